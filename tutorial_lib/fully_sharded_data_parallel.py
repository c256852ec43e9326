"""Sharded data parallelism: ZeRO-2 and ZeRO-3 (FSDP), one unit at a time (chapter 12).

Plain data parallelism keeps on every replica a whole copy of the parameters, of their
gradients and of the optimizer state.  ZeRO (Rajbhandari et al. 2020) cuts the copies
into ``DP`` shards, one per rank, in three stages.  Megatron-Core's Megatron-FSDP names
the four settings ``--data-parallel-sharding-strategy``:

=======================  =====  ================================================
strategy                 ZeRO   each rank keeps whole / its shard of
=======================  =====  ================================================
``no_shard``             0      everything whole: :class:`~tutorial_lib.data_parallel.DataParallel`
``optim``                1      optimizer state sharded: :class:`~tutorial_lib.data_parallel.DistributedOptimizer`
``optim_grads``          2      and the gradients: reduce-scattered per unit in backward
``optim_grads_params``   3      and the parameters: all-gathered per unit when needed (FSDP)
=======================  =====  ================================================

The last two live here.  A **unit** is a module whose parameters travel together (FSDP2's
``fully_shard(module)``; Megatron-FSDP's FSDP unit): usually one Transformer block each,
and the *root* unit for everything else (embedding, final LayerNorm, output layer).  A
unit's parameters are one flat vector padded to a multiple of ``DP``, rank ``r`` owning the
``r``-th equal slice (:class:`~tutorial_lib.data_parallel.ShardedBuffer`, ZeRO-1's
layout, reused: Megatron-FSDP lays its buffers out flat too; FSDP2 instead cuts every
parameter by rows and all-gathers the row-chunks of a unit together).  The fp32 slice is
what the optimizer steps (``main_param``) and keeps Adam's moments for.

**ZeRO-2** (``optim_grads``).  Backward fills each parameter's ``.grad`` as usual; the
moment the last gradient of a unit arrives, the unit's gradients are reduce-scattered
(this rank receives the average of its slice, added into ``main_param.grad``) and the whole
gradients are freed.  The optimizer updates the slices; an all-gather per unit brings
every rank the updated parameters.

**ZeRO-3 / FSDP** (``optim_grads_params``).  Between uses a unit holds only its slice:
its parameters are views of a flat *unsharded* buffer whose storage is freed (size 0).
Just before the unit's forward its slices are all-gathered into that buffer; after the
forward the storage is freed again (``reshard_after_forward``); just before its backward
they are all-gathered again; after its backward its gradients are reduce-scattered, as
in ZeRO-2, and the storage freed.  With ``prefetch`` the all-gather of the next unit
(forward: the next one to run; backward: the one that ran before, as FSDP2's implicit
backward prefetch) is issued asynchronously before this unit computes, so it runs under
this unit's compute.  ``mp_policy`` is FSDP2's ``MixedPrecisionPolicy``: the fp32 slices are
cast to ``param_dtype`` (bf16) before the all-gather, so the unit computes in bf16 and the
gather moves half the bytes; the gradients are reduce-scattered in ``reduce_dtype``.

Bytes per step on the ring (:func:`tutorial_lib.costs.sharded_step_collectives`): plain DP
and ZeRO-1/2 move ``2 (DP-1)/DP`` times the gradient bytes; ZeRO-3 adds one all-gather of
the parameters (two per step, forward and backward), ``3 (DP-1)/DP``: 1.5x.

**HSDP is predicted, not run here.**  Hybrid sharding (shard inside a group of ``S``
ranks, replicate over ``DP / S`` groups: FSDP2's 2-D mesh ``(Replicate(), Shard(0))``,
Megatron's ``--num-distributed-optimizer-instances``) lives in the cost and memory models
only (:func:`tutorial_lib.costs.sharded_step_collectives` with ``shard_size``,
:func:`tutorial_lib.costs.memory_per_rank` with ``num_distributed_optimizer_instances``).
A unit here shards over its gradient domain's group (``dp``, from
:data:`tutorial_lib.data_parallel.DOMAINS`), and the course's grid
(:class:`tutorial_lib.grid.ProcessGrid`) has no group kinds for the two halves of DP: running
HSDP means adding ``dp_shard`` and ``dp_replicate`` to every layout of the grid and to
:mod:`tutorial_lib.parallel_state`, then one all-reduce of each reduced slice over
``dp_replicate`` after its reduce-scatter.

**In the 4D run** (:mod:`tutorial_lib.train_4d`, ``--data-parallel-sharding-strategy
optim_grads`` or ``optim_grads_params``).  The units are each pipeline chunk's decoder
layers and one root unit for the rank's other parameters; a unit holds one gradient domain, so a MoE layer is two
units: its dense part sharded over ``dp`` (``dp_cp`` under context parallelism) and its
routed experts over ``expert_dp``, each reduced with the divisor of
:func:`~tutorial_lib.data_parallel.gradient_divisor`, as ZeRO-1's buffers are.  With
gradient accumulation a unit is reduce-scattered at the end of *every* microbatch's
backward through it, into the fp32 slice's gradient, as FSDP2 does by default (torch
2.13.0, ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``,
``FSDPParamGroup.post_backward`` reduce-scatters whenever ``reduce_grads`` is true, and
``_fsdp_collectives.py``'s ``foreach_reduce`` adds the result into the sharded
``.grad``; ``set_requires_gradient_sync(False)`` is its ``no_sync``).  The other choice,
Megatron-Core's distributed optimizer under ``no_sync`` (whole gradients accumulated
over the microbatches, reduce-scattered in the last microbatch's backward), keeps every
whole gradient alive through the step, which is the memory ZeRO-2 exists to free, and
needs each chunk's last backward known to the hooks (a different moment in each
schedule; chapter 11's W).  The price is ``M`` reduce-scatters of each unit per step
instead of one.  It needs no help from the pipeline executor: the hooks fire when
autograd accumulates a gradient, wherever the executor runs the backward (W included).
Under TP the gradients of parameters flagged ``sequence_parallel`` are summed over TP on
the reduced slices (:meth:`FSDPUnit.sum_sequence_parallel_grads`).  ZeRO-3's gathers need
none either: the executor calls each layer module, so the pre-forward hook gathers the
unit before every microbatch's forward through it; the backward's gather hangs on the
module's output (a DeepSeek block's is a tuple ``(hidden, info)``: its first tensor); the
root unit, whose parameters live in the embedding, the final LayerNorm and the output
layer (the model's own forward is never called: ``forward_stage`` is), is gathered by
those modules' hooks (``root_modules``) and kept from its first forward to its backward.

Trace: every all-gather and reduce-scatter carries ``unit`` (the unit's name), ``phase``
(``forward``, ``backward`` or ``optimizer``), ``zero`` (the stage) and, for an all-gather,
``prefetch`` (issued ahead of its unit) and ``op_name`` (the method that issued it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import comm, parallel_state
from .config import SHARDING_STRATEGIES, ZERO_STAGE
from .data_parallel import (DOMAINS, DataParallel, DistributedOptimizer, MixedPrecisionOptimizer,
                            ShardedBuffer, grad_domain, gradient_divisor)
from .trace import get_tracer

__all__ = ["SHARDING_STRATEGIES", "ZERO_STAGE", "check_sharding_strategy",
           "MixedPrecisionPolicy", "FSDPUnit", "FullyShardedDataParallel", "fully_shard",
           "FullyShardedOptimizer", "shard_data_parallel"]

def check_sharding_strategy(strategy: str) -> str:
    """``strategy`` if it is one of :data:`SHARDING_STRATEGIES`, else a ``ValueError`` naming them."""
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"unknown data-parallel sharding strategy {strategy!r}: one of "
                         f"{', '.join(SHARDING_STRATEGIES)} (ZeRO 0 to 3)")
    return strategy


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``, its first two fields."""

    param_dtype: torch.dtype | None = None
    """The dtype the unit computes in: the slices are cast to it and all-gathered in it
    (``None``: the parameters' own)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype the gradients are reduce-scattered in (``None``: ``param_dtype``'s)."""


