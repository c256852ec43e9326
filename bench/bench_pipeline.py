"""Pipeline parallelism on CPU ranks: train_4d's throughput per layout, and the bubble measured.

    python bench/bench_pipeline.py                 # ~1.5-4 minutes on 2 cores (depends on load)
    python bench/bench_pipeline.py --quick         # ~10-35 s: 3 layouts, PP 2 only, 1 round
    python bench/bench_pipeline.py --tables 2 --bubble-steps 4

Two tables:

1. **train_4d per layout.**  ``tutorial_lib.train_4d.train`` (what
   ``examples/train_4d.py`` runs) on 8 ranks in several layouts (DP8, TP2 x DP4,
   PP2 x DP4, PP4 x DP2, PP2 x TP2 x DP2, PP2 x DP4 with EP2 (Megatron carves EP
   out of DP: the routed experts split over 2 ranks, each expert replicated over an
   expert-DP group of 2), PP4 x DP2 interleaved with V = 2), beside the world-size-1
   run (one thread, and every core).  Every row trains the **same model on the same
   data** (a DeepSeek-style MoE model: ``--layers`` layers, the first dense,
   ``--experts`` routed experts, top-2, one shared expert; the same global batch and
   M), so the loss after the last step
   must be the same in every row up to fp32 rounding: the *|loss - 1 rank|* column
   shows it, and its maximum is printed under the table.  A step's time is the
   slowest rank's ``step_time_s`` (each rank times its own step); the first step of
   every launch is warm-up and is dropped; the table shows the median over the
   remaining steps of every round (the layouts take turns, ``--rounds`` rounds, so
   load from elsewhere hits all alike).  Tokens per second = global batch x
   sequence length / that time; *x 1 rank* divides it by the world-size-1 run's
   with one thread (what each of the 8 ranks gets).  **8 ranks on 2 cores
   oversubscribe the CPU four times over**: no layout can be faster than the
   arithmetic on 2 cores, so this measures what each layout's communication,
   scheduling and bubbles cost on top of the same arithmetic, not speedups.  One
   torch thread per rank (the launcher's default for 8 ranks on 2 cores), tracing off.
2. **The pipeline bubble, measured vs the formula.**  ``forward_backward_pipelining``
   (the real executor, batched P2P, overlapped for the interleaved schedule as
   Megatron runs it, labels sent from the first stage to the last;
   run by ``pipeline.measure_synthetic_schedules``, the harness chapter 6 uses)
   on ``SyntheticStage`` stages that *sleep* a known time instead of computing: a
   rank's stage costs ``--forward-ms`` forward and ``--backward-ms`` backward (with
   interleaving each of its V = 2 chunks costs half of that, so every schedule
   runs the same model), so the ranks do not compete for the two cores and the
   timeline is the schedule's.  GPipe, 1F1B and interleaved 1F1B at PP in {2, 4}
   and M in {PP, 2 PP, 4 PP}.  Every step starts after a barrier; the bubble of a
   step is ``viz.timeline.bubble_fraction(count="compute", window="global")`` on
   that step's events (the idle share of the window from the first event of any
   rank to the last), averaged over the ranks; the table shows the second step's
   (the first is warm-up; with ``--bubble-steps N``, steps 2..N), median over
   ``--bubble-rounds`` launches of every configuration, taken in turns.
   Beside it: ``pipeline_parallel.formulas.expected_bubble`` = (PP - 1) / (V M + PP - 1)
   and the difference (what the P2P messages, the Python between actions and the
   sleep's overshoot add, and on a loaded machine the milliseconds a sleeping rank
   waits for a core when it wakes; the formula assumes they cost nothing); the step time
   (slowest rank, its first to its last recorded event of the step) beside the ideal ``(V M + PP - 1)(f + b) / V``;
   and the peak activations each rank held (``StepOutput.peak_activations``, in
   chunk-microbatches, rank 0 first) beside
   ``pipeline_parallel.formulas.expected_peak_activations`` (asserted equal).  The column
   *simulated, P2P x ms* is ``pipeline_parallel.simulator.simulate`` of the same schedule
   with every send costing ``--sim-p2p-ms`` (no launch): a what-if, not a fit, that
   shows how much of the gap a per-message cost of that size explains.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

WORLD = 8

# name, TP, PP, EP, schedule
LAYOUTS = [
    ("DP8", 1, 1, 1, "1f1b"),
    ("TP2 x DP4", 2, 1, 1, "1f1b"),
    ("PP2 x DP4", 1, 2, 1, "1f1b"),
    ("PP4 x DP2", 1, 4, 1, "1f1b"),
    ("PP2 x TP2 x DP2", 2, 2, 1, "1f1b"),
    ("PP2 x DP4, EP2", 1, 2, 2, "1f1b"),  # EP inside DP: experts split over 2, expert-DP 2
    ("PP4 x DP2, interleaved V=2", 1, 4, 1, "interleaved"),
]
QUICK_LAYOUTS = ("DP8", "PP2 x DP4", "PP4 x DP2, interleaved V=2")


# --- table 1: train_4d per layout ------------------------------------------------------------


def _training_args(args, world: int, tp: int, pp: int, ep: int, schedule: str):
    from tutorial_lib.train_4d import TrainingArgs
    return TrainingArgs(world_size=world, tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                        schedule=schedule, virtual_pipeline_model_parallel_size=2,
                        num_microbatches=args.microbatches, global_batch_size=args.global_batch,
                        seq_length=args.seq, num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=args.heads, vocab_size=args.vocab,
                        num_experts=args.experts, steps=args.steps, seed=args.seed,
                        p2p_mode="batched")


def table_layouts(args) -> None:
    from tutorial_lib.train_4d import train
    cores = os.cpu_count() or 1
    # name, world, TP, PP, EP, schedule, torch threads per rank
    # The reference first: one rank with one thread, as each of the 8 ranks has.
    variants = [("1 rank, 1 thread", 1, 1, 1, 1, "1f1b", 1),
                (f"1 rank, {cores} threads", 1, 1, 1, 1, "1f1b", cores)]
    variants += [(name, WORLD, tp, pp, ep, schedule, 1) for name, tp, pp, ep, schedule in LAYOUTS
                 if not args.quick or name in QUICK_LAYOUTS]
    times = {v[0]: [] for v in variants}
    losses: dict = {}
    for r in range(args.rounds):
        # Rotate the order every round, so that no layout always runs first or last.
        for name, world, tp, pp, ep, schedule, threads in (variants[r % len(variants):]
                                                           + variants[:r % len(variants)]):
            result = train(_training_args(args, world, tp, pp, ep, schedule), threads=threads)
            per_rank = result.results
            for step in range(1, args.steps):  # step 0 is warm-up
                times[name].append(max(records[step]["step_time_s"] for records in per_rank))
            losses.setdefault(name, per_rank[0][-1]["loss"])
    tokens = args.global_batch * args.seq
    base_name = variants[0][0]
    base_s = statistics.median(times[base_name])
    base_loss = losses[base_name]
    rows = []
    for name, world, tp, pp, ep, schedule, threads in variants:
        t = statistics.median(times[name])
        dp = world // (tp * pp)
        rows.append([name, world, tp, pp, ep, dp, t * 1e3, tokens / t, base_s / t,
                     f"{losses[name]:.6f}", f"{abs(losses[name] - base_loss):.1e}"])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print_table(["layout", "ranks", "TP", "PP", "EP", "DP", "ms / step", "tokens / s",
                 "x 1 rank", f"loss (step {args.steps})", "|loss - 1 rank|"], rows, digits=2,
                title=f"1. train_4d per layout: {args.layers} layers (h={args.hidden}, "
                      f"{args.heads} heads, {args.experts} routed experts top-2, 1 shared, "
                      f"first layer dense), global batch {args.global_batch} x {args.seq} "
                      f"tokens, M = {args.microbatches}, batched P2P; median of {args.rounds} "
                      f"round{'s' * (args.rounds != 1)} x {args.steps - 1} "
                      f"step{'s' * (args.steps != 2)} (first step of each launch dropped); "
                      f"slowest rank per step; {now}, {cores} cores, load average "
                      f"{os.getloadavg()[0]:.1f} at the end")
    worst = max(abs(v - base_loss) for v in losses.values())
    print(f"\nmax |loss - 1 rank| over every layout after step {args.steps}: {worst:.2e} "
          f"(the same model and data on every grid: fp32 rounding only)")


# --- table 2: the bubble with synthetic stages -------------------------------------------


def _step_seconds(trace, pp: int, repeat: int) -> float:
    """One traced step's length on its slowest rank: first event start to last event end."""
    lengths = []
    for rank in range(pp):
        events = trace.filter(repeat=repeat, rank=rank).events
        assert events, f"rank {rank} recorded nothing in step {repeat}"
        lengths.append(max(e.t_end for e in events) - min(e.t_start for e in events))
    return max(lengths)


