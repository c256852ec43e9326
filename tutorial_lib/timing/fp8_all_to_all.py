"""Chapter 8's timing: one all-to-all in BF16 against FP8, on EP ranks.

The FP8 trip is :func:`tutorial_lib.fp8.all_to_all` with ``("fp8", "fp8")``: quantize each
1x128 tile, pack the rows with their scales, send, unpack and dequantize; the BF16 trip
sends the rows as they are.  The bytes come from the trace, the times from each rank's
clock (the slowest rank's median trip).  ``bench/bench_fp8.py --save-reference`` stores this
very run as chapter 8's reference.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import parallel_state
from ..config import ParallelConfig
from ..devices import cpu_generator, synchronize
from ..fp8 import all_to_all
from ..trace import get_tracer
from .runs import check_timing_args, timed_launch

__all__ = ["time_all_to_all"]


def _timing_worker(ctx, hiddens, rows_per_rank, repeats):
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, expert_model_parallel_size=ctx.world_size))
    splits = [rows_per_rank // ctx.world_size] * ctx.world_size
    medians = {}
    for hidden in hiddens:
        g = cpu_generator(ctx.rank)  # drawn on the CPU, then moved to this rank's device
        x = torch.randn(rows_per_rank, hidden, generator=g, device="cpu").bfloat16().to(ctx.device)
        for warmup in (True, False):
            for precision in ("bf16", "fp8"):
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    with get_tracer().tags(hidden=hidden, timed=precision, warmup=warmup):
                        all_to_all(x, "ep", splits, splits, "timed", precision=(precision,) * 2)
                    synchronize(ctx.device)  # on a GPU: the trip done, not just queued
                    times.append(time.perf_counter() - start)
                medians[hidden, precision] = statistics.median(times)
    return medians


def time_all_to_all(hiddens=(1024, 4096), rows_per_rank: int = 2048, ranks: int = 4,
                    repeats: int = 5) -> list[dict]:
    """Time one all-to-all of ``rows_per_rank`` bf16 rows per rank in BF16 and in FP8.

    ``ranks`` processes (gloo, one torch thread each) form one EP group.  Per hidden size, a
    warm-up round then a timed round, each ``repeats`` trips per precision, a barrier before
    every trip; the FP8 trip is :func:`tutorial_lib.fp8.all_to_all` with ``("fp8", "fp8")``:
    quantize and pack, send, unpack and dequantize.  One row per hidden size: ``hidden``,
    ``bf16_bytes`` and ``fp8_bytes`` (what one rank hands to the all-to-all, from the trace), ``bf16_ms`` and
    ``fp8_ms`` (the median trip of the slowest rank).  Starts processes.
    """
    check_timing_args("ranks", ranks, 2, "an all-to-all between two ranks at least", repeats)
    if rows_per_rank % ranks:
        raise ValueError(f"rows_per_rank ({rows_per_rank}) must be a multiple of ranks ({ranks}): "
                         f"every rank sends the same number of rows to each, e.g. "
                         f"{rows_per_rank // ranks * ranks or ranks}")
    run = timed_launch(_timing_worker, ranks, (tuple(hiddens), rows_per_rank, repeats), 600,
                       threads=1, print_output=False)
    rows = []
    for hidden in hiddens:
        row = {"hidden": hidden}
        for precision in ("bf16", "fp8"):
            sent = {e.bytes for e in run.trace.filter(op="all_to_all", hidden=hidden,
                                                      timed=precision)}
            if len(sent) != 1:
                raise AssertionError(f"H {hidden}, {precision}: the ranks sent {sorted(sent)} "
                                     f"bytes per all-to-all; every trip should send the same")
            row[f"{precision}_bytes"] = sent.pop()
            row[f"{precision}_ms"] = 1e3 * max(r[hidden, precision] for r in run.results)
        rows.append(row)
    return rows
