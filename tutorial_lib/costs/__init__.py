"""Closed-form costs of communication: bytes on the wire, time, and what each parallelism needs.

Chapters print these predictions next to what the traced collectives actually did, and
tests compare the two.  One module per subject, each named for what it predicts; every
name is re-exported here, so a chapter calls ``costs.X`` whichever module holds ``X``.
The names differ from the technique modules' (``memory_model`` beside
:mod:`tutorial_lib.memory`, ``cp_messages`` beside :mod:`tutorial_lib.context_parallel`),
so a chapter that imports both reads which is which:

=================  ========  ============================================================
module             chapters  what it holds
=================  ========  ============================================================
``alpha_beta``     1-3, 7    bytes each rank sends in the ring algorithms, the alpha-beta
                             model (``time = steps * alpha + bytes * beta``), its fit
``bandwidth``      1         which parallelism uses which collective, how often, on what
                             volume, over which link (the bandwidth table)
``tp_dp_step``     3         every collective of one TP + DP training step; ZeRO-1's
                             optimizer state per rank
``moe``            4         the MoE dispatch / combine all-to-alls: bytes, send splits
``zero_stages``    12        the ZeRO stages (Megatron-FSDP's strategies): each unit's
                             all-gathers and reduce-scatters per step, bytes on the
                             wire, state per parameter (the ZeRO paper), HSDP, the peak
                             of gathered parameters
``memory_model``   10        every rank's memory (weights, gradients, optimizer state,
                             saved activations per layer and schedule, recomputation),
                             checked against runs; ``train_4d`` checks it before it starts
=================  ========  ============================================================

And ``cp_messages`` (chapter 9): context-parallel attention's messages and bytes per
rank in each ``cp_comm_type`` (the p2p ring, the all-gather, Ulysses' all-to-all); and
chapter 13's planner's parts: ``hardware`` (GPUs and clusters as data, each figure's
source), ``model_flops`` (a real model's shapes by Megatron's names: GQA, SwiGLU, MoE with
shared experts, MLA; its parameters and FLOPs), ``step_time`` (one step of a layout:
compute, exposed communication on the link each group crosses, the bubble, memory),
``rooflines`` (each technique's FLOPs per byte against NVLink's and the network's ridge).

What they import: ``bandwidth`` is pure Python (not even numpy), and so is ``memory_model``
(it reads the schedules' formulas from :mod:`tutorial_lib.pipeline_parallel` and the
recomputation rule from :mod:`tutorial_lib.recompute`); ``alpha_beta``,
``tp_dp_step``, ``moe``, ``cp_messages`` and ``zero_stages`` import numpy (``cp_messages`` through
``alpha_beta``) and none of them imports torch when it is loaded, so
``import tutorial_lib.costs`` loads no torch; and the numpy ones are imported only when one
of their names is first used, so ``import tutorial_lib.costs`` loads no numpy either.  One function reaches torch through
another module of the library when it is called: :func:`tp_dp_step_collectives` with
``tp > 1`` reads each block's collectives from
:func:`tutorial_lib.transformer.block_collectives` (which imports torch).  Every other
function is a pure function of its arguments.  Measuring on this machine (processes, the
launcher) is :mod:`tutorial_lib.timing`'s.

Byte counts follow the library's convention (:mod:`tutorial_lib.comm`, tabled in
:mod:`tutorial_lib.costs.alpha_beta`), so ``ring_bytes_sent(e.op, e.bytes,
len(e.group_ranks))`` works directly on a trace event ``e``.
"""
from .bandwidth import (LinkSpec, ParallelismTraffic, bandwidth_table, dp_gradient_bytes,
                        link_bandwidths, pp_activation_bytes, tp_all_reduce_bytes,
                        transfer_seconds)
from .memory_model import (PRECISION_BYTES, RankMemory, available_memory_bytes, format_bytes,
                           layer_activation_bytes, layer_parameters, memory_of_ranks,
                           memory_on_this_machine, memory_per_rank, peak_unsharded_numel,
                           stage_activation_bytes, unit_slice_numel, zero_bytes_per_parameter)


