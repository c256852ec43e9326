"""Data parallelism: replicas average their gradients once per optimizer step.

Every data-parallel (DP) replica holds the same parameters (or, with tensor
parallelism, the same TP shard of them) and sees different samples.  After the
backward pass each replica has the gradient of *its* samples; averaging over the
replicas gives the gradient of the whole global batch, so every replica takes
the same optimizer step and the replicas never drift apart.  This file builds
that in four parts, one section each:

1. **Domains.**  Dense parameters are replicated over the ``dp`` group; routed
   experts over the ``expert_dp`` group (each expert lives on one EP rank, so
   fewer ranks hold a copy of it).  A parameter names its domain with an
   attribute, and everything below groups parameters by domain.
2. **Bucketed all-reduce, overlapped with backward** (:class:`DataParallel`).
   Gradients are copied into a few flat buffers ("buckets") in reverse order of
   use; the moment a bucket's last gradient arrives, its all-reduce starts in
   the background while backward carries on with earlier layers.  With gradient
   accumulation only the last microbatch communicates (:meth:`DataParallel.no_sync`).
3. **Global gradient-norm clipping** (:func:`clip_grad_norm_`): every parameter
   of the model-parallel model counted exactly once.
4. **ZeRO-1** (:class:`DistributedOptimizer`): a reduce-scatter instead of the
   all-reduce, so each DP rank updates (and keeps Adam state for) only 1/DP of
   the parameters, then an all-gather of the updated parameters.
5. **bf16 parameters with an fp32 master copy, unsharded**
   (:class:`Float16OptimizerWithFloat16Params`): what ZeRO-1 is measured against in a
   bf16 run, where every rank would otherwise keep the master and both Adam moments
   of every parameter.

The attribute contract (set by the layers that create parameters, read here):

``param.tensor_model_parallel = True``
    The parameter is a *shard*: each rank of its domain's tensor-parallel group
    (``tp``; ``expert_tp`` for experts) holds a different piece (column- and
    row-parallel weights, column-parallel biases, vocab-parallel embeddings).
    Absent or ``False``: every TP rank holds an identical copy (LayerNorm,
    row-parallel bias).  Set it with :func:`mark_tensor_parallel`.
``param.allreduce_group = "expert_dp"``
    The gradient domain: the group kind the gradient is averaged over.  Absent:
    the default (``"dp"``).  One of :data:`DOMAINS`.  Set it with
    :func:`set_grad_domain`.

Every event is recorded through the tracer: bucket all-reduces carry
``phase="backward"``, ``bucket=<index>``, ``overlap`` (started from a hook
during backward, or afterwards) and ``op_name`` (the method that issued it,
``DataParallel._on_grad_ready`` or ``DataParallel.finish_grad_sync``); clipping
carries ``phase="clip_grad"`` and ``op_name="reduce_squared_norms"``; ZeRO's
reduce-scatter and all-gather carry ``phase="optimizer"`` and ``zero=1``.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import comm, parallel_state
from .trace import get_tracer

# --- 1. the attribute contract and the gradient domains ----------------------------------

TENSOR_PARALLEL_ATTR = "tensor_model_parallel"
"""Attribute name: ``True`` on parameters that are TP shards (Megatron's name)."""

GRAD_DOMAIN_ATTR = "allreduce_group"
"""Attribute name: the group kind a parameter's gradient is averaged over."""


@dataclass(frozen=True)
class GradDomain:
    """The groups one kind of parameter lives in."""

    data_parallel_group: str
    """Replicas of the same values: gradients are summed over this group."""
    averaging_group: str
    """The sum is divided by this group's size: the number of dense replicas that each
    averaged the loss over their own tokens (see :func:`gradient_divisor`)."""
    tensor_parallel_group: str
    """Parameters marked ``tensor_model_parallel`` are split over it; the others are
    copies."""
    model_parallel_groups: tuple[str, ...]
    """Groups whose ranks hold *different* pieces of the model: the norm sums over
    them."""


DOMAINS = {
    "dp": GradDomain("dp", "dp", "tp", ("tp", "pp")),
    # With context parallelism the dense weights are also replicated over CP ranks.
    "dp_cp": GradDomain("dp_cp", "dp_cp", "tp", ("tp", "pp")),
    # Experts are summed over their replicas but divided by the DENSE data-parallel size:
    # the backward of MoE's all-to-all has already added, on the rank that owns an
    # expert, the gradients of every EP rank's tokens.  After the sum over expert_dp
    # every token of the global batch has contributed once, as after the dense sum, so
    # the divisor is the same (Megatron: expert_gradient_scaling_factor = 1 / (DP * CP)).
    # Averaging over expert_dp instead would scale expert gradients by DP * CP / EDP
    # = EP * ETP / TP: 4x at TP 1 x EP 4, but right by accident at TP = EP * ETP.
    "expert_dp": GradDomain("expert_dp", "dp_cp", "expert_tp", ("expert_tp", "ep", "pp")),
}


def gradient_divisor(domain: str) -> int:
    """What a gradient summed over ``domain``'s replicas is divided by."""
    return parallel_state.get_size(DOMAINS[_check_domain(domain)].averaging_group)


def mark_tensor_parallel(param: torch.Tensor, partition_dim: int = 0) -> torch.Tensor:
    """Mark ``param`` as a TP shard split along ``partition_dim``."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim  # not read here; what a checkpoint gather needs
    return param


def set_grad_domain(param: torch.Tensor, domain: str) -> torch.Tensor:
    """Average ``param``'s gradient over ``domain`` (e.g. ``"expert_dp"`` for an expert)."""
    _check_domain(domain)
    param.allreduce_group = domain
    return param


def grad_domain(param: torch.Tensor, default: str = "dp") -> str:
    """The domain ``param`` belongs to: its ``allreduce_group`` attribute, else ``default``."""
    return _check_domain(getattr(param, GRAD_DOMAIN_ATTR, default))


def _check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise ValueError(f"unknown gradient domain {domain!r}: {GRAD_DOMAIN_ATTR} must be one of "
                         f"{', '.join(DOMAINS)} (dense weights 'dp', routed experts 'expert_dp')")
    return domain


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, TENSOR_PARALLEL_ATTR, False))


