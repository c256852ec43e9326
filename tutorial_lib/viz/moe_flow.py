"""Token flow of a mixture-of-experts layer between expert-parallel ranks, drawn from a trace.

An MoE layer with expert parallelism moves tokens twice per forward pass: the
*dispatch* all-to-all sends every token copy (one per token and chosen expert)
to the EP rank that holds its expert, and the *combine* all-to-all, its mirror,
brings the experts' outputs back.  Both are uneven: how many copies go from
rank ``i`` to rank ``j`` is whatever the router decided.  This module draws
those numbers exactly as the ranks recorded them, from each all-to-all event's
``splits`` (:class:`~tutorial_lib.trace.TraceEvent`); nothing is simulated::

    out = launch(work, 4, capture_values=64)   # values: only for per-expert counts
    dispatch_matrix(out.trace)                 # [[2, 4, 6, 0], ...]: S[src][dst]
    animate_token_flow(out.trace)              # the player

The send matrix of one all-to-all call is ``S[i][j] = splits["input"][j]`` of
group rank ``i``'s event, and it must equal ``splits["output"][i]`` of group
rank ``j``'s event (what ``j`` expected from ``i``); a trace where the two
disagree is refused with the cells that differ.

Which events: every ``all_to_all`` with recorded splits, except the ones tagged
``payload="counts"`` (:mod:`tutorial_lib.moe` exchanges the per-expert counts
before the tokens; they are read as metadata, see below).  Events tagged
``op_name="dispatch"`` / ``"combine"`` and ``phase="forward"`` / ``"backward"``
(as :class:`tutorial_lib.moe.AllToAllDispatcher` tags them) are taken by name;
in an untagged trace the ``call``-th all-to-all of the group is the dispatch
and the next one is its combine when its matrix is the transpose.

Per-expert counts (optional): the counts all-to-all's values (record them with
``capture_values`` at least ``EP * N/EP``), or a ``tokens_per_expert`` tag on the
token all-to-all events (the copies that rank sends to each global expert, a
list of ``EP * N/EP``).  With them, arrivals are grouped per local expert and
each copy is shaded by its expert; without them, only per-rank counts are drawn.

The player is the course's :class:`~tutorial_lib.viz.widget.Animation`:
precomputed SVG frames and the shared player script, inlined, so it plays in the static book.
The phase pills above each frame are buttons: a click (or Enter) jumps to the first frame
of that phase (``moe_flow.js``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..trace import Trace, TraceEvent
from . import draw
from .draw import INK, KIND_COLORS, LINE, MUTED
from .widget import Animation

__all__ = ["TokenFlow", "TokenFlowAnimation", "animate_token_flow", "dispatch_matrix"]

IDLE = "#9a6700"            # text of a rank or expert that received nothing (amber: no rank uses it)
IDLE_FILL = "#fff8e1"
IDLE_LINE = "#d4a72c"
BAND = "#f6f8fa"            # the background band of one rank
BOX = "#ffffff"
MAX_SQUARES = 96            # squares in one box before a square stands for several copies


# --- reading the trace -------------------------------------------------------------------


def _phase(e: TraceEvent) -> str:
    """An untagged all-to-all counts as forward."""
    return e.tags.get("phase", "forward")


def _token_events(trace: Trace, layer) -> list[TraceEvent]:
    events = [e for e in trace if e.op == "all_to_all" and e.splits is not None]
    if not events:
        raise ValueError(f"no all_to_all events with recorded splits in this trace; it holds ops "
                         f"{sorted({e.op for e in trace}) or 'none'}. Record one with "
                         f"tutorial_lib.comm.all_to_all (or an MoE layer) inside a launch")
    if layer is not None:
        layers = sorted({str(e.tags.get("layer")) for e in events})
        events = [e for e in events if e.tags.get("layer") == layer]
        if not events:
            raise ValueError(f"no all_to_all events tagged layer={layer!r}; the trace's "
                             f"all-to-alls carry layer tags {layers}")
    return events


def _pick_group(events: list[TraceEvent], ranks) -> tuple[int, ...]:
    groups: list[tuple[int, ...]] = []
    for e in events:
        if e.group_ranks not in groups:
            groups.append(e.group_ranks)
    if ranks is not None:
        if tuple(ranks) not in groups:
            raise ValueError(f"no all_to_all on ranks {list(ranks)} in this trace; its "
                             f"all-to-alls ran on {[list(g) for g in groups]}")
        return tuple(ranks)
    ep = [e.group_ranks for e in events if e.group_kind == "ep"]
    return ep[0] if ep else groups[0]


def _calls(events: list[TraceEvent], group: tuple[int, ...], what: str) -> list[dict[int, TraceEvent]]:
    """The calls of one group: call k is the k-th matching event of every group rank."""
    per_rank = {r: [e for e in events if e.rank == r and e.group_ranks == group] for r in group}
    counts = {r: len(v) for r, v in per_rank.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"the ranks of group {list(group)} recorded different numbers of {what} "
                         f"all-to-alls ({', '.join(f'rank {r}: {c}' for r, c in counts.items())}): "
                         f"the trace must hold every rank's events of one launch")
    return [{r: per_rank[r][k] for r in group} for k in range(next(iter(counts.values())))]


def _matrix(call: dict[int, TraceEvent], group: tuple[int, ...], what: str) -> list[list[int]]:
    """``S[i][j]``: rows group rank i sent to group rank j, checked against what j received."""
    n = len(group)
    for r in group:
        s = call[r].splits or {}
        if len(s.get("input", ())) != n or len(s.get("output", ())) != n:
            raise ValueError(f"{what}: rank {r}'s splits {s} do not have one entry per rank of "
                             f"the group {list(group)}")
    send = [[int(call[src].splits["input"][j]) for j in range(n)] for src in group]
    recv = [[int(call[dst].splits["output"][i]) for i in range(n)] for dst in group]
    bad = [(i, j) for i in range(n) for j in range(n) if send[i][j] != recv[j][i]]
    if bad:
        cells = "; ".join(f"rank {group[i]} sends {send[i][j]} rows to rank {group[j]} "
                          f"(its splits['input'][{j}]) but rank {group[j]} expects {recv[j][i]} "
                          f"(its splits['output'][{i}])" for i, j in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise ValueError(f"inconsistent all-to-all splits in {what} on group {list(group)}: "
                         f"{cells}{more}. The events are not one all-to-all call: pick one with "
                         f"layer=/call=, or filter the trace first")
    return send


def _transpose(m: list[list[int]]) -> list[list[int]]:
    return [list(row) for row in zip(*m)]


def _select(events, op_name=None, phase=None) -> list[TraceEvent]:
    return [e for e in events if (op_name is None or e.tags.get("op_name") == op_name)
            and (phase is None or _phase(e) == phase)]


def dispatch_matrix(trace: Trace, op_name: str | None = None, phase: str | None = "forward",
                    call: int = 0, *, layer=None, ranks: list[int] | None = None) -> list[list[int]]:
    """The send matrix ``S[i][j]`` (token rows from group rank i to group rank j) of one all-to-all.

    ``op_name`` (e.g. ``"dispatch"``, ``"combine"``) and ``phase`` (``"forward"``,
    ``"backward"``; ``None``: any; an untagged event counts as forward) filter the
    events by their tags; ``call`` picks the call-th match of the group; ``layer``
    keeps events tagged with that layer; ``ranks`` picks a group when several ran
    (default: the first ``ep`` group, else the first group).  Rows and columns are
    in group order.  Raises ``ValueError`` when the senders' ``splits["input"]``
    and the receivers' ``splits["output"]`` disagree.
    """
    events = [e for e in _token_events(trace, layer) if e.tags.get("payload") != "counts"]
    if not events:
        raise ValueError("this trace holds only the counts all-to-all (payload='counts'), "
                         "no token all-to-all")
    group = _pick_group(events, ranks)
    chosen = _select([e for e in events if e.group_ranks == group], op_name, phase)
    what = " ".join(x for x in (op_name, phase) if x) or "all_to_all"
    calls = _calls(chosen, group, what)
    if not 0 <= call < len(calls):
        raise ValueError(f"call {call} of the {what} all-to-all on group {list(group)} is not in "
                         f"the trace (it holds {len(calls)} call{'s' if len(calls) != 1 else ''})")
    return _matrix(calls[call], group, f"{what} call {call}")


@dataclass
class TokenFlow:
    """The numbers one token-flow animation draws (all from the trace)."""

    ranks: list[int]
    """Global ranks of the EP group, in group order (the matrices' row/column order)."""
    group_kind: str | None
    dispatch: list[list[int]]
    """``S[i][j]``: token copies group rank i sent to group rank j."""
    combine: list[list[int]] | None = None
    """The recorded combine matrix (the transpose of ``dispatch``), or None if not recorded."""
    backward: dict[str, list[list[int]]] | None = None
    """``{"combine": ..., "dispatch": ...}``: the backward all-to-alls' matrices, when drawn."""
    experts_per_rank: int | None = None
    expert_counts: list[list[int]] | None = None
    """``C[i][e]``: copies group rank i sent to global expert e (None: not recorded)."""
    layer: object = None
    call: int = 0
    scale: int = 1
    """Token copies per drawn square (1 unless the counts are large)."""
    notes: list[str] = field(default_factory=list)

    @property
    def sent(self) -> list[int]:
        return [sum(row) for row in self.dispatch]

    @property
    def received(self) -> list[int]:
        return [sum(col) for col in zip(*self.dispatch)]

    def per_local_expert(self, j: int) -> list[int] | None:
        """Copies group rank j's local experts received (summed over senders)."""
        if self.expert_counts is None:
            return None
        L = self.experts_per_rank
        return [sum(row[j * L + l] for row in self.expert_counts) for l in range(L)]

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "group_kind": self.group_kind,
                "dispatch": self.dispatch, "combine": self.combine, "backward": self.backward,
                "experts_per_rank": self.experts_per_rank, "expert_counts": self.expert_counts,
                "sent": self.sent, "received": self.received, "scale": self.scale}


