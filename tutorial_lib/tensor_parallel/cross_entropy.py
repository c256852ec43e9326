"""Vocabulary-parallel cross-entropy (Megatron's ``cross_entropy.py``).

:func:`vocab_parallel_cross_entropy`: the loss from logits split by vocabulary over the TP
ranks, in fp32, with optional label smoothing; three all-reduces of one number per token in
forward, none in backward.  :func:`megatron_label_smoothing_losses`: Megatron-Core's own
smoothing, recomputed serially, to compare with.
"""
from __future__ import annotations

import torch

from .. import comm, parallel_state
from .mappings import _tags

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
           "megatron_label_smoothing_losses"]



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