def counts_in_grad_norm(param: torch.Tensor, domain: str) -> bool:
    """True on the ranks that add ``param`` to the norm: every rank for a TP shard
    (the shards differ), only TP rank 0 for a copy (so it is counted once); never for a
    parameter of DualPipe's second model copy (``model_copy == 1``: its twin in the first
    copy holds the same gradient, :func:`tutorial_lib.pipeline_parallel.dualpipe.sum_model_copy_gradients`)."""
    tp_group = DOMAINS[domain].tensor_parallel_group
    if getattr(param, "model_copy", 0) == 1:  # DualPipe's second copy: its twin counts
        return False
    return is_tensor_parallel(param) or parallel_state.get_rank_in(tp_group) == 0


# --- 2. bucketed all-reduce, overlapped with backward -------------------------------------

DEFAULT_BUCKET_SIZE_BYTES = 40_000_000
"""Megatron-Core 0.20.0's default bucket is max(40M, 1M x DP) *elements* (``--ddp-bucket-size``
counts elements too); ours counts bytes so that small models get several."""


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together in one all-reduce."""

    index: int
    """Position in launch order; every rank launches buckets in this order."""
    domain: str
    """The group kind its gradients are averaged over."""
    params: list
    """Its parameters; each one's ``main_grad`` is a view into :attr:`grad_buffer`."""
    grad_buffer: torch.Tensor
    """The flat gradient buffer that is all-reduced."""
    ready: set = field(default_factory=set)
    """``id`` of each parameter whose last-microbatch gradient has arrived."""
    work: comm.TracedWork | None = None
    """The all-reduce in flight, once launched."""

    @property
    def nbytes(self) -> int:
        return self.grad_buffer.numel() * self.grad_buffer.element_size()


