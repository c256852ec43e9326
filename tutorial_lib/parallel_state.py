"""Live communicator groups, built in every worker from the pure grid.

:mod:`tutorial_lib.grid` says which ranks belong together; this module asks
``torch.distributed`` for one process group per rank list and remembers, for the
calling rank, the group of each kind it belongs to.  Look groups up by kind:
``get_group("tp")``, ``get_group("expert_dp")``, ``get_group("world")``.

``torch.distributed.new_group`` is collective over the whole world: every rank
must create every group, in the same order, even the groups it is not in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .config import ParallelConfig
from .grid import EXTRA_GROUP_KINDS, GROUP_KINDS, ProcessGrid


@dataclass
class ParallelState:
    """The calling rank's view of the grid and its live groups."""

    grid: ProcessGrid
    """The pure grid the groups were built from."""
    rank: int
    """This process's global rank."""
    groups: dict = field(default_factory=dict)
    """Kind -> the ``ProcessGroup`` of that kind containing this rank."""
    ranks: dict = field(default_factory=dict)
    """Kind -> the global ranks of that group, in group order."""
    p2p_groups: dict = field(default_factory=dict)
    """Kind -> the twin of that group for point-to-point traffic, made only while torch's
    collective check is on (:func:`new_unchecked_group`)."""


_STATE: ParallelState | None = None


def initialize_model_parallel(config: ParallelConfig, layout: str | None = None,
                              order: str | None = None) -> ParallelState:
    """Build every group of ``config``'s grid; call once per worker after ``init_process_group``.

    ``layout`` and ``order`` as in :class:`~tutorial_lib.grid.ProcessGrid`: neither given,
    Megatron-Core's layout in its default order; ``layout="megatron", order=...``, its two
    grids read from that order; an order alone, one grid in that order.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (tutorial_lib.launch does that for you)")
    if config.world_size != dist.get_world_size():
        raise ValueError(f"config.world_size ({config.world_size}) differs from the launched "
                         f"world size ({dist.get_world_size()})")
    grid = ProcessGrid(config, layout=layout, order=order)
    rank = dist.get_rank()
    state = ParallelState(grid=grid, rank=rank)
    # Kinds often share rank lists (e.g. dp and expert_dp): create each list once.
    created: dict[tuple[int, ...], object] = {}
    twins: dict[tuple[int, ...], object] = {}
    checked = collective_checks_on()
    for kind in GROUP_KINDS + EXTRA_GROUP_KINDS:
        for ranks in grid.groups(kind):
            key = tuple(ranks)
            if key not in created:
                created[key] = dist.new_group(ranks=list(key))
                if checked:
                    twins[key] = new_unchecked_group(list(key))
            if rank in ranks:
                state.groups[kind] = created[key]
                state.ranks[kind] = list(ranks)
                if checked:
                    state.p2p_groups[kind] = twins[key]
    state.groups["world"] = dist.group.WORLD
    state.ranks["world"] = list(range(dist.get_world_size()))
    # new_group does not wait for its members: without this barrier a rank could
    # finish and exit while a peer is still connecting to it ("Connection closed by peer").
    dist.barrier()
    _STATE = state
    return state


def is_initialized() -> bool:
    return _STATE is not None


def get_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model-parallel groups are not built yet: call "
                           "parallel_state.initialize_model_parallel(config) in the worker")
    return _STATE


def get_group(kind: str = "world"):
    """The live ``ProcessGroup`` of ``kind`` that holds this rank."""
    if kind == "world" and _STATE is None:
        return dist.group.WORLD
    state = get_state()
    if kind not in state.groups:
        if kind in GROUP_KINDS + EXTRA_GROUP_KINDS:
            state.grid.group_of(kind, state.rank)  # raises the reason this rank has none
        raise KeyError(f"unknown group kind {kind!r}; kinds are {', '.join(sorted(state.groups))}")
    return state.groups[kind]


def collective_checks_on() -> bool:
    """True when torch's collective-consistency check wraps new groups
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``; ``launch(..., check_collectives=True)``)."""
    return dist.get_debug_level() == dist.DebugLevel.DETAIL


def new_unchecked_group(ranks: list[int] | None = None):
    """A new group that torch's collective check leaves alone, for point-to-point traffic.

    The check compares a sequence number with each collective, and gloo counts sends and
    receives in that number too: after a pipeline's uneven point-to-point traffic the ranks'
    numbers differ although every collective matches.  So while the check is on, ``comm``'s
    sends and receives travel on a twin of each group made with the check off (the wrapper
    is chosen when a group is created).  Collective over the world, like ``new_group``.
    """
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        return dist.new_group(ranks=ranks)
    finally:
        dist.set_debug_level(level)


_WORLD_P2P = None


def make_world_p2p_group() -> None:
    """Make the world's point-to-point twin; every rank calls it right after
    ``init_process_group`` when the collective check is on (the launcher does)."""
    global _WORLD_P2P
    _WORLD_P2P = new_unchecked_group() if collective_checks_on() else None


def get_p2p_group(kind: str = "world"):
    """The group ``comm``'s sends and receives of ``kind`` use: the group itself, or its
    unchecked twin while the collective check is on (:func:`new_unchecked_group`)."""
    if kind == "world" and _WORLD_P2P is not None:
        return _WORLD_P2P
    if _STATE is not None and kind in _STATE.p2p_groups:
        return _STATE.p2p_groups[kind]
    return get_group(kind)


def get_group_ranks(kind: str = "world") -> list[int]:
    """Global ranks of this rank's group of ``kind``, in group order."""
    if kind == "world" and _STATE is None:
        return list(range(dist.get_world_size()))
    get_group(kind)  # raises a helpful error for unknown kinds
    return list(get_state().ranks[kind])


def get_rank_in(kind: str) -> int:
    """This rank's index inside its group of ``kind``."""
    return get_group_ranks(kind).index(dist.get_rank())


def get_size(kind: str) -> int:
    """Number of ranks in this rank's group of ``kind``."""
    return len(get_group_ranks(kind))


def group_size(kind: str | None) -> int:
    """Ranks in this rank's group of ``kind``; 1 when serial (``kind=None``) or no groups are built.

    The one question every layer asks ("how many ranks share my work?"), so the same
    layer runs serially in a plain session and split inside workers.
    """
    if kind is None or not is_initialized():
        return 1
    return get_size(kind)


def group_rank(kind: str | None) -> int:
    """This rank's index inside its group of ``kind``; 0 when serial or no groups are built."""
    return 0 if group_size(kind) == 1 else get_rank_in(kind)


def destroy_model_parallel() -> None:
    """Forget the groups (the process groups die with ``destroy_process_group``)."""
    global _STATE
    _STATE = None
