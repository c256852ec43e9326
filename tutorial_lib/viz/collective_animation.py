"""Animations of collectives, drawn from recorded traces.

Every frame here is rebuilt from events a real launch recorded: the values a
rank sent, the values it received, the split sizes of an all-to-all.  Nothing
is simulated, so what you see is what the ranks did.  Record values by
launching with ``capture_values`` at least the number of elements of the
tensors involved::

    out = launch(work, 4, capture_values=64)
    animate_ring_all_reduce(out.trace)
    animate_collective(out.trace, "all_to_all")

An :class:`~tutorial_lib.viz.widget.Animation` is one self-contained HTML
fragment: one inline SVG per frame and the course's player (Play/Pause, Back,
Next, a slider, a caption; ``viz/assets/player.js``, inlined).  It needs no
Python kernel, no external file and no widget library, so it plays the same
live in Jupyter and in the static book.  The pictures are drawn with
:mod:`tutorial_lib.viz.draw`.

A library collective (gloo's all-reduce, ...) is one call: its trace events hold what
every rank had before and after it, not the messages inside.  :func:`animate_collective`
therefore replays, on those recorded values, the standard schedule of each collective
(the one the alpha-beta formulas of :mod:`tutorial_lib.costs` count): the ring for
all-reduce, reduce-scatter and all-gather, a pipelined chain for broadcast, the pairwise
exchange for all-to-all.  Its first frame is every rank's recorded input, its last
every rank's recorded output.

Reading the pictures: ranks are rows; each rank's tensor is drawn as cells
holding its values.  In the ring and chain pictures a colour is a chunk index and the
shade says how many ranks' values the chunk already sums (``Σ k/N``); grey cells hold
old values about to be overwritten.  In the all-to-all and point-to-point pictures a
colour is the rank the values came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..trace import Trace, TraceEvent
from . import draw
from .draw import INK, LINE, MUTED
from .widget import Animation

SUM_COLOR = "#5b6b7c"  # a value reduced over every rank (all-reduce result)
FULL, LIGHT = 0.8, 0.4  # how strongly a block shows its colour: dark text stays readable on both
OLD_COLOR = "#e4e7eb"  # values about to be overwritten (broadcast targets)
MONO_CHAR_W = 7.3      # width of one 12 px monospace character, for layout
MAX_VALUES = 4         # values written per cell before eliding with "…"

RING_ALGORITHMS = ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
P2P_OPS = ("send", "recv", "p2p", "send_recv")


# --- drawing helpers ------------------------------------------------------------------


def _fmt(v: float) -> str:
    """A value as a short string: whole numbers exactly, others to 3 significant digits."""
    if v == v and not math.isinf(v) and v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def _cell_text(values: list[float]) -> str:
    """The values of one cell, e.g. ``"1, 2.5"``; long rows end in an ellipsis."""
    if len(values) <= MAX_VALUES:
        return ", ".join(_fmt(v) for v in values)
    return ", ".join(_fmt(v) for v in values[:MAX_VALUES - 1]) + ", \u2026"


def _text_width(s: str) -> float:
    return len(s) * MONO_CHAR_W


def _need_values(values, event: TraceEvent, what: str):
    if values is None:
        raise ValueError(f"the trace holds no values for {what} (rank {event.rank}, shape "
                         f"{tuple(event.shape)}): launch with capture_values >= the number of "
                         f"elements of the tensor, e.g. launch(fn, n, capture_values=256)")
    return values


# --- ring all-reduce -------------------------------------------------------------------


def animate_ring_all_reduce(trace: Trace, call: int | None = None,
                            ranks: list[int] | None = None) -> Animation:
    """Replay a traced :func:`tutorial_lib.ring_collectives.ring_all_reduce`, step by step.

    Frame 0 shows every rank's chunks as they started; then one frame per
    reduce-scatter step and per all-gather step (``1 + 2 (N-1)`` frames) shows
    which chunk moved from which rank to which and every buffer after the step.
    ``call`` picks one call when the trace holds several (the ``call`` tag;
    default: the first), ``ranks`` one group when several rings ran at once
    (e.g. ``[0, 2]`` of the dp groups; default: the first to start).
    """
    return animate_ring(trace, "ring_all_reduce", call, ranks)


def animate_ring(trace: Trace, algorithm: str | None = None, call: int | None = None,
                 ranks: list[int] | None = None) -> Animation:
    """Replay any traced ring algorithm of :mod:`tutorial_lib.ring_collectives`.

    ``algorithm``: ``ring_all_reduce``, ``ring_reduce_scatter`` or
    ``ring_all_gather`` (default: whichever the trace holds first).
    """
    events = _pick_ring_call(trace, algorithm, call, ranks)
    ranks = events[0].group_ranks
    n = len(ranks)
    algorithm = events[0].tags["algorithm"]
    pos = {r: p for p, r in enumerate(ranks)}

    # Frame 0: the "ring_buffer" events hold what every rank started with.
    buffers: list[list] = [[None] * n for _ in range(n)]  # [position][chunk] -> values
    sums: list[list] = [[set() for _ in range(n)] for _ in range(n)]  # which ranks each chunk sums
    for e in events:
        if e.op == "compute" and e.tags.get("name") == "ring_buffer":
            values = _need_values(e.values_in, e, "the ring's starting buffers")
            held = e.tags["held"]
            k = len(values) // len(held)
            for j, c in enumerate(held):
                buffers[pos[e.rank]][c] = values[j * k:(j + 1) * k]
                sums[pos[e.rank]][c] = {pos[e.rank]}
    reduces = algorithm != "ring_all_gather"
    states = [_ring_state(buffers, sums, [], "start", 0, 0)]

    phases = [p for p in ("reduce_scatter", "all_gather")
              if any(e.tags.get("phase") == p for e in events)]
    for phase in phases:
        for s in range(n - 1):
            step = [e for e in events if e.tags.get("phase") == phase and e.tags.get("step") == s]
            before = [list(map(set, row)) for row in sums]
            moves = []
            for recv in (e for e in step if e.op == "recv"):
                src, dst, c = pos[recv.peer], pos[recv.rank], recv.tags["chunk"]
                moves.append((src, dst, c))
                if phase == "reduce_scatter":
                    # The receiver added what arrived: its "ring_reduce" event holds the new sum.
                    add = next(e for e in step if e.op == "compute" and e.rank == recv.rank
                               and e.tags.get("name") == "ring_reduce")
                    buffers[dst][c] = _need_values(add.values_out, add, "a ring reduction")
                    sums[dst][c] = before[dst][c] | before[src][c]
                else:
                    buffers[dst][c] = _need_values(recv.values_out, recv, "a ring receive")
                    sums[dst][c] = set(before[src][c])
            states.append(_ring_state(buffers, sums, moves, phase, s, n - 1))

    sends = [e for e in events if e.op == "send" and e.rank == ranks[0]]
    sent = (len(sends), sends[0].bytes) if sends else None
    chunk_shape = next(e.shape for e in events if e.tags.get("name") == "ring_buffer")
    captions = [_ring_caption(st, n, ranks, algorithm, sent, i == len(states) - 1)
                for i, st in enumerate(states)]
    cell_w = max(64.0, max(_text_width(_cell_text(v)) + 18 for st in states
                           for row in st["buffers"] for v in row if v is not None))
    frames = [_draw_ring(st, ranks, cell_w, reduces) for st in states]
    data = [{"phase": st["phase"], "step": st["step"],
             "buffers": {ranks[p]: row for p, row in enumerate(st["buffers"])},
             "moves": [(ranks[a], ranks[b], c) for a, b, c in st["moves"]]} for st in states]
    title = {"ring_all_reduce": "Ring all-reduce", "ring_reduce_scatter": "Ring reduce-scatter",
             "ring_all_gather": "Ring all-gather"}[algorithm]
    group = events[0].group_kind
    title += f" over ranks {list(ranks)} ({group} group, chunks of shape {tuple(chunk_shape)})"
    note = ("Colour: chunk index. Arrow: the chunk sent this step, from the dashed cell "
            "to the outlined cell that received it.")
    if reduces:
        note += " Shade and \u03a3 k/N: how many ranks' values a chunk sums so far."
    return Animation(frames, captions, title=title, data=data, note=note)


def _pick_ring_call(trace: Trace, algorithm: str | None, call: int | None,
                    ranks: list[int] | None) -> list[TraceEvent]:
    """The events of one ring call: same algorithm, call number and group."""
    ring = [e for e in trace if e.tags.get("algorithm") in RING_ALGORITHMS
            and (algorithm is None or e.tags["algorithm"] == algorithm)
            and (call is None or e.tags.get("call") == call)
            and (ranks is None or e.group_ranks == tuple(ranks))]
    if not ring:
        found = sorted({(e.tags["algorithm"], e.tags.get("call"), e.group_ranks) for e in trace
                        if e.tags.get("algorithm") in RING_ALGORITHMS})
        raise ValueError(f"no {algorithm or 'ring'} events (call={call}, ranks={ranks}) in this "
                         f"trace; it holds (algorithm, call, ranks): {found or 'none'}. Record "
                         f"them by calling tutorial_lib.ring_collectives inside a launch")
    first = ring[0]
    key = (first.tags["algorithm"], first.tags.get("call"), first.group_ranks)
    return [e for e in ring if (e.tags["algorithm"], e.tags.get("call"), e.group_ranks) == key]


def _ring_state(buffers, sums, moves, phase, step, steps, stale=()) -> dict:
    return {"buffers": [list(row) for row in buffers],
            "sums": [[len(s) for s in row] for row in sums],
            "moves": list(moves), "phase": phase, "step": step, "steps": steps,
            "stale": set(stale)}


def _ring_caption(st, n, ranks, algorithm, sent, last) -> str:
    """One frame's caption; ``sent``: (chunks each rank sent, bytes per chunk) or None."""
    ring = " \u2192 ".join(str(r) for r in list(ranks) + [ranks[0]])
    if st["phase"] == "start":
        if algorithm == "ring_all_gather":
            return f"Start: each of the {n} ranks holds one chunk. The ring: {ring}."
        return (f"Start: each of the {n} ranks holds its own tensor, cut into {n} chunks. "
                f"The ring: {ring}.")
    label = f"{st['phase'].replace('_', '-')} step {st['step'] + 1}/{st['steps']}: "
    if st["phase"] == "reduce_scatter":
        text = ("every rank sends one chunk to the next rank, which adds it to its own copy "
                "of that chunk.")
        if st["step"] == st["steps"] - 1:
            text += f" Each rank now owns one chunk summed over all {n} ranks (\u03a3 {n}/{n})."
    else:
        text = "every rank forwards a finished chunk to the next rank, which stores it."
    if last and sent:
        # The cost: read off rank 0's recorded sends, or the ring's count for one call.
        count, chunk = sent
        text += (f" Done: each rank sent {count} chunks of {chunk} bytes = "
                 f"{count * chunk} bytes")
        if algorithm == "ring_all_reduce":
            text += f", i.e. 2(N-1)/N \u00d7 the tensor's {chunk * n} bytes."
        else:
            text += f", i.e. (N-1)/N \u00d7 the full tensor's {chunk * n} bytes."
    return label + text


