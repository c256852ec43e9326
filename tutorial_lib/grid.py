"""The process grid: which rank sits where, and who talks to whom.

Everything here is plain integer arithmetic: no ``torch.distributed``, so tests,
widgets and the book use it directly.  :mod:`tutorial_lib.parallel_state` turns
the rank lists computed here into live process groups.

A *grid* lays ranks out along named dimensions.  An *order string* such as
``"tp-cp-ep-dp-pp"`` lists the dimensions fastest first (Megatron's convention):
``rank = tp + TP * (cp + CP * (ep + EP * (dp + DP * pp)))``.  A *communicator
group* is the set of ranks that share every coordinate except the varying ones.

Three layouts are taught (see chapter 1):

``megatron``
    Megatron-Core's "MoE parallel folding": two grids over the same ranks that
    share the pipeline dimension.  The dense grid is ``tp-cp-dp-pp``, the expert
    grid ``etp-ep-edp-pp``.  EP is carved out of the dense data-parallel ranks.
``course``
    The 4D order the course's pipeline chapter starts from:
    ``rank = (((dp * PP + pp) * TP + tp) * EP + ep)``, i.e. order ``ep-tp-cp-pp-dp``
    (CP slotted in after TP, where the formula has none).
``visualizer``
    The communicator-groups visualizer: ``rank = tp + TP*(ep + EP*(cp + CP*(dp + DP*pp)))``,
    order ``tp-ep-cp-dp-pp``.  It counts EP as a dimension of its own.

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

from .config import ConfigError, ParallelConfig, check_grid

#: Named layouts and their order strings (fastest dimension first).
LAYOUT_ORDERS = {
    "megatron": ("tp-cp-dp-pp", "etp-ep-edp-pp"),
    "course": ("ep-tp-cp-pp-dp",),
    "visualizer": ("tp-ep-cp-dp-pp",),
}

#: Group kinds printed by the command line (and the keys of ``--json``).
GROUP_KINDS = ("tp", "cp", "pp", "dp", "ep", "expert_tp", "expert_dp")

#: Extra kinds: Megatron's model-parallel (TP x PP), data x context, embedding.
EXTRA_GROUP_KINDS = ("dp_cp", "mp", "embedding")

SINGLE_GRID_DIMS = ("tp", "cp", "ep", "dp", "pp")


def parse_order(order: str, allowed=SINGLE_GRID_DIMS) -> tuple[str, ...]:
    """Split ``"tp-cp-ep-dp-pp"`` into dimension names, checking each appears once."""
    dims = tuple(part.strip() for part in order.lower().split("-"))
    if sorted(dims) != sorted(allowed):
        raise ConfigError(
            "malformed",
            f"order {order!r} must name each of {', '.join(allowed)} exactly once, "
            f"joined by '-', fastest first (e.g. 'tp-cp-ep-dp-pp')",
        )
    return dims


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


class ProcessGrid:
    """All coordinates and communicator groups of one parallel configuration."""

    def __init__(self, config: ParallelConfig, layout: str = "megatron", order: str | None = None):
        check_grid(config, layout if order is None else "course")
        self.config = config
        self.layout = layout if order is None else "custom"
        c = config
        if self.layout == "megatron":
            dense_order, expert_order = (parse_order(o, o.split("-")) for o in LAYOUT_ORDERS["megatron"])
            dense_sizes = {"tp": c.tensor_model_parallel_size, "cp": c.context_parallel_size,
                           "dp": c.data_parallel_size, "pp": c.pipeline_model_parallel_size}
            expert_sizes = {"etp": c.expert_tensor_parallel_size, "ep": c.expert_model_parallel_size,
                            "edp": c.expert_data_parallel_size, "pp": c.pipeline_model_parallel_size}
            self.dense = RankGrid(dense_order, tuple(dense_sizes[d] for d in dense_order))
            self.expert = RankGrid(expert_order, tuple(expert_sizes[d] for d in expert_order))
        else:
            dims = parse_order(order or LAYOUT_ORDERS[layout][0])
            sizes = {"tp": c.tensor_model_parallel_size, "cp": c.context_parallel_size,
                     "ep": c.expert_model_parallel_size, "pp": c.pipeline_model_parallel_size}
            sizes["dp"] = c.world_size // math.prod(sizes.values())
            self.dense = self.expert = RankGrid(dims, tuple(sizes[d] for d in dims))
        self.order = "-".join(self.dense.order)

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
            orders = f"dense order {self.order}, expert order {'-'.join(self.expert.order)}"
        else:
            orders = f"order {self.order}"
        return f"{head} [{self.layout} layout: {orders}]"


def build_grid(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, etp: int = 1,
               layout: str = "megatron", order: str | None = None) -> ProcessGrid:
    """Short-hand: ``build_grid(8, tp=2, pp=2)``."""
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
    parser.add_argument("--etp", type=int, default=1, help="expert_tensor_parallel_size")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--order", help="a single grid's order, fastest first, e.g. tp-cp-ep-dp-pp")
    where.add_argument("--layout", choices=sorted(LAYOUT_ORDERS), default="megatron")
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
