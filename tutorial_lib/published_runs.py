"""Published training runs, the matmul efficiency fitted on one, the others predicted (ch. 13).

Two sources, every row cited:

* **Narayanan et al. 2021** (arXiv 2104.04473, Table 1): GPT from 1.7B to 1T parameters on
  up to 3,072 A100 80GB (Selene, 8 per node, one 200 Gb/s HDR port per GPU), vocabulary
  51,200, sequence 2,048, each row's heads, hidden size, layers, TP, PP, GPUs, global batch
  and achieved TFLOP/s per GPU, counted with the paper's ``96 B s l h^2 (1 + s/6h +
  V/16lh)``, which includes full recomputation's extra forward.  The micro-batch size and
  schedule are not in the table: the planner picks them (TP, PP and DP fixed, full
  recomputation, plain data parallelism).  The paper was read through transcriptions of
  its Table 1 in public repositories (three agree to the digit); the PDF itself could not
  be read in the session that wrote this module.
* **Korthikanti et al. 2022** (arXiv 2205.05198): the model FLOPs utilization (MFU) of four
  GPT models with sequence parallelism and selective recomputation, data-parallel size one,
  as the Megatron-LM README tabulates it (22B 41.5 %, 175B 51.4 %, 530B 56.0 %, 1T
  56.3 %); their layouts from the paper's Table 3 (TP 8; PP 1, 8, 35, 64; 8, 64, 280, 512
  GPUs; global batch 4, 64, 280, 512; micro-batch 4, 1, 1, 1; the interleaved schedule with
  three chunks for 175B and 530B), read through a transcription of the paper.

:func:`fit_efficiency` finds the one matmul efficiency at which the planner's prediction
for :data:`FITTED_ON` equals its published throughput; :func:`published_table` then
predicts every row with it.  Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .costs.hardware import cluster
from .costs.model_flops import gpt, hardware_flops_per_step
from .costs.step_time import predict_step
from .plan import candidate_layouts

__all__ = ["PublishedRun", "PUBLISHED_RUNS", "FITTED_ON", "fit_efficiency", "predict_run",
           "published_rank", "published_table", "format_table", "MACHINE_REFERENCE",
           "machine_table"]

NARAYANAN = "Narayanan et al. 2021, arXiv 2104.04473, Table 1"
KORTHIKANTI = ("Korthikanti et al. 2022, arXiv 2205.05198: MFU from the Megatron-LM README's "
               "table, layouts from the paper's Table 3")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: the model, its layout, what it achieved, where it is published."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    tp: int
    pp: int
    gpus: int
    global_batch_size: int
    metric: str
    """``"hardware_tflops"`` (TFLOP/s per GPU, recomputation counted) or ``"mfu"``."""
    value: float
    """The published figure: TFLOP/s per GPU, or MFU as a fraction."""
    recompute_granularity: str
    source: str
    micro_batch_size: int | None = None
    virtual_pipeline_size: int | None = None
    aggregate_pflops: float | None = None
    """Narayanan et al.'s aggregate PFLOP/s column (a check on the transcription: the
    per-GPU figure times the GPUs)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def model(self):
        return gpt(self.num_layers, self.hidden_size, self.num_attention_heads, name=self.name)


def _narayanan(name, heads, hidden, layers, tp, pp, gpus, batch, tflops, aggregate):
    return PublishedRun(name, layers, hidden, heads, tp, pp, gpus, batch, "hardware_tflops",
                        tflops, "full", NARAYANAN, aggregate_pflops=aggregate)