def _draw_ring(st: dict, ranks, cell_w: float, reduces: bool) -> str:
    """One frame: ranks as rows, chunks as columns, this step's moves as arrows."""
    n, chunks = len(ranks), len(st["buffers"][0])
    cell_h = 48 if reduces else 38
    left, col_gap, row_gap, top = 78.0, 12.0, 30.0, 46.0
    x = lambda c: left + c * (cell_w + col_gap)  # noqa: E731 - tiny layout helpers
    y = lambda p: top + p * (cell_h + row_gap)   # noqa: E731
    right_lane = x(chunks) - col_gap + 20
    top_lane, bottom_lane = top - 12, y(n - 1) + cell_h + 16
    body = []
    for c in range(chunks):  # column headers: a swatch and the chunk index
        cx = x(c) + cell_w / 2
        body.append(draw.rect(cx - 34, 8, 10, 10, draw.palette_color(c), rx=2))
        body.append(draw.text(cx + 6, 17, f"chunk {c}", size=12, fill=MUTED))
    senders = {(a, c) for a, b, c in st["moves"]}
    receivers = {(b, c) for a, b, c in st["moves"]}
    for p in range(n):
        body.append(draw.text(left - 14, y(p) + cell_h / 2 + 5, f"rank {ranks[p]}", size=13,
                              anchor="end", weight="600"))
        for c in range(chunks):
            values = st["buffers"][p][c]
            if values is None:  # all-gather: not arrived yet
                body.append(draw.rect(x(c), y(p), cell_w, cell_h, "#fafbfc", LINE, 1.2, dash="4 3"))
                continue
            share = st["sums"][p][c] / n if reduces else 1.0
            fill = draw.mix(draw.palette_color(c), 0.18 + (FULL - 0.18) * share)
            if (p, c) in st.get("stale", ()):  # old contents, about to be overwritten
                fill = OLD_COLOR
            ink = draw.text_color(fill)
            if (p, c) in receivers:
                stroke, width, dash = INK, 2.6, None
            elif (p, c) in senders:
                stroke, width, dash = INK, 1.6, "5 3"
            else:
                stroke, width, dash = draw.darken(draw.palette_color(c), 0.1), 0.8, None
            body.append(draw.rect(x(c), y(p), cell_w, cell_h, fill, stroke, width, dash))
            value_y = y(p) + (20 if reduces else cell_h / 2 + 4.5)
            body.append(draw.text(x(c) + cell_w / 2, value_y, _cell_text(values), mono=True,
                                  fill=ink))
            if reduces and values:
                body.append(draw.text(x(c) + cell_w / 2, y(p) + 38,
                                      f"\u03a3 {st['sums'][p][c]}/{n}", size=10.5, fill=ink))
    for a, b, c in st["moves"]:
        cx = x(c) + cell_w / 2
        color = draw.darken(draw.palette_color(c), 0.3)
        if b == a + 1:  # down to the next row, in the chunk's column
            body.append(draw.arrow([(cx, y(a) + cell_h + 2), (cx, y(b) - 2)], color))
        else:  # the ring closes: from the last row around the right edge back to the top
            body.append(draw.arrow([(cx, y(a) + cell_h + 2), (cx, bottom_lane),
                                   (right_lane, bottom_lane), (right_lane, top_lane),
                                   (cx, top_lane), (cx, y(b) - 2)], color))
    return draw.svg(right_lane + 14, bottom_lane + 10, body)