def build_buckets(params, bucket_size_bytes: float, default_domain: str = "dp") -> list[list]:
    """Split ``params`` into buckets of about ``bucket_size_bytes``, in reverse order.

    Backward produces gradients roughly in reverse order of registration (last
    layer first), so filling buckets from the end lets the first bucket start its
    all-reduce while backward is still early.  A bucket holds one domain and one
    dtype; it closes once it holds at least ``bucket_size_bytes`` (0: one
    parameter per bucket; ``math.inf``: one bucket per domain).
    """
    if bucket_size_bytes < 0:
        raise ValueError(f"bucket_size_bytes must be >= 0, got {bucket_size_bytes}")
    open_buckets: dict[tuple, list] = {}
    buckets = []
    for param in reversed(list(params)):
        key = (grad_domain(param, default_domain), param.dtype)
        bucket = open_buckets.setdefault(key, [])
        if not bucket:
            buckets.append(bucket)
        bucket.append(param)
        if sum(p.numel() * p.element_size() for p in bucket) >= bucket_size_bytes:
            del open_buckets[key]
    return buckets


class DataParallel(nn.Module):
    """Wrap ``module`` so that its gradients are averaged over its DP domains.

    One optimizer step with gradient accumulation over M microbatches::

        model.zero_grad()                     # zeroes the bucket buffers
        for i, batch in enumerate(microbatches):
            with model.no_sync() if i < M - 1 else contextlib.nullcontext():
                (loss_fn(model(batch)) / M).backward()
        model.finish_grad_sync()              # wait; param.grad now holds the average
        optimizer.step()

    ``bucket_size_bytes=0, overlap=False`` is the baseline: one all-reduce per
    parameter, all issued after backward.  ``overlap=True`` starts each bucket's
    all-reduce from a gradient hook on the last microbatch.

    ``grad_reduce_in_fp32``: the buckets of low-precision (bf16) parameters are fp32, so
    the microbatches' gradients add up and are averaged in fp32 (Megatron-Core's
    ``DistributedDataParallelConfig.grad_reduce_in_fp32``, which Megatron-LM's training
    script turns on for ``--bf16`` unless ``--grad-reduce-in-bf16``).  Such a gradient
    cannot be a bf16 parameter's ``.grad``: after the sync it stays in ``param.main_grad``
    and ``.grad`` is ``None``; :class:`Float16OptimizerWithFloat16Params` reads it there.
    """

    def __init__(self, module: nn.Module, group: str = "dp",
                 bucket_size_bytes: float = DEFAULT_BUCKET_SIZE_BYTES, overlap: bool = True,
                 grad_reduce_in_fp32: bool = False):
        super().__init__()
        self.module = module
        self.overlap = overlap
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        for index, members in enumerate(build_buckets(params, bucket_size_bytes, group)):
            domain = grad_domain(members[0], group)
            dtype = torch.float32 if grad_reduce_in_fp32 else members[0].dtype
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=dtype,
                                 device=members[0].device)
            bucket = Bucket(index, domain, members, buffer)
            offset = 0
            for p in members:
                p.main_grad = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self._bucket_of[id(p)] = bucket
            self.buckets.append(bucket)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._sync_enabled = True
        self._next_to_launch = 0
        self._synced = False  # True from finish_grad_sync until the buffers are zeroed

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients without communicating."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Runs after autograd accumulated ``param.grad``: move it into its bucket."""
        if self._synced:
            raise RuntimeError("backward after finish_grad_sync() without zeroing: call "
                               "model.zero_grad() (or zero_grad_buffer()) at the start "
                               "of each step")
        bucket = self._bucket_of[id(param)]
        if bucket.work is not None:
            raise RuntimeError(f"a gradient arrived for bucket {bucket.index} after its "
                               f"all-reduce started: with gradient accumulation, run every "
                               f"backward but the last inside model.no_sync()")
        param.main_grad.add_(param.grad)
        param.grad = None
        if self._sync_enabled and self.overlap:
            bucket.ready.add(id(param))
            self._launch_ready_buckets()

    def _launch_ready_buckets(self, everything: bool = False) -> None:
        # Collectives on a group must be issued in the same order on every rank, so a
        # bucket that is ready early still waits for the buckets before it.
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if not everything and len(bucket.ready) < len(bucket.params):
                return
            # Scale before summing: a low-precision sum of many replicas cannot overflow.
            bucket.grad_buffer.div_(gradient_divisor(bucket.domain))
            # op_name: the method that issued it, from a gradient hook or after backward.
            issuer = "DataParallel." + ("finish_grad_sync" if everything else "_on_grad_ready")
            tags = {"phase": "backward", "bucket": bucket.index, "overlap": not everything,
                    "op_name": issuer}
            bucket.work = comm.all_reduce(bucket.grad_buffer, group=bucket.domain,
                                          async_op=True, tags=tags)
            self._next_to_launch += 1

    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all; ``param.grad`` = the average."""
        for bucket in self.buckets[self._next_to_launch:]:
            for p in bucket.params:  # gradients no hook moved (set by hand)
                if p.grad is not None and p.grad is not p.main_grad:
                    p.main_grad.add_(p.grad)
                    p.grad = None
        self._launch_ready_buckets(everything=True)
        for bucket in self.buckets:
            bucket.work.wait()
            for p in bucket.params:
                # An fp32 average of a bf16 parameter stays in main_grad (see the class doc).
                p.grad = p.main_grad if p.main_grad.dtype == p.dtype else None
        self._synced = True

    def zero_grad_buffer(self) -> None:
        """Zero every bucket and forget the last step's launches; call once per step."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # never zero a buffer a collective is still writing
            bucket.grad_buffer.zero_()
            bucket.ready.clear()
            bucket.work = None
            for p in bucket.params:
                p.grad = None
        self._next_to_launch = 0
        self._synced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_buffer()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()