# --- 1. one unit: its flat slice, its unsharded buffer, its reduce-scatters -------------------


class FSDPUnit(ShardedBuffer):
    """The parameters of one unit as a flat vector cut into ``DP`` slices.

    ``main_param`` (fp32) is this rank's slice, what the optimizer steps; its ``.grad``
    accumulates the reduce-scattered gradients.  Under ZeRO-3 each parameter is a view
    of :attr:`unsharded` (``param_dtype``), whose storage exists only while the unit is
    gathered.
    """

    def __init__(self, name: str, module: nn.Module, params: list, stage: int,
                 mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                 reshard_after_forward: bool = True, domain: str = "dp"):
        super().__init__(domain, params)
        self.name, self.module, self.stage = name, module, stage
        self.param_dtype = mp_policy.param_dtype or params[0].dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.ready: set = set()
        """``id`` of each parameter whose gradient arrived in this backward."""
        self.gather_work: comm.TracedWork | None = None
        self.reductions: list = []
        """Reduce-scatters in flight: ``(work, output, input)``."""
        self.unsharded: torch.Tensor | None = None
        self.span = None
        """The compute span open while the unit runs (ZeRO-3's hooks record it)."""
        self.tensor_parallel_sum = self._sequence_parallel_elements()
        """Where this rank's slice holds gradients of parameters flagged
        ``sequence_parallel`` (LayerNorms under sequence parallelism, the MoE router under
        TP): partial sums over the TP ranks' tokens, summed over TP after the reduce-scatter
        (``None``: none, or TP = 1)."""
        if stage == 3:
            self.unsharded = torch.zeros(self.padded_numel, dtype=self.param_dtype,
                                         device=params[0].device)
            for p, flat in zip(params, self.unflatten(self.unsharded)):
                p.data = flat  # a view of the flat buffer, in param_dtype
            self.reshard()

    def _sequence_parallel_elements(self) -> torch.Tensor | None:
        tp_group = DOMAINS[self.domain].tensor_parallel_group
        if parallel_state.group_size(tp_group) == 1:
            return None
        flags = self.my_slice([torch.full_like(p, float(getattr(p, "sequence_parallel", False)))
                               for p in self.params]).bool()
        return flags if bool(flags.any()) else None

    @property
    def unsharded_bytes(self) -> int:
        """Bytes the gathered parameters hold now (0 when resharded, or below ZeRO-3)."""
        return 0 if self.unsharded is None else self.unsharded.untyped_storage().nbytes()

    def unshard(self, phase: str, prefetch: bool = False) -> None:
        """Allocate the unsharded buffer and start the all-gather of the slices into it."""
        if self.unsharded_bytes > 0:  # gathered, or its gather already in flight
            return
        nbytes = self.padded_numel * self.unsharded.element_size()
        self.unsharded.untyped_storage().resize_(nbytes)
        with get_tracer().tags(unit=self.name, phase=phase, zero=3, prefetch=prefetch,
                               op_name="FSDPUnit.unshard"):
            self.gather_work = comm.all_gather(
                self.unsharded, self.main_param.detach().to(self.param_dtype), group=self.group,
                async_op=True)

    def wait_for_unshard(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None

    def reshard(self) -> None:
        """Free the gathered parameters: the views stay, their storage is gone."""
        self.wait_for_unshard()
        self.unsharded.untyped_storage().resize_(0)

    def reduce_scatter_grads(self) -> None:
        """Start the reduce-scatter of the unit's gradients; free the whole gradients.

        The gradients are flattened in ``reduce_dtype`` and divided by the averaging group's
        size before the sum (as :class:`~tutorial_lib.data_parallel.DataParallel` does);
        :meth:`finish_reduce_scatter` adds this rank's slice into ``main_param.grad``.
        """
        flat = torch.zeros(self.padded_numel, dtype=self.reduce_dtype,
                           device=self.main_param.device)
        for p, (start, end) in zip(self.params, self.ranges):
            if p.grad is not None:
                flat[start:end] = p.grad.reshape(-1)
                p.grad = None
        flat.div_(gradient_divisor(self.domain))
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=flat.device)
        with get_tracer().tags(unit=self.name, zero=self.stage,
                               op_name="FSDPUnit.reduce_scatter_grads"):
            work = comm.reduce_scatter(out, flat, group=self.group, async_op=True)
        self.reductions.append((work, out, flat))
        self.ready.clear()

    def finish_reduce_scatter(self) -> None:
        for work, out, _ in self.reductions:
            work.wait()
            self.main_param.grad += out.float()
        self.reductions.clear()

    def sum_sequence_parallel_grads(self) -> None:
        """Sum over TP the slice's elements of sequence-parallel parameters.

        What :func:`~tutorial_lib.tensor_parallel.allreduce_sequence_parallel_grads` does to
        whole gradients, done here on the reduced slices (the whole gradients are freed by
        then): the TP ranks of one DP rank hold units of the same shapes, so their slices
        cover the same elements, and a sum over TP commutes with the reduce-scatter over DP
        (both are sums).  It moves ``1 / DP`` of those gradients' bytes.
        """
        if self.tensor_parallel_sum is None:
            return
        grad = self.main_param.grad
        partial = grad[self.tensor_parallel_sum]
        with get_tracer().tags(unit=self.name, zero=self.stage, phase="grad_sync",
                               op_name="FSDPUnit.sum_sequence_parallel_grads"):
            comm.all_reduce(partial, group=DOMAINS[self.domain].tensor_parallel_group)
        grad[self.tensor_parallel_sum] = partial

    def all_gather_params(self) -> None:
        with get_tracer().tags(unit=self.name, zero=self.stage,
                               op_name="FSDPUnit.all_gather_params"):
            super().all_gather_params()


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward runs the unit's pre-backward first."""

    @staticmethod
    def forward(ctx, state, unit, output):
        ctx.state, ctx.unit = state, unit
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.pre_backward(ctx.unit)
        return None, None, grad