def _expert_counts(events, group, call, S, tagged_dispatch: dict[int, TraceEvent],
                   experts_per_rank) -> tuple[int | None, list[list[int]] | None, list[str]]:
    """Per-expert counts from the counts all-to-all (or a ``tokens_per_expert`` tag)."""
    n, notes = len(group), []
    counts_events = [e for e in events if e.group_ranks == group and e.op == "all_to_all"
                     and e.tags.get("payload") == "counts" and _phase(e) == "forward"]
    L, C = None, None
    if counts_events:
        calls = _calls(counts_events, group, "counts")
        if call < len(calls):
            chosen = calls[call]
            shape = chosen[group[0]].shape
            if len(shape) == 2 and shape[0] == n:
                L = int(shape[1])
            values = [chosen[r].values_in for r in group]
            if L is not None and all(v is not None and len(v) == n * L for v in values):
                C = [[int(x) for x in v] for v in values]
                for j, dst in enumerate(group):  # what j received from i is what i sent to j
                    got = chosen[dst].values_out
                    for i in range(n):
                        if got is not None and [int(x) for x in got[i * L:(i + 1) * L]] != \
                                C[i][j * L:(j + 1) * L]:
                            raise ValueError(
                                f"the counts all-to-all is inconsistent: rank {group[i]} sent "
                                f"{C[i][j * L:(j + 1) * L]} to rank {dst}'s experts, which "
                                f"received {got[i * L:(i + 1) * L]}")
            elif L is not None:
                notes.append(f"per-expert counts not recorded: launch with capture_values >= "
                             f"{n * L} to see each expert's share")
    if C is None and all("tokens_per_expert" in tagged_dispatch[r].tags for r in group):
        C = [[int(x) for x in tagged_dispatch[r].tags["tokens_per_expert"]] for r in group]
        if any(len(row) % n for row in C) or len({len(row) for row in C}) != 1:
            raise ValueError(f"tokens_per_expert tags must list EP * experts-per-rank counts on "
                             f"every rank, got lengths {[len(row) for row in C]} for EP = {n}")
        L = len(C[0]) // n
    if experts_per_rank is not None:
        if L is not None and experts_per_rank != L:
            raise ValueError(f"experts_per_rank={experts_per_rank} but the recorded counts hold "
                             f"{L} experts per rank (shape of the counts all-to-all)")
        L = experts_per_rank
    if C is not None:
        for i in range(n):
            for j in range(n):
                if sum(C[i][j * L:(j + 1) * L]) != S[i][j]:
                    raise ValueError(
                        f"per-expert counts disagree with the token splits: rank {group[i]} "
                        f"counts {C[i][j * L:(j + 1) * L]} copies for rank {group[j]}'s experts "
                        f"(sum {sum(C[i][j * L:(j + 1) * L])}) but its token all-to-all sends "
                        f"{S[i][j]} rows there")
    return L, C, notes


