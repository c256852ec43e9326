"""One training step of a layout on a cluster, predicted: time by part, and memory (chapter 13).

The planner (:mod:`tutorial_lib.plan`) ranks layouts with :func:`predict_step`.  A step
is the pipeline schedule played with each chunk-microbatch's forward and backward costs,
each cost the sum of

* **compute**: the chunk's FLOPs (:mod:`~tutorial_lib.costs.model_flops`: dense and MoE
  layers, attention with the sequence length; on the rank that also runs the LM head, the
  heaviest, its chunks' average) over ``peak x efficiency``, one matmul-efficiency figure for the GPU
  (fitted on a published run, :mod:`~tutorial_lib.costs.published_runs`), split over TP and
  CP; a backward is two forwards, plus the recomputed forward (``full``) or core attention
  (``selective``);
* **exposed communication** on the critical path of every microbatch: TP's all-reduces
  (two per layer each way, two more under full recomputation; reduce-scatter plus
  all-gather under sequence parallelism move the same bytes), CP's K/V ring beyond what the
  layer's core attention hides, EP's dispatch and combine all-to-alls (exposed, except
  under DualPipeV, where the other microbatch's compute hides them), PP's send of the
  boundary activation (and its gradient back).

Each collective costs what :func:`~tutorial_lib.costs.alpha_beta.predict_time` says on the
link its group crosses: NVLink inside a node, the network (per GPU) as soon as the group
leaves it, read from where Megatron's grid (:func:`tutorial_lib.grid.megatron_grids`) puts
the group.  The **bubble** is the schedule's idle time with those costs: the course's
simulator (:func:`~tutorial_lib.pipeline_parallel.simulator.simulate`) for small schedules,
its closed form (:func:`~tutorial_lib.pipeline_parallel.formulas.expected_bubble_time`,
equal to the simulation for equal stages, see the tests) for large ones.  **Data-parallel**
gradient reduction runs under the last microbatch's backward but its last bucket (and, for
the distributed optimizer, the parameter all-gather under the next forward but its first
bucket).  **Memory** is :func:`~tutorial_lib.costs.memory_model.memory_per_rank` at
bf16 with the layout's schedule and recomputation: the heaviest rank, and whether it fits
in :data:`USABLE_MEMORY_FRACTION` of the GPU.

Sharding strategies by Megatron-FSDP's names (chapter 12, :mod:`~tutorial_lib.costs.zero_stages`):
``no_shard`` (plain data parallelism) and ``optim`` (the distributed optimizer, ZeRO-1) as
above; ``optim_grads`` (ZeRO-2) reduce-scatters each layer's gradients after every
microbatch's backward, under that backward but the last layer's, and all-gathers the
updated parameters under the next forward as ZeRO-1 does; ``optim_grads_params``
(ZeRO-3) also all-gathers each layer's parameters before its forward and again before its
backward, every microbatch, prefetched under the compute before them but the first
unit's of each pass (:func:`sharded_exposure`; one unit per decoder layer and a root unit
for the rest, as :mod:`tutorial_lib.fully_sharded_data_parallel` wraps them).  A MoE
layer is two units, as ``train_4d`` runs it: its dense part sharded over ``dp`` (``dp_cp``
under CP) and its routed experts over ``expert_dp``, each unit's collectives on the link
its own group crosses; a layer's two gathers (prefetched together) and two
reduce-scatters go back to back.  Their memory is the memory model's (ZeRO-3: the
gathered units at their peak, a MoE layer's two together).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from ..config import (ZERO_STAGE, ConfigError, ModelConfig, ParallelConfig,
                      TrainConfig, layers_per_pipeline_stage, uneven_split)
from ..grid import megatron_grids
from ..pipeline_parallel import build_schedules
from ..pipeline_parallel.actions import SCHEDULE_PLACEMENT, model_stage
from ..pipeline_parallel.formulas import expected_bubble_time, expected_peak_activations
from ..pipeline_parallel.simulator import idle_time, makespan, simulate
from ..recompute import Recompute
from .alpha_beta import predict_time
from .hardware import Cluster
from .memory_model import (attention_widths, expert_parameters, layer_parameters,
                           memory_per_rank, stage_activation_bytes, unit_slice_numel)
from .model_flops import hardware_flops_per_step, layer_flops, model_flops_per_step

__all__ = ["Layout", "StepTime", "SHARDING_STRATEGIES", "MODELLED_SHARDING", "SCHEDULES",
           "uneven_split", "stage_layers", "rank_layers", "rank_parameter_counts",
           "state_bytes_floor", "rank_chunk_layers", "sharded_exposure",
           "USABLE_MEMORY_FRACTION", "DDP_BUCKET_PARAMETERS", "group_crosses_nodes",
           "chunk_costs", "schedule_times", "predict_step", "with_memory", "layout_memory",
           "rank_parameters", "memory_lower_bound", "check_layout"]

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's ``--data-parallel-sharding-strategy`` names."""

MODELLED_SHARDING = SHARDING_STRATEGIES
"""What this model predicts: every strategy, for dense and MoE models."""

SCHEDULES = ("1f1b", "interleaved", "dualpipev")
"""The schedules the planner weighs (GPipe holds more and runs no faster than 1F1B)."""