# --- library collectives, replayed chunk by chunk ---------------------------------------------
#
# A library collective (gloo's, NCCL's) is one call: the trace records what every rank held
# before and after it, not the messages inside.  To show the data move, each animation
# replays one standard schedule for that collective on the recorded values, the schedule
# whose step count the alpha-beta formulas of tutorial_lib.costs charge:
#
# * all-reduce: the ring (reduce-scatter, then all-gather), as tutorial_lib.ring_collectives runs
#   it: at reduce-scatter step s position i sends chunk (i - s - 1) mod N, at all-gather
#   step s chunk (i - s) mod N, always to position i + 1;
# * reduce-scatter: that ring's first phase; all-gather: its second;
# * broadcast: a pipelined chain from the root, one chunk per hop and step;
# * all-to-all: the pairwise exchange, at step s position i sends to i + s and receives
#   from i - s.
#
# Partial reductions are computed from the recorded inputs; a finished chunk, and every
# value in the last frame, is the value the trace recorded.

_REDUCERS = {"sum": lambda a, b: a + b, "max": max, "min": min, "product": lambda a, b: a * b}

_RING_NOTE = ("gloo ran this {op} as one call: the trace holds what every rank had before "
              "and after it. The frames replay {schedule} on those values; finished chunks "
              "are the recorded results.")


