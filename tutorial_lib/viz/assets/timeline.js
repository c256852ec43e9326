// A timeline (tutorial_lib.viz.timeline): tooltips, drag-to-zoom, and a cursor swept
// by the player.  D (the JSON island) holds the domain, the layout numbers, the
// tooltips and the player's frames; the bars are in the SVG Python drew.
function startTimeline(root, D) {
  var svg = root.querySelector("svg.tl-chart");
  var tip = root.querySelector(".tl-tooltip");
  var caption = root.querySelector(".tl-anim-caption");
  var axis = root.querySelector(".tl-axis");
  var cursorG = root.querySelector(".tl-cursor");
  var brush = root.querySelector(".tl-brush");
  var reset = root.querySelector(".tl-zoom-reset");
  var nodes = root.querySelectorAll(".tl-bar");
  var bars = [];
  for (var i = 0; i < nodes.length; i++) {
    var g = nodes[i], label = g.querySelector(".tl-label");
    // A pipeline bar may carry a short label (its microbatch) for when the full one
    // ("F3.1") does not fit: data-label holds the full text, data-short the short one.
    var full = g.getAttribute("data-label") || label.textContent, short = g.getAttribute("data-short") || "";
    bars.push({g: g, s: parseFloat(g.getAttribute("data-s")), e: parseFloat(g.getAttribute("data-e")),
               ghost: g.querySelector(".tl-ghost"), solid: g.querySelector(".tl-solid"),
               label: label, full: full, short: short, lw: full.length * D.charw + 8,
               sw: short.length * D.charw + D.shortpad});
  }
  var view = [D.d0, D.d1], cursor = null;
  function X(t) { return D.x0 + (t - view[0]) * D.pw / (view[1] - view[0]); }
  function T(x) { return view[0] + (x - D.x0) * (view[1] - view[0]) / D.pw; }
  function niceStep(span, target) {  // mirrors _nice_step in Python
    var raw = span / Math.max(target, 1), p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
  }
  function drawAxis() {
    while (axis.firstChild) { axis.removeChild(axis.firstChild); }
    var step = niceStep(view[1] - view[0], D.pw / D.spacing);
    var dec = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    for (var k = Math.ceil(view[0] / step - 1e-9); k * step <= view[1] + 1e-9 * step; k++) {
      var v = k * step, x = X(v).toFixed(1);
      if (Math.abs(v) < step * 1e-9) { v = 0; }
      axis.appendChild(svgElement(svg, "line", {x1: x, x2: x, y1: D.top - 5, y2: D.bottom - 4,
                                                stroke: "#e3e7eb", "stroke-width": 1}));
      axis.appendChild(svgElement(svg, "text", {x: x, y: D.top - 12, "font-size": 11,
                                                "text-anchor": "middle", fill: "#57606a"},
                                  v.toFixed(dec)));
    }
  }
  function layout() {
    var left = D.x0, right = D.x0 + D.pw;
    for (var i = 0; i < bars.length; i++) {
      var b = bars[i], xs = X(b.s), xe = X(b.e);
      var w = Math.max(D.minw, xe - xs);
      if (b.ghost) { b.ghost.setAttribute("x", xs.toFixed(2)); b.ghost.setAttribute("width", w.toFixed(2)); }
      var reached = cursor === null ? b.e : Math.min(b.e, Math.max(b.s, cursor));
      var hidden = cursor !== null && cursor < b.s;
      var xr = X(reached), ws = Math.max(D.minw, xr - xs);
      b.solid.setAttribute("x", xs.toFixed(2));
      b.solid.setAttribute("width", ws.toFixed(2));
      b.solid.setAttribute("display", hidden ? "none" : "inline");
      var vis0 = Math.max(xs, left), vis1 = Math.min(xr, right);
      var fits = !hidden && b.full.length > 0 && vis1 - vis0 >= b.lw;
      var shortFits = !fits && !hidden && b.short.length > 0 && vis1 - vis0 >= b.sw;
      if (b.short) { b.label.textContent = shortFits ? b.short : b.full; }
      b.label.setAttribute("x", (vis0 + (shortFits ? 1.5 : 4)).toFixed(2));
      b.label.setAttribute("display", fits || shortFits ? "inline" : "none");
      var on = cursor !== null && b.s <= cursor && cursor < b.e;
      if (on) { b.g.classList.add("tl-on"); } else { b.g.classList.remove("tl-on"); }
    }
    if (cursor === null || cursor < view[0] || cursor > view[1]) {
      cursorG.setAttribute("display", "none");
    } else {
      cursorG.setAttribute("display", "inline");
      cursorG.setAttribute("transform", "translate(" + X(cursor).toFixed(2) + ",0)");
    }
    drawAxis();
    root.setAttribute("data-zoom", view[0].toFixed(3) + " " + view[1].toFixed(3));
    if (reset) { reset.disabled = (view[0] === D.d0 && view[1] === D.d1); }
  }

  // --- tooltip ---
  function showTip(i, ev) {
    var t = D.tips[i];
    while (tip.firstChild) { tip.removeChild(tip.firstChild); }
    var head = document.createElement("div");
    head.className = "tl-tip-title";
    head.textContent = t[0];
    tip.appendChild(head);
    var table = document.createElement("table");
    for (var r = 0; r < t[1].length; r++) {
      var tr = document.createElement("tr"), a = document.createElement("td"), b = document.createElement("td");
      a.className = "tl-tip-key"; a.textContent = t[1][r][0]; b.textContent = t[1][r][1];
      tr.appendChild(a); tr.appendChild(b); table.appendChild(tr);
    }
    tip.appendChild(table);
    tip.style.display = "block";
    moveTip(ev);
  }
  function moveTip(ev) {
    // Inside the root, beside the pointer; flipped left or up where it would spill out.
    var box = root.getBoundingClientRect(), w = tip.offsetWidth, h = tip.offsetHeight;
    var px = ev.clientX - box.left, py = ev.clientY - box.top;
    var x = px + 14, y = py + 16;
    if (x + w > box.width - 4) { x = Math.max(4, px - w - 14); }
    if (y + h > box.height - 4) { y = Math.max(4, py - h - 12); }
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function barOf(target) {
    while (target && target !== svg) {
      if (target.classList && target.classList.contains("tl-bar")) { return target; }
      target = target.parentNode;
    }
    return null;
  }
  // Pointer events: a mouse hovers for a tooltip and drags to zoom; a finger (or pen)
  // taps a bar for its tooltip, taps it again or taps elsewhere to close it, and its drags
  // scroll the page as usual.  (With mouse events, a tap showed the tooltip on the
  // emulated mouseover and hid it on the mousedown that follows.)
  var dragging = false, dragX = 0, tapped = null, downAt = null;
  function hideTip() { tip.style.display = "none"; tapped = null; }
  svg.addEventListener("pointerover", function (ev) {
    if (ev.pointerType !== "mouse") { return; }
    var g = barOf(ev.target);
    if (g && !dragging) { showTip(parseInt(g.getAttribute("data-i"), 10), ev); }
  });
  svg.addEventListener("pointermove", function (ev) {
    if (ev.pointerType === "mouse" && tip.style.display !== "none") { moveTip(ev); }
  });
  svg.addEventListener("pointerout", function (ev) {
    if (ev.pointerType !== "mouse") { return; }
    var g = barOf(ev.target);
    if (g && barOf(ev.relatedTarget) !== g) { hideTip(); }
  });
  svg.addEventListener("pointerup", function (ev) {
    if (ev.pointerType === "mouse" || downAt === null) { return; }
    var moved = Math.abs(ev.clientX - downAt[0]) + Math.abs(ev.clientY - downAt[1]);
    downAt = null;
    if (moved > 10) { return; }  // a swipe, not a tap
    var g = barOf(ev.target);
    if (!g || g === tapped) { hideTip(); return; }
    showTip(parseInt(g.getAttribute("data-i"), 10), ev);
    tapped = g;
  });
  document.addEventListener("pointerdown", function (ev) {  // a tap outside closes it
    if (ev.pointerType !== "mouse" && tapped !== null && !svg.contains(ev.target)) { hideTip(); }
  });

  // --- zoom: drag across the chart; double-click or Reset zoom goes back ---
  function svgX(ev) {
    var box = svg.getBoundingClientRect();
    return (ev.clientX - box.left) * svg.viewBox.baseVal.width / box.width;
  }
  function clampX(x) { return Math.max(D.x0, Math.min(D.x0 + D.pw, x)); }
  svg.addEventListener("pointerdown", function (ev) {
    if (ev.pointerType !== "mouse") { downAt = [ev.clientX, ev.clientY]; return; }
    if (ev.button !== 0) { return; }
    var x = svgX(ev);
    if (x < D.x0 || x > D.x0 + D.pw) { return; }
    dragging = true; dragX = x;
    brush.setAttribute("x", x.toFixed(1)); brush.setAttribute("width", "0");
    brush.setAttribute("display", "inline");
    hideTip();
    ev.preventDefault();
  });
  window.addEventListener("pointermove", function (ev) {
    if (!dragging) { return; }
    var x = clampX(svgX(ev));
    brush.setAttribute("x", Math.min(x, dragX).toFixed(1));
    brush.setAttribute("width", Math.abs(x - dragX).toFixed(1));
  });
  window.addEventListener("pointerup", function (ev) {
    if (!dragging) { return; }
    dragging = false;
    brush.setAttribute("display", "none");
    var x = clampX(svgX(ev));
    if (Math.abs(x - dragX) < 6) { return; }
    var a = T(Math.min(x, dragX)), b = T(Math.max(x, dragX));
    view = [a, b];
    layout();
  });
  function resetZoom() { view = [D.d0, D.d1]; layout(); }
  svg.addEventListener("dblclick", resetZoom);
  if (reset) { reset.addEventListener("click", resetZoom); }

  // --- the player: frame 0 is the overview, frames 1..n-1 sweep the cursor ---
  if (root.querySelector(".tl-play")) {
    var counter = root.querySelector(".tl-anim-counter");
    player(root, D.times.length, D.interval, function (i) {
      cursor = D.times[i];
      caption.textContent = D.captions[i];
      counter.textContent = i === 0 ? "overview" : (cursor.toFixed(2) + " " + D.unit);
      layout();
    }, 1);
  }
  // On a touch screen the notes say "tap", and leave out the drag that only a mouse does.
  if (window.matchMedia && window.matchMedia("(hover: none)").matches) {
    var notes = root.querySelectorAll(".tl-anim-caption, .tl-anim-note");
    for (var n = 0; n < notes.length; n++) {
      notes[n].textContent = notes[n].textContent
        .replace(/([,;]\s*)?drag across the chart to zoom( into a time range)?/g, "")
        .replace(/\bhover a bar\b/g, "tap a bar").replace(/\bHover a bar\b/g, "Tap a bar");
    }
    if (D.captions) { D.captions[0] = caption.textContent; }
  }
  layout();
}
