"""Recorded traces: one flat event per communication op (or compute span) per rank.

Every collective and point-to-point op that :mod:`tutorial_lib.comm` issues
appends a :class:`TraceEvent` to the calling rank's :class:`Tracer`.  The
launcher collects the events of every rank and returns them merged as a
:class:`Trace`.  Widgets draw from these events and tests compare their byte
counts with the closed-form predictions in the library: nothing a chapter
shows is a cartoon.

Times are wall-clock seconds (``time.time()``), shared by all processes on one
machine; :meth:`Trace.relative` shifts them so the first event starts at 0.

**On a GPU** the host clock would lie: an NCCL collective returns to Python as soon as it
is queued on the GPU, long before it runs, and so does every kernel of a compute span.
So a rank whose tensors live on ``cuda:N`` (:meth:`Tracer.use_device`; the launcher calls
it) times every op on a CUDA tensor, and every :meth:`Tracer.span`, with two CUDA events
recorded on the current stream: one before the op is queued, one after (for an async op,
after ``wait()``, which makes the stream wait for it).  The start event fires when the
GPU has finished the work queued before the op, the end event when the op is done and
the stream may go on: the interval is what the op occupied the GPU's timeline, waiting
for its peers included.  The events are converted to wall-clock seconds when the rank's
events are collected (:meth:`Tracer.resolved_events`, one ``synchronize``), from one
anchor event recorded on an idle GPU at :meth:`Tracer.use_device`; such events say
``clock="cuda"``.  CPU tensors keep the host clock (``clock="host"``).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator


@dataclass
class TraceEvent:
    """One op on one rank."""

    rank: int
    """Global rank that issued the op."""
    op: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``, ``broadcast``,
    ``send``, ``recv``, ``barrier``, or ``compute`` for a labelled span of local work."""
    group_kind: str | None = None
    """Which communicator: ``tp``, ``pp``, ``dp``, ``ep``, ``expert_dp``, ``world``..."""
    group_ranks: tuple[int, ...] = ()
    """Global ranks of the communicator, in group order."""
    peer: int | None = None
    """For send/recv: the global rank on the other end (destination or source)."""
    shape: tuple[int, ...] = ()
    """Shape of the tensor this rank passed in."""
    dtype: str = ""
    """Its dtype as torch prints it without the ``torch.`` prefix, e.g. ``float32``."""
    bytes: int = 0
    """Bytes of the tensor this rank passed in (for all-to-all: the bytes it sent)."""
    t_start: float = 0.0
    """When the op was issued (``time.time()`` seconds)."""
    t_end: float = 0.0
    """When it completed (for async ops: when ``wait()`` returned)."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Free-form labels: layer, microbatch, phase, step, ..."""
    values_in: list | None = None
    """Tensor values before the op (only for small tensors when capture is on)."""
    values_out: list | None = None
    """Tensor values after the op (likewise)."""
    splits: dict[str, list[int]] | None = None
    """For all-to-all: ``{"input": [...], "output": [...]}`` row counts per peer."""
    clock: str = "host"
    """What timed it: ``host`` (``time.time()`` around the call) or ``cuda`` (CUDA events on
    the rank's stream, converted to wall-clock seconds; see the module docstring)."""

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    def to_dict(self) -> dict:
        return asdict(self)


class CudaClock:
    """Wall-clock seconds of CUDA events on one device, from one anchor.

    The anchor is an event recorded right after a ``synchronize`` (the stream is idle, so
    it fires at once) together with ``time.time()``; an event's time is the anchor's plus
    the GPU time elapsed between the two.  Events are read only after a ``synchronize``.
    """

    def __init__(self, device: str):
        import torch
        self.torch, self.device = torch, torch.device(device)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            self.anchor = self.mark()
            self.anchor_seconds = time.time()

    def mark(self):
        """An event recorded now on the current stream."""
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def seconds(self, event) -> float:
        return self.anchor_seconds + self.anchor.elapsed_time(event) / 1e3