@dataclass
class _Block:
    """A run of dim-0 rows of one rank's tensor, drawn as cells side by side."""

    rows: list[list[float]] | None
    """Values per row; ``None`` for a buffer whose contents are not data yet."""
    color: str
    label: str = ""
    n_rows: int = 1
    """Rows to draw when ``rows`` is None."""
    style: str = "plain"
    """``plain``, ``sent`` (dashed outline) or ``arrived`` (bold outline)."""

    def cells(self) -> int:
        return len(self.rows) if self.rows is not None else self.n_rows


@dataclass
class _Frame:
    """One picture: per rank a row of columns, each column one block or nothing."""

    rows: list[tuple[int, list[_Block | None]]]
    caption: str
    arrows: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(from row, from column, to row, to column): a block moving to another place."""
    data: dict = field(default_factory=dict)
    headers: list[tuple[int, str]] = field(default_factory=list)
    """(column, text): a heading above the first row, starting at that column."""


def animate_collective(trace: Trace, op: str, call: int = 0) -> Animation:
    """One traced collective, step by step, drawn from each rank's recorded values.

    ``op``: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``,
    ``all_to_all`` (replayed chunk by chunk on the standard schedule of each, see the
    comment above), or ``send``/``recv``/``p2p`` for every send/recv pair in the trace
    (one frame per message).  Frame 0 shows the inputs, the last frame what every rank
    held afterwards, as recorded.  ``call`` picks the call-th call of ``op`` by the first
    group that made one.  To pick a call by its tags, filter the trace first:
    ``animate_collective(trace.filter(layer=3), "all_gather")``.
    """
    if op in P2P_OPS:
        frames, title, note = _p2p_frames(trace)
        return _rows_animation(frames, title, note)
    if op not in COLLECTIVES:
        raise ValueError(f"animate_collective: unknown op {op!r}; choose one of "
                         f"{', '.join(COLLECTIVES + P2P_OPS)} (ring algorithms: animate_ring)")
    ranks, chosen = _pick_call(trace, op, call)
    if op == "all_to_all":
        frames, title, note = _all_to_all_frames(ranks, chosen)
        return _rows_animation(frames, title, note, min_cell=32.0)
    return _chunk_animation(op, ranks, chosen)


def _rows_animation(frames: list[_Frame], title: str, note: str,
                    min_cell: float = 44.0) -> Animation:
    texts = [_cell_text(r) for f in frames for _, blocks in f.rows for b in blocks if b
             for r in (b.rows or [])]
    cell_w = max(min_cell, max((_text_width(t) + 16 for t in texts), default=min_cell))
    # Column widths are shared by every frame, so blocks stay put when the frame changes.
    columns = [0.0] * max(len(blocks) for f in frames for _, blocks in f.rows)
    for f in frames:
        for _, blocks in f.rows:
            for j, b in enumerate(blocks):
                if b is not None:
                    columns[j] = max(columns[j], _block_width(b, cell_w), len(b.label) * 6.4)
    svgs = [_draw_rows(f, cell_w, columns) for f in frames]
    return Animation(svgs, [f.caption for f in frames], title=title,
                     data=[f.data for f in frames], note=note, interval_ms=1600)


def _rows_of(values: list[float], shape: tuple[int, ...]) -> list[list[float]]:
    """Cut flat values into dim-0 rows (the width of a row comes from the recorded shape)."""
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    return [values[i:i + width] for i in range(0, len(values), width)]


def _pick_call(trace: Trace, op: str, call: int) -> tuple[tuple[int, ...], dict]:
    """The group of the first ``op`` event and each of its ranks' ``call``-th event."""
    events = [e for e in trace if e.op == op]
    if not events:
        raise ValueError(f"no {op} events in this trace; it holds ops "
                         f"{sorted({e.op for e in trace})}")
    ranks = events[0].group_ranks
    per_rank = {r: [e for e in events if e.rank == r and e.group_ranks == ranks] for r in ranks}
    if any(len(v) <= call for v in per_rank.values()):
        raise ValueError(f"call {call} of {op} on group {list(ranks)} is not in the trace "
                         f"(it holds {min(len(v) for v in per_rank.values())} calls)")
    return ranks, {r: per_rank[r][call] for r in ranks}


