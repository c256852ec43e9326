"""What every timing run shares: its argument check, its launch, its rounds.

A timing run starts processes (:func:`tutorial_lib.launch.launch`), repeats what it times
after a few untimed warm-up rounds and reads the times back (from the trace, or from each
rank's own clock).  Three pieces are the same for all of them:

* :func:`check_timing_args`: the ranks, repeats, warm-up rounds and sizes, refused with the
  rule, the value and a fix before any process starts;
* :func:`timed_launch`: the launch, without torch's collective-consistency check (in a
  notebook it is on by default, and it would add a collective of its own before each timed
  one: the chapters' timings would not be the stored references', measured from scripts);
* :func:`rounds_by_size`: a run's trace cut into rounds, one per iteration on every rank,
  and their median per size (chapter 2's collectives, chapter 7's P2P modes).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..launch import launch

__all__ = ["check_timing_args", "timed_launch", "TimedRounds", "rounds_by_size"]


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_timing_args(ranks_name: str, ranks, least: int, why: str, repeats: int = 1,
                      warmup: int = 0,
                      sizes: Sequence[int] | Mapping[str, Sequence[int]] | None = None) -> None:
    """Refuse a timing run's bad arguments before any process starts (``ValueError``).

    ``ranks`` (called ``ranks_name`` in the caller's signature) must be a whole number of at
    least ``least``, ``why`` saying what needs that many; ``repeats >= 1`` timed rounds after
    ``warmup >= 0`` untimed ones; ``sizes``, when given, a non-empty list of byte counts
    ``>= 1``, or a mapping from each measured thing to such a list (each checked, the
    message naming the one at fault).
    """
    if not _is_whole(ranks) or ranks < least:
        raise ValueError(f"{ranks_name} must be a whole number >= {least} ({why}), got "
                         f"{ranks!r}; try {ranks_name}={least}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"warmup={warmup}; try repeats={max(repeats, 1)}, "
                         f"warmup={max(warmup, 0)}")
    if sizes is None:
        return
    lists = sizes.items() if isinstance(sizes, Mapping) else [(None, sizes)]
    for name, listed in lists:
        listed = list(listed)
        if not listed or any(int(s) < 1 for s in listed):
            where = "" if name is None else f" for {name}"
            raise ValueError(f"sizes must be a non-empty list of byte counts >= 1, got "
                             f"{listed}{where}; e.g. [1024, 65536]")


def timed_launch(fn, ranks: int, args: tuple, timeout: float, **options):
    """:func:`tutorial_lib.launch.launch` for a timing run: ``fn`` on ``ranks`` ranks, torch's
    collective-consistency check off (it would add a collective before each timed one);
    ``options`` go to the launch as they are (``print_output``, ``backend``, ``threads``)."""
    return launch(fn, ranks, args=args, timeout=timeout, check_collectives=False, **options)


# --- the rounds of a timing run ----------------------------------------------------------


@dataclass(frozen=True)
class TimedRounds:
    """The non-warm-up rounds of one measured thing (an op, a P2P mode) on one size."""

    name: str
    """What was measured: the value of the run's tag (``all_reduce``, ``batched``, ...)."""
    size: int
    """The ``size`` tag: bytes asked for (the bytes moved may be rounded)."""
    events: tuple[tuple, ...]
    """Each round's trace events, every rank's, in the order the trace holds the rounds."""
    seconds: tuple[float, ...]
    """Each round's time: ``max(t_end) - max(first t_start per rank)`` over its events."""

    @property
    def median_seconds(self) -> float:
        """The median round time, at least 1 ns (a fit or a ratio cannot use 0)."""
        return max(statistics.median(self.seconds), 1e-9)


def _round_seconds(events) -> float:
    """From the moment the last rank began its round (before that, the others only wait
    for it) until the last rank is done."""
    first_start = {}
    for e in events:
        first_start[e.rank] = min(first_start.get(e.rank, e.t_start), e.t_start)
    return max(e.t_end for e in events) - max(first_start.values())


def rounds_by_size(trace, tag: str) -> dict[tuple[str, int], TimedRounds]:
    """Group a timing run's events into rounds: ``{(name, size): TimedRounds}``.

    The run tags every timed call with ``tag`` (what is measured, e.g. ``measured_op``),
    ``size``, ``iteration`` and ``warmup``; one round is one iteration on every rank.
    Untagged events and warm-up rounds are left out.  The median over the rounds shrugs
    off the odd round where the scheduler paused a process.
    """
    rounds: dict[tuple, dict] = {}
    for e in trace:
        if tag not in e.tags or e.tags.get("warmup"):
            continue
        by_iteration = rounds.setdefault((e.tags[tag], e.tags["size"]), {})
        by_iteration.setdefault(e.tags["iteration"], []).append(e)
    return {(name, size): TimedRounds(name, size, tuple(map(tuple, by_iteration.values())),
                                      tuple(_round_seconds(r) for r in by_iteration.values()))
            for (name, size), by_iteration in rounds.items()}
