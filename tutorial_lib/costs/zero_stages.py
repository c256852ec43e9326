"""The ZeRO stages: the collectives of one step and the state each rank keeps (chapter 12).

Pure functions of the model's unit sizes and the layout (numpy through
:mod:`~tutorial_lib.costs.tp_dp_step`'s :class:`StepCollective`, no torch), checked against
the traces and tensors of :mod:`tutorial_lib.fully_sharded_data_parallel`'s runs.

The strategies are Megatron-FSDP's (``no_shard``, ``optim``, ``optim_grads``,
``optim_grads_params``: ZeRO 0 to 3).  A *unit* is a module whose parameters travel
together; ``unit_numels`` lists their sizes in the order they run, the root unit first.
With ``S`` ranks in the sharding group each unit's flat vector is padded to a multiple of
``S`` and every rank owns one slice of ``ceil(n / S)`` elements.

Rajbhandari et al. 2020 (ZeRO), section 7: plain DP all-reduces the gradients, ``2 Psi``
on the ring; ZeRO-1 and ZeRO-2 reduce-scatter them and all-gather the updated parameters,
the same ``2 Psi``; ZeRO-3 all-gathers every unit's parameters twice (forward and
backward) and reduce-scatters its gradients once, ``3 Psi``: 1.5x plain DP.

**HSDP** (hybrid sharding: shard inside a group of ``S`` ranks, replicate over the
``DP / S`` groups; FSDP2's 2-D mesh ``(Replicate(), Shard(0))``, Megatron's
``--num-distributed-optimizer-instances``): every reduce-scatter over the shard group is
followed by an all-reduce of the reduced slice over the replicas (group kind
``dp_replicate``); the state per rank is divided by ``S`` instead of ``DP``.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from ..config import ZERO_STAGE
from .alpha_beta import ring_bytes_sent
from .memory_model import unit_slice_numel
from .tp_dp_step import StepCollective, _positive

__all__ = ["sharded_step_collectives", "step_bytes_sent", "sharding_beats_tp_tokens"]


def _stage(strategy: str) -> int:
    if strategy not in ZERO_STAGE:
        raise ValueError(f"unknown data-parallel sharding strategy {strategy!r}: one of "
                         f"{', '.join(ZERO_STAGE)}")
    return ZERO_STAGE[strategy]


def sharded_step_collectives(unit_numels: Sequence[int], dp: int, strategy: str,
                             num_microbatches: int = 1, param_bytes: int = 4,
                             grad_bytes: int = 4, reshard_after_forward: bool | None = True,
                             shard_size: int | None = None,
                             unit_names: Sequence[str] | None = None,
                             expert_numels: Sequence[int] | None = None,
                             expert_dp: int | None = None) -> list[StepCollective]:
    """The data-parallel collectives one rank issues in one step, one row per unit and op.

    ``unit_numels``: the units' sizes, root first, then in the order they run.  ``dp``: the
    data-parallel size; ``shard_size`` (default ``dp``): the sharding group (HSDP below
    ``dp``).  ``param_bytes``: what the all-gathers move per element (2 under a bf16
    ``param_dtype``); ``grad_bytes``: what the gradient collectives move per element.
    ``reshard_after_forward``: ``True`` frees every unit after its forward (each is
    gathered again for backward), ``None`` every unit but the root (FSDP2's default),
    ``False`` none.  Bytes follow :mod:`tutorial_lib.comm`'s convention.

    ``expert_numels``: per unit, the routed-expert parameters it holds (0 for none), a
    second gradient domain reduced over the ``expert_dp`` ranks of group kind
    ``expert_dp``, as :mod:`tutorial_lib.fully_sharded_data_parallel` runs a MoE layer:
    under ZeRO-2 and ZeRO-3 a unit of its own, named ``"<unit>[expert_dp]"``, right after
    its unit with the same rows; under plain DP and ZeRO-1 one buffer of its own.  HSDP
    applies to the dense units only.

    ``no_shard``: one all-reduce of every gradient (:class:`DataParallel`'s buckets hold
    the same bytes together); ``optim``: ZeRO-1's reduce-scatter of the whole padded
    gradient buffer and all-gather of the slice, once per step; ``optim_grads``: per unit,
    a reduce-scatter after each microbatch's backward and an all-gather after the step;
    ``optim_grads_params``: per unit and microbatch an all-gather before the forward, one
    before the backward unless the unit stayed gathered, and a reduce-scatter.
    """
    stage = _stage(strategy)
    dp, m = _positive("dp", dp), _positive("num_microbatches", num_microbatches)
    shard = dp if shard_size is None else _positive("shard_size", shard_size)
    if dp % shard:
        raise ValueError(f"shard_size ({shard}) must divide the data-parallel size ({dp}): "
                         f"HSDP replicates whole sharding groups; try one of "
                         f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    names = list(unit_names) if unit_names is not None else (
        ["root"] + [f"unit {i}" for i in range(1, len(unit_numels))])
    experts = [0] * len(unit_numels) if expert_numels is None else list(expert_numels)
    if len(experts) != len(unit_numels):
        raise ValueError(f"expert_numels lists {len(experts)} units, unit_numels "
                         f"{len(unit_numels)}: one routed-expert count (0 for none) per unit")
    if any(experts):
        if expert_dp is None:
            raise ValueError("expert_numels needs expert_dp, the expert data-parallel size "
                             "its units are reduced over")
        expert_dp = _positive("expert_dp", expert_dp)
    domain = dict(param_bytes=param_bytes, grad_bytes=grad_bytes)
    if stage < 2:  # one buffer per domain
        rows = _buffer_rows(stage, sum(_positive("numel", n) for n in unit_numels), "dp", dp,
                            shard, **domain)
        if any(experts):
            rows += _buffer_rows(stage, sum(experts), "expert_dp", expert_dp, expert_dp,
                                 **domain)
        return rows
    rows = []
    for index, (name, numel, routed) in enumerate(zip(names, unit_numels, experts)):
        freed = reshard_after_forward is True or (reshard_after_forward is None and index > 0)
        rows += _unit_rows(stage, name, _positive("numel", numel), "dp", dp, shard, freed, m,
                           **domain)
        if routed:
            rows += _unit_rows(stage, f"{name}[expert_dp]", routed, "expert_dp", expert_dp,
                               expert_dp, freed, m, **domain)
    return rows


def _buffer_rows(stage: int, total: int, kind: str, dp: int, shard: int, *, param_bytes: int,
                 grad_bytes: int) -> list[StepCollective]:
    """Plain DP's all-reduce, or ZeRO-1's reduce-scatter and all-gather, of one domain's
    ``total`` elements once per step."""
    if stage == 0:
        return [StepCollective("all_reduce", kind, "backward", 1, total * grad_bytes,
                               "no_shard: average every gradient over the replicas")]
    padded = math.ceil(total / shard) * shard
    rows = [StepCollective("reduce_scatter", kind, "optimizer", 1, padded * grad_bytes,
                           "optim: my slice of the averaged gradients"),
            StepCollective("all_gather", kind, "optimizer", 1, padded // shard * param_bytes,
                           "optim: every replica gets every updated slice")]
    return rows + _replica_rows(padded // shard, dp, shard, 1, grad_bytes, "the whole buffer")


def _unit_rows(stage: int, name: str, numel: int, kind: str, dp: int, shard: int, freed: bool,
               m: int, *, param_bytes: int, grad_bytes: int) -> list[StepCollective]:
    """ZeRO-2's or ZeRO-3's rows of one unit of ``numel`` elements sharded over ``shard``
    ranks of group kind ``kind``; ``freed``: ZeRO-3 gathers it again before its backward."""
    piece = unit_slice_numel(numel, shard)
    rows = []
    if stage == 3:
        rows.append(StepCollective("all_gather", kind, "forward", m, piece * param_bytes,
                                   f"{name}: gather the parameters before its forward"))
        if freed:
            rows.append(StepCollective("all_gather", kind, "backward", m, piece * param_bytes,
                                       f"{name}: gather them again before its backward"))
    rows.append(StepCollective("reduce_scatter", kind, "backward", m, piece * shard * grad_bytes,
                               f"{name}: my slice of the averaged gradients"))
    rows += _replica_rows(piece, dp, shard, m, grad_bytes, name)
    if stage == 2:
        rows.append(StepCollective("all_gather", kind, "optimizer", 1, piece * param_bytes,
                                   f"{name}: every rank gets the updated parameters"))
    return rows


def _replica_rows(piece: int, dp: int, shard: int, count: int, grad_bytes: int,
                  name: str) -> list[StepCollective]:
    """HSDP: the reduced slice all-reduced over the ``dp / shard`` replicas of the group."""
    if shard == dp:
        return []
    return [StepCollective("all_reduce", "dp_replicate", "backward", count, piece * grad_bytes,
                           f"{name}: HSDP, sum my slice over the replicas")]


def step_bytes_sent(rows: Iterable[StepCollective], group_sizes: dict[str, int]) -> float:
    """Bytes one rank puts on the wire for ``rows`` with ring algorithms
    (:func:`~tutorial_lib.costs.alpha_beta.ring_bytes_sent`), ``group_sizes[kind]`` ranks per group."""
    return sum(row.count * ring_bytes_sent(row.op, row.bytes_each, group_sizes[row.group_kind])
               for row in rows)


def sharding_beats_tp_tokens(parameters: int, num_layers: int, hidden_size: int, world: int,
                             tp: int) -> float:
    """Tokens per step above which ZeRO-3 on all ``world`` ranks (TP 1) sends fewer bytes per
    rank than TP ``tp`` x DP ``world / tp`` with plain DP (chapter 12, "Sharding or tensor
    parallelism?"), on rings, every collective in the same dtype.

    With ``Psi`` parameters, ``L`` blocks of hidden size ``h``, ``N`` ranks, ``T = tp``,
    ``D = N / T`` and ``x`` tokens in a step, ``a`` bytes per element, per rank and step:

    - ZeRO-3 gathers every parameter twice and reduce-scatters its gradient once, whatever
      the batch: ``3 (N-1)/N Psi a`` (:func:`sharded_step_collectives`);
    - TP all-reduces an ``[s, b, h]`` activation four times per block and microbatch
      (chapter 3, no sequence parallelism), on the ``x / D`` tokens of its replica:
      ``4 L (x / D) h a 2 (T-1)/T``, and plain DP all-reduces the ``Psi / T`` gradients of
      the rank's shard: ``2 (D-1)/D (Psi / T) a``.

    The two are equal at ``x* = D Psi (3 (N-1)/N - 2 (D-1)/(D T)) / (8 L h (T-1)/T)``; ``a``
    cancels.  The embedding's and the loss's small collectives are left out.
    """
    n, t = _positive("world", world), _positive("tp", tp)
    if t < 2 or n % t:
        raise ValueError(f"tp ({t}) must be 2 or more and divide world ({n}): the formula "
                         f"compares TP {t} x DP {n}/{t} with ZeRO-3 on DP {n}")
    d = n // t
    psi, layers, h = (_positive(name, value) for name, value in (
        ("parameters", parameters), ("num_layers", num_layers), ("hidden_size", hidden_size)))
    sharded = 3 * (n - 1) / n * psi
    tp_replicas = 2 * (d - 1) / d * psi / t
    tp_per_token = 4 * layers * h * 2 * (t - 1) / t / d
    return (sharded - tp_replicas) / tp_per_token