def table_bubble(args) -> None:
    from tutorial_lib.launch import launch
    from tutorial_lib.pipeline_parallel import build_schedules, simulator
    from tutorial_lib.pipeline_parallel.formulas import expected_bubble, expected_peak_activations
    from tutorial_lib.pipeline_parallel.simulator import simulate
    from tutorial_lib.pipeline_parallel.synthetic import (measure_synthetic_schedules,
                                                          synthetic_run_name)
    from tutorial_lib.viz.timeline import bubble_fraction
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    pps = [2] if args.quick else [2, 4]
    factors = [1, 4] if args.quick else [1, 2, 4]
    configs = [(schedule, pp, factor * pp, v) for pp in pps for factor in factors
               for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]
    bubbles: dict = {c: [] for c in configs}
    step_ms: dict = {c: [] for c in configs}
    peaks: dict = {}
    for _ in range(args.bubble_rounds):
        for config in configs:  # every configuration once per round: load hits all alike
            schedule, pp, m, v = config
            result = launch(measure_synthetic_schedules, pp,
                            args=([(schedule, m, v)], f, b, args.bubble_steps, None),
                            threads=1, print_output=False, timeout=600)
            for step in range(1, args.bubble_steps):  # step 0 is warm-up
                per_rank = bubble_fraction(result.trace.filter(repeat=step), count="compute",
                                           window="global")
                bubbles[config].append(statistics.mean(per_rank[r] for r in range(pp)))
                step_ms[config].append(_step_seconds(result.trace, pp, step) * 1e3)
            run = synthetic_run_name(schedule, m, v)
            measured_peaks = [result.results[r][run] for r in range(pp)]
            expected = [expected_peak_activations(schedule, pp, m, r, v) for r in range(pp)]
            for step in range(args.bubble_steps):
                if [p[step] for p in measured_peaks] != expected:
                    raise AssertionError(f"{schedule} PP={pp} M={m}: peak activations per rank "
                                         f"{[p[step] for p in measured_peaks]}, "
                                         f"expected_peak_activations gives {expected}")
            peaks[config] = ([p[-1] for p in measured_peaks], expected)
    rows, worst = [], 0.0
    for config in configs:
        schedule, pp, m, v = config
        measured = statistics.median(bubbles[config])
        formula = expected_bubble(pp, m, v)
        worst = max(worst, abs(measured - formula))
        ideal_ms = (v * m + pp - 1) * (f + b) / v * 1e3
        simulated = simulate(build_schedules(schedule, pp, m, v), f / v, b / v,
                             args.sim_p2p_ms / 1e3)
        simulated_bubble = simulator.bubble_fraction(simulated)  # mean over the ranks
        rows.append([schedule, pp, m, v, measured, formula, measured - formula, simulated_bubble,
                     round(statistics.median(step_ms[config])), round(ideal_ms),
                     "/".join(map(str, peaks[config][0])), "/".join(map(str, peaks[config][1]))])
    steps = "the second step" if args.bubble_steps == 2 else f"steps 2..{args.bubble_steps}"
    launches = f"{args.bubble_rounds} launch{'es' * (args.bubble_rounds != 1)}"
    label = f"median over {launches} of {steps}"
    print_table(["schedule", "PP", "M", "V", "bubble measured", "(PP-1)/(VM+PP-1)",
                 "measured - formula", f"simulated, P2P {args.sim_p2p_ms:g} ms", "step ms",
                 "ideal ms", "peak act. / rank", "expected peak"], rows, digits=3,
                title=f"2. Pipeline bubble with SyntheticStage (a rank's stage: forward "
                      f"{args.forward_ms:g} ms, backward {args.backward_ms:g} ms; each of V "
                      f"chunks 1/V of that), real executor, batched P2P (interleaved: overlapped); "
                      f"bubble = compute-idle share of the step window, mean of the ranks, "
                      f"{label}; step ms: slowest rank; load average "
                      f"{os.getloadavg()[0]:.1f} at the end")
    print(f"\nchecked: peak activations per rank == expected_peak_activations on every row. "
          f"Largest |measured - formula|: {worst:.3f}.")


