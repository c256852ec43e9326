"""The three pipeline P2P modes side by side: one steady-state round per mode and message size.

    python bench/bench_p2p.py                    # 2 and 4 ranks, 1 KiB .. 16 MiB, ~30 seconds on 2 cores
    python bench/bench_p2p.py --ranks 2 --repeats 50

What is timed is :func:`tutorial_lib.p2p_timing.steady_state_round`: every stage calls
``send_forward_recv_backward`` and ``send_backward_recv_forward`` once, ordered by stage
parity, so every link between neighbours carries one activation forward and one gradient
backward (``2 (PP - 1)`` messages in all).  For each size the three modes take turns at
every repetition (each repetition starting with a different mode), a barrier before each
round, in one launch: the ratios compare modes measured under the same load.  A round's
time runs from the last stage's start to the last stage's end (from the trace); the table
shows medians, ratios to the batched mode (Megatron's default), and the 25th-75th
percentile spread of the batched rounds.

Nothing is asserted about speed.  Every round's received values are checked, and the trace
must show the same bytes sent in every mode.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

from tutorial_lib import p2p, p2p_timing  # noqa: E402
from tutorial_lib.launch import warm_up  # noqa: E402

KIB = 1024
DEFAULT_SIZES = [KIB, 16 * KIB, 256 * KIB, KIB ** 2, 4 * KIB ** 2, 16 * KIB ** 2]


def size_name(n: int) -> str:
    return f"{n // KIB} KiB" if n < KIB ** 2 else f"{n // KIB ** 2} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                        help="bytes per message")
    parser.add_argument("--repeats", type=int, default=50, help="timed rounds per mode and size")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    warm_up()
    started = time.perf_counter()
    for pp in args.ranks:
        print(f"[{pp} ranks] measuring ...", file=sys.stderr, flush=True)
        timings, _ = p2p_timing.measure_p2p_modes(sizes=args.sizes, pp=pp, repeats=args.repeats,
                                                  warmup=args.warmup, timeout=600)
        by = {(t.mode, t.nbytes): t for t in timings}
        ratios = p2p_timing.ratios_to(timings, "batched")
        rows = []
        for n in sorted({t.nbytes for t in timings}):
            if len({by[m, n].bytes_sent for m in p2p.MODES}) != 1:
                raise RuntimeError(f"the modes sent different bytes at {n} B: "
                                   f"{[by[m, n].bytes_sent for m in p2p.MODES]}")
            batched = by["batched", n]
            rows.append([size_name(n)] + [1e6 * by[m, n].seconds for m in p2p.MODES]
                        + [ratios["sequential", n, pp], ratios["overlapped", n, pp]]
                        + [f"{1e6 * batched.quartiles[0]:.0f}-{1e6 * batched.quartiles[1]:.0f}"])
        print_table(["message", "sequential us", "overlapped us", "batched us", "seq / batched",
                     "ovl / batched", "batched p25-p75 us"], rows, digits=2,
                    title=f"PP = {pp}: one steady-state round ({2 * (pp - 1)} messages), gloo, "
                          f"{os.cpu_count()} cores, median of {args.repeats}, load average "
                          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
