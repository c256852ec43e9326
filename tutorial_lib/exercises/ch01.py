"""Checkers for chapter 1, communicator groups and rank mapping.

* :func:`check_rank_to_coords`: turn a global rank into coordinates for any
  order string (fastest dimension first).
* :func:`check_data_parallel_group`: the data-parallel group of a rank in
  Megatron-Core's dense grid ``tp-cp-dp-pp``.

Both compare the student's function with :mod:`tutorial_lib.grid` on many grid
shapes, every rank of each, and when an answer is wrong they try the classic
wrong answers too: if the student's output matches one of them, the hint names
that mistake.  Student code never makes a checker raise.
"""
from __future__ import annotations

import math
from typing import Callable

from ..grid import RankGrid, build_grid
from .kit import Case, Checking, CheckResult, Mistakes, as_group_kinds, as_rank_list

# --- hints (tests look for these exact strings) ---------------------------------

HINT_SLOWEST_FIRST = (
    "you treated the first dimension of the order string as the slowest. The order is "
    "written fastest first: the first dimension is the lowest 'digit', so peel it off "
    "first with rank % size, then divide the rank by that size and go on to the next one."
)
HINT_DICT_ORDER = (
    "you walked the dimensions in the order of the sizes dictionary, not of the order "
    "string. The dictionary's key order means nothing; split `order` on '-' and walk that."
)
HINT_NO_MODULO = (
    "a coordinate came out larger than its dimension's size: after dividing by the "
    "stride, take the remainder modulo that dimension's size (or peel: c = rank % size; "
    "rank //= size)."
)
HINT_NOT_A_DICT = (
    "return a dict that maps every dimension name in the order string to this rank's "
    "coordinate, e.g. {'tp': 1, 'dp': 0, 'pp': 1}."
)
HINT_COORDS_NUDGE = (
    "read the rank as a number written in mixed digits, one digit per dimension, the first "
    "dimension of the order string being the lowest digit: which coordinate changes "
    "between rank 0 and rank 1, and after how many ranks does the second one change?"
)
HINT_COORDS_GENERIC = (
    "for order d0-d1-...-dk with sizes S0..Sk, rank = c0 + S0*(c1 + S1*(c2 + ...)). "
    "Invert it like writing a number in a mixed radix: c0 = rank % S0, then rank //= S0, "
    "then c1 = rank % S1, and so on."
)

HINT_TP_GROUP = (
    "you returned the tensor-parallel group: the ranks that differ only in tp. The "
    "data-parallel group keeps tp, cp and pp fixed and lets dp vary, so its members are "
    "TP*CP ranks apart, not 1."
)
HINT_PP_GROUP = (
    "you returned the pipeline group (fixed tp, cp, dp; varying pp). The data-parallel "
    "group keeps pp fixed: all its members belong to the same pipeline stage."
)
HINT_FORGOT_CP_MERGED = (
    "you forgot CP: your group has DP*CP ranks because it also varies the cp coordinate "
    "(that is Megatron's dp_cp group). Context-parallel ranks hold different parts of the "
    "sequence, so DP = world / (TP*CP*PP) and the members are TP*CP ranks apart."
)
HINT_FORGOT_CP_STRIDE = (
    "you forgot CP in the stride: in the order tp-cp-dp-pp one step of dp moves the rank "
    "by TP*CP, not by TP. With CP > 1 a stride of TP lands on a rank with another cp "
    "coordinate."
)
HINT_DP_OUTSIDE_PP = (
    "you put DP outside PP (rank = ... + TP*CP*(pp + PP*dp), the order tp-cp-pp-dp). "
    "Megatron's dense grid is tp-cp-dp-pp: PP is the slowest dimension, so "
    "rank = tp + TP*(cp + CP*(dp + DP*pp))."
)
HINT_FORGOT_CP_EVERYWHERE = (
    "you left CP out of the rank formula altogether: your members are TP ranks apart and "
    "your pipeline stages TP*DP ranks long, as if the grid were tp-dp-pp. In Megatron's "
    "tp-cp-dp-pp one step of dp moves the rank by TP*CP, and a pipeline stage holds "
    "TP*CP*DP ranks. (With CP = 1 the two agree, which is why some cases pass.)"
)
HINT_SAME_TP_RANK = (
    "you kept every rank with the same rank % tp: those share this rank's tp coordinate "
    "only, across every cp coordinate and every pipeline stage. The data-parallel group "
    "also keeps cp and pp fixed: among those ranks, only the ones in this rank's pipeline "
    "stage with its cp coordinate belong."
)
HINT_WHOLE_WORLD = (
    "you returned every rank. Only the ranks that share this rank's tp, cp and pp "
    "coordinates belong to its data-parallel group."
)
HINT_NOT_A_LIST = (
    "return the list of global ranks in this rank's data-parallel group (this rank "
    "included), e.g. [1, 3, 5, 7], not a single number."
)
HINT_DP_NUDGE = (
    "the data-parallel group of a rank is every rank that agrees with it on tp, cp and pp "
    "and differs only in dp. Work out this rank's coordinates first (as in exercise 1.1, "
    "with the order tp-cp-dp-pp), then let dp alone vary."
)
HINT_DP_GENERIC = (
    "in the dense grid rank = tp + TP*(cp + CP*(dp + DP*pp)) with DP = world/(TP*CP*PP). "
    "Work out this rank's tp, cp and pp, then list the ranks for dp = 0 .. DP-1."
)

