"""TP + DP: every collective of one training step, and ZeRO-1's optimizer state per rank.

Chapter 3 (TP + DP) prints :func:`tp_dp_step_collectives` beside the trace of
:func:`tutorial_lib.tp_dp_step.train_step`, and a test checks that they agree op for op
and byte for byte; :func:`zero1_state_bytes_per_rank` is the memory ZeRO-1 saves.
Importing this module loads numpy, no torch; :func:`tp_dp_step_collectives` with
``tp > 1`` imports :mod:`tutorial_lib.transformer` (and so torch) to read the block's
own collectives from :func:`tutorial_lib.transformer.block_collectives`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


# --- the collectives of one training step ---------------------------------------------------
#
# What train_step issues on one rank, predicted from the model's shape and the layout alone.
# Per microbatch, inside one DP replica (TP collectives, group "tp", only when TP > 1):
#   forward:  word embedding all-reduce; each block's (transformer.block_collectives);
#             the output layer's all-gather (SP only); the cross-entropy's 3 all-reduces
#             (fp32, whatever the model's dtype: the loss upcasts)
#   backward: the output layer's all-reduce of dX (SP: the all-gather of its saved input
#             shard, then the reduce-scatter of dX); each block's; the embedding
#             scatter's all-gather (SP only)
# Once per step:
#   grad_sync: one all-reduce of every sequence-parallel gradient over TP (SP only)
#   backward:  DataParallel's bucket all-reduces over DP (not with ZeRO-1)
#   clip_grad: the squared norm summed over TP (ZeRO-1: over DP too), 4 bytes each
#   optimizer: ZeRO-1's reduce-scatter of the gradients and all-gather of the parameters
#   logging:   the loss averaged over DP, 4 bytes

#: ``tutorial_lib.data_parallel.DEFAULT_BUCKET_SIZE_BYTES``, repeated here so that importing
#: this module does not import torch, as data_parallel does (a unit test checks the two agree).
DATA_PARALLEL_BUCKET_SIZE_BYTES = 40_000_000

_NORM_BYTES = 4  # the clip's squared norm and the logged loss are float32 scalars
_LOSS_BYTES = 4  # the vocab-parallel cross-entropy computes in float32 whatever the logits' dtype
_ZERO1_BYTES = 4  # ZeRO-1 reduce-scatters float32 gradients whatever the model's dtype
_FP32_BYTES = 4


@dataclass(frozen=True)
class StepCollective:
    """One row of the prediction: ``count`` identical collectives of one kind, on one rank."""

    op: str
    """``all_reduce``, ``reduce_scatter`` or ``all_gather``, as in the trace."""
    group_kind: str
    """``tp`` (inside a DP replica) or ``dp`` (across the replicas of one shard)."""
    phase: str
    """The trace's ``phase`` tag: forward, backward, grad_sync, clip_grad, optimizer, logging."""
    count: int
    """How many per optimizer step (microbatches and layers multiplied in)."""
    bytes_each: int
    """Bytes of each, in :mod:`tutorial_lib.comm`'s convention (``TraceEvent.bytes``)."""
    what: str
    """Which part of the model or the step issues it."""

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes_each


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(value)


def _per_rank(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({tp}); "
                         f"try {what} = {(total // tp + 1) * tp}")
    return total // tp


