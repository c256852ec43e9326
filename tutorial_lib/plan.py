"""Choosing a layout: every candidate for a model on a cluster, ranked (chapter 13).

``python -m tutorial_lib.plan --preset llama-3.1-405b --gpu h100-sxm --gpus 16384
--global-batch-size 2048`` lists the layouts that fit, fastest first, with each one's
predicted step time and its parts, throughput, MFU and heaviest rank's memory
(:func:`tutorial_lib.costs.step_time.predict_step`).  The layout flags (``--tp --cp --pp
--ep --dp --virtual-pipeline-size --schedule --micro-batch-size --recompute-granularity
--data-parallel-sharding-strategy``) fix those choices; the planner searches the rest
(:func:`candidate_layouts`).  It times every candidate first (cheap), then walks them
fastest first through the memory model until it has ``--top`` layouts that fit, so a
world of 16,384 GPUs takes seconds.  Bad input exits 2 with the rule, the value and a fix.
No torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields

from .config import ConfigError, ModelConfig, default_pipeline_split, uneven_split
from .costs.hardware import GPUS, Cluster, cluster
from .costs.memory_model import format_bytes
from .costs.model_flops import MODEL_PRESETS, check_model, parameter_count
from .costs.step_time import (MODELLED_SHARDING, SCHEDULES, SHARDING_STRATEGIES,
                              USABLE_MEMORY_FRACTION, Layout, StepTime, check_layout,
                              memory_lower_bound, predict_step, with_memory)

__all__ = ["MATMUL_EFFICIENCY", "Plan", "Decision", "candidate_layouts", "plan",
           "decision_flow", "main"]

MATMUL_EFFICIENCY = 0.567
"""The fraction of the GPU's peak one matmul reaches, for every GPU: fitted on one
published run (:data:`tutorial_lib.published_runs.FITTED_ON`, Narayanan et al.'s GPT 145.6B
on 1,536 A100s; the tests check this
figure is the fit's, to three decimals) and used for every GPU, which the chapter says is
the model's largest simplification (``--efficiency`` overrides it)."""

TP_SIZES = (1, 2, 4, 8, 16, 32, 64)
CP_SIZES = (1, 2, 4, 8, 16)
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
VIRTUAL_SIZES = (2, 3, 4, 6, 8)
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found."""

    layouts: list
    """:class:`~tutorial_lib.costs.step_time.StepTime` of the layouts that fit, fastest first."""
    candidates: int
    """Valid layouts timed."""
    memory_checked: int
    """Of those, how many went through the memory model."""


def _choices(fixed, name, default):
    value = fixed.get(name)
    return (value,) if value is not None else default


def candidate_layouts(model: ModelConfig, gpus: int, global_batch_size: int,
                      fixed: dict | None = None):
    """Every layout of ``gpus`` GPUs :func:`~tutorial_lib.costs.step_time.check_layout`
    accepts, the choices in ``fixed`` (Layout field names; ``recompute_granularity``
    ``"none"`` holds no recomputation) held.  TP and CP powers of two,
    PP every size up to the layers (Megatron's uneven first and last stages where it does
    not divide them, :func:`_split`), DP what the world leaves, EP every divisor of the
    experts that the grid allows, the schedules of
    :data:`~tutorial_lib.costs.step_time.SCHEDULES` (interleaved with V in
    :data:`VIRTUAL_SIZES`), micro-batches in :data:`MICRO_BATCH_SIZES`, no, selective or full
    recomputation, and the modelled sharding strategies."""
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    for tp in _choices(fixed, "tp", TP_SIZES):
        for cp in _choices(fixed, "cp", CP_SIZES):
            for pp in _choices(fixed, "pp", range(1, model.num_layers + 1)):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                if fixed.get("dp", dp) != dp:
                    continue
                experts = (range(1, model.num_experts + 1) if model.num_experts else (1,))
                for ep in _choices(fixed, "ep", experts):
                    if model.num_experts and (model.num_experts % ep or (dp * cp) % ep):
                        continue
                    yield from _schedules(model, global_batch_size, fixed,
                                          Layout(tp, cp, pp, ep, dp))


def _schedules(model, global_batch_size, fixed, base: Layout):
    schedules = []
    for schedule in _choices(fixed, "schedule", SCHEDULES):
        sizes = (1,) if schedule in ("1f1b", "dualpipev") else VIRTUAL_SIZES
        for v in _choices(fixed, "virtual_pipeline_size", sizes):
            schedules.append((schedule, v))
    for schedule, v in schedules:
        for mbs in _choices(fixed, "micro_batch_size", MICRO_BATCH_SIZES):
            recomputes = _choices(fixed, "recompute_granularity", RECOMPUTE)
            recomputes = [None if r == "none" else r for r in recomputes]
            for recompute in recomputes:
                for sharding in _choices(fixed, "sharding", MODELLED_SHARDING):
                    first, last = _split(model, base.pp, schedule, v, fixed)
                    layout = Layout(base.tp, base.cp, base.pp, base.ep, base.dp, v, schedule, mbs,
                                    recompute, sharding, first, last)
                    try:
                        check_layout(model, layout, global_batch_size)
                    except ConfigError:
                        continue
                    yield layout


def _split(model, pp, schedule, v, fixed) -> tuple:
    """The first and last ranks' layers: as fixed, else equal stages where PP x V divides
    the layers, else the most even uneven split Megatron accepts
    (:func:`tutorial_lib.config.default_pipeline_split`); DualPipeV only equal stages."""
    first = fixed.get("num_layers_in_first_pipeline_stage")
    last = fixed.get("num_layers_in_last_pipeline_stage")
    if first is not None or last is not None or schedule == "dualpipev":
        return first, last
    return default_pipeline_split(model.num_layers, pp, v)


def plan(model: ModelConfig, where: Cluster, gpus: int, global_batch_size: int, *,
         efficiency: float = MATMUL_EFFICIENCY, precision: str = "bf16",
         fixed: dict | None = None, top: int | None = 10) -> Plan:
    """The layouts that fit, fastest first (all of them with ``top=None``).  A
    :class:`ConfigError` when no layout is valid or none fits, naming why and a fix."""
    check_model(model)
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    _check_fixed(model, gpus, global_batch_size, fixed)
    timed = [predict_step(model, where, layout, global_batch_size, efficiency, precision,
                          memory=False, checked=True)
             for layout in candidate_layouts(model, gpus, global_batch_size, fixed)]
    if not timed:
        raise ConfigError("no layout", f"no layout of {gpus} GPUs keeps every rule for this "
                                       f"model and a global batch of {global_batch_size} (with "
                                       f"{_fixed_text(fixed)}); try a number of GPUs with more "
                                       f"divisors, or fix fewer choices")
    timed.sort(key=lambda r: r.step_time_s)
    fitting, checked = [], 0
    usable = USABLE_MEMORY_FRACTION * where.gpu.memory_bytes
    for result in timed:
        if memory_lower_bound(model, result.layout, global_batch_size) > usable:
            continue  # its state and activations alone do not fit
        checked += 1
        result = with_memory(result, model, where, global_batch_size)
        if result.fits:
            fitting.append(result)
            if top is not None and len(fitting) >= top:
                break
    if not fitting:
        raise ConfigError("fits nowhere", f"none of the {len(timed)} layouts of {gpus} "
                                          f"{where.gpu.name} fits in memory (with "
                                          f"{_fixed_text(fixed)}); use more GPUs, a GPU with "
                                          f"more memory, or leave recomputation and micro-batch "
                                          f"to the planner")
    return Plan(fitting, len(timed), checked)


def _fixed_text(fixed) -> str:
    shown = ", ".join(f"{k} {v}" for k, v in fixed.items())
    return shown or "nothing fixed"


def _check_fixed(model, gpus, global_batch_size, fixed) -> None:
    """Refuse a fixed choice on its own, before the search, naming the rule."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError("gpus", f"--gpus must be a whole number >= 1, got {gpus!r}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ConfigError("batch", f"--global-batch-size must be a whole number >= 1, got "
                                   f"{global_batch_size!r}")
    product = 1
    for name in ("tp", "cp", "pp", "dp"):
        value = fixed.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("layout", f"--{name} must be a whole number >= 1, got {value!r}")
            product *= value
    if gpus % product:
        raise ConfigError("layout", f"the fixed sizes multiply to {product}, which does not "
                                    f"divide the {gpus} GPUs; choose sizes whose product "
                                    f"divides {gpus}")
    if fixed.get("sharding") is not None and fixed["sharding"] not in MODELLED_SHARDING:
        check_layout(model, Layout(sharding=fixed["sharding"]), global_batch_size)
    if fixed.get("schedule") is not None and fixed["schedule"] not in SCHEDULES:
        check_layout(model, Layout(schedule=fixed["schedule"]), global_batch_size)


# --- the decision flow ------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One question of the decision flow and what the planner answers."""

    question: str
    answer: str
    best: StepTime | None
    """The fastest layout that answers it (``None``: none fits)."""


def _best(model, where, gpus, batch, efficiency, fixed) -> StepTime | None:
    try:
        return plan(model, where, gpus, batch, efficiency=efficiency, fixed=fixed, top=1).layouts[0]
    except ConfigError:
        return None


def decision_flow(model: ModelConfig, where: Cluster, gpus: int, global_batch_size: int,
                  efficiency: float = MATMUL_EFFICIENCY) -> list[Decision]:
    """Does it fit, how fast, which knob first, each answered by the planner:

    1. plain data parallelism alone (TP = CP = PP = 1, nothing sharded), recomputation and
       micro-batch searched;
    2. else the least sharding of the model state over the data-parallel ranks that makes
       it fit without model parallelism: ZeRO-1 (``optim``), ZeRO-2, ZeRO-3 in turn (a MoE
       model's routed experts over expert-DP);
    3. else the smallest TP inside one node with which it fits without PP;
    4. else TP at the node's size and the smallest PP with which it fits;
    5. the fastest layout of all, and what it changes against the first that fit (the knob
       to turn first is the one it changes)."""
    flow, first = [], None
    alone = {"tp": 1, "cp": 1, "pp": 1}
    best = _best(model, where, gpus, global_batch_size, efficiency,
                 {**alone, "sharding": "no_shard"})
    flow.append(Decision("Does it fit with data parallelism alone?",
                         "yes" if best else "no: the weights, gradients, optimizer state and "
                         "activations of a whole model exceed one GPU", best))
    first = best
    if first is None:
        for sharding, name in (("optim", "ZeRO-1"), ("optim_grads", "ZeRO-2"),
                               ("optim_grads_params", "ZeRO-3")):
            best = _best(model, where, gpus, global_batch_size, efficiency,
                         {**alone, "sharding": sharding})
            if best:
                break
        flow.append(Decision("Does sharding the model state over the data-parallel ranks make "
                             "it fit, without model parallelism?",
                             f"yes, from {best.layout.sharding} ({name})" if best else
                             "no: even ZeRO-3 leaves the activations of a whole model on each "
                             "GPU", best))
        first = best
    if first is None:
        for tp in (t for t in TP_SIZES if t <= where.gpus_per_node and t > 1):
            best = _best(model, where, gpus, global_batch_size, efficiency,
                         {"tp": tp, "pp": 1, "cp": 1})
            if best:
                break
        flow.append(Decision("Does TP inside one node make it fit, without PP?",
                             f"yes, from TP {best.layout.tp}" if best else
                             "no: even TP at the node's size leaves too much on each GPU", best))
        first = best
    if first is None:
        tp = max(t for t in TP_SIZES if t <= where.gpus_per_node)
        for pp in range(2, model.num_layers + 1):
            unsplittable = model.num_layers % pp and not uneven_split(model.num_layers, pp)
            if gpus % (tp * pp) or unsplittable:
                continue
            best = _best(model, where, gpus, global_batch_size, efficiency, {"tp": tp, "pp": pp})
            if best:
                break
        flow.append(Decision(f"With TP {tp}, which PP makes it fit?",
                             f"PP {best.layout.pp}" if best else "none: it fits nowhere on "
                             f"{gpus} GPUs", best))
        first = best
    fastest = _best(model, where, gpus, global_batch_size, efficiency, {})
    if fastest is None or first is None:
        return flow
    changed = [name for name in ("tp", "cp", "pp", "ep", "schedule", "virtual_pipeline_size",
                                 "micro_batch_size", "recompute_granularity", "sharding")
               if getattr(fastest.layout, name) != getattr(first.layout, name)]
    gain = first.step_time_s / fastest.step_time_s - 1
    flow.append(Decision("Which knob first?",
                         (f"{', '.join(changed)}: {fastest.layout.describe()}, {gain:.0%} "
                          f"faster than the first layout that fit") if changed else
                         "none: the first layout that fit is the fastest", fastest))
    return flow


# --- the command line ------------------------------------------------------------------

_MODEL_FLAGS = [f.name for f in fields(ModelConfig)
                if f.name not in ("sequence_parallel", "dropout", "cp_comm_type", "name", "source")]

FLAG_DEFAULTS = {"num_shared_experts": 0, "first_k_dense_replace": 0}
"""A model from the flags alone takes Megatron's defaults where the course's small model
differs (:class:`~tutorial_lib.config.ModelConfig`: one shared expert, the first layer
dense): no shared expert (``--moe-shared-expert-intermediate-size`` unset) and every layer
MoE (``--moe-layer-freq 1``)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.plan",
        description="The layouts of a model on a cluster that fit, fastest first: predicted step "
                    "time and its parts, throughput, MFU, memory (tutorial_lib.costs.step_time).")
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default=None,
                        help="a published model (else the model flags below)")
    model = parser.add_argument_group("model (Megatron's flag names)")
    for name in _MODEL_FLAGS:
        flag = "--" + name.replace("_", "-")
        if name in ("swiglu", "multi_latent_attention"):
            model.add_argument(flag, action="store_true", default=None)
        elif name == "position_embedding_type":
            model.add_argument(flag, choices=["learned_absolute", "rope"], default=None)
        else:
            model.add_argument(flag, type=int, default=None)
    hw = parser.add_argument_group("cluster")
    hw.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(sorted(GPUS))}")
    hw.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    hw.add_argument("--gpus-per-node", type=int, default=None)
    hw.add_argument("--intra-node-bandwidth", type=float, default=None,
                    help="GB/s per GPU, one direction (default: the GPU's NVLink)")
    hw.add_argument("--inter-node-bandwidth", type=float, default=None,
                    help="GB/s per GPU, one direction (default: its network card)")
    parser.add_argument("--global-batch-size", type=int, required=True, help="sequences per step")
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                        help="the matmuls' peak (memory is counted in bf16)")
    parser.add_argument("--efficiency", type=float, default=MATMUL_EFFICIENCY,
                        help=f"matmul efficiency (default {MATMUL_EFFICIENCY}, fitted on a "
                             f"published run)")
    lay = parser.add_argument_group("layout: fix a choice, the planner searches the others")
    for short, long in (("tp", "tensor-model-parallel-size"), ("cp", "context-parallel-size"),
                        ("pp", "pipeline-model-parallel-size"), ("ep", "expert-model-parallel-size")):
        lay.add_argument(f"--{short}", f"--{long}", dest=short, type=int, default=None)
    lay.add_argument("--dp", type=int, default=None, help="data-parallel size")
    lay.add_argument("--virtual-pipeline-size", "--virtual-pipeline-model-parallel-size",
                     dest="virtual_pipeline_size", type=int, default=None)
    lay.add_argument("--schedule", default=None, help=f"one of {', '.join(SCHEDULES)}")
    lay.add_argument("--micro-batch-size", type=int, default=None)
    lay.add_argument("--recompute-granularity", choices=["full", "selective", "none"],
                     default=None)
    lay.add_argument("--decoder-first-pipeline-num-layers",
                     dest="num_layers_in_first_pipeline_stage", type=int, default=None,
                     help="layers on the first pipeline rank (Megatron's uneven split)")
    lay.add_argument("--decoder-last-pipeline-num-layers",
                     dest="num_layers_in_last_pipeline_stage", type=int, default=None,
                     help="layers on the last pipeline rank")
    lay.add_argument("--data-parallel-sharding-strategy", dest="sharding", default=None,
                     help=f"Megatron-FSDP's names: {', '.join(SHARDING_STRATEGIES)} (ZeRO 0 "
                          f"to 3; routed experts over expert-DP)")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to list")
    parser.add_argument("--decide", action="store_true",
                        help="walk the decision flow (does it fit, how fast, which knob first)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object; its 'layouts' list holds each layout's fields")
    return parser


def model_from_args(options) -> ModelConfig:
    """The preset with any model flag given over it, or a model from the flags alone."""
    given = {name: getattr(options, name) for name in _MODEL_FLAGS
             if getattr(options, name) is not None}
    if options.preset:
        base = MODEL_PRESETS[options.preset]
        return ModelConfig(**{**{f.name: getattr(base, f.name) for f in fields(ModelConfig)},
                            **given})
    needed = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"]
    missing = [n for n in needed if n not in given]
    if missing:
        raise ConfigError("model", f"no --preset and no {', '.join('--' + m.replace('_', '-') for m in missing)}; "
                                   f"give a --preset ({', '.join(sorted(MODEL_PRESETS))}) or "
                                   f"every shape flag")
    return ModelConfig(**{**FLAG_DEFAULTS, **given})


def _row(r: StepTime) -> str:
    l = r.layout
    v = f"V{l.virtual_pipeline_size}" if l.schedule == "interleaved" else ""
    return (f"{l.tp:>3} {l.cp:>3} {l.pp:>3} {l.ep:>3} {l.dp:>6} {l.schedule + v:>13} "
            f"{l.micro_batch_size:>3} {l.recompute_granularity or '-':>9} {l.sharding:>8} "
            f"{r.step_time_s:>9.3f} {r.compute_s:>8.3f} {r.tp_s:>7.3f} {r.cp_s:>7.3f} "
            f"{r.ep_s:>7.3f} {r.dp_s:>7.3f} {r.pp_s:>7.3f} {r.bubble_s:>7.3f} "
            f"{r.tokens_per_s:>11,.0f} {r.tflops_per_gpu:>6.0f} {r.mfu:>5.1%} "
            f"{r.hardware_tflops_per_gpu:>6.0f} {r.memory_gib:>7.1f}")


HEADER = (" TP  CP  PP  EP     DP      schedule mbs recompute sharding    step s  compute"
          "      TP      CP      EP      DP      PP  bubble    tokens/s  TF/s   MFU  HW TF"
          "  mem GiB")


def main(argv=None) -> int:
    options = _parser().parse_args(argv)
    try:
        model = model_from_args(options)
        check_model(model)
        where = cluster(options.gpu, options.gpus_per_node, options.intra_node_bandwidth,
                        options.inter_node_bandwidth)
        if options.top < 1:
            raise ConfigError("top", f"--top must be >= 1, got {options.top}")
        fixed = {name: getattr(options, name) for name in
                 ("tp", "cp", "pp", "ep", "dp", "virtual_pipeline_size", "schedule",
                  "micro_batch_size", "sharding", "num_layers_in_first_pipeline_stage",
                  "num_layers_in_last_pipeline_stage")}
        if options.recompute_granularity is not None:
            fixed["recompute_granularity"] = options.recompute_granularity
        if options.decide:
            for step in decision_flow(model, where, options.gpus, options.global_batch_size,
                                      options.efficiency):
                shown = f" ({step.best.step_time_s:.3f} s a step)" if step.best else ""
                print(f"{step.question} {step.answer}{shown}")
            return 0
        found = plan(model, where, options.gpus, options.global_batch_size,
                     efficiency=options.efficiency, precision=options.precision, fixed=fixed,
                     top=options.top)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if options.json:
        print(json.dumps({"model": model.name or "from flags", "parameters": parameter_count(model),
                          "gpu": where.gpu.name, "gpus": options.gpus,
                          "gpus_per_node": where.gpus_per_node,
                          "global_batch_size": options.global_batch_size,
                          "efficiency": options.efficiency, "candidates": found.candidates,
                          "memory_checked": found.memory_checked,
                          "layouts": [r.as_dict() for r in found.layouts]}))
        return 0
    print(f"{model.name or 'model from flags'} ({parameter_count(model) / 1e9:.1f}B parameters) "
          f"on {options.gpus} {where.gpu.name}, {where.gpus_per_node} per node; global batch "
          f"{options.global_batch_size} x {model.seq_length} tokens; matmul efficiency "
          f"{options.efficiency:.3f}")
    print(f"{found.candidates} valid layouts timed, {found.memory_checked} checked for memory "
          f"(fastest first); the {len(found.layouts)} fastest that fit, times in seconds:")
    print(HEADER)
    for r in found.layouts:
        print(_row(r))
    best = found.layouts[0]
    print(f"best: {best.layout.describe()}; heaviest rank {format_bytes(best.memory_bytes)} of "
          f"{format_bytes(where.gpu.memory_bytes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
