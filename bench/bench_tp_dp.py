"""Tensor and data parallelism on CPU ranks: what the layers, the TP x DP split and DP buckets cost.

    python bench/bench_tp_dp.py                    # ~2-4 minutes on 2 cores
    python bench/bench_tp_dp.py --quick            # ~30 s: fewer rounds, steps, sizes, buckets
    python bench/bench_tp_dp.py --tables 2 3 --rounds 5

Three tables, each from side-by-side variants that take turns for ``--rounds``
rounds (the median is reported, so a burst of load from elsewhere hits every
variant alike):

1. **TP layer overhead at TP=1.**  Forward + backward (``dX`` included) of a
   ``ColumnParallelLinear`` and a ``RowParallelLinear`` of TP size 1 against a
   plain ``nn.Linear`` of the same shape and weights, in one launched rank:
   once with no groups built (the layers take their serial path) and once after
   ``initialize_model_parallel`` (they look up a TP group of one rank, then skip
   every collective).  The smallest size shows the per-call cost, the larger
   ones whether it matters next to the matmul.  A second ``nn.Linear`` with the
   same weights gives the noise floor.  One torch thread, ``--layer-rounds``
   rounds in rotating order.
2. **One Transformer block at TP x DP = 8** (``(1, 8)``, ``(2, 4)``, ``(4, 2)``,
   ``(8, 1)``) on 8 ranks, each with one torch thread: forward + backward +
   the DP gradient all-reduce (``DataParallel``, default buckets) on a fixed
   global batch split over the DP replicas.  Reference: the serial block
   (``tp_group=None``, no communication) on the whole batch in one process,
   with every core's thread and with one thread.  **8 ranks on 2 cores measure scheduling and
   communication overhead**, not what TP buys on a GPU node: the ranks share two
   cores, so splitting the matmuls cannot make them faster, and every
   collective waits for peers to be scheduled.
3. **Bucketed vs unbucketed DP all-reduce.**  A stack of blocks on 4 DP ranks:
   one all-reduce per parameter issued after backward (``bucket_size_bytes=0,
   overlap=False``, the baseline) against buckets of a few sizes whose
   all-reduces start from gradient hooks during backward (and one bucket size
   started after backward, to separate bucketing from overlap).  The all-reduce
   counts come from the trace.

Timing: every step starts after a barrier; each rank times its own step; a
step's time is the slowest rank's; the table shows the median over every timed
step of every round (after ``--warmup`` untimed steps per launch).  Tables 2
and 3 also split the step, per rank and step (mean of the ranks, median of the
rounds): *in TP ms* is the time inside the blocking TP all-reduces (from the
trace), *DP wait ms* / *wait after bwd ms* the time in ``finish_grad_sync``,
i.e. DP all-reduce time that backward did not hide.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

# --- table 1: the parallel linears at TP=1 ------------------------------------------------


def _layer_overhead(ctx, sizes, rounds: int, target_s: float) -> dict:
    """Seconds per forward+backward of each variant, per size: ``{(size, variant): [rounds]}``."""
    import torch
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    from tutorial_lib.tensor_parallel import ColumnParallelLinear, RowParallelLinear, serial_linear

    def fwd_bwd(layer, x, grad_out, iterations):
        t0 = time.perf_counter()
        for _ in range(iterations):
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            layer(x).backward(grad_out)
        return (time.perf_counter() - t0) / iterations

    config = ParallelConfig(world_size=1)
    out: dict = {}
    for size in sizes:
        tokens, n_in, n_out = size
        plain = serial_linear(n_in, n_out, seed=1)
        column = ColumnParallelLinear(n_in, n_out, seed=1)  # same master weights as `plain`
        row = RowParallelLinear(n_in, n_out, seed=1)
        x = torch.randn(tokens, 1, n_in, requires_grad=True)  # [s, b, h] with b = 1
        grad_out = torch.randn(tokens, 1, n_out)
        # A second, identical nn.Linear: the same code on other memory differs by a few
        # percent (where its weights and gradients land), the noise floor of this table.
        twin = serial_linear(n_in, n_out, seed=1)
        variants = [("nn.Linear", plain, False), ("Column, no groups", column, False),
                    ("Row, no groups", row, False), ("Column, TP group of 1", column, True),
                    ("Row, TP group of 1", row, True), ("nn.Linear, 2nd copy", twin, True)]
        for _, layer, _ in variants:  # the first calls are slow (allocator, lazy init)
            fwd_bwd(layer, x, grad_out, 5)
        # Iterations so that one measurement lasts about target_s: double a calibration
        # run until it lasts a tenth of that.
        calibration = 1
        while (per_iter := fwd_bwd(plain, x, grad_out, calibration)) * calibration < target_s / 10:
            calibration *= 2
        iterations = max(3, int(target_s / per_iter))
        for r in range(rounds):
            # Rotate the order every round, so that no variant always runs right after a switch.
            for name, layer, groups in variants[r % len(variants):] + variants[:r % len(variants)]:
                if groups and not parallel_state.is_initialized():
                    parallel_state.initialize_model_parallel(config)
                elif not groups and parallel_state.is_initialized():
                    parallel_state.destroy_model_parallel()
                fwd_bwd(layer, x, grad_out, 2)  # warm-up
                out.setdefault((size, name), []).append(fwd_bwd(layer, x, grad_out, iterations))
        out[(size, "iterations")] = iterations
    return out


def table_layers(args) -> None:
    from tutorial_lib.launch import launch
    sizes = [(32, 64, 256), (256, 512, 2048), (256, 1024, 4096)]
    if args.quick:
        sizes = sizes[:2]
    rounds = args.layer_rounds
    # One torch thread: with two, a busy machine descheduling either thread stalls both.
    result = launch(_layer_overhead, 1, args=(sizes, rounds, args.layer_target_s), threads=1,
                    print_output=False, timeout=600)
    times = result.results[0]
    rows = []
    for size in sizes:
        tokens, n_in, n_out = size
        plain_us = statistics.median(times[(size, "nn.Linear")]) * 1e6
        for name in ("nn.Linear", "nn.Linear, 2nd copy", "Column, no groups",
                     "Column, TP group of 1", "Row, no groups", "Row, TP group of 1"):
            us = statistics.median(times[(size, name)]) * 1e6
            rows.append([f"{tokens} x {n_in} -> {n_out}", times[(size, "iterations")], name,
                         us, us - plain_us, us / plain_us])
    print_table(["tokens x in -> out", "iters", "layer", "us / fwd+bwd", "overhead us",
                 "x nn.Linear"], rows, digits=2,
                title=f"1. Parallel linears at TP=1 vs nn.Linear: forward + backward (with dX), "
                      f"one launched rank, 1 torch thread; median of {rounds} rounds of ~"
                      f"{args.layer_target_s * 1e3:g} ms; load average "
                      f"{os.getloadavg()[0]:.1f} at the end")


# --- tables 2 and 3: timed training steps on launched ranks ---------------------------------


def _run_steps(ctx, model, x, sync: bool, warmup: int, steps: int) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones, each started after a barrier.

    A step: zero the gradients, forward, backward of a scalar loss, and (``sync``)
    ``model.finish_grad_sync()``.  Returns this rank's seconds per timed step, the
    seconds of each step spent in ``finish_grad_sync`` (waiting for the DP
    all-reduces still running after backward), and from the trace of the timed
    steps: collectives per step by kind, and seconds per step inside the (blocking)
    TP collectives.
    """
    import torch.distributed as dist

    def step():
        model.zero_grad()
        model(x).square().mean().backward()
        t0 = time.perf_counter()
        if sync:
            model.finish_grad_sync()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step()
    events = ctx.tracer.events
    first = len(events)
    times, waits = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        waits.append(step())
        times.append(time.perf_counter() - t0)
    dist.barrier()
    counts: dict = {}
    tp_seconds = 0.0
    for e in events[first:]:
        if e.op in ("all_reduce", "all_gather", "reduce_scatter") and e.group_kind in ("tp", "dp"):
            key = f"{e.group_kind}_{e.op}"
            counts[key] = counts.get(key, 0) + 1 / steps
            if e.tags.get("overlap"):
                counts["overlapped"] = counts.get("overlapped", 0) + 1 / steps
            if e.group_kind == "tp":
                tp_seconds += e.t_end - e.t_start
    return {"times": times, "waits": waits, "counts": counts, "tp_seconds": tp_seconds / steps}


