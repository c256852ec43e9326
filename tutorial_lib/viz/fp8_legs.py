"""The four all-to-alls of one MoE layer's step, each drawn with the precision it travels in.

    dispatch_combine_figure()                               # DeepSeek-V3's setting
    dispatch_combine_figure(fp8.FP8_DISPATCH, fp8.FP8_COMBINE)   # every leg in FP8

An MoE layer sends token rows four times per training step, in this order: the dispatch
(tokens to their experts), the combine (expert outputs back), then in the backward pass
the combine's backward (output gradients out to the experts) and the dispatch's backward
(input gradients back).  Each leg's precision is the ``(forward, backward)`` pair of its
all-to-all (:data:`tutorial_lib.fp8.DEEPSEEK_V3_DISPATCH` and ``_COMBINE`` by default);
its bytes per token copy are :func:`tutorial_lib.fp8.wire_bytes_per_row`.  An arrow is
thicker the more bytes it carries (BF16 5 units, FP8 3.3).  Static SVG drawn with
:mod:`tutorial_lib.viz.draw` (no script): it scales to the width of the page.
"""
from __future__ import annotations

import html

from .. import fp8_format
from . import draw

__all__ = ["LEGS", "dispatch_combine_legs", "dispatch_combine_figure", "LegsFigure"]

LEGS = (
    ("dispatch", "forward", "to experts", "tokens", "FP8 up-projection"),
    ("combine", "forward", "to tokens", "expert outputs", "residual stream"),
    ("combine", "backward", "to experts", "output gradients", "FP8 down-proj. backward"),
    ("dispatch", "backward", "to tokens", "input gradients", "residual gradient"),
)
"""The four legs in the order they run: all-to-all, pass, direction, what travels, and
what it feeds on arrival (an FP8 matmul, or a sum in higher precision)."""

WIDTH = 460
"""The figure's drawing width: at 13 px text it stays readable on a 390 px phone."""
PRECISION_COLORS = {"fp32": draw.KIND_COLORS["world"], "bf16": draw.KIND_COLORS["tp"],
                    "fp8": draw.KIND_COLORS["ep"], "fp8_pow2": draw.KIND_COLORS["ep"],
                    "fp8_ue8m0": draw.KIND_COLORS["expert_tp"]}
"""FP8 legs orange (the EP colour), BF16 blue, fp32 grey."""


def dispatch_combine_legs(dispatch=fp8_format.DEEPSEEK_V3_DISPATCH,
                          combine=fp8_format.DEEPSEEK_V3_COMBINE, hidden: int = 7168) -> list[dict]:
    """The four legs, in the order they run, each with its precision and bytes per row."""
    pairs = {"dispatch": fp8_format.check_precision_pair(dispatch),
             "combine": fp8_format.check_precision_pair(combine)}
    bf16 = fp8_format.wire_bytes_per_row(hidden, "bf16")
    legs = []
    for number, (op, phase, direction, carries, consumer) in enumerate(LEGS, start=1):
        precision = pairs[op][0 if phase == "forward" else 1]
        row = fp8_format.wire_bytes_per_row(hidden, precision)
        legs.append({"number": number, "op": op, "phase": phase, "direction": direction,
                     "carries": carries, "consumer": consumer, "precision": precision,
                     "bytes_per_row": row, "of_bf16": row / bf16})
    return legs


class LegsFigure:
    """The figure: ``legs`` (:func:`dispatch_combine_legs`), ``svg``, ``_repr_html_()``."""

    def __init__(self, legs: list[dict], hidden: int, title: str):
        self.legs, self.hidden, self.title = legs, hidden, title
        self.svg = _draw(legs, hidden)

    def to_html(self) -> str:
        return (f'<div class="tl-fp8-legs" style="max-width:{WIDTH}px;font-family:{draw.SANS}">'
                f'<div style="font-weight:600;margin-bottom:4px">{html.escape(self.title)}</div>'
                f"{self.svg}</div>")

    def _repr_html_(self) -> str:
        return self.to_html()


def _draw(legs: list[dict], hidden: int) -> str:
    column, top, leg_height, gap = 22, 60, 64, 34
    left, right = column, WIDTH - column
    height = top + 4 * leg_height + gap + 4
    shade = draw.mix(draw.INK, 0.08)
    body = [draw.rect(0, 26, column - 4, height - 26, shade, rx=4),
            draw.rect(WIDTH - column + 4, 26, column - 4, height - 26, shade, rx=4),
            draw.text(0, 17, "token's rank", size=14, anchor="start", weight="600"),
            draw.text(WIDTH, 17, "expert's rank", size=14, anchor="end", weight="600"),
            draw.text(WIDTH / 2, 44, f"bytes per token copy (H = {hidden:,}), % of BF16",
                      size=13, fill=draw.MUTED)]
    bf16 = fp8_format.wire_bytes_per_row(hidden, "bf16")
    y = top
    for leg in legs:
        if leg["number"] == 3:
            line_y = y + 4
            body.append(f'<line x1="{left}" x2="{right}" y1="{line_y:.1f}" y2="{line_y:.1f}" '
                        f'stroke="{draw.LINE}" stroke-dasharray="4 3"/>')
            body.append(draw.text(WIDTH / 2, line_y + 18, "backward pass", size=13,
                                  fill=draw.MUTED))
            y += gap
        color = PRECISION_COLORS[leg["precision"]]
        width = 1.5 + 3.5 * leg["bytes_per_row"] / bf16  # BF16 5, FP8 3.3, fp32 8.5
        to_experts = leg["direction"] == "to experts"
        x0, x1 = (left + 6, right - 6) if to_experts else (right - 6, left + 6)
        name = f"{leg['number']}. {leg['op']}, {leg['phase']}: {leg['carries']}"
        wire = f"{leg['precision']} · {leg['bytes_per_row']:,} B · {leg['of_bf16']:.1%}"
        body += [f'<g class="tl-fp8-leg" data-op="{leg["op"]}" data-phase="{leg["phase"]}" '
                 f'data-precision="{leg["precision"]}">',
                 draw.text(left + 6, y + 14, name, size=14, anchor="start"),
                 draw.arrow([(x0, y + 29), (x1, y + 29)], color, width=width),
                 draw.text(left + 6, y + 51, wire, size=13, anchor="start",
                           fill=draw.readable(color), weight="600"),
                 draw.text(right - 6, y + 51, f"→ {leg['consumer']}", size=13, anchor="end",
                           fill=draw.MUTED),
                 "</g>"]
        y += leg_height
    picture = draw.svg(WIDTH, height, body)
    label = html.escape("the four MoE all-to-alls of one training step and their precisions",
                        quote=True)
    return picture.replace("<svg ", f'<svg style="width:100%;height:auto" aria-label="{label}" ', 1)


def dispatch_combine_figure(dispatch=fp8_format.DEEPSEEK_V3_DISPATCH,
                            combine=fp8_format.DEEPSEEK_V3_COMBINE, hidden: int = 7168,
                            title: str = "") -> LegsFigure:
    """The figure of the four legs with ``dispatch`` and ``combine`` ``(forward, backward)``."""
    legs = dispatch_combine_legs(dispatch, combine, hidden)
    return LegsFigure(legs, hidden, title or "One MoE layer, one step: four all-to-alls")
