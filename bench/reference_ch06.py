"""Chapter 6's stored reference: the measured bubble of GPipe, 1F1B and interleaved 1F1B.

    python bench/reference_ch06.py                # 5 launches; ~1 minute on 2 quiet cores
    python bench/reference_ch06.py --launches 9   # more launches, a steadier reference
    python bench/reference_ch06.py --print        # show the stored reference, measure nothing

Run it on a machine doing nothing else: it writes ``tutorial_lib/reference/ch06_bubble.json``
(through :func:`tutorial_lib.reference.save`, which records the machine, the date and the
load), which chapter 6 shows beside the bubble the reader's own run measures.

The measurement is the chapter's, cell for cell: PP = 4 ranks of
:class:`tutorial_lib.pipeline_parallel.synthetic.SyntheticStage` (a forward sleeps 10 ms, a backward 20 ms, a
chunk 1/V of that) run by :func:`~tutorial_lib.pipeline_parallel.synthetic.measure_synthetic_schedules` with real
P2P messages and labels, each schedule traced 3 times per launch; a run's bubble is the idle
share of the step (:func:`tutorial_lib.viz.timeline.bubble_fraction` over the compute spans,
the mean over the ranks), and the launch keeps the smallest of its 3, as the chapter does
(noise only adds idle time).  Each row stores, over ``--launches`` launches, the median and
the range of those per-launch bubbles and the median step time of the kept steps; with the
closed form and the simulated schedule beside them.  The configuration is stored with the
rows, and the chapter checks it ran the same one.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAME = "ch06_bubble"
COMMAND = "python bench/reference_ch06.py"
#: The chapter's measurement (notebooks/06_pipeline_4d.ipynb checks this dict).
CONFIG = {"pp": 4, "forward_s": 0.010, "backward_s": 0.020, "repeats": 3,
          "runs": [["gpipe", 4, 1], ["gpipe", 8, 1], ["1f1b", 4, 1], ["1f1b", 8, 1],
                   ["interleaved", 8, 2]]}


def mean_bubble(trace) -> float:
    """The idle share of the step, mean over the ranks (idle: not in a forward or backward)."""
    from tutorial_lib.viz.timeline import bubble_fraction

    per_rank = bubble_fraction(trace, count="compute")
    return sum(per_rank.values()) / len(per_rank)


def step_seconds(trace) -> float:
    return max(e.t_end for e in trace) - min(e.t_start for e in trace)


def one_launch(config: dict) -> dict[str, tuple[float, float]]:
    """Run name -> (smallest bubble of the repeats, that step's seconds)."""
    from tutorial_lib.launch import launch
    from tutorial_lib.pipeline_parallel.synthetic import (measure_synthetic_schedules,
                                                          synthetic_run_name)

    runs = [tuple(run) for run in config["runs"]]
    measured = launch(measure_synthetic_schedules, config["pp"],
                      args=(runs, config["forward_s"], config["backward_s"], config["repeats"]))
    out = {}
    for schedule, m, v in runs:
        name = synthetic_run_name(schedule, m, v)
        kept = min((measured.trace.filter(run=name, repeat=i) for i in range(config["repeats"])),
                   key=mean_bubble)
        out[name] = (mean_bubble(kept), step_seconds(kept))
    return out


def rows_of(launches: list[dict], config: dict) -> list[dict]:
    from tutorial_lib.pipeline_parallel import build_schedules
    from tutorial_lib.pipeline_parallel.formulas import expected_bubble
    from tutorial_lib.pipeline_parallel.simulator import bubble_fraction, makespan, simulate
    from tutorial_lib.pipeline_parallel.synthetic import synthetic_run_name

    rows = []
    for schedule, m, v in config["runs"]:
        name = synthetic_run_name(schedule, m, v)
        bubbles = [launch[name][0] for launch in launches]
        steps = [launch[name][1] for launch in launches]
        plan = simulate(build_schedules(schedule, config["pp"], m, v),
                        config["forward_s"] / v, config["backward_s"] / v)
        rows.append({
            "run": name, "schedule": schedule, "M": m, "V": v,
            "formula": round(expected_bubble(config["pp"], m, v), 4),
            "simulated": round(bubble_fraction(plan), 4),
            "measured": round(statistics.median(bubbles), 4),
            "measured_min": round(min(bubbles), 4), "measured_max": round(max(bubbles), 4),
            "step_ms": round(1000 * statistics.median(steps), 1),
            "ideal_step_ms": round(1000 * makespan(plan), 1),
        })
    return rows


def show(ref) -> None:
    print(ref.caption())
    print(f"{'run':<22} {'formula':>8} {'measured':>9} {'range':>13} {'step ms':>8} {'ideal':>6}")
    for r in ref.rows:
        print(f"{r['run']:<22} {r['formula']:8.3f} {r['measured']:9.3f} "
              f"{r['measured_min']:6.3f}-{r['measured_max']:.3f} {r['step_ms']:8.1f} "
              f"{r['ideal_step_ms']:6.1f}")


def main(argv=None) -> int:
    from tutorial_lib import reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=5, help="launches to measure (default 5)")
    parser.add_argument("--print", action="store_true", help="show the stored reference only")
    args = parser.parse_args(argv)
    if args.print:
        show(reference.load(NAME))
        return 0
    from tutorial_lib.launch import warm_up

    load_before = reference.load_average()  # the load the measurement started under
    warm_up()
    launches = [one_launch(CONFIG) for _ in range(args.launches)]
    ref = reference.save(
        NAME, rows_of(launches, CONFIG), command=COMMAND, load=load_before,
        notes=(f"Chapter 6's measured bubble: PP = {CONFIG['pp']} SyntheticStage ranks "
               f"(forward {CONFIG['forward_s'] * 1e3:g} ms, backward "
               f"{CONFIG['backward_s'] * 1e3:g} ms per stage, 1/V per chunk), batched P2P "
               f"(overlapped for interleaved), the smallest of {CONFIG['repeats']} traced "
               f"steps per launch; 'measured' is the median over {args.launches} launches, "
               f"'measured_min'/'measured_max' their range; 'step_ms' the kept step's "
               f"length (median), 'ideal_step_ms' the simulated step with free messages."),
        config=CONFIG, launches=args.launches)
    show(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