def _read_flow(trace: Trace, layer, call: int, ranks, include_backward: bool,
               experts_per_rank) -> TokenFlow:
    events = _token_events(trace, layer)
    tokens = [e for e in events if e.tags.get("payload", "tokens") == "tokens"]
    if not tokens:
        raise ValueError("this trace holds only the counts all-to-all (payload='counts'), "
                         "no token all-to-all")
    group = _pick_group(tokens, ranks)
    mine = [e for e in tokens if e.group_ranks == group]
    kind = mine[0].group_kind
    named = _select(mine, "dispatch", "forward")
    backward = None
    if named:  # tagged like tutorial_lib.moe: take each all-to-all by its name
        dispatch_calls = _calls(named, group, "dispatch")
        if not 0 <= call < len(dispatch_calls):
            raise ValueError(f"call {call} of the dispatch all-to-all on group {list(group)} is "
                             f"not in the trace (it holds {len(dispatch_calls)})")
        d_call = dispatch_calls[call]
        S = _matrix(d_call, group, f"dispatch call {call}")
        combine_calls = _calls(_select(mine, "combine", "forward"), group, "combine")
        combine = (_matrix(combine_calls[call], group, f"combine call {call}")
                   if call < len(combine_calls) else None)
        if include_backward:
            found = {}
            for name in ("combine", "dispatch"):
                bw = _calls(_select(mine, name, "backward"), group, f"{name} backward")
                if call < len(bw):
                    found[name] = _matrix(bw[call], group, f"{name} backward call {call}")
            missing = [name for name in ("combine", "dispatch") if name not in found]
            if missing:
                raise ValueError(f"include_backward=True, but the trace holds no backward "
                                 f"all-to-all of {' or '.join(missing)} (tag phase='backward') "
                                 f"for call {call}: run backward inside the launch, e.g. "
                                 f"y.sum().backward()")
            backward = found
    else:  # untagged: the call-th all-to-all, and the next one if it is the mirror
        forward = _calls(_select(mine, None, "forward"), group, "forward")
        if not 0 <= call < len(forward):
            raise ValueError(f"call {call} of the all-to-all on group {list(group)} is not in the "
                             f"trace (it holds {len(forward)})")
        d_call = forward[call]
        S = _matrix(d_call, group, f"all_to_all call {call}")
        combine = None
        if call + 1 < len(forward):
            nxt = _matrix(forward[call + 1], group, f"all_to_all call {call + 1}")
            combine = nxt if nxt == _transpose(S) else None
        if include_backward:
            raise ValueError("include_backward=True needs all-to-alls tagged op_name='dispatch'/"
                             "'combine' and phase='backward' (as tutorial_lib.moe records them); "
                             "this trace's all-to-alls carry no such tags")
    if combine is not None and combine != _transpose(S):
        raise ValueError(f"the combine all-to-all (call {call}) is not the mirror of the dispatch: "
                         f"dispatch {S}, combine {combine} (expected the transpose)")
    if backward is not None and (backward["combine"] != S or backward["dispatch"] != _transpose(S)):
        raise ValueError(f"the backward all-to-alls do not mirror the forward ones: dispatch {S}, "
                         f"combine's backward {backward['combine']} (expected the dispatch matrix), "
                         f"dispatch's backward {backward['dispatch']} (expected its transpose)")
    L, C, notes = _expert_counts(events, group, call, S, d_call, experts_per_rank)
    return TokenFlow(list(group), kind, S, combine, backward, L, C, layer, call, notes=notes)


# --- layout -------------------------------------------------------------------------------

SQUARES = ((40, 12.0, 15.0, 10), (None, 9.0, 11.0, 12))
"""(most squares in one box, square size, pitch, squares per line): big squares for few tokens."""
PAD = 6.0                   # inside a box
LEFT = 84.0                 # x of the sender boxes (rank labels left of it)
FLOW_W = 200.0              # the gap the flows cross
TOP = 64.0                  # y of the first rank band (phase stepper and headings above)
BAND_GAP = 12.0
HEAD = 17.0                 # a box's heading line, inside the band
SUB_HEAD = 14.0             # an expert box's heading
MATRIX_GAP = 44.0


def _expert_shades(L: int) -> list[float]:
    if L <= 1:
        return [1.0]
    return [1.0 - 0.55 * l / (L - 1) for l in range(L)]


@dataclass
class _Square:
    i: int          # sender (group position)
    j: int          # receiver
    l: int          # local expert at the receiver (0 when unknown)
    k: int          # index within its (i, j) flow
    src: tuple[float, float] = (0.0, 0.0)
    dst: tuple[float, float] = (0.0, 0.0)