class Tracer:
    """The per-process recorder.  ``get_tracer()`` returns the one the launcher set up."""

    def __init__(self, rank: int = 0, enabled: bool = True, capture_values: int = 0):
        self.rank = rank
        self.enabled = enabled
        self.capture_values = capture_values
        """Record tensor values for tensors with at most this many elements (0: never)."""
        self.events: list[TraceEvent] = []
        self._shared_tags: dict[str, Any] = {}
        self._local = threading.local()  # a thread's own tags (see _tags)
        self.pending: TraceEvent | None = None
        """The op this rank is blocked in right now, if any (read by the deadlock report)."""
        self.finished = False
        """Set by the launcher once the rank's function has returned."""
        self.cuda_clock: CudaClock | None = None
        """Set by :meth:`use_device` for a rank on a GPU: ops on CUDA tensors and compute
        spans are then timed with CUDA events."""
        self._marks: dict[int, list] = {}  # id(event) -> [start mark, end mark]

    def use_device(self, device: str) -> None:
        """This rank's tensors live on ``device``; on ``cuda:N``, time with CUDA events."""
        if str(device).startswith("cuda") and self.enabled:
            self.cuda_clock = CudaClock(device)

    @property
    def _tags(self) -> dict[str, Any]:
        """The tags in force in the calling thread: those of the process (every thread's,
        autograd's device threads included), or a thread's own once it has called
        :meth:`adopt_tags` (the pipeline runs an overlapped backward in a second thread,
        with its own microbatch's tags)."""
        own = getattr(self._local, "tags", None)
        return self._shared_tags if own is None else own

    @_tags.setter
    def _tags(self, tags: dict[str, Any]) -> None:
        if getattr(self._local, "tags", None) is None:
            self._shared_tags = tags
        else:
            self._local.tags = tags

    def adopt_tags(self, tags: dict[str, Any]) -> None:
        """Give the calling thread tags of its own, starting from ``tags`` (another
        thread's :meth:`current_tags`); the other threads no longer see its changes."""
        self._local.tags = dict(tags)

    @contextmanager
    def tags(self, **tags: Any) -> Iterator[None]:
        """Attach ``tags`` to every event recorded inside the ``with`` block."""
        saved = self._tags
        self._tags = {**saved, **tags}
        try:
            yield
        finally:
            self._tags = saved

    def current_tags(self) -> dict[str, Any]:
        return dict(self._tags)

    def wants_values(self, numel: int) -> bool:
        return self.enabled and 0 < numel <= self.capture_values

    def begin(self, op: str, blocking: bool = True, on_gpu: bool = False,
              **fields: Any) -> TraceEvent:
        """Start an event; call :meth:`end` when the op completes.

        A blocking op becomes :attr:`pending` until it ends; an asynchronous one
        only while something waits on it (:meth:`waiting`).  ``on_gpu``: the op's tensor is
        on this rank's GPU: time it with CUDA events (see the module docstring).
        """
        tags = {**self._tags, **fields.pop("tags", {})}
        event = TraceEvent(rank=self.rank, op=op, t_start=time.time(), tags=tags, **fields)
        if on_gpu:
            self._start_mark(event)
        if blocking:
            self._set_pending(event)
        return event

    def end(self, event: TraceEvent) -> TraceEvent:
        event.t_end = time.time()
        self._end_mark(event)
        if self.pending is event:
            self._set_pending(None)
        if self.enabled:
            self.events.append(event)
        return event

    def _start_mark(self, event: TraceEvent) -> None:
        if self.enabled and self.cuda_clock is not None:
            event.clock = "cuda"
            self._marks[id(event)] = [self.cuda_clock.mark(), None]

    def _end_mark(self, event: TraceEvent) -> None:
        marks = self._marks.get(id(event))
        if marks is not None:
            marks[1] = self.cuda_clock.mark()

    @contextmanager
    def waiting(self, event: TraceEvent) -> Iterator[None]:
        """Mark ``event`` as what this rank is blocked in (e.g. ``work.wait()``)."""
        self._set_pending(event)
        try:
            yield
        finally:
            self._set_pending(None)

    def _set_pending(self, event: TraceEvent | None) -> None:
        # A plain assignment: this runs twice per op, so it must cost nothing.
        # The launcher's watchdog thread reads it only when a deadlock report is due.
        self.pending = event

    @contextmanager
    def span(self, name: str, **tags: Any) -> Iterator[TraceEvent]:
        """Record a ``compute`` span around local work: ``with tracer.span("forward", microbatch=0):``.

        On a GPU rank (:meth:`use_device`) the span is the GPU time of the work queued
        inside it, from CUDA events, not the host time it took to queue it.
        """
        event = TraceEvent(rank=self.rank, op="compute", t_start=time.time(),
                           tags={**self._tags, **tags, "name": name})
        self._start_mark(event)
        try:
            yield event
        finally:
            event.t_end = time.time()
            self._end_mark(event)
            if self.enabled:
                self.events.append(event)

    def resolved_events(self) -> list[TraceEvent]:
        """The events, with the CUDA-timed ones' ``t_start`` / ``t_end`` read from their
        events (one ``synchronize`` first, when there are any)."""
        if self._marks:
            self.cuda_clock.synchronize()
            for event in self.events:
                marks = self._marks.pop(id(event), None)
                if marks is not None and marks[1] is not None:
                    event.t_start = self.cuda_clock.seconds(marks[0])
                    event.t_end = self.cuda_clock.seconds(marks[1])
            self._marks.clear()
        return list(self.events)

    def event_dicts(self) -> list[dict]:
        """:meth:`resolved_events` as plain dicts, to send back to the launcher."""
        return [e.to_dict() for e in self.resolved_events()]

    def clear(self) -> None:
        self.events.clear()
        self._marks.clear()