USABLE_MEMORY_FRACTION = 0.9
"""Of the GPU's memory, what the model's tensors may take: the rest is the CUDA context,
NCCL's buffers and the allocator's fragmentation, which the memory model does not count
(an assumption of the course, not a measured figure)."""

DDP_BUCKET_PARAMETERS = 40_000_000
"""Parameters per gradient bucket: Megatron-Core's default ``ddp_bucket_size``,
``max(40,000,000, 1,000,000 x DP)`` (``megatron/core/distributed/distributed_data_parallel.py``)."""

BYTES = 2
"""bf16: activations and parameters on the wire."""

GRADIENT_BYTES = 4
"""fp32: gradients reduced as the memory model keeps them (``main_grad``)."""

SIMULATED_ACTIONS = 2048
"""Above this many compute actions per step (PP x M x V x 2), the bubble comes from the
closed form rather than the simulator (the same number for equal stages)."""


@dataclass(frozen=True)
class Layout:
    """Every choice of one layout, by Megatron's flag names."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    virtual_pipeline_size: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    recompute_granularity: str | None = None
    sharding: str = "no_shard"
    """Megatron-FSDP's ``--data-parallel-sharding-strategy``."""
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    """Megatron's uneven first and last pipeline ranks (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``); ``None``: equal stages."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP: replicas of each routed-expert shard, ``world / (ETP x EP x PP)`` with ETP =
        TP, as :attr:`tutorial_lib.config.ParallelConfig.expert_data_parallel_size`."""
        return self.world_size // (self.tp * self.ep * self.pp)

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    def describe(self) -> str:
        v = f" V {self.virtual_pipeline_size}" if self.schedule == "interleaved" else ""
        return (f"TP {self.tp} CP {self.cp} PP {self.pp} EP {self.ep} DP {self.dp}, "
                f"{self.schedule}{v}, micro-batch {self.micro_batch_size}, recompute "
                f"{self.recompute_granularity or 'none'}, {self.sharding}{self._uneven()}")

    def _uneven(self) -> str:
        first = self.num_layers_in_first_pipeline_stage
        last = self.num_layers_in_last_pipeline_stage
        if first is None and last is None:
            return ""
        return f", layers on the first / last rank {first or '-'} / {last or '-'}"


@dataclass(frozen=True)
class StepTime:
    """The prediction for one layout (seconds, FLOP/s per GPU, bytes)."""

    layout: Layout
    step_time_s: float
    compute_s: float
    """The heaviest rank's compute, recomputation included."""
    tp_s: float
    cp_s: float
    ep_s: float
    dp_s: float
    pp_s: float
    """Exposed communication of each kind on the critical path."""
    bubble_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    """The model's FLOPs (no recomputation) per second per GPU, in 10^12."""
    mfu: float
    hardware_tflops_per_gpu: float
    """What the GPUs computed, recomputation included (the Megatron papers' figure)."""
    memory_bytes: int
    fits: bool | None
    crosses_nodes: dict = field(default_factory=dict)
    """Per group kind: whether its ring leaves a node."""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def as_dict(self) -> dict:
        """The fields ``python -m tutorial_lib.plan --json`` prints for one layout."""
        l = self.layout
        return {"tp": l.tp, "cp": l.cp, "pp": l.pp, "ep": l.ep, "dp": l.dp,
                "virtual_pipeline_size": l.virtual_pipeline_size, "schedule": l.schedule,
                "micro_batch_size": l.micro_batch_size,
                "recompute_granularity": l.recompute_granularity, "sharding": l.sharding,
                "num_layers_in_first_pipeline_stage": l.num_layers_in_first_pipeline_stage,
                "num_layers_in_last_pipeline_stage": l.num_layers_in_last_pipeline_stage,
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "tp_comm_s": self.tp_s, "cp_comm_s": self.cp_s, "ep_comm_s": self.ep_s,
                "dp_comm_s": self.dp_s, "pp_comm_s": self.pp_s, "bubble_s": self.bubble_s,
                "tokens_per_s": self.tokens_per_s, "tflops_per_gpu": self.tflops_per_gpu,
                "mfu": self.mfu, "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
                "memory_gib": self.memory_gib, "fits": self.fits,
                "crosses_nodes": dict(self.crosses_nodes)}


