"""What recording every collective costs: raw all-reduce vs the traced ``comm`` wrapper.

    python bench/bench_trace_overhead.py            # ~2 minutes on 2 cores
    python bench/bench_trace_overhead.py --rounds 1 --small-iterations 500

Each variant runs an all-reduce loop on gloo ranks, for three workloads:

* 4 ranks, ``--small-iterations`` (default 1000) all-reduces of a 16-element
  float32 tensor (64 B): the per-call cost dominates;
* 4 ranks, 200 all-reduces of a 1 MiB tensor: moving the data dominates;
* 1 rank, 5000 all-reduces of 64 B: no communication and no other process to
  wait for, so what is left is exactly the per-call cost of each variant.

``raw dist.all_reduce``         ``torch.distributed.all_reduce`` directly
``comm, trace on``              the library wrapper, events recorded (``launch(trace=True)``)
``comm, trace off``             the library wrapper with ``launch(trace=False)``

Each rank times its loop between two barriers; a variant's time is the
slowest rank's, divided by the iterations.  The variants take turns for
``--rounds`` rounds and the median round is reported, so a burst of load
from elsewhere on the machine hits all of them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

VARIANTS = [  # (name, which all-reduce, launch(trace=...))
    ("raw dist.all_reduce", "raw", False),
    ("comm, trace on", "comm", True),
    ("comm, trace off", "comm", False),
]


def _loop(ctx, how: str, numel: int, iterations: int) -> float:
    """Seconds this rank spent in ``iterations`` all-reduces (after one untimed warm-up)."""
    import torch
    import torch.distributed as dist
    from tutorial_lib import comm
    t = torch.zeros(numel)  # zeros: repeated sums stay finite
    op = dist.all_reduce if how == "raw" else comm.all_reduce
    op(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        op(t)
    dist.barrier()  # every rank's loop is over: the slowest one sets the time
    return time.perf_counter() - t0


def main() -> None:
    from tutorial_lib.launch import launch, warm_up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small-iterations", type=int, default=1000)
    args = parser.parse_args()
    workloads = [  # (ranks, label, float32 elements, iterations)
        (4, "64 B", 16, args.small_iterations),
        (4, "1 MiB", 1 << 18, 200),
        (1, "64 B", 16, 5000),
    ]
    warm_up()  # start the forkserver before anything is timed
    started = time.perf_counter()
    rows = []
    for world, label, numel, iterations in workloads:
        per_op = {v[0]: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for name, how, trace in VARIANTS:
                result = launch(_loop, world, args=(how, numel, iterations),
                                trace=trace, print_output=False, timeout=300)
                per_op[name].append(max(result.results) / iterations)
                if trace and how == "comm":  # the trace really holds every op (+ the warm-up)
                    assert len(result.trace.filter(op="all_reduce")) == world * (iterations + 1)
        raw_us = statistics.median(per_op[VARIANTS[0][0]]) * 1e6
        for name, *_ in VARIANTS:
            us = statistics.median(per_op[name]) * 1e6
            rows.append([world, label, iterations, name, us, us - raw_us, us / raw_us])
    print_table(["ranks", "tensor", "iters", "variant", "us / op", "overhead us", "x raw"],
                rows, digits=1,
                title=f"all-reduce on gloo ({os.cpu_count()} cores, load average "
                      f"{os.getloadavg()[0]:.1f} at the end), median of {args.rounds} rounds")
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