# --- 2. the hooks: when to gather, free and reduce ---------------------------------------------


class FullyShardedDataParallel:
    """ZeRO-2 or ZeRO-3 on ``model``, in place: hooks on its units (see the module doc).

    The hooks are named as FSDP2's ``FSDPParamGroup`` methods (torch 2.13.0,
    torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): ``pre_forward``,
    ``post_forward``, ``pre_backward``; the root is kept gathered after its forward by default
    as ``FSDPState._lazy_init`` keeps FSDP2's (_fsdp_state.py).

    ``units``: the submodules that are units, in the order they run, none inside another
    (a parameter belongs to the first unit listed that holds it); the model's remaining
    parameters form the root unit, named ``"root"``.  A unit holds one gradient domain
    (:data:`~tutorial_lib.data_parallel.DOMAINS`): ``group`` is the dense parameters'
    (``dp``, or ``dp_cp`` under context parallelism), and a module's routed experts
    (``expert_dp``) become a unit of their own, sharded over expert-DP.  ``strategy``: ``optim_grads`` or
    ``optim_grads_params``.  ``reshard_after_forward``: ``None`` frees every unit but the
    root after its forward (FSDP2's default: the root is needed again as soon as
    backward starts), ``True`` every unit, ``False`` none.  ``prefetch``: issue the next
    unit's all-gather before this one computes.  ``mp_policy``: ZeRO-3 only.
    ``root_modules``: the modules whose forward gathers the root unit under ZeRO-3 (default:
    the model's own); the 4D run's stages call their embedding, final LayerNorm and output
    layer, never the model.  ``chunks``: the unit modules of each pipeline chunk, in the
    order every microbatch's forward runs them (the 4D run); the order is then fixed within
    a chunk, so prefetch stays inside it: before a module's forward the next module's
    units are gathered ahead, before its backward the previous module's (each microbatch's
    backward runs the chunk in reverse), and the root, gathered by ``root_modules``, is
    never prefetched.  Without it (one forward through ``units``, chapter 12) the forward
    prefetches the next unit listed, the backward FSDP2's: the one whose forward ran before.

    Call :meth:`finish_grad_sync` after the last backward of a step (the optimizer does).
    """

    def __init__(self, model: nn.Module, units, strategy: str = "optim_grads_params",
                 reshard_after_forward: bool | None = None, prefetch: bool = True,
                 mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), group: str = "dp",
                 root_modules=None, chunks=None):
        strategy = check_sharding_strategy(strategy)
        self.stage = ZERO_STAGE[strategy]
        if self.stage < 2:
            raise ValueError(f"FullyShardedDataParallel runs optim_grads and optim_grads_params; "
                             f"{strategy!r} is {'DataParallel' if self.stage == 0 else 'DistributedOptimizer'}: "
                             f"use shard_data_parallel(model, {strategy!r}, ...)")
        if self.stage == 2 and mp_policy != MixedPrecisionPolicy():
            raise ValueError("mp_policy casts the gathered parameters (ZeRO-3); under optim_grads "
                             "the parameters stay whole: convert the model (model.bfloat16())")
        self.model, self.strategy, self.prefetch = model, strategy, prefetch
        modules = list(units)
        names = {id(m): n for n, m in model.named_modules()}
        owned = set()
        self.units: list[FSDPUnit] = []
        for module in modules:
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in owned]
            owned.update(id(p) for p in params)
            self.units += self._units_by_domain(names[id(module)], module, params, group,
                                                mp_policy, True if reshard_after_forward is None
                                                else reshard_after_forward)
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in owned]
        # the root runs first: its pre-forward hook is the model's
        self.units[:0] = self._units_by_domain("root", model, rest, group, mp_policy,
                                               bool(reshard_after_forward))
        self.forward_order = list(self.units)
        self.post_forward_order: list[FSDPUnit] = []
        self.chunk_position: dict[FSDPUnit, tuple[list, int]] = {}
        """With ``chunks``: each unit's chunk (its modules' units, in order) and its place."""
        for chunk in chunks or ():
            by_module = [[u for u in self.units if u.module is module] for module in chunk]
            for position, units_of_module in enumerate(by_module):
                for unit in units_of_module:
                    self.chunk_position[unit] = (by_module, position)
        self.peak_unsharded_bytes = 0
        """The most bytes of gathered parameters held at once since :meth:`reset_peak`."""
        self._handles = []
        for unit in self.units:
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, unit=unit: self.on_grad_ready(unit, p)))
            if self.stage == 3:
                hooked = [unit.module]
                if unit.module is model and root_modules is not None:
                    hooked = list(root_modules)
                for module in hooked:
                    self._handles.append(module.register_forward_pre_hook(
                        lambda module, args, unit=unit: self.pre_forward(unit)))
                    self._handles.append(module.register_forward_hook(
                        lambda module, args, output, unit=unit: self.post_forward(unit, output)))

    def _units_by_domain(self, name: str, module: nn.Module, params: list, group: str,
                         mp_policy, reshard_after_forward: bool) -> list[FSDPUnit]:
        """One unit per gradient domain of ``params`` (:data:`~tutorial_lib.data_parallel.DOMAINS`):
        a MoE layer's routed experts (``expert_dp``) are a unit of their own, named
        ``"<module>[expert_dp]"``, sharded over the expert data-parallel group."""
        by_domain: dict[str, list] = {}
        for p in params:
            by_domain.setdefault(grad_domain(p, group), []).append(p)
        return [FSDPUnit(name if domain == group else f"{name}[{domain}]", module, members,
                         self.stage, mp_policy, reshard_after_forward, domain)
                for domain, members in by_domain.items()]

    def _note_unsharded(self) -> None:
        held = sum(u.unsharded_bytes for u in self.units)
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, held)

    def reset_peak(self) -> None:
        self.peak_unsharded_bytes = sum(u.unsharded_bytes for u in self.units)

    def pre_forward(self, unit: FSDPUnit) -> None:
        if unit is self.forward_order[0]:
            self.post_forward_order.clear()
        unit.unshard("forward")
        for ahead in self.prefetched(unit, "forward"):
            ahead.unshard("forward", prefetch=True)
        self._note_unsharded()
        unit.wait_for_unshard()
        self._open_span(unit, "forward")

    def prefetched(self, unit: FSDPUnit, phase: str) -> list[FSDPUnit]:
        """The units whose all-gather ``unit`` issues ahead in ``phase`` (none without
        ``prefetch``): the next in the forward, the previous in the backward, within the
        unit's chunk when ``chunks`` fixed the order."""
        step = 1 if phase == "forward" else -1
        if not self.prefetch:
            return []
        if self.chunk_position:  # the units of the chunk's next (previous) module
            modules, position = self.chunk_position.get(unit, ([], -1))
            ahead = position + step
            return modules[ahead] if 0 <= ahead < len(modules) else []
        # backward: FSDP2's order, the unit whose forward ran before
        order = self.forward_order if phase == "forward" else self.post_forward_order
        ahead = order.index(unit) + step if unit in order else -1
        return [order[ahead]] if 0 <= ahead < len(order) else []

    def _open_span(self, unit: FSDPUnit, phase: str) -> None:
        """A compute span ``"<phase> <unit>"`` from the unit's gather to its end (not the
        root's: it encloses every other unit)."""
        if unit.module is not self.model:
            unit.span = get_tracer().span(f"{phase} {unit.name}", unit=unit.name)
            unit.span.__enter__()

    def _close_span(self, unit: FSDPUnit) -> None:
        if unit.span is not None:
            unit.span.__exit__(None, None, None)
            unit.span = None

    def post_forward(self, unit: FSDPUnit, output):
        self._close_span(unit)
        self.post_forward_order.append(unit)
        if unit.reshard_after_forward:
            unit.reshard()
        # the backward's gather hangs on the output: a tensor, or a tuple's first (a
        # DeepSeek block returns ``(hidden, info)``)
        first = output[0] if isinstance(output, tuple) and output else output
        if torch.is_tensor(first) and first.requires_grad:
            first = _PreBackward.apply(self, unit, first)
            return (first,) + output[1:] if isinstance(output, tuple) else first
        return output

    def pre_backward(self, unit: FSDPUnit) -> None:
        unit.unshard("backward")
        for ahead in self.prefetched(unit, "backward"):
            ahead.unshard("backward", prefetch=True)
        self._note_unsharded()
        unit.wait_for_unshard()
        self._open_span(unit, "backward")

    def on_grad_ready(self, unit: FSDPUnit, param) -> None:
        unit.ready.add(id(param))
        if len(unit.ready) == len(unit.params):  # the unit's backward is done
            self._close_span(unit)
            with get_tracer().tags(phase="backward"):
                unit.reduce_scatter_grads()
            if self.stage == 3:
                unit.reshard()

    def finish_grad_sync(self) -> None:
        """Reduce the units no hook reduced (a parameter without a gradient), wait for every
        reduce-scatter; ``main_param.grad`` then holds this rank's averaged slice."""
        for unit in self.units:
            if unit.ready:
                unit.reduce_scatter_grads()
                if self.stage == 3:
                    unit.reshard()
        for unit in self.units:
            unit.finish_reduce_scatter()
            unit.sum_sequence_parallel_grads()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


