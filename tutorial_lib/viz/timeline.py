"""Timelines: what every rank did, and when, drawn from a recorded trace.

``timeline(launch(...).trace)`` draws one lane per rank with time on the x axis
(milliseconds since the first recorded event).  Compute spans recorded with
``tracer.span("backward", microbatch=0)`` are grey bars labelled by their name;
every collective and point-to-point op is a bar coloured by the kind of group it
ran on (the course's :data:`~tutorial_lib.viz.draw.KIND_COLORS`).  When a rank
records both, its lane splits into a *compute* row and a *comm* row, so an
asynchronous op in flight during a compute span shows as two bars stacked one
above the other: the gradient buckets' all-reduces visibly overlapping backward.
Ops that overlap each other (two buckets in flight) stack into extra rows.

A pipeline step is drawn as its schedule with ``timeline(trace, pipeline=True)`` (or, for
a simulated plan, :func:`plan_spans` and ``timeline_from_spans(..., bubble=True)``):
forwards blue and backwards orange, each further chunk of an interleaved rank a shade
darker, a bar too narrow for ``F3.1`` labelled ``3``, each rank's idle time (the bubble)
hatched, and a send posted before a compute and waited on only at the end of the step
(the labels' ``isend``) a tick where it was posted instead of a bar across the step.

What a bar means: it runs from the moment the op was issued to the moment it
completed.  For an asynchronous op (``comm.isend``/``irecv``, a bucket's
all-reduce) "completed" is when ``wait()`` returned, so the bar is the time the
op was *in flight*, not the time the bytes spent on the wire.

The widget is one self-contained HTML fragment (inline SVG; CSS and script from
``viz/assets/``, inlined; no kernel, no external file), so it works in the static book:

* hover a bar for its op, group, shape, dtype, bytes, duration and tags;
* drag across the chart to zoom into a time range (Reset zoom goes back);
* Play sweeps a cursor through time (40 steps by default): bars fill in as the
  cursor passes them and the caption says what every rank is doing at that
  instant.  Frame 0 is the overview (everything drawn, no cursor).

The drawing code knows nothing about traces: it draws :class:`Span` objects
(rank, start, end, label, kind, lane), so a *planned* schedule can be drawn by
the same code, in its own lane, next to what a run recorded::

    planned = [(0, 0.0, 1.0, "F0", "compute", "planned"), ...]
    timeline_from_spans(planned + trace_spans(trace), lanes=["planned", "compute", "comm"])

Pure helpers turn the same events into numbers a chapter can assert:
:func:`overlap_seconds` (how much of some ops' time falls inside compute spans of
one name), :func:`overlap_breakdown` (the same time split into waiting for the
group's last rank to issue the op, overlapped with the rank's own compute, and
exposed: the honest measure of hidden communication) and
:func:`busy_fraction` / :func:`bubble_fraction` (how much of the step each rank
spends working, or idle: the pipeline bubble).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from ..trace import Trace, TraceEvent
from .draw import INK, KIND_COLORS, MUTED, SANS, darken, kind_color, text_color
from .widget import Widget, ascii_html

GRID = "#e3e7eb"     # vertical grid lines
TRACK = "#f4f6f8"    # the background of one row of bars
SEPARATOR = "#d8dee4"  # between ranks

#: Layout, in SVG pixels.
LEFT = 128.0        # x of the plot's left edge (rank and lane labels sit left of it)
RIGHT = 16.0        # margin right of the plot
AXIS_H = 30.0       # height of the time axis above the lanes
ROW_H = 18.0        # height of one bar
ROW_GAP = 3.0       # between stacked rows of one lane
LANE_GAP = 5.0      # between the lanes (compute, comm) of one rank
BAND_PAD = 7.0      # above the first and below the last lane of a rank
MIN_W = 1.5         # the narrowest bar drawn: a 10 us op still shows
CHAR_W = 5.9        # width of one character of a 10.5 px bar label, for fitting labels
CAPTION_CHAR_W = 6.6  # width of one character of the 13 px caption, for sizing its box
TICK_SPACING = 90.0  # aim for one axis tick per this many pixels

#: What the legend calls each kind.
KIND_NAMES = {
    "compute": "compute", "tp": "tensor parallel", "cp": "context parallel",
    "dp": "data parallel", "dp_cp": "data \u00d7 context parallel", "pp": "pipeline",
    "mp": "model parallel", "embedding": "embedding", "ep": "expert parallel",
    "expert_tp": "expert tensor parallel", "expert_dp": "expert data parallel",
    "world": "all ranks", "custom": "custom group",
}

#: Tags added to a bar's label, and how: ``{"microbatch": 1}`` -> ``"mb1"``.
LABEL_TAGS = (("microbatch", "mb{}"), ("mb", "mb{}"), ("phase", "{}"), ("bucket", "bucket {}"))

#: The lanes a trace is drawn in when a rank has both compute spans and communication.
TRACE_LANES = ("compute", "comm")


# --- the data model: spans ---------------------------------------------------------


@dataclass
class Span:
    """One bar: something a rank did (or was planned to do) from ``start`` to ``end``.

    Times are in source units (seconds for traces); ``timeline_from_spans`` shows
    them multiplied by its ``scale`` (1000: milliseconds).  ``kind`` picks the
    colour (``compute`` or a group kind such as ``dp``); ``lane`` the row of the
    rank's band it is drawn in (``""``: the only one).
    """

    rank: int
    start: float
    end: float
    label: str
    kind: str = "compute"
    lane: str = ""
    info: dict[str, str] = field(default_factory=dict)
    """Rows of the hover tooltip (start, end and duration are added when drawn)."""
    title: str = ""
    """Heading of the tooltip; the label when empty."""
    caption: str = ""
    """How the cursor caption names this span; the label when empty."""
    chunk: int | None = None
    """For a pipeline schedule's forward or backward: the model chunk of the rank it
    belongs to (interleaved 1F1B); chunk ``c > 0`` is drawn ``c`` shades darker."""
    short_label: str = ""
    """Drawn instead of ``label`` where the bar is too narrow for it (``"3"`` for
    ``"F3.1"``: the colour says forward, the shade the chunk)."""
    chunk_name: str = ""
    """How the legend names this bar's chunk (``"up (copy 1)"`` for DualPipe's second
    direction); ``""``: ``chunk c``."""
    outline: bool = False
    """Drawn with a dark border: one half of an overlapped pair (DualPipe's ``F&B``), the
    two halves side by side inside one border, as in the DualPipe README's figure."""

    @classmethod
    def coerce(cls, span: "Span | Sequence") -> "Span":
        """A :class:`Span` from itself or a tuple ``(rank, start, end, label, kind[, lane])``."""
        if isinstance(span, Span):
            return span
        items = tuple(span)
        if not 5 <= len(items) <= 6:
            raise ValueError(f"a span is (rank, start, end, label, kind[, lane]); got {span!r}")
        rank, start, end, label, kind = items[:5]
        lane = items[5] if len(items) == 6 else ""
        return cls(int(rank), float(start), float(end), str(label), str(kind), str(lane))


def _with_tags(label: str, tags: dict[str, Any]) -> str:
    parts = [label]
    for key, pattern in LABEL_TAGS:
        if key in tags and tags[key] is not None:
            parts.append(pattern.format(tags[key]))
    return " ".join(parts)


def event_label(event: TraceEvent, tags: bool = True) -> str:
    """The short text on an event's bar: ``backward mb0``, ``all-reduce``, ``send \u2192 r1``.

    ``tags``: append the microbatch, phase and bucket tags (``all-reduce mb0 bucket 1``).
    """
    if event.op == "compute":
        return _with_tags(str(event.tags.get("name", "compute")), event.tags if tags else {})
    label = event.op.replace("_", "-")
    if event.peer is not None:
        if event.op == "send":
            label += f" \u2192 r{event.peer}"
        elif event.op == "recv":
            label += f" \u2190 r{event.peer}"
        elif event.op == "broadcast":
            label += f" from r{event.peer}"
    return _with_tags(label, event.tags if tags else {})


def format_bytes(n: int) -> str:
    """``4096`` -> ``"4 KiB (4,096 B)"``; small counts stay plain bytes."""
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.3g} {unit} ({n:,} B)"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals into disjoint ones, sorted."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b < a:
            a, b = b, a
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(a: float, b: float, disjoint: list[tuple[float, float]]) -> float:
    """Length of [a, b] inside the union of ``disjoint`` intervals."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in disjoint)


def trace_spans(trace: Trace, ranks: Iterable[int] | None = None,
                kinds: Iterable[str] | None = None, split: bool | None = None) -> list[Span]:
    """The spans :func:`timeline` draws for a trace, times relative to its first event.

    ``ranks``/``kinds`` keep only those ranks / kinds (``compute`` is the kind of a
    compute span).  ``split`` puts compute spans in lane ``compute`` and ops in
    lane ``comm``; ``None`` splits when both are present.
    """
    rel = trace.relative()
    keep_ranks = None if ranks is None else set(ranks)
    keep_kinds = None if kinds is None else set(kinds)
    events = [e for e in rel if (keep_ranks is None or e.rank in keep_ranks)
              and (keep_kinds is None or _kind(e) in keep_kinds)]
    if split is None:
        split = (any(e.op == "compute" for e in events)
                 and any(e.op != "compute" for e in events))
    computes: dict[int, list[tuple[float, float]]] = {}
    for e in rel:  # overlap in the tooltip counts every compute span, even hidden ones
        if e.op == "compute":
            computes.setdefault(e.rank, []).append((e.t_start, e.t_end))
    computes = {r: _union(v) for r, v in computes.items()}
    instances = collective_instances(rel)
    spans = []
    for e in events:
        kind = _kind(e)
        lane = ("compute" if e.op == "compute" else "comm") if split else ""
        label = event_label(e)
        info: dict[str, str] = {}
        tags = {k: v for k, v in e.tags.items() if k != "name"}
        if e.op == "compute":
            title = f"{label} (compute, rank {e.rank})"
        else:
            title = f"{e.op} on the {kind} group, rank {e.rank}"
            info["group ranks"] = str(list(e.group_ranks))
            if e.peer is not None:
                info["peer"] = f"rank {e.peer}"
            info["shape"] = str(tuple(e.shape))
            info["dtype"] = e.dtype or "-"
            info["bytes"] = format_bytes(e.bytes)
            # With every peer's event at hand, the time before the last peer issued the op
            # is waiting, not overlap: only the rest can hide behind compute.
            running_from = e.t_start
            if id(e) in instances:
                running_from = min(max(p.t_start for p in instances[id(e)]), e.t_end)
                info["waiting for peers"] = (f"{(running_from - e.t_start) * 1e3:.3f} ms "
                                             "(until the last rank issued it)")
            if e.rank in computes and e.duration > 0:
                inside = _covered(running_from, e.t_end, computes[e.rank])
                info["overlaps compute"] = (f"{inside * 1e3:.3f} ms "
                                            f"({100 * inside / e.duration:.0f}%)")
        if e.splits:
            info["splits"] = f"in {e.splits.get('input')}, out {e.splits.get('output')}"
        if tags:
            info["tags"] = ", ".join(f"{k}={v}" for k, v in tags.items())
        caption = label if e.op == "compute" else f"{event_label(e, tags=False)} [{kind}]"
        spans.append(Span(e.rank, e.t_start, e.t_end, label, kind, lane, info, title, caption))
    return spans


def _kind(e: TraceEvent) -> str:
    return "compute" if e.op == "compute" else (e.group_kind or "world")


# --- numbers: overlap and idle time ------------------------------------------------


def _ops_match(e: TraceEvent, op, group_kind) -> bool:
    if e.op == "compute":
        return False
    if op is not None and (e.op != op if isinstance(op, str) else e.op not in set(op)):
        return False
    return group_kind is None or e.group_kind == group_kind


def overlap_seconds(trace: Trace, rank: int, compute_name: str, op: str | Iterable[str] | None = None,
                    group_kind: str | None = None) -> float:
    """Seconds of the selected ops' time on ``rank`` that fall inside compute spans named
    ``compute_name``.

    The ops are the communication events of ``rank`` with ``op`` (a name or several)
    and ``group_kind``, when given.  Each op counts its own overlap, so two ops in
    flight during the same millisecond of backward count it twice: divide by their
    total duration (:func:`overlap_fraction`) for the share of communication hidden
    behind compute.  Nested or repeated spans of that name count once.  Time an op spent
    waiting for the other ranks of its group to issue it counts as overlap here;
    :func:`overlap_breakdown` separates the two.
    """
    spans = _union((e.t_start, e.t_end) for e in trace
                   if e.rank == rank and e.op == "compute" and e.tags.get("name") == compute_name)
    return sum(_covered(e.t_start, e.t_end, spans) for e in trace
               if e.rank == rank and _ops_match(e, op, group_kind))


def overlap_fraction(trace: Trace, rank: int, compute_name: str, op: str | Iterable[str] | None = None,
                     group_kind: str | None = None) -> float:
    """:func:`overlap_seconds` divided by the selected ops' total duration (0 if they took none)."""
    total = sum(e.duration for e in trace if e.rank == rank and _ops_match(e, op, group_kind))
    return overlap_seconds(trace, rank, compute_name, op, group_kind) / total if total > 0 else 0.0


