"""Chapter 2's alpha-beta fit, measured to be stored as the chapter's reference.

    python bench/bench_alpha_beta.py             # print the table (~1 minute on 2 cores)
    python bench/bench_alpha_beta.py --save      # also store tutorial_lib/reference/ch02_alpha_beta.json
    python bench/bench_alpha_beta.py --device cuda --ranks 8   # NCCL, one GPU per rank

The measurement is the chapter's own, :func:`tutorial_lib.timing.measure_alpha_beta`
(2 ranks, the five collectives, tensors of 1 KiB to 64 MiB, all-gather sized by its
output), repeated ``--runs`` times.  Noise on a shared machine only ever adds time, so
for every collective and size the stored time is the smallest of the runs' medians.
Then one alpha-beta fit per collective (:func:`tutorial_lib.costs.fit_alpha_beta`).

Run it on a machine that is as quiet as you can make it: the reference records the
machine, the date and the one-minute load average before every run.  Chapter 2 shows its
own run beside this reference and describes the reference in its prose, so after
storing a new one, run the chapter (its cell after the fit checks every sentence it
says about the reference).

Every run also prints, for the largest size of each collective, the time, ``algbw`` and
``busbw`` as nccl-tests defines them (``tutorial_lib.timing.bandwidth_rows``).  With
``--device cuda`` the collectives run over NCCL on one GPU per rank (``--ranks``, at most
the GPUs of the machine), so the bus bandwidths compare with what nccl-tests'
``all_reduce_perf -g 1`` (one process per GPU) prints there and with the course's bandwidth
table.  ``--save`` stores only the CPU run: it is the reference chapter 2 shows.  The CUDA
path has not been run by this project (no GPU was available).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

from tutorial_lib import costs, reference, timing  # noqa: E402
from tutorial_lib.launch import warm_up  # noqa: E402

NAME = "ch02_alpha_beta"


def size_name(n: int) -> str:
    return f"{n // 1024} KiB" if n < 1024 ** 2 else f"{n // 1024 ** 2} MiB"


def measure(args) -> tuple[list[costs.Sample], list[float]]:
    """One measurement: ``args.runs`` runs, per collective and size the fastest median;
    with the load average before each run."""
    best: dict[tuple[str, int], costs.Sample] = {}
    loads = []
    for run in range(args.runs):
        loads.append(round(os.getloadavg()[0], 2))
        print(f"[run {run + 1}/{args.runs}] load {loads[-1]} ...", file=sys.stderr, flush=True)
        for s in timing.measure_alpha_beta(repeats=args.repeats, warmup=args.warmup,
                                          world_size=args.ranks, device=args.device):
            key = (s.op, s.nbytes)
            if key not in best or s.seconds < best[key].seconds:
                best[key] = s
    return [best[k] for k in sorted(best)], loads


def as_rows(samples: list[costs.Sample]) -> list[dict]:
    return [{"op": s.op, "nbytes": s.nbytes, "n": s.n, "seconds": s.seconds} for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="whole measurements; keep the "
                        "fastest median of each size")
    parser.add_argument("--measurements", type=int, default=3,
                        help="whole measurements, one after the other; the chapter's text "
                             "says only what all of them show, the first is plotted")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--save", action="store_true", help=f"store the reference {NAME}")
    parser.add_argument("--device", choices=sorted(timing.MEASURE_DEVICES), default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL, one GPU per rank")
    parser.add_argument("--ranks", type=int, default=timing.ALPHA_BETA_RANKS,
                        help="ranks to time the collectives on (the reference: "
                             f"{timing.ALPHA_BETA_RANKS})")
    args = parser.parse_args()
    if args.save and (args.device != "cpu" or args.ranks != timing.ALPHA_BETA_RANKS):
        parser.error(f"--save stores chapter 2's reference: {timing.ALPHA_BETA_RANKS} ranks on "
                     f"the CPU; drop --save to time other settings")

    warm_up()
    started = time.perf_counter()
    # the chapter keeps only what every one of these measurements shows (the first is the
    # one it plots); each is ``--runs`` whole runs, the fastest median per size
    measured = [measure(args) for _ in range(args.measurements)]
    samples, loads = measured[0]
    fits = {op: costs.fit_alpha_beta([s for s in samples if s.op == op])
            for op in timing.ALPHA_BETA_OPS}

    rows = [{"op": op, "alpha_us": round(1e6 * f.model.alpha, 2),
             "gb_per_s": None if f.model.beta == 0 else round(f.model.bandwidth / 1e9, 4),
             "r_squared": round(f.r_squared, 4), "relative_error": round(f.relative_error, 4)}
            for op, f in fits.items()]
    print_table(["collective", "alpha (us)", "1/beta (GB/s)", "R^2", "median |error|"],
                [[r["op"], r["alpha_us"], r["gb_per_s"], r["r_squared"], r["relative_error"]]
                 for r in rows], digits=3)
    sizes = sorted({s.nbytes for s in samples if s.op == "all_reduce"})
    print()
    print_table(["collective", *map(size_name, sizes)],
                [[op, *(round(1e6 * s.seconds) for s in samples if s.op == op)]
                 for op in timing.ALPHA_BETA_OPS])
    print(f"(microseconds, {args.ranks} ranks on {args.device}; all-gather columns are its "
          f"output, samples record the shard; load before the runs: {loads}; "
          f"{time.perf_counter() - started:.0f} s)")
    print()
    largest = [max((s for s in samples if s.op == op), key=lambda s: s.nbytes)
               for op in timing.ALPHA_BETA_OPS]
    print_table(["collective", "size (B, nccl-tests' S)", "time (us)", "algbw (GB/s)",
                 "busbw (GB/s)"],
                [[r["op"], r["size_bytes"], round(r["time_us"], 1),
                  round(r["algbw_gb_per_s"], 3), round(r["busbw_gb_per_s"], 3)]
                 for r in timing.bandwidth_rows(largest)])
    print("(busbw = algbw x 2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter, "
          "all-gather and all-to-all, 1 for broadcast: nccl-tests' doc/PERFORMANCE.md)")
    if args.save:
        ref = reference.save(
            NAME, rows, command="python bench/bench_alpha_beta.py --save",
            notes=(f"timing.measure_alpha_beta on {timing.ALPHA_BETA_RANKS} gloo ranks, "
                   f"{args.runs} runs of {args.repeats} timed repeats after {args.warmup} "
                   f"warm-up; per collective and size the fastest run's median; "
                   f"{args.measurements} such measurements in a row ('measurements'; the "
                   f"rows and the chapter's plots are the first's)"),
            measurements=[{"samples": as_rows(more), "load_before_runs": more_loads}
                          for more, more_loads in measured],
            world_size=timing.ALPHA_BETA_RANKS, runs=args.runs, repeats=args.repeats,
            warmup=args.warmup, load=loads[0] if loads else None)
        print(f"stored {NAME}: {ref.caption()}")


if __name__ == "__main__":
    main()