def _block_step(ctx, tp: int | None, shape: dict, warmup: int, steps: int) -> dict:
    """Forward + backward + DP grad sync of one block; ``tp=None``: the serial block, no groups."""
    import torch
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.transformer import TransformerBlock

    s, batch, h, heads = shape["seq"], shape["batch"], shape["hidden"], shape["heads"]
    if tp is None:
        model = TransformerBlock(h, heads, seed=0, tp_group=None)
        dp, dp_rank = 1, 0
    else:
        parallel_state.initialize_model_parallel(
            ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp))
        dp, dp_rank = ctx.world_size // tp, parallel_state.get_rank_in("dp")
        model = DataParallel(TransformerBlock(h, heads, seed=0))  # default buckets, overlap on
    # The global batch of `batch` sequences, split over the DP replicas; the TP ranks of
    # one replica draw the same samples (same generator seed).
    generator = torch.Generator().manual_seed(dp_rank)
    x = torch.randn(s, batch // dp, h, generator=generator)
    return _run_steps(ctx, model, x, tp is not None, warmup, steps)


def _stack_step(ctx, blocks: int, shape: dict, bucket_size_bytes: float, overlap: bool,
                warmup: int, steps: int) -> dict:
    """A stack of ``blocks`` blocks on DP ranks only, under one DataParallel configuration."""
    import torch
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.transformer import TransformerBlock

    parallel_state.initialize_model_parallel(ParallelConfig(ctx.world_size))
    s, b, h, heads = shape["seq"], shape["batch"], shape["hidden"], shape["heads"]
    stack = torch.nn.Sequential(*[TransformerBlock(h, heads, seed=i) for i in range(blocks)])
    model = DataParallel(stack, bucket_size_bytes=bucket_size_bytes, overlap=overlap)
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(ctx.rank))
    out = _run_steps(ctx, model, x, True, warmup, steps)
    out.update(buckets=len(model.buckets), params=sum(1 for _ in stack.parameters()),
               mbytes=sum(p.numel() * 4 for p in stack.parameters()) / 2**20)
    return out