def _korthikanti(name, heads, hidden, layers, pp, gpus, batch, mbs, v, mfu):
    return PublishedRun(name, layers, hidden, heads, 8, pp, gpus, batch, "mfu", mfu,
                        "selective", KORTHIKANTI, mbs, v)


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    _narayanan("GPT 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 4.4),
    _narayanan("GPT 3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 8.8),
    _narayanan("GPT 7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 18.2),
    _narayanan("GPT 18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 34.6),
    _narayanan("GPT 39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 70.8),
    _narayanan("GPT 76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 143.8),
    _narayanan("GPT 145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 227.1),
    _narayanan("GPT 310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 297.4),
    _narayanan("GPT 529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 410.2),
    _narayanan("GPT 1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 502.0),
    _korthikanti("GPT 22B (SP + selective)", 64, 6144, 48, 1, 8, 4, 4, None, 0.415),
    _korthikanti("GPT 175B (SP + selective)", 96, 12288, 96, 8, 64, 64, 1, 3, 0.514),
    _korthikanti("GPT 530B (SP + selective)", 128, 20480, 105, 35, 280, 280, 1, 3, 0.560),
    _korthikanti("GPT 1T (SP + selective)", 160, 25600, 128, 64, 512, 512, 1, None, 0.563),
)
"""Every row, as published (see the module docstring for each source)."""

FITTED_ON = "GPT 145.6B"
"""The run the efficiency is fitted on: a middle row of Narayanan et al.'s table, with
pipeline, tensor and data parallelism all at work."""

GPU = "a100-80gb"


def _fixed(run: PublishedRun) -> dict:
    fixed = {"tp": run.tp, "pp": run.pp, "dp": run.dp, "cp": 1,
             "recompute_granularity": run.recompute_granularity, "sharding": "no_shard"}
    if run.micro_batch_size is not None:
        fixed["micro_batch_size"] = run.micro_batch_size
    if run.virtual_pipeline_size is not None:
        fixed["schedule"], fixed["virtual_pipeline_size"] = "interleaved", run.virtual_pipeline_size
    elif run.metric == "mfu":
        fixed["schedule"] = "1f1b"
    return fixed


def _figure(run: PublishedRun, result) -> float:
    """The prediction in the run's published unit: the papers' TFLOP/s per GPU (with the
    recomputation the layout runs) or MFU."""
    if run.metric == "mfu":
        return result.mfu
    flops = hardware_flops_per_step(run.model(), run.global_batch_size, run.recompute_granularity)
    return flops / run.gpus / result.step_time_s / 1e12


def predict_run(run: PublishedRun, efficiency: float):
    """The planner's best layout with the run's published choices held (TP, PP, DP, its
    recomputation, and where published its micro-batch and schedule), memory ignored
    (these runs ran), and its prediction in the published unit: ``(result, figure)``."""
    model, where = run.model(), cluster(GPU)
    best = None
    for layout in candidate_layouts(model, run.gpus, run.global_batch_size, _fixed(run)):
        result = predict_step(model, where, layout, run.global_batch_size, efficiency,
                              memory=False, checked=True)
        if best is None or result.step_time_s < best.step_time_s:
            best = result
    return best, _figure(run, best)


def fit_efficiency(run_name: str = FITTED_ON, low: float = 0.05, high: float = 1.0) -> float:
    """The matmul efficiency at which :func:`predict_run` gives ``run_name``'s published
    figure (bisection: the prediction grows with the efficiency), to 1e-6."""
    run = next(r for r in PUBLISHED_RUNS if r.name == run_name)
    for _ in range(40):
        middle = (low + high) / 2
        if predict_run(run, middle)[1] < run.value:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def published_rank(run: PublishedRun, efficiency: float, result) -> int:
    """Where the published layout (its prediction ``result``) ranks among every layout the
    planner finds for the run's model, GPUs and batch: 1 + the layouts that fit and are
    predicted faster.  (Its own recomputation and sharding may not be the planner's pick.)"""
    from .costs.step_time import USABLE_MEMORY_FRACTION, memory_lower_bound, with_memory
    model, where = run.model(), cluster(GPU)
    usable = USABLE_MEMORY_FRACTION * where.gpu.memory_bytes
    faster = 0
    for layout in candidate_layouts(model, run.gpus, run.global_batch_size):
        other = predict_step(model, where, layout, run.global_batch_size, efficiency,
                             memory=False, checked=True)
        if other.step_time_s >= result.step_time_s \
                or memory_lower_bound(model, layout, run.global_batch_size) > usable:
            continue
        faster += bool(with_memory(other, model, where, run.global_batch_size).fits)
    return 1 + faster


def published_table(efficiency: float, ranks: bool = False) -> list[dict]:
    """One row per published run: its layout, the published figure, the prediction, the
    relative error, the best layout's schedule and micro-batch, the source, and with
    ``ranks`` the published layout's place in the planner's list (:func:`published_rank`,
    a search over every layout per row)."""
    rows = []
    for run in PUBLISHED_RUNS:
        result, figure = predict_run(run, efficiency)
        rows.append({"run": run.name, "tp": run.tp, "pp": run.pp, "dp": run.dp, "gpus": run.gpus,
                     "global_batch_size": run.global_batch_size, "metric": run.metric,
                     "published": run.value, "predicted": figure,
                     "error": figure / run.value - 1, "schedule": result.layout.schedule,
                     "virtual_pipeline_size": result.layout.virtual_pipeline_size,
                     "micro_batch_size": result.layout.micro_batch_size,
                     "fitted": run.name == FITTED_ON, "source": run.source})
        if ranks:
            rows[-1]["rank"] = published_rank(run, efficiency, result)
    return rows


def format_table(rows: list[dict]) -> str:
    """The table as text, one run a line (the chapter prints this)."""
    lines = [f"{'run':<26} {'TP':>2} {'PP':>3} {'DP':>3} {'GPUs':>5} {'unit':>9} "
             f"{'published':>9} {'predicted':>9} {'error':>7}"
             + (f" {'rank':>4}" if rows and "rank" in rows[0] else "")]
    for r in rows:
        unit = "MFU" if r["metric"] == "mfu" else "TFLOP/s"
        fmt = (lambda x: f"{x:.1%}") if r["metric"] == "mfu" else (lambda x: f"{x:.0f}")
        mark = (f" {r['rank']:>4}" if "rank" in r else "") + (" (fitted)" if r["fitted"] else "")
        lines.append(f"{r['run']:<26} {r['tp']:>2} {r['pp']:>3} {r['dp']:>3} {r['gpus']:>5} "
                     f"{unit:>9} {fmt(r['published']):>9} {fmt(r['predicted']):>9} "
                     f"{r['error']:>+7.1%}{mark}")
    return "\n".join(lines)


# --- checked on this machine ---------------------------------------------------------

MACHINE_REFERENCE = "ch13_planner_cpu"
"""The stored reference of ``bench/bench_planner_cpu.py``: a few ``train_4d`` layouts'
step times on this machine's gloo ranks, and the planner's prediction for each."""


def machine_table(ref=None) -> list[dict]:
    """Each layout's predicted and measured step time over the first layout's, side by side,
    and how far the predicted ratio is from the measured one, computed from the stored
    reference (``ref``, default :data:`MACHINE_REFERENCE` loaded; ``FileNotFoundError``
    where it has not been measured yet).  The prediction uses an all-reduce fit measured on
    the runs' own ranks; where the reference also holds the prediction with chapter 2's
    stored fit (``predicted_ch02_s``), its ratio and error come too (``..._ch02``)."""
    if ref is None:
        from . import reference
        ref = reference.load(MACHINE_REFERENCE)
    first = ref.rows[0]
    rows = []
    for row in ref.rows:
        predicted = row["predicted_s"] / first["predicted_s"]
        measured = row["measured_s"] / first["measured_s"]
        out = {"layout": row["layout"], "predicted_ratio": predicted,
               "measured_ratio": measured, "error": predicted / measured - 1}
        if "predicted_ch02_s" in row:
            ch02 = row["predicted_ch02_s"] / first["predicted_ch02_s"]
            out.update(predicted_ch02_ratio=ch02, error_ch02=ch02 / measured - 1)
        rows.append(out)
    return rows
