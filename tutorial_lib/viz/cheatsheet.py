"""One-page cheat sheets, one per chapter, for slides and handouts .

A sheet is a standalone HTML page (inline CSS, no script, nothing fetched): the chapter's
title, what the reader will be able to do, its key table and its takeaways.  The key table
is computed here from the library, as the chapter computes it, at sizes a slide can hold,
by the function that the chapter's entry in :data:`tutorial_lib.chapters.CHAPTERS` names
(``key_table``); each function's caption says what its table shows.

The text (title, objectives, takeaways) comes from the notebook: ``scripts/cheat_sheets.py``
reads it and writes every sheet; the book build calls that script, so the sheets land in
``_build/html/cheatsheets/`` beside the chapters.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Callable

from ..chapters import CHAPTERS


@dataclass(frozen=True)
class KeyTable:
    """A chapter's key table: what it shows, its header and its rows (strings)."""

    caption: str
    header: list[str]
    rows: list[list[str]]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def _groups_table() -> KeyTable:
    from ..grid import build_grid
    grid = build_grid(16, tp=2, pp=2, ep=2, etp=1, layout="megatron")
    rows = []
    for kind in ("tp", "dp", "pp", "ep", "expert_tp", "expert_dp"):
        groups = grid.groups(kind)
        crosses = any(len({r // 8 for r in g}) > 1 for g in groups)
        rows.append([f"`{kind}`", str(len(groups[0])), str(sorted(grid.group_of(kind, 5))),
                     "yes" if crosses else "no"])
    return KeyTable("16 ranks on two 8-GPU nodes, Megatron-Core's layout, TP = 2, PP = 2, "
                    "EP = 2, ETP = 1 (DP = 4)",
                    ["kind", "group size", "rank 5's group", "crosses the node boundary"],
                    rows)


def _collectives_table() -> KeyTable:
    from ..costs import alpha_beta as cc
    n, b = 8, 2**20
    used = {"all_reduce": "TP layers; DP gradients", "reduce_scatter": "ZeRO gradients; SP",
            "all_gather": "ZeRO parameters; SP", "all_to_all": "EP dispatch and combine",
            "broadcast": "initial weights", "send": "PP activations and gradients"}
    rows = []
    for op, who in used.items():
        nbytes = b / n if op == "all_gather" else b  # all-gather: each rank's shard
        steps = cc.ring_steps(op, n) if op != "send" else 1
        rows.append([op.replace("_", "-"), _mib(cc.ring_bytes_sent(op, nbytes, n)),
                     str(steps), who])
    return KeyTable("Bytes each rank sends and steps taken, N = 8 ranks, a 1 MiB tensor "
                    "(all-gather: 1/8 MiB per rank), ring or chain algorithm",
                    ["collective", "bytes per rank", "steps", "used by"], rows)


def _zero_table() -> KeyTable:
    from ..costs.tp_dp_step import zero1_state_bytes_per_rank
    n = 10**9
    rows = [[str(d), f"{12 * n / 1e9:.1f} GB", f"{zero1_state_bytes_per_rank(n, d) / 1e9:.2f} GB"]
            for d in (1, 2, 4, 8, 16)]
    return KeyTable("Optimizer state per rank for 10^9 parameters of a bf16 model with an "
                    "fp32 master copy (master + two Adam moments, 12 bytes each)",
                    ["DP", "plain DP", "ZeRO-1"], rows)


def _moe_table() -> KeyTable:
    from ..costs.moe import moe_all_to_all_bytes
    rows = []
    for tokens, topk, hidden in ((4096, 8, 7168), (4096, 6, 5120), (1024, 2, 1024)):
        one = moe_all_to_all_bytes(tokens, topk, hidden)
        rows.append([str(tokens), str(topk), str(hidden), _mib(one), _mib(4 * one)])
    return KeyTable("One rank's dropless MoE all-to-alls in bf16 (its own rows included): "
                    "T tokens, K experts each, hidden size h",
                    ["T", "K", "h", "dispatch (= combine)", "per layer and step (x 4)"], rows)


def _losses_table() -> KeyTable:
    import torch

    from .. import moe_balance as mb
    n, k, d, m, t = 8, 2, 4, 2, 8
    uniform = torch.full((t, n), 1 / n, dtype=torch.float64)
    spread = (torch.arange(t)[:, None] + torch.tensor([[0, 2]])) % n
    on_first = torch.zeros(t, n, dtype=torch.float64)
    on_first[:, :2] = 0.5
    collapsed = torch.tensor([[0, 1]] * t)
    rows = []
    for name, fn, closed in (
            ("expert", lambda p, i: mb.expert_balance_loss(p, i, n, k), "N'/K'"),
            ("device", lambda p, i: mb.device_balance_loss(p, i, n, k, d), "D"),
            ("communication", lambda p, i: mb.communication_balance_loss(p, i, n, d, m),
             "D/M")):
        rows.append([name, f"{float(fn(uniform, spread)):g}",
                     f"{float(fn(on_first, collapsed)):g}", closed])
    return KeyTable(f"Each balance loss over its coefficient, N' = {n}, K' = {k}, D = {d}, "
                    f"M = {m}: balanced routing, and every token on experts 0 and 1",
                    ["loss", "balanced", "collapsed", "collapsed, closed form"], rows)


def _bubble_table() -> KeyTable:
    from ..pipeline_parallel import build_schedules
    from ..pipeline_parallel.formulas import expected_bubble, peak_activations_in_flight
    from ..pipeline_parallel.simulator import bubble_fraction, simulate
    pp, m = 4, 8
    rows = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        schedules = build_schedules(name, pp, m, v)
        timed = simulate(schedules, forward_cost=1, backward_cost=2)
        rows.append([name, str(v), f"{bubble_fraction(timed):.3f}",
                     f"{expected_bubble(pp, m, v):.3f}",
                     str(peak_activations_in_flight(schedules[0]))])
    return KeyTable(f"PP = {pp}, M = {m} microbatches, simulated with equal stages "
                    "(backward = 2 x forward) and free messages",
                    ["schedule", "V", "bubble (simulated)", "(PP-1)/(VM+PP-1)",
                     "rank 0's peak (microbatch chunks held)"], rows)


def _modes_table() -> KeyTable:
    from ..config import ConfigError
    from ..pipeline_parallel.actions import SCHEDULE_NAMES
    from ..pipeline_parallel.modes import P2P_MODES, check_schedule_and_mode
    rows = []
    for schedule in SCHEDULE_NAMES:
        row = [schedule]
        for mode in P2P_MODES:
            verdicts = []
            for pp in (2, 4):
                try:
                    check_schedule_and_mode(schedule, mode, pp)
                    verdicts.append("runs")
                except ConfigError:
                    verdicts.append("refused")
            row.append(" / ".join(verdicts))
        rows.append(row)
    return KeyTable("Which (schedule, P2P mode) pairs a run accepts, as Megatron-Core 0.20.0 "
                    "does, at PP = 2 / PP = 4 (gpipe is the course's own schedule)",
                    ["schedule", *P2P_MODES], rows)


def _wire_table() -> KeyTable:
    from ..fp8_format import wire_bytes_per_row
    from ..recipes import PRECISIONS
    hidden = 7168
    bf16 = wire_bytes_per_row(hidden, "bf16")
    rows = [[p, f"{wire_bytes_per_row(hidden, p):,}",
             f"{100 * wire_bytes_per_row(hidden, p) / bf16:.1f} %"] for p in PRECISIONS]
    return KeyTable(f"Bytes of one token copy on the wire, H = {hidden} (DeepSeek-V3), "
                    "FP8 rows carrying their 1x128 scales",
                    ["precision", "bytes per copy", "of bf16"], rows)


def _cp_table() -> KeyTable:
    from ..costs.cp_messages import cp_bytes_sent
    long = dict(batch=1, heads=8, seq_length=128 * 1024, head_dim=128, bytes_per_element=2)
    modes = ("p2p", "all_gather", "a2a")
    rows = [[str(size)] + [_mib(cp_bytes_sent(mode, size, **long)) if
                           (mode != "a2a" or long["heads"] % size == 0) else "refused"
                           for mode in modes] for size in (2, 4, 8, 16)]
    return KeyTable("Bytes one CP rank sends per attention layer, forward + backward, at "
                    "128K tokens (bf16, 8 heads of 128 per TP rank, one sequence)",
                    ["CP", *modes], rows)


def _memory_table() -> KeyTable:
    from ..config import ModelConfig, ParallelConfig, TrainConfig
    from ..costs.memory_model import memory_per_rank
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                        vocab_size=128)
    rows = []
    for precision in ("fp32", "bf16"):
        for zero in (False, True):
            per = []
            for dp in (1, 8, 64):
                rank = memory_per_rank(model, ParallelConfig(dp), TrainConfig(dp, 1),
                                       precision=precision, use_distributed_optimizer=zero)[0]
                per.append(f"{(rank.weights + rank.gradients + rank.optimizer) / rank.parameters:.2f}")
            rows.append([precision, "distributed (ZeRO-1)" if zero else "plain DP", *per])
    return KeyTable("Bytes per parameter a rank holds for weights, gradients and optimizer "
                    "state (Adam), by precision and optimizer (the course's distributed "
                    "optimizer also keeps its slice's fp32 gradient)",
                    ["precision", "optimizer", "DP 1", "DP 8", "DP 64"], rows)


def _zero_bubble_table() -> KeyTable:
    from ..pipeline_parallel import build_schedules
    from ..pipeline_parallel.formulas import (PARAMETER_COPIES, expected_bubble_time,
                                              peak_activations_in_flight)
    from ..pipeline_parallel.simulator import COSTS, idle_time, simulate
    pp, m = 4, 8
    f, b, w = COSTS["F"], COSTS["B"], COSTS["W"]
    rows = []
    for name in ("1f1b", "zb-h1", "zbv", "dualpipev", "dualpipe"):
        scale = 0.5 if name in ("zbv", "dualpipev") else 1  # a V chunk is half a stage
        schedules = build_schedules(name, pp, m)
        timed = simulate(schedules, f * scale, b * scale, 0, w * scale)
        held = max(peak_activations_in_flight(a) for a in schedules.values()) * scale
        formula = expected_bubble_time(name, pp, f * scale, b * scale, w * scale)
        rows.append([name, f"{idle_time(timed):g}", f"{formula:g}",
                     f"{held:g}", f"{PARAMETER_COPIES[name]}x"])
    return KeyTable(f"The same model on PP = {pp} ranks, M = {m}, F = 1, B = 2 of which W = 1 "
                    "per stage (a V chunk half of it), free messages",
                    ["schedule", "bubble (simulated)", "the DualPipe table's formula",
                     "activations held (stages)", "parameters per rank"], rows)


def _sharding_table() -> KeyTable:
    from ..config import SHARDING_STRATEGIES, ZERO_STAGE
    from ..costs.memory_model import zero_bytes_per_parameter
    from ..costs.zero_stages import sharded_step_collectives, step_bytes_sent
    units = [1000, 4000, 4000]
    plain = step_bytes_sent(sharded_step_collectives(units, 8, "no_shard"), {"dp": 8})
    rows = []
    for strategy in SHARDING_STRATEGIES:
        stage = ZERO_STAGE[strategy]
        sent = step_bytes_sent(sharded_step_collectives(units, 8, strategy), {"dp": 8})
        rows.append([strategy, str(stage),
                     *(f"{zero_bytes_per_parameter(stage, nd):.2f}" for nd in (8, 64)),
                     f"{sent / plain:g}x"])
    return KeyTable("Megatron-FSDP's strategies: model-state bytes per parameter on one rank "
                    "(the ZeRO paper's mixed-precision Adam, K = 12) and bytes on the wire "
                    "per step against plain DP (one microbatch, every unit resharded)",
                    ["strategy", "ZeRO", "bytes / param, DP 8", "DP 64", "sent vs plain DP"],
                    rows)


def _layout_table() -> KeyTable:
    from ..costs.hardware import GPUS
    from ..plan import MATMUL_EFFICIENCY
    rows = []
    for gpu in GPUS.values():
        rate = gpu.peak_flops("bf16") * MATMUL_EFFICIENCY
        rows.append([gpu.name, f"{gpu.bf16_flops / 1e12:,.0f}", f"{gpu.memory_bytes / 1e9:.0f}",
                     f"{gpu.nvlink_bandwidth / 1e9:,.0f}", f"{gpu.network_bandwidth / 1e9:,.0f}",
                     f"{rate / gpu.nvlink_bandwidth:,.0f}",
                     f"{rate / gpu.network_bandwidth:,.0f}"])
    return KeyTable("The planner's GPUs: peak dense bf16, memory, NVLink and network bytes per "
                    "second per GPU (one way), and each link's ridge: the FLOPs per byte sent "
                    f"below which a technique is communication-bound there (at the fitted "
                    f"matmul efficiency {MATMUL_EFFICIENCY})",
                    ["GPU", "bf16 TFLOP/s", "GB", "NVLink GB/s", "network GB/s",
                     "NVLink ridge", "network ridge"], rows)


KEY_TABLES: dict[int, Callable[[], KeyTable]] = {
    entry.number: globals()[entry.key_table] for entry in CHAPTERS}
"""Chapter number -> its key table's builder (named by the chapter's entry in
:data:`tutorial_lib.chapters.CHAPTERS`)."""


def key_table(chapter: int) -> KeyTable:
    """The key table of a chapter (one of :data:`KEY_TABLES`), computed by the library."""
    if chapter not in KEY_TABLES:
        raise ValueError(f"no cheat sheet for chapter {chapter}: chapters are "
                         f"{min(KEY_TABLES)} to {max(KEY_TABLES)}")
    return KEY_TABLES[chapter]()


_TEX = [(r"\cdot", "·"), (r"\times", "×"), (r"\lceil", "⌈"), (r"\rceil", "⌉"),
        (r"\dots", "…"), (r"\alpha", "α"), (r"\beta", "β"), (r"\le", "≤"), (r"\ge", "≥"),
        (r"\sqrt", "√"), (r"\,", " "), (r"\text", ""), (r"\mathcal", ""), (r"\sum", "Σ"),
        (r"\top", "ᵀ"), (r"\gamma", "γ"), (r"\ell", "ℓ"), (r"\operatorname", ""),
        (r"\overline", ""), (r"\mathbb", ""), (r"\left", ""), (r"\right", "")]


def plain(text: str) -> str:
    """Chapter Markdown as safe HTML for a sheet: code, bold, italics, and TeX spelled in
    plain characters (a sheet loads no MathJax)."""
    text = re.sub(r"\{term\}`([^`<]+?)(?: <[^>]+>)?`", r"\1", text)
    text = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text)

    def math(m: re.Match) -> str:
        tex = m.group(1)
        tex = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", tex)
        for macro, char in sorted(_TEX, key=lambda pair: -len(pair[0])):  # \left before \le
            tex = tex.replace(macro, char)
        tex = tex.replace(r"\&", "&")  # F\&B, the overlapped pair: "F&B"
        tex = re.sub(r"\^\{([^{}]*)\}", r"^\1", tex)
        tex = re.sub(r"\\([A-Za-z]+)", r"\1", tex)  # \log, \min, \max: the name itself
        return tex.replace("{", "").replace("}", "")

    text = re.sub(r"\$([^$]+)\$", math, text)
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return re.sub(r"(?<![\w*])\*([^*]+)\*(?![\w*])", r"<i>\1</i>", out)


STYLE = """
@page { size: A4 landscape; margin: 10mm; }
body { font: 13px/1.4 system-ui, sans-serif; color: #1f2328; margin: 16px; }
h1 { font-size: 20px; margin: 0 0 6px; }
h2 { font-size: 14px; margin: 10px 0 4px; color: #3f6490; }
nav { font-size: 12px; margin: 0 0 8px; }
a { color: #0b5cad; }
.cols { display: flex; flex-wrap: wrap; gap: 8px 24px; align-items: flex-start; }
.cols > div { flex: 1 1 340px; min-width: 0; }
.scroll { overflow-x: auto; max-width: 100%; }
ul { margin: 0; padding-left: 1.2em; }
li { margin: 2px 0; overflow-wrap: anywhere; }
table { border-collapse: collapse; font-size: 13px; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #d0d7de; }
caption { caption-side: top; text-align: left; font-style: italic; padding-bottom: 4px; }
code { font-size: 12px; background: #f3f7fc; padding: 0 2px; overflow-wrap: anywhere; }
footer { margin-top: 10px; font-size: 11px; color: #57606a; }
@media (max-width: 600px) { body { margin: 10px; } th, td { padding: 3px 5px; } }
"""

FAVICON = ("data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 32 32'%3E"
           "%3Crect x='2' y='2' width='13' height='13' rx='3' fill='%234e79a7'/%3E"
           "%3Crect x='17' y='2' width='13' height='13' rx='3' fill='%23f28e2b'/%3E"
           "%3Crect x='2' y='17' width='13' height='13' rx='3' fill='%2359a14f'/%3E"
           "%3Crect x='17' y='17' width='13' height='13' rx='3' fill='%23b07aa1'/%3E%3C/svg%3E")
"""The book's favicon (_static/favicon.svg) inline: a sheet fetches nothing, not even it."""


def page_head(title: str) -> str:
    """The head of a standalone page of the sheets: the phone's width, the book's favicon,
    the sheets' style."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="icon" type="image/svg+xml" href="{FAVICON}">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>")


def cheat_sheet_html(number: int, title: str, objectives: list[str], takeaways: list[str],
                     table: KeyTable | None = None, chapter_href: str = "") -> str:
    """One chapter's sheet as a standalone HTML page (no script, nothing fetched);
    ``chapter_href``: where its chapter is (a link back, with one to every sheet)."""
    table = key_table(number) if table is None else table
    items = lambda xs: "".join(f"<li>{plain(x)}</li>" for x in xs)  # noqa: E731
    head = "".join(f"<th>{plain(h)}</th>" for h in table.header)
    body = "".join("<tr>" + "".join(f"<td>{plain(c)}</td>" for c in row) + "</tr>"
                   for row in table.rows)
    nav = (f'<nav><a href="{html.escape(chapter_href, quote=True)}">Chapter {number} in the '
           f'book</a> · <a href="index.html">every cheat sheet</a></nav>' if chapter_href else "")
    return (page_head(f"Chapter {number} cheat sheet: {title}") + "<body>"
            f'{nav}<h1>Chapter {number}. {html.escape(title)}</h1>'
            f'<div class="cols"><div><h2>You will be able to</h2><ul>{items(objectives)}</ul>'
            f'<h2>Key table</h2><div class="scroll"><table class="tl-cheat-table"><caption>'
            f"{plain(table.caption)}</caption><tr>{head}</tr>{body}</table></div></div>"
            f"<div><h2>Takeaways</h2><ul>{items(takeaways)}</ul></div></div>"
            f"<footer>Computed by tutorial_lib.viz.cheatsheet when the book was built."
            f"</footer></body></html>\n")


__all__ = ["KeyTable", "KEY_TABLES", "cheat_sheet_html", "key_table", "page_head", "plain"]