def _step_times(results) -> list[float]:
    """Per step, the slowest rank's time (every rank's step i started after the same barrier)."""
    return [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]


def _per_step_ms(results, key: str) -> float:
    """Milliseconds per step of ``key`` (``waits`` or ``tp_seconds``), averaged over the ranks."""
    values = [statistics.mean(r[key]) if isinstance(r[key], list) else r[key] for r in results]
    return statistics.mean(values) * 1e3


def _threads_note(world: int) -> str:
    threads = max(1, (os.cpu_count() or 1) // world)
    return f"{threads} torch thread{'s' if threads > 1 else ''} per rank"


def table_tp_dp(args) -> None:
    from tutorial_lib.launch import launch
    world = 8
    shape = {"seq": args.seq, "batch": args.batch, "hidden": args.hidden, "heads": args.heads}
    tps = [tp for tp in (1, 2, 4, 8) if args.heads % tp == 0 and args.batch % (world // tp) == 0]
    cores = os.cpu_count() or 1
    variants = [(f"serial, {cores} threads", None, 1, cores), ("serial, 1 thread", None, 1, 1)]
    variants += [(f"TP={tp} x DP={world // tp}", tp, world, None) for tp in tps]
    times = {name: [] for name, *_ in variants}
    tp_ms, wait_ms, counts = ({name: [] for name, *_ in variants} for _ in range(3))
    for _ in range(args.rounds):
        for name, tp, ranks, threads in variants:
            result = launch(_block_step, ranks, args=(tp, shape, args.warmup, args.steps),
                            threads=threads, print_output=False, timeout=600)
            times[name] += _step_times(result.results)
            tp_ms[name].append(_per_step_ms(result.results, "tp_seconds"))
            wait_ms[name].append(_per_step_ms(result.results, "waits"))
            counts[name] = result.results[0]["counts"]
    tokens = args.seq * args.batch
    base = statistics.median(times[f"TP=1 x DP={world}"]) if 1 in tps else None
    rows = []
    for name, tp, ranks, threads in variants:
        t = statistics.median(times[name])
        c = counts[name]
        rows.append([name, ranks, threads or max(1, cores // ranks), t * 1e3, tokens / t,
                     None if base is None else t / base, c.get("tp_all_reduce", 0.0),
                     statistics.median(tp_ms[name]), c.get("dp_all_reduce", 0.0),
                     statistics.median(wait_ms[name])])
    print_table(["layout", "ranks", "threads / rank", "ms / step", "tokens / s", "x TP=1",
                 "TP all-reduces", "in TP ms", "DP all-reduces", "DP wait ms"], rows, digits=1,
                title=f"2. One Transformer block (h={args.hidden}, {args.heads} heads, ffn "
                      f"{4 * args.hidden}), global batch {args.batch} x {args.seq} tokens = "
                      f"{tokens}: forward + backward + DP grad sync; median of {args.rounds} x "
                      f"{args.steps} steps; all-reduces and ms inside them per rank per step "
                      f"(mean of the ranks); {cores} cores, load average "
                      f"{os.getloadavg()[0]:.1f} at the end")


def _size_name(nbytes: float) -> str:
    if nbytes == 0:
        return "0 (per parameter)"
    if math.isinf(nbytes):
        return "inf (one bucket)"
    return f"{nbytes / 2**20:g} MiB"


def table_buckets(args) -> None:
    from tutorial_lib.launch import launch
    world = 4
    shape = {"seq": args.seq, "batch": args.stack_batch, "hidden": args.stack_hidden,
             "heads": args.heads}
    variants = [(0, False), (0, True), (2**18, True), (2**20, False), (2**20, True),
                (4 * 2**20, True), (math.inf, True)]
    if args.quick:
        variants = [(0, False), (0, True), (2**20, True), (math.inf, True)]
    times = {v: [] for v in variants}
    wait_ms = {v: [] for v in variants}
    info = {}
    for _ in range(args.rounds):
        for size, overlap in variants:
            result = launch(_stack_step, world,
                            args=(args.blocks, shape, size, overlap, args.warmup, args.steps),
                            print_output=False, timeout=600)
            times[(size, overlap)] += _step_times(result.results)
            wait_ms[(size, overlap)].append(_per_step_ms(result.results, "waits"))
            info[(size, overlap)] = result.results[0]
    base = statistics.median(times[(0, False)])
    rows = []
    for size, overlap in variants:
        t = statistics.median(times[(size, overlap)])
        r = info[(size, overlap)]
        rows.append([_size_name(size), "hooks" if overlap else "after backward", r["buckets"],
                     r["counts"].get("dp_all_reduce", 0.0), r["counts"].get("overlapped", 0.0),
                     statistics.median(wait_ms[(size, overlap)]), t * 1e3, t / base])
    first = info[variants[0]]
    print_table(["bucket size", "all-reduces start", "buckets", "all-reduces", "from hooks",
                 "wait after bwd ms", "ms / step", "x per-param"], rows, digits=2,
                title=f"3. DP gradient all-reduce: {args.blocks} blocks (h={args.stack_hidden}, "
                      f"{first['params']} parameters, {first['mbytes']:.1f} MiB of gradients) on "
                      f"{world} DP ranks, {args.stack_batch} x {args.seq} tokens per rank; "
                      f"forward + backward + sync; all-reduces per rank per step from the trace; "
                      f"{_threads_note(world)}; median of {args.rounds} x {args.steps} steps; "
                      f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")


def main() -> None:
    from tutorial_lib.launch import warm_up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant (median)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per launch")
    parser.add_argument("--hidden", type=int, default=512, help="table 2: hidden size")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (tables 2, 3)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="table 2: global batch (sequences)")
    parser.add_argument("--blocks", type=int, default=4, help="table 3: blocks in the model")
    parser.add_argument("--stack-batch", type=int, default=2,
                        help="table 3: sequences per DP rank")
    parser.add_argument("--layer-rounds", type=int, default=15, help="table 1: rounds (median)")
    parser.add_argument("--layer-target-s", type=float, default=0.05,
                        help="table 1: seconds per measurement (sets the iterations)")
    parser.add_argument("--stack-hidden", type=int, default=256, help="table 3: hidden size")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds, 2 timed steps, fewer sizes and buckets (~30 s)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.layer_rounds = 2, 2, 1, 7
    warm_up()  # start the forkserver before anything is timed
    started = time.perf_counter()
    for table, fn in ((1, table_layers), (2, table_tp_dp), (3, table_buckets)):
        if table in args.tables:
            t0 = time.perf_counter()
            fn(args)
            print(f"\n(table {table}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
