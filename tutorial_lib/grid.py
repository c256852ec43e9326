"""The process grid: which rank sits where, and who talks to whom.

Everything here is plain integer arithmetic: no ``torch.distributed``, so tests,
widgets and the book use it directly.  :mod:`tutorial_lib.parallel_state` turns
the rank lists computed here into live process groups.

A *grid* lays ranks out along named dimensions.  An *order string* such as
``"tp-cp-ep-dp-pp"`` lists the dimensions fastest first (Megatron's convention):
``rank = tp + TP * (cp + CP * (ep + EP * (dp + DP * pp)))``.  A *communicator
group* is the set of ranks that share every coordinate except the varying ones.
A dimension of size 1 may be left out of an order string (it changes no rank);
leaving out a larger one is an error that names it, as in Megatron-Core's
``RankGenerator``.  One difference: Megatron-Core's ``initialize_model_parallel``
(d98e8a64, ``megatron/core/parallel_state.py``) fails on an order without ``tp`` even
at TP = 1: it inserts a ``gtp_remat`` axis, in whose name ``RankGenerator``'s substring
test finds ``tp``, so ``tp`` is never appended and building the TP groups raises.  The
course accepts such an order (``cp-dp-pp``).

Three layouts are taught (see chapter 1):

``megatron``
    Megatron-Core's "MoE parallel folding": two grids over the same ranks that
    share the pipeline dimension, both read from one order string (default
    ``tp-cp-ep-dp-pp``, Megatron-Core's).  The dense grid is the order without
    ``ep`` (``tp-cp-dp-pp``), the expert grid the order without ``cp``, with
    ``tp`` read as ETP and ``dp`` as EDP (``etp-ep-edp-pp``).  EP is carved out
    of the dense data-parallel ranks.  :func:`build_grid` and the command line
    default ETP to TP here, as Megatron-Core does.
``course``
    The 4D order the course's pipeline chapter starts from:
    ``rank = (((dp * PP + pp) * TP + tp) * EP + ep)``, i.e. order ``ep-tp-cp-pp-dp``
    (CP slotted in after TP, where the formula has none).
``visualizer``
    The communicator-groups visualizer: ``rank = tp + TP*(ep + EP*(cp + CP*(dp + DP*pp)))``,
    order ``tp-ep-cp-dp-pp``.  It counts EP as a dimension of its own.

An order string given without a layout builds one grid in that order, with EP a
dimension of its own (layout ``custom``), like ``course`` and ``visualizer``.  For
``tp-cp-ep-dp-pp`` its groups differ from the megatron layout's exactly when EP > 1
and CP > 1 or ETP != TP.

In the single-grid layouts the dense data-parallel group varies both ``dp`` and
``ep``: ranks with different EP coordinates process different tokens, so they are
replicas of every dense weight (a group of "fixed (tp, ep), varying dp" would
leave those replicas drifting apart).  Its size is ``world / (TP * CP * PP)`` in
every layout, as in Megatron.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass
from functools import cached_property
from itertools import product

from .config import LAYOUTS, ConfigError, ParallelConfig, check_grid

#: Megatron-Core's default order string (``initialize_model_parallel``'s ``order``):
#: the megatron layout reads both of its grids from it unless given another.
MEGATRON_ORDER = "tp-cp-ep-dp-pp"

#: Named layouts and the grids' order strings (fastest dimension first); for
#: ``megatron``, the dense and expert grids read from :data:`MEGATRON_ORDER`.
LAYOUT_ORDERS = {
    "megatron": ("tp-cp-dp-pp", "etp-ep-edp-pp"),
    "course": ("ep-tp-cp-pp-dp",),
    "visualizer": ("tp-ep-cp-dp-pp",),
}

#: Group kinds printed by the command line (and the keys of ``--json``).
GROUP_KINDS = ("tp", "cp", "pp", "dp", "ep", "expert_tp", "expert_dp")

#: Extra kinds: Megatron's model-parallel (TP x PP), data x context, embedding.
EXTRA_GROUP_KINDS = ("dp_cp", "mp", "embedding")

#: The names an order string may use.
SINGLE_GRID_DIMS = ("tp", "cp", "ep", "dp", "pp")

#: What each name of an order string stands for in the megatron layout's expert grid
#: (``cp`` has no place there: the expert grid has CP = 1).
EXPERT_GRID_NAMES = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}


def parse_order(order: str, sizes: dict[str, int] | None = None,
                where: str = "") -> tuple[str, ...]:
    """Split ``"tp-cp-ep-dp-pp"`` into dimension names, fastest first, each named at most once.

    A dimension left out of ``order`` is appended (slowest) when its size in ``sizes``
    is 1, where it changes no rank; one whose size is not 1 is refused, naming it (the
    rule of Megatron-Core's ``RankGenerator``; its ``initialize_model_parallel`` refuses
    any order without ``tp``, see the module docstring).  Without ``sizes`` every dimension must
    be named.  ``where`` says which grid ``sizes`` describe, for the message.
    """
    dims = tuple(part.strip() for part in str(order).lower().split("-"))
    names = ", ".join(SINGLE_GRID_DIMS)
    if not str(order).strip():
        raise ConfigError(
            "malformed",
            f"order {order!r} is empty; an order joins {names} with '-', fastest first "
            f"(e.g. {MEGATRON_ORDER!r}), or leave the order out for the layout's own",
        )
    for dim in dims:
        if dim not in SINGLE_GRID_DIMS:
            raise ConfigError(
                "malformed",
                f"order {order!r} names {dim!r}, which is not a dimension; an order joins "
                f"{names} with '-', fastest first (e.g. {MEGATRON_ORDER!r})",
            )
        if dims.count(dim) > 1:
            raise ConfigError(
                "malformed",
                f"order {order!r} names {dim} {dims.count(dim)} times; name each of {names} "
                f"once, joined by '-', fastest first (e.g. {MEGATRON_ORDER!r})",
            )
    missing = tuple(d for d in SINGLE_GRID_DIMS if d not in dims)
    for dim in missing:
        if sizes is None:
            raise ConfigError(
                "malformed",
                f"order {order!r} leaves out {dim}; name each of {names} once, joined by "
                f"'-', fastest first (e.g. {MEGATRON_ORDER!r})",
            )
        if sizes[dim] != 1:
            raise ConfigError(
                "order",
                f"order {order!r} leaves out {dim}, whose size{where} is {sizes[dim]}; only a "
                f"dimension of size 1 may be left out. Add {dim} to the order (Megatron-Core's "
                f"default order is {MEGATRON_ORDER!r})",
            )
    return dims + missing


@dataclass(frozen=True)
class RankGrid:
    """One grid: ``order`` lists dimensions fastest first, ``sizes`` their extents."""

    order: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, dim: str) -> int:
        return self.sizes[self.order.index(dim)]

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> coordinates: peel off the fastest dimension first."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        out = {}
        for dim, size in zip(self.order, self.sizes):
            out[dim] = rank % size
            rank //= size
        return out

    def rank(self, **coords: int) -> int:
        """Coordinates -> rank: ``c0 + S0 * (c1 + S1 * (c2 + ...))``."""
        rank = 0
        for dim, size in reversed(list(zip(self.order, self.sizes))):
            c = coords.get(dim, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {dim}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def stride(self, dim: str) -> int:
        """How far apart two ranks are whose ``dim`` coordinates differ by one."""
        return math.prod(self.sizes[:self.order.index(dim)])

    def group_count(self, *varying: str) -> int:
        """How many groups :meth:`groups` lists for ``varying``."""
        return self.world_size // self.group_size(*varying)

    def group_size(self, *varying: str) -> int:
        """How many ranks each group of ``varying`` holds."""
        return math.prod(self.size(d) for d in varying)

    def group_member(self, group: int, index: int, *varying: str) -> int:
        """``self.groups(*varying)[group][index]`` without listing the groups.

        Group ``g``'s fixed coordinates are the digits of ``g`` in the mixed radix of the
        fixed dimensions, fastest first; member ``i``'s varying coordinates are the digits of
        ``i`` in the varying dimensions' radix.  Both orders ascend, because a dimension's
        stride exceeds what all faster dimensions together can add.
        """
        fixed = [d for d in self.order if d not in varying]
        if not 0 <= group < self.group_count(*varying) or not 0 <= index < self.group_size(*varying):
            raise ValueError(f"group {group}, member {index}: outside the {self.group_count(*varying)} "
                             f"groups of {self.group_size(*varying)} ranks varying {varying}")
        rank = 0
        for dims, number in ((fixed, group), ([d for d in self.order if d in varying], index)):
            for dim in dims:
                rank += (number % self.size(dim)) * self.stride(dim)
                number //= self.size(dim)
        return rank

    def groups(self, *varying: str) -> list[list[int]]:
        """Ranks sharing every coordinate except ``varying``, one list per group.

        Groups are listed in the order of their smallest rank, and each group's
        ranks ascend: the order ``torch.distributed.new_group`` gives its members,
        so a rank's index here is its rank inside the live group.
        """
        fixed = [d for d in self.order if d not in varying]
        out = []
        for fixed_values in product(*(range(self.size(d)) for d in fixed)):
            base = dict(zip(fixed, fixed_values))
            members = []
            for var_values in product(*(range(self.size(d)) for d in reversed(varying))):
                members.append(self.rank(**base, **dict(zip(reversed(varying), var_values))))
            out.append(sorted(members))
        return sorted(out, key=min)


def megatron_grids(config: ParallelConfig, order: str = MEGATRON_ORDER) -> tuple[RankGrid, RankGrid]:
    """Megatron-Core's dense and expert grids, both read from one ``order`` string.

    As ``initialize_model_parallel`` builds its two ``RankGenerator`` objects (Megatron-Core
    0.20.0): the dense grid takes the order with EP = 1, so ``ep`` drops out; the expert
    grid takes the same order with CP = 1, so ``cp`` drops out, and its ``tp`` and ``dp``
    are ETP and EDP.  A dimension of size 1 in both grids may be left out of the order
    (``RankGenerator``'s rule; 0.20.0's ``initialize_model_parallel`` itself fails on an
    order without ``tp``, whose name it finds inside the ``gtp_remat`` name it inserts).
    Megatron-Core refuses an order under which the two grids would not share their
    pipeline groups, and, with PP > 1, an order that does not end in ``pp`` unless
    DP = EDP; so does this function (:class:`ConfigError` ``"order"``).
    """
    c = config
    pp = c.pipeline_model_parallel_size
    dense_sizes = {"tp": c.tensor_model_parallel_size, "cp": c.context_parallel_size, "ep": 1,
                   "dp": c.data_parallel_size, "pp": pp}
    expert_sizes = {"tp": c.expert_tensor_parallel_size, "cp": 1,
                    "ep": c.expert_model_parallel_size, "dp": c.expert_data_parallel_size, "pp": pp}
    parse_order(order, dense_sizes, " in the dense grid")
    dims = parse_order(order, expert_sizes, " in the expert grid (where tp is ETP and dp is EDP)")
    dense = RankGrid(tuple(d for d in dims if d != "ep"),
                     tuple(dense_sizes[d] for d in dims if d != "ep"))
    expert = RankGrid(tuple(EXPERT_GRID_NAMES[d] for d in dims if d != "cp"),
                      tuple(expert_sizes[d] for d in dims if d != "cp"))
    last_named = str(order).lower().split("-")[-1].strip()
    dp, edp = dense_sizes["dp"], expert_sizes["dp"]
    if last_named != "pp" and pp > 1 and dp != edp:
        raise ConfigError(
            "order",
            f"order {order!r} does not end in pp, and with PP = {pp} Megatron-Core then needs "
            f"the dense and expert data-parallel sizes to match, but DP = {dp} and EDP = {edp}; "
            f"put pp last (e.g. {MEGATRON_ORDER!r}) or make TP * CP equal ETP * EP",
        )
    # The pipeline groups agree iff ``pp`` has the same stride in both grids (or PP = 1):
    # then every rank has the same pp coordinate in both; else rank 0's groups differ.
    if pp > 1 and dense.stride("pp") != expert.stride("pp"):
        first = {name: _abbreviated(lambda i, grid=grid: grid.group_member(0, i, "pp"), pp)
                 for name, grid in (("dense", dense), ("expert", expert))}
        raise ConfigError(
            "order",
            f"order {order!r} gives the dense and expert grids different pipeline groups "
            f"(rank 0's: {first['dense']} and {first['expert']}), and Megatron-Core "
            f"needs one pipeline for both; put pp last (e.g. {MEGATRON_ORDER!r})",
        )
    return dense, expert


def _resolve_layout(layout: str | None, order: str | None) -> str:
    """No layout: ``megatron``, or ``custom`` (one grid in that order) when an order is given."""
    if layout is None:
        return "megatron" if order is None else "custom"
    if layout in ("course", "visualizer") and order is not None:
        raise ConfigError(
            "malformed",
            f"the {layout!r} layout has its own order ({LAYOUT_ORDERS[layout][0]}), so it takes "
            f"no order {order!r}; give layout 'megatron' for Megatron-Core's two grids read from "
            f"{order!r}, or no layout for one grid in that order",
        )
    if layout == "custom" and order is None:
        raise ConfigError("malformed", "the 'custom' layout is one grid in a given order: pass an order")
    return layout


class ProcessGrid:
    """All coordinates and communicator groups of one parallel configuration.

    ``layout`` is ``megatron``, ``course`` or ``visualizer``; ``order`` goes with
    ``megatron`` (the order both of its grids are read from, :func:`megatron_grids`),
    or stands alone: then it builds one grid in that order, EP a dimension of its own
    (layout ``custom``).  Neither given: the megatron layout in Megatron-Core's order.
    """

    def __init__(self, config: ParallelConfig, layout: str | None = None, order: str | None = None):
        layout = _resolve_layout(layout, order)
        check_grid(config, layout)
        self.config = config
        self.layout = layout
        c = config
        if layout == "megatron":
            order = MEGATRON_ORDER if order is None else order
            self.dense, self.expert = megatron_grids(config, order)
            # the order as Megatron-Core completes it: left-out dimensions (size 1) appended
            self.order = "-".join(parse_order(order, dict.fromkeys(SINGLE_GRID_DIMS, 1)))
        else:
            sizes = {"tp": c.tensor_model_parallel_size, "cp": c.context_parallel_size,
                     "ep": c.expert_model_parallel_size, "pp": c.pipeline_model_parallel_size}
            sizes["dp"] = c.world_size // math.prod(sizes.values())
            dims = parse_order(LAYOUT_ORDERS[layout][0] if order is None else order, sizes)
            self.dense = self.expert = RankGrid(dims, tuple(sizes[d] for d in dims))
            self.order = "-".join(dims)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def folded(self) -> bool:
        """True when dense and expert grids are separate (Megatron's folding)."""
        return self.dense is not self.expert

    def coords(self, rank: int) -> dict[str, int]:
        """Every coordinate of ``rank``: the dense grid's, then the expert grid's."""
        out = dict(self.dense.coords(rank))
        if self.folded:
            out.update({k: v for k, v in self.expert.coords(rank).items() if k != "pp"})
        return out

    @cached_property
    def _specs(self) -> dict[str, tuple[RankGrid, tuple[str, ...]]]:
        """Each group kind but ``embedding`` as ``(grid, varying dimensions)``."""
        d, e = self.dense, self.expert
        etp = self.config.expert_tensor_parallel_size
        if self.folded:
            return {
                "tp": (d, ("tp",)), "cp": (d, ("cp",)), "pp": (d, ("pp",)), "dp": (d, ("dp",)),
                "dp_cp": (d, ("cp", "dp")), "mp": (d, ("tp", "pp")),
                "ep": (e, ("ep",)), "expert_tp": (e, ("etp",)), "expert_dp": (e, ("edp",)),
            }
        expert_replicas = ("dp", "cp") if etp > 1 else ("tp", "dp", "cp")
        return {
            "tp": (d, ("tp",)), "cp": (d, ("cp",)), "pp": (d, ("pp",)), "ep": (d, ("ep",)),
            "dp": (d, ("ep", "dp")),
            "dp_cp": (d, ("ep", "dp", "cp")),
            "mp": (d, ("tp", "pp")),
            "expert_tp": (d, ("tp",) if etp > 1 else ()),  # ETP = 1: every rank alone
            "expert_dp": (d, expert_replicas),
        }

    @cached_property
    def _groups(self) -> dict[str, list[list[int]]]:
        groups = {kind: grid.groups(*varying) for kind, (grid, varying) in self._specs.items()}
        groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
        return groups

    def _check_kind(self, kind: str) -> None:
        if kind not in self._specs and kind != "embedding":
            raise KeyError(
                f"unknown group kind {kind!r}; kinds are {', '.join(GROUP_KINDS + EXTRA_GROUP_KINDS)}"
            )

    def group_count(self, kind: str) -> int:
        """How many groups of ``kind`` there are, without listing them."""
        self._check_kind(kind)
        grid, varying = self._specs["pp" if kind == "embedding" else kind]
        return grid.group_count(*varying)

    def group_size(self, kind: str) -> int:
        """How many ranks each group of ``kind`` holds (all groups of a kind are alike)."""
        self._check_kind(kind)
        if kind == "embedding":
            return min(2, self.group_size("pp"))
        grid, varying = self._specs[kind]
        return grid.group_size(*varying)

    def group_member(self, kind: str, group: int, index: int) -> int:
        """``self.groups(kind)[group][index]``, computed without listing every group."""
        self._check_kind(kind)
        if kind == "embedding":
            size = self.group_size("pp")
            return self.group_member("pp", group, (0, size - 1)[index] if size > 1 else index)
        grid, varying = self._specs[kind]
        return grid.group_member(group, index, *varying)

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (see :data:`GROUP_KINDS` and :data:`EXTRA_GROUP_KINDS`)."""
        self._check_kind(kind)
        return [list(g) for g in self._groups[kind]]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that contains ``rank``."""
        for group in self._groups[kind]:
            if rank in group:
                return list(group)
        if kind == "embedding":
            raise ValueError(f"rank {rank} is a middle pipeline stage: only the first and last "
                             f"stages hold the (tied) embedding, so it is in no embedding group")
        raise ValueError(f"rank {rank} is in no {kind} group")

    def all_groups(self, kinds=GROUP_KINDS) -> dict[str, list[list[int]]]:
        return {k: self.groups(k) for k in kinds}

    def describe(self) -> str:
        c = self.config
        head = (
            f"world_size={c.world_size} TP={c.tensor_model_parallel_size} "
            f"CP={c.context_parallel_size} EP={c.expert_model_parallel_size} "
            f"PP={c.pipeline_model_parallel_size} ETP={c.expert_tensor_parallel_size} "
            f"-> DP={c.data_parallel_size} EDP={c.expert_data_parallel_size}"
        )
        if self.folded:
            orders = (f"order {self.order}: dense grid {'-'.join(self.dense.order)}, "
                      f"expert grid {'-'.join(self.expert.order)}")
        else:
            orders = f"order {self.order}"
        return f"{head} [{self.layout} layout: {orders}]"


def build_grid(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1,
               etp: int | None = None, layout: str | None = None,
               order: str | None = None) -> ProcessGrid:
    """Short-hand: ``build_grid(8, tp=2, pp=2)``; ``layout`` and ``order`` as in :class:`ProcessGrid`.

    ``etp=None`` takes Megatron-Core's default in the megatron layout, ETP = TP
    (``initialize_model_parallel`` and ``ModelParallelConfig``, Megatron-Core 0.20.0),
    and 1 in the single-grid layouts, which have no expert-TP dimension.
    (:class:`~tutorial_lib.config.ParallelConfig` itself, the training configuration,
    also defaults an unset ETP to TP, as Megatron-LM's ``validate_args`` does.)
    """
    if etp is None:
        etp = tp if _resolve_layout(layout, order) == "megatron" else 1
    config = ParallelConfig(world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, context_parallel_size=cp,
                            expert_tensor_parallel_size=etp)
    return ProcessGrid(config, layout=layout, order=order)


#: The command line prints every group up to this world size, a summary above it.
LIST_ALL_UP_TO = 256

#: ``--all`` and ``--json`` list every group of at most this many ranks (2**20; a minute's work).
MAX_LISTED_WORLD_SIZE = 2**20

#: The largest world the command line describes at all (2**24 ranks).
MAX_WORLD_SIZE = 2**24


def _abbreviated(member, size: int, shown: int = 8) -> str:
    """A group of ``size`` ranks, ``member(i)`` its ``i``-th, as ``[0, 1, 2, ..., 99]``: all of
    them up to ``shown``, else the first ``shown - 1`` and the last."""
    if size <= shown:
        return str([member(i) for i in range(size)])
    return "[" + ", ".join(str(member(i)) for i in range(shown - 1)) + f", ..., {member(size - 1)}]"


def format_groups(grid: ProcessGrid, kinds=GROUP_KINDS, summary: bool = False,
                  groups_shown: int = 4, members_shown: int = 8) -> str:
    """The layout's description, then one line per kind: ``count x size:`` and its groups.

    ``summary``: only the first ``groups_shown`` groups, each as its first
    ``members_shown - 1`` ranks and its last (computed without listing the groups, so a
    world of 2**24 ranks answers at once).
    """
    lines = [grid.describe()]
    width = max(len(k) for k in kinds)
    for kind in kinds:
        count, size = grid.group_count(kind), grid.group_size(kind)
        head = f"  {kind:<{width}}  {count} x {size}: "
        if not summary:
            lines.append(head + " ".join(str(g) for g in grid.groups(kind)))
            continue
        shown = [_abbreviated(functools.partial(grid.group_member, kind, g), size, members_shown)
                 for g in range(min(count, groups_shown))]
        more = f" ... ({count - len(shown):,} more)" if count > len(shown) else ""
        lines.append(head + " ".join(shown) + more)
    if summary:
        lines.append(f"(a summary: the first {groups_shown} groups of each kind; --all prints every "
                     f"group, up to {MAX_LISTED_WORLD_SIZE:,} ranks)")
    return "\n".join(lines)


def _repeating_world(grid: ProcessGrid) -> int:
    """The smallest world with the same sizes: the groups' pattern repeats every this many ranks."""
    c = grid.config
    tp, cp, pp = c.tensor_model_parallel_size, c.context_parallel_size, c.pipeline_model_parallel_size
    ep, etp = c.expert_model_parallel_size, c.expert_tensor_parallel_size
    if grid.folded:
        return math.lcm(tp * cp * pp, etp * ep * pp)
    return tp * cp * ep * pp


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.grid",
        description="Print every communicator group of a parallel layout.",
    )
    parser.add_argument("--world-size", type=int, required=True,
                        help=f"ranks in all (at most {MAX_WORLD_SIZE:,}); above {LIST_ALL_UP_TO} "
                             f"a summary is printed unless --all")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
    parser.add_argument("--cp", type=int, default=1, help="context_parallel_size")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert_tensor_parallel_size (default: TP in the megatron layout, "
                             "Megatron-Core's default; 1 in the others and with a bare --order)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS),
                        help="megatron (the default), course or visualizer; with --order only "
                             "megatron")
    parser.add_argument("--order", help=(
        "an order string, fastest first, e.g. tp-cp-ep-dp-pp (Megatron-Core's default); a "
        "dimension of size 1 may be left out. With --layout megatron: Megatron-Core's two "
        "grids read from it (dense: the order without ep; expert: without cp, tp read as "
        "ETP, dp as EDP). A bare --order (no --layout) builds ONE grid in that order with "
        "EP a dimension of its own, like the course and visualizer layouts: for "
        "tp-cp-ep-dp-pp its groups differ from Megatron-Core's exactly when EP > 1 and "
        "CP > 1 or ETP != TP"))
    parser.add_argument("--json", action="store_true",
                        help=f"print one JSON object: kind -> rank lists (above {LIST_ALL_UP_TO} "
                             f"ranks only with --all)")
    parser.add_argument("--all", action="store_true",
                        help=f"print every group, also above {LIST_ALL_UP_TO} ranks (up to "
                             f"{MAX_LISTED_WORLD_SIZE:,})")
    parser.add_argument("--all-kinds", action="store_true",
                        help="also print dp_cp, mp (model parallel) and embedding groups")
    args = parser.parse_args(argv)
    kinds = GROUP_KINDS + (EXTRA_GROUP_KINDS if args.all_kinds else ())
    try:
        grid = build_grid(args.world_size, args.tp, args.pp, args.ep, args.cp, args.etp,
                          layout=args.layout, order=args.order)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    w, small = args.world_size, _repeating_world(grid)
    sizes = " ".join(f"--{name} {value}" for name, value in (
        ("tp", args.tp), ("pp", args.pp), ("ep", args.ep), ("cp", args.cp)) if value != 1)
    smaller = (f"the groups repeat every {small:,} ranks, so --world-size {min(4 * small, w):,}"
               + (f" {sizes}" if sizes else "") + " shows the same pattern")
    numbers = w * len(kinds)
    if w > MAX_WORLD_SIZE:
        print(f"error: world_size ({w:,}) is more ranks than this command describes (at most "
              f"{MAX_WORLD_SIZE:,} = 2**24); {smaller}", file=sys.stderr)
        return 2
    if (args.all or args.json) and w > MAX_LISTED_WORLD_SIZE:
        print(f"error: {'--json' if args.json else '--all'} lists every group, {numbers:,} numbers "
              f"for world_size {w:,}, and lists at most {MAX_LISTED_WORLD_SIZE:,} (2**20) ranks; "
              f"leave out {'--json and ' if args.json else ''}--all for a summary, or: {smaller}",
              file=sys.stderr)
        return 2
    if args.json and not args.all and w > LIST_ALL_UP_TO:
        print(f"error: --json lists every group, {numbers:,} numbers for world_size {w:,} (more "
              f"than {LIST_ALL_UP_TO} ranks); add --all to print them all, or leave out --json "
              f"for a summary", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(grid.all_groups(kinds)))
    else:
        print(format_groups(grid, kinds, summary=w > LIST_ALL_UP_TO and not args.all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
