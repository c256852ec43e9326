"""The tensor-parallel layers (Megatron's ``layers.py``).

:class:`ColumnParallelLinear`, :class:`RowParallelLinear` and :class:`VocabParallelEmbedding`
each build the *full* master weight (:mod:`.random`) as their serial counterparts
(:func:`serial_linear`, :func:`serial_embedding`) would, then keep their slice, copied to
the layer's ``device``.  They talk only through the conjugate pairs of :mod:`.mappings`.
One function is not a pair: :func:`linear_with_sequence_parallel_all_gather`, the
column-parallel matmul under sequence parallelism, which all-gathers its input in the
forward pass, keeps only this rank's shard for backward and gathers it again there.
Sequence parallelism's extra gradient sync: :func:`allreduce_sequence_parallel_grads`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm, parallel_state
from ..devices import resolve_device
from .mappings import (_gather_first_dim, _reduce_scatter_first_dim, _tags, divide,
                       copy_to_tensor_model_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .random import init_embedding_master, init_linear_master

__all__ = [
    "SP_LINEAR", "LinearWithSequenceParallelAllGather", "linear_with_sequence_parallel_all_gather",
    "serial_linear", "serial_embedding", "ColumnParallelLinear", "RowParallelLinear",
    "VocabParallelEmbedding", "allreduce_sequence_parallel_grads",
]


# --- the column-parallel matmul under sequence parallelism ---------------------------------

SP_LINEAR = "linear_with_sequence_parallel_all_gather"
"""The ``op_name`` of the collectives of :class:`LinearWithSequenceParallelAllGather`."""


class LinearWithSequenceParallelAllGather(torch.autograd.Function):
    """``F.linear`` of the all-gathered sequence, keeping only this rank's shard for backward.

    The sequence-parallel branch of Megatron-Core 0.20.0's
    ``LinearWithGradAccumulationAndAsyncCommunication`` (``megatron/core/tensor_parallel/
    layers.py``, d98e8a64), without its fused gradient accumulation.
    Forward: all-gather ``x`` (``[s/T, b, in]``) to ``[s, b, in]`` and multiply.  A plain
    ``F.linear`` of the gathered input would keep the whole ``[s, b, in]`` for its weight
    gradient; this function keeps the ``[s/T, b, in]`` shard instead.  Backward:

    1. start an asynchronous all-gather of the saved shard (the input again, for dW);
    2. meanwhile compute ``dX = dY W`` for the whole sequence (partial sums over TP);
    3. wait for the gather; start an asynchronous reduce-scatter of ``dX`` (each rank
       keeps the summed gradient of its own tokens);
    4. meanwhile compute ``dW = dY^T X`` and ``db``; wait for the reduce-scatter.

    One more all-gather per layer in backward (``s/T * b * in`` elements a rank), hidden
    behind the two matmuls on a GPU, in exchange for storing ``1/T`` of the input.  All
    three collectives are tagged ``op_name="linear_with_sequence_parallel_all_gather"``
    (:data:`SP_LINEAR`).
    A precision recipe (:mod:`tutorial_lib.precision`) rounds the forward matmul here but
    not the two backward ones.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # my shard of the sequence, not the gathered input
        with _tags(SP_LINEAR, "forward"):
            total = _gather_first_dim(x, group)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        grad_output = grad_output.contiguous()
        if need_dw:
            with _tags(SP_LINEAR, "backward"):
                total, gathering = _gather_first_dim(x, ctx.group, async_op=True)
        # dX = dY W needs no input: compute it while the gather runs
        grad_total = grad_output.matmul(weight) if need_dx else None
        grad_x = grad_weight = grad_bias = None
        if need_dw:
            gathering.wait()
        if need_dx:
            with _tags(SP_LINEAR, "backward"):
                grad_x, scattering = _reduce_scatter_first_dim(grad_total, ctx.group,
                                                               async_op=True)
        if need_dw:  # dW while the reduce-scatter runs
            grad_weight = grad_output.flatten(0, -2).t().matmul(total.flatten(0, -2))
        if ctx.has_bias and need_db:
            grad_bias = grad_output.flatten(0, -2).sum(dim=0)
        if need_dx:
            scattering.wait()
        return grad_x, grad_weight, grad_bias, None


def linear_with_sequence_parallel_all_gather(x, weight, bias=None, tp_group="tp"):
    """``F.linear(all_gather(x), weight, bias)`` that keeps only ``x`` (this rank's tokens)
    for backward and gathers it again there (:class:`LinearWithSequenceParallelAllGather`).

    ``x``: ``[s/T, b, in]``; returns ``[s, b, out_shard]``.  With TP size 1: ``F.linear``.
    """
    if parallel_state.group_size(tp_group) == 1:
        return F.linear(x, weight, bias)
    return LinearWithSequenceParallelAllGather.apply(x, weight, bias, tp_group)


# --- serial layers and shards ---------------------------------------------------------


def serial_linear(input_size: int, output_size: int, bias: bool = True,
                  seed: int = 0, device=None) -> torch.nn.Linear:
    """The plain ``nn.Linear`` whose slices the parallel linears hold (the TP=1 reference),
    on ``device`` (``None``: torch's default)."""
    weight, bias_ = init_linear_master(input_size, output_size, bias, seed)
    layer = torch.nn.Linear(input_size, output_size, bias=bias, device=resolve_device(device))
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(bias_)
    return layer


def serial_embedding(num_embeddings: int, embedding_dim: int, seed: int = 0,
                     device=None) -> torch.nn.Embedding:
    """The plain ``nn.Embedding`` whose vocabulary ranges the parallel embedding holds, on
    ``device`` (``None``: torch's default)."""
    layer = torch.nn.Embedding(num_embeddings, embedding_dim, device=resolve_device(device))
    with torch.no_grad():
        layer.weight.copy_(init_embedding_master(num_embeddings, embedding_dim, seed))
    return layer


