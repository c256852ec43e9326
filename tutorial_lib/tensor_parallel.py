"""Tensor parallelism: conjugate communication pairs, parallel layers, vocab-parallel loss.

Read it top to bottom, like the chapter:

1. **Who am I in the TP group.**  Every function takes ``tp_group``: a group kind
   (``"tp"``, the default) or ``None`` for *serial*.  Outside a launch (no groups
   built) every layer is its own serial self, so the TP=1 reference is this same code.
2. **The conjugate pairs** (Megatron's ``mappings.py``).  Each communication is an
   ``autograd.Function`` named after what its *forward* does; its backward is the
   conjugate (the transpose) of the forward:

   ======================================================  ======================  ======================
   function                                                forward                 backward
   ======================================================  ======================  ======================
   ``copy_to_tensor_model_parallel_region``                identity                all-reduce
   ``reduce_from_tensor_model_parallel_region``            all-reduce              identity
   ``scatter_to_tensor_model_parallel_region``             split last dim          all-gather last dim
   ``gather_from_tensor_model_parallel_region``            all-gather last dim     split last dim
   ``scatter_to_sequence_parallel_region``                 split seq dim           all-gather seq dim
   ``gather_from_sequence_parallel_region``                all-gather seq dim      reduce-scatter seq dim
   ``reduce_scatter_to_sequence_parallel_region``          reduce-scatter seq dim  all-gather seq dim
   ======================================================  ======================  ======================

   Every collective goes through :mod:`tutorial_lib.comm` on the ``tp`` group, tagged
   ``phase="forward"|"backward"`` and ``op_name=<function name>``, so traces count them.
   With TP size 1 each function returns its input and issues no collective.
   One more function is not a pair: :func:`linear_with_sequence_parallel_all_gather`, the
   column-parallel matmul under sequence parallelism, which all-gathers its input in the
   forward pass, keeps only this rank's shard for backward and gathers it again there.
3. **The layers**: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
   :class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy` (fp32, with
   optional label smoothing).  Each layer builds the *full* master weight from
   ``torch.Generator().manual_seed(seed)`` exactly as its serial counterpart
   (:func:`serial_linear`, :func:`serial_embedding`) would, then keeps its slice
   (Megatron's ``_initialize_affine_weight_cpu``): every shard *is* the matching slice
   of the serial layer.  The master is drawn on the CPU and the slice copied to the
   layer's ``device`` (:mod:`tutorial_lib.devices`), so a GPU holds the same numbers.
4. **Sequence-parallel gradients**: :func:`allreduce_sequence_parallel_grads`, and
   :func:`saved_activation_bytes`, which measures what a layer keeps for backward.

Layout: activations are ``[s, b, h]`` (sequence, batch, hidden) as in Megatron, so
the sequence dimension is dim 0, the one :func:`comm.all_gather` and
:func:`comm.reduce_scatter` work along.  Last-dimension gathers use the same dim-0
collectives followed by a split-and-concatenate.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import comm, parallel_state
from .devices import cpu_generator, resolve_device
from .trace import get_tracer

__all__ = [
    "divide",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "derive_seed", "init_linear_master", "init_embedding_master", "serial_linear", "serial_embedding",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "allreduce_sequence_parallel_grads", "saved_activation_bytes",
    "SavedTensorBytes",
    "linear_with_sequence_parallel_all_gather", "SP_LINEAR", "megatron_label_smoothing_losses",
    "CopyToTensorModelParallelRegion", "ReduceFromTensorModelParallelRegion",
    "ScatterToTensorModelParallelRegion", "GatherFromTensorModelParallelRegion",
    "ScatterToSequenceParallelRegion", "GatherFromSequenceParallelRegion",
    "ReduceScatterToSequenceParallelRegion", "LinearWithSequenceParallelAllGather",
    "VocabParallelCrossEntropy",
]

# --- 1. shapes that must divide by the TP size ---------------------------------------


def divide(numerator: int, denominator: int, what: str,
           by: str = "tensor_model_parallel_size") -> int:
    """``numerator // denominator``, or a ``ValueError`` that names the rule and a fix."""
    if numerator % denominator:
        lower = numerator // denominator * denominator
        options = f"{lower} or {lower + denominator}" if lower else f"{denominator}"
        raise ValueError(f"{what} ({numerator}) must be divisible by {by} ({denominator}); "
                         f"try {what} = {options}")
    return numerator // denominator


