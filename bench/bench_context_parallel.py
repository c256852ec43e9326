"""Chapter 9's timings, measured and stored as the chapter's references.

    python bench/bench_context_parallel.py --rounds 5   # ~30 s on 2 cores; on a quiet machine
    python bench/bench_context_parallel.py --no-save   # print only

Two measurements, with the chapter's own functions and shapes:

* :func:`tutorial_lib.timing.measure_ring_work`: the causal ring's forward on 4
  ranks, 2048 tokens, naive and balanced split: the pairs each rank attended and the time
  its attention steps took (reference ``ch09_ring_work``);
* :func:`tutorial_lib.timing.measure_cp_modes`: one attention call (forward and
  backward) in each ``cp_comm_type`` on 4 ranks, 1024 tokens, 4 heads of 32: the median
  over the repetitions of the slowest rank (reference ``ch09_cp_modes``).

Each is run ``--rounds`` times and the round with the median total is stored (a noisy
neighbour ruins one round, not the reference).  Nothing is asserted about speed; every
run's outputs are checked against serial attention by the functions themselves.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

from tutorial_lib import context_parallel as cp  # noqa: E402
from tutorial_lib import reference, timing  # noqa: E402
from tutorial_lib.launch import warm_up  # noqa: E402

#: The chapter's shapes (notebooks/09_context_parallel.ipynb uses the same).
RING = dict(cp_size=4, seq_length=2048)
MODES = dict(cp_size=4, batch=1, heads=4, seq_length=1024, head_dim=32)
COMMAND = "python bench/bench_context_parallel.py"


def _median_round(rounds, total):
    ordered = sorted(rounds, key=total)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per mode")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    load_before = reference.load_average()  # stored with the references: the load we started under
    warm_up()

    ring_rounds = []
    for _ in range(args.rounds):
        rows, errors, _ = timing.measure_ring_work(**RING)
        if max(errors.values()) > 1e-5:
            raise RuntimeError(f"the ring differs from serial attention: {errors}")
        ring_rounds.append(rows)
    ring = _median_round(ring_rounds, lambda rows: sum(r["seconds"] for r in rows))
    print_table(["split", "rank", "pairs", "ms"],
                [[r["split"], r["rank"], r["pairs"], 1e3 * r["seconds"]] for r in ring])

    mode_rounds = []
    for _ in range(args.rounds):
        seconds, errors, run = timing.measure_cp_modes(repeats=args.repeats, **MODES)
        if max(errors.values()) > 1e-5:
            raise RuntimeError(f"a mode differs from serial attention: {errors}")
        mode_rounds.append(seconds)
    modes = _median_round(mode_rounds, lambda s: sum(s.values()))
    print_table(["mode", "ms (median round)", "ms (all rounds)"],
                [[m, 1e3 * modes[m], " ".join(f"{1e3 * s[m]:.1f}" for s in mode_rounds)]
                 for m in cp.CP_COMM_TYPES])
    spread = {m: statistics.pstdev(s[m] for s in mode_rounds) for m in cp.CP_COMM_TYPES}
    print("spread between rounds (ms):", {m: round(1e3 * v, 1) for m, v in spread.items()})

    if not args.no_save:
        command = f"{COMMAND} --rounds {args.rounds} --repeats {args.repeats}"
        reference.save("ch09_ring_work", ring, command=command, load=load_before,
                       notes="measure_ring_work(cp_size=4, seq_length=2048): the median of "
                             f"{args.rounds} rounds by total time", shape=RING)
        reference.save("ch09_cp_modes", [{"mode": m, "seconds": modes[m]} for m in cp.CP_COMM_TYPES],
                       command=command, load=load_before, notes=f"measure_cp_modes, {args.repeats} timed calls per "
                       f"mode; the median of {args.rounds} rounds by total time", shape=MODES)
        print("saved: tutorial_lib/reference/ch09_ring_work.json, ch09_cp_modes.json")


if __name__ == "__main__":
    main()
