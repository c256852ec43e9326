"""A 1x128 FP8 tile up close: its values, its scale, what E4M3 makes of them, and the error.

    tile_explorer(x)            # x: [tokens, hidden], hidden a multiple of 128 (a few tokens)

The reader picks a token, one of its tiles and a scaling (``1x128``, ``1x128, power-of-two
scale``, ``per-tensor``).  The widget draws the tile's 128 values as bars, each value after
the FP8 round trip as a tick, and below them each channel's relative error; beside it the
tile's amax, its scale and the errors.  Every number is computed here by
:mod:`tutorial_lib.fp8` (the library's own quantizer); the page only draws them.  Hover a bar
for its channel.  Self-contained HTML (inline SVG, CSS and script, no CDN), so it works in the
static book.
"""
from __future__ import annotations

import html
import json
import uuid

import torch

from .. import fp8
from .colors import SANS

__all__ = ["tile_explorer", "TileExplorer", "tile_data"]

MODES = (("1x128", "1x128 tiles"), ("1x128_pow2", "1x128, power-of-two scale"),
         ("per_tensor", "one scale per tensor"))
MAX_TOKENS, MAX_TILES = 6, 8


def _round(v: float, digits: int = 6) -> float:
    return float(f"{v:.{digits}g}")


def tile_data(x: torch.Tensor, token_names: list[str] | None = None) -> dict:
    """Everything the widget draws: per token, tile and mode, the FP8 values and the scale."""
    if x.dim() != 2:
        raise ValueError(f"tile_explorer takes [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    tiles = fp8.num_tiles(hidden)  # refuses a hidden size that is not a multiple of 128
    if tokens > MAX_TOKENS or tiles > MAX_TILES:
        raise ValueError(f"tile_explorer shows at most {MAX_TOKENS} tokens of {MAX_TILES} tiles "
                         f"(hidden {MAX_TILES * fp8.TILE}); got {tokens} tokens of {tiles} tiles: "
                         f"pass a slice such as x[:{MAX_TOKENS}, :{MAX_TILES * fp8.TILE}]")
    x = x.float()
    quantized = {}
    for mode, _ in MODES:
        if mode == "per_tensor":
            q, scale = fp8.quantize_per_tensor(x)
            scales = scale.expand(tokens, tiles)
        else:
            q, scales = fp8.quantize_1x128(x, pow2=mode == "1x128_pow2")
        quantized[mode] = (q.float(), scales, fp8.dequantize_1x128(q, scales))
    names = token_names or [f"token {t}" for t in range(tokens)]
    out = {"tile": fp8.TILE, "max": fp8.E4M3_MAX, "min_normal": fp8.E4M3_MIN_NORMAL,
           "tokens": names, "tiles": tiles, "modes": [list(m) for m in MODES], "cells": {}}
    for t in range(tokens):
        for j in range(tiles):
            cols = slice(j * fp8.TILE, (j + 1) * fp8.TILE)
            values = x[t, cols]
            cell = {"x": [_round(v) for v in values.tolist()]}
            for mode, _ in MODES:
                q, scales, x_hat = quantized[mode]
                err = x_hat[t, cols] - values
                cell[mode] = {
                    "q": q[t, cols].tolist(),  # E4M3 values: short and exact as they are
                    "x_hat": [_round(v) for v in x_hat[t, cols].tolist()],
                    "scale": _round(scales[t, j].item(), 8),
                    "amax": _round(values.abs().max().item()),
                    "rel_fro": _round(((err.norm() / values.norm()).item()
                                       if values.norm() > 0 else 0.0), 4),
                    "zeros": int(((q[t, cols] == 0) & (values != 0)).sum()),
                }
            out["cells"][f"{t},{j}"] = cell
    return out


_CSS = """
#UID { font-family: SANS; font-size: 13px; color: #1b1f24; background: #ffffff;
  border: 1px solid #d0d7de; border-radius: 8px; padding: 12px 14px; max-width: 980px; }
#UID .tl-fp8-title { font-weight: 600; margin-bottom: 6px; }
#UID .tl-fp8-row { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 4px 0; }
#UID .tl-fp8-row span.tl-fp8-label { min-width: 4.5em; color: #57606a; }
#UID button { font: inherit; font-size: 12.5px; padding: 3px 10px; border: 1px solid #c4cbd3;
  border-radius: 6px; background: #f6f8fa; color: #1b1f24; cursor: pointer; margin: 0; }
#UID button.tl-on { background: #1b1f24; color: #ffffff; border-color: #1b1f24; }
#UID .tl-fp8-stats { display: grid; grid-template-columns: repeat(3, minmax(180px, 1fr));
  gap: 2px 18px; margin-top: 6px; font-variant-numeric: tabular-nums; }
#UID .tl-fp8-stats b { font-weight: 600; }
#UID .tl-fp8-hover { min-height: 1.4em; color: #57606a; margin-top: 4px; font-variant-numeric: tabular-nums; }
#UID svg { display: block; margin-top: 6px; }
"""

_JS = r"""
(function () {
  var root = document.getElementById("UID");
  var D = JSON.parse(root.querySelector("script.tl-fp8-data").textContent);
  var svg = root.querySelector("svg"), stats = root.querySelector(".tl-fp8-stats");
  var hover = root.querySelector(".tl-fp8-hover");
  var NS = "http://www.w3.org/2000/svg", W = 940, PLOT = 170, ERR = 46, LEFT = 44;
  var state = {token: 0, tile: 0, mode: D.modes[0][0]};
  function el(name, attrs, text) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
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
})();
"""


class TileExplorer:
    """The widget: ``_repr_html_`` for notebooks, :meth:`to_html` for a page."""

    def __init__(self, data: dict, title: str = ""):
        self.data, self.title = data, title

    def to_html(self) -> str:
        uid = "tl-fp8-" + uuid.uuid4().hex[:12]
        payload = json.dumps(self.data, separators=(",", ":")).replace("</", "<\\/")
        title = html.escape(self.title or "One FP8 tile: values, scale and error")
        return (f'<div class="tl-fp8-tiles" id="{uid}" data-token="0" data-tile="0" data-mode="1x128">'
                f"<style>{_CSS.replace('UID', uid).replace('SANS', SANS)}</style>"
                f'<div class="tl-fp8-title">{title}</div>'
                f'<div class="tl-fp8-row"><span class="tl-fp8-label">token</span>'
                f'<span class="tl-fp8-tokens tl-fp8-row"></span></div>'
                f'<div class="tl-fp8-row"><span class="tl-fp8-label">tile</span>'
                f'<span class="tl-fp8-tilebtns tl-fp8-row"></span></div>'
                f'<div class="tl-fp8-row"><span class="tl-fp8-label">scaling</span>'
                f'<span class="tl-fp8-modes tl-fp8-row"></span></div>'
                f'<svg width="940" height="260" viewBox="0 0 940 260" role="img" '
                f'aria-label="the values of one tile before and after FP8"></svg>'
                f'<div class="tl-fp8-hover">hover a bar: bars are the values, black ticks the '
                f'values after FP8 and back</div><div class="tl-fp8-stats"></div>'
                f'<script type="application/json" class="tl-fp8-data">{payload}</script>'
                f"<script>{_JS.replace('UID', uid)}</script></div>")

    def _repr_html_(self) -> str:
        return self.to_html()


def tile_explorer(x: torch.Tensor, token_names: list[str] | None = None,
                  title: str = "") -> TileExplorer:
    """The widget for ``x [tokens, hidden]`` (at most 6 tokens of 8 tiles)."""
    return TileExplorer(tile_data(x, token_names), title)