# --- whose time is it: waiting for peers, hidden behind compute, exposed -----------------

#: Ops whose every rank must take part before any rank's copy can finish.
COLLECTIVE_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                            "broadcast", "barrier"})


def collective_instances(trace: Trace) -> dict[int, list[TraceEvent]]:
    """Each collective event, by ``id``, with the matching events of its group's other ranks.

    The ranks of a communicator issue its collectives in the same order (that is what
    makes them pair up at all), so the k-th collective a rank recorded on a group (its
    kind and ranks) and the k-th its peers recorded on the same group are one operation.  An event whose peers are
    missing from ``trace`` (a trace filtered to one rank, or a peer that recorded fewer
    ops) is left out.  Point-to-point ops and compute spans are never in it.
    """
    streams: dict[tuple, list[TraceEvent]] = {}
    for e in sorted(trace, key=lambda e: (e.rank, e.t_start)):
        if e.op in COLLECTIVE_OPS and e.group_ranks:
            streams.setdefault((e.rank, e.group_kind, tuple(e.group_ranks)), []).append(e)
    out: dict[int, list[TraceEvent]] = {}
    for (rank, kind, group), mine in streams.items():
        others = [streams.get((r, kind, group), []) for r in group]
        for k, e in enumerate(mine):
            if all(len(s) > k for s in others):
                out[id(e)] = [s[k] for s in others]
    return out


