"""Closed-form costs of communication: bytes on the wire, time, and what each parallelism needs.

Chapters print these predictions next to what the traced collectives actually did, and
tests compare the two.  One module per subject, each named for what it predicts; every
name is re-exported here, so a chapter calls ``costs.X`` whichever module holds ``X``:

=================  ========  ============================================================
module             chapters  what it holds
=================  ========  ============================================================
``collectives``    1-3, 7    bytes each rank sends in the ring algorithms, the alpha-beta
                             model (``time = steps * alpha + bytes * beta``), its fit
``measure``        2, 7      timing on this machine: :func:`measure_collective`
                             (:func:`measure_alpha_beta`, chapter 2's run), and
                             :func:`rounds_by_size` (a timing run's rounds, median per
                             size), which :mod:`tutorial_lib.p2p_timing` shares
``bandwidth``      1         which parallelism uses which collective, how often, on what
                             volume, over which link (the bandwidth table)
``tp_dp_step``     3         every collective of one TP + DP training step; ZeRO-1's
                             optimizer state per rank
``moe``            4         the MoE dispatch / combine all-to-alls: bytes, send splits
``memory``         10        every rank's memory (weights, gradients, optimizer state,
                             saved activations per layer and schedule, recomputation),
                             checked against runs; ``train_4d`` checks it before it starts
=================  ========  ============================================================

And ``context_parallel`` (chapter 9): context-parallel attention's messages and bytes per
rank in each ``cp_comm_type`` (the p2p ring, the all-gather, Ulysses' all-to-all).

What they import: ``bandwidth`` is pure Python (not even numpy), and so is ``memory``
(it reads the schedules' formulas from :mod:`tutorial_lib.pipeline_schedules` and the
recomputation rule from :mod:`tutorial_lib.recompute`); ``collectives``,
``measure``, ``tp_dp_step``, ``moe`` and ``context_parallel`` import numpy (``measure`` and
``context_parallel`` through ``collectives``) and none of them imports torch when it is
loaded, so ``import tutorial_lib.costs`` loads no torch; and the numpy ones are imported
only when one of their names is first used, so ``import tutorial_lib.costs`` loads no
numpy either.  Two functions reach torch through
other modules of the library when they are called: :func:`tp_dp_step_collectives` with ``tp > 1``
reads each block's collectives from :func:`tutorial_lib.transformer.block_collectives`
(which imports torch), and :func:`measure_collective` imports torch,
:mod:`tutorial_lib.comm` and :mod:`tutorial_lib.launch`, and starts processes.  Every
other function is a pure function of its arguments.

Byte counts follow the library's convention (:mod:`tutorial_lib.comm`, tabled in
:mod:`tutorial_lib.costs.collectives`), so ``ring_bytes_sent(e.op, e.bytes,
len(e.group_ranks))`` works directly on a trace event ``e``.
"""
from .bandwidth import (LinkSpec, ParallelismTraffic, bandwidth_table, cp_kv_chunk_bytes,
                        dp_gradient_bytes, ep_all_to_all_bytes, link_bandwidths,
                        pp_activation_bytes, tp_all_reduce_bytes, transfer_seconds)
from .memory import (PRECISION_BYTES, RankMemory, available_memory_bytes, format_bytes,
                     layer_activation_bytes, layer_parameters, memory_of_ranks,
                     memory_on_this_machine, memory_per_rank, stage_activation_bytes)


def _import_numpy_modules() -> None:
    """The modules that import numpy, loaded on first use of one of their names (PEP 562's
    module ``__getattr__``): ``python -m tutorial_lib.memory`` and train_4d's refusals read
    ``memory`` alone and never pay numpy's import."""
    from .context_parallel import (CP_MODES, cp_attention_messages, cp_bytes_sent,
                                   cp_kv_block_bytes)
    from .collectives import (BUS_BANDWIDTH_FACTORS, OPS, AlphaBeta, Fit, Sample,
                              algorithm_bandwidth, all_gather_bytes, all_reduce_bytes,
                              all_to_all_bytes, broadcast_bytes, bus_bandwidth, cost_coefficients,
                              fit_alpha_beta, nccl_tests_size, predict_time, reduce_scatter_bytes,
                              ring_bytes_sent, ring_steps, send_bytes, tree_broadcast_time)
    from .measure import (ALPHA_BETA_OPS, ALPHA_BETA_RANKS, ALPHA_BETA_SIZES, DEFAULT_SIZES,
                          MEASURABLE_OPS, MEASURE_DEVICES, TimedRounds, bandwidth_rows,
                          measure_alpha_beta, measure_collective, rounds_by_size,
                          samples_from_trace)
    from .moe import (MoEAllToAll, moe_all_to_all_bytes, moe_dedup_rank_all_to_alls,
                      moe_expert_tp_bytes,
                      moe_dedup_rows, moe_rank_all_to_alls, moe_rank_send_splits,
                      moe_send_counts)
    from .tp_dp_step import (DATA_PARALLEL_BUCKET_SIZE_BYTES, StepCollective,
                             data_parallel_bucket_bytes, distributed_optimizer_collectives,
                             gpt_parameter_shapes, megatron_distributed_optimizer_numel,
                             step_bytes_by_group, tp_dp_step_collectives,
                             zero1_state_bytes_per_rank)
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
    "LinkSpec", "ParallelismTraffic", "bandwidth_table", "cp_kv_chunk_bytes",
    "dp_gradient_bytes", "ep_all_to_all_bytes", "link_bandwidths", "pp_activation_bytes",
    "tp_all_reduce_bytes", "transfer_seconds",
    "CP_MODES", "cp_attention_messages", "cp_bytes_sent", "cp_kv_block_bytes",
    "BUS_BANDWIDTH_FACTORS", "OPS", "AlphaBeta", "Fit", "Sample", "algorithm_bandwidth",
    "all_gather_bytes", "all_reduce_bytes", "nccl_tests_size",
    "all_to_all_bytes", "broadcast_bytes", "bus_bandwidth", "cost_coefficients",
    "fit_alpha_beta", "predict_time", "reduce_scatter_bytes", "ring_bytes_sent", "ring_steps",
    "send_bytes", "tree_broadcast_time",
    "DEFAULT_SIZES", "MEASURABLE_OPS", "MEASURE_DEVICES", "TimedRounds", "bandwidth_rows",
    "measure_collective", "rounds_by_size", "samples_from_trace",
    "MoEAllToAll", "moe_all_to_all_bytes", "moe_rank_all_to_alls", "moe_rank_send_splits",
    "moe_send_counts", "moe_dedup_rows", "moe_dedup_rank_all_to_alls", "moe_expert_tp_bytes",
    "DATA_PARALLEL_BUCKET_SIZE_BYTES", "StepCollective", "data_parallel_bucket_bytes",
    "distributed_optimizer_collectives", "megatron_distributed_optimizer_numel",
    "gpt_parameter_shapes", "step_bytes_by_group", "tp_dp_step_collectives",
    "zero1_state_bytes_per_rank",
    "PRECISION_BYTES", "RankMemory", "available_memory_bytes", "format_bytes",
    "layer_activation_bytes", "layer_parameters", "memory_of_ranks", "memory_on_this_machine",
    "memory_per_rank", "stage_activation_bytes",
]