#: The mistakes of exercise 1.1, in order of preference.
COORDS_MISTAKES = Mistakes(
    (HINT_COORDS_NUDGE, HINT_COORDS_GENERIC), not_a_dict=HINT_NOT_A_DICT,
    slowest_first=HINT_SLOWEST_FIRST, dict_order=HINT_DICT_ORDER, no_modulo=HINT_NO_MODULO)
#: The mistakes of exercise 1.2: each but the first is the group some other rule gives.
DATA_PARALLEL_MISTAKES = Mistakes(
    (HINT_DP_NUDGE, HINT_DP_GENERIC), not_a_list=HINT_NOT_A_LIST, tp=HINT_TP_GROUP,
    dp_cp=HINT_FORGOT_CP_MERGED, stride_tp=HINT_FORGOT_CP_STRIDE,
    cp_everywhere=HINT_FORGOT_CP_EVERYWHERE, dp_outside_pp=HINT_DP_OUTSIDE_PP, pp=HINT_PP_GROUP,
    same_tp_rank=HINT_SAME_TP_RANK, world=HINT_WHOLE_WORLD)



# --- exercise 1: rank -> coordinates ------------------------------------------------

#: (order, sizes) pairs: the library's layouts and some odd shapes (a size of 3, one
#: dimension of size 1) so that a formula that only works for powers of two fails.
RANK_TO_COORDS_SHAPES = [
    ("tp-cp-dp-pp", {"tp": 2, "cp": 1, "dp": 2, "pp": 2}),
    ("tp-ep-cp-dp-pp", {"tp": 2, "ep": 2, "cp": 2, "dp": 1, "pp": 2}),
    ("ep-tp-cp-pp-dp", {"ep": 4, "tp": 2, "cp": 1, "pp": 2, "dp": 2}),
    ("etp-ep-edp-pp", {"etp": 1, "ep": 4, "edp": 2, "pp": 2}),
    ("tp-cp-dp-pp", {"tp": 4, "cp": 2, "dp": 3, "pp": 2}),
    ("pp-dp-tp", {"pp": 3, "dp": 2, "tp": 2}),
    ("tp", {"tp": 4}),
]


def _reference_coords(order: str, sizes: dict) -> list[dict]:
    dims = tuple(order.split("-"))
    grid = RankGrid(dims, tuple(sizes[d] for d in dims))
    return [grid.coords(r) for r in range(grid.world_size)]


def _slowest_first_coords(order: str, sizes: dict) -> list[dict]:
    dims = tuple(order.split("-"))
    grid = RankGrid(tuple(reversed(dims)), tuple(sizes[d] for d in reversed(dims)))
    return [grid.coords(r) for r in range(grid.world_size)]


def _dict_order_coords(order: str, sizes: dict) -> list[dict]:
    dims = tuple(sizes)  # the order the sizes dictionary happens to list them in
    grid = RankGrid(dims, tuple(sizes[d] for d in dims))
    return [grid.coords(r) for r in range(grid.world_size)]


def _no_modulo_coords(order: str, sizes: dict) -> list[dict]:
    dims = order.split("-")
    out = []
    for rank in range(math.prod(sizes.values())):
        stride, coords = 1, {}
        for d in dims:
            coords[d] = rank // stride
            stride *= sizes[d]
        out.append(coords)
    return out


def _sizes_for_student(order: str, sizes: dict) -> dict:
    """The sizes dict with its keys sorted by name, so key order differs from ``order``."""
    return {d: sizes[d] for d in sorted(sizes)}


