"""Timing collectives on this machine: gloo ranks (or NCCL on GPUs), for the alpha-beta fit.

Chapter 2 (collectives) times every collective with :func:`measure_alpha_beta` (one
:func:`measure_collective` run, the same as ``bench/bench_alpha_beta.py`` stores as its
reference) and fits the alpha-beta model of :mod:`tutorial_lib.costs.alpha_beta` to
the result.  The rounds and their medians come from
:func:`tutorial_lib.timing.runs.rounds_by_size`.

**On GPUs** (``device="cuda"``: one GPU per rank, NCCL) the same run times NCCL, and
:func:`bandwidth_rows` reports each size the way nccl-tests' ``*_perf`` binaries do
(size, time, ``algbw``, ``busbw``: :func:`~tutorial_lib.costs.alpha_beta.bus_bandwidth`),
so the numbers compare with nccl-tests on the same machine and with the course's
bandwidth table.  The times then come from CUDA events (an NCCL call returns before the
collective has run; :mod:`tutorial_lib.trace`), each rank's events placed on the shared
host clock through one anchor per rank (a few microseconds of uncertainty, which only the
smallest sizes notice).  Untested here: no GPU was available to this project.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..costs import Sample, algorithm_bandwidth, bus_bandwidth, nccl_tests_size
from .runs import check_timing_args, rounds_by_size, timed_launch

__all__ = ["MEASURABLE_OPS", "COLLECTIVE_SIZES", "ALPHA_BETA_OPS", "ALPHA_BETA_SIZES",
           "ALPHA_BETA_RANKS", "MEASURE_DEVICES", "samples_from_trace", "measure_collective",
           "measure_alpha_beta", "bandwidth_rows"]

# --- measuring collectives ---------------------------------------------------------------

MEASURABLE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
"""Ops :func:`measure_collective` can time (``send`` times a send from rank 0 to rank 1)."""

COLLECTIVE_SIZES = tuple(1024 * 4 ** i for i in range(7))
"""1 KiB, 4 KiB, ..., 4 MiB: a quick sweep (tests, small machines)."""

ALPHA_BETA_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
"""The collectives chapter 2 fits the alpha-beta model to."""

ALPHA_BETA_SIZES = tuple(1024 * 4 ** i for i in range(9))
"""1 KiB, 4 KiB, ..., 64 MiB: from well inside the latency-bound regime to well inside the
bandwidth-bound one (on loopback gloo the two terms meet between 64 KiB and 1 MiB)."""

ALPHA_BETA_RANKS = 2
"""Ranks of chapter 2's fit: no more than the cores of the smallest machine the course
runs on, so that no rank waits for a core while its peers time it."""

MEASURE_DEVICES = {"cpu": "gloo", "cuda": "nccl"}
"""Where :func:`measure_collective` runs, and over which backend: ``cpu`` (gloo) or ``cuda``
(NCCL, one GPU per rank)."""

_ELEMENT = 4  # measurements use float32


def _make_tensors(op: str, nbytes: int, n: int, device="cpu"):
    """Zero float32 tensors on ``device`` whose size follows the byte convention for ``op``
    (rounded to fit ``n``)."""
    numel = max(1, int(nbytes) // _ELEMENT)

    def zeros(count):
        return torch.zeros(count, device=device)
    if op in ("reduce_scatter", "all_to_all"):
        numel = max(n, numel - numel % n)  # the input must split into n equal slices
        out_numel = numel // n if op == "reduce_scatter" else numel
        return zeros(numel), zeros(out_numel)
    if op == "all_gather":
        return zeros(numel), zeros(numel * n)
    return zeros(numel), None  # zeros: repeated in-place sums never overflow


def _run_op(op: str, tensors, rank: int) -> None:
    x, out = tensors
    if op == "all_reduce":
        comm.all_reduce(x)
    elif op == "reduce_scatter":
        comm.reduce_scatter(out, x)
    elif op == "all_gather":
        comm.all_gather(out, x)
    elif op == "all_to_all":
        comm.all_to_all(out, x)
    elif op == "broadcast":
        comm.broadcast(x, src=0)
    elif op == "send":
        if rank == 0:
            comm.send(x, dst=1)
        elif rank == 1:
            comm.recv(x, src=0)


def _measure_worker(ctx, ops: Sequence[str], sizes: dict[str, list[int]], repeats: int,
                    warmup: int) -> None:
    """Runs in every rank: each op on each of its sizes, ``warmup + repeats`` times,
    barrier first."""
    for op in ops:
        for size in sizes[op]:
            tensors = _make_tensors(op, size, ctx.world_size, ctx.device)
            for iteration in range(warmup + repeats):
                # Untraced barrier: every timed op starts from (nearly) the same moment,
                # and the trace shows only the ops being measured.
                dist.barrier()
                with ctx.tracer.tags(measured_op=op, size=size, iteration=iteration,
                                     warmup=iteration < warmup):
                    _run_op(op, tensors, ctx.rank)


def samples_from_trace(trace, n: int) -> list[Sample]:
    """Turn the trace of a :func:`measure_collective` run into one :class:`Sample` per (op, size).

    A sample's ``seconds`` is the median round time of :func:`rounds_by_size`: from the
    moment the last rank joins until the last rank is done, over the non-warm-up
    iterations.  Its ``nbytes`` is what the trace recorded (the bytes actually moved:
    sizes are rounded to split evenly over the ranks).
    """
    rounds = rounds_by_size(trace, "measured_op")
    samples = []
    for op, size in sorted(rounds):
        timed = rounds[op, size]
        moved = next(e.bytes for e in timed.events[-1] if e.op != "recv")
        samples.append(Sample(op=op, nbytes=moved, n=n, seconds=timed.median_seconds))
    return samples


def measure_collective(op: str | Sequence[str],
                       sizes: Sequence[int] | Mapping[str, Sequence[int]] = COLLECTIVE_SIZES,
                       world_size: int = 4, repeats: int = 10, warmup: int = 1,
                       timeout: float = 120.0, device: str = "cpu") -> list[Sample]:
    """Time ``op`` (one name or several) on this machine for each size in ``sizes`` bytes.

    Starts ``world_size`` ranks with :func:`tutorial_lib.launch.launch`: gloo ranks on the
    CPU, or with ``device="cuda"`` NCCL ranks, one GPU each (refused before anything starts
    when the machine has fewer GPUs than ranks).
    Each rank runs every size ``warmup + repeats`` times through the traced
    :mod:`tutorial_lib.comm` wrappers with a barrier before each run; the
    times come from the trace events (see :func:`samples_from_trace`).
    Sizes follow the byte convention, so for ``all_gather`` a size is the
    shard each rank contributes.  ``sizes`` is one list for every op, or a
    mapping from each op to its own list.  Feed the result to
    :func:`tutorial_lib.costs.alpha_beta.fit_alpha_beta`.
    """
    ops = (op,) if isinstance(op, str) else tuple(op)
    for name in ops:
        if name not in MEASURABLE_OPS:
            raise ValueError(f"cannot measure {name!r}: measure_collective times "
                             f"{', '.join(MEASURABLE_OPS)}")
    if device not in MEASURE_DEVICES:
        raise ValueError(f"device must be one of {', '.join(MEASURE_DEVICES)}, got {device!r}")
    per_op = {name: list(sizes.get(name, ())) if isinstance(sizes, Mapping) else list(sizes)
              for name in ops}
    check_timing_args("world_size", world_size, 2, "two ranks to measure communication",
                      repeats, warmup, per_op)
    result = timed_launch(_measure_worker, world_size,
                          (ops, {k: [int(s) for s in v] for k, v in per_op.items()},
                           int(repeats), int(warmup)),
                          timeout, print_output=False, backend=MEASURE_DEVICES[device])
    return samples_from_trace(result.trace, world_size)


def measure_alpha_beta(ops: Sequence[str] = ALPHA_BETA_OPS,
                       sizes: Sequence[int] = ALPHA_BETA_SIZES,
                       world_size: int = ALPHA_BETA_RANKS, repeats: int = 5, warmup: int = 2,
                       timeout: float = 300.0, device: str = "cpu") -> list[Sample]:
    """Chapter 2's timing run, and its stored reference's (``bench/bench_alpha_beta.py``).

    Every op in ``ops`` on tensors of each size in ``sizes`` bytes, in one launch of
    ``world_size`` ranks.  A size is the tensor ``B`` of the alpha-beta formulas: for
    ``all_gather`` the gathered *output*, so its shard is ``B / N`` (by the byte
    convention the samples record the shard).  The median of ``repeats`` timed runs
    per size, after ``warmup`` untimed ones.  ``device="cuda"``: on NCCL, one GPU per rank
    (see the module docstring).
    """
    per_op = {op: [max(1, int(s) // world_size) if op == "all_gather" else int(s)
                   for s in sizes] for op in ops}
    return measure_collective(tuple(ops), sizes=per_op, world_size=world_size,
                              repeats=repeats, warmup=warmup, timeout=timeout, device=device)


def bandwidth_rows(samples: Sequence[Sample]) -> list[dict]:
    """One row per sample as nccl-tests prints it: ``op``, ``ranks``, ``size_bytes`` (its
    ``S``: :func:`~tutorial_lib.costs.alpha_beta.nccl_tests_size`), ``time_us``,
    ``algbw_gb_per_s`` and ``busbw_gb_per_s`` (GB = 1e9 bytes, as nccl-tests counts)."""
    rows = []
    for s in samples:
        rows.append({"op": s.op, "ranks": s.n,
                     "size_bytes": int(nccl_tests_size(s.op, s.nbytes, s.n)),
                     "time_us": 1e6 * s.seconds,
                     "algbw_gb_per_s": algorithm_bandwidth(s.op, s.nbytes, s.n, s.seconds) / 1e9,
                     "busbw_gb_per_s": bus_bandwidth(s.op, s.nbytes, s.n, s.seconds) / 1e9})
    return rows