def overlap_breakdown(trace: Trace, rank: int, compute_name: str,
                      op: str | Iterable[str] | None = None,
                      group_kind: str | None = None, **tags: Any) -> dict[str, float]:
    """Split the selected collectives' time on ``rank`` by what it was spent on, in seconds.

    A collective cannot complete on any rank before every rank of its group has issued
    it, so the time from this rank's issue to the *last* rank's issue is
    ``waiting_for_peers``: not communication, just being early.  Only after that can the
    transfer run; of that part, ``overlapped`` falls inside this rank's own compute spans
    named ``compute_name`` (communication really hidden behind compute), ``exposed`` does
    not.  ``in_flight`` is the ops' whole duration (issue to ``wait()`` returned), the sum
    of the three.  :func:`overlap_seconds` counts the waiting as overlap too; this is the
    honest split.  Needs the events of every rank of each op's group
    (:func:`collective_instances`); selects like :func:`overlap_seconds`, and ``tags``
    keeps only the ops carrying those tags (``phase="backward"``: the gradient buckets).
    """
    spans = _union((e.t_start, e.t_end) for e in trace
                   if e.rank == rank and e.op == "compute" and e.tags.get("name") == compute_name)
    instances = collective_instances(trace)
    out = {"in_flight": 0.0, "waiting_for_peers": 0.0, "overlapped": 0.0, "exposed": 0.0}
    for e in trace:
        if e.rank != rank or not _ops_match(e, op, group_kind):
            continue
        if any(e.tags.get(k) != v for k, v in tags.items()):
            continue
        if id(e) not in instances:
            raise ValueError(f"overlap_breakdown: no matching events of the other ranks of "
                             f"{list(e.group_ranks)} for rank {rank}'s {e.op}; pass the trace of "
                             f"every rank of the group (point-to-point ops are not supported)")
        last_issue = min(max(p.t_start for p in instances[id(e)]), e.t_end)
        running = _covered(last_issue, e.t_end, spans)
        out["in_flight"] += e.duration
        out["waiting_for_peers"] += last_issue - e.t_start
        out["overlapped"] += running
        out["exposed"] += (e.t_end - last_issue) - running
    return out


_COUNTS = {"compute": lambda e: e.op == "compute", "comm": lambda e: e.op != "compute",
           "all": lambda e: True}


def busy_fraction(trace: Trace, ranks: Iterable[int] | None = None, count: str = "compute",
                  window: str = "global") -> dict[int, float]:
    """Per rank, the fraction of the window covered by its events (overlaps counted once).

    ``count``: which events make a rank busy: ``"compute"`` spans (default: time
    spent blocked in a receive is idle, as in a pipeline bubble), ``"comm"`` or
    ``"all"``.  ``window``: ``"global"`` (default) is from the first start to the
    last end of the whole trace, the step every rank shares; ``"rank"`` is from
    that rank's own first start to its own last end.
    """
    if count not in _COUNTS:
        raise ValueError(f"count must be one of {sorted(_COUNTS)}, got {count!r}")
    if window not in ("global", "rank"):
        raise ValueError(f"window must be 'global' or 'rank', got {window!r}")
    by_rank = trace.by_rank()
    ranks = trace.ranks() if ranks is None else list(ranks)
    out = {}
    for r in ranks:
        events = by_rank.get(r, [])
        scope = trace.events if window == "global" else events
        if not scope:
            out[r] = 0.0
            continue
        w0, w1 = min(e.t_start for e in scope), max(e.t_end for e in scope)
        busy = _union((e.t_start, e.t_end) for e in events if _COUNTS[count](e))
        out[r] = _covered(w0, w1, busy) / (w1 - w0) if w1 > w0 else 0.0
    return out


def bubble_fraction(trace: Trace, ranks: Iterable[int] | None = None, count: str = "compute",
                    window: str = "global") -> dict[int, float]:
    """Per rank, the idle fraction of the window: ``1 - busy_fraction(...)``."""
    return {r: 1.0 - b for r, b in busy_fraction(trace, ranks, count, window).items()}


# --- pipeline schedules: forward, backward, chunk, bubble ---------------------------------

#: Colours of a pipeline schedule's bars: forwards blue, backwards orange (each chunk
#: ``c > 0`` of an interleaved rank :data:`CHUNK_DARKEN` x ``c`` darker), the bubble
#: (idle time inside the step) hatched in red.  None of them is a group kind's colour.
SCHEDULE_COLORS = {"forward": "#6a9fd8", "backward": "#e8a04a", "weight": "#9bbf3f",
                   "bubble": "#d1495b"}

#: The kinds of a schedule's compute bars (:func:`schedule_span`): ``weight`` is W, the
#: weight-gradient half of a backward a zero-bubble schedule splits (chapter 11), in green.
SCHEDULE_KINDS = ("forward", "backward", "weight")

#: Where a schedule splits the backward (``part="input"``), its B's tooltip says so.
PART_NAMES = {"input": "B: the input's gradient only (its W comes later)"}

#: The outline of an overlapped pair's halves.
PAIR_EDGE = "#1b1f24"

#: The kind of the idle bars :func:`bubble_spans` adds.
BUBBLE = "bubble"

#: How much darker each further chunk of a rank is drawn.
CHUNK_DARKEN = 0.3

#: Padding of a short label (:attr:`Span.short_label`): it may fill a narrow bar.
SHORT_PAD = 3.0


def schedule_span(rank: int, start: float, end: float, kind: str, microbatch: int,
                  chunk: int = 0, lane: str = "", *, overlapped: bool = False,
                  chunk_name: str = "", part: str = "") -> Span:
    """One forward, backward or W of a pipeline schedule, planned or recorded.

    Labelled like :attr:`tutorial_lib.pipeline_parallel.actions.Action.label` (``F3``, ``B3.1``
    for chunk 1, ``W3``), the microbatch alone where the bar is narrow; coloured by
    ``kind`` (:data:`SCHEDULE_COLORS`) and shaded by ``chunk``.  ``overlapped``: one half
    of an overlapped pair, outlined.  ``chunk_name``: the chunk's name in the legend and
    tooltip (a direction, for the V and DualPipe).  ``part``: ``"input"`` for a B whose
    W runs later (:data:`PART_NAMES`).
    """
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"a schedule span is one of {SCHEDULE_KINDS}, got {kind!r}")
    suffix = f".{chunk}" if chunk else ""
    label = f"{kind[0].upper()}{microbatch}{suffix}"
    where = f"microbatch {microbatch}, " + (chunk_name or f"chunk {chunk}")
    info = {"microbatch": str(microbatch), "chunk": chunk_name or str(chunk)}
    if part:
        info["computes"] = PART_NAMES.get(part, part)
    if overlapped:
        info["overlapped"] = "with the other half of its pair (F&B)"
    return Span(rank, float(start), float(end), label, kind, lane, info=info,
                title=f"{kind} of {where} (rank {rank})",
                caption=f"{kind} mb{microbatch}" + (f" chunk {chunk}" if chunk else ""),
                chunk=int(chunk), short_label=str(microbatch), chunk_name=chunk_name,
                outline=overlapped)