def _same_coords(got, want: list[dict]) -> bool:
    try:
        return len(got) == len(want) and all(
            isinstance(g, dict) and {k: int(v) for k, v in g.items()} == w for g, w in zip(got, want))
    except Exception:  # noqa: BLE001 - whatever the student returned, it is not a match
        return False


def _first_difference(got: list, want: list[dict]) -> str:
    """What is wrong with the first wrong rank's answer, without the right coordinates."""
    for rank, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, dict):
            return f"rank {rank}: got {g!r}, not a dict"
        try:
            mine = {k: int(v) for k, v in g.items()}
        except Exception:  # noqa: BLE001 - a value that is not a whole number
            return f"rank {rank}: got {g!r}, whose values are not all whole numbers"
        if mine == w:
            continue
        if set(mine) != set(w):
            missing, extra = sorted(set(w) - set(mine)), sorted(set(mine) - set(w))
            parts = ([f"no coordinate for {missing}"] if missing else []) + (
                [f"keys {extra} that the order string does not name"] if extra else [])
            return f"rank {rank}: got {g!r}: {' and '.join(parts)}"
        wrong = [d for d in w if mine[d] != w[d]]
        return f"rank {rank}: got {g!r}: the {', '.join(wrong)} coordinate{'s are' if len(wrong) > 1 else ' is'} wrong"
    return f"returned {len(got)} answers for {len(want)} ranks"


def check_rank_to_coords(fn: Callable) -> CheckResult:
    """Check ``fn(rank, order, sizes) -> {dim: coordinate}`` against :class:`RankGrid`.

    ``order`` is a string such as ``"tp-cp-dp-pp"`` (fastest first); ``sizes`` maps
    each dimension to its size.  Every rank of several shapes is tried.
    """
    check = Checking("Exercise 1.1: rank_to_coords", COORDS_MISTAKES)
    mistakes = (("slowest_first", _slowest_first_coords), ("dict_order", _dict_order_coords),
                ("no_modulo", _no_modulo_coords))
    for order, sizes in RANK_TO_COORDS_SHAPES:
        want = _reference_coords(order, sizes)
        given = _sizes_for_student(order, sizes)
        name = f"order {order!r}, sizes {given}"

        def attempt(order=order, given=given, n=len(want)):
            return [fn(rank, order, dict(given)) for rank in range(n)]

        case, got = check.run(name, attempt, want, compare=_same_coords)
        if check.stub:  # one case says it all
            break
        if not case.passed and isinstance(got, list):
            case.detail = _first_difference(got, want)
            matches = {label for label, model in mistakes if _same_coords(got, model(order, given))}
            if got and not all(isinstance(g, dict) for g in got):
                matches.add("not_a_dict")
            check.shows(matches)
        elif not case.passed:
            check.shows()
    return check.verdict()


# --- exercise 2: Megatron's dense data-parallel group ---------------------------------

#: (world_size, tp, pp, cp): small and odd shapes, CP > 1 in several, DP = 1 once.
DATA_PARALLEL_SHAPES = [
    (8, 2, 2, 1),
    (8, 1, 1, 1),
    (16, 2, 2, 2),
    (16, 4, 2, 1),
    (12, 2, 3, 1),
    (24, 2, 2, 3),
    (32, 2, 2, 2),
    (8, 8, 1, 1),
]


def _same_groups(got, want: list[list[int]]) -> bool:
    if not isinstance(got, list) or len(got) != len(want):
        return False
    return all(as_rank_list(g) == w for g, w in zip(got, want))


