"""Recorded traces: one flat event per communication op (or compute span) per rank.

Every collective and point-to-point op that :mod:`tutorial_lib.comm` issues
appends a :class:`TraceEvent` to the calling rank's :class:`Tracer`.  The
launcher collects the events of every rank and returns them merged as a
:class:`Trace`.  Widgets draw from these events and tests compare their byte
counts with the closed-form predictions in the library: nothing a chapter
shows is a cartoon.

Times are wall-clock seconds (``time.time()``), shared by all processes on one
machine; :meth:`Trace.relative` shifts them so the first event starts at 0.
"""
from __future__ import annotations

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

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    def to_dict(self) -> dict:
        return asdict(self)


class Tracer:
    """The per-process recorder.  ``get_tracer()`` returns the one the launcher set up."""

    def __init__(self, rank: int = 0, enabled: bool = True, capture_values: int = 0):
        self.rank = rank
        self.enabled = enabled
        self.capture_values = capture_values
        """Record tensor values for tensors with at most this many elements (0: never)."""
        self.events: list[TraceEvent] = []
        self._tags: dict[str, Any] = {}
        self.pending: TraceEvent | None = None
        """The op this rank is blocked in right now, if any (read by the deadlock report)."""
        self.finished = False
        """Set by the launcher once the rank's function has returned."""

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

    def begin(self, op: str, blocking: bool = True, **fields: Any) -> TraceEvent:
        """Start an event; call :meth:`end` when the op completes.

        A blocking op becomes :attr:`pending` until it ends; an asynchronous one
        only while something waits on it (:meth:`waiting`).
        """
        tags = {**self._tags, **fields.pop("tags", {})}
        event = TraceEvent(rank=self.rank, op=op, t_start=time.time(), tags=tags, **fields)
        if blocking:
            self._set_pending(event)
        return event

    def end(self, event: TraceEvent) -> TraceEvent:
        event.t_end = time.time()
        if self.pending is event:
            self._set_pending(None)
        if self.enabled:
            self.events.append(event)
        return event

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
        """Record a ``compute`` span around local work: ``with tracer.span("forward", microbatch=0):``."""
        event = TraceEvent(rank=self.rank, op="compute", t_start=time.time(),
                           tags={**self._tags, **tags, "name": name})
        try:
            yield event
        finally:
            event.t_end = time.time()
            if self.enabled:
                self.events.append(event)

    def clear(self) -> None:
        self.events.clear()


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