def gpt_parameter_shapes(model_config, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter one TP rank of ``tutorial_lib.gpt.GPTModel``
    holds, in registration order (the order DataParallel fills its buckets from, reversed).

    ``model_config`` needs ``hidden_size``, ``num_layers``, ``seq_length``, ``vocab_size``;
    the MLP is ``4 * hidden_size`` wide.  Sharded: the word table and the output layer by
    vocabulary rows, qkv and fc1 (weights and biases) by output rows, proj and fc2 by input
    columns.  Replicated: the position table, the LayerNorms, the row-parallel biases.
    """
    tp = _positive("tp", tp)
    h, ffn = model_config.hidden_size, 4 * model_config.hidden_size
    vocab = _per_rank(model_config.vocab_size, tp, "vocab_size")
    shapes = [("embedding.word_embeddings.weight", (vocab, h)),
              ("embedding.position_embeddings.weight", (model_config.seq_length, h))]
    for layer in range(model_config.num_layers):
        p = f"layers.{layer}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "input_layernorm.bias", (h,)),
                   (p + "self_attention.linear_qkv.weight", (_per_rank(3 * h, tp, "3 * hidden_size"), h)),
                   (p + "self_attention.linear_qkv.bias", (3 * h // tp,)),
                   (p + "self_attention.linear_proj.weight", (h, _per_rank(h, tp, "hidden_size"))),
                   (p + "self_attention.linear_proj.bias", (h,)),
                   (p + "pre_mlp_layernorm.weight", (h,)), (p + "pre_mlp_layernorm.bias", (h,)),
                   (p + "mlp.linear_fc1.weight", (ffn // tp, h)), (p + "mlp.linear_fc1.bias", (ffn // tp,)),
                   (p + "mlp.linear_fc2.weight", (h, ffn // tp)), (p + "mlp.linear_fc2.bias", (h,))]
    shapes += [("final_layernorm.weight", (h,)), ("final_layernorm.bias", (h,)),
               ("output_layer.weight", (vocab, h))]
    return shapes


def data_parallel_bucket_bytes(param_bytes: Sequence[int], bucket_size_bytes: float) -> list[int]:
    """Bytes of each DataParallel bucket, in launch order, for parameters of ``param_bytes``
    (registration order, one domain, one dtype).

    The rule of ``tutorial_lib.data_parallel.build_buckets``: walk the parameters from the
    last to the first (backward produces their gradients roughly in that order) and close
    a bucket as soon as it holds at least ``bucket_size_bytes`` (0: one parameter a bucket).
    """
    if bucket_size_bytes < 0:
        raise ValueError(f"bucket_size_bytes must be >= 0, got {bucket_size_bytes}")
    buckets, current = [], 0
    for nbytes in reversed(list(param_bytes)):
        current += nbytes
        if current >= bucket_size_bytes:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def tp_dp_step_collectives(model_config, tp: int, dp: int, micro_batch_size: int,
                           num_microbatches: int, sequence_parallel: bool | None = None,
                           zero1: bool = False,
                           bucket_size_bytes: float = DATA_PARALLEL_BUCKET_SIZE_BYTES,
                           clip_grad: bool = False, log_loss: bool = True,
                           bytes_per_element: int = 4,
                           grad_reduce_in_fp32: bool = False) -> list[StepCollective]:
    """Every collective one rank issues in one ``train_step`` of ``GPTModel``, as rows.

    ``tp``, ``dp``: the layout; ``micro_batch_size`` sequences per microbatch,
    ``num_microbatches`` of them per replica per step; ``sequence_parallel`` (``None``:
    ``model_config.sequence_parallel``); ``zero1``: DistributedOptimizer instead of
    DataParallel (whose buckets hold about ``bucket_size_bytes``); ``clip_grad``: a
    ``max_grad_norm`` is given; ``log_loss``: the loss is averaged over DP for the log.
    ``bytes_per_element``: the model's dtype (4: fp32, 2: bf16), of the activations and
    the parameters; ``grad_reduce_in_fp32``: DataParallel's buckets are fp32 whatever the
    parameters' dtype (they are cut by the parameters' bytes all the same).  ZeRO-1
    reduce-scatters fp32 gradients and all-gathers parameters in their own dtype.
    Every rank issues the same list (the shards are of equal size).

    Two things the trace shows that a reader may not expect: DataParallel and ZeRO-1
    issue their collectives even when DP = 1 (a group of one rank, where gloo returns at
    once), while the clip and the log skip groups of one rank; and with sequence
    parallelism the word embedding still all-reduces (Megatron's pattern with a learned
    position embedding), the split along the sequence comes after it for free, while
    every column-parallel layer (qkv, fc1, the output layer) all-gathers its input twice,
    once forward and once backward (it keeps only its shard for dW).
    """
    tp, dp = _positive("tp", tp), _positive("dp", dp)
    b, m = _positive("micro_batch_size", micro_batch_size), _positive("num_microbatches", num_microbatches)
    sp = model_config.sequence_parallel if sequence_parallel is None else bool(sequence_parallel)
    s, h, layers = model_config.seq_length, model_config.hidden_size, model_config.num_layers
    shapes = gpt_parameter_shapes(model_config, tp)  # checks vocab and hidden divide over TP
    _per_rank(model_config.num_attention_heads, tp, "num_attention_heads")
    if sp and tp > 1:
        _per_rank(s, tp, "seq_length")
    activation = s * b * h * bytes_per_element      # one [s, b, h] tensor
    shard = activation // tp                        # this rank's [s/T, b, h] slice
    per_token = s * b * _LOSS_BYTES                 # one fp32 number per token: [s, b]
    rows: list[StepCollective] = []

    def add(op, kind, phase, count, nbytes, what):
        if count:
            rows.append(StepCollective(op, kind, phase, count, int(nbytes), what))

    if tp > 1:
        # Each block's TP collectives, from the block's own accounting (transformer.py).
        from ..transformer import block_collectives
        block = block_collectives(s, b, h, tp, sp, bytes_per_element)
        per_block: dict[tuple, int] = {}
        for row in block:
            key = (row["phase"], row["op"], row["bytes"], row["op_name"])
            per_block[key] = per_block.get(key, 0) + 1

        def add_blocks(phase):
            for (row_phase, op, nbytes, op_name), n in per_block.items():
                if row_phase == phase:
                    add(op, "tp", phase, n * layers * m, nbytes, f"transformer blocks: {op_name}")

        add("all_reduce", "tp", "forward", m, activation,
            "word embedding: sum the vocabulary shards' rows")
        add_blocks("forward")
        if sp:
            add("all_gather", "tp", "forward", m, shard,
                "output layer: gather the sequence back for the vocabulary-parallel matmul")
        add("all_reduce", "tp", "forward", 3 * m, per_token,
            "vocab-parallel cross-entropy: max, target logit, sum of exponentials")
        if sp:
            add("all_gather", "tp", "backward", m, shard,
                "output layer: gather its saved input shard again, for dW")
            add("reduce_scatter", "tp", "backward", m, activation,
                "output layer: dX partial sums over vocabulary shards, back to my tokens")
        else:
            add("all_reduce", "tp", "backward", m, activation,
                "output layer: dX partial sums over vocabulary shards")
        add_blocks("backward")
        if sp:
            add("all_gather", "tp", "backward", m, shard,
                "embedding: gather the gradient of the sequence split")
            # The blocks' LayerNorms and row-parallel biases (the block's own grad_sync row
            # says how many bytes a block has), plus the final LayerNorm: one flat buffer.
            block_sync = sum(r["bytes"] for r in block if r["phase"] == "grad_sync")
            add("all_reduce", "tp", "grad_sync", 1, layers * block_sync + 2 * h * bytes_per_element,
                "sequence-parallel gradients (LayerNorms, row-parallel biases)")

    numels = [math.prod(shape) for _, shape in shapes]
    if not zero1:
        sizes = data_parallel_bucket_bytes([n * bytes_per_element for n in numels], bucket_size_bytes)
        if grad_reduce_in_fp32:  # the same buckets, fp32 buffers
            sizes = [nbytes // bytes_per_element * _FP32_BYTES for nbytes in sizes]
        for nbytes in sorted(set(sizes), reverse=True):
            add("all_reduce", "dp", "backward", sizes.count(nbytes), nbytes,
                "DataParallel buckets: average the gradients over the replicas")
        if clip_grad and tp > 1:
            add("all_reduce", "tp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over TP shards")
    else:
        reduce_scatter, all_gather = distributed_optimizer_collectives(
            sum(numels), dp, param_bytes=bytes_per_element, grad_bytes=_ZERO1_BYTES)
        rows.append(reduce_scatter)
        if clip_grad and dp > 1:
            add("all_reduce", "dp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over DP slices")
        if clip_grad and tp > 1:
            add("all_reduce", "tp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over TP shards")
        rows.append(all_gather)
    if log_loss and dp > 1:
        add("all_reduce", "dp", "logging", 1, _NORM_BYTES, "the loss averaged over replicas (logging only)")
    return rows


def step_bytes_by_group(rows: Iterable[StepCollective]) -> dict[str, int]:
    """Bytes one rank hands to collectives in one step, per group kind (``{"tp": ..., "dp": ...}``)."""
    out: dict[str, int] = {}
    for row in rows:
        out[row.group_kind] = out.get(row.group_kind, 0) + row.total_bytes
    return out


# --- ZeRO-1: optimizer state per rank ---------------------------------------------------


def distributed_optimizer_collectives(numel: int, data_parallel_size: int, param_bytes: int = 4,
                                      grad_bytes: int = 4, group_kind: str = "dp"
                                      ) -> tuple[StepCollective, StepCollective]:
    """The distributed optimizer's two collectives on one rank in one step, for one buffer.

    A buffer is the flat vector of one gradient domain's parameters (dense over ``dp``,
    routed experts over ``expert_dp``: ``group_kind``) of one dtype, ``numel`` elements
    padded to a multiple of the group's size ``data_parallel_size``.  After the last
    backward each rank reduce-scatters the whole padded gradient buffer (``grad_bytes``
    an element: fp32 here, whatever the parameters' dtype) and receives the average of
    its ``padded / DP`` slice; it updates that slice, then all-gathers it (``param_bytes``
    an element): :class:`tutorial_lib.data_parallel.DistributedOptimizer`.  Bytes in
    :mod:`tutorial_lib.comm`'s convention: the reduce-scatter's full input, the
    all-gather's shard.  On the ring each sends ``(DP - 1) x slice``, so with equal
    dtypes the pair moves what one all-reduce of the gradients would.

    Megatron-Core 0.20.0 (d98e8a64) runs the same pair per bucket of its gradient buffer:
    megatron/core/distributed/param_and_grad_buffer.py, ``start_grad_sync``
    (``reduce_scatter_tensor`` of the bucket's gradients into this rank's shard) and
    ``start_param_sync`` (``all_gather_into_tensor`` of the parameter shards); without
    ``overlap_grad_reduce`` a buffer is one bucket (distributed_data_parallel.py sets
    ``bucket_size = None``), as here.  Its buffer is padded more: see
    :func:`megatron_distributed_optimizer_numel`.
    """
    _positive("numel", numel)
    padded = math.ceil(numel / _positive("data_parallel_size", data_parallel_size)) * data_parallel_size
    shard = padded // data_parallel_size
    return (StepCollective("reduce_scatter", group_kind, "optimizer", 1, padded * grad_bytes,
                           "ZeRO-1: my slice of the averaged gradients"),
            StepCollective("all_gather", group_kind, "optimizer", 1, shard * param_bytes,
                           "ZeRO-1: every replica gets every updated slice"))


def megatron_distributed_optimizer_numel(param_numels: Sequence[int], data_parallel_size: int,
                                         pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """The padded length of Megatron's one-bucket gradient buffer for these parameters.

    Megatron-Core 0.20.0 (d98e8a64), megatron/core/optimizer/distrib_optimizer.py
    ``DistributedOptimizer._compute_per_buffer_param_layout`` with param_layout.py's
    ``pad_param_start`` / ``pad_bucket_end``: the parameters are laid out last to first,
    each starting at a multiple of 64 elements, and the bucket's end is padded to a
    multiple of ``lcm(DP, 128)`` (``lcm(DP, 128, 2**16)`` with
    ``--ddp-pad-buckets-for-high-nccl-busbw``), for aligned GPU memory and faster NCCL.
    The course pads only to a multiple of DP (:func:`distributed_optimizer_collectives`):
    the same algorithm, a few elements fewer per parameter.
    """
    end = 0
    for numel in reversed(list(param_numels)):
        end = math.ceil(end / 64) * 64 + numel
    divisor = math.lcm(data_parallel_size, 128, *([2**16] if pad_buckets_for_high_nccl_busbw else []))
    return math.ceil(end / divisor) * divisor


def zero1_state_bytes_per_rank(num_params: int, data_parallel_size: int,
                               bytes_per_param: int = 12) -> int:
    """Predicted optimizer-state bytes per rank with ZeRO-1: ``ceil(N / DP) * bytes_per_param``.

    Adam with an fp32 master copy keeps 4 (master) + 4 (exp_avg) + 4 (exp_avg_sq)
    = 12 bytes per parameter; unsharded that is ``12 N`` on every rank.
    """
    return math.ceil(num_params / data_parallel_size) * bytes_per_param
