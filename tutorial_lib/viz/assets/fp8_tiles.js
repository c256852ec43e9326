// The FP8 tile explorer (tutorial_lib.viz.fp8_tiles): buttons pick a token, a tile and a
// scaling; the SVG is redrawn from D (the JSON island), where Python computed every number.
// The drawing takes the width the page gives it (all 128 channels, whatever the screen) and
// is drawn again when that width changes; text keeps its size.
function startTileExplorer(root, D) {
  var svg = root.querySelector("svg"), stats = root.querySelector(".tl-fp8-stats");
  svg.setAttribute("data-text-sized", "1");  // drawn at the column's width: widget.js leaves it
  var hover = root.querySelector(".tl-fp8-hover");
  var PLOT = 170, ERR = 36, LEFT = 58, RIGHT = 8, TOP = 10, FONT = 11;
  var state = {token: 0, tile: 0, mode: D.modes[0][0]}, drawnWidth = 0;
  function el(name, attrs, text) { return svgElement(svg, name, attrs, text); }
  function fmt(v) {
    return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toPrecision(4);
  }
  function tick(v) {  // a short axis label
    if (v === 0) return "0";
    return Math.abs(v) >= 1e4 || Math.abs(v) < 1e-2 ? v.toExponential(1) : String(Number(v.toPrecision(3)));
  }
  function buttons(where, pairs, key) {
    var box = root.querySelector(where);
    pairs.forEach(function (pair) {
      var b = document.createElement("button");
      b.textContent = pair[1];
      b.dataset.value = String(pair[0]);
      b.addEventListener("click", function () {
        state[key] = key === "mode" ? b.dataset.value : parseInt(b.dataset.value, 10); draw();
      });
      box.appendChild(b);
    });
  }
  buttons(".tl-fp8-tokens", D.tokens.map(function (n, i) { return [i, n]; }), "token");
  var tileLabels = [];
  for (var j = 0; j < D.tiles; j++) tileLabels.push([j, "channels " + (j * D.tile) + "-" + ((j + 1) * D.tile - 1)]);
  buttons(".tl-fp8-tilebtns", tileLabels, "tile");
  buttons(".tl-fp8-modes", D.modes, "mode");
  function width() {  // the drawing's width: the root's content box
    var style = window.getComputedStyle(root);
    var inner = root.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return Math.max(Math.floor(inner) || 720, LEFT + RIGHT + D.tile);  // at least 1 px a channel
  }
  function draw() {
    root.dataset.token = state.token; root.dataset.tile = state.tile; root.dataset.mode = state.mode;
    root.querySelectorAll(".tl-fp8-tokens button").forEach(function (b, i) { b.classList.toggle("tl-on", i === state.token); });
    root.querySelectorAll(".tl-fp8-tilebtns button").forEach(function (b, i) { b.classList.toggle("tl-on", i === state.tile); });
    root.querySelectorAll(".tl-fp8-modes button").forEach(function (b) { b.classList.toggle("tl-on", b.dataset.value === state.mode); });
    var cell = D.cells[state.token + "," + state.tile], m = cell[state.mode];
    var W = width(), errTop = TOP + PLOT + 14, H = errTop + ERR + 28;
    drawnWidth = W;
    svg.setAttribute("width", W); svg.setAttribute("height", H);
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var amax = 0; cell.x.forEach(function (v) { amax = Math.max(amax, Math.abs(v)); });
    amax = amax || 1;
    var bw = (W - LEFT - RIGHT) / D.tile, mid = TOP + PLOT / 2, half = PLOT / 2 - 4;
    function yOf(v) { return mid - (v / amax) * half; }
    // the value axis: ticks at -amax, -amax/2, 0, amax/2, amax, with their values
    [-1, -0.5, 0, 0.5, 1].forEach(function (f) {
      var y = yOf(f * amax);
      svg.appendChild(el("line", {x1: LEFT - 4, x2: W - RIGHT, y1: y, y2: y,
        stroke: f === 0 ? "#afb8c1" : "#eaeef2"}));
      var label = el("text", {x: LEFT - 6, y: y + 4, "font-size": FONT, fill: "#57606a", "text-anchor": "end"}, tick(f * amax));
      label.classList.add("tl-fp8-tick");
      svg.appendChild(label);
    });
    svg.appendChild(el("line", {x1: LEFT - 1, x2: LEFT - 1, y1: TOP, y2: TOP + PLOT, stroke: "#afb8c1"}));
    var maxRel = 0;
    var rels = cell.x.map(function (v, i) { var r = v === 0 ? 0 : Math.abs(m.x_hat[i] - v) / Math.abs(v); maxRel = Math.max(maxRel, r); return r; });
    svg.appendChild(el("text", {x: 2, y: errTop + ERR / 2 + 4, "font-size": FONT, fill: "#57606a"}, "rel. err"));
    cell.x.forEach(function (v, i) {
      var x0 = LEFT + i * bw, small = Math.abs(m.q[i]) < D.min_normal;
      var top = v >= 0 ? yOf(v) : mid, h = Math.max(Math.abs(yOf(v) - mid), 0.5);
      var bar = el("rect", {x: x0 + 0.15 * bw, width: Math.max(0.7 * bw, 0.8), y: top, height: h,
        fill: small ? "#e15759" : (v >= 0 ? "#4e79a7" : "#f28e2b"), opacity: 0.75});
      bar.classList.add("tl-fp8-bar");
      bar.dataset.channel = String(state.tile * D.tile + i);
      bar.addEventListener("mouseenter", function () {
        hover.textContent = "channel " + (state.tile * D.tile + i) + ": x = " + fmt(v) + ", x / scale = " + fmt(v / m.scale) +
          " -> E4M3 " + fmt(m.q[i]) + " -> " + fmt(m.x_hat[i]) + " (error " + (100 * rels[i]).toFixed(2) + " %)";
      });
      svg.appendChild(bar);
      var yHat = yOf(m.x_hat[i]);
      svg.appendChild(el("line", {x1: x0, x2: x0 + bw, y1: yHat, y2: yHat, stroke: "#1b1f24", "stroke-width": 1.5}));
      var shade = Math.min(rels[i] * 17, 1);
      svg.appendChild(el("rect", {x: x0, y: errTop, width: Math.max(bw, 0.8), height: ERR,
        fill: rels[i] > 1 / 17 + 1e-9 ? "#e15759" : "rgba(78,121,167," + (0.08 + 0.92 * shade).toFixed(3) + ")"}));
    });
    // the channel axis: every 32nd channel of the tile, and its last
    [0, 32, 64, 96, D.tile - 1].forEach(function (i) {
      var x = LEFT + (i + 0.5) * bw;
      svg.appendChild(el("line", {x1: x, x2: x, y1: errTop + ERR, y2: errTop + ERR + 4, stroke: "#afb8c1"}));
      var label = el("text", {x: x, y: errTop + ERR + 16, "font-size": FONT, fill: "#57606a",
        "text-anchor": i === D.tile - 1 ? "end" : (i === 0 ? "start" : "middle")}, String(state.tile * D.tile + i));
      label.classList.add("tl-fp8-channel");
      svg.appendChild(label);
    });
    svg.appendChild(el("text", {x: 2, y: errTop + ERR + 16, "font-size": FONT, fill: "#57606a"}, "channel"));
    var cells = [["amax", fmt(m.amax)], ["scale = amax / 448" + (state.mode === "1x128_pow2" ? ", rounded up to 2^k" : ""), fmt(m.scale)],
      ["amax / scale", fmt(m.amax / m.scale)], ["max relative error", (100 * maxRel).toFixed(2) + " %"],
      ["relative Frobenius error", (100 * m.rel_fro).toFixed(2) + " %"], ["values flushed to zero", String(m.zeros)]];
    stats.innerHTML = "";
    cells.forEach(function (c) { var d = document.createElement("div"); d.innerHTML = c[0] + ": <b>" + c[1] + "</b>"; stats.appendChild(d); });
  }
  draw();
  function redrawIfResized() { if (width() !== drawnWidth) draw(); }
  if (window.ResizeObserver) { new ResizeObserver(redrawIfResized).observe(root); }
  window.addEventListener("resize", redrawIfResized);
}