def _cut(rows: list[list[float]], parts: int) -> list[list[float]]:
    """``rows`` cut into ``parts`` chunks of consecutive rows (sizes differ by at most one,
    larger first, like ``torch.tensor_split``), each chunk as flat values."""
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for c in range(parts):
        stop = start + size + (c < extra)
        out.append([v for row in rows[start:stop] for v in row])
        start = stop
    return out


def _chunk_animation(op: str, ranks: tuple[int, ...], chosen: dict) -> Animation:
    """all-reduce, reduce-scatter, all-gather (a ring) and broadcast (a chain), chunk by chunk."""
    n = len(ranks)
    first = chosen[ranks[0]]
    inputs = {r: _rows_of(_need_values(e.values_in, e, f"the {op} input"), e.shape)
              for r, e in chosen.items()}
    outputs = {r: _rows_of(_need_values(e.values_out, e, f"the {op} output"), e.shape)
               for r, e in chosen.items()}
    reduce_op = first.tags.get("reduce_op", "sum")
    if op == "broadcast":
        states, parts = _broadcast_states(ranks, inputs, outputs, ranks.index(first.peer))
    else:
        states, parts = _ring_states(op, n, [inputs[r] for r in ranks],
                                     [outputs[r] for r in ranks], _REDUCERS[reduce_op])
    algorithm = {"all_reduce": "ring_all_reduce", "reduce_scatter": "ring_reduce_scatter",
                 "all_gather": "ring_all_gather", "broadcast": "broadcast"}[op]
    # What each rank sends if the collective runs as drawn (the library's byte convention).
    chunk_bytes = first.bytes // n if op != "all_gather" else first.bytes
    sent = ((2 * (n - 1) if op == "all_reduce" else n - 1), chunk_bytes) if n > 1 else None
    captions = []
    for i, st in enumerate(states):
        if op == "broadcast":
            captions.append(_broadcast_caption(st, n, ranks, ranks[states[0]["root"]], parts,
                                               first.bytes))
        elif st["phase"] == "after":
            captions.append(f"After: group rank j keeps only chunk j, the {reduce_op} of "
                            f"every rank's part j (the rest of its buffer was scratch).")
        else:
            last = i == len(states) - 1 or states[i + 1]["phase"] == "after"
            captions.append(_ring_caption(st, n, ranks, algorithm, sent, last))
    if op == "all_reduce" and reduce_op != "sum":
        captions = [c.replace("adds it to", f"takes the {reduce_op} with") for c in captions]
    cell_w = max(64.0, max(_text_width(_cell_text(v)) + 18 for st in states
                           for row in st["buffers"] for v in row if v is not None))
    reduces = op in ("all_reduce", "reduce_scatter")
    frames = [_draw_ring(st, ranks, cell_w, reduces) for st in states]
    data = []
    for st in states:
        data.append({"phase": st["phase"], "step": st["step"],
                     "buffers": {ranks[p]: row for p, row in enumerate(st["buffers"])},
                     "values": {ranks[p]: [v for chunk in row if chunk is not None
                                           for v in chunk]
                                for p, row in enumerate(st["buffers"])},
                     "moves": [(ranks[a], ranks[b], c) for a, b, c in st["moves"]]})
    name = op.replace("_", "-")
    title = (f"{name} over the {first.group_kind} group {list(ranks)}, traced, "
             f"replayed chunk by chunk")
    if op == "broadcast":
        note = (_RING_NOTE.format(op=name, schedule="a pipelined chain from the root") +
                " (gloo's own broadcast is a binomial tree.) Colour: chunk; grey: old values "
                "about to be overwritten. Arrow: the chunk sent this step.")
    else:
        schedule = {"all_reduce": "the ring (reduce-scatter, then all-gather) built by hand "
                                  "later in this chapter",
                    "reduce_scatter": "the first phase of the ring built by hand later in "
                                      "this chapter",
                    "all_gather": "the second phase of the ring built by hand later in this "
                                  "chapter"}[op]
        note = (_RING_NOTE.format(op=name, schedule=schedule) + " Colour: chunk index. "
                "Arrow: the chunk sent this step, from the dashed cell to the outlined cell "
                "that received it.")
        if reduces:
            note += " Shade and \u03a3 k/N: how many ranks' values a chunk holds so far."
    return Animation(frames, captions, title=title, data=data, note=note, interval_ms=1400)