def _import_numpy_modules() -> None:
    """The modules that import numpy, loaded on first use of one of their names (PEP 562's
    module ``__getattr__``): ``python -m tutorial_lib.memory`` and train_4d's refusals read
    ``memory_model`` alone and never pay numpy's import."""
    from .alpha_beta import (BUS_BANDWIDTH_FACTORS, OPS, AlphaBeta, Fit, Sample,
                             algorithm_bandwidth, all_gather_bytes, all_reduce_bytes,
                             all_to_all_bytes, broadcast_bytes, bus_bandwidth, cost_coefficients,
                             fit_alpha_beta, nccl_tests_size, predict_time, reduce_scatter_bytes,
                             ring_bytes_sent, ring_steps, send_bytes, tree_broadcast_time)
    from .cp_messages import (CP_MODES, cp_attention_messages, cp_bytes_sent,
                              cp_kv_block_bytes)
    from .moe import (MoEAllToAll, moe_all_to_all_bytes, moe_dedup_rank_all_to_alls,
                      moe_dedup_rows, moe_expert_tp_bytes, moe_rank_all_to_alls,
                      moe_rank_send_splits, moe_send_counts)
    from .tp_dp_step import (DATA_PARALLEL_BUCKET_SIZE_BYTES, StepCollective,
                             data_parallel_bucket_bytes, distributed_optimizer_collectives,
                             gpt_parameter_shapes, megatron_distributed_optimizer_numel,
                             step_bytes_by_group, tp_dp_step_collectives,
                             zero1_state_bytes_per_rank)
    from .hardware import GPU, GPUS, Cluster, cluster
    from .model_flops import (MODEL_PRESETS, active_parameter_count, gpt,
                              hardware_flops_per_step, layer_flops, model_flops_per_step,
                              parameter_count)
    from .rooflines import Roofline, rooflines
    from .step_time import (Layout, StepTime, group_crosses_nodes, predict_step,
                            schedule_times)
    from .zero_stages import sharded_step_collectives, sharding_beats_tp_tokens, step_bytes_sent
    globals().update({name: value for name, value in locals().items()})


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    _import_numpy_modules()
    try:
        return globals()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

__all__ = [
    "LinkSpec", "ParallelismTraffic", "bandwidth_table",
    "dp_gradient_bytes", "link_bandwidths", "pp_activation_bytes",
    "tp_all_reduce_bytes", "transfer_seconds",
    "CP_MODES", "cp_attention_messages", "cp_bytes_sent", "cp_kv_block_bytes",
    "BUS_BANDWIDTH_FACTORS", "OPS", "AlphaBeta", "Fit", "Sample", "algorithm_bandwidth",
    "all_gather_bytes", "all_reduce_bytes", "nccl_tests_size",
    "all_to_all_bytes", "broadcast_bytes", "bus_bandwidth", "cost_coefficients",
    "fit_alpha_beta", "predict_time", "reduce_scatter_bytes", "ring_bytes_sent", "ring_steps",
    "send_bytes", "tree_broadcast_time",
    "MoEAllToAll", "moe_all_to_all_bytes", "moe_rank_all_to_alls", "moe_rank_send_splits",
    "moe_send_counts", "moe_dedup_rows", "moe_dedup_rank_all_to_alls", "moe_expert_tp_bytes",
    "DATA_PARALLEL_BUCKET_SIZE_BYTES", "StepCollective", "data_parallel_bucket_bytes",
    "distributed_optimizer_collectives", "megatron_distributed_optimizer_numel",
    "gpt_parameter_shapes", "step_bytes_by_group", "tp_dp_step_collectives",
    "zero1_state_bytes_per_rank",
    "sharded_step_collectives", "sharding_beats_tp_tokens", "step_bytes_sent",
    "PRECISION_BYTES", "RankMemory", "available_memory_bytes", "format_bytes",
    "layer_activation_bytes", "layer_parameters", "memory_of_ranks", "memory_on_this_machine",
    "memory_per_rank", "stage_activation_bytes", "peak_unsharded_numel", "unit_slice_numel",
    "zero_bytes_per_parameter",
    "GPU", "GPUS", "Cluster", "cluster", "MODEL_PRESETS", "active_parameter_count",
    "gpt", "hardware_flops_per_step", "layer_flops", "model_flops_per_step", "parameter_count",
    "Layout", "StepTime", "group_crosses_nodes", "predict_step", "schedule_times",
    "Roofline", "rooflines",
]
