// The FP8 tile explorer (tutorial_lib.viz.fp8_tiles): buttons pick a token, a tile and a
// scaling; the SVG is redrawn from D (the JSON island), where Python computed every number.
function startTileExplorer(root, D) {
  var svg = root.querySelector("svg"), stats = root.querySelector(".tl-fp8-stats");
  var hover = root.querySelector(".tl-fp8-hover");
  var W = 940, PLOT = 170, ERR = 46, LEFT = 44;
  var state = {token: 0, tile: 0, mode: D.modes[0][0]};
  function el(name, attrs, text) { return svgElement(svg, name, attrs, text); }
  function fmt(v) { return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toPrecision(4); }
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
  function draw() {
    root.dataset.token = state.token; root.dataset.tile = state.tile; root.dataset.mode = state.mode;
    root.querySelectorAll(".tl-fp8-tokens button").forEach(function (b, i) { b.classList.toggle("tl-on", i === state.token); });
    root.querySelectorAll(".tl-fp8-tilebtns button").forEach(function (b, i) { b.classList.toggle("tl-on", i === state.tile); });
    root.querySelectorAll(".tl-fp8-modes button").forEach(function (b) { b.classList.toggle("tl-on", b.dataset.value === state.mode); });
    var cell = D.cells[state.token + "," + state.tile], m = cell[state.mode];
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var amax = 0; cell.x.forEach(function (v) { amax = Math.max(amax, Math.abs(v)); });
    amax = amax || 1;
    var bw = (W - LEFT) / D.tile, mid = PLOT / 2 + 8;
    svg.appendChild(el("text", {x: 2, y: 14, "font-size": 11, fill: "#57606a"}, "value"));
    svg.appendChild(el("text", {x: 2, y: mid + 4, "font-size": 11, fill: "#57606a"}, "0"));
    svg.appendChild(el("line", {x1: LEFT, x2: W, y1: mid, y2: mid, stroke: "#d0d7de"}));
    var errTop = PLOT + 30, maxRel = 0;
    var rels = cell.x.map(function (v, i) { var r = v === 0 ? 0 : Math.abs(m.x_hat[i] - v) / Math.abs(v); maxRel = Math.max(maxRel, r); return r; });
    svg.appendChild(el("text", {x: 2, y: errTop + 14, "font-size": 11, fill: "#57606a"}, "rel. err"));
    cell.x.forEach(function (v, i) {
      var x0 = LEFT + i * bw, h = (v / amax) * (PLOT / 2 - 10), hat = (m.x_hat[i] / amax) * (PLOT / 2 - 10);
      var small = Math.abs(m.q[i]) < D.min_normal;
      var bar = el("rect", {x: x0 + 0.5, width: Math.max(bw - 1, 1), y: h >= 0 ? mid - h : mid, height: Math.max(Math.abs(h), 0.5),
        fill: small ? "#e15759" : (v >= 0 ? "#4e79a7" : "#f28e2b"), opacity: 0.75});
      bar.classList.add("tl-fp8-bar");
      bar.addEventListener("mouseenter", function () {
        hover.textContent = "channel " + (state.tile * D.tile + i) + ": x = " + fmt(v) + ", x / scale = " + fmt(v / m.scale) +
          " -> E4M3 " + fmt(m.q[i]) + " -> " + fmt(m.x_hat[i]) + " (error " + (100 * rels[i]).toFixed(2) + " %)";
      });
      svg.appendChild(bar);
      svg.appendChild(el("line", {x1: x0, x2: x0 + bw, y1: mid - hat, y2: mid - hat, stroke: "#1b1f24", "stroke-width": 1.5}));
      var shade = Math.min(rels[i] * 17, 1);
      svg.appendChild(el("rect", {x: x0 + 0.5, y: errTop, width: Math.max(bw - 1, 1), height: ERR - 10,
        fill: rels[i] > 1 / 17 + 1e-9 ? "#e15759" : "rgba(78,121,167," + (0.08 + 0.92 * shade).toFixed(3) + ")"}));
    });
    svg.appendChild(el("text", {x: LEFT, y: errTop + ERR + 6, "font-size": 11, fill: "#57606a"},
      "darker: closer to the 1/17 bound of normal values; red: worse (below E4M3's normal range, or flushed to zero)"));
    var cells = [["amax", fmt(m.amax)], ["scale = amax / 448" + (state.mode === "1x128_pow2" ? ", rounded up to 2^k" : ""), fmt(m.scale)],
      ["amax / scale", fmt(m.amax / m.scale)], ["max relative error", (100 * maxRel).toFixed(2) + " %"],
      ["relative Frobenius error", (100 * m.rel_fro).toFixed(2) + " %"], ["values flushed to zero", String(m.zeros)]];
    stats.innerHTML = "";
    cells.forEach(function (c) { var d = document.createElement("div"); d.innerHTML = c[0] + ": <b>" + c[1] + "</b>"; stats.appendChild(d); });
  }
  draw();
}