def chunk_names(placement: str) -> dict[int, str]:
    """The legend's names of a placement's chunks: ``loop`` none (``chunk c``); the V's
    chunk 0 runs down the ranks and chunk 1 back up; DualPipe's chunks are its two copies,
    one per direction."""
    return {"v": {0: "down", 1: "up"},
            "dual": {0: "down (copy 0)", 1: "up (copy 1)"}}.get(placement, {})


def plan_spans(plan: dict, lane: str = "planned") -> list[Span]:
    """The forwards, backwards and W's of a simulated schedule
    (:func:`tutorial_lib.pipeline_parallel.simulator.simulate`), as :func:`schedule_span` bars:
    overlapped pairs outlined, a split backward's B marked, the V's and DualPipe's
    chunks named by direction."""
    from ..pipeline_parallel.actions import split_backwards
    out = []
    for timed in plan.values():
        split = split_backwards([t.action for t in timed])
        for t in timed:
            a = t.action
            if a.is_compute:
                part = "input" if a.kind == "backward" and (a.microbatch, a.chunk) in split else ""
                out.append(schedule_span(t.rank, t.start, t.end, a.kind, a.microbatch, a.chunk,
                                         lane, overlapped=a.overlapped, part=part,
                                         chunk_name=chunk_names(a.placement).get(a.chunk, "")))
    return out


def _posted_and_waited_later(e: TraceEvent, computes: dict[int, list[tuple[float, float]]]) -> bool:
    """A send in flight across a whole compute span of its rank: posted, then waited on
    only after the rank computed (the labels' ``isend``, a deferred send)."""
    return e.op == "send" and any(e.t_start <= a and b <= e.t_end
                                  for a, b in computes.get(e.rank, []))


def pipeline_spans(trace: Trace, ranks: Iterable[int] | None = None,
                   kinds: Iterable[str] | None = None, split: bool | None = None,
                   schedules: dict | None = None) -> list[Span]:
    """The spans of a recorded pipeline step, drawn as a schedule.

    Compute spans named ``forward`` / ``backward`` / ``weight`` (tagged ``microbatch``
    and ``chunk``, as :mod:`tutorial_lib.pipeline_parallel.executor` records them; a B tagged
    ``part="input"``) become :func:`schedule_span` bars; the other events are
    :func:`trace_spans`'.  A send posted before a compute and waited on after it (the
    labels' ``isend``, waited at the end of the step) becomes a tick at the moment it
    was posted, its wait in the tooltip: its bar would cover the whole step.  ``ranks``,
    ``kinds`` and ``split`` select and place them as in :func:`trace_spans`.
    ``schedules``: the step's action lists (``build_schedules``), keyed by the ranks of
    the trace; each rank's recorded computes, in the order they started, must be its
    list's computes (else ``ValueError``), and take from them their pair outlines and
    chunk names.  (An overlapped pair's two halves run in turns, recorded as well as
    ``turn`` spans; drawn, they stack under the pair.)
    """
    spans = trace_spans(trace, ranks=ranks, kinds=kinds, split=split)
    rel = trace.relative()
    keep_ranks = None if ranks is None else set(ranks)
    keep_kinds = None if kinds is None else set(kinds)
    events = [e for e in rel if (keep_ranks is None or e.rank in keep_ranks)
              and (keep_kinds is None or _kind(e) in keep_kinds)]
    if len(events) != len(spans):  # trace_spans draws one span per selected event
        raise RuntimeError("pipeline_spans: trace_spans no longer draws one span per event")
    computes: dict[int, list[tuple[float, float]]] = {}
    for e in rel:
        if e.op == "compute":
            computes.setdefault(e.rank, []).append((e.t_start, e.t_end))
    def scheduled(e: TraceEvent) -> bool:
        return e.op == "compute" and e.tags.get("name") in SCHEDULE_KINDS and "microbatch" in e.tags

    planned: dict[int, object] = {}  # id of a recorded compute -> its action
    if schedules is not None:
        for rank, actions in schedules.items():
            mine = sorted((e for e in events if e.rank == rank and scheduled(e)),
                          key=lambda e: e.t_start)  # the order the rank started them in
            todo = iter([a for a in actions if a.is_compute])
            for e in mine:
                a = next(todo, None)
                chunk = e.tags.get("chunk") or 0
                if a is None or (a.kind, a.microbatch, a.chunk) != (
                        e.tags["name"], e.tags["microbatch"], chunk):
                    raise ValueError(f"rank {rank} recorded {e.tags['name']} of microbatch "
                                     f"{e.tags['microbatch']}, chunk {chunk} where its schedule "
                                     f"has {a.label if a else 'nothing more'}")
                planned[id(e)] = a
            left = next(todo, None)
            if mine and left is not None:
                raise ValueError(f"rank {rank}'s schedule has {left.label} and more after its "
                                 f"last recorded compute: the trace misses part of the step")
    out = []
    for e, span in zip(events, spans):
        name = e.tags.get("name")
        if scheduled(e):
            chunk = e.tags.get("chunk") or 0
            overlapped, chunk_name = False, ""
            if id(e) in planned:
                a = planned[id(e)]
                overlapped, chunk_name = a.overlapped, chunk_names(a.placement).get(a.chunk, "")
            out.append(schedule_span(e.rank, e.t_start, e.t_end, name, e.tags["microbatch"],
                                     chunk, span.lane, overlapped=overlapped,
                                     chunk_name=chunk_name, part=e.tags.get("part", "")))
        elif _posted_and_waited_later(e, computes):
            info = dict(span.info)
            info["waited on"] = (f"{e.t_end * 1e3:.3f} ms, {e.duration * 1e3:.3f} ms after "
                                 "it was posted (the rank computed meanwhile)")
            out.append(replace(span, end=span.start, info=info,
                               title=span.title + ": posted (isend), waited on later"))
        else:
            out.append(span)
    return out


def bubble_spans(spans: Iterable[Span | Sequence], lanes: Iterable[str] | None = None) -> list[Span]:
    """The idle time of each rank in each lane, as spans of kind :data:`BUBBLE`.

    A lane's step runs from its first compute to its last, over every rank drawn in it
    (for a simulated schedule: 0 to the makespan); a rank is idle wherever none of its
    compute spans (kinds ``forward``, ``backward``, ``compute``) runs.  ``lanes``: the
    lanes to mark (default: every lane with a ``forward`` or ``backward`` span).  Their
    total per rank is :func:`bubble_fraction`'s idle time when the window is the same.
    """
    spans = [Span.coerce(s) for s in spans]
    computing = [s for s in spans if s.kind in SCHEDULE_KINDS + ("compute",)]
    if lanes is None:
        lanes = [lane for lane in dict.fromkeys(s.lane for s in spans if s.kind in SCHEDULE_KINDS)]
    out = []
    for lane in lanes:
        mine = [s for s in computing if s.lane == lane]
        if not mine:
            continue
        w0, w1 = min(s.start for s in mine), max(s.end for s in mine)
        for rank in dict.fromkeys(s.rank for s in mine):
            t = w0
            for a, b in _union((s.start, s.end) for s in mine if s.rank == rank) + [(w1, w1)]:
                if a > t:
                    out.append(Span(rank, t, a, "", BUBBLE, lane, info={},
                                    title=f"idle: the bubble (rank {rank})",
                                    caption="idle (bubble)"))
                t = max(t, b)
    return out