def _shard_parameter(full: torch.Tensor, dim: int | None, group,
                     device=None) -> torch.nn.Parameter:
    """My slice of ``full`` along ``dim`` (``None``: replicated), copied to ``device``,
    flagged like Megatron's."""
    size, rank = parallel_state.group_size(group), parallel_state.group_rank(group)
    data = full if dim is None else full.chunk(size, dim=dim)[rank]
    param = torch.nn.Parameter(data.to(resolve_device(device), copy=True))
    param.tensor_model_parallel = dim is not None
    param.partition_dim = dim
    return param


# --- the layers ----------------------------------------------------------------------------


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by output features: ``A = [A_1 ... A_T]``.

    Weight shard ``[output_size / T, input_size]``.  The input enters through
    :func:`copy_to_tensor_model_parallel_region` (backward: all-reduce dX), or, with
    ``sequence_parallel``, is all-gathered from ``[s/T, b, in]`` inside
    :func:`linear_with_sequence_parallel_all_gather`, which keeps only the
    ``[s/T, b, in]`` shard for backward and all-gathers it again there for dW (backward:
    all-gather the input, reduce-scatter dX), as Megatron-Core does.
    The output stays split ``[..., output_size / T]`` unless ``gather_output``.
    ``device``: where the shards live (``None``: torch's default device).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, seed: int = 0,
                 tp_group: str | None = "tp", device=None):
        super().__init__()
        self.tp_group = tp_group
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, parallel_state.group_size(tp_group),
                                                "output_size")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        weight, bias_ = init_linear_master(input_size, output_size, bias, seed)
        self.weight = _shard_parameter(weight, 0, tp_group, device)
        self.bias = _shard_parameter(bias_, 0, tp_group, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = linear_with_sequence_parallel_all_gather(x, self.weight, self.bias, self.tp_group)
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x, self.tp_group), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """``Y = X A + b`` with ``A`` split by input features: ``A = [A_1; ...; A_T]``.

    Weight shard ``[output_size, input_size / T]``.  Each rank's ``X_i A_i`` is a
    partial sum: it leaves through :func:`reduce_from_tensor_model_parallel_region`
    (all-reduce) or, with ``sequence_parallel``,
    :func:`reduce_scatter_to_sequence_parallel_region` (to ``[s/T, b, out]``).  The
    bias is replicated and added *after* the reduction (else it would be added T times).
    ``device``: where the shards live (``None``: torch's default device).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seed: int = 0,
                 tp_group: str | None = "tp", device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel=True needs "
                             "input_is_parallel=True: its input must already be split by "
                             "features (the output of a ColumnParallelLinear), as in Megatron")
        self.tp_group = tp_group
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, parallel_state.group_size(tp_group), "input_size")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        weight, bias_ = init_linear_master(input_size, output_size, bias, seed)
        self.weight = _shard_parameter(weight, 1, tp_group, device)
        self.bias = _shard_parameter(bias_, None, tp_group, device) if bias else None
        if self.bias is not None:
            # With sequence parallelism each rank adds the bias to its own tokens only,
            # so its gradient is a partial sum (see allreduce_sequence_parallel_grads).
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding table split by vocabulary: TP rank i holds rows ``[i V/T, (i+1) V/T)``.

    Ids outside my range look up row 0 and are then zeroed, so the sum over TP ranks
    (:func:`reduce_from_tensor_model_parallel_region`) holds every token's one real row.
    Ids ``[s, b]`` give ``[s, b, h]``; with ``sequence_parallel`` the sum is
    reduce-scattered instead, giving this rank's ``[s/T, b, h]`` slice of the sequence.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, seed: int = 0,
                 sequence_parallel: bool = False, tp_group: str | None = "tp", device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = divide(num_embeddings, parallel_state.group_size(tp_group), "num_embeddings")
        self.vocab_start_index = parallel_state.group_rank(tp_group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        table = init_embedding_master(num_embeddings, embedding_dim, seed)
        self.weight = _shard_parameter(table, 0, tp_group, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(rows, self.tp_group)
        return reduce_from_tensor_model_parallel_region(rows, self.tp_group)


# --- sequence parallelism's extra gradient sync -------------------------------------------


def allreduce_sequence_parallel_grads(module: torch.nn.Module, tp_group="tp") -> None:
    """Sum over TP the gradients of parameters flagged ``sequence_parallel=True``.

    With sequence parallelism the LayerNorms (and the row-parallel biases) run on
    ``[s/T, b, h]``: each TP rank saw only its own tokens, so its gradient of a
    *replicated* weight is a partial sum over those tokens.  The true gradient is the
    sum over TP ranks.  Call after backward, before the optimizer (in Megatron this is
    part of ``finalize_model_grads``).  One all-reduce of one flat buffer, tagged
    ``phase="grad_sync"``.
    """
    if parallel_state.group_size(tp_group) == 1:
        return
    flagged = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    pending = [p for p in flagged if p.grad is None and hasattr(p, "main_grad")]
    if pending:
        # DataParallel keeps gradients in `main_grad` and sets `grad` only in
        # finish_grad_sync(): before that there is nothing here to reduce.
        raise RuntimeError(f"allreduce_sequence_parallel_grads found {len(pending)} sequence-parallel "
                           f"parameters whose gradients are still in DataParallel's buckets; call "
                           f"model.finish_grad_sync() first, then this function")
    grads = [p.grad for p in flagged if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _tags("allreduce_sequence_parallel_grads", "grad_sync"):
        comm.all_reduce(flat, group=tp_group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