def _tags(op_name: str, phase: str):
    return get_tracer().tags(op_name=op_name, phase=phase)


# --- the primitive moves (each issues at most one traced collective) -------------------


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place: autograd may still need x
    return comm.all_reduce(out, group=group)


def _split(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    size, rank = parallel_state.group_size(group), parallel_state.group_rank(group)
    divide(x.shape[dim], size, "seq_length" if dim == 0 else "the last dimension")
    return x.chunk(size, dim=dim)[rank].contiguous()


def _gather_first_dim(x: torch.Tensor, group: str, async_op: bool = False,
                      split_sizes: list[int] | None = None):
    """``[T*s, ...]`` from every rank's ``[s, ...]``; with ``async_op``: ``(out, work)``.

    ``split_sizes``: rank i holds ``split_sizes[i]`` rows (uneven; the MoE dispatcher's
    gather over the expert-TP group)."""
    if split_sizes is not None:
        out = x.new_empty((sum(split_sizes), *x.shape[1:]))
        return comm.all_gather(out, x.contiguous(), group=group, output_split_sizes=split_sizes)
    size = parallel_state.group_size(group)
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if async_op:
        return out, comm.all_gather(out, x.contiguous(), group=group, async_op=True)
    return comm.all_gather(out, x.contiguous(), group=group)


def _gather_last_dim(x: torch.Tensor, group: str) -> torch.Tensor:
    # comm gathers along dim 0: [T*s, b, h/T]; cut it back into T pieces, glue them on the last dim.
    stacked = _gather_first_dim(x, group)
    return torch.cat(stacked.chunk(parallel_state.group_size(group), dim=0), dim=-1).contiguous()


def _reduce_scatter_first_dim(x: torch.Tensor, group: str, async_op: bool = False,
                              split_sizes: list[int] | None = None):
    """My ``[s/T, ...]`` slice of the sum over ranks; with ``async_op``: ``(out, work)``.

    ``split_sizes``: rank i's slice has ``split_sizes[i]`` rows (uneven)."""
    if split_sizes is not None:
        mine = split_sizes[parallel_state.group_rank(group)]
        out = x.new_empty((mine, *x.shape[1:]))
        return comm.reduce_scatter(out, x.contiguous(), group=group, input_split_sizes=split_sizes)
    size = parallel_state.group_size(group)
    divide(x.shape[0], size, "seq_length")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if async_op:
        return out, comm.reduce_scatter(out, x.contiguous(), group=group, async_op=True)
    return comm.reduce_scatter(out, x.contiguous(), group=group)


# --- 2. the conjugate pairs -------------------------------------------------------------


class CopyToTensorModelParallelRegion(torch.autograd.Function):
    """Forward: identity (every TP rank gets the same X).  Backward: all-reduce dX."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        with _tags("copy_to_tensor_model_parallel_region", "backward"):
            return _all_reduce(grad, ctx.group), None


class ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce the partial sums.  Backward: identity (dY is already replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        with _tags("reduce_from_tensor_model_parallel_region", "forward"):
            return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTensorModelParallelRegion(torch.autograd.Function):
    """Forward: keep my slice of the last dim.  Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        with _tags("scatter_to_tensor_model_parallel_region", "backward"):
            return _gather_last_dim(grad, ctx.group), None


class GatherFromTensorModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim.  Backward: keep my slice of the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        with _tags("gather_from_tensor_model_parallel_region", "forward"):
            return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep my slice of the sequence.  Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        with _tags("scatter_to_sequence_parallel_region", "backward"):
            return _gather_first_dim(grad, ctx.group), None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence.  Backward: reduce-scatter the sequence.

    The backward sums because the gathered tensor feeds tensor-parallel matmuls: each
    TP rank's gradient is a partial sum.  With ``tensor_parallel_output_grad=False``
    (the consumer is replicated, so every rank already holds the full gradient) the
    backward only keeps this rank's slice, as in Megatron.
    """

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, split_sizes=None):
        ctx.group, ctx.reduce, ctx.split_sizes = group, tensor_parallel_output_grad, split_sizes
        with _tags("gather_from_sequence_parallel_region", "forward"):
            return _gather_first_dim(x, group, split_sizes=split_sizes)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.reduce:
            if ctx.split_sizes is not None:
                rank = parallel_state.group_rank(ctx.group)
                start = sum(ctx.split_sizes[:rank])
                return grad[start:start + ctx.split_sizes[rank]].contiguous(), None, None, None
            return _split(grad, 0, ctx.group), None, None, None
        with _tags("gather_from_sequence_parallel_region", "backward"):
            return (_reduce_scatter_first_dim(grad, ctx.group, split_sizes=ctx.split_sizes),
                    None, None, None)


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter the partial sums along the sequence.  Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, split_sizes=None):
        ctx.group, ctx.split_sizes = group, split_sizes
        with _tags("reduce_scatter_to_sequence_parallel_region", "forward"):
            return _reduce_scatter_first_dim(x, group, split_sizes=split_sizes)

    @staticmethod
    def backward(ctx, grad):
        with _tags("reduce_scatter_to_sequence_parallel_region", "backward"):
            return _gather_first_dim(grad, ctx.group, split_sizes=ctx.split_sizes), None, None


def copy_to_tensor_model_parallel_region(x, tp_group="tp"):
    """Identity forward, all-reduce backward: enters a column-parallel matmul."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return CopyToTensorModelParallelRegion.apply(x, tp_group)


def reduce_from_tensor_model_parallel_region(x, tp_group="tp"):
    """All-reduce forward, identity backward: leaves a row-parallel matmul."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return ReduceFromTensorModelParallelRegion.apply(x, tp_group)


def scatter_to_tensor_model_parallel_region(x, tp_group="tp"):
    """Split the last dim forward, all-gather it backward."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return ScatterToTensorModelParallelRegion.apply(x, tp_group)


def gather_from_tensor_model_parallel_region(x, tp_group="tp"):
    """All-gather the last dim forward, split it backward."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return GatherFromTensorModelParallelRegion.apply(x, tp_group)


def scatter_to_sequence_parallel_region(x, tp_group="tp"):
    """Split the sequence (dim 0) forward, all-gather it backward."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return ScatterToSequenceParallelRegion.apply(x, tp_group)


def gather_from_sequence_parallel_region(x, tp_group="tp", tensor_parallel_output_grad=True,
                                         output_split_sizes: list[int] | None = None):
    """All-gather the sequence (dim 0) forward, reduce-scatter it backward.

    ``output_split_sizes``: how many rows each rank of the group holds, when they differ
    (Megatron's argument of the same name; the MoE dispatcher gathers its tokens over the
    expert-TP group with it)."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return GatherFromSequenceParallelRegion.apply(x, tp_group, tensor_parallel_output_grad,
                                                  output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(x, tp_group="tp",
                                               input_split_sizes: list[int] | None = None):
    """Reduce-scatter the sequence (dim 0) forward, all-gather it backward.

    ``input_split_sizes``: the rows of each rank's slice, when they differ (Megatron's
    argument of the same name)."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return ReduceScatterToSequenceParallelRegion.apply(x, tp_group, input_split_sizes)


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