def _chunk_color(color: str, chunk: int | None) -> str:
    return darken(color, min(0.75, CHUNK_DARKEN * chunk)) if chunk else color


# --- layout ----------------------------------------------------------------------------


def _nice_step(span: float, target: float) -> float:
    """A 1-2-5 step giving about ``target`` ticks over ``span`` (the script does the same)."""
    raw = span / max(target, 1.0)
    power = 10 ** math.floor(math.log10(raw))
    m = raw / power
    return (1 if m < 1.5 else 2 if m < 3.5 else 5 if m < 7.5 else 10) * power


def _ticks(d0: float, d1: float, plot_w: float) -> list[tuple[float, str]]:
    step = _nice_step(d1 - d0, plot_w / TICK_SPACING)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    first = math.ceil(d0 / step - 1e-9)
    out = []
    k = first
    while k * step <= d1 + 1e-9 * step:
        v = k * step
        out.append((v, f"{0.0 if abs(v) < step * 1e-9 else v:.{decimals}f}"))
        k += 1
    return out


def _pack(spans: list[tuple[int, Span]]) -> dict[int, int]:
    """Greedy interval packing: index -> row, so that spans sharing a row never overlap."""
    rows_end: list[float] = []
    out = {}
    for i, s in sorted(spans, key=lambda p: (p[1].start, -p[1].end)):
        for row, end in enumerate(rows_end):
            if end <= s.start:
                rows_end[row] = s.end
                out[i] = row
                break
        else:
            out[i] = len(rows_end)
            rows_end.append(s.end)
    return out


def _fmt(v: float) -> str:
    return f"{v:.3f}"