def fully_shard(model: nn.Module, units, **options) -> FullyShardedDataParallel:
    """ZeRO-3 (``strategy="optim_grads_params"``, the default) or ZeRO-2 on ``model`` in place.

    Named as FSDP2's ``torch.distributed.fsdp.fully_shard``, which FSDP2 calls once per
    unit (the blocks, then the root); here the units are listed in one call.  ``options``:
    :class:`FullyShardedDataParallel`'s.
    """
    return FullyShardedDataParallel(model, units, **options)


# --- 3. the optimizer: the shards' step, then (ZeRO-2) the all-gather -------------------------


class FullyShardedOptimizer(DistributedOptimizer):
    """The step of ZeRO-2 and ZeRO-3: the wrapped optimizer updates each unit's fp32 slice.

    The step is :class:`~tutorial_lib.data_parallel.MixedPrecisionOptimizer`'s four moves,
    as ZeRO-1's: the main gradients are the reduce-scattered slices (here waited for: they
    were issued during backward), clipped by the norm summed over DP; the wrapped
    optimizer steps the slices; then ZeRO-2 all-gathers each unit's parameters, while
    ZeRO-3 gathers nothing (the next forward does).  The memory measurement reads
    :attr:`buffers`, the units, as it reads ZeRO-1's; checkpoints save and load each unit's
    slices where they are, without gathering them (:mod:`tutorial_lib.dist_checkpointing`).
    """

    def __init__(self, fsdp: FullyShardedDataParallel, optimizer_class=torch.optim.Adam,
                 max_grad_norm: float | None = None, **optimizer_kwargs):
        self.fsdp, self.buffers, self._hooks = fsdp, fsdp.units, []
        self.step_tags = {"phase": "optimizer", "zero": fsdp.stage}
        params = [p for unit in fsdp.units for p in unit.params]
        MixedPrecisionOptimizer.__init__(
            self, params, optimizer_class([u.main_param for u in fsdp.units], **optimizer_kwargs),
            max_grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.buffers:
            unit.main_param.grad.zero_()
            for p in unit.params:
                p.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        self.fsdp.finish_grad_sync()

    def _copy_main_params_to_model_params(self) -> None:
        if self.fsdp.stage == 2:
            for unit in self.buffers:
                unit.all_gather_params()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """After the slices changed outside a step (a checkpoint was loaded into them): ZeRO-2
        all-gathers the weights; ZeRO-3 frees any gathered unit, so its next use gathers the
        new slices.  Collective over DP."""
        self._copy_main_params_to_model_params()
        if self.fsdp.stage == 3:
            for unit in self.buffers:
                unit.reshard()


def shard_data_parallel(model: nn.Module, strategy: str, units=(), optimizer_class=torch.optim.Adam,
                        fsdp_options: dict | None = None, **optimizer_kwargs):
    """``(model to train, optimizer)`` for any of the four strategies, over ``dp``.

    ``no_shard``: ``DataParallel(model)`` and the wrapped optimizer on every parameter;
    ``optim``: the bare model and a :class:`~tutorial_lib.data_parallel.DistributedOptimizer`;
    ``optim_grads`` and ``optim_grads_params``: the bare model, sharded in place by
    :func:`fully_shard` over ``units`` (with ``fsdp_options``: ``reshard_after_forward``,
    ``prefetch``, ``mp_policy``), and a :class:`FullyShardedOptimizer`.  Every one trains
    with :func:`tutorial_lib.tp_dp_step.train_step`.
    """
    stage = ZERO_STAGE[check_sharding_strategy(strategy)]
    if stage == 0:
        return DataParallel(model), optimizer_class(model.parameters(), **optimizer_kwargs)
    if stage == 1:
        return model, DistributedOptimizer(model.parameters(), optimizer_class, **optimizer_kwargs)
    fsdp = fully_shard(model, units, strategy=strategy, **(fsdp_options or {}))
    return model, FullyShardedOptimizer(fsdp, optimizer_class, **optimizer_kwargs)
