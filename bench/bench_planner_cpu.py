"""Chapter 13's planner on this machine: predicted against measured step-time ratios.

    python bench/bench_planner_cpu.py --save      # stores the reference ch13_planner_cpu
    python bench/bench_planner_cpu.py             # print the table, store nothing
    python bench/bench_planner_cpu.py --dry-run   # a tiny model, two steps each: checks it runs

Four layouts of the course's dense model on four gloo ranks (DP 4, TP 2 x DP 2, PP 2 x
DP 2, TP 2 x PP 2; 1F1B, micro-batches of one sequence) run ``train_4d`` for ``--steps``
steps, ``--rounds`` times in turn; each layout's time is the median over every round of
its steps after the first (the slowest rank's step, as ``train_4d`` logs it).

The planner predicts the same four with this machine as its cluster
(:func:`machine_cluster`): a "GPU" whose peak is one torch thread's fp32 matmul rate,
measured here (:func:`matmul_rate`), shared by the ranks when there are more ranks than
cores, at efficiency 1.  It predicts them twice, with two links:

* chapter 2's stored all-reduce fit (``tutorial_lib/reference/ch02_alpha_beta.json``),
  measured on 2 ranks, each with a core of its own;
* the same measurement (chapter 2's :func:`~tutorial_lib.timing.alpha_beta.measure_alpha_beta`,
  all-reduce only) taken here, before the runs, on the 4 ranks the layouts run on, two to
  a core: a rank's partner in a collective may be waiting for its core, and that is the
  cost the layouts' many small TP all-reduces pay (:func:`run_link`).

Absolute times are not the point: the planner counts bf16 activations on the wire where
these runs send fp32 (the small TP and PP messages are undercounted by half; the fp32
gradients are counted as they are), and a CPU's matmul rate is not a GPU's.  What is
compared are the ratios between layouts, each layout's time over the first's, side by
side in chapter 13.

Run ``--save`` on an idle machine (``scripts/measure_references.py`` waits for one): the
reference records the machine, the date and the load before measuring.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

from tutorial_lib import reference  # noqa: E402
from tutorial_lib.costs.alpha_beta import AlphaBeta  # noqa: E402
from tutorial_lib.costs.hardware import FIGURES, GPU, Cluster  # noqa: E402
from tutorial_lib.config import ModelConfig  # noqa: E402
from tutorial_lib.costs.step_time import Layout, predict_step  # noqa: E402
from tutorial_lib.published_runs import machine_table  # noqa: E402

NAME = "ch13_planner_cpu"
COMMAND = "python bench/bench_planner_cpu.py --save"

LAYOUTS = ((1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1))
"""``(TP, PP, DP)`` on four ranks."""

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128,
         "vocab_size": 512, "num_experts": 0}
"""The course's model, dense (``ModelConfig`` field names)."""

TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
        "vocab_size": 64, "num_experts": 0}

GLOBAL_BATCH_SIZE = 8


def matmul_rate(hidden: int, tokens: int, seconds: float = 1.0) -> float:
    """FLOP/s of one torch thread on this machine: ``[tokens, h] @ [h, 4h]`` in fp32, the
    best of five timings of repeated products lasting about ``seconds`` in all."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(tokens, hidden), torch.randn(hidden, 4 * hidden)
    flops = 2.0 * tokens * hidden * 4 * hidden
    a @ b  # warm up
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < seconds / 5:
        a @ b
        count += 1
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(count):
            a @ b
        best = min(best, (time.perf_counter() - started) / count)
    return flops / best


def stored_link() -> AlphaBeta:
    """Chapter 2's stored all-reduce fit on this machine's gloo ranks."""
    (row,) = [r for r in reference.load("ch02_alpha_beta").rows if r["op"] == "all_reduce"]
    return AlphaBeta(row["alpha_us"] * 1e-6, 1 / (row["gb_per_s"] * 1e9))


def run_link(ranks: int, dry_run: bool = False) -> AlphaBeta:
    """Chapter 2's all-reduce fit, measured now on ``ranks`` gloo ranks (the layouts' own
    world) instead of chapter 2's two."""
    from tutorial_lib.costs.alpha_beta import fit_alpha_beta
    from tutorial_lib.timing.alpha_beta import ALPHA_BETA_SIZES, measure_alpha_beta
    sizes = ALPHA_BETA_SIZES[:4] if dry_run else ALPHA_BETA_SIZES
    return fit_alpha_beta(measure_alpha_beta(("all_reduce",), sizes, world_size=ranks,
                                             repeats=2 if dry_run else 5)).model


def machine_cluster(rate: float, link: AlphaBeta, ranks: int, cores: int) -> Cluster:
    """This machine as the planner's cluster: one node of ``ranks`` "GPUs", each
    computing at ``rate`` times its share of the cores (one thread per rank), both links
    ``link``."""
    share = min(1.0, cores / ranks)
    gpu = GPU("this CPU, one rank", rate * share, None, 1e15, 1 / link.beta, 1 / link.beta,
              ranks, unsourced=tuple((f, "measured on this machine") for f in FIGURES))
    return Cluster(gpu, ranks, link, link)