# --- 3. global gradient-norm clipping ------------------------------------------------------
#
# The norm of the model's gradient is sqrt(sum of g**2 over every parameter of the
# *whole* model, each counted once).  After the DP sync every DP replica holds the
# same gradients, so nothing is summed over DP.  Within one replica:
#   * a TP shard holds a different piece on every TP rank: sum over the TP group;
#   * a TP copy (LayerNorm, row-parallel bias) is identical on every TP rank: count
#     it on TP rank 0 only, then the same TP sum adds it once;
#   * pipeline stages hold different layers: sum over the PP group;
#   * experts live on different EP ranks: their squares are summed over EP (and
#     expert-TP, PP), i.e. over the groups of the expert domain.
# With ZeRO the gradients are sharded over DP too, so there the DP group is added.


_NORM_TAGS = {"op_name": "reduce_squared_norms"}


def reduce_squared_norms(squares: dict[str, torch.Tensor],
                          sharded_over_data_parallel: bool = False) -> torch.Tensor:
    """Sum each domain's local squared norm over the groups holding distinct pieces.

    The pipeline sum comes last, once, over the total: stages can hold different
    domains (a dense first stage has no experts), so a per-domain all-reduce over PP
    would be issued by some stages and not others, and the collectives would pair up
    wrongly.  Every other group of a domain lies inside one stage.  The sums live on the
    squares' device (each rank's parameters are on its ``ctx.device``: every rank uses the
    same backend for these all-reduces).
    """
    device = next((s.device for s in squares.values() if torch.is_tensor(s)), torch.device("cpu"))
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for name in sorted(squares):  # the same order on every rank of the stage
        domain, square = DOMAINS[name], squares[name].reshape(1).float()
        groups = tuple(g for g in domain.model_parallel_groups if g != "pp")
        if sharded_over_data_parallel:
            groups = (domain.data_parallel_group,) + groups
        for group in groups:
            if parallel_state.get_size(group) > 1:  # a group of one rank adds nothing
                comm.all_reduce(square, group=group, tags=_NORM_TAGS)
        total += square
    if parallel_state.get_size("pp") > 1:
        comm.all_reduce(total, group="pp", tags=_NORM_TAGS)
    return total.sqrt()


def _squared_norms(params, grads, default_domain: str) -> dict[str, torch.Tensor]:
    """This rank's squared norm of ``grads`` (one per parameter of ``params``; ``None``: no
    gradient) per domain, each parameter counted where :func:`counts_in_grad_norm` says."""
    squares: dict[str, torch.Tensor] = {}
    for p, grad in zip(params, grads):
        domain = grad_domain(p, default_domain)
        square = squares.setdefault(domain, torch.zeros(1, dtype=torch.float32, device=p.device))
        if grad is not None and counts_in_grad_norm(p, domain):
            square += grad.detach().float().square().sum()
    return squares


