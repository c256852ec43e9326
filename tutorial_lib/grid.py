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
``RankGenerator``.

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
    rule of Megatron-Core's ``RankGenerator``).  Without ``sizes`` every dimension must
    be named.  ``where`` says which grid ``sizes`` describe, for the message.
    """
    dims = tuple(part.strip() for part in str(order).lower().split("-"))
    names = ", ".join(SINGLE_GRID_DIMS)
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
    if dense.groups("pp") != expert.groups("pp"):
        raise ConfigError(
            "order",
            f"order {order!r} gives the dense and expert grids different pipeline groups "
            f"(rank 0's: {dense.groups('pp')[0]} and {expert.groups('pp')[0]}), and Megatron-Core "
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
            self.dense, self.expert = megatron_grids(config, order or MEGATRON_ORDER)
            # the order as Megatron-Core completes it: left-out dimensions (size 1) appended
            self.order = "-".join(parse_order(order or MEGATRON_ORDER, dict.fromkeys(SINGLE_GRID_DIMS, 1)))
        else:
            sizes = {"tp": c.tensor_model_parallel_size, "cp": c.context_parallel_size,
                     "ep": c.expert_model_parallel_size, "pp": c.pipeline_model_parallel_size}
            sizes["dp"] = c.world_size // math.prod(sizes.values())
            dims = parse_order(order or LAYOUT_ORDERS[layout][0], sizes)
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
    def _groups(self) -> dict[str, list[list[int]]]:
        d, e = self.dense, self.expert
        etp = self.config.expert_tensor_parallel_size
        if self.folded:
            groups = {
                "tp": d.groups("tp"), "cp": d.groups("cp"), "pp": d.groups("pp"),
                "dp": d.groups("dp"), "dp_cp": d.groups("cp", "dp"), "mp": d.groups("tp", "pp"),
                "ep": e.groups("ep"), "expert_tp": e.groups("etp"), "expert_dp": e.groups("edp"),
            }
        else:
            expert_replicas = ("dp", "cp") if etp > 1 else ("tp", "dp", "cp")
            groups = {
                "tp": d.groups("tp"), "cp": d.groups("cp"), "pp": d.groups("pp"),
                "ep": d.groups("ep"),
                "dp": d.groups("ep", "dp"),
                "dp_cp": d.groups("ep", "dp", "cp"),
                "mp": d.groups("tp", "pp"),
                "expert_tp": d.groups("tp") if etp > 1 else [[r] for r in range(self.world_size)],
                "expert_dp": d.groups(*expert_replicas),
            }
        groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
        return groups

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (see :data:`GROUP_KINDS` and :data:`EXTRA_GROUP_KINDS`)."""
        if kind not in self._groups:
            raise KeyError(
                f"unknown group kind {kind!r}; kinds are {', '.join(GROUP_KINDS + EXTRA_GROUP_KINDS)}"
            )
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
    and 1 in the single-grid layouts.  (:class:`~tutorial_lib.config.ParallelConfig`,
    the course's training configuration, defaults to ETP = 1: its routed experts are
    whole, rule 5.)
    """
    if etp is None:
        etp = tp if _resolve_layout(layout, order) == "megatron" else 1
    config = ParallelConfig(world_size, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, context_parallel_size=cp,
                            expert_tensor_parallel_size=etp)
    return ProcessGrid(config, layout=layout, order=order)


def format_groups(grid: ProcessGrid, kinds=GROUP_KINDS) -> str:
    lines = [grid.describe()]
    width = max(len(k) for k in kinds)
    for kind in kinds:
        groups = grid.groups(kind)
        lines.append(f"  {kind:<{width}}  {len(groups)} x {len(groups[0])}: "
                     + " ".join(str(g) for g in groups))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.grid",
        description="Print every communicator group of a parallel layout.",
    )
    parser.add_argument("--world-size", type=int, required=True)
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
    parser.add_argument("--json", action="store_true", help="print one JSON object: kind -> rank lists")
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
    if args.json:
        print(json.dumps(grid.all_groups(kinds)))
    else:
        print(format_groups(grid, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