# --- 3. one seed, one master weight, many shards ------------------------------------------


def derive_seed(seed: int, component: int) -> int:
    """The seed of one part of a module seeded ``seed``: ``1000 * seed + component``.

    Every model derives its weights' seeds this way, and only this way (the GPT's
    embeddings and blocks, a block's sublayers, an MoE layer's router and experts), so
    distinct parts never share random numbers and every rank derives the same seeds:
    every TP / EP rank draws the same master weight and keeps its own slice.
    """
    return 1000 * seed + component


def init_linear_master(input_size: int, output_size: int, bias: bool = True, seed: int = 0):
    """The full ``[output_size, input_size]`` weight (and bias) a serial layer would get.

    ``torch.nn.Linear``'s distribution, U(-1/sqrt(in), 1/sqrt(in)), drawn from one seeded
    CPU generator (weight first, then bias), on the CPU, so every TP size and every
    device slices the same numbers.
    """
    generator = cpu_generator(seed)
    bound = 1.0 / math.sqrt(input_size)
    weight = torch.empty(output_size, input_size, device="cpu").uniform_(
        -bound, bound, generator=generator)
    bias_ = (torch.empty(output_size, device="cpu").uniform_(-bound, bound, generator=generator)
             if bias else None)
    return weight, bias_


def init_embedding_master(num_embeddings: int, embedding_dim: int, seed: int = 0) -> torch.Tensor:
    """The full ``[num_embeddings, embedding_dim]`` table, N(0, 1) like ``torch.nn.Embedding``
    (on the CPU, from a seeded CPU generator)."""
    generator = cpu_generator(seed)
    return torch.empty(num_embeddings, embedding_dim, device="cpu").normal_(
        0.0, 1.0, generator=generator)


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