def check_layout(model: ModelConfig, layout: Layout, global_batch_size: int,
                 world_size: int | None = None) -> None:
    """Every rule a layout must keep, as :class:`ConfigError` naming it, its numbers and a fix."""
    l = layout
    for name in ("tp", "cp", "pp", "ep", "dp", "virtual_pipeline_size", "micro_batch_size"):
        value = getattr(l, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("layout", f"--{name.replace('_', '-')} must be a whole number >= 1, "
                                        f"got {value!r}")
    if world_size is not None and l.world_size != world_size:
        raise ConfigError("layout", f"TP {l.tp} x CP {l.cp} x PP {l.pp} x DP {l.dp} = "
                                    f"{l.world_size}, not the {world_size} GPUs; change a size "
                                    f"or leave one out for the planner to fill")
    groups = getattr(model, "num_query_groups", None) or model.num_attention_heads
    if model.num_attention_heads % l.tp or (not model.multi_latent_attention and groups % l.tp):
        raise ConfigError("rule tp", f"TP ({l.tp}) must divide the attention heads "
                                     f"({model.num_attention_heads}) and key/value groups "
                                     f"({groups}); take a divisor of {groups}")
    if model.seq_length % (2 * l.cp):
        raise ConfigError("rule cp", f"the sequence ({model.seq_length}) must split into "
                                     f"2 x CP = {2 * l.cp} chunks (the load-balanced split); "
                                     f"take a CP that divides {model.seq_length // 2}")
    if l.schedule not in SCHEDULES:
        raise ConfigError("schedule", f"--schedule {l.schedule!r}: the planner weighs "
                                      f"{', '.join(SCHEDULES)}")
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    if l.schedule != "interleaved" and l.virtual_pipeline_size != 1:
        raise ConfigError("schedule", f"--virtual-pipeline-size {l.virtual_pipeline_size} needs "
                                      f"--schedule interleaved ({l.schedule} places its own "
                                      f"chunks)")
    if l.schedule == "interleaved" and (l.pp < 2 or l.virtual_pipeline_size < 2):
        raise ConfigError("schedule", f"the interleaved schedule needs PP >= 2 and "
                                      f"--virtual-pipeline-size >= 2, got PP {l.pp}, V "
                                      f"{l.virtual_pipeline_size}; use --schedule 1f1b")
    if l.schedule == "dualpipev" and (l.pp < 2 or l.recompute_granularity):
        raise ConfigError("schedule", "DualPipeV needs PP >= 2 and no recomputation (its "
                                      "backward is split into B and W); use 1f1b or interleaved")
    uneven = (l.num_layers_in_first_pipeline_stage is not None
              or l.num_layers_in_last_pipeline_stage is not None)
    if l.schedule == "dualpipev" and uneven:
        raise ConfigError("uneven pipeline", "DualPipeV folds 2 PP equal stages in a V; "
                                             "--decoder-first/last-pipeline-num-layers are for "
                                             "1f1b and interleaved; leave them out")
    if l.schedule == "dualpipev" and model.num_layers % (2 * l.pp):
        raise ConfigError("rule 9", f"--num-layers ({model.num_layers}) must divide into 2 x PP "
                                    f"= {2 * l.pp} equal stages for DualPipeV; take a PP "
                                    f"with 2 x PP dividing {model.num_layers}, or 1f1b with "
                                    f"uneven first and last stages")
    if l.schedule != "dualpipev" and not uneven and model.num_layers % (l.pp * chunks):
        split = uneven_split(model.num_layers, l.pp, chunks)
        hint = (f", or Megatron's uneven first and last stages: "
                f"--decoder-first-pipeline-num-layers {split[0]} "
                f"--decoder-last-pipeline-num-layers {split[1]}") if split else ""
        raise ConfigError("rule 9", f"--num-layers ({model.num_layers}) must divide into PP x "
                                    f"chunks = {l.pp} x {chunks} stages of equal layers; take a "
                                    f"PP that divides {model.num_layers}{hint}")
    if l.schedule != "dualpipev":
        layers_per_pipeline_stage(model.num_layers, l.pp, chunks,
                                  l.num_layers_in_first_pipeline_stage,
                                  l.num_layers_in_last_pipeline_stage)
    if global_batch_size % (l.dp * l.micro_batch_size):
        raise ConfigError("batch", f"--global-batch-size ({global_batch_size}) must divide by "
                                   f"DP x micro-batch = {l.dp} x {l.micro_batch_size}")
    m = l.num_microbatches(global_batch_size)
    if l.schedule == "interleaved" and m % l.pp:
        raise ConfigError("schedule", f"the interleaved schedule needs the microbatches ({m}) "
                                      f"to be a multiple of PP ({l.pp}), as Megatron-Core asks")
    if l.schedule == "dualpipev" and m < 2 * l.pp:
        raise ConfigError("schedule", f"DualPipeV needs M >= 2 PP, got M {m}, PP {l.pp}")
    if model.num_experts:
        if model.num_experts % l.ep:
            raise ConfigError("rule ep", f"EP ({l.ep}) must divide the experts "
                                         f"({model.num_experts})")
        if (l.dp * l.cp * l.tp) % (l.ep * l.tp):
            raise ConfigError("rule ep", f"EP x ETP = {l.ep} x {l.tp} must divide DP x CP x TP "
                                         f"= {l.dp * l.cp * l.tp} (Megatron's expert grid "
                                         f"folds onto the dense one)")
    elif l.ep != 1:
        raise ConfigError("rule ep", f"EP ({l.ep}) needs experts (--num-experts); use --ep 1")
    if l.sharding not in SHARDING_STRATEGIES:
        raise ConfigError("sharding", f"--data-parallel-sharding-strategy {l.sharding!r}: one of "
                                      f"{', '.join(SHARDING_STRATEGIES)}")


def _parallel_config(layout: Layout) -> ParallelConfig:
    return ParallelConfig(layout.world_size, tensor_model_parallel_size=layout.tp,
                          pipeline_model_parallel_size=layout.pp,
                          expert_model_parallel_size=layout.ep, context_parallel_size=layout.cp)


def group_crosses_nodes(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """For ``tp``, ``cp``, ``dp_cp``, ``pp``, ``ep`` and ``edp``: whether the group's ring
    leaves a node, in Megatron's grid (``tp-cp-ep-dp-pp``).  Group ``g`` of a dimension
    of stride ``t`` and size ``n`` spans aligned blocks of ``t n`` ranks; every such block
    lies in one node iff ``t n`` divides the node's GPUs."""
    l = layout
    return dict(_crossings(l.tp, l.cp, l.pp, l.ep, l.dp, gpus_per_node))


@functools.lru_cache(maxsize=4096)
def _crossings(tp: int, cp: int, pp: int, ep: int, dp: int, gpus_per_node: int) -> tuple:
    dense, expert = megatron_grids(_parallel_config(Layout(tp, cp, pp, ep, dp)))

    def crosses(grid, *dims) -> bool:
        sizes = [grid.size(d) for d in dims]
        if all(s == 1 for s in sizes):
            return False
        span = max(grid.stride(d) * grid.size(d) for d in dims)
        return span > gpus_per_node or gpus_per_node % span != 0

    return (("tp", crosses(dense, "tp")), ("cp", crosses(dense, "cp")),
            ("dp_cp", crosses(dense, "dp", "cp")), ("pp", crosses(dense, "pp")),
            ("ep", crosses(expert, "ep")), ("edp", crosses(expert, "edp")))


def _flop_rate(cluster: Cluster, efficiency: float, precision: str) -> float:
    if not 0 < efficiency <= 1:
        raise ConfigError("efficiency", f"the matmul efficiency must be in (0, 1], got "
                                        f"{efficiency!r}")
    return cluster.gpu.peak_flops(precision) * efficiency


@dataclass(frozen=True)
class ChunkCosts:
    """Seconds of one chunk-microbatch on the heaviest rank, by part."""

    forward_compute: float
    backward_compute: float
    """Including the recomputed forward."""
    tp: float
    cp: float
    ep: float
    ep_hidden: float
    """EP time the schedule hides (DualPipeV's overlapped pairs)."""
    pp: float
    layers: float = 0.0
    """The rank's decoder layers per chunk (its chunks' average)."""
    moe_layers: float = 0.0
    """Of those, MoE layers."""
    dp_forward: float = 0.0
    dp_backward: float = 0.0
    """Sharded data parallelism's exposed time in the chunk's forward and backward (ZeRO-3's
    gathers, ZeRO-2 and ZeRO-3's reduce-scatters: :func:`sharded_exposure`)."""

    @property
    def forward(self) -> float:
        return (self.forward_compute + (self.tp + self.cp + self.ep + self.pp) / 3
                + self.dp_forward)

    @property
    def backward(self) -> float:
        return (self.backward_compute + 2 * (self.tp + self.cp + self.ep + self.pp) / 3
                + self.dp_backward)


def stage_layers(model: ModelConfig, layout: Layout) -> list[int]:
    """Layers of each model stage, in model order: equal stages (rule 9), or Megatron's
    uneven first and last pipeline ranks (:func:`tutorial_lib.config.layers_per_pipeline_stage`);
    DualPipeV's ``2 PP`` stages equal."""
    l = layout
    if l.schedule == "dualpipev":
        return [model.num_layers // (2 * l.pp)] * (2 * l.pp)
    return layers_per_pipeline_stage(model.num_layers, l.pp, l.virtual_pipeline_size,
                                     l.num_layers_in_first_pipeline_stage,
                                     l.num_layers_in_last_pipeline_stage)


def _placement(layout: Layout) -> tuple:
    """The choices that decide which layers each pipeline rank holds: PP, the schedule, V
    and the uneven split.  The per-rank counts below are kept under this key, as the
    planner asks them of thousands of layouts that differ only in the other choices."""
    l = layout
    return (l.pp, l.schedule, l.virtual_pipeline_size, l.num_layers_in_first_pipeline_stage,
            l.num_layers_in_last_pipeline_stage)


def _placed(placement: tuple) -> Layout:
    pp, schedule, v, first, last = placement
    return Layout(pp=pp, schedule=schedule, virtual_pipeline_size=v,
                  num_layers_in_first_pipeline_stage=first,
                  num_layers_in_last_pipeline_stage=last)


def rank_chunk_layers(model: ModelConfig, layout: Layout, rank: int) -> list[list[int]]:
    """The decoder layers of each chunk of pipeline rank ``rank``, chunk by chunk."""
    return [list(c) for c in _chunk_layers(model, _placement(layout), rank)]


@functools.lru_cache(maxsize=65536)
def _chunk_layers(model: ModelConfig, placement: tuple, rank: int) -> tuple:
    l = _placed(placement)
    counts = stage_layers(model, l)
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    where = SCHEDULE_PLACEMENT.get(l.schedule, "loop")
    stages = [model_stage(where, rank, c, l.pp) for c in range(chunks)]
    return tuple(tuple(range(sum(counts[:s]), sum(counts[:s + 1]))) for s in stages)


def rank_layers(model: ModelConfig, layout: Layout, rank: int) -> tuple[list[int], bool]:
    """``(layers, holds the head)``: the decoder layers pipeline rank ``rank`` runs, over
    its chunks in order, and whether one of its stages is the last (the LM head)."""
    chunks = rank_chunk_layers(model, layout, rank)
    last = model.num_layers - 1
    holds_last_stage = any(c and c[-1] == last for c in chunks)
    return [i for c in chunks for i in c], holds_last_stage


@functools.lru_cache(maxsize=65536)
def _rank_flops(model: ModelConfig, placement: tuple, rank: int) -> tuple:
    """``(forward FLOPs per token of the rank's decoder layers, of which core attention,
    its layers, whether it holds the head)``, summed layer by layer in model order."""
    layers, head = rank_layers(model, _placed(placement), rank)
    parts = [layer_flops(model, i) for i in layers]
    return (sum(sum(p.values()) for p in parts), sum(p["core_attention"] for p in parts),
            tuple(layers), head)


def _ranks_to_weigh(pp: int) -> list[int]:
    """The first, a middle and the last pipeline rank: every middle rank holds the same."""
    return sorted({0, min(1, pp - 1), pp - 1})


def chunk_costs(model: ModelConfig, cluster: Cluster, layout: Layout, efficiency: float,
                precision: str = "bf16", crosses: dict | None = None) -> ChunkCosts:
    """The costs of one chunk-microbatch on the pipeline rank with the most FLOPs (the
    first, a middle or the last; its chunks' average, the head's FLOPs spread over them),
    split as the module docstring says.  Communication is given for the
    forward and backward together (a third forward, two thirds backward: the backward
    issues each collective of the forward's twice over, for inputs and, for CP, keys and
    values' gradients)."""
    l = layout
    crosses = group_crosses_nodes(l, cluster.gpus_per_node) if crosses is None else crosses
    rate = _flop_rate(cluster, efficiency, precision)
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    tokens = l.micro_batch_size * model.seq_length   # of one microbatch, before TP and CP
    split = l.tp * l.cp * chunks                     # the rank's work, per chunk on average

    def work(rank):
        per_token, attention_per_token, layers, head = _rank_flops(model, _placement(l), rank)
        flops = tokens * per_token / split
        head_flops = tokens * 2.0 * model.hidden_size * model.vocab_size / split if head else 0.0
        return flops + head_flops, flops, layers, attention_per_token, rank

    forward, layer_part, last, attention, rank = max((work(r) for r in _ranks_to_weigh(l.pp)),
                                                     key=lambda w: w[0])
    per_chunk = len(last) / chunks                   # the rank's layers per chunk, on average
    attention = tokens * attention / split
    recomputed = {None: 0.0, "selective": attention, "full": layer_part}[l.recompute_granularity]
    h = model.hidden_size
    rank_tokens = tokens // l.cp                     # this rank's tokens of the microbatch
    tp_time = cp_time = ep_time = ep_hidden = pp_time = 0.0
    if l.tp > 1:
        per_layer = 6 if l.recompute_granularity == "full" else 4
        tp_time = per_chunk * per_layer * predict_time(
            "all_reduce", rank_tokens * h * BYTES, l.tp, cluster.link(crosses["tp"]))
    if l.cp > 1 and per_chunk:  # the K/V ring: forward once, backward twice; under core attention
        _, k, v = attention_widths(model)
        block = rank_tokens * (k + v) * BYTES / l.tp
        ring = (l.cp - 1) * predict_time("send", block, 2, cluster.link(crosses["cp"]))
        core = attention / per_chunk / rate
        cp_time = per_chunk * 3 * max(0.0, ring - core)   # forward 1, backward 2 rings
    moe_layers = sum(1 for i in last if model.num_experts and i >= model.first_k_dense_replace)
    moe_layers /= chunks
    if moe_layers and l.ep > 1:
        rows = rank_tokens // l.tp * model.moe_router_topk
        one = predict_time("all_to_all", rows * h * BYTES, l.ep, cluster.link(crosses["ep"]))
        total = moe_layers * 4 * one
        if l.schedule == "dualpipev":  # hidden behind the other microbatch's compute
            ep_hidden = min(total, 3 * forward / rate)
            total -= ep_hidden
        ep_time = total
    if l.pp > 1:
        boundary = rank_tokens * h * BYTES / (l.tp if l.tp > 1 else 1)
        pp_time = 2 * predict_time("send", boundary, 2, cluster.link(crosses["pp"]))
    dp_forward = dp_backward = 0.0
    if ZERO_STAGE[l.sharding] >= 2 and l.dp * l.cp > 1:  # the root goes with the first chunk
        link, expert_link = cluster.link(crosses["dp_cp"]), cluster.link(crosses["edp"])
        sizes = _chunk_unit_parameters(model, _placement(l), l.tp, l.ep, rank)
        root = rank_parameter_counts(model, l, rank)[0] - sum(d for c in sizes for d, _ in c)
        for c, units in enumerate(sizes):
            f, b = sharded_exposure(l.sharding, [d for d, _ in units], root if c == 0 else 0,
                                    l.dp * l.cp, link, forward / rate,
                                    (2 * forward + recomputed) / rate,
                                    experts=[e for _, e in units],
                                    expert_shard=l.expert_data_parallel_size,
                                    expert_link=expert_link)
            dp_forward, dp_backward = dp_forward + f / chunks, dp_backward + b / chunks
    return ChunkCosts(forward / rate, (2 * forward + recomputed) / rate, tp_time, cp_time,
                      ep_time, ep_hidden, pp_time, per_chunk, moe_layers, dp_forward, dp_backward)


@functools.lru_cache(maxsize=4096)
def _simulated(schedule: str, pp: int, m: int, v: int, forward: float, backward: float) -> tuple:
    """``(makespan, idle)`` of the simulated schedule with these chunk costs."""
    schedules = build_schedules(schedule, pp, m, v if schedule == "interleaved" else 1)
    timelines = simulate(schedules, forward_cost=forward, backward_cost=backward)
    return makespan(timelines), idle_time(timelines)


def schedule_times(schedule: str, pp: int, m: int, v: int, forward: float,
                   backward: float) -> tuple[float, float]:
    """``(busy, bubble)`` seconds of one rank in the step: ``M V`` chunk-microbatches of
    ``forward + backward`` each, and the idle time the schedule adds.  The simulator where
    the step has at most :data:`SIMULATED_ACTIONS` computes, else the closed form it
    agrees with for equal stages; DualPipeV by the DualPipe table's row (W half the
    backward)."""
    chunks = 2 if schedule == "dualpipev" else v
    busy = m * chunks * (forward + backward)
    if pp == 1:
        return busy, 0.0
    if schedule != "dualpipev" and 2 * pp * m * chunks <= SIMULATED_ACTIONS:
        # simulated with F = 1, B = 2 and scaled: with equal stages the idle time of 1F1B
        # and the interleaved schedule is (PP - 1)(F + B) / V whatever B / F is (chapter 6),
        # so one simulation serves every layout with this PP, M and V
        _, idle = _simulated(schedule, pp, m, v, 1, 2)
        return busy, float(idle) * (forward + backward) / 3
    return busy, expected_bubble_time(schedule, pp, forward, backward)


@functools.lru_cache(maxsize=65536)
def layout_memory(model: ModelConfig, layout: Layout, global_batch_size: int) -> int:
    """Bytes of the layout's heaviest rank (bf16, no process runtime):
    :func:`~tutorial_lib.costs.memory_model.memory_per_rank` on the first, a middle and the
    last pipeline rank (the embedding, the most layers under an uneven split, the head;
    rank 0 holds the most microbatches)."""
    l = layout
    spec = replace(model, sequence_parallel=l.tp > 1)
    full = l.recompute_granularity == "full"
    recompute = Recompute(l.recompute_granularity, "uniform" if full else None, 1 if full else None)
    ranks = memory_per_rank(spec, _parallel_config(l),
                            TrainConfig(global_batch_size, l.num_microbatches(global_batch_size)),
                            l.schedule, 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size,
                            pipeline_ranks=_ranks_to_weigh(l.pp), precision="bf16",
                            data_parallel_sharding_strategy=l.sharding, recompute=recompute,
                            runtime=0, stage_layers=stage_layers(model, l))
    return max(r.total for r in ranks)


@functools.lru_cache(maxsize=65536)
def memory_lower_bound(model: ModelConfig, layout: Layout, global_batch_size: int) -> int:
    """A quick floor under :func:`layout_memory`: over the first, a middle and the last
    pipeline rank, the rank's weights, gradients and optimizer state (bf16 as the memory
    model counts them, :func:`state_bytes_floor`) plus its microbatches in flight times
    the lightest stage's activations.  The planner skips the exact count where this floor
    already does not fit."""
    l = layout
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    counts = stage_layers(model, l)
    full = l.recompute_granularity == "full"
    recompute = Recompute(l.recompute_granularity, "uniform" if full else None, 1 if full else None)
    m = l.num_microbatches(global_batch_size)
    spec = replace(model, sequence_parallel=l.tp > 1)
    lightest = min(sum(stage_activation_bytes(spec, s, len(counts), l.micro_batch_size, l.tp,
                                              l.cp, precision="bf16", recompute=recompute,
                                              ep=l.ep, etp=l.tp, stage_layers=counts).values())
                   for s in sorted({0, min(1, len(counts) - 1), len(counts) - 1}))
    floor = 0
    for rank in _ranks_to_weigh(l.pp):
        in_flight = expected_peak_activations(l.schedule, l.pp, m, rank, chunks) if l.pp > 1 \
            else 1
        state = state_bytes_floor(l, *rank_parameter_counts(model, l, rank))
        floor = max(floor, state + in_flight * lightest)
    return floor


def state_bytes_floor(layout: Layout, dense: int, experts: int) -> int:
    """Bytes of weights, gradients and optimizer state for ``dense`` and ``experts``
    parameters on one rank, bf16, at most what the memory model counts.  A slice element
    costs 16 bytes (fp32 gradient, master and two moments), the slices ``ceil(dense / (DP
    x CP)) + ceil(experts / EDP)`` (the routed experts over expert-DP, in every sharded
    strategy; per unit the memory model pads each, so it counts at least this).  Plain DP
    keeps 18 bytes per parameter; ``optim`` 6 whole (bf16 weight, fp32 gradient) besides
    the slices; ``optim_grads`` 2 (the weight); ``optim_grads_params`` none (the gathered
    weights, counted at their peak, are left out of the floor)."""
    l = layout
    stage = ZERO_STAGE[l.sharding]
    if stage == 0:
        return 18 * (dense + experts)
    mine = -(-dense // (l.dp * l.cp)) + -(-experts // l.expert_data_parallel_size)
    return {1: 6, 2: 2, 3: 0}[stage] * (dense + experts) + 16 * mine


def rank_parameter_counts(model: ModelConfig, layout: Layout, rank: int) -> tuple[int, int]:
    """``(dense, routed-expert)`` parameters pipeline rank ``rank`` holds (the embedding on
    rank 0, the head with the last stage)."""
    return _rank_parameter_counts(model, _placement(layout), layout.tp, layout.ep, rank)


def _layer_units(model: ModelConfig, layer: int, tp: int, ep: int) -> tuple[int, int]:
    """``(dense, routed-expert)`` parameters of decoder layer ``layer`` on one rank (ETP =
    TP): the two gradient domains, and under ZeRO-2 / ZeRO-3 the two units, of a MoE layer
    (a dense layer's routed part 0)."""
    total = layer_parameters(model, layer, tp, ep, tp)
    moe = model.num_experts and layer >= model.first_k_dense_replace
    routed = expert_parameters(model, ep, tp) if moe else 0
    return total - routed, routed


@functools.lru_cache(maxsize=65536)
def _rank_parameter_counts(model: ModelConfig, placement: tuple, tp: int, ep: int,
                           rank: int) -> tuple[int, int]:
    layers, head = rank_layers(model, _placed(placement), rank)
    units = [_layer_units(model, i, tp, ep) for i in layers]
    dense = sum(d for d, _ in units) + model.vocab_size * model.hidden_size // tp * (
        (rank == 0) + head)
    return dense, sum(e for _, e in units)


@functools.lru_cache(maxsize=65536)
def _chunk_unit_parameters(model: ModelConfig, placement: tuple, tp: int, ep: int,
                           rank: int) -> tuple:
    """Each chunk's decoder layers on pipeline rank ``rank``, chunk by chunk, as
    ``(dense, routed-expert)`` parameters (:func:`_layer_units`): the units sharded data
    parallelism gathers and reduce-scatters."""
    return tuple(tuple(_layer_units(model, i, tp, ep) for i in c)
                 for c in _chunk_layers(model, placement, rank))


def rank_parameters(model: ModelConfig, layout: Layout) -> tuple[int, int]:
    """``(dense, routed-expert)`` parameters of the pipeline rank that holds the most
    (:func:`rank_parameter_counts` of the first, a middle and the last rank), each reduced
    over its own data-parallel group."""
    return max((rank_parameter_counts(model, layout, r) for r in _ranks_to_weigh(layout.pp)),
               key=sum)


def _dp_exposed(cluster: Cluster, layout: Layout, crosses: dict, params: tuple[int, int],
                backward_window: float, forward_window: float) -> float:
    """Exposed data-parallel time after the last microbatch: each domain's gradient
    reduction (all-reduce, or the distributed optimizer's reduce-scatter) beyond the window
    it runs under plus the bucket that cannot overlap, and the updated parameters'
    all-gather (``optim``, ``optim_grads``) under the next forward but its first bucket.
    ZeRO-2's reduce-scatters and ZeRO-3's traffic run every microbatch: in the chunk
    costs (:func:`sharded_exposure`)."""
    l = layout
    dense, experts = params
    domains = [(dense, l.dp * l.cp, crosses["dp_cp"]),
               (experts, l.expert_data_parallel_size, crosses["edp"])]
    exposed = 0.0
    for count, size, across in domains:
        if not count or size == 1:
            continue
        link = cluster.link(across)
        bucket = min(count, max(DDP_BUCKET_PARAMETERS, 1_000_000 * size))
        if l.sharding == "no_shard":
            total = predict_time("all_reduce", count * GRADIENT_BYTES, size, link)
            last = predict_time("all_reduce", bucket * GRADIENT_BYTES, size, link)
            exposed += last + max(0.0, total - last - backward_window)
        if l.sharding == "optim":
            scatter = predict_time("reduce_scatter", count * GRADIENT_BYTES, size, link)
            last = predict_time("reduce_scatter", bucket * GRADIENT_BYTES, size, link)
            exposed += last + max(0.0, scatter - last - backward_window)
        if l.sharding in ("optim", "optim_grads"):
            gather = predict_time("all_gather", count * BYTES / size, size, link)
            first = predict_time("all_gather", bucket * BYTES / size, size, link)
            exposed += first + max(0.0, gather - first - forward_window)
    return exposed


def sharded_exposure(strategy: str, units: list[int], root: int, shard: int, link,
                     forward_s: float, backward_s: float, *, experts=(), expert_shard: int = 1,
                     expert_link=None) -> tuple[float, float]:
    """``(forward, backward)`` seconds of sharded data parallelism that one chunk-microbatch
    cannot hide, for ZeRO-2 (``optim_grads``) and ZeRO-3 (``optim_grads_params``), as
    :func:`~tutorial_lib.costs.zero_stages.sharded_step_collectives` lists the collectives
    (per microbatch; bf16 gathers, fp32 reduce-scatters, each unit padded to its group's
    slices).

    ``units``: the chunk's decoder layers' (dense) parameters in forward order, sharded
    over ``shard`` ranks on ``link``; ``root``: the rest of the rank's parameters
    (embedding, head; 0 for none), gathered first and kept gathered through the backward
    (FSDP2's default).  ``experts``: per layer of ``units``, its routed experts' parameters
    (0 for a dense layer; none given: every layer dense), a unit of its own sharded over
    ``expert_shard`` ranks on ``expert_link``.  A layer's two units are prefetched together
    and reduce-scattered back to back, so a layer's collective costs the two together, as
    torchtitan prefetches a MoE block with its experts (``apply_fsdp`` in
    ``torchtitan/models/llama4/infra/parallelize.py``, commit 2645c02d); ``train_4d``'s
    prefetch runs one unit ahead, so there a layer's second unit is gathered only as the
    layer starts.  ZeRO-3's forward gathers each layer before it runs, the next one
    prefetched under the current one's compute: the first gather is exposed, the others
    only beyond ``forward_s``.  Its backward gathers the layers again in reverse (the first
    exposed) and reduce-scatters every layer's gradients as they are ready, the last one
    (the root's, or the first layer's) after the compute: exposed; the rest beyond
    ``backward_s``.  ZeRO-2 only reduce-scatters."""
    stage = ZERO_STAGE[strategy]
    experts = list(experts) or [0] * len(units)
    if len(experts) != len(units):
        raise ValueError(f"experts lists {len(experts)} layers, units {len(units)}: one "
                         f"routed-expert count (0 for a dense layer) per layer")
    if stage < 2 or (shard == 1 and expert_shard == 1):
        return 0.0, 0.0
    # forward order, the root first: (dense, routed) parameters of each unit pair
    order = ([(root, 0)] if root else []) + list(zip(units, experts))

    def one(op, n, size, over):  # one unit's collective over ``size`` ranks
        if not n or size == 1:
            return 0.0
        piece = unit_slice_numel(n, size)
        wire = piece * BYTES if op == "all_gather" else piece * size * GRADIENT_BYTES
        return predict_time(op, wire, size, over)

    timed = {}  # per (op, unit sizes): a chunk's layers are mostly alike

    def both(op, pair):
        if (op, pair) not in timed:
            timed[op, pair] = (one(op, pair[0], shard, link)
                               + one(op, pair[1], expert_shard, expert_link))
        return timed[op, pair]

    scatters = [both("reduce_scatter", p) for p in order]    # the last issued: order[0]'s
    forward = backward = 0.0
    if stage == 3 and order:
        gathers = [both("all_gather", p) for p in order]
        forward = gathers[0] + max(0.0, sum(gathers[1:]) - forward_s)
        again = [both("all_gather", p) for p in reversed(order[bool(root):])]  # root stays
        hidden = sum(again[1:]) + sum(scatters[1:])
        backward = (again[0] if again else 0.0) + scatters[0] + max(0.0, hidden - backward_s)
    elif order:
        backward = scatters[0] + max(0.0, sum(scatters[1:]) - backward_s)
    return forward, backward


def predict_step(model: ModelConfig, cluster: Cluster, layout: Layout, global_batch_size: int,
                 efficiency: float, precision: str = "bf16", *, memory: bool = True,
                 checked: bool = False) -> StepTime:
    """The prediction for ``layout`` (checked by :func:`check_layout` first, unless
    ``checked``).  ``memory=False`` leaves the memory out (``memory_bytes`` -1, ``fits``
    ``None``): the planner ranks by time first and adds it with :func:`with_memory`."""
    if not checked:
        check_layout(model, layout, global_batch_size)
    l = layout
    crosses = group_crosses_nodes(l, cluster.gpus_per_node)
    costs = chunk_costs(model, cluster, l, efficiency, precision, crosses)
    m = l.num_microbatches(global_batch_size)
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    busy, bubble = schedule_times(l.schedule, l.pp, m, l.virtual_pipeline_size,
                                  costs.forward, costs.backward)
    count = m * chunks
    dp = _dp_exposed(cluster, l, crosses, rank_parameters(model, l),
                     chunks * costs.backward_compute, chunks * costs.forward_compute)
    step = busy + bubble + dp
    gpus = l.world_size
    model_flops = model_flops_per_step(model, global_batch_size)
    hardware = hardware_flops_per_step(model, global_batch_size, l.recompute_granularity)
    peak = cluster.gpu.peak_flops(precision)
    result = StepTime(l, step, count * (costs.forward_compute + costs.backward_compute),
                    count * costs.tp, count * costs.cp, count * costs.ep,
                    dp + count * (costs.dp_forward + costs.dp_backward), count * costs.pp,
                    bubble, global_batch_size * model.seq_length / step,
                    model_flops / gpus / step / 1e12, model_flops / gpus / step / peak,
                    hardware / gpus / step / 1e12, -1, None, crosses)
    return with_memory(result, model, cluster, global_batch_size) if memory else result


def with_memory(result: StepTime, model: ModelConfig, cluster: Cluster,
                global_batch_size: int) -> StepTime:
    """``result`` with its heaviest rank's bytes (:func:`layout_memory`) and whether they
    fit in :data:`USABLE_MEMORY_FRACTION` of the GPU."""
    used = layout_memory(model, result.layout, global_batch_size)
    return replace(result, memory_bytes=used,
                   fits=used <= USABLE_MEMORY_FRACTION * cluster.gpu.memory_bytes)