_TRACER = Tracer(enabled=False)


def get_tracer() -> Tracer:
    """The tracer of this process (a disabled one outside a launch)."""
    return _TRACER


def set_tracer(tracer: Tracer) -> Tracer:
    global _TRACER
    _TRACER = tracer
    return tracer


class Trace:
    """The merged events of every rank, sorted by start time."""

    def __init__(self, events: Iterable[TraceEvent]):
        self.events = sorted(events, key=lambda e: (e.t_start, e.rank))

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def __getitem__(self, i):
        return self.events[i]

    def __repr__(self) -> str:
        ranks = sorted({e.rank for e in self.events})
        return f"Trace({len(self.events)} events on ranks {ranks})"

    def filter(self, op: str | None = None, group_kind: str | None = None,
               rank: int | None = None, comm_only: bool = False, **tags: Any) -> "Trace":
        """Events matching every given field (tags compare by equality)."""
        def keep(e: TraceEvent) -> bool:
            return ((op is None or e.op == op)
                    and (group_kind is None or e.group_kind == group_kind)
                    and (rank is None or e.rank == rank)
                    and (not comm_only or e.op != "compute")
                    and all(e.tags.get(k) == v for k, v in tags.items()))
        return Trace(e for e in self.events if keep(e))

    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def by_rank(self) -> dict[int, list[TraceEvent]]:
        out: dict[int, list[TraceEvent]] = {}
        for e in self.events:
            out.setdefault(e.rank, []).append(e)
        return out

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    def relative(self) -> "Trace":
        """A copy with times shifted so the earliest event starts at 0."""
        if not self.events:
            return Trace([])
        t0 = min(e.t_start for e in self.events)
        shifted = []
        for e in self.events:
            d = asdict(e)
            d["t_start"] -= t0
            d["t_end"] -= t0
            shifted.append(TraceEvent(**d))
        return Trace(shifted)

    def summary(self) -> list[dict]:
        """One row per (op, group kind, group, shape, dtype): how often and how many bytes per rank."""
        rows: dict[tuple, dict] = {}
        for e in self.events:
            if e.op == "compute":
                continue
            key = (e.op, e.group_kind, e.group_ranks, e.shape, e.dtype)
            row = rows.setdefault(key, {"op": e.op, "group_kind": e.group_kind,
                                        "group_ranks": list(e.group_ranks), "shape": list(e.shape),
                                        "dtype": e.dtype, "calls": 0, "bytes": 0})
            row["calls"] += 1
            row["bytes"] += e.bytes
        return list(rows.values())

    def to_dicts(self) -> list[dict]:
        return [e.to_dict() for e in self.events]

    @classmethod
    def from_dicts(cls, rows: Iterable[dict]) -> "Trace":
        events = []
        for r in rows:
            r = dict(r)
            r["group_ranks"] = tuple(r.get("group_ranks", ()))
            r["shape"] = tuple(r.get("shape", ()))
            events.append(TraceEvent(**r))
        return cls(events)
