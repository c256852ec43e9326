"""A 1x128 FP8 tile up close: its values, its scale, what E4M3 makes of them, and the error.

    tile_explorer(x)            # x: [tokens, hidden], hidden a multiple of 128 (a few tokens)

The reader picks a token, one of its tiles and a scaling (``1x128``, ``1x128, power-of-two
scale``, ``per-tensor``).  The widget draws the tile's 128 values as bars on a value axis
with its scale (ticks at 0, half the tile's amax and its amax, either sign), each value
after the FP8 round trip as a tick, below them each channel's relative error and the
channel numbers; under it the tile's amax, its scale and the errors.  The drawing takes
the width of its column, whatever the screen, and shows all 128 channels of the tile.  Every number is computed here by
:mod:`tutorial_lib.fp8_format` (the library's own quantizer); the page only draws them.  Hover a bar
for its channel.  Self-contained HTML (inline SVG, CSS and script, no CDN), so it works in the
static book.
"""
from __future__ import annotations

import html

import torch

from .. import fp8_format
from .widget import Explorer

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
    tiles = fp8_format.num_tiles(hidden)  # refuses a hidden size that is not a multiple of 128
    if tokens > MAX_TOKENS or tiles > MAX_TILES:
        widest = MAX_TILES * fp8_format.TILE
        raise ValueError(f"tile_explorer shows at most {MAX_TOKENS} tokens of {MAX_TILES} tiles "
                         f"(hidden {widest}); got {tokens} tokens of {tiles} tiles: "
                         f"pass a slice such as x[:{MAX_TOKENS}, :{widest}]")
    x = x.float()
    quantized = {}
    for mode, _ in MODES:
        if mode == "per_tensor":
            q, scale = fp8_format.quantize_per_tensor(x)
            scales = scale.expand(tokens, tiles)
        else:
            q, scales = fp8_format.quantize_1x128(x, pow2=mode == "1x128_pow2")
        quantized[mode] = (q.float(), scales, fp8_format.dequantize_1x128(q, scales))
    names = token_names or [f"token {t}" for t in range(tokens)]
    out = {"tile": fp8_format.TILE, "max": fp8_format.E4M3_MAX,
           "min_normal": fp8_format.E4M3_MIN_NORMAL,
           "tokens": names, "tiles": tiles, "modes": [list(m) for m in MODES], "cells": {}}
    for t in range(tokens):
        for j in range(tiles):
            cols = slice(j * fp8_format.TILE, (j + 1) * fp8_format.TILE)
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


class TileExplorer(Explorer):
    """The widget: ``data`` is :func:`tile_data`'s; ``to_html()``, ``_repr_html_()``, ``save()``."""

    styles = Explorer.styles + ("fp8_tiles.css",)
    scripts = ("fp8_tiles.js",)
    start = "startTileExplorer"
    id_prefix = "tl-fp8-"
    data_class = "tl-fp8-data"
    default_title = "One FP8 tile: values, scale and error"

    def parts(self, uid: str) -> tuple[str, str, object]:
        markup = (f'<div class="tl-fp8-title">{html.escape(self.title)}</div>'
                  f'<div class="tl-fp8-row"><span class="tl-fp8-label">token</span>'
                  f'<span class="tl-fp8-tokens tl-fp8-row"></span></div>'
                  f'<div class="tl-fp8-row"><span class="tl-fp8-label">tile</span>'
                  f'<span class="tl-fp8-tilebtns tl-fp8-row"></span></div>'
                  f'<div class="tl-fp8-row"><span class="tl-fp8-label">scaling</span>'
                  f'<span class="tl-fp8-modes tl-fp8-row"></span></div>'
                  f'<svg width="720" height="268" role="img" '
                  f'aria-label="the values of one tile before and after FP8"></svg>'
                  f'<div class="tl-fp8-legend">relative error per channel: <i></i> 0 to '
                  f'1/17 (5.9 %), the bound for values in E4M3\'s normal range; <s></s> worse '
                  f'(below the normal range, or flushed to zero). Red bars: values below '
                  f'the normal range after scaling.</div>'
                  f'<div class="tl-fp8-hover">hover a bar: bars are the values, black ticks the '
                  f'values after FP8 and back</div><div class="tl-fp8-stats"></div>')
        attributes = (f'class="tl-fp8-tiles" id="{uid}" data-token="0" data-tile="0" '
                      f'data-mode="1x128"')
        return attributes, markup, self.data


def tile_explorer(x: torch.Tensor, token_names: list[str] | None = None,
                  title: str = "") -> TileExplorer:
    """The widget for ``x [tokens, hidden]`` (at most 6 tokens of 8 tiles)."""
    return TileExplorer(tile_data(x, token_names), title)