def _grad_norm(params, grads, default_domain: str) -> torch.Tensor:
    """The global norm of ``grads``, one per parameter of ``params`` (``None``: no gradient)."""
    with get_tracer().tags(phase="clip_grad"):
        return reduce_squared_norms(_squared_norms(params, grads, default_domain))


def get_grad_norm(params, default_domain: str = "dp") -> torch.Tensor:
    """The global L2 norm of the gradients of the model-parallel model (DP-synced grads)."""
    params = list(params)
    return _grad_norm(params, [p.grad for p in params], default_domain)


def clip_grad_norm_(params, max_norm: float, default_domain: str = "dp",
                    eps: float = 1e-6) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (norm + eps))``; return the norm.

    The same rule as ``torch.nn.utils.clip_grad_norm_``, but with the norm taken
    over the whole model-parallel model.  Call it on every rank, after the DP sync.
    """
    params = list(params)
    norm = get_grad_norm(params, default_domain)
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm


# --- 4. ZeRO-1: the distributed optimizer --------------------------------------------------


def main_grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient an optimizer step uses: ``param.grad``, or the fp32 ``param.main_grad``
    where a bf16 parameter's gradient was accumulated in fp32 (its ``.grad`` is then None)."""
    if param.grad is None:
        return getattr(param, "main_grad", None)
    return param.grad


def _accumulate_in_fp32(param: torch.Tensor) -> None:
    """Gradient hook: add the microbatch's (bf16) gradient into the fp32 ``main_grad``."""
    param.main_grad.add_(param.grad)
    param.grad = None


class MixedPrecisionOptimizer:
    """What both optimizers below share: the wrapped optimizer steps fp32 *main*
    parameters (``main_params``), and one step is always the same four moves.

    ``step()``: bring the gradients to the main parameters
    (:meth:`_copy_model_grads_to_main_grads`: upcast, or reduce-scatter for ZeRO-1);
    with ``max_grad_norm``, clip them by the global norm (:meth:`clip_grad_norm`, the
    squares from :meth:`_main_grad_squares`); step the wrapped optimizer; copy the main
    parameters back into the model's (:meth:`_copy_main_params_to_model_params`: rounded,
    or all-gathered).  Megatron-Core splits it the same way: its ``MixedPrecisionOptimizer``
    (a ``MegatronOptimizer``) is the parent of both ``Float16OptimizerWithFloat16Params``
    and ``DistributedOptimizer``, and its ``step()`` runs ``_copy_model_grads_to_main_grads``,
    ``clip_grad_norm``, the inner step and ``_copy_main_params_to_model_params`` in this
    order (Megatron-LM 71371b4e, megatron/core/optimizer/optimizer.py; the loss scaler
    between the first two is fp16's, and bf16 runs without one).
    """

    step_tags: dict = {}
    """Tracer tags on every event of a step."""
    sharded_over_data_parallel = False
    """Whether each DP rank holds a different slice of the main gradients (the clip's
    sum then runs over DP too)."""

    def __init__(self, params: list, optimizer: torch.optim.Optimizer,
                 max_grad_norm: float | None):
        self.params = params
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def main_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the wrapped optimizer updates."""
        raise NotImplementedError

    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _main_grad_squares(self) -> dict[str, torch.Tensor]:
        """This rank's squared norm of the main gradients, per domain."""
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """Scale the main gradients by ``min(1, max_norm / (norm + eps))``, the norm taken
        over the whole model (:func:`reduce_squared_norms`); return the norm."""
        with get_tracer().tags(phase="clip_grad"):
            norm = reduce_squared_norms(self._main_grad_squares(),
                                        sharded_over_data_parallel=self.sharded_over_data_parallel)
        scale = torch.clamp(max_norm / (norm + eps), max=1.0)
        for main in self.main_params:
            if main.grad is not None:
                main.grad.mul_(scale)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        with get_tracer().tags(**self.step_tags):
            self._copy_model_grads_to_main_grads()
            if self.max_grad_norm is not None:
                self.last_grad_norm = self.clip_grad_norm(self.max_grad_norm)
            self.optimizer.step()
            self._copy_main_params_to_model_params()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps for the optimizer: the fp32 main parameters + the wrapped
        optimizer's state."""
        out = {"master_params": sum(main.numel() * 4 for main in self.main_params)}
        out.update(optimizer_state_bytes(self.optimizer))
        return out