# --- 4. the layers -------------------------------------------------------------------------


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


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over a vocabulary split across TP ranks, in fp32; backward is local."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        size, rank = parallel_state.group_size(group), parallel_state.group_rank(group)
        per_rank = logits.shape[-1]
        vocab, start = per_rank * size, rank * per_rank
        ctx.logits_dtype = logits.dtype
        # At least fp32 (fp64 stays fp64): bf16 would round exp, sums and log to 3 digits.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        with _tags("vocab_parallel_cross_entropy", "forward"):
            # 1. the global max, for a stable exp (it cancels out of the loss)
            logits_max = logits.max(dim=-1).values
            if size > 1:
                comm.all_reduce(logits_max, group=group, op="max")
            shifted = logits - logits_max.unsqueeze(-1)
            # 2. the target's logit: only the rank that owns the target id has it
            outside = (target < start) | (target >= start + per_rank)
            local_target = (target - start).masked_fill(outside, 0)
            target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            target_logit = target_logit.masked_fill(outside, 0.0)
            if label_smoothing:
                # The smoothed target: 1 - eps on the label, eps / V on every id. Its
                # logit term, (1 - eps) z_target + eps * mean(z), is a sum over the
                # vocabulary like z_target: the same all-reduce sums it.
                target_logit = ((1.0 - label_smoothing) * target_logit
                                + label_smoothing / vocab * shifted.sum(dim=-1))
            # 3. the softmax denominator, summed over every rank's slice of the vocabulary
            exp_logits = shifted.exp()
            sum_exp = exp_logits.sum(dim=-1)
            if size > 1:
                comm.all_reduce(target_logit, group=group)
                comm.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        ctx.save_for_backward(exp_logits / sum_exp.unsqueeze(-1), local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logits = softmax - smoothed target: both are known on my slice.
        softmax, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        on_label = (1.0 - eps) * (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_label.unsqueeze(-1))
        if eps:
            grad -= eps / ctx.vocab
        grad = grad * grad_loss.unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 tp_group="tp", label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``log sum_v exp(z_v) - z_target`` from this rank's ``[..., V/T]`` logits.

    Forward: three all-reduces of one number per token (max, target logit, sum of
    exponentials), never the ``[..., V]`` logits.  Backward: no communication.
    ``target`` holds global vocabulary ids, the same on every TP rank.  The loss is
    computed and returned in fp32 (fp64 for fp64 logits) whatever the logits' dtype
    (Megatron-Core >= 0.8 upcasts too); the gradient comes back in the logits' dtype.

    ``label_smoothing`` (``eps`` in ``[0, 1)``): ``torch.nn.functional.cross_entropy``'s
    convention, the target ``(1 - eps) one_hot + eps / V``, so the loss is
    ``(1 - eps) (logZ - z_target) + eps (logZ - mean_v z_v)`` with the mean over the whole
    vocabulary: the same on every TP rank and at every TP size.  It costs no extra
    collective.  (Megatron-Core 0.20.0's smoothing differs by rank: see
    :func:`megatron_label_smoothing_losses`.)
    """
    vocab = logits_shard.shape[-1] * parallel_state.group_size(tp_group)
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise ValueError(f"target ids must lie in [0, {vocab}) (the vocabulary size), "
                         f"got ids from {int(target.min())} to {int(target.max())}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1) (the share of the target spread "
                         f"over the vocabulary), got {label_smoothing}; try 0.1")
    return VocabParallelCrossEntropy.apply(logits_shard, target, float(label_smoothing), tp_group)


def megatron_label_smoothing_losses(logits: torch.Tensor, target: torch.Tensor,
                                    label_smoothing: float, tp_size: int):
    """The loss each of ``tp_size`` ranks returns under Megatron-Core 0.20.0's label
    smoothing (``_VocabParallelCrossEntropy`` in ``megatron/core/tensor_parallel/
    cross_entropy.py``, d98e8a64), recomputed serially from all the logits, ``[..., V]``.

    A teaching model of that formula, not used in training: returns ``[tp_size, ...]``.
    Upstream normalises the probabilities over the whole vocabulary (its all-reduces),
    then smooths with what it has on the rank: the width of the rank's slice, ``V/T``,
    stands in for ``V`` in the coefficient ``eps V / (V - 1)``, and the mean of the log
    probabilities is taken over the rank's slice only.  So each rank's loss depends on
    which slice it holds, and even at ``T = 1`` its target puts ``eps / (V - 1)`` on
    each id but the label, where torch's puts ``eps / V`` on every id.
    """
    log_probs = logits.float().log_softmax(dim=-1)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    losses = []
    for piece in log_probs.chunk(tp_size, dim=-1):
        width = piece.shape[-1]  # upstream's "vocab_size": the slice's width, not V
        coefficient = label_smoothing * width / (width - 1)
        losses.append((1.0 - coefficient) * nll - coefficient * piece.mean(dim=-1))
    return torch.stack(losses)


# --- 5. sequence parallelism's extra gradient sync -------------------------------------------


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


# --- 6. what a layer keeps for backward ------------------------------------------------------


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class SavedTensorBytes:
    """Count the bytes autograd saves for backward while the ``with`` block runs.

    ``with SavedTensorBytes(module.parameters()) as saved: forward()``, then ``saved.bytes``:
    the storages of the saved tensors (a saved view keeps its whole storage), each once,
    those of ``exclude`` (the parameters) left out
    (``torch.autograd.graph.saved_tensors_hooks``).  The tensors are kept as they are.
    What the pipeline executor counts per microbatch and chunk (chapter 10).
    """

    def __init__(self, exclude=()):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.exclude and pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self):
        self.seen.clear()  # a storage counts once per block (a later one may reuse the address)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _keep)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False


@contextmanager
def saved_activation_bytes(modules: dict[str, torch.nn.Module]):
    """Measure the bytes autograd keeps for backward inside each module's forward.

    ``with saved_activation_bytes({"qkv": block.self_attention.linear_qkv}) as saved:`` run
    forward, then ``saved["qkv"]`` is the bytes of the tensors that module's autograd
    nodes saved (:class:`SavedTensorBytes`: each storage once, the module's own parameters
    left out): its saved activations.  Summed over every forward inside the ``with`` block
    (each storage once per forward).  Modules must not contain one another.
    """
    saved = {name: 0 for name in modules}
    handles = []

    def watch(name, module):
        counters = []

        def enter(mod, args):
            counters.append(SavedTensorBytes(module.parameters()).__enter__())

        def leave(mod, args, output):
            counter = counters.pop()
            counter.__exit__(None, None, None)
            saved[name] += counter.bytes

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))

    for name, module in modules.items():
        watch(name, module)
    try:
        yield saved
    finally:
        for handle in handles:
            handle.remove()