def spec(model: dict) -> ModelConfig:
    return ModelConfig(model["num_layers"], model["hidden_size"],
                       model["num_attention_heads"], model["seq_length"],
                       model["vocab_size"], name="course model, dense")


def layout_of(tp: int, pp: int, dp: int) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=1)


def predicted_times(model: dict, where: Cluster) -> list[float]:
    """The planner's step time of each of :data:`LAYOUTS` (no memory check)."""
    return [predict_step(spec(model), where, layout_of(*l), GLOBAL_BATCH_SIZE, 1.0,
                         memory=False).step_time_s for l in LAYOUTS]


def measured_time(model: dict, tp: int, pp: int, dp: int, steps: int) -> list[float]:
    """Step times of one ``train_4d`` run of the layout, its first step left out."""
    from tutorial_lib.train_4d import TrainingArgs, train
    args = TrainingArgs(world_size=tp * pp * dp, tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp, global_batch_size=GLOBAL_BATCH_SIZE,
                        num_microbatches=GLOBAL_BATCH_SIZE // dp, steps=steps, **model)
    records = train(args).results[0]
    return [r["step_time_s"] for r in records[1:]]


def time_rows(predicted: list[float], measured: list[float],
              predicted_ch02: list[float]) -> list[dict]:
    """One row per layout: its times, predicted with the run's link and with chapter 2's,
    and measured (the ratios are :func:`tutorial_lib.published_runs.machine_table`'s)."""
    return [{"layout": f"TP {tp} PP {pp} DP {dp}", "tp": tp, "pp": pp, "dp": dp,
             "predicted_s": p, "measured_s": m, "predicted_ch02_s": c}
            for (tp, pp, dp), p, m, c in zip(LAYOUTS, predicted, measured, predicted_ch02)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--save", action="store_true", help=f"store {NAME}")
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model, two steps, one round: checks the script runs")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (first left out)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every layout, in turn")
    args = parser.parse_args()
    if args.dry_run and args.save:
        parser.error("--dry-run measures a tiny model: it stores nothing, drop --save")
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be >= 2 (the first is left out) and --rounds >= 1")
    model, steps, rounds = (TINY, 2, 1) if args.dry_run else (MODEL, args.steps, args.rounds)
    load = reference.load_average()
    rate = matmul_rate(model["hidden_size"], model["seq_length"],
                       seconds=0.1 if args.dry_run else 1.0)
    ranks, cores = 4, os.cpu_count() or 1
    link, ch02 = run_link(ranks, args.dry_run), stored_link()
    predicted = predicted_times(model, machine_cluster(rate, link, ranks, cores))
    predicted_ch02 = predicted_times(model, machine_cluster(rate, ch02, ranks, cores))
    times: dict[tuple, list[float]] = {l: [] for l in LAYOUTS}
    for _ in range(rounds):
        for l in LAYOUTS:
            times[l] += measured_time(model, *l, steps)
    measured = [statistics.median(times[l]) for l in LAYOUTS]
    rows = time_rows(predicted, measured, predicted_ch02)
    ratios = machine_table(reference.Reference(NAME, rows))
    print_table(["layout", "predicted s", "measured s", "predicted / first",
                 "measured / first", "with ch. 2's link"],
                [[r["layout"], f"{r['predicted_s']:.4f}", f"{r['measured_s']:.4f}",
                  f"{q['predicted_ratio']:.2f}", f"{q['measured_ratio']:.2f}",
                  f"{q['predicted_ch02_ratio']:.2f}"] for r, q in zip(rows, ratios)],
                title=f"planner vs train_4d, {ranks} gloo ranks on {cores} cores, matmul "
                      f"{rate / 1e9:.1f} GFLOP/s a thread, all-reduce alpha "
                      f"{link.alpha * 1e6:.0f} us on {ranks} ranks ({ch02.alpha * 1e6:.0f} us "
                      f"in chapter 2's fit), load {load}")
    if args.save:
        ref = reference.save(NAME, rows, command=COMMAND, load=load,
                             notes=f"train_4d on {ranks} gloo ranks, {steps} steps x {rounds} "
                                   f"rounds, median after the first step; planner with a "
                                   f"one-thread fp32 matmul rate and chapter 2's all-reduce "
                                   f"fit measured on the {ranks} ranks (predicted_ch02_s: "
                                   f"with ch02_alpha_beta's, measured on 2)",
                             matmul_flops=rate, cores=cores, model=model,
                             run_link={"ranks": ranks, "alpha_us": link.alpha * 1e6,
                                       "gb_per_s": link.bandwidth / 1e9},
                             global_batch_size=GLOBAL_BATCH_SIZE)
        print(ref.caption())
    return 0


if __name__ == "__main__":
    sys.exit(main())