class _Layout:
    """Where every box and every square sits; shared by all frames so nothing jumps."""

    def __init__(self, flow: TokenFlow):
        self.flow = flow
        n = self.n = len(flow.ranks)
        S = flow.dispatch
        self.by_expert = flow.expert_counts is not None
        self.L = flow.experts_per_rank or 1
        Lb = self.L if self.by_expert else 1  # expert boxes per receiver
        self.Lb = Lb

        def pieces(i, j):  # copies from i to j, per drawn expert box
            if self.by_expert:
                return [flow.expert_counts[i][j * self.L + l] for l in range(self.L)]
            return [S[i][j]]

        biggest = max([sum(r) for r in S] + [sum(c) for c in zip(*S)] + [1])
        flow.scale = self.scale = max(1, math.ceil(biggest / MAX_SQUARES))
        for most, sq, pitch, cols in SQUARES:
            if most is None or biggest <= most:
                self.sq, self.pitch, self.cols = sq, pitch, cols
                break
        cols, pitch, sq = self.cols, self.pitch, self.sq
        self.units = {(i, j, l): math.ceil(c / self.scale) for i in range(n) for j in range(n)
                      for l, c in enumerate(pieces(i, j))}
        self.dst_cols = max(3, round(cols / Lb)) if Lb > 1 else cols
        src_lines = max(math.ceil(sum(self.units[i, j, l] for j in range(n) for l in range(Lb))
                                  / cols) for i in range(n))
        dst_lines = max(math.ceil(sum(self.units[i, j, l] for i in range(n)) / self.dst_cols)
                        for j in range(n) for l in range(Lb))
        self.lines = max(1, src_lines, dst_lines)
        self.box_h = self.lines * pitch + 2 * PAD - (pitch - sq)
        self.src_w = cols * pitch + 2 * PAD - (pitch - sq)
        self.sub_w = self.dst_cols * pitch + 2 * PAD - (pitch - sq)
        self.sub_gap = 6.0
        self.dst_x = LEFT + self.src_w + FLOW_W
        self.dst_w = Lb * self.sub_w + (Lb - 1) * self.sub_gap
        self.sub_head = SUB_HEAD if self.L > 1 or self.by_expert else 0.0
        self.band_h = 8 + HEAD + self.sub_head + self.box_h + 8
        self.band_y = [TOP + p * (self.band_h + BAND_GAP) for p in range(n)]
        self.right = max(self.dst_x + self.dst_w, self.dst_x + 150) + 14
        # the matrix panel
        self.cell = 30.0 if n <= 8 else max(18.0, 240.0 / n)
        self.mx = self.right + MATRIX_GAP + 34
        self.my = TOP + 22
        self.matrix_bottom = self.my + (n + 1) * self.cell + 62
        self.width = max(self.mx + (n + 1) * self.cell + 24, self.mx - 34 + 250)
        rows_bottom = self.band_y[-1] + self.band_h
        self.legend_y = max(rows_bottom, self.matrix_bottom) + 22
        self.height = self.legend_y + 16
        # the squares, with their slot in the sender's box and in the receiver's expert box
        self.squares: list[_Square] = []
        src_slot = [0] * n
        for i in range(n):
            for j in range(n):
                k = 0
                for l in range(Lb):
                    for _ in range(self.units[i, j, l]):
                        square = _Square(i, j, l, k)
                        square.src = self._slot(self.src_box(i), cols, src_slot[i])
                        src_slot[i] += 1
                        self.squares.append(square)
                        k += 1
        for j in range(n):  # at the receiver: per expert box, in sender order
            for l in range(Lb):
                arriving = [q for q in self.squares if (q.j, q.l) == (j, l)]
                for slot, square in enumerate(sorted(arriving, key=lambda q: (q.i, q.k))):
                    square.dst = self._slot(self.expert_box(j, l), self.dst_cols, slot)

    def _slot(self, box, cols, s):
        x, y, _, _ = box
        return (x + PAD + (s % cols) * self.pitch, y + PAD + (s // cols) * self.pitch)

    def src_box(self, p):
        return (LEFT, self.band_y[p] + 8 + HEAD + self.sub_head, self.src_w, self.box_h)

    def expert_box(self, p, l):
        x = self.dst_x + l * (self.sub_w + self.sub_gap)
        return (x, self.band_y[p] + 8 + HEAD + self.sub_head, self.sub_w, self.box_h)

    def mid(self, p):
        x, y, w, h = self.src_box(p)
        return y + h / 2

    def end_offset(self, k):
        """Vertical spread of the flows meeting one box, so their ends do not coincide."""
        step = min(6.0, (self.box_h - 10) / max(self.n - 1, 1))
        return (k - (self.n - 1) / 2) * step


# --- drawing ------------------------------------------------------------------------------


def _square(x, y, color, style, fly=None, delay=0.0, size=9.0) -> str:
    """One token copy: ``filled``, ``output`` (after its expert ran), ``ghost`` (it left),
    ``grad`` (a gradient, drawn round); ``fly``: the (dx, dy) it flies in from."""
    box = f'x="{x:.1f}" y="{y:.1f}" width="{size}" height="{size}" rx="{size / 6:.1f}"'
    if style == "ghost":
        shape = f'<rect {box} fill="#ffffff" stroke="{draw.mix(color, 0.7)}" stroke-width="1"/>'
    elif style == "grad":
        shape = (f'<circle cx="{x + size / 2:.1f}" cy="{y + size / 2:.1f}" r="{size / 2:.1f}" '
                 f'fill="{color}" stroke="{draw.darken(color, 0.3)}" stroke-width="0.8"/>')
    elif style == "output":
        shape = f'<rect {box} fill="{color}" stroke="{INK}" stroke-width="1.2"/>'
    else:
        edge = draw.darken(color, 0.25)
        shape = f'<rect {box} fill="{color}" stroke="{edge}" stroke-width="0.6"/>'

    if fly is None:
        return shape
    dx, dy = fly
    return (f'<g class="tl-moe-fly" style="--dx:{dx:.1f}px;--dy:{dy:.1f}px;'
            f'animation-delay:{delay:.2f}s">{shape}</g>')


def _pill(x, y, s, color, anchor) -> str:
    """A label on a white pill: ``anchor`` start or end at x, vertically centred on y."""
    w = len(s) * 6.0 + 12
    left = x if anchor == "start" else x - w
    return (draw.rect(left, y - 9, w, 18, "#ffffff", color, 1.0, rx=9)
            + draw.text(left + w / 2, y + 4, s, size=11, fill=INK))


def _flow_path(x0, y0, x1, y1, color, width, opacity, arrow=True) -> str:
    dx = (x1 - x0) / 2
    d = f"M{x0:.1f},{y0:.1f} C{x0 + dx:.1f},{y0:.1f} {x1 - dx:.1f},{y1:.1f} {x1:.1f},{y1:.1f}"
    out = (f'<path d="{d}" fill="none" stroke="{color}" stroke-width="{width:.1f}" '
           f'stroke-opacity="{opacity}" stroke-linecap="round"/>')
    if arrow:
        s = 1 if x1 > x0 else -1
        head = 7.0
        out += (f'<polygon points="{x1:.1f},{y1:.1f} {x1 - s * head:.1f},{y1 - head / 2 - 0.5:.1f} '
                f'{x1 - s * head:.1f},{y1 + head / 2 + 0.5:.1f}" fill="{color}" '
                f'fill-opacity="{min(1.0, opacity + 0.2)}"/>')
    return out


def _copies(c: int) -> str:
    """``"5 copies"``: a square is a token *copy*, one per (token, chosen expert)."""
    return f"{c} cop{'y' if c == 1 else 'ies'}"


@dataclass
class _State:
    """One frame: where every square is and how it looks, plus what to highlight."""

    phase: str
    caption: str
    src_style: dict = field(default_factory=dict)   # (i, j) -> style at the sender (None: absent)
    dst_style: dict = field(default_factory=dict)   # (i, j) -> style at the receiver
    fly: dict = field(default_factory=dict)         # (i, j) -> "to_dst" | "to_src"
    flows: list = field(default_factory=list)       # (i, j, direction, labelled)
    faint_flows: bool = False
    row: int | None = None                          # matrix row / column to outline
    col: int | None = None
    whole: bool = False                             # outline the whole matrix
    margins: bool = False
    computing: bool = False
    data: dict = field(default_factory=dict)


def _draw(lay: _Layout, st: _State, stepper: dict[str, int]) -> str:
    """One frame; ``stepper``: each phase's name and the first frame it starts at."""
    flow, n, S = lay.flow, lay.n, lay.flow.dispatch
    ranks = flow.ranks
    body = []
    # the phase stepper: each pill jumps to its phase's first frame (moe_flow.js)
    x = 8.0
    for name, first in stepper.items():
        active = name.lower() == st.phase.split(":")[0]
        w = len(name) * 6.6 + 20
        body.append(f'<g class="tl-moe-step" data-goto="{first}" role="button" tabindex="0" '
                    f'aria-label="go to {name.lower()}" style="cursor:pointer">'
                    f"<title>Go to {name.lower()} (frame {first + 1})</title>")
        body.append(draw.rect(x, 10, w, 22, INK if active else "#ffffff",
                              INK if active else LINE, 1.0, rx=11))
        body.append(draw.text(x + w / 2, 25, name, size=11.5, fill="#ffffff" if active else MUTED,
                              weight="600" if active else None))
        body.append("</g>")
        x += w + 8
    # column headings
    hy = TOP - 10
    body.append(draw.text(LEFT, hy, "token copies, by sender", size=11.5, anchor="start",
                          fill=MUTED, weight="600"))
    body.append(draw.text(lay.dst_x, hy, "experts, by receiver", size=11.5, anchor="start",
                          fill=MUTED, weight="600"))
    # rank bands and boxes
    recv = flow.received
    per_expert = [flow.per_local_expert(j) for j in range(n)]
    for p, r in enumerate(ranks):
        y = lay.band_y[p]
        color = draw.palette_color(p)
        body.append(draw.rect(8, y, lay.right - 8, lay.band_h, BAND, "#e6eaef", 1.0, rx=8))
        body.append(draw.rect(16, y + lay.band_h / 2 - 5, 10, 10, color, rx=2))
        body.append(draw.text(32, y + lay.band_h / 2 + 4.5, f"rank {r}", size=13, anchor="start",
                              weight="600"))
        sx, sy, sw, sh = lay.src_box(p)
        sends = (f"sent {flow.sent[p]}, got {flow.sent[p]} back" if st.phase == "totals"
                 and flow.combine is not None else f"sends {flow.sent[p]}")
        body.append(draw.text(sx, y + 8 + 12, sends, size=11, anchor="start", fill=MUTED))
        body.append(draw.rect(sx, sy, sw, sh, BOX, "#d0d7de", 1.0, rx=5))
        idle = recv[p] == 0
        head = f"receives {recv[p]}" if not idle else "receives 0 copies"
        body.append(draw.text(lay.dst_x, y + 8 + 12, head, size=11, anchor="start",
                              fill=IDLE if idle else MUTED, weight="600" if idle else None))
        for l in range(lay.Lb):
            bx, by, bw, bh = lay.expert_box(p, l)
            count = per_expert[p][l] if per_expert[p] is not None else recv[p]
            empty = count == 0
            tint = draw.mix(color, 0.16) if st.computing and not empty else BOX
            body.append(draw.rect(bx, by, bw, bh, IDLE_FILL if empty else tint,
                                  IDLE_LINE if empty else ("#d0d7de" if not st.computing
                                                           else draw.darken(color, 0.1)),
                                  1.0 if not st.computing or empty else 1.4,
                                  dash="4 3" if empty else None, rx=5))
            if lay.sub_head:
                if lay.by_expert:
                    label = f"e{p * lay.L + l}: {count}"
                else:
                    first, last = p * lay.L, p * lay.L + lay.L - 1
                    label = f"experts e{first}\u2013e{last}" if lay.L > 1 else f"expert e{first}"
                body.append(draw.text(bx + 2, by - 4, label, size=10.5, anchor="start",
                                      fill=IDLE if empty else MUTED))
            if empty:
                body.append(draw.text(bx + bw / 2, by + bh / 2 + 4, "idle" if lay.Lb > 1 or idle
                                      else "0", size=11, fill=IDLE))
    # flows (under the squares)
    peak = max([c for row in S for c in row] + [1])
    labels = []
    for i, j, direction, labelled in st.flows:
        c = S[i][j]
        if c == 0:
            continue
        color = draw.palette_color(j)
        sx, sy, sw, sh = lay.src_box(i)
        x_src, y_src = sx + sw + 4, lay.mid(i) + lay.end_offset(j)
        x_dst, y_dst = lay.dst_x - 4, lay.mid(j) + lay.end_offset(i)
        width = 1.4 + 4.0 * c / peak
        opacity = 0.22 if st.faint_flows else 0.75
        if direction == "to_dst":
            body.append(_flow_path(x_src, y_src, x_dst, y_dst, color, width, opacity,
                                   arrow=not st.faint_flows))
        else:
            body.append(_flow_path(x_dst, y_dst, x_src, y_src, color, width, opacity))
        if labelled:
            if direction == "to_dst":
                text = f"r{ranks[i]} \u2192 r{ranks[j]}: {_copies(c)}"
                labels.append(_pill(x_dst - 16, y_dst, text, color, "end"))
            else:
                text = f"r{ranks[j]} \u2192 r{ranks[i]}: {_copies(c)}"
                labels.append(_pill(x_src + 16, y_src, text, color, "start"))
    # squares
    shades = _expert_shades(lay.L) if lay.by_expert else [1.0]
    moving = {}
    for sq in lay.squares:
        color = draw.mix(draw.palette_color(sq.j), shades[sq.l])
        key = (sq.i, sq.j)
        delay = min(0.02 * sq.k, 0.4)
        # each copy at the sender and at the receiver; it flies in when this frame moves it there
        for end, here, there, styles, arriving in (("src", sq.src, sq.dst, st.src_style, "to_src"),
                                                   ("dst", sq.dst, sq.src, st.dst_style, "to_dst")):
            style = styles.get(key)
            if not style:
                continue
            if st.fly.get(key) == arriving:
                moving.setdefault(end, []).append(_square(*here, color, style, (
                    there[0] - here[0], there[1] - here[1]), delay, lay.sq))
            else:
                body.append(_square(*here, color, style, size=lay.sq))
    for part in moving.values():  # in flight: above everything that stays
        body.extend(part)
    body.extend(labels)
    body.append(_matrix_svg(lay, st))
    body.append(_legend(lay))
    return draw.svg(lay.width, lay.height, body)


def _matrix_svg(lay: _Layout, st: _State) -> str:
    flow, n, S, c = lay.flow, lay.n, lay.flow.dispatch, lay.cell
    ranks, mx, my = flow.ranks, lay.mx, lay.my
    out = [draw.text(mx - 34, TOP - 10, "dispatch matrix (copies)", size=11.5, anchor="start",
                     fill=MUTED, weight="600")]
    out.append(draw.text(mx - 8, my - 6, "from \\ to", size=10, anchor="end", fill=MUTED))
    peak = max([v for row in S for v in row] + [1])
    base = KIND_COLORS["ep"]
    for j in range(n):
        out.append(draw.text(mx + (j + 0.5) * c, my - 6, f"r{ranks[j]}", size=11, fill=MUTED))
    out.append(draw.text(mx + (n + 0.5) * c + 4, my - 6, "sent", size=10.5, fill=MUTED))
    for i in range(n):
        y = my + i * c
        out.append(draw.text(mx - 8, y + c / 2 + 4, f"r{ranks[i]}", size=11, anchor="end",
                             fill=MUTED))
        for j in range(n):
            v = S[i][j]
            fill = draw.mix(base, 0.12 + 0.78 * v / peak) if v else "#ffffff"
            out.append(draw.rect(mx + j * c, y, c, c, fill, "#d0d7de", 0.8, rx=0))
            out.append(draw.text(mx + (j + 0.5) * c, y + c / 2 + 4, str(v), size=11.5,
                                 fill=draw.text_color(fill) if v else "#8c959f",
                                 weight="600" if v else None))
        out.append(draw.text(mx + (n + 0.5) * c + 4, y + c / 2 + 4, str(flow.sent[i]), size=11.5,
                             fill=INK, weight="600" if st.margins else None))
    out.append(draw.text(mx - 8, my + n * c + c / 2 + 4, "recv", size=10.5, anchor="end",
                         fill=MUTED))
    for j in range(n):
        v = flow.received[j]
        x, y = mx + j * c, my + n * c + 4
        if v == 0:
            out.append(draw.rect(x + 1, y, c - 2, c - 6, IDLE_FILL, IDLE_LINE, 1.0, dash="3 2",
                                 rx=4))
        out.append(draw.text(x + c / 2, y + c / 2 + 1, str(v), size=11.5,
                             fill=IDLE if v == 0 else INK,
                             weight="600" if st.margins or v == 0 else None))
    local = sum(S[i][i] for i in range(n))
    out.append(draw.text(mx - 34, my + (n + 1) * c + 24,
                         "cell (i, j): copies rank i sends to rank j", size=10.5, anchor="start",
                         fill=MUTED))
    out.append(draw.text(mx - 34, my + (n + 1) * c + 40, f"diagonal: {local} stay on their rank",
                         size=10.5, anchor="start", fill=MUTED))
    if any(flow.received[j] == 0 for j in range(n)):
        idle = ", ".join(f"r{ranks[j]}" for j in range(n) if flow.received[j] == 0)
        says = f"{idle} receive 0 copies" if "," in idle else f"{idle} receives 0 copies"
        out.append(draw.text(mx - 34, my + (n + 1) * c + 56, says, size=10.5, anchor="start",
                             fill=IDLE, weight="600"))
    # the rank in focus: its row (it sends) or its column (it returns what its experts made)
    if st.row is not None:
        out.append(draw.rect(mx - 2, my + st.row * c - 2, n * c + 4, c + 4, "none", INK, 2.0, rx=3))
    if st.col is not None:
        out.append(draw.rect(mx + st.col * c - 2, my - 2, c + 4, n * c + 4, "none", INK, 2.0, rx=3))
    if st.whole:
        out.append(draw.rect(mx - 2, my - 2, n * c + 4, n * c + 4, "none", INK, 2.0, rx=3))
    return "".join(out)


def _legend(lay: _Layout) -> str:
    y, x = lay.legend_y, 16.0
    color = draw.palette_color(0)
    items = [("filled", "token copy"), ("output", "expert output"), ("ghost", "copy that left")]
    if lay.flow.backward:
        items.append(("grad", "gradient"))
    out = []
    for style, name in items:
        out.append(_square(x, y - 8, color, style, size=9.0))
        out.append(draw.text(x + 15, y, name, size=11, anchor="start", fill=MUTED))
        x += 15 + len(name) * 6.2 + 18
    colour = ("colour: receiving rank" + (", shade: its local expert" if lay.by_expert else ""))
    if lay.scale > 1:
        colour += f"; one square = {lay.scale} copies (rounded up)"
    out.append(draw.text(x + 6, y, colour, size=11, anchor="start", fill=MUTED))
    return "".join(out)


# --- the frames ---------------------------------------------------------------------------


def _frames(flow: TokenFlow) -> list[_State]:
    n, S, ranks = len(flow.ranks), flow.dispatch, flow.ranks
    pairs = [(i, j) for i in range(n) for j in range(n)]
    recv, sent = flow.received, flow.sent
    total = sum(sent)
    local = sum(S[i][i] for i in range(n))
    idle = [ranks[j] for j in range(n) if recv[j] == 0]
    states = []

    def data(st: _State, moves=(), labels=()):
        at_src = {ranks[i]: sum(S[i][j] for j in range(n) if st.src_style.get((i, j)) in
                                ("filled", "output", "grad")) for i in range(n)}
        at_dst = {ranks[j]: sum(S[i][j] for i in range(n) if st.dst_style.get((i, j)) in
                                ("filled", "output", "grad")) for j in range(n)}
        st.data = {"phase": st.phase, "moves": [(ranks[i], ranks[j], c) for i, j, c in moves],
                   "labels": list(labels), "at_senders": at_src, "at_receivers": at_dst,
                   "sent": dict(zip(ranks, sent)), "received": dict(zip(ranks, recv)),
                   "matrix": [list(row) for row in S]}
        if flow.expert_counts is not None:
            st.data["per_local_expert"] = {ranks[j]: flow.per_local_expert(j) for j in range(n)}
        return st

    # start
    st = _State("start", "", {p: "filled" for p in pairs})
    scale = f" (one square = {flow.scale} copies)" if flow.scale > 1 else ""
    shade = " and shaded by expert" if flow.expert_counts is not None else ""
    st.caption = (f"Start: each EP rank holds the token copies its router assigned, one square per "
                  f"copy{scale}, coloured by the rank that holds the expert{shade}. "
                  f"Copies to send: " + ", ".join(f"r{r} {s}" for r, s in zip(ranks, sent)) + ".")
    states.append(data(st))
    # dispatch, one sender at a time
    for k in range(n):
        st = _State(f"dispatch:{k}", "", row=k)
        for i, j in pairs:
            st.src_style[i, j] = "ghost" if i <= k else "filled"
            if i <= k:
                st.dst_style[i, j] = "filled"
            if i == k:
                st.fly[i, j] = "to_dst"
        st.flows = [(k, j, "to_dst", True) for j in range(n)]
        moves = [(k, j, S[k][j]) for j in range(n) if S[k][j]]
        labels = [f"r{ranks[k]} \u2192 r{ranks[j]}: {_copies(c)}" for _, j, c in moves]
        zero = [f"r{ranks[j]}" for j in range(n) if S[k][j] == 0]
        text = ", ".join(label + (" (stay local)" if j == k else "")
                         for label, (_, j, _c) in zip(labels, moves)) or "nothing"
        st.caption = (f"Dispatch {k + 1}/{n}: rank {ranks[k]} sends {sent[k]} copies: {text}"
                      + (f"; none to {', '.join(zero)}" if zero and moves else "") +
                      ". (One all-to-all: every rank sends at once; shown one sender at a time.)")
        states.append(data(st, moves, labels))
    # expert compute
    st = _State("experts", "", {p: "ghost" for p in pairs}, {p: "output" for p in pairs},
                computing=True, margins=True)
    mean = total / n if n else 0
    busiest = max(range(n), key=lambda j: recv[j])
    per = []
    for j in range(n):
        pe = flow.per_local_expert(j)
        detail = (" (" + ", ".join(f"e{j * flow.experts_per_rank + l} {c}" for l, c in enumerate(pe))
                  + ")") if pe is not None else ""
        per.append(f"r{ranks[j]} {recv[j]}{detail}")
    st.caption = ("Expert compute: each rank runs its local experts on the copies it received: "
                  + ", ".join(per) + f". Busiest: rank {ranks[busiest]} with {recv[busiest]}"
                  + (f" = {recv[busiest] / mean:.2f} \u00d7 the mean {mean:.1f}" if mean else "")
                  + (f"; rank{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} received "
                     f"0 copies, {'their' if len(idle) > 1 else 'its'} experts sit idle" if idle
                     else "") + ".")
    states.append(data(st))
    last_src, last_dst = "output", "ghost"
    # combine, one returning rank at a time
    if flow.combine is not None:
        for k in range(n):
            st = _State(f"combine:{k}", "", col=k)
            for i, j in pairs:
                st.src_style[i, j] = "output" if j <= k else "ghost"
                st.dst_style[i, j] = "ghost" if j <= k else "output"
                if j == k:
                    st.fly[i, j] = "to_src"
            st.flows = [(i, k, "to_src", True) for i in range(n)]
            moves = [(k, i, S[i][k]) for i in range(n) if S[i][k]]
            labels = [f"r{ranks[k]} \u2192 r{ranks[i]}: {_copies(c)}" for _, i, c in moves]
            st.caption = (f"Combine {k + 1}/{n}: rank {ranks[k]} returns its experts' outputs to "
                          f"their senders: " + (", ".join(
                              label + (" (stay local)" if i == k else "")
                              for label, (_, i, _c) in zip(labels, moves)) or
                              "nothing (it received no copies)")
                          + ". The mirror all-to-all: the dispatch splits, swapped.")
            states.append(data(st, moves, labels))
    else:
        last_src, last_dst = "ghost", "output"
    # backward: the two recorded all-to-alls of autograd, all senders at once
    if flow.backward is not None:
        for name, src, dst, direction, said in (
                ("combine", "output", "grad", "to_dst", "each copy's output gradient travels to "
                 "its expert, one all-to-all with the dispatch matrix"),
                ("dispatch", "grad", "ghost", "to_src", "the input gradients return to the ranks "
                 "that sent the tokens, the mirror matrix")):
            st = _State(f"backward:{name}", "", {p: src for p in pairs}, {p: dst for p in pairs},
                        {p: direction for p in pairs}, whole=True)
            st.flows = [(i, j, direction, False) for i, j in pairs]
            moves = [(i, j, S[i][j]) if direction == "to_dst" else (j, i, S[i][j])
                     for i, j in pairs if S[i][j]]
            st.caption = f"Backward of {name}: {said} (recorded: {flow.backward[name]})."
            states.append(data(st, moves))
        last_src, last_dst = "grad", "ghost"
    # totals
    st = _State("totals", "", {p: last_src for p in pairs}, {p: last_dst for p in pairs},
                margins=True, faint_flows=True)
    st.flows = [(i, j, "to_dst", False) for i, j in pairs]
    crossed = total - local
    st.caption = (f"Totals: the dispatch moved {total} token copies, {crossed} across ranks and "
                  f"{local} kept local; received per rank: "
                  + ", ".join(f"r{r} {c}" for r, c in zip(ranks, recv))
                  + (f" (max {max(recv)} vs mean {mean:.1f})" if mean else "")
                  + (f"; combine returned all {total}" if flow.combine is not None
                     else "; no combine all-to-all was recorded")
                  + (", and backward repeated both exchanges" if flow.backward else "") + ".")
    states.append(data(st))
    return states


# --- the public entry ---------------------------------------------------------------------


class TokenFlowAnimation(Animation):
    """An :class:`Animation` whose squares fly between frames (``moe_flow.css``, scoped to
    this player).  ``flow`` holds the numbers (:class:`TokenFlow`); ``data`` one dict per frame.
    """

    styles = Animation.styles + ("moe_flow.css",)
    scripts = Animation.scripts + ("moe_flow.js",)
    start = "startTokenFlow"

    def __init__(self, frames, captions, flow: TokenFlow, title: str = "", data=None,
                 note: str = "", interval_ms: int = 1700):
        super().__init__(frames, captions, title=title, data=data, note=note,
                         interval_ms=interval_ms)
        self.flow = flow


def animate_token_flow(trace: Trace, layer=None, include_backward: bool = False,
                       experts_per_rank: int | None = None, title: str | None = None, *,
                       call: int = 0, ranks: list[int] | None = None) -> TokenFlowAnimation:
    """Animate the tokens an MoE layer's all-to-alls moved between EP ranks, from the trace.

    Frames: the copies on each sender; dispatch, one sender at a time (labels
    ``"r0 → r2: 5 copies"``); expert compute at the receivers (per local expert
    when the counts are known); combine, one returning rank at a time (when
    recorded); with ``include_backward``, the two backward all-to-alls; and the
    totals.  Beside them, the dispatch matrix (senders x receivers, with sums).

    ``layer``: keep events tagged with that layer; ``call``: which dispatch of the
    group (default the first); ``ranks``: which EP group when several ran;
    ``experts_per_rank``: label the receivers' experts when the trace does not say.
    """
    flow = _read_flow(trace, layer, call, ranks, include_backward, experts_per_rank)
    lay = _Layout(flow)
    states = _frames(flow)
    stepper = {}  # phase name -> its first frame, in order
    for index, st in enumerate(states):
        stepper.setdefault(st.phase.split(":")[0].capitalize(), index)
    frames = [_draw(lay, st, stepper) for st in states]
    n = len(flow.ranks)
    if title is None:
        where = f"layer {layer}, " if layer is not None else ""
        title = (f"MoE token flow over the {flow.group_kind or 'all-to-all'} group "
                 f"{flow.ranks} ({where}{sum(flow.sent)} token copies, "
                 f"{n} rank{'s' if n != 1 else ''}), traced")
    note = ("Counts are the recorded all-to-all splits. Squares: token copies (one per token and "
            "chosen expert), coloured by the receiving rank"
            + (", shaded by its local expert" if flow.expert_counts is not None else "")
            + "; bold outline: an expert's output; white: a copy that has left"
            + ("; circles: gradients" if flow.backward else "") + ".")
    for extra in flow.notes:
        note += " " + extra[0].upper() + extra[1:] + "."
    if flow.combine is None:
        note += " No combine all-to-all was recorded, so none is drawn."
    data = [st.data for st in states]
    return TokenFlowAnimation(frames, [st.caption for st in states], flow, title=title,
                              data=data, note=note)