def _stride_tp_groups(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    """The 'forgot CP in the stride' answer: DP ranks, TP apart, inside the stage."""
    dp = world // (tp * cp * pp)
    stage = world // pp
    out = []
    for rank in range(world):
        base = rank % tp + stage * (rank // stage)
        out.append(sorted(base + tp * j for j in range(dp)))
    return out


def _cp_everywhere_groups(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    """The 'forgot CP everywhere' answer: the right DP size, but coordinates read as if the
    grid were tp-dp-pp (members TP apart, stages TP*DP long)."""
    dp = world // (tp * cp * pp)
    return [sorted(rank % tp + tp * (j + dp * (rank // (tp * dp))) for j in range(dp))
            for rank in range(world)]


def _same_tp_rank_groups(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    """The 'every rank with the same rank % tp' answer."""
    return [[r for r in range(world) if r % tp == rank % tp] for rank in range(world)]


def _group_difference(rank: int, got, want: list[int], grid) -> str:
    """What is wrong with ``rank``'s group ``got``, without naming the right members."""
    members = as_rank_list(got)
    if members is None:
        return f"rank {rank}: got {got!r}, not a list of ranks"
    if len(set(members)) != len(members):
        return f"rank {rank}: got {got!r}, which lists a rank twice"
    outside = [m for m in members if not 0 <= m < grid.world_size]
    if outside:
        return f"rank {rank}: got {got!r}: rank {outside[0]} is not in a world of {grid.world_size}"
    if rank not in members:
        return f"rank {rank}: got {got!r}, which leaves out rank {rank} itself"
    mine = grid.coords(rank)
    for m in members:
        if m not in want:
            theirs = grid.coords(m)
            differ = [d for d in ("tp", "cp", "pp") if theirs[d] != mine[d]]
            return (f"rank {rank}: got {got!r}: rank {m} is in it, but its "
                    f"{' and '.join(differ)} coordinate{'s differ' if len(differ) > 1 else ' differs'}"
                    f" from rank {rank}'s")
    return (f"rank {rank}: got {got!r}: some ranks with rank {rank}'s tp, cp and pp "
            "coordinates are missing")


def _dp_outside_pp_groups(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    grid = build_grid(world, tp=tp, pp=pp, cp=cp, order="tp-cp-ep-pp-dp")
    return [sorted(grid.group_of("dp", r)) for r in range(world)]


def check_data_parallel_group(fn: Callable) -> CheckResult:
    """Check ``fn(rank, world_size, tp, pp, cp=1) -> [ranks]`` against Megatron's dense grid.

    Any order of the returned ranks is accepted: a group is a set.
    """
    check = Checking("Exercise 1.2: data_parallel_group", DATA_PARALLEL_MISTAKES)
    for world, tp, pp, cp in DATA_PARALLEL_SHAPES:
        grid = build_grid(world, tp=tp, pp=pp, cp=cp, layout="megatron")
        want = [sorted(grid.group_of("dp", r)) for r in range(world)]
        name = f"world_size={world}, tp={tp}, pp={pp}, cp={cp}"

        def attempt(world=world, tp=tp, pp=pp, cp=cp):
            return [fn(rank, world, tp, pp, cp) for rank in range(world)]

        case, got = check.run(name, attempt, want, compare=_same_groups)
        if check.stub:  # one case says it all
            break
        if not case.passed and isinstance(got, list):
            for rank, (g, w) in enumerate(zip(got, want)):
                if as_rank_list(g) != w:
                    case.detail = _group_difference(rank, g, w, grid)
                    break
            else:
                case.detail = f"returned {len(got)} groups for {world} ranks"
            models = {
                "tp": [sorted(grid.group_of("tp", r)) for r in range(world)],
                "pp": [sorted(grid.group_of("pp", r)) for r in range(world)],
                "dp_cp": [sorted(grid.group_of("dp_cp", r)) for r in range(world)],
                "stride_tp": _stride_tp_groups(world, tp, pp, cp),
                "cp_everywhere": _cp_everywhere_groups(world, tp, pp, cp),
                "dp_outside_pp": _dp_outside_pp_groups(world, tp, pp, cp),
                "same_tp_rank": _same_tp_rank_groups(world, tp, pp, cp),
                "world": [list(range(world))] * world,
            }
            matches = {label for label, model in models.items() if _same_groups(got, model)}
            if any(as_rank_list(g) is None for g in got):
                matches.add("not_a_list")
            check.shows(matches)
        elif not case.passed:
            check.shows()
    return check.verdict()


__all__ = ["check_rank_to_coords", "check_data_parallel_group"]


# --- exercise 3: which groups cross the node boundary? --------------------------------

#: The group kinds exercise 1.3 asks about.
NODE_KINDS = ("tp", "dp", "pp", "ep", "expert_tp", "expert_dp")
NODE_WORLD, NODE_GPUS = 16, 8
"""16 ranks on two nodes of 8 GPUs: rank r on GPU r % 8 of node r // 8."""

#: Exercise 1.3's layouts: name -> (what the student reads, build_grid's arguments).
NODE_SCENARIOS = {
    "A": ("Megatron-Core's layout, TP = 2, PP = 4 (DP = 2, no experts)",
          dict(tp=2, pp=4, layout="megatron")),
    "B": ("Megatron-Core's layout, TP = 4, EP = 4, ETP left at its default (DP = 4)",
          dict(tp=4, ep=4, layout="megatron")),
    "C": ("Megatron-Core's layout, TP = 2, EP = 8, ETP = 1 (DP = 8)",
          dict(tp=2, ep=8, etp=1, layout="megatron")),
    "D": ("Megatron-Core's layout, PP = 2, EP = 4 (TP = 1, DP = 8)",
          dict(pp=2, ep=4, layout="megatron")),
}

HINT_NODES_FORMAT = (
    "return a dict from each scenario name in NODE_SCENARIOS ('A', 'B', ...) to the set of "
    "group kinds, among 'tp', 'dp', 'pp', 'ep', 'expert_tp', 'expert_dp', that have a group "
    "spanning both nodes (an empty set when none has)."
)
HINT_NODES_BY_SIZE = (
    "a group does not need more members than a node has GPUs to cross the boundary: two "
    "ranks 8 apart already sit on different nodes. What decides it is how far apart the "
    "members are (the stride of the dimension in the order string) times the group's size, "
    "and where a group starts."
)
HINT_NODES_STRIDE = (
    "for each kind, write down the stride of its dimension in the order string (the product "
    "of the sizes of the dimensions before it) and its size: a group spans (size - 1) * "
    "stride + 1 consecutive ranks from its first member. It crosses when that span cannot "
    "fit between two multiples of 8."
)
HINT_NODES_EXPERT = (
    "the expert kinds come from the expert grid, etp-ep-edp-pp, folded onto the same ranks "
    "as the dense one: EP's stride there is ETP, not TP, and EDP = world / (ETP * EP * PP). "
    "Under Megatron-Core's layout ETP defaults to TP when it is not given."
)
HINT_NODES_DENSE = (
    "the dense kinds come from the order tp-cp-dp-pp: DP's stride is TP * CP, and PP's is "
    "TP * CP * DP, where DP = world / (TP * CP * PP) counts the EP ranks too."
)

DENSE_KINDS = frozenset({"tp", "dp", "pp"})


def node_crossings_of(sizes: dict, world: int = NODE_WORLD, gpus: int = NODE_GPUS) -> frozenset:
    """The kinds of :data:`NODE_KINDS` with a group that holds ranks of two nodes."""
    grid = build_grid(world, **sizes)
    return frozenset(kind for kind in NODE_KINDS
                     if any(len({r // gpus for r in group}) > 1 for group in grid.groups(kind)))


def _by_size(sizes: dict) -> frozenset:
    """The classic wrong rule: a kind crosses only when its groups outgrow a node."""
    grid = build_grid(NODE_WORLD, **sizes)
    return frozenset(k for k in NODE_KINDS if len(grid.groups(k)[0]) > NODE_GPUS)


#: The mistakes of exercise 1.3, in order of preference.
NODE_MISTAKES = Mistakes(HINT_NODES_STRIDE, any_case={"format"}, format=HINT_NODES_FORMAT,
                         by_size=HINT_NODES_BY_SIZE, expert=HINT_NODES_EXPERT,
                         dense=HINT_NODES_DENSE)


def _crossing_mistakes(kinds: frozenset, sizes: dict) -> set[str]:
    """What a wrong set of kinds shows: the size rule, or right on one grid only."""
    want = node_crossings_of(sizes)
    if kinds == _by_size(sizes):
        return {"by_size"}
    if kinds & DENSE_KINDS == want & DENSE_KINDS:
        return {"expert"}  # the dense grid is right: the expert grid is not
    if kinds - DENSE_KINDS == want - DENSE_KINDS:
        return {"dense"}
    return set()


def check_node_crossings(fn: Callable) -> CheckResult:
    """Check ``fn() -> {scenario: kinds}``: for each layout of :data:`NODE_SCENARIOS` on 16
    ranks in two 8-GPU nodes, the group kinds with a group on both nodes, against the
    groups :func:`~tutorial_lib.grid.build_grid` builds.  A wrong set is shown as the
    student gave it, never the right one."""
    check = Checking("Exercise 1.3: node_crossings", NODE_MISTAKES)
    opened = check.prediction(fn)
    if opened is None:
        return check.verdict()
    got, _ = opened
    for name, (_, sizes) in NODE_SCENARIOS.items():
        given = got.get(name)
        kinds = as_group_kinds(given) if name in got else None
        if kinds is None or not kinds <= set(NODE_KINDS):
            check.add(Case(name, False, "missing from the dict" if name not in got else
                           f"got {given!r}, not a set of group kinds"))
            check.shows({"format"})
        elif kinds == node_crossings_of(sizes):
            check.add(Case(name, True))
        else:
            check.add(Case(name, False, f"got {sorted(kinds)}: not the kinds whose groups "
                                        "span both nodes"))
            check.shows(_crossing_mistakes(kinds, sizes))
    return check.verdict()


__all__ += ["check_node_crossings", "node_crossings_of", "NODE_SCENARIOS", "NODE_KINDS"]
