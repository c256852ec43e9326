"""The layout explorer and the roofline chart of chapter 13, both computed by the planner.

    layout_explorer()        # the best layouts per model size, GPU type and GPU count
    roofline_chart(lines)    # each technique's FLOPs per byte against the two links' ridges

The explorer's buttons pick a model size, a GPU type and a number of GPUs; the page then
shows the table :func:`tutorial_lib.plan.plan` printed for that choice when the widget
was built (:func:`explorer_data`): the fastest layouts that fit, their predicted step
time, throughput, MFU and heaviest rank's memory, or the planner's reason that none fits.
Every number, and every table's markup, is made here in Python; the page's script only
shows the one asked for, so the static book needs no kernel and holds no second model.
"""
from __future__ import annotations

import html
import itertools
import math

from ..config import ConfigError, ModelConfig
from ..costs.hardware import GPUS, cluster
from ..costs.model_flops import gpt, parameter_count
from ..plan import plan
from . import draw
from .widget import Explorer, ascii_html

__all__ = ["SIZES", "GPU_TYPES", "GPU_COUNTS", "GLOBAL_BATCH", "explorer_data",
           "LayoutExplorer", "layout_explorer", "roofline_chart"]

SIZES: dict[str, ModelConfig] = {
    "1.3B": gpt(24, 2048, 16, name="GPT 1.3B"),
    "13B": gpt(40, 5120, 40, name="GPT 13B"),
    "70B": gpt(80, 8192, 64, name="GPT 70B"),
}
"""GPT shapes (sequence 2,048, vocabulary 51,200) the explorer offers."""
GPU_TYPES = ("a100-80gb", "h100-sxm")
GPU_COUNTS = (16, 64)
GLOBAL_BATCH = 256
"""Sequences per step, the same for every choice."""
SHOWN = 3
"""Layouts shown per choice, fastest first."""

_HEADER = ("layout", "step s", "tokens/s", "MFU", "memory")


def _table(rows) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in _HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in rows)
    return f'<table class="tl-lay-table"><tr>{cells}</tr>{body}</table>'


def explorer_data(sizes=tuple(SIZES), gpus=GPU_TYPES, counts=GPU_COUNTS,
                  global_batch_size: int = GLOBAL_BATCH) -> dict:
    """Per choice ``"size|gpu|count"``: the planner's best layouts (``rows``, as shown, and
    their ``html``) or its refusal (``refused``)."""
    out = {"sizes": list(sizes), "gpus": [[g, GPUS[g].name] for g in gpus],
           "counts": list(counts), "batch": global_batch_size, "results": {}}
    for size, gpu, count in itertools.product(sizes, gpus, counts):
        model = SIZES[size]
        try:
            found = plan(model, cluster(gpu), count, global_batch_size, top=SHOWN).layouts
        except ConfigError as err:
            out["results"][f"{size}|{gpu}|{count}"] = {"refused": str(err)}
            continue
        rows = [[r.layout.describe(), f"{r.step_time_s:.2f}", f"{r.tokens_per_s:,.0f}",
                 f"{r.mfu:.1%}", f"{r.memory_gib:.0f} GiB"] for r in found]
        out["results"][f"{size}|{gpu}|{count}"] = {
            "rows": rows, "html": _table(rows),
            "params": f"{parameter_count(model) / 1e9:.1f}B parameters"}
    return out


class LayoutExplorer(Explorer):
    """The widget: ``data`` is :func:`explorer_data`'s; ``to_html()``, ``_repr_html_()``, ``save()``
    (its own panel styles, ``layout.css``, instead of ``explorer.css``)."""

    styles = ("layout.css",)
    scripts = ("layout.js",)
    start = "startLayoutExplorer"
    id_prefix = "tl-lay-"
    data_class = "tl-lay-data"
    default_title = "The planner's fastest layouts: pick a model, a GPU and a count"

    def parts(self, uid: str) -> tuple[str, str, object]:
        d = self.data
        first = f"{d['sizes'][0]}|{d['gpus'][0][0]}|{d['counts'][0]}"
        shown = d["results"][first]
        rows = "".join(f'<div class="tl-lay-row"><span class="tl-lay-label">{label}</span>'
                       f'<span class="tl-lay-{key} tl-lay-row"></span></div>'
                       for key, label in (("size", "model"), ("gpu", "GPU"), ("count", "GPUs")))
        body = shown.get("html") or html.escape(shown.get("refused", ""))
        markup = (f'<div class="tl-lay-title">{html.escape(self.title)}</div>{rows}'
                  f'<div class="tl-lay-result">{body}</div>')
        attributes = f'class="tl-layout-explorer" id="{uid}" data-key="{html.escape(first)}"'
        return attributes, ascii_html(markup), d


def layout_explorer(title: str = "") -> LayoutExplorer:
    """The explorer over :data:`SIZES`, :data:`GPU_TYPES` and :data:`GPU_COUNTS`."""
    return LayoutExplorer(explorer_data(), title)


class _Picture:
    def __init__(self, markup: str):
        self.markup = markup

    def _repr_html_(self) -> str:
        return self.markup


def roofline_chart(lines, title: str = ""):
    """One row per technique (:class:`~tutorial_lib.costs.rooflines.Roofline`): its
    arithmetic intensity on a log axis, and the ridges of NVLink and of the network as two
    dashed lines; a technique left of a ridge is communication-bound on that link."""
    lines = list(lines)
    if not lines:
        raise ValueError("roofline_chart needs at least one Roofline (a layout using TP, CP, "
                         "EP, PP or DP > 1)")
    values = [r.intensity for r in lines] + [lines[0].ridge_nvlink, lines[0].ridge_network]
    low = math.floor(math.log10(min(values)))
    high = math.ceil(math.log10(max(values)))
    left, right, top, row = 40, 290, 34 if title else 8, 30
    width = right + 80  # room for the longest bar's value

    def x(v):
        return left + (right - left) * (math.log10(v) - low) / (high - low)

    body = [draw.text(8, 18, title, size=13, anchor="start", weight="600")] if title else []
    bottom = top + row * len(lines)
    for i, r in enumerate(lines):
        y = top + i * row
        body += [draw.text(left - 6, y + 18, r.technique, size=12, anchor="end"),
                 draw.rect(left, y + 6, x(r.intensity) - left, 16, draw.palette_color(i), rx=2),
                 draw.text(x(r.intensity) + 4, y + 18, f"{r.intensity:,.0f}", size=11,
                           anchor="start")]
    for k, (value, name, dash) in enumerate(((lines[0].ridge_nvlink, "NVLink", "4 3"),
                                             (lines[0].ridge_network, "network", "1 3"))):
        px = x(value)
        body += [f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{top:.1f}" y2="{bottom + 6 + 14 * k:.1f}" '
                 f'stroke="{draw.INK}" stroke-dasharray="{dash}"/>',
                 draw.text(px + 3, bottom + 16 + 14 * k, f"{name} ridge {value:,.0f}", size=11,
                           anchor="start")]
    for k in range(low, high + 1):
        body.append(draw.text(x(10 ** k), bottom + 50, f"1e{k}", size=10, fill=draw.MUTED))
    body.append(draw.text((left + right) / 2, bottom + 66, "FLOPs per byte sent (log scale)",
                          size=11, fill=draw.MUTED))
    label = "each technique's FLOPs per byte against the NVLink and network ridges"
    picture = draw.svg(width, bottom + 74, body, label)
    return _Picture(picture.replace("<svg ", '<svg style="max-width:100%;height:auto" ', 1))