def _ring_states(op: str, n: int, inputs: list, outputs: list, reducer) -> tuple[list, int]:
    """Ring frames for one library call: [position][chunk] buffers, step after step."""
    if op == "all_gather":
        buffers = [[None] * n for _ in range(n)]
        sums = [[set() for _ in range(n)] for _ in range(n)]
        for p in range(n):
            buffers[p][p] = _cut(inputs[p], 1)[0]
            sums[p][p] = {p}
        done = [_cut(outputs[p], n) for p in range(n)]
    else:
        buffers = [_cut(inputs[p], n) for p in range(n)]
        sums = [[{p} for _ in range(n)] for p in range(n)]
        if op == "reduce_scatter":  # the output is the position's own chunk only
            done = [[_cut(outputs[p], 1)[0] if c == p else None for c in range(n)]
                    for p in range(n)]
        else:
            done = [_cut(outputs[p], n) for p in range(n)]
    states = [_ring_state(buffers, sums, [], "start", 0, n - 1)]
    if op != "all_gather":
        for s in range(n - 1):
            before, held = [list(row) for row in buffers], [list(map(set, r)) for r in sums]
            moves = []
            for i in range(n):
                c, dst = (i - s - 1) % n, (i + 1) % n
                sums[dst][c] = held[dst][c] | held[i][c]
                if len(sums[dst][c]) == n and done[dst][c] is not None:
                    buffers[dst][c] = done[dst][c]  # finished: the recorded result
                else:
                    buffers[dst][c] = [reducer(a, b) for a, b in zip(before[dst][c],
                                                                     before[i][c])]
                moves.append((i, dst, c))
            states.append(_ring_state(buffers, sums, moves, "reduce_scatter", s, n - 1))
        if op == "reduce_scatter":
            kept = [[buffers[p][c] if c == p else None for c in range(n)] for p in range(n)]
            states.append(_ring_state(kept, sums, [], "after", 0, 0))
            return states, n
    for s in range(n - 1):
        before = [list(row) for row in buffers]
        moves = []
        for i in range(n):
            c, dst = (i - s) % n, (i + 1) % n
            buffers[dst][c] = done[dst][c] if done[dst][c] is not None else before[i][c]
            sums[dst][c] = set(range(n)) if op != "all_gather" else {c}
            moves.append((i, dst, c))
        states.append(_ring_state(buffers, sums, moves, "all_gather", s, n - 1))
    return states, n


def _broadcast_states(ranks, inputs: dict, outputs: dict, root: int) -> tuple[list, int]:
    """A pipelined chain from ``root`` (a position): chunk c crosses hop j at step c + j."""
    n = len(ranks)
    parts = max(1, min(len(inputs[ranks[root]]), n))
    buffers = [_cut(inputs[r], parts) for r in ranks]
    done = [_cut(outputs[r], parts) for r in ranks]
    chain = [(root + j) % n for j in range(n)]
    stale = {(p, c) for p in range(n) if p != root for c in range(parts)}
    sums = [[{p} for _ in range(parts)] for p in range(n)]
    steps = n - 1 + parts - 1 if n > 1 else 0
    states = [dict(_ring_state(buffers, sums, [], "start", 0, steps, stale), root=root)]
    for t in range(steps):
        moves = []
        for j in range(n - 1):
            c = t - j
            if 0 <= c < parts:
                src, dst = chain[j], chain[j + 1]
                buffers[dst][c] = done[dst][c]
                stale.discard((dst, c))
                moves.append((src, dst, c))
        states.append(dict(_ring_state(buffers, sums, moves, "broadcast", t, steps, stale),
                           root=root))
    return states, parts


def _broadcast_caption(st, n, ranks, root, parts, nbytes) -> str:
    if st["phase"] == "start":
        chain = " \u2192 ".join(str(ranks[(ranks.index(root) + j) % n]) for j in range(n))
        return (f"Before: rank {root} holds the tensor, cut into {parts} chunks; the others' "
                f"buffers hold old values. The chain: {chain}.")
    hops = ", ".join(f"chunk {c}: {ranks[a]} \u2192 {ranks[b]}" for a, b, c in st["moves"])
    text = f"broadcast step {st['step'] + 1}/{st['steps']}: {hops}."
    if st["step"] == st["steps"] - 1:
        text += (f" Done after N-1 + chunks-1 = {st['steps']} steps: every rank holds rank "
                 f"{root}'s {nbytes} bytes, and each rank but the last sent them once.")
    return text