class ShardedBuffer:
    """One domain's parameters as one flat vector, cut into DP-many equal shards.

    The flat length is padded to a multiple of the DP size so every shard has the
    same length (the reduce-scatter and all-gather need that).  This rank owns
    ``[shard_start, shard_start + shard_numel)`` and keeps the fp32 master copy of
    that slice only, in :attr:`main_param`.
    """

    def __init__(self, domain: str, params: list):
        self.domain, self.params = domain, params
        self.param_dtype = params[0].dtype
        """The parameters' dtype (one per buffer): what the all-gather moves."""
        self.group = DOMAINS[domain].data_parallel_group
        size, rank = parallel_state.get_size(self.group), parallel_state.get_rank_in(self.group)
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = math.ceil(self.numel / size) * size
        self.shard_numel = self.padded_numel // size
        self.shard_start = rank * self.shard_numel
        self.ranges, offset = [], 0
        for p in params:
            self.ranges.append((offset, offset + p.numel()))
            offset += p.numel()
        mine = slice(self.shard_start, self.shard_start + self.shard_numel)
        flat_params = self._flatten([p.detach() for p in params])
        self.main_param = nn.Parameter(flat_params[mine].clone())
        self.main_param.grad = torch.zeros_like(self.main_param)
        counts = self._flatten([torch.full_like(p, float(counts_in_grad_norm(p, domain)))
                                for p in params])
        self.norm_mask = counts[mine].clone()
        """1 where this rank adds the element to the gradient norm, 0 for TP copies off rank 0."""

    def _flatten(self, tensors) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.params[0].device)
        for t, (start, end) in zip(tensors, self.ranges):
            if t is not None:
                flat[start:end] = t.reshape(-1)
        return flat

    def reduce_scatter_grads(self) -> None:
        """``main_param.grad`` = this rank's slice of the DP-averaged gradient (fp32)."""
        flat_grads = self._flatten([main_grad_of(p) for p in self.params])
        flat_grads.div_(gradient_divisor(self.domain))
        comm.reduce_scatter(self.main_param.grad, flat_grads, group=self.group)

    def all_gather_params(self) -> None:
        """Every rank's updated slice, concatenated, copied back into the parameters.

        The slices travel in the parameters' dtype: bf16 parameters are all-gathered in
        bf16, each rank rounding its own fp32 slice first (as Megatron-Core all-gathers its
        bf16 parameter buffer), half the bytes of an fp32 gather, the same values.
        """
        flat_params = self.gather(self.main_param.detach(), dtype=self.param_dtype)
        for p, (start, end) in zip(self.params, self.ranges):
            p.copy_(flat_params[start:end].view_as(p))

    def gather(self, shard: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The padded flat vector whose slice on each rank of the group is that rank's
        ``shard``, all-gathered in ``dtype``."""
        flat = torch.empty(self.padded_numel, dtype=dtype, device=shard.device)
        comm.all_gather(flat, shard.detach().to(dtype), group=self.group)
        return flat

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (the padded flat vector) cut back into one tensor per parameter."""
        return [flat[start:end].view_as(p) for p, (start, end) in zip(self.params, self.ranges)]

    def my_slice(self, tensors) -> torch.Tensor:
        """This rank's slice of the flat vector made of ``tensors`` (one per parameter)."""
        return self._flatten(tensors)[self.shard_start:self.shard_start + self.shard_numel].clone()


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO stage 1: each DP rank keeps optimizer state for 1/DP of the parameters.

    ``step()`` replaces the DP all-reduce: it reduce-scatters the accumulated
    gradients (this rank receives the average of its slice), optionally clips,
    updates its slice with the wrapped optimizer, and all-gathers the parameters.
    Use it on an unwrapped model (no :class:`DataParallel`): gradient accumulation
    is plain autograd accumulation, and the only communication is in ``step()``.

    fp32 parameters: the fp32 slice each rank updates is a copy of its piece of the
    parameters (Megatron-Core would update that piece in place, without a copy).
    bf16 parameters: the slice is their fp32 *master* copy, which a bf16 run needs
    anyway; the gradients add up over the microbatches in an fp32 ``param.main_grad``
    (a hook moves each ``.grad`` there, as :class:`DataParallel` with
    ``grad_reduce_in_fp32`` does) and are reduce-scattered in fp32; the updated slices are
    rounded to bf16 and all-gathered in bf16.  Megatron-Core's ``DistributedOptimizer``
    (``--use-distributed-optimizer --bf16``) keeps the fp32 master and Adam's two moments
    of its slice too, but the slice's gradient is a view of its fp32 gradient buffer
    where this class copies it (``main_param.grad``, 4 bytes per element of the slice):
    ``6 + 12 / DP`` bytes per parameter there, ``6 + 16 / DP`` here
    (:mod:`tutorial_lib.costs.memory_model` counts this class's).
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, group: str = "dp",
                 max_grad_norm: float | None = None, **optimizer_kwargs):
        params = [p for p in params if p.requires_grad]
        by_key: dict[tuple[str, str], list] = {}  # one flat buffer per domain and dtype
        for p in params:
            by_key.setdefault((grad_domain(p, group), str(p.dtype)), []).append(p)
        self.buffers = [ShardedBuffer(domain, by_key[domain, dtype])
                        for domain, dtype in sorted(by_key)]
        # Low-precision parameters accumulate their gradients in fp32 (see the class doc).
        self._hooks = []
        for p in params:
            if p.dtype != torch.float32:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_in_fp32))
        super().__init__(params, optimizer_class([b.main_param for b in self.buffers],
                                                 **optimizer_kwargs), max_grad_norm)

    step_tags = {"phase": "optimizer", "zero": 1}
    sharded_over_data_parallel = True  # the main gradients are reduce-scattered

    @property
    def main_params(self) -> list[torch.Tensor]:
        return [b.main_param for b in self.buffers]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            if p.dtype != torch.float32:
                p.main_grad.zero_()

    def _copy_model_grads_to_main_grads(self) -> None:
        for buffer in self.buffers:
            with get_tracer().tags(op_name="ShardedBuffer.reduce_scatter_grads"):
                buffer.reduce_scatter_grads()

    def _main_grad_squares(self) -> dict[str, torch.Tensor]:
        squares: dict[str, torch.Tensor] = {}
        for b in self.buffers:  # a domain may have a buffer per dtype
            square = (b.main_param.grad.square() * b.norm_mask).sum()
            squares[b.domain] = squares.get(b.domain, 0) + square
        return squares

    def _copy_main_params_to_model_params(self) -> None:
        for buffer in self.buffers:
            with get_tracer().tags(op_name="ShardedBuffer.all_gather_params"):
                buffer.all_gather_params()

    # --- checkpoints: the state as a plain optimizer would hold it ----------------------
    #
    # Each rank holds the wrapped optimizer's state for its slice of each flat buffer, a
    # cut that depends on the DP size and on which parameters share the buffer.  A
    # checkpoint that any layout (and plain Adam) can load stores the state per parameter
    # instead: gathered over the buffer's DP group, cut at the parameters' boundaries.
    # Megatron-Core's DistributedOptimizer offers the same two directions
    # (get_parameter_state_dp_zero gathers onto DP rank 0; here every DP rank gets it).

    @torch.no_grad()
    def get_parameter_state(self) -> dict:
        """``{param: {name: tensor}}``: each parameter's whole optimizer state; collective over DP.

        A state tensor with one value per element of the slice (Adam's ``exp_avg``,
        ``exp_avg_sq``) is all-gathered and cut per parameter; a scalar (``step``) is
        copied to every parameter of the buffer.  Empty until the first ``step()``.
        """
        out: dict = {}
        with get_tracer().tags(phase="checkpoint", zero=1):
            for buffer in self.buffers:
                inner = self.optimizer.state.get(buffer.main_param, {})
                for name in sorted(inner):
                    value = inner[name]
                    if torch.is_tensor(value) and value.shape == buffer.main_param.shape:
                        pieces = buffer.unflatten(buffer.gather(value))
                    else:
                        pieces = [value] * len(buffer.params)
                    for p, piece in zip(buffer.params, pieces):
                        out.setdefault(p, {})[name] = piece.clone() if torch.is_tensor(piece) else piece
        return out

    @torch.no_grad()
    def load_parameter_state(self, state: dict) -> None:
        """Install per-parameter state (``get_parameter_state``'s form), keeping my slices only.

        Also re-reads each fp32 master slice from the parameters, so call it after the
        parameters themselves were loaded.  No communication.
        """
        for buffer in self.buffers:
            buffer.main_param.copy_(buffer.my_slice([p.detach() for p in buffer.params]))
            names = {name for p in buffer.params for name in state.get(p, {})}
            inner = {}
            for name in sorted(names):
                values = [state[p][name] for p in buffer.params]
                if torch.is_tensor(values[0]) and values[0].shape == buffer.params[0].shape:
                    inner[name] = buffer.my_slice(values)
                else:
                    def on_cpu(value):
                        return torch.as_tensor(value, device="cpu")
                    if any(not torch.equal(on_cpu(v), on_cpu(values[0])) for v in values):
                        raise ValueError(f"the parameters of the {buffer.domain!r} buffer carry "
                                         f"different {name!r} values; one flat buffer takes one")
                    inner[name] = values[0].clone() if torch.is_tensor(values[0]) else values[0]
            if inner:
                self.optimizer.state[buffer.main_param] = inner

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of each per-parameter state tensor (Adam: ``exp_avg``, ``exp_avg_sq``)."""
    out: dict[str, int] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":  # step is one scalar
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


# --- 5. bf16 parameters, an fp32 master copy, no sharding ---------------------------------


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """Plain DP with bf16 parameters: the wrapped optimizer updates an fp32 master copy.

    What Megatron-Core runs for ``--bf16`` without ``--use-distributed-optimizer``
    (its class of the same name).  bf16 keeps 8 bits of mantissa: an update of a weight
    smaller than 1/256 of it would round away, so the weights are updated in fp32 and
    each step's result is rounded into the bf16 parameters the model computes with.
    Every DP rank keeps, for every parameter it holds, the fp32 master (4 bytes) and
    the wrapped optimizer's state (Adam: 8 bytes): the 12 bytes per parameter that
    ZeRO-1 (:class:`DistributedOptimizer`) divides by DP.

    ``step()``: each master's gradient is the parameter's, in fp32 (``main_grad`` from
    :class:`DataParallel` with ``grad_reduce_in_fp32=True``, else ``.grad`` upcast);
    with ``max_grad_norm`` the masters' gradients are clipped by the global norm, over
    the same groups as :func:`clip_grad_norm_`; the wrapped optimizer steps the masters;
    each master, rounded, is copied into its parameter.  No communication beyond the clip.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, group: str = "dp",
                 max_grad_norm: float | None = None, **optimizer_kwargs):
        params = [p for p in params if p.requires_grad]
        full = [p for p in params if p.dtype == torch.float32]
        if full:
            raise ValueError(f"Float16OptimizerWithFloat16Params: {len(full)} of {len(params)} "
                             f"parameters are fp32 already and need no master copy; convert the "
                             f"model to bf16 (model.bfloat16()) or give the parameters to the "
                             f"optimizer itself (Megatron-Core's FP32Optimizer)")
        self.group = group
        self._main_params = [nn.Parameter(p.detach().float().clone()) for p in params]
        super().__init__(params, optimizer_class(self._main_params, **optimizer_kwargs),
                         max_grad_norm)

    @property
    def main_params(self) -> list[torch.Tensor]:
        return self._main_params

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def _copy_model_grads_to_main_grads(self) -> None:
        for p, main in zip(self.params, self.main_params):
            grad = main_grad_of(p)
            main.grad = None if grad is None else grad.detach().float().clone()

    def _main_grad_squares(self) -> dict[str, torch.Tensor]:
        return _squared_norms(self.params, [main.grad for main in self.main_params], self.group)

    def _copy_main_params_to_model_params(self) -> None:
        for p, main in zip(self.params, self.main_params):
            p.copy_(main)  # rounded to the parameter's dtype
