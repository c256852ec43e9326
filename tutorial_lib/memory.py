"""A rank's memory: the prediction per rank on the command line, and the measurement in a run.

The model itself is :mod:`tutorial_lib.costs.memory_model` (pure, no torch); this module is

* the command line ``python -m tutorial_lib.memory --world-size 2048 --tp 1 --pp 16 --ep 64
  --preset deepseek-v3 [--json]``: the breakdown per rank (with ``--json`` one object whose
  ``ranks`` list has one entry per rank of the world), for the course's model or a preset
  at published scale (:data:`PRESETS`);
* :func:`measure_state_bytes`: what a worker holds, read from its tensors (parameters,
  gradients, optimizer state), which :func:`tutorial_lib.train_4d.train_worker` logs per
  rank next to the activations the pipeline executor counts.

No torch at import: the measurement only reads tensors it is given.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace

from .config import (SHARDING_STRATEGIES, ConfigError, ModelConfig, ParallelConfig, TrainConfig,
                     check_pipeline_layers, check_sharding_flags, default_pipeline_split,
                     layers_per_pipeline_stage, validate)
from .costs.memory_model import (PRECISION_BYTES, RUNTIME_BYTES_PER_RANK, RankMemory,
                           format_bytes, memory_of_ranks, memory_per_rank)
from .costs.model_flops import MODEL_PRESETS
from .pipeline_parallel.actions import (ALL_SCHEDULES, SCHEDULE_PLACEMENT,
                                        SPLIT_BACKWARD_SCHEDULES, num_model_stages)
from .recompute import RECOMPUTE_METHODS, Recompute, check_recompute

__all__ = ["Preset", "PRESETS", "predict", "preset_stage_layers", "preset_layout",
           "preset_ranks", "heaviest_rank_bytes", "measure_state_bytes", "main"]


@dataclass(frozen=True)
class Preset:
    """A model and its batch at published scale, with the precision it trains in."""

    name: str
    model: ModelConfig
    global_batch_size: int
    num_microbatches: int
    precision: str = "bf16"
    note: str = ""
    layout: dict = field(default_factory=dict)
    """A layout it was trained on (the command line's defaults for this preset)."""


def _run_of(name: str) -> ModelConfig:
    """A published model of :data:`~tutorial_lib.costs.model_flops.MODEL_PRESETS` as its
    run trains it: sequence parallelism on, as Megatron-Core's MoE layers ask under TP
    (nothing to split at TP 1)."""
    return replace(MODEL_PRESETS[name], sequence_parallel=True)


PRESETS = {
    "deepseek-v3": Preset(
        "deepseek-v3", _run_of("deepseek-v3"),
        # the report's batch: 15,360 sequences of 4,096; DP 128, one sequence a microbatch
        global_batch_size=15360, num_microbatches=120,
        note="DeepSeek-V3 (arXiv 2412.19437: 2048 H800, PP 16, EP 64, ZeRO-1, no TP; "
             "61 layers on the ranks as 2, 14 x 4, 3; its MTP module not counted)",
        layout={"world_size": 2048, "tp": 1, "pp": 16, "ep": 64, "cp": 1}),
    "llama-3.1-405b": Preset(
        "llama-3.1-405b", _run_of("llama-3.1-405b"),
        # the report's Table 4 at 16,384 GPUs: 16 sequences of 8,192 per DP replica
        global_batch_size=2048, num_microbatches=16,
        note="Llama 3.1 405B (arXiv 2407.21783: 16384 H100, TP 8, PP 16, DP 128; "
             "126 layers on the ranks as 7, 14 x 8, 7)",
        layout={"world_size": 16384, "tp": 8, "pp": 16, "ep": 1, "cp": 1}),
}
"""The command line's ``--preset`` choices: the published models of
:data:`tutorial_lib.costs.model_flops.MODEL_PRESETS` (the one table of shapes, the
planner's ``--preset`` too, under the same names) with the batch and the layout they were
trained on, in bf16.  Their layer counts do not divide by 16 pipeline ranks: the first and
the last rank hold fewer layers (:func:`tutorial_lib.config.default_pipeline_split`,
Megatron's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``).
Llama 3's report (section 3.3.2) took one layer off the first and the last stage: 7, 14 x 8,
7 per rank.  DeepSeek-V3's report gives PP 16 but not how its 61 layers split; the presets
take the most even split Megatron accepts, 2, 14 x 4, 3.

What the memory model still leaves out: DeepSeek-V3's multi-token-prediction module (one
more MoE layer and a projection beside the last stage, about 14B parameters, outside the
report's 671B), its FP8 matmuls (``--fp8`` counts the saved inputs in FP8) and its
recomputation of RMSNorms and MLA up-projections (the course recomputes core attention or
whole layers); both trained with other schedules (DualPipe; Meta's interleaved 1F1B)
than the command line's default 1F1B, which ``--schedule`` changes where the stages are
equal."""


def predict(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, *,
            schedule: str = "1f1b", virtual_pipeline_size: int = 1,
            num_layers_in_first_pipeline_stage: int | None = None,
            num_layers_in_last_pipeline_stage: int | None = None,
            **options) -> list[RankMemory]:
    """Validate the config (:func:`tutorial_lib.config.validate`; the fields only the cost
    models read accepted, as this only counts), then
    :func:`tutorial_lib.costs.memory_per_rank` with ``options`` (precision, distributed
    optimizer, recompute, ...); chapter 11's schedules with their own chunks (two per rank
    for ZBV, DualPipeV, DualPipe, on equal stages), as ``train_4d`` accepts them.
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``:
    Megatron's uneven first and last pipeline ranks (1F1B, GPipe, interleaved)."""
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    validate(parallel, model, train, cost_model=True, num_layers_in_first_pipeline_stage=first,
             num_layers_in_last_pipeline_stage=last)
    pp = parallel.pipeline_model_parallel_size
    placement = SCHEDULE_PLACEMENT.get(schedule, "loop")
    chunks = 2 if placement != "loop" else virtual_pipeline_size
    uneven = first is not None or last is not None
    if uneven and placement != "loop":
        raise ConfigError("uneven pipeline", f"{schedule} places equal stages itself; "
                                             f"--decoder-first/last-pipeline-num-layers are for "
                                             f"1f1b, gpipe and interleaved; leave them out")
    stage_layers = None
    if schedule in ALL_SCHEDULES and uneven:  # else memory_per_rank names the schedules
        stage_layers = layers_per_pipeline_stage(model.num_layers, pp, chunks, first, last)
    elif schedule in ALL_SCHEDULES:
        check_pipeline_layers(model.num_layers, pp, num_model_stages(placement, pp, chunks) // pp)
    recompute = options.get("recompute")
    if schedule in SPLIT_BACKWARD_SCHEDULES and recompute is not None and recompute.granularity:
        raise ConfigError("recompute", f"activation recomputation does not run with {schedule}, "
                          f"whose backward is split into B and W (train_4d refuses it too); "
                          f"use --schedule 1f1b, interleaved or gpipe, or no recomputation")
    return memory_per_rank(model, parallel, train, schedule, virtual_pipeline_size,
                           stage_layers=stage_layers, **options)


def preset_stage_layers(preset: Preset | str, pp: int, virtual_pipeline_size: int = 1) -> list:
    """Layers of each model stage of the preset's model on ``pp`` pipeline ranks: equal
    where ``PP x V`` divides them, else the first and last ranks' of
    :func:`tutorial_lib.config.default_pipeline_split` (the planner's); a
    :class:`ConfigError` (rule 9) where no split exists."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    layers = preset.model.num_layers
    first, last = default_pipeline_split(layers, pp, virtual_pipeline_size)
    return layers_per_pipeline_stage(layers, pp, virtual_pipeline_size, first, last)


def preset_layout(preset: Preset | str, tp: int, pp: int, ep: int = 1) -> tuple:
    """``(parallel, train)``: the preset's world with TP, PP and EP (DP what the world leaves),
    microbatches of one sequence (``M = global batch / DP``); a :class:`ConfigError` where the
    batch does not split or a rule refuses the grid (the layers split as
    :func:`preset_stage_layers` says)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    world = preset.layout["world_size"]
    parallel = ParallelConfig(world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    dp = world // (tp * pp) if world % (tp * pp) == 0 else 0
    if not dp or preset.global_batch_size % dp:
        raise ConfigError("batch", f"the global batch ({preset.global_batch_size} sequences) does "
                                   f"not split over DP = {world} / (TP {tp} x PP {pp}); take more "
                                   f"TP or PP ranks")
    train = TrainConfig(preset.global_batch_size, preset.global_batch_size // dp)
    first, last = default_pipeline_split(preset.model.num_layers, pp)
    validate(parallel, preset.model, train, cost_model=True,
             num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    return parallel, train


def preset_ranks(preset: Preset | str, tp: int, pp: int, ep: int = 1, **options) -> list:
    """The prediction for each pipeline rank of the preset on that layout
    (:func:`preset_layout`, its layers split as :func:`preset_stage_layers` says), in the
    preset's precision, GPU ranks (no process runtime); ``options`` as
    :func:`tutorial_lib.costs.memory_per_rank` takes them (``use_distributed_optimizer``,
    ``recompute``, ...)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    parallel, train = preset_layout(preset, tp, pp, ep)
    options.setdefault("precision", preset.precision)
    return memory_per_rank(preset.model, parallel, train, runtime=0,
                           stage_layers=preset_stage_layers(preset, pp), **options)


def heaviest_rank_bytes(preset: Preset | str, tp: int, pp: int, ep: int = 1, **options) -> int:
    """Bytes of the preset's heaviest rank on that layout: the most of
    :func:`preset_ranks`."""
    return max(r.total for r in preset_ranks(preset, tp, pp, ep, **options))


# --- measured in a worker --------------------------------------------------------------


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure_state_bytes(module, optimizer) -> dict[str, int]:
    """``{"weights", "gradients", "optimizer"}``: bytes this rank's tensors hold now.

    ``module``: the model (chunks in a ``ModuleList``); ``optimizer``: ``torch.optim.Adam``,
    :class:`~tutorial_lib.data_parallel.DistributedOptimizer` or
    :class:`~tutorial_lib.data_parallel.Float16OptimizerWithFloat16Params`.  Each storage
    counted once: gradients are every parameter's ``.grad`` and ``main_grad`` (a
    ``DataParallel`` bucket's views count as the bucket) and a distributed optimizer's
    slice gradients; the optimizer is the fp32 master copies and each state tensor
    (Adam's moments; the scalar ``step`` left out).  Call it after the optimizer step.
    """
    params = [p for p in module.parameters()]
    grads = [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
    masters = []
    inner = optimizer
    if hasattr(optimizer, "buffers"):  # ZeRO-1: each buffer's fp32 slice and its gradient
        masters = [b.main_param for b in optimizer.buffers]
        grads += [b.main_param.grad for b in optimizer.buffers]
        inner = optimizer.optimizer
    elif hasattr(optimizer, "main_params"):  # bf16 weights, fp32 masters
        masters, inner = list(optimizer.main_params), optimizer.optimizer
    state = [value for per_param in inner.state.values() for key, value in per_param.items()
             if key != "step" and hasattr(value, "untyped_storage")]
    return {"weights": _unique_bytes(params), "gradients": _unique_bytes(grads),
            "optimizer": _unique_bytes(masters + state)}


# --- the command line ------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.memory",
        description="Predicted memory per rank of a training run (tutorial_lib.costs.memory_model): "
                    "weights, gradients, optimizer state and activations at the schedule's peak.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a published-scale model and batch (default: the course's "
                             "train_4d model and batch, in fp32)")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--tp", type=int, default=None, help="tensor_model_parallel_size")
    parser.add_argument("--pp", type=int, default=None, help="pipeline_model_parallel_size")
    parser.add_argument("--ep", type=int, default=None, help="expert_model_parallel_size")
    parser.add_argument("--cp", type=int, default=None, help="context_parallel_size")
    parser.add_argument("--schedule", choices=ALL_SCHEDULES, default="1f1b",
                        help="zbv, dualpipev and dualpipe place two chunks per rank themselves")
    parser.add_argument("--virtual-pipeline-size", type=int, default=1,
                        help="chunks per rank (the interleaved schedule's V)")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        dest="num_layers_in_first_pipeline_stage",
                        help="layers on the first pipeline rank (Megatron's uneven split; "
                             "a preset whose layers PP does not divide takes the planner's)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        dest="num_layers_in_last_pipeline_stage",
                        help="layers on the last pipeline rank")
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--num-microbatches", type=int, default=None)
    parser.add_argument("--precision", choices=sorted(PRECISION_BYTES), default=None,
                        help="fp32 (the course's runs) or bf16 (mixed precision; presets' default)")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="ZeRO-1: master weights and Adam's moments sharded over DP")
    parser.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES,
                        default=None,
                        help="Megatron-FSDP's: no_shard (plain DP), optim (ZeRO-1, the same as "
                             "--use-distributed-optimizer), optim_grads (ZeRO-2), "
                             "optim_grads_params (ZeRO-3 / FSDP; routed experts over expert-DP)")
    parser.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                        help="HSDP: shard over DP x CP / this many ranks, replicate over the "
                             "instances")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    parser.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None)
    parser.add_argument("--recompute-num-layers", type=int, default=None)
    parser.add_argument("--fp8", action="store_true", help="matmul inputs saved in FP8")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object; its 'ranks' list has one entry per rank")
    return parser


def configs_from_args(options) -> tuple:
    """``(model, parallel, train, precision)`` from the command line's options."""
    preset = PRESETS.get(options.preset)
    if preset is not None:
        model, layout = preset.model, preset.layout
        batch, micro, precision = preset.global_batch_size, preset.num_microbatches, preset.precision
    else:
        from .arguments import TrainingArgs  # the course's defaults (no torch)
        defaults = TrainingArgs()
        _, model, train = defaults.configs()
        layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
        batch, micro, precision = train.global_batch_size, train.num_microbatches, "fp32"

    def pick(name):
        value = getattr(options, name)
        return layout[name] if value is None else value
    parallel = ParallelConfig(pick("world_size"), tensor_model_parallel_size=pick("tp"),
                              pipeline_model_parallel_size=pick("pp"),
                              expert_model_parallel_size=pick("ep"),
                              context_parallel_size=pick("cp"))
    for flag, value in (("--global-batch-size", options.global_batch_size),
                        ("--num-microbatches", options.num_microbatches),
                        ("--world-size", options.world_size), ("--tp", options.tp),
                        ("--pp", options.pp), ("--ep", options.ep), ("--cp", options.cp),
                        ("--virtual-pipeline-size", options.virtual_pipeline_size)):
        if value is not None and value < 1:  # 0 must not fall back to the default silently
            raise ConfigError("malformed", f"{flag} must be a whole number >= 1, got {value}; "
                                           f"leave it out for the default, or e.g. {flag} 4")
    train = TrainConfig(batch if options.global_batch_size is None else options.global_batch_size,
                        micro if options.num_microbatches is None else options.num_microbatches)
    return model, parallel, train, options.precision or precision


def _pipeline_split(options, model, parallel) -> tuple:
    """``(first, last)``: the first and last pipeline ranks' layers, as given, else for a
    preset on a 1F1B, GPipe or interleaved pipeline that does not divide its layers
    :func:`tutorial_lib.config.default_pipeline_split`'s (the planner's); the course's model
    keeps rule 9's equal stages, as ``train_4d`` runs them."""
    first = options.num_layers_in_first_pipeline_stage
    last = options.num_layers_in_last_pipeline_stage
    if first is not None or last is not None or not options.preset \
            or SCHEDULE_PLACEMENT.get(options.schedule, "loop") != "loop":
        return first, last
    return default_pipeline_split(model.num_layers, parallel.pipeline_model_parallel_size,
                                  options.virtual_pipeline_size)


def main(argv=None) -> int:
    options = _parser().parse_args(argv)
    try:
        model, parallel, train, precision = configs_from_args(options)
        recompute = Recompute(options.recompute_granularity, options.recompute_method,
                              options.recompute_num_layers)
        check_recompute(recompute, model.num_layers, parallel.pipeline_model_parallel_size)
        strategy = options.data_parallel_sharding_strategy
        check_sharding_flags(options.use_distributed_optimizer, strategy)
        first, last = _pipeline_split(options, model, parallel)
        ranks = predict(model, parallel, train, schedule=options.schedule,
                        virtual_pipeline_size=options.virtual_pipeline_size, precision=precision,
                        num_layers_in_first_pipeline_stage=first,
                        num_layers_in_last_pipeline_stage=last,
                        use_distributed_optimizer=options.use_distributed_optimizer,
                        data_parallel_sharding_strategy=strategy,
                        num_distributed_optimizer_instances=(
                            options.num_distributed_optimizer_instances),
                        recompute=recompute, fp8=options.fp8,
                        runtime=0 if options.preset else RUNTIME_BYTES_PER_RANK)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    every = memory_of_ranks(ranks, parallel)
    if options.json:
        print(json.dumps({
            "preset": options.preset, "precision": precision,
            "world_size": parallel.world_size,
            "layout": {"tp": parallel.tensor_model_parallel_size,
                       "pp": parallel.pipeline_model_parallel_size,
                       "ep": parallel.expert_model_parallel_size,
                       "cp": parallel.context_parallel_size,
                       "dp": parallel.data_parallel_size,
                       "num_layers_in_first_pipeline_stage": first,
                       "num_layers_in_last_pipeline_stage": last},
            "pipeline_ranks": [r.as_dict() for r in ranks],
            "ranks": [{"rank": rank, "coords": coords, **r.as_dict()} for rank, coords, r in every]}))
        return 0
    name = PRESETS[options.preset].note if options.preset else "the course's train_4d model"
    print(f"{name}; {precision}; world {parallel.world_size} = TP "
          f"{parallel.tensor_model_parallel_size} x CP {parallel.context_parallel_size} x PP "
          f"{parallel.pipeline_model_parallel_size} x DP {parallel.data_parallel_size} "
          f"(EP {parallel.expert_model_parallel_size})"
          + (f"; layers on the first / last pipeline rank {first or '-'} / {last or '-'}"
             if first is not None or last is not None else ""))
    for r in ranks:
        print(r.describe())
    shown = every if len(every) <= 16 else every[:8] + every[-8:]
    for rank, coords, r in shown:
        where = " ".join(f"{k}{v}" for k, v in coords.items())
        print(f"rank {rank:>6} ({where}): {format_bytes(r.total)}")
    if len(shown) < len(every):
        print(f"... {len(every) - len(shown)} ranks more (--json lists every rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
