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

Who talks to whom, as a rule of thumb: TP collectives stay inside one DP
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

A bf16 model (``model.bfloat16()``) trains with an fp32 master copy of its weights:
``DataParallel(model, grad_reduce_in_fp32=True)`` + ``Float16OptimizerWithFloat16Params``
(every rank keeps all of it), or the bare model + ``DistributedOptimizer`` (1/D each).

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
from .data import split_microbatches
from .data_parallel import (DataParallel, DistributedOptimizer, Float16OptimizerWithFloat16Params,
                            clip_grad_norm_)
from .devices import module_device
from .tensor_parallel import allreduce_sequence_parallel_grads
from .trace import get_tracer

__all__ = ["StepResult", "train_step", "finish_step"]



class StepResult(NamedTuple):
    """What one step reports (both for logging; neither is needed for correctness)."""

    loss: float
    """Mean loss over the global batch (over this replica's share if ``log_loss=False``)."""
    grad_norm: float | None
    """The global gradient norm before clipping (``None`` when not clipping)."""


def _check_setup(model, optimizer) -> None:
    wrapped = isinstance(model, DataParallel)
    zero1 = isinstance(optimizer, DistributedOptimizer)
    if wrapped and zero1:
        raise ValueError("DistributedOptimizer (ZeRO-1) replaces DataParallel's all-reduce with its "
                         "own reduce-scatter: give train_step the bare model, not DataParallel(model)")
    dp = parallel_state.group_size("dp")
    if dp > 1 and not (wrapped or zero1):
        raise ValueError(f"with {dp} data-parallel replicas the gradients must be averaged over them: "
                         f"wrap the model in DataParallel (plain optimizer) or use a "
                         f"DistributedOptimizer (ZeRO-1) on the bare model")


def _check_sequence_parallel_grads(module, tp_group) -> None:
    """Refuse what the sequence-parallel sum cannot read: a gradient held only in an fp32
    ``main_grad`` (bf16 parameters under ``DataParallel(grad_reduce_in_fp32=True)`` or a
    bf16 ZeRO-1), which ``allreduce_sequence_parallel_grads`` does not look at."""
    if parallel_state.group_size(tp_group) == 1:
        return
    stuck = [name for name, p in module.named_parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is None
             and getattr(p, "main_grad", None) is not None and p.main_grad.dtype != p.dtype]
    if stuck:
        raise ValueError(f"sequence parallelism with bf16 parameters whose gradients are kept in "
                         f"fp32 (e.g. {stuck[0]}) is not supported: allreduce_sequence_parallel_grads "
                         f"reads .grad only; run with sequence_parallel=False, or keep the model fp32")


def _clip(params, max_grad_norm: float) -> float:
    if not parallel_state.is_initialized():  # serial: torch's own clip is the reference
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    return float(clip_grad_norm_(params, max_grad_norm))


def train_step(model, optimizer, batch, num_microbatches: int, max_grad_norm: float | None = None,
               log_loss: bool = True) -> StepResult:
    """One optimizer step of TP + DP training with gradient accumulation; every rank calls it.

    ``model``: a :class:`~tutorial_lib.gpt.GPTModel`, wrapped in
    :class:`~tutorial_lib.data_parallel.DataParallel` unless ``optimizer`` is a
    :class:`~tutorial_lib.data_parallel.DistributedOptimizer` (ZeRO-1; then bare).
    ``batch``: ``(input_ids, labels)``, this DP replica's share of the global batch
    (:func:`tutorial_lib.data.split_global_batch`), the same on every TP rank of the replica.
    ``num_microbatches``: ``M``; each microbatch's loss is scaled by ``1/M`` so the
    accumulated gradient is that of the replica's mean loss.
    ``max_grad_norm``: clip by the global norm (``None``: no clipping).  With ZeRO-1 it is
    handed to the optimizer, which clips between its reduce-scatter and its update.
    ``log_loss``: average the reported loss over DP (one 4-byte all-reduce).

    When it returns, ``param.grad`` still holds what the optimizer used (DataParallel:
    the DP average, clipped; ZeRO-1: this replica's own sum, the average lives in the
    optimizer's shards), so a test can compare it with the serial model's gradient.
    A bf16 parameter whose gradient is accumulated in fp32 holds it in ``param.main_grad``
    instead (its ``.grad`` is ``None``), and the clip acts on the optimizer's fp32 copies.
    """
    _check_setup(model, optimizer)
    tracer = get_tracer()
    wrapped = isinstance(model, DataParallel)
    gpt = model.module if wrapped else model

    model.zero_grad()      # DataParallel: zero the buckets, forget last step's launches
    optimizer.zero_grad()

    # 1. forward + backward of each microbatch; gradients accumulate in place.
    microbatches = split_microbatches(batch, num_microbatches)
    replica_loss = torch.zeros((), device=module_device(gpt))
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

    # 2-5. the DP average, the sequence-parallel sums, clipping and the update.
    grad_norm = finish_step(model, optimizer, max_grad_norm, gpt.tp_group)

    # 6. logging only: the mean over the replicas (the TP ranks of a replica already agree).
    dp = parallel_state.group_size("dp")
    if log_loss and dp > 1:
        with tracer.tags(phase="logging", op_name="train_step"):
            comm.all_reduce(replica_loss, group="dp")
        replica_loss /= dp
    return StepResult(loss=float(replica_loss), grad_norm=grad_norm)


def finish_step(model, optimizer, max_grad_norm: float | None, tp_group: str | None = "tp") -> float | None:
    """The end of every training step, once the last backward has run; returns the grad norm.

    Chapter 3's :func:`train_step` and the 4D run (:mod:`tutorial_lib.train_4d`) share it::

        wait for the DP all-reduces                   DataParallel.finish_grad_sync (if wrapped)
        all-reduce the sequence-parallel grads        over ``tp_group`` (nothing at TP = 1)
        clip by the global gradient norm              unless ``max_grad_norm`` is None
        optimizer step                                ZeRO-1 clips inside its own step

    ``model``: the module, or :class:`~tutorial_lib.data_parallel.DataParallel` around it.
    The norm is that before clipping (``None`` when not clipping).
    """
    tracer = get_tracer()
    module = model.module if isinstance(model, DataParallel) else model
    if isinstance(model, DataParallel):
        with tracer.span("grad_sync"):   # the buckets' all-reduces started in the last backward
            model.finish_grad_sync()
    # sequence parallelism: LayerNorm and row-parallel-bias grads are partial sums over TP
    _check_sequence_parallel_grads(module, tp_group)
    allreduce_sequence_parallel_grads(module, tp_group)
    # ZeRO-1 and the fp32-master optimizer clip inside their step, on their fp32 gradients.
    clips_in_step = isinstance(optimizer, (DistributedOptimizer, Float16OptimizerWithFloat16Params))
    grad_norm = None
    if clips_in_step:
        optimizer.max_grad_norm = max_grad_norm
    elif max_grad_norm is not None:
        with tracer.span("clip_grad"):
            grad_norm = _clip(module.parameters(), max_grad_norm)
    with tracer.span("optimizer"):
        optimizer.step()
    if clips_in_step and max_grad_norm is not None:
        grad_norm = float(optimizer.last_grad_norm)
    return grad_norm
