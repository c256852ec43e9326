"""The conjugate pairs: tensor parallelism's communication (Megatron's ``mappings.py``).

Each communication is an ``autograd.Function`` named after what its *forward* does; its
backward is the conjugate (the transpose) of the forward:

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

Every function takes ``tp_group``: a group kind (``"tp"``, the default) or ``None`` for
*serial*; outside a launch (no groups built) each returns its input.  Every collective
goes through :mod:`tutorial_lib.comm` on that group, tagged ``phase="forward"|"backward"``
and ``op_name=<function name>``, so traces count them.  With TP size 1 each function
returns its input and issues no collective.

Layout: activations are ``[s, b, h]`` (sequence, batch, hidden) as in Megatron, so the
sequence dimension is dim 0, the one :func:`comm.all_gather` and :func:`comm.reduce_scatter`
work along.  Last-dimension gathers use the same dim-0 collectives followed by a
split-and-concatenate.
"""
from __future__ import annotations

import torch

from .. import comm, parallel_state
from ..trace import get_tracer

__all__ = [
    "divide",
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "CopyToTensorModelParallelRegion", "ReduceFromTensorModelParallelRegion",
    "ScatterToTensorModelParallelRegion", "GatherFromTensorModelParallelRegion",
    "ScatterToSequenceParallelRegion", "GatherFromSequenceParallelRegion",
    "ReduceScatterToSequenceParallelRegion",
]


# --- shapes that must divide by the TP size --- ---------------------------------------


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


# --- the conjugate pairs --- -------------------------------------------------------------


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


def _unless_alone(function: type[torch.autograd.Function], x, tp_group, *args):
    """``function`` applied to ``x`` over ``tp_group``, or ``x`` itself when the group has
    one rank (no collective, no autograd node): the rule every function below follows."""
    if parallel_state.group_size(tp_group) == 1:
        return x
    return function.apply(x, tp_group, *args)


def copy_to_tensor_model_parallel_region(x, tp_group="tp"):
    """Identity forward, all-reduce backward: enters a column-parallel matmul."""
    return _unless_alone(CopyToTensorModelParallelRegion, x, tp_group)


def reduce_from_tensor_model_parallel_region(x, tp_group="tp"):
    """All-reduce forward, identity backward: leaves a row-parallel matmul."""
    return _unless_alone(ReduceFromTensorModelParallelRegion, x, tp_group)


def scatter_to_tensor_model_parallel_region(x, tp_group="tp"):
    """Split the last dim forward, all-gather it backward."""
    return _unless_alone(ScatterToTensorModelParallelRegion, x, tp_group)


def gather_from_tensor_model_parallel_region(x, tp_group="tp"):
    """All-gather the last dim forward, split it backward."""
    return _unless_alone(GatherFromTensorModelParallelRegion, x, tp_group)


def scatter_to_sequence_parallel_region(x, tp_group="tp"):
    """Split the sequence (dim 0) forward, all-gather it backward."""
    return _unless_alone(ScatterToSequenceParallelRegion, x, tp_group)


def gather_from_sequence_parallel_region(x, tp_group="tp", tensor_parallel_output_grad=True,
                                         output_split_sizes: list[int] | None = None):
    """All-gather the sequence (dim 0) forward, reduce-scatter it backward.

    ``output_split_sizes``: how many rows each rank of the group holds, when they differ
    (Megatron's argument of the same name; the MoE dispatcher gathers its tokens over the
    expert-TP group with it)."""
    return _unless_alone(GatherFromSequenceParallelRegion, x, tp_group,
                         tensor_parallel_output_grad, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(x, tp_group="tp",
                                               input_split_sizes: list[int] | None = None):
    """Reduce-scatter the sequence (dim 0) forward, all-gather it backward.

    ``input_split_sizes``: the rows of each rank's slice, when they differ (Megatron's
    argument of the same name)."""
    return _unless_alone(ReduceScatterToSequenceParallelRegion, x, tp_group, input_split_sizes)
