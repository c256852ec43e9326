"""The three pipeline P2P modes side by side: one steady-state round per mode and message size.

    python bench/bench_p2p.py                 # 2 and 4 ranks, 4 B .. 16 MiB, ~1 minute on 2 cores
    python bench/bench_p2p.py --save          # ... and store it as chapter 7's reference
    python bench/bench_p2p.py --ranks 2 --repeats 50

What is timed is :func:`tutorial_lib.timing.steady_state_round`: every stage calls
``send_forward_recv_backward`` and ``send_backward_recv_forward`` once, ordered by stage
parity, so every link between neighbours carries one activation forward and one gradient
backward (``2 (PP - 1)`` messages in all).  The sizes and the three modes take turns at
every repetition (each repetition starting with a different mode), a barrier before each
round, in one launch: the ratios compare modes measured under the same load.  A round's
time runs from the last stage's start to the last stage's end (from the trace); the table
shows medians, ratios to the batched mode (Megatron's default), and the 25th-75th
percentile spread of the batched rounds.

``--save`` stores every (ranks, mode, size) median and its quartiles as the reference
``ch07_p2p_modes`` (:mod:`tutorial_lib.reference`), which chapter 7 shows beside the
reader's own measurement.  Run it on a machine as quiet as you can make it: the file
records the machine, the date, the load average before and after, and how idle the CPUs
were in the 5 seconds before it started.

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

from tutorial_lib import p2p, reference, timing  # noqa: E402
from tutorial_lib.launch import warm_up  # noqa: E402

REFERENCE = "ch07_p2p_modes"
"""The stored reference chapter 7 loads (``tutorial_lib/reference/ch07_p2p_modes.json``)."""
KIB = 1024


def size_name(n: int) -> str:
    if n < KIB:
        return f"{n} B"
    return f"{n // KIB} KiB" if n < KIB ** 2 else f"{n // KIB ** 2} MiB"


def cpu_idle_percent(seconds: float = 5.0) -> float | None:
    """How idle the CPUs were over the next ``seconds`` (from /proc/stat; None elsewhere):
    a quieter sign than the one-minute load average, which still counts the last minute."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        total1, idle1 = sample()
        time.sleep(seconds)
        total2, idle2 = sample()
    except (OSError, ValueError):
        return None
    return round(100 * (idle2 - idle1) / max(1, total2 - total1), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(timing.P2P_SIZES),
                        help="bytes per message")
    parser.add_argument("--repeats", type=int, default=50, help="timed rounds per mode and size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--save", action="store_true",
                        help=f"store the result as the reference {REFERENCE!r} chapter 7 shows")
    args = parser.parse_args()

    load_before = reference.load_average()
    idle_before = cpu_idle_percent()
    warm_up()
    started = time.perf_counter()
    stored = []
    for pp in args.ranks:
        print(f"[{pp} ranks] measuring ...", file=sys.stderr, flush=True)
        timings, _ = timing.measure_p2p_modes(sizes=args.sizes, pp=pp, repeats=args.repeats,
                                                  warmup=args.warmup, timeout=600)
        by = {(t.mode, t.nbytes): t for t in timings}
        ratios = timing.ratios_to(timings, "batched")
        rows = []
        for n in sorted({t.nbytes for t in timings}):
            if len({by[m, n].bytes_sent for m in p2p.MODES}) != 1:
                raise RuntimeError(f"the modes sent different bytes at {n} B: "
                                   f"{[by[m, n].bytes_sent for m in p2p.MODES]}")
            batched = by["batched", n]
            rows.append([size_name(n)] + [1e6 * by[m, n].seconds for m in p2p.MODES]
                        + [ratios["sequential", n, pp], ratios["overlapped", n, pp]]
                        + [f"{1e6 * batched.quartiles[0]:.0f}-{1e6 * batched.quartiles[1]:.0f}"])
        stored += [{"pp": pp, "mode": t.mode, "nbytes": t.nbytes, "us": round(1e6 * t.seconds, 1),
                    "p25_us": round(1e6 * t.quartiles[0], 1),
                    "p75_us": round(1e6 * t.quartiles[1], 1)} for t in timings]
        print_table(["message", "sequential us", "overlapped us", "batched us", "seq / batched",
                     "ovl / batched", "batched p25-p75 us"], rows, digits=2,
                    title=f"PP = {pp}: one steady-state round ({2 * (pp - 1)} messages), gloo, "
                          f"{os.cpu_count()} cores, median of {args.repeats}, load average "
                          f"{os.getloadavg()[0]:.1f} at the end")
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")
    if args.save:
        command = "python bench/bench_p2p.py --save" + (
            f" --ranks {' '.join(map(str, args.ranks))}" if args.ranks != [2, 4] else "")
        ref = reference.save(
            REFERENCE, stored, command=command,
            notes=(f"timing.measure_p2p_modes: median of {args.repeats} rounds after "
                   f"{args.warmup} warm-up rounds, gloo on CPU, one rank per process"),
            repeats=args.repeats, load=load_before,
            idle_before_percent=idle_before)
        print(f"stored the reference {REFERENCE!r}: {ref.caption()}")


if __name__ == "__main__":
    main()