def main() -> None:
    from tutorial_lib.launch import warm_up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--quick", action="store_true",
                        help="table 1: 3 layouts, 1 round of 3 steps; table 2: PP 2, M in "
                             "{2, 8} (< 60 s)")
    group = parser.add_argument_group("table 1 (train_4d)")
    group.add_argument("--hidden", type=int, default=64)
    group.add_argument("--heads", type=int, default=4)
    group.add_argument("--layers", type=int, default=8)
    group.add_argument("--seq", type=int, default=64)
    group.add_argument("--vocab", type=int, default=256)
    group.add_argument("--experts", type=int, default=4, help="routed experts (a multiple of 2)")
    group.add_argument("--global-batch", type=int, default=32)
    group.add_argument("--microbatches", type=int, default=4, help="M (a multiple of 4)")
    group.add_argument("--steps", type=int, default=4, help="steps per launch, the first dropped")
    group.add_argument("--rounds", type=int, default=3, help="rounds of every layout")
    group.add_argument("--seed", type=int, default=1234)
    group = parser.add_argument_group("table 2 (bubble)")
    group.add_argument("--forward-ms", type=float, default=10.0)
    group.add_argument("--backward-ms", type=float, default=20.0)
    group.add_argument("--bubble-steps", type=int, default=2,
                       help="pipeline steps per launch; the first is warm-up")
    group.add_argument("--bubble-rounds", type=int, default=3,
                       help="launches of every configuration (rounds); the median is shown")
    group.add_argument("--sim-p2p-ms", type=float, default=1.0,
                       help="per-send cost for the simulated column (a what-if)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.bubble_rounds = 3, 1, 1
    if args.steps < 2 or args.bubble_steps < 2:
        parser.error("--steps and --bubble-steps must be >= 2 (the first step is warm-up)")
    warm_up()  # start the forkserver before anything is timed
    started = time.perf_counter()
    if 1 in args.tables:
        table_layouts(args)
    if 2 in args.tables:
        table_bubble(args)
    print(f"\nbench time {time.perf_counter() - started:.0f} s (Python "
          f"{platform.python_version()}, torch {__import__('torch').__version__})")


if __name__ == "__main__":
    main()