def _all_to_all_frames(ranks, chosen: dict) -> tuple[list[_Frame], str, str]:
    """The pairwise exchange: step 0 keeps each rank's own block, step s sends to i + s."""
    n = len(ranks)
    color = {r: draw.mix(draw.palette_color(p), FULL) for p, r in enumerate(ranks)}
    sends, receives, send_labels, recv_labels = {}, {}, {}, {}
    for r, e in chosen.items():
        rows = _rows_of(_need_values(e.values_in, e, "the all_to_all input"), e.shape)
        got = _rows_of(_need_values(e.values_out, e, "the all_to_all output"), e.shape)
        sends[r] = _split_rows(rows, e.splits["input"])
        receives[r] = _split_rows(got, e.splits["output"])
        send_labels[r] = [_split_label("\u2192", ranks[j], k)
                          for j, k in enumerate(e.splits["input"])]
        recv_labels[r] = [_split_label("\u2190", ranks[j], k)
                          for j, k in enumerate(e.splits["output"])]
    labels = {"send": send_labels, "receive": recv_labels}

    def frame(arrived: set, moving: list, caption: str, step: int) -> _Frame:
        rows, arrows = [], []
        moved_from = {(a, b) for a, b in moving}
        for p, r in enumerate(ranks):
            blocks: list[_Block | None] = []
            for j in range(n):  # the send buffer, by destination
                style = "sent" if (p, j) in moved_from else "plain"
                blocks.append(_Block(sends[r][j], color[r], send_labels[r][j], style=style))
            blocks.append(None)  # a gap between the two buffers
            for j in range(n):  # the receive buffer, by source
                style = "arrived" if (j, p) in moved_from else "plain"
                got = receives[r][j] if (j, p) in arrived else None
                blocks.append(_Block(got, color[ranks[j]], recv_labels[r][j],
                                     n_rows=len(receives[r][j]), style=style))
            rows.append((r, blocks))
        for a, b in moving:
            arrows.append((a, b, b, n + 1 + a))
        values = {r: [v for j in range(n) if (j, p) in arrived for row in receives[r][j]
                      for v in row] for p, r in enumerate(ranks)}
        if step < 0:
            values = {r: [v for block in sends[r] for row in block for v in row]
                      for r in ranks}
        data = {"step": step, "values": values, "labels": labels,
                "moves": [(ranks[a], ranks[b], len(sends[ranks[a]][b])) for a, b in moving]}
        return _Frame(rows, caption, arrows, data,
                      headers=[(0, "send buffer (block j goes to group rank j)"),
                               (n + 1, "receive buffer (block j came from group rank j)")])

    split_text = "; ".join(f"r{r} {chosen[r].splits['input']}" for r in ranks)
    frames = [frame(set(), [], f"Before: each rank cuts its input by its input splits "
                               f"({split_text}); block j goes to group rank j.", -1)]
    arrived = {(p, p) for p in range(n)}
    frames.append(frame(set(arrived), [(p, p) for p in range(n)],
                        "Step 0: every rank copies the block addressed to itself; it never "
                        "leaves the rank.", 0))
    for s in range(1, n):
        moving = [(p, (p + s) % n) for p in range(n)]
        arrived |= set(moving)
        text = ", ".join(f"{ranks[a]} \u2192 {ranks[b]}" for a, b in moving)
        caption = (f"Exchange step {s}/{n - 1}: every rank sends to the rank {s} after it "
                   f"and receives from the rank {s} before it ({text}).")
        if s == n - 1:
            caption += (" Done: each rank holds the rows it received, in sender order "
                        "(uneven splits are normal: MoE routing sends each token to the rank "
                        "of its expert).")
        frames.append(frame(set(arrived), moving, caption, s))
    first = chosen[ranks[0]]
    title = (f"all-to-all over the {first.group_kind} group {list(ranks)}, traced, "
             f"replayed as a pairwise exchange")
    note = ("gloo ran this all-to-all as one call: the trace holds every rank's input, "
            "splits and output. The frames replay the pairwise exchange (N-1 steps, the "
            "schedule behind (N-1)\u03b1 in the cost model) on those values. Colour: the "
            "sending rank. Each cell is one row (dim 0). Dashed: the block sent this step; "
            "bold: where it arrived.")
    return frames, title, note


def _split_rows(rows, sizes) -> list[list[list[float]]]:
    out, start = [], 0
    for size in sizes:
        out.append(rows[start:start + size])
        start += size
    return out


def _split_label(direction: str, rank: int, size: int) -> str:
    return f"{direction} r{rank}: {size} row{'' if size == 1 else 's'}"


def _block_data(rows) -> dict:
    """What a frame shows, as numbers: per rank its values in drawing order, and the labels."""
    return {"values": {r: [v for b in blocks if b for row in (b.rows or []) for v in row]
                       for r, blocks in rows},
            "labels": {r: [b.label for b in blocks if b] for r, blocks in rows}}


def _p2p_frames(trace: Trace) -> tuple[list[_Frame], str, str]:
    """Pair every send with its receive: frame 0 shows what waits to be sent, then one
    frame per message.  Each message has its own column, so it moves straight up or down."""
    sends = [e for e in trace if e.op == "send"]
    recvs = [e for e in trace if e.op == "recv"]
    if not sends:
        raise ValueError(f"no send events in this trace; it holds ops "
                         f"{sorted({e.op for e in trace})}")
    waiting: dict[tuple[int, int], list[TraceEvent]] = {}
    for r in recvs:  # the k-th send from a to b meets the k-th receive on b from a
        waiting.setdefault((r.peer, r.rank), []).append(r)
    messages = []
    for s in sends:
        pending = waiting.get((s.rank, s.peer))
        if not pending:
            raise ValueError(f"the send from rank {s.rank} to rank {s.peer} has no matching "
                             f"recv in this trace")
        messages.append((s, pending.pop(0)))
    ranks = sorted({e.rank for e in sends + recvs})
    row_of = {r: i for i, r in enumerate(ranks)}
    color = {r: draw.mix(draw.palette_color(i), FULL) for i, r in enumerate(ranks)}

    def frame(delivered: int, caption: str) -> _Frame:
        columns = {r: [None] * len(messages) for r in ranks}
        for m, (s, r) in enumerate(messages):
            rows = _rows_of(_need_values(s.values_in, s, "a sent tensor"), s.shape)
            latest = m == delivered - 1
            columns[s.rank][m] = _Block(rows, color[s.rank], f"#{m + 1} \u2192 r{r.rank}",
                                        style="sent" if latest else "plain")
            got = (_rows_of(_need_values(r.values_out, r, "a received tensor"), r.shape)
                   if m < delivered else None)
            columns[r.rank][m] = _Block(got, color[s.rank], f"#{m + 1} \u2190 r{s.rank}",
                                        n_rows=len(rows), style="arrived" if latest else "plain")
        arrows = []
        if delivered:
            s, r = messages[delivered - 1]
            arrows.append((row_of[s.rank], delivered - 1, row_of[r.rank], delivered - 1))
        rows = [(r, columns[r]) for r in ranks]
        return _Frame(rows, caption, arrows, data=_block_data(rows))

    count = f"{len(messages)} message{'s' if len(messages) != 1 else ''}"
    frames = [frame(0, f"Before: {count} to send, numbered in the order they were posted; "
                       f"dashed: receive buffers, still empty.")]
    for m, (s, r) in enumerate(messages):
        frames.append(frame(m + 1, f"Message {m + 1}/{len(messages)}: rank {s.rank} sends "
                                   f"{s.bytes} bytes (shape {tuple(s.shape)}) to rank {r.rank}."))
    note = ("Colour: the sending rank. Each cell is one row (dim 0) of a tensor. "
            "Dashed outline: the copy that left; bold: where it arrived.")
    return frames, f"Point-to-point messages between ranks {ranks}, traced", note