class Timeline(Widget):
    """A drawn timeline: ``.data`` holds every number drawn; ``to_html()`` the widget.

    ``data`` keys: ``domain`` (first and last time shown, display units), ``x0`` and
    ``plot_width`` (pixels: time t is drawn at ``x0 + (t - d0) * plot_width / (d1 - d0)``),
    ``ranks``, ``lanes``, ``lane_boxes`` (per rank and lane: top y, rows, height),
    ``bars`` (per span: rank, lane, row, start, end, x, y, w, h, label, kind, color),
    ``frames`` (per player frame: cursor time or None, what each rank is doing,
    the caption) and ``legend``.
    """

    styles = ("player.css", "timeline.css")
    scripts = ("player.js", "timeline.js")
    start = "startTimeline"
    id_prefix = "tl-timeline-"

    def __init__(self, data: dict, playable: bool, interval_ms: int, note: str):
        self.data = data
        self.playable = playable
        self.interval_ms = interval_ms
        self.note = note

    @property
    def title(self) -> str:
        return self.data["title"]

    def __len__(self) -> int:
        return len(self.data["frames"])

    def __repr__(self) -> str:
        d0, d1 = self.data["domain"]
        return (f"Timeline({len(self.data['bars'])} bars on ranks {self.data['ranks']}, "
                f"{d0:g}-{d1:g} {self.data['unit']}: {self.title!r})")

    # -- rendering --

    def parts(self, uid: str) -> tuple[str, str, object]:
        """The root (``tl-animation`` too when playable), legend, caption, chart, controls."""
        d = self.data
        n = len(d["frames"])
        classes = "tl-timeline tl-animation" if self.playable else "tl-timeline"
        frame_attrs = f' data-frame="0" data-frames="{n}"' if self.playable else ""
        legend = "".join(
            f'<span class="tl-legend-item"><span class="tl-swatch" style="background:'
            f'{_hatch_css(color) if kind == BUBBLE else color}'
            f'{f"; box-shadow: inset 0 0 0 2px {PAIR_EDGE}" if kind == "pair" else ""}">'
            f"</span>{html.escape(text)}</span>" for kind, color, text in d["legend"])
        controls = ""
        if self.playable:
            controls = (
                '<button type="button" class="tl-play" aria-label="Play or pause">'
                "&#9654;&#xFE0E; Play</button>"
                '<button type="button" class="tl-prev" title="Step back">&#8249; Back</button>'
                '<button type="button" class="tl-next" title="Step forward">Next &#8250;</button>'
                f'<input type="range" class="tl-slider" min="0" max="{n - 1}" step="1" value="0" '
                f'aria-label="Cursor time">'
                f'<span class="tl-anim-counter">overview</span>')
        controls += ('<button type="button" class="tl-zoom-reset" disabled '
                     'title="Show the whole time range">Reset zoom</button>')
        attributes = (f'class="{classes}" id="{uid}"{frame_attrs} data-zoom="{_fmt(d["domain"][0])} '
                      f'{_fmt(d["domain"][1])}"')
        markup = (f'<div class="tl-anim-title">{html.escape(d["title"])}</div>\n'
                  f'<div class="tl-legend">{legend}</div>\n'
                  f'<div class="tl-anim-caption" style="min-height:{self._caption_lines() * 1.4:.1f}em">'
                  f'{html.escape(d["frames"][0]["caption"])}</div>\n'
                  f'<div class="tl-stage">{self._svg(uid)}</div>\n'
                  # Outside the scrolling stage (which would clip it), positioned in the root.
                  f'<div class="tl-tooltip" role="tooltip" style="display:none"></div>\n'
                  f'<div class="tl-anim-controls">{controls}</div>\n'
                  + (f'<div class="tl-anim-note">{html.escape(self.note)}</div>\n' if self.note else ""))
        payload = {
            "d0": d["domain"][0], "d1": d["domain"][1], "x0": d["x0"], "pw": d["plot_width"],
            "minw": MIN_W, "charw": CHAR_W, "shortpad": SHORT_PAD, "spacing": TICK_SPACING,
            "unit": d["unit"],
            "top": AXIS_H, "bottom": d["height"],
            "tips": [[b["tip_title"], [[k, v] for k, v in b["tip"].items()]] for b in d["bars"]],
            "times": [f["t"] for f in d["frames"]],
            "captions": [f["caption"] for f in d["frames"]],
            "interval": int(self.interval_ms),
        }
        return attributes, ascii_html(markup), payload

    def _caption_lines(self) -> int:
        """Lines the longest caption needs at full width: the caption box keeps that height,
        so the chart does not jump while the cursor plays."""
        per_line = max(20, int((self.data["width"] - 34) / CAPTION_CHAR_W))
        return max(2, max(math.ceil(len(f["caption"]) / per_line) for f in self.data["frames"]))

    def _svg(self, uid: str) -> str:
        d = self.data
        x0, pw, width, height = d["x0"], d["plot_width"], d["width"], d["height"]
        d0, d1 = d["domain"]
        k = pw / (d1 - d0)
        multi_lane = len(d["lanes"]) > 1 or d["lanes"][0] != ""
        hatch = _hatch_pattern(uid) if any(b["kind"] == BUBBLE for b in d["bars"]) else ""
        out = [f'<svg class="tl-chart" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
               f'height="{height:.0f}" font-family="{SANS}" role="img" '
               f'aria-label="{html.escape(d["title"], quote=True)}">',
               f'<defs><clipPath id="{uid}-clip"><rect x="{x0:.1f}" y="0" width="{pw:.1f}" '
               f'height="{height:.0f}"/></clipPath>{hatch}</defs>']
        # Rank bands: labels on the left, a track per row of bars, separators between ranks.
        for i, band in enumerate(d["bands"]):
            if i:
                out.append(f'<line x1="8" x2="{width - 4:.0f}" y1="{band["y"]:.1f}" '
                           f'y2="{band["y"]:.1f}" stroke="{SEPARATOR}" stroke-width="1"/>')
            cy = band["y"] + band["h"] / 2
            out.append(f'<text x="10" y="{cy + 4.5:.1f}" font-size="12.5" font-weight="600" '
                       f'fill="{INK}">rank {band["rank"]}</text>')
        for box in d["lane_boxes"]:
            out.append(f'<rect x="{x0:.1f}" y="{box["y"] - 2:.1f}" width="{pw:.1f}" '
                       f'height="{box["h"] + 4:.1f}" rx="3" fill="{TRACK}"/>')
            if multi_lane and box["lane"]:
                out.append(f'<text x="{x0 - 8:.1f}" y="{box["y"] + ROW_H / 2 + 3.8:.1f}" '
                           f'font-size="10.5" text-anchor="end" fill="{MUTED}">'
                           f'{html.escape(box["lane"])}</text>')
        # The axis: ticks, labels and grid lines; the script redraws them on zoom.
        out.append(f'<text x="{x0 - 8:.1f}" y="{AXIS_H - 12:.1f}" font-size="11" text-anchor="end" '
                   f'fill="{MUTED}">time ({html.escape(d["unit"])})</text>')
        out.append('<g class="tl-axis">')
        for v, text in _ticks(d0, d1, pw):
            x = x0 + (v - d0) * k
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{AXIS_H - 5:.1f}" y2="{height - 4:.1f}" '
                       f'stroke="{GRID}" stroke-width="1"/>'
                       f'<text x="{x:.1f}" y="{AXIS_H - 12:.1f}" font-size="11" text-anchor="middle" '
                       f'fill="{MUTED}">{text}</text>')
        out.append("</g>")
        out.append(f'<line x1="{x0:.1f}" x2="{x0 + pw:.1f}" y1="{AXIS_H - 5:.1f}" '
                   f'y2="{AXIS_H - 5:.1f}" stroke="#aeb6bf" stroke-width="1"/>')
        # The bars, clipped to the plot (zoom moves them out of it).
        out.append(f'<g class="tl-bars" clip-path="url(#{uid}-clip)">')
        for i, b in enumerate(d["bars"]):
            ink = text_color(b["color"])
            edge = PAIR_EDGE if b.get("outline") else darken(b["color"], 0.25)
            edge_w = 1.8 if b.get("outline") else 0.6
            fill = f"url(#{uid}-hatch)" if b["kind"] == BUBBLE else b["color"]
            inset = 1.5 if b.get("short_fits") else 4
            label = html.escape(b.get("shown_label", b["label"]) or b["label"])
            shown = "" if b["label_fits"] or b.get("short_fits") else ' display="none"'
            short = (f' data-label="{html.escape(b["label"], quote=True)}" '
                     f'data-short="{html.escape(b["short_label"], quote=True)}"'
                     if b.get("short_label") else "")
            ghost = (f'<rect class="tl-ghost" x="{b["x"]:.2f}" y="{b["y"]:.1f}" width="{b["w"]:.2f}" '
                     f'height="{b["h"]:.1f}" rx="2" fill="{fill}" fill-opacity="0.16"/>'
                     if self.playable else "")
            out.append(f'<g class="tl-bar" data-i="{i}" data-rank="{b["rank"]}" '
                       f'data-kind="{html.escape(b["kind"], quote=True)}" data-s="{b["start"]!r}" '
                       f'data-e="{b["end"]!r}"{short}>{ghost}'
                       f'<rect class="tl-solid" x="{b["x"]:.2f}" y="{b["y"]:.1f}" width="{b["w"]:.2f}" '
                       f'height="{b["h"]:.1f}" rx="2" fill="{fill}" stroke="{edge}" '
                       f'stroke-width="{edge_w}"/>'
                       f'<text class="tl-label" x="{max(b["x"], x0) + inset:.2f}" '
                       f'y="{b["y"] + b["h"] / 2 + 3.7:.1f}" font-size="10.5" fill="{ink}" '
                       f'pointer-events="none"{shown}>{label}</text></g>')
        out.append("</g>")
        # The cursor (player) and the zoom brush, hidden until used.
        out.append(f'<g class="tl-cursor" display="none"><line x1="0" x2="0" y1="{AXIS_H - 5:.1f}" '
                   f'y2="{height - 2:.1f}" stroke="{INK}" stroke-width="1.5"/>'
                   f'<path d="M -5 {AXIS_H - 9:.1f} L 5 {AXIS_H - 9:.1f} L 0 {AXIS_H - 3:.1f} Z" '
                   f'fill="{INK}"/></g>')
        out.append(f'<rect class="tl-brush" x="0" y="{AXIS_H - 5:.1f}" width="0" '
                   f'height="{height - AXIS_H + 3:.1f}" fill="#4e79a7" fill-opacity="0.15" '
                   f'stroke="#4e79a7" stroke-width="1" display="none"/>')
        out.append("</svg>")
        return "".join(out)


def _hatch_pattern(uid: str) -> str:
    """The SVG pattern bubble bars are filled with: red stripes on white."""
    color = SCHEDULE_COLORS[BUBBLE]
    return (f'<pattern id="{uid}-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fdf3f4"/>'
            f'<rect width="2" height="6" fill="{color}" fill-opacity="0.55"/></pattern>')


def _hatch_css(color: str) -> str:
    """The legend swatch of the bubble: the same stripes in CSS."""
    return f"repeating-linear-gradient(45deg, {color} 0 2px, #fdf3f4 2px 5px)"


def _kind_order(kinds: Iterable[str]) -> list[str]:
    known = list(KIND_COLORS)
    kinds = list(dict.fromkeys(kinds))
    return ([k for k in dict.fromkeys(["compute"] + known) if k in kinds]
            + [k for k in kinds if k not in known and k != "compute"])


def _doing_text(captions: list[str]) -> str:
    """``["backward", "all-reduce [dp]", "all-reduce [dp]"]`` -> ``"backward + 2\u00d7 all-reduce [dp]"``."""
    counts: dict[str, int] = {}
    for c in captions:
        counts[c] = counts.get(c, 0) + 1
    return " + ".join(f"{n}\u00d7 {c}" if n > 1 else c for c, n in counts.items()) or "idle"


