"""Chapter 9's timings: context-parallel attention in its three modes, and the ring's work.

:func:`measure_cp_modes` times one attention call (forward and backward) in each of
Megatron's ``cp_comm_type`` modes side by side on the same ranks, the modes taking turns at
every repetition, after a warm-up round that checks every rank's output against serial
attention.  :func:`measure_ring_work` runs the causal ring's forward under the naive and the
load-balanced split and reads, per rank, the (query, key) pairs it attended and the time
they took.  The attention itself is :mod:`tutorial_lib.context_parallel`'s.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import parallel_state
from ..config import CP_COMM_TYPES, ParallelConfig
from ..context_parallel import context_parallel_attention, ring_attention, split_for_cp_rank
from ..devices import cpu_generator, synchronize
from .runs import check_timing_args, timed_launch

__all__ = ["measure_cp_modes", "measure_ring_work"]


def _modes_worker(ctx, cp_size, batch, heads, seq_length, head_dim, repeats, causal):
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, context_parallel_size=cp_size))
    rank, group = parallel_state.get_rank_in("cp"), parallel_state.get_group("cp")
    g = cpu_generator(9)  # drawn on the CPU, the same on every device, then moved
    shape = (batch, heads, seq_length, head_dim)
    q, k, v, dy = (torch.randn(*shape, generator=g, device="cpu").to(ctx.device)
                   for _ in range(4))
    serial = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def mine(t):
        return split_for_cp_rank(t, 2, cp_size, rank)

    seconds, errors = {mode: [] for mode in CP_COMM_TYPES}, {}
    for repeat in range(repeats + 1):  # round 0 warms up, untimed, and is checked
        first = repeat % len(CP_COMM_TYPES)  # the modes take turns going first
        for mode in CP_COMM_TYPES[first:] + CP_COMM_TYPES[:first]:
            leaves = [mine(t).clone().requires_grad_() for t in (q, k, v)]
            dist.barrier(group=group)  # untraced: timing only
            started = time.perf_counter()
            with ctx.tracer.tags(mode=mode, repeat=repeat):
                out = context_parallel_attention(*leaves, mode, causal, "cp")
                (out * mine(dy)).sum().backward()
            synchronize(ctx.device)  # on a GPU: its work done, not just queued
            elapsed = time.perf_counter() - started
            if repeat:
                seconds[mode].append(elapsed)
            else:
                errors[mode] = (out.detach() - mine(serial)).abs().max().item()
    return {"seconds": seconds, "errors": errors}


def measure_cp_modes(cp_size: int = 4, batch: int = 1, heads: int = 4,
                     seq_length: int = 1024, head_dim: int = 32, repeats: int = 5,
                     causal: bool = True, timeout: float = 300):
    """Time one attention call (forward + backward) in every mode on ``cp_size`` ranks.

    The modes take turns at every repetition, after a warm-up round in which every rank
    checks its output against serial attention.  Returns ``(seconds, errors,
    launch_result)``: per mode, the median over the repetitions of the slowest rank's
    time; per mode, the largest difference from serial on any rank; the launch (its
    trace holds every message, tagged ``mode`` and ``repeat``).
    """
    check_timing_args("cp_size", cp_size, 2, "a ring of two ranks at least", repeats)
    result = timed_launch(_modes_worker, cp_size, (cp_size, batch, heads, seq_length,
                                                   head_dim, repeats, causal), timeout)
    slowest = {mode: [max(r["seconds"][mode][i] for r in result.results)
                      for i in range(repeats)] for mode in CP_COMM_TYPES}
    seconds = {mode: statistics.median(times) for mode, times in slowest.items()}
    errors = {mode: max(r["errors"][mode] for r in result.results)
              for mode in CP_COMM_TYPES}
    return seconds, errors, result


def _ring_work_worker(ctx, batch, heads, seq_length, head_dim):
    size = ctx.world_size
    parallel_state.initialize_model_parallel(
        ParallelConfig(size, context_parallel_size=size))
    rank = parallel_state.get_rank_in("cp")
    g = cpu_generator(0)  # drawn on the CPU, the same on every device, then moved
    shape = (batch, heads, seq_length, head_dim)
    q, k, v = (torch.randn(*shape, generator=g, device="cpu").to(ctx.device) for _ in range(3))
    serial = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors = {}
    for split in ("naive", "balanced", "naive", "balanced"):  # the first two warm up
        balanced = split == "balanced"
        mine = [split_for_cp_rank(t, 2, size, rank, balanced) for t in (q, k, v)]
        with ctx.tracer.tags(split=split, warm_up=split not in errors):
            out = ring_attention(*mine, load_balanced=balanced)
        want = split_for_cp_rank(serial, 2, size, rank, balanced)
        errors[split] = (out - want).abs().max().item()
    return errors


def measure_ring_work(cp_size: int = 4, batch: int = 1, heads: int = 4,
                      seq_length: int = 2048, head_dim: int = 32, timeout: float = 300):
    """The causal ring's forward on ``cp_size`` ranks, under the naive and the balanced
    split.

    Returns ``(rows, errors, launch_result)``: one row per split and CP rank with the
    (query, key) ``pairs`` its steps attended and the ``seconds`` they took (the summed
    ``ring_attention`` spans of the second run; the first warms up), the largest
    difference from serial attention per split, and the launch (its trace: tags
    ``split`` and ``warm_up``).
    """
    check_timing_args("cp_size", cp_size, 2, "a ring of two ranks at least")
    result = timed_launch(_ring_work_worker, cp_size, (batch, heads, seq_length, head_dim),
                          timeout)
    rows = []
    for split in ("naive", "balanced"):
        spans = result.trace.filter(op="compute", split=split, warm_up=False)
        for rank in range(cp_size):
            mine = [e for e in spans.filter(rank=rank)
                    if e.tags.get("name") == "ring_attention"]
            rows.append({"split": split, "rank": rank,
                         "pairs": sum(e.tags["pairs"] for e in mine),
                         "seconds": sum(e.duration for e in mine)})
    errors = {split: max(r[split] for r in result.results)
              for split in ("naive", "balanced")}
    return rows, errors, result