_LEFT, _ROW_H, _ROW_GAP, _TOP, _COL_GAP = 78.0, 34.0, 34.0, 20.0, 16.0


def _block_width(b: _Block, cell_w: float) -> float:
    return b.cells() * cell_w if b.cells() else 14.0  # a zero-row split: a thin empty slot


def _draw_rows(frame: _Frame, cell_w: float, columns: list[float]) -> str:
    """One frame: a row per rank, its blocks in shared columns, arrows from block to block."""
    top = _TOP + (20.0 if frame.headers else 0.0)
    col_x = [_LEFT + sum(columns[:j]) + _COL_GAP * j for j in range(len(columns))]
    row_y = [top + i * (_ROW_H + _ROW_GAP) for i in range(len(frame.rows))]
    body = []
    for j, text in frame.headers:
        body.append(draw.text(col_x[j], 14, text, size=12, anchor="start", fill=INK,
                              weight="600"))
    for i, (rank, blocks) in enumerate(frame.rows):
        y = row_y[i]
        body.append(draw.text(_LEFT - 14, y + _ROW_H / 2 + 5, f"rank {rank}", size=13,
                              anchor="end", weight="600"))
        for j, b in enumerate(blocks):
            if b is None:
                continue
            x, w = col_x[j], _block_width(b, cell_w)
            body.append(draw.text(x, y - 6, b.label, size=11, anchor="start", fill=MUTED))
            if b.rows is None or b.cells() == 0:  # an empty receive buffer, or a zero-row split
                body.append(draw.rect(x, y, w, _ROW_H, "#fafbfc", LINE, 1.2, dash="4 3", rx=4))
            else:
                ink = draw.text_color(b.color)
                body.append(draw.rect(x, y, w, _ROW_H, b.color, draw.darken(b.color, 0.15),
                                      0.8, rx=4))
                for k, row in enumerate(b.rows):
                    if k:  # thin separators between the rows of one block
                        sx = x + k * cell_w
                        body.append(f'<line x1="{sx:.1f}" y1="{y + 6:.1f}" x2="{sx:.1f}" '
                                    f'y2="{y + _ROW_H - 6:.1f}" stroke="{ink}" '
                                    f'stroke-opacity="0.3" stroke-width="1"/>')
                    body.append(draw.text(x + (k + 0.5) * cell_w, y + _ROW_H / 2 + 4.5,
                                          _cell_text(row), mono=True, fill=ink))
            if b.style != "plain":
                body.append(draw.rect(x - 2.5, y - 2.5, w + 5, _ROW_H + 5, "none", INK,
                                      2.6 if b.style == "arrived" else 1.6,
                                      dash="5 3" if b.style == "sent" else None, rx=6))
    for a, ja, b, jb in frame.arrows:
        source = frame.rows[a][1][ja]
        ax = col_x[ja] + _block_width(source, cell_w) / 2
        bx = col_x[jb] + _block_width(frame.rows[b][1][jb], cell_w) / 2
        if b == a:  # within one rank: a short detour under its row
            low = row_y[a] + _ROW_H + 11
            points = [(ax, row_y[a] + _ROW_H + 4), (ax, low), (bx, low),
                      (bx, row_y[a] + _ROW_H + 4)]
        elif b > a:  # down: from under the sender to above the receiver's label
            points = [(ax, row_y[a] + _ROW_H + 4), (bx, row_y[b] - 17)]
        else:
            points = [(ax, row_y[a] - 17), (bx, row_y[b] + _ROW_H + 4)]
        body.append(draw.arrow(points, draw.darken(source.color, 0.35), 2.0))
    width = col_x[-1] + columns[-1] + 20
    height = row_y[-1] + _ROW_H + 14
    return draw.svg(width, height, body)


__all__ = ["Animation", "animate_ring_all_reduce", "animate_ring", "animate_collective"]
