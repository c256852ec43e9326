"""One training step with tensor and data parallelism, and the data it eats.

The whole step, on every rank (``T`` TP ranks x ``D`` DP replicas; ``M`` microbatches)::

    batch = my DP replica's share of the global batch          split_global_batch
    for i in 0 .. M-1:                                         (gradient accumulation)
        loss_i = model(microbatch i) / M      forward          TP collectives inside the layers
        loss_i.backward()                     backward         TP collectives; on the LAST
                                                               microbatch the DP buckets'
                                                               all-reduces start from hooks
    wait for the DP all-reduces                                DataParallel.finish_grad_sync
    all-reduce the sequence-parallel grads over TP             allreduce_sequence_parallel_grads
    clip by the global gradient norm                           clip_grad_norm_ (all-reduce over TP)
    optimizer step                                             local on my shards; ZeRO-1:
                                                               reduce-scatter + all-gather over DP
    (logging) average the loss over DP                         one 4-byte all-reduce

Who talks to whom (the seed note's rule of thumb): TP collectives stay inside one DP
replica and carry *activations*; DP collectives connect the replicas of one shard and
carry *parameter gradients*; no collective ever spans the whole world.  In
particular the loss needs no world all-reduce: every TP rank already holds its
replica's loss (the vocabulary-parallel cross-entropy all-reduced it), the gradients
are made consistent by the DP average, and averaging the loss over DP only serves the
log line (``log_loss=False`` skips it and returns this replica's loss).

Two ways to run the DP part, one per wrapper (see :mod:`tutorial_lib.data_parallel`):

* ``DataParallel(model)`` + a plain optimizer (Adam): every replica averages every
  gradient (bucketed all-reduce, overlapped with the last backward) and updates
  every parameter of its shard;
* the bare model + ``DistributedOptimizer`` (ZeRO-1): no communication during
  backward; in ``optimizer.step()`` a reduce-scatter gives each DP rank the average
  of 1/D of the gradients, it clips and updates that slice, and an all-gather brings
  every replica the updated parameters.

Without process groups (a plain Python session) the same ``train_step`` runs the
serial model: nothing to sync, ``torch.nn.utils.clip_grad_norm_`` for the clip.

Trace: compute spans ``forward``/``backward`` (tag ``microbatch``), ``grad_sync``,
``clip_grad`` and ``optimizer``; every collective carries a ``phase`` tag
(``forward``, ``backward``, ``grad_sync``, ``clip_grad``, ``optimizer``, ``logging``)
that :func:`tutorial_lib.costs.tp_dp_step_collectives` predicts row by row.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch

from . import comm, parallel_state
from .data_parallel import DataParallel, DistributedOptimizer, clip_grad_norm_
from .tensor_parallel import allreduce_sequence_parallel_grads
from .trace import get_tracer

__all__ = ["StepResult", "train_step", "split_global_batch", "split_microbatches", "synthetic_batch"]


# --- the data -------------------------------------------------------------------------------


def synthetic_batch(seed: int, step: int, global_batch_size: int, seq_length: int,
                    vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable global batch: ``(input_ids, labels)``, each ``[global_batch_size, seq_length]``.

    Each sequence counts through the vocabulary from a random start with a random
    stride of 1, 2 or 3: ``x_t = (start + stride * t) mod vocab_size``.  The label of
    each token is the next one, so a model that reads the previous token (to learn the
    stride) can predict every label but the first.  It depends only on ``(seed, step)``,
    never on the layout: every TP and DP size trains on the very same numbers.
    """
    generator = torch.Generator().manual_seed(1_000_003 * seed + step)
    start = torch.randint(0, vocab_size, (global_batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (global_batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq_length + 1)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def split_global_batch(global_batch, dp_rank: int, dp_size: int):
    """Data-parallel replica ``dp_rank``'s rows of every tensor in ``global_batch``.

    Replica ``r`` of ``D`` gets rows ``[r * B/D, (r + 1) * B/D)``: contiguous, so
    replica 0's first microbatch is the first rows of the global batch.
    """
    rows = global_batch[0].shape[0]
    if rows % dp_size:
        raise ValueError(f"global_batch_size ({rows}) must be divisible by the data-parallel "
                         f"size ({dp_size}) so every replica gets the same number of sequences (rule 3)")
    share = rows // dp_size
    return tuple(t[dp_rank * share:(dp_rank + 1) * share] for t in global_batch)


def split_microbatches(batch, num_microbatches: int) -> list[tuple]:
    """Cut a replica's batch into ``num_microbatches`` equal microbatches (along rows)."""
    rows = batch[0].shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"this replica's batch ({rows} sequences) must be divisible by "
                         f"num_microbatches ({num_microbatches}) (rule 3); choose one of "
                         f"{[m for m in range(1, rows + 1) if rows % m == 0]}")
    return list(zip(*(t.chunk(num_microbatches) for t in batch)))


# --- one step -----------------------------------------------------------------------------


class StepResult(NamedTuple):
    """What one step reports (both for logging; neither is needed for correctness)."""

    loss: float
    """Mean loss over the global batch (over this replica's share if ``log_loss=False``)."""
    grad_norm: float | None
    """The global gradient norm before clipping (``None`` when not clipping)."""


def _data_parallel_size() -> int:
    return parallel_state.get_size("dp") if parallel_state.is_initialized() else 1


def _check_setup(model, optimizer) -> None:
    wrapped = isinstance(model, DataParallel)
    zero1 = isinstance(optimizer, DistributedOptimizer)
    if wrapped and zero1:
        raise ValueError("DistributedOptimizer (ZeRO-1) replaces DataParallel's all-reduce with its "
                         "own reduce-scatter: give train_step the bare model, not DataParallel(model)")
    dp = _data_parallel_size()
    if dp > 1 and not (wrapped or zero1):
        raise ValueError(f"with {dp} data-parallel replicas the gradients must be averaged over them: "
                         f"wrap the model in DataParallel (plain optimizer) or use a "
                         f"DistributedOptimizer (ZeRO-1) on the bare model")


def _clip(params, max_grad_norm: float) -> float:
    if not parallel_state.is_initialized():  # serial: torch's own clip is the reference
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    return float(clip_grad_norm_(params, max_grad_norm))


def train_step(model, optimizer, batch, num_microbatches: int, max_grad_norm: float | None = None,
               log_loss: bool = True) -> StepResult:
    """One optimizer step of TP + DP training with gradient accumulation; every rank calls it.

    ``model``: a :class:`~tutorial_lib.model.GPTModel`, wrapped in
    :class:`~tutorial_lib.data_parallel.DataParallel` unless ``optimizer`` is a
    :class:`~tutorial_lib.data_parallel.DistributedOptimizer` (ZeRO-1; then bare).
    ``batch``: ``(input_ids, labels)``, this DP replica's share of the global batch
    (:func:`split_global_batch`), the same on every TP rank of the replica.
    ``num_microbatches``: ``M``; each microbatch's loss is scaled by ``1/M`` so the
    accumulated gradient is that of the replica's mean loss.
    ``max_grad_norm``: clip by the global norm (``None``: no clipping).  With ZeRO-1 it is
    handed to the optimizer, which clips between its reduce-scatter and its update.
    ``log_loss``: average the reported loss over DP (one 4-byte all-reduce).

    When it returns, ``param.grad`` still holds what the optimizer used (DataParallel:
    the DP average, clipped; ZeRO-1: this replica's own sum, the average lives in the
    optimizer's shards), so a test can compare it with the serial model's gradient.
    """
    _check_setup(model, optimizer)
    tracer = get_tracer()
    wrapped = isinstance(model, DataParallel)
    zero1 = isinstance(optimizer, DistributedOptimizer)
    gpt = model.module if wrapped else model

    model.zero_grad()      # DataParallel: zero the bucket buffers, forget last step's launches
    optimizer.zero_grad()

    # 1. forward + backward of each microbatch; gradients accumulate in place.
    microbatches = split_microbatches(batch, num_microbatches)
    replica_loss = torch.zeros(())
    for i, (input_ids, labels) in enumerate(microbatches):
        last = i == num_microbatches - 1
        # Only the last backward communicates: earlier ones just add into the buckets.
        quiet = model.no_sync() if wrapped and not last else nullcontext()
        with tracer.tags(microbatch=i), quiet:
            with tracer.span("forward", microbatch=i):
                loss = model(input_ids, labels) / num_microbatches
            with tracer.span("backward", microbatch=i):
                loss.backward()
        replica_loss += loss.detach()

    # 2. the DP average: the buckets' all-reduces started during the last backward.
    if wrapped:
        with tracer.span("grad_sync"):
            model.finish_grad_sync()
    # 3. sequence parallelism: LayerNorm and row-parallel-bias grads are partial sums over TP.
    allreduce_sequence_parallel_grads(gpt, gpt.tp_group)

    # 4 + 5. clip by the global norm, then update (ZeRO-1 does both inside its step).
    grad_norm = None
    if zero1:
        optimizer.max_grad_norm = max_grad_norm
    elif max_grad_norm is not None:
        with tracer.span("clip_grad"):
            grad_norm = _clip(gpt.parameters(), max_grad_norm)
    with tracer.span("optimizer"):
        optimizer.step()
    if zero1 and max_grad_norm is not None:
        grad_norm = float(optimizer.last_grad_norm)

    # 6. logging only: the mean over the replicas (the TP ranks of a replica already agree).
    dp = _data_parallel_size()
    if log_loss and dp > 1:
        with tracer.tags(phase="logging"):
            comm.all_reduce(replica_loss, group="dp")
        replica_loss /= dp
    return StepResult(loss=float(replica_loss), grad_norm=grad_norm)