def _rank_list(ranks: list[int], order: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"ranks 0\u20133"`` (a run in drawing order), else ``"ranks 0, 2"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    pos = [order.index(r) for r in ranks]
    if len(ranks) > 2 and pos == list(range(pos[0], pos[0] + len(pos))):
        return f"ranks {ranks[0]}\u2013{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _doing_caption(doing: dict[int, list[str]]) -> str:
    """What every rank does at one instant; ranks doing the same thing share one entry."""
    same: dict[str, list[int]] = {}
    for r, captions in doing.items():
        same.setdefault(_doing_text(captions), []).append(r)
    order = list(doing)
    return " \u00b7 ".join(f"{_rank_list(rs, order)}: {text}" for text, rs in same.items())


def _schedule_legend(bars: list[dict], color_of) -> list[tuple[str, str, str]]:
    """Legend entries for forwards, backwards and W's: one per kind, or per (kind, chunk)
    when a rank runs several chunks (named by :attr:`Span.chunk_name` when set); one for
    the overlapped pairs' outline."""
    names = {b["chunk"] or 0: b.get("chunk_name") for b in bars if b["kind"] in SCHEDULE_KINDS}
    drawn = {(b["kind"], b["chunk"] or 0) for b in bars if b["kind"] in SCHEDULE_KINDS}
    chunked = any(chunk for _, chunk in drawn)
    out = []
    for kind in SCHEDULE_KINDS:
        for chunk in sorted(c for k, c in drawn if k == kind):
            text = f"{kind}, {names.get(chunk) or f'chunk {chunk}'}" if chunked else kind
            out.append((kind, _chunk_color(color_of(kind), chunk), text))
    if any(b.get("outline") for b in bars):
        out.append(("pair", "#ffffff", "outlined: an overlapped F&B pair"))
    return out


def _schedule_note(spans: list[Span]) -> str:
    """The sentence a schedule's drawing starts its note with: what its colours, its
    hatching and its ticks mean ("" when it draws none of them)."""
    parts = []
    if any(s.kind in SCHEDULE_KINDS for s in spans):
        chunked = any(s.chunk for s in spans if s.kind in SCHEDULE_KINDS)
        weights = any(s.kind == "weight" for s in spans)
        parts.append("forwards blue, backwards orange" + (", W's green" if weights else "")
                     + (" (each further chunk a darker shade)" if chunked else ""))
    if any(s.outline for s in spans):
        parts.append("the two halves of an overlapped pair share a dark outline")
    if any(s.kind == BUBBLE for s in spans):
        parts.append("each rank's idle time (the bubble) hatched")
    if any(s.end == s.start and "waited on" in s.info for s in spans):
        parts.append("a send posted before a compute and waited on at the end of the step "
                     "is a tick where it was posted")
    if not parts:
        return ""
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + ". "


def timeline_from_spans(spans: Iterable[Span | Sequence], title: str | None = None,
                        ranks: Iterable[int] | None = None,
                        t_range: tuple[float, float] | None = None, width: int = 900,
                        playable: bool = True, *, lanes: Sequence[str] | None = None,
                        kinds: Iterable[str] | None = None, frames: int = 40,
                        scale: float = 1000.0, unit: str = "ms",
                        colors: dict[str, str] | None = None, note: str | None = None,
                        interval_ms: int = 150,
                        bubble: bool | Sequence[str] = False) -> Timeline:
    """Draw spans (``Span`` or ``(rank, start, end, label, kind[, lane])``): one band per rank.

    ``ranks``: the bands, in order (default: every rank with a span).  ``lanes``:
    the lanes of each band, top to bottom (default: ``planned``, ``compute``,
    ``comm`` when present, then the rest in order of appearance).  ``kinds``: keep
    spans of these kinds only.  Times are shown multiplied by ``scale`` in ``unit``
    (seconds to ``ms`` by default; ``scale=1, unit="step"`` for a schedule in
    slots); ``t_range`` (display units) fixes the range shown.  ``colors``
    overrides the colour of a kind.  ``frames``: cursor positions of the player.
    ``bubble``: mark each rank's idle time (:func:`bubble_spans`), hatched, in every lane
    that holds a schedule's forwards and backwards (``True``) or in the lanes named.
    Spans of kinds ``forward`` / ``backward`` (:func:`schedule_span`) take
    :data:`SCHEDULE_COLORS`, a shade darker per chunk, with one legend entry per chunk.
    """
    spans = [Span.coerce(s) for s in spans]
    if kinds is not None:
        keep = set(kinds)
        spans = [s for s in spans if s.kind in keep]
    if ranks is not None:
        ranks = list(ranks)
        keep_ranks = set(ranks)
        spans = [s for s in spans if s.rank in keep_ranks]
    else:
        ranks = sorted({s.rank for s in spans})
    if not spans or not ranks:
        raise ValueError("timeline: nothing to draw (no spans, or the filters removed them all)")
    if frames < 1:
        raise ValueError(f"timeline: frames must be at least 1, got {frames}")
    if bubble:
        spans = spans + bubble_spans(spans, None if bubble is True else list(bubble))
    palette = {**KIND_COLORS, **SCHEDULE_COLORS, **(colors or {})}

    def color_of(kind: str) -> str:
        return palette.get(kind, kind_color(kind))

    # The time range shown, in display units.
    if t_range is not None:
        d0, d1 = float(t_range[0]), float(t_range[1])
        if not d1 > d0:
            raise ValueError(f"timeline: t_range must be (start, end) with end > start, got {t_range}")
        spans = [s for s in spans if s.end * scale > d0 and s.start * scale < d1]
    elif spans:
        d0 = min(s.start for s in spans) * scale
        d1 = max(s.end for s in spans) * scale
    else:
        d0, d1 = 0.0, 1.0
    if d1 <= d0:
        d1 = d0 + 1.0

    present = list(dict.fromkeys(s.lane for s in spans))
    if lanes is None:
        preferred = [lane for lane in ("planned", "compute", "comm") if lane in present]
        lanes = preferred + [lane for lane in present if lane not in preferred] or [""]
    else:
        lanes = list(lanes)
        missing = [lane for lane in present if lane not in lanes]
        if missing:
            raise ValueError(f"timeline: spans use lanes {missing} that are not in lanes={lanes}")

    x0 = LEFT
    plot_w = float(width) - LEFT - RIGHT
    if plot_w < 100:
        raise ValueError(f"timeline: width {width} leaves no room for the plot (need > {LEFT + RIGHT + 100:g})")
    k = plot_w / (d1 - d0)

    def x_of(t: float) -> float:
        return x0 + (t - d0) * k

    # Rows: pack the spans of each (rank, lane) so that no two in a row overlap.
    groups: dict[tuple[int, str], list[tuple[int, Span]]] = {}
    for i, s in enumerate(spans):
        groups.setdefault((s.rank, s.lane), []).append((i, s))
    row_of: dict[int, int] = {}
    n_rows: dict[tuple[int, str], int] = {}
    for key, members in groups.items():
        packed = _pack(members)
        row_of.update(packed)
        n_rows[key] = max(packed.values()) + 1

    bands, lane_boxes, lane_top = [], [], {}
    y = AXIS_H
    for r in ranks:
        top = y
        y += BAND_PAD
        for j, lane in enumerate(lanes):
            rows = n_rows.get((r, lane), 1)
            h = rows * ROW_H + (rows - 1) * ROW_GAP
            lane_top[(r, lane)] = y
            lane_boxes.append({"rank": r, "lane": lane, "y": y, "rows": rows, "h": h})
            y += h + (LANE_GAP if j < len(lanes) - 1 else 0)
        y += BAND_PAD
        bands.append({"rank": r, "y": top, "h": y - top})
    height = y + 6

    bars = []
    order = sorted(range(len(spans)), key=lambda i: (ranks.index(spans[i].rank), spans[i].start))
    for i in order:
        s = spans[i]
        start, end = s.start * scale, s.end * scale
        xa, xb = x_of(max(start, d0)), x_of(min(end, d1))
        w = max(MIN_W, xb - xa)
        info = dict(s.info)
        info["start"] = f"{start:.3f} {unit}"
        info["end"] = f"{end:.3f} {unit}"
        info["duration"] = f"{end - start:.3f} {unit}"
        label_w = len(s.label) * CHAR_W + 8
        room = min(xb, x0 + plot_w) - max(xa, x0)
        fits = bool(s.label) and room >= label_w
        short_fits = (not fits and bool(s.short_label)
                      and room >= len(s.short_label) * CHAR_W + SHORT_PAD)
        bars.append({
            "rank": s.rank, "lane": s.lane, "row": row_of[i], "start": start, "end": end,
            "x": xa, "y": lane_top[(s.rank, s.lane)] + row_of[i] * (ROW_H + ROW_GAP),
            "w": w, "h": ROW_H, "label": s.label, "kind": s.kind,
            "color": _chunk_color(color_of(s.kind), s.chunk), "chunk": s.chunk,
            "chunk_name": s.chunk_name, "outline": s.outline,
            "short_label": s.short_label, "label_fits": fits, "short_fits": short_fits,
            "shown_label": s.label if fits else s.short_label if short_fits else "",
            "caption": s.caption or s.label, "tip_title": s.title or s.label, "tip": info,
        })

    # Player frames: 0 is the overview; 1..frames sweep the cursor to the end.
    total = len(bars)
    kinds_drawn = _kind_order(b["kind"] for b in bars)
    overview = (f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}, {total} bar"
                f"{'s' if total != 1 else ''} over {d1 - d0:.3g} {unit}.")
    overview += (" Press Play to sweep a cursor through time, hover a bar for details, "
                 "drag across the chart to zoom." if playable else
                 " Hover a bar for details; drag across the chart to zoom.")
    frame_list = [{"t": None, "doing": {}, "caption": overview}]
    if playable:
        for f in range(1, frames + 1):
            t = d0 + (d1 - d0) * f / frames
            doing = {r: [b["caption"] for b in bars
                         if b["rank"] == r and b["start"] <= t < b["end"]] for r in ranks}
            caption = f"t = {t:.2f} {unit} \u2014 " + _doing_caption(doing)
            if f == frames and not any(doing.values()):
                caption = f"t = {t:.2f} {unit} \u2014 the end: every rank has finished."
            frame_list.append({"t": t, "doing": doing, "caption": caption})

    legend = [(kind, color_of(kind),
               kind if kind == "compute" or kind not in KIND_NAMES else f"{kind} \u00b7 {KIND_NAMES[kind]}")
              for kind in kinds_drawn if kind not in SCHEDULE_KINDS + (BUBBLE,)]
    legend = _schedule_legend(bars, color_of) + legend
    if any(b["kind"] == BUBBLE for b in bars):
        legend.append((BUBBLE, color_of(BUBBLE), "bubble (idle)"))
    data = {
        "title": title or "Timeline", "unit": unit, "scale": scale, "domain": (d0, d1),
        "x0": x0, "plot_width": plot_w, "width": float(width), "height": height,
        "ranks": ranks, "lanes": lanes, "bands": bands, "lane_boxes": lane_boxes,
        "bars": bars, "frames": frame_list, "legend": legend,
    }
    if note is None:
        note = ("Hover a bar for details; drag across the chart to zoom into a time range.")
    note = _schedule_note(spans) + note
    return Timeline(data, playable, interval_ms, note)


