// The memory explorer (tutorial_lib.viz.memory_explorer): buttons pick a preset and a layout; the
// bars are redrawn from D (the JSON island), where Python computed every number.
// ASCII only.
function startMemoryExplorer(root, D) {
  var svg = root.querySelector("svg"), summary = root.querySelector(".tl-mem-summary");
  var COLORS = ["#4e79a7", "#9c755f", "#f28e2b", "#59a14f", "#e15759"];
  var state = {preset: D.presets[0].name, tp: 1, pp: 16, ep: D.presets[0].ep[D.presets[0].ep.length - 1],
               zero: 1, recompute: "none", budget: D.budgets[1]};
  function el(name, attrs, text) { return svgElement(svg, name, attrs, text); }
  function gib(mib) { return (mib / 1024).toFixed(mib >= 10240 ? 0 : 1) + " GiB"; }
  function preset() { return D.presets.filter(function (p) { return p.name === state.preset; })[0]; }
  function buttons(where, pairs, key, numeric) {
    var box = root.querySelector(".tl-mem-" + where);
    box.innerHTML = "";
    pairs.forEach(function (pair) {
      var b = document.createElement("button");
      b.textContent = pair[1];
      b.dataset.value = String(pair[0]);
      b.addEventListener("click", function () {
        state[key] = numeric ? parseInt(b.dataset.value, 10) : b.dataset.value;
        if (key === "preset") {  // EP sizes differ between presets
          var eps = preset().ep;
          if (eps.indexOf(state.ep) < 0) state.ep = eps[eps.length - 1];
          controls();
        }
        draw();
      });
      box.appendChild(b);
    });
  }
  function same(list) { return list.map(function (v) { return [v, String(v)]; }); }
  function controls() {
    buttons("preset", D.presets.map(function (p) { return [p.name, p.name]; }), "preset", false);
    buttons("tp", same(D.grid.tp), "tp", true);
    buttons("pp", same(D.grid.pp), "pp", true);
    buttons("ep", same(preset().ep), "ep", true);
    buttons("zero", D.grid.zero.map(function (z, i) { return [z, D.zero_labels[i]]; }), "zero", true);
    buttons("recompute", same(D.grid.recompute), "recompute", false);
    buttons("budget", D.budgets.map(function (b) { return [b, b + " GiB"]; }), "budget", true);
  }
  function mark() {
    ["preset", "tp", "pp", "ep", "zero", "recompute", "budget"].forEach(function (key) {
      root.querySelectorAll(".tl-mem-" + key + " button").forEach(function (b) {
        b.classList.toggle("tl-on", b.dataset.value === String(state[key]));
      });
    });
  }
  function draw() {
    mark();
    var key = [state.preset, state.tp, state.pp, state.ep, state.zero, state.recompute].join("|");
    var result = D.results[key], budget = state.budget * 1024;
    root.dataset.key = key;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (result.error !== undefined) {
      root.dataset.fits = "refused";
      summary.textContent = "The course refuses this layout: " + D.errors[result.error];
      svg.setAttribute("height", 10);
      return;
    }
    var totals = result.ranks.map(function (r) { return r.reduce(function (a, b) { return a + b; }, 0); });
    var heaviest = 0;
    totals.forEach(function (t, i) { if (t > totals[heaviest]) heaviest = i; });
    var fits = totals[heaviest] <= budget;
    root.dataset.fits = fits ? "yes" : "no";
    root.dataset.heaviest = String(heaviest);
    root.dataset.heaviestMib = String(totals[heaviest]);
    summary.innerHTML = "";
    var line = document.createElement("div");
    line.textContent = preset().world + " GPUs = TP " + state.tp + " x PP " + state.pp + " x DP " +
      result.dp + " (EP " + state.ep + "), " + result.m + " microbatches of one sequence. Heaviest: pipeline rank " +
      heaviest + ", " + gib(totals[heaviest]) + ": ";
    var verdict = document.createElement("span");
    verdict.className = fits ? "tl-mem-yes" : "tl-mem-no";
    verdict.textContent = fits ? "fits in " + state.budget + " GiB" : "does not fit in " + state.budget + " GiB";
    line.appendChild(verdict);
    summary.appendChild(line);
    // Drawn at the width of its box, one unit a pixel, so that a phone's 356 px get the
    // bars and their 11 px labels whole instead of a 720-unit picture to scroll.
    var LEFT = 44, RIGHT = 62, TOP = 6, ROW = 16, GAP = 4, W = boxWidth();
    drawnAt = W;
    svg.setAttribute("width", W);
    var H = TOP + result.ranks.length * (ROW + GAP) + 24;
    svg.setAttribute("height", H); svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var scale = (W - LEFT - RIGHT) / Math.max(budget, totals[heaviest]);
    result.ranks.forEach(function (r, i) {
      var y = TOP + i * (ROW + GAP), x = LEFT;
      svg.appendChild(el("text", {x: LEFT - 6, y: y + ROW - 4, "text-anchor": "end", "font-size": 11}, "PP " + i));
      r.forEach(function (v, j) {
        var w = v * scale;
        var rect = el("rect", {x: x, y: y, width: Math.max(w, 0), height: ROW, fill: COLORS[j],
                               "class": "tl-mem-bar", "data-part": D.parts[j], "data-mib": v});
        rect.appendChild(el("title", {}, "pipeline rank " + i + ": " + D.parts[j] + " " + gib(v)));
        svg.appendChild(rect);
        x += w;
      });
      svg.appendChild(el("text", {x: x + 4, y: y + ROW - 4, "font-size": 11}, gib(totals[i])));
    });
    var bx = LEFT + budget * scale, bottom = TOP + result.ranks.length * (ROW + GAP);
    svg.appendChild(el("line", {x1: bx, x2: bx, y1: TOP - 4, y2: bottom, stroke: "#1b1f24",
                                "stroke-dasharray": "4 3", "class": "tl-mem-budget"}));
    svg.appendChild(el("text", {x: bx, y: bottom + 14, "text-anchor": "middle", "font-size": 11},
                       state.budget + " GiB"));
  }
  function boxWidth() {  // the content width of the svg's box, 240 to 720 px
    var box = svg.parentNode, style = window.getComputedStyle(box);
    var w = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return w > 0 ? Math.max(240, Math.min(720, Math.floor(w))) : 720;
  }
  var drawnAt = 0;
  svg.setAttribute("data-text-sized", "");  // widget.js: its labels keep their size
  window.addEventListener("resize", function () { if (boxWidth() !== drawnAt) { draw(); } });
  var legend = root.querySelector(".tl-mem-legend");
  D.parts.forEach(function (p, j) {
    var i = document.createElement("i"); i.style.background = COLORS[j];
    legend.appendChild(i); legend.appendChild(document.createTextNode(p));
  });
  controls();
  draw();
}