def timeline(trace: Trace, title: str | None = None, ranks: Iterable[int] | None = None,
             kinds: Iterable[str] | None = None, t_range: tuple[float, float] | None = None,
             width: int = 900, playable: bool = True, *, split: bool | None = None,
             frames: int = 40, interval_ms: int = 150, pipeline: bool = False) -> Timeline:
    """Draw a recorded trace: one band per rank, time in ms since the first event.

    ``ranks``: which ranks, in order.  ``kinds``: which kinds of bars to keep;
    compute spans are kind ``"compute"``, so ``kinds=["dp", "compute"]`` shows the
    data-parallel ops next to the compute they overlap.  ``t_range``: ``(start,
    end)`` in ms.  ``split``: compute and comm in separate lanes of a rank's band
    (default: when the trace has both).  ``playable``: add the cursor player.
    ``pipeline``: draw a pipeline step as a schedule (:func:`pipeline_spans`): forwards
    and backwards in their colours, shaded by chunk, the bubble hatched, and a send
    waited on only at the end of the step (the labels' ``isend``) as a tick where it was
    posted.
    """
    if not len(trace):
        raise ValueError("timeline: the trace is empty (was the launch run with trace=True?)")
    ranks = None if ranks is None else list(ranks)
    if pipeline:
        spans = pipeline_spans(trace, ranks=ranks, kinds=kinds, split=split)
    else:
        spans = trace_spans(trace, ranks=ranks, kinds=kinds, split=split)
    if ranks is None:
        ranks = sorted({s.rank for s in spans})
    has_split = any(s.lane for s in spans)
    lanes = list(TRACE_LANES) if has_split else [""]
    if title is None:
        n_ops = sum(1 for s in spans if s.kind not in ("compute",) + SCHEDULE_KINDS)
        n_compute = len(spans) - n_ops
        title = (f"Timeline of ranks {list(ranks)}: {n_ops} communication op"
                 f"{'s' if n_ops != 1 else ''}" + (f", {n_compute} compute span"
                                                   f"{'s' if n_compute != 1 else ''}"
                                                   if n_compute else ""))
    note = ("A bar runs from when the op was issued to when it completed; for an asynchronous "
            "op that is when wait() returned, so its bar is the time it was in flight, "
            "including any time spent waiting for the other ranks of its group to issue it "
            "(the tooltip says how long). Ops in flight at the same time stack into extra "
            "rows. Hover a bar for details; drag across the chart to zoom.")
    return timeline_from_spans(spans, title=title, ranks=ranks, t_range=t_range, width=width,
                               playable=playable, lanes=lanes, frames=frames, note=note,
                               interval_ms=interval_ms, bubble=pipeline)


__all__ = ["Span", "Timeline", "timeline", "timeline_from_spans", "trace_spans", "event_label",
           "format_bytes", "overlap_seconds", "overlap_fraction", "overlap_breakdown",
           "collective_instances", "COLLECTIVE_OPS", "busy_fraction",
           "bubble_fraction", "KIND_NAMES"]
__all__ += ["schedule_span", "plan_spans", "pipeline_spans", "bubble_spans", "chunk_names",
            "SCHEDULE_COLORS", "SCHEDULE_KINDS", "BUBBLE", "PART_NAMES"]
