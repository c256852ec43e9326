"""Grid math against hand-written loops, for many shapes and every layout."""
import itertools
import json

import pytest

from tutorial_lib.config import ConfigError
from tutorial_lib.grid import GROUP_KINDS, RankGrid, build_grid, main, parse_order

SHAPES = [  # (world, tp, pp, ep, cp)
    (1, 1, 1, 1, 1), (2, 2, 1, 1, 1), (4, 1, 4, 1, 1), (8, 2, 2, 2, 1), (8, 1, 2, 4, 1),
    (16, 2, 2, 2, 2), (16, 4, 2, 1, 1), (24, 2, 3, 2, 1), (32, 2, 2, 4, 2), (12, 1, 3, 2, 2),
]


def loop_ranks_visualizer(world, tp, pp, ep, cp):
    """The visualizer's formula, written as the nested loop it describes."""
    dp = world // (tp * pp * ep * cp)
    table = {}
    for pp_i, dp_i, cp_i, ep_i, tp_i in itertools.product(range(pp), range(dp), range(cp),
                                                          range(ep), range(tp)):
        table[(tp_i, ep_i, cp_i, dp_i, pp_i)] = tp_i + tp * (ep_i + ep * (cp_i + cp * (dp_i + dp * pp_i)))
    return table


def loop_ranks_course(world, tp, pp, ep):
    """The 4D guide's formula rank = (((dp * PP + pp) * TP + tp) * EP + ep)."""
    dp = world // (tp * pp * ep)
    return {(dp_i, pp_i, tp_i, ep_i): ((dp_i * pp + pp_i) * tp + tp_i) * ep + ep_i
            for dp_i, pp_i, tp_i, ep_i in itertools.product(range(dp), range(pp), range(tp), range(ep))}


def groups_by_loop(world, coords_of, varying):
    """Group ranks whose coordinates agree outside ``varying``: the definition itself."""
    buckets = {}
    for rank in range(world):
        c = coords_of(rank)
        key = tuple(sorted((k, v) for k, v in c.items() if k not in varying))
        buckets.setdefault(key, []).append(rank)
    return sorted((sorted(g) for g in buckets.values()), key=min)


def normalise(groups):
    return sorted((sorted(g) for g in groups), key=min)


@pytest.mark.parametrize("world,tp,pp,ep,cp", SHAPES)
def test_visualizer_layout_matches_its_formula(world, tp, pp, ep, cp):
    grid = build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, layout="visualizer")
    for (tp_i, ep_i, cp_i, dp_i, pp_i), rank in loop_ranks_visualizer(world, tp, pp, ep, cp).items():
        assert grid.coords(rank) == {"tp": tp_i, "ep": ep_i, "cp": cp_i, "dp": dp_i, "pp": pp_i}
        assert grid.dense.rank(tp=tp_i, ep=ep_i, cp=cp_i, dp=dp_i, pp=pp_i) == rank


@pytest.mark.parametrize("world,tp,pp,ep,cp", [s for s in SHAPES if s[4] == 1])
def test_course_layout_matches_its_formula(world, tp, pp, ep, cp):
    grid = build_grid(world, tp=tp, pp=pp, ep=ep, layout="course")
    for (dp_i, pp_i, tp_i, ep_i), rank in loop_ranks_course(world, tp, pp, ep).items():
        c = grid.coords(rank)
        assert (c["dp"], c["pp"], c["tp"], c["ep"]) == (dp_i, pp_i, tp_i, ep_i)


@pytest.mark.parametrize("layout", ["visualizer", "course"])
@pytest.mark.parametrize("world,tp,pp,ep,cp", SHAPES)
def test_single_grid_groups_match_the_definition(layout, world, tp, pp, ep, cp):
    if layout == "course" and cp > 1:
        cp = 1
        world //= 2
    grid = build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, layout=layout)
    expected = {
        "tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "ep": ("ep",),
        "dp": ("dp", "ep"),  # dense replicas: every rank that sees other tokens
        "expert_dp": ("dp", "cp", "tp"),  # ETP = 1: experts are whole on each TP rank
        "dp_cp": ("dp", "ep", "cp"), "mp": ("tp", "pp"),
    }
    for kind, varying in expected.items():
        assert normalise(grid.groups(kind)) == groups_by_loop(world, grid.coords, varying), kind
    assert grid.groups("expert_tp") == [[r] for r in range(world)]


@pytest.mark.parametrize("world,tp,pp,ep,cp,etp", [
    (8, 2, 2, 2, 1, 1), (16, 2, 2, 4, 1, 1), (16, 4, 1, 2, 1, 2), (32, 2, 2, 4, 2, 2), (8, 1, 1, 8, 1, 1),
])
def test_megatron_folded_grids(world, tp, pp, ep, cp, etp):
    grid = build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, layout="megatron")
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    # Hand-written Megatron loops: dense rank = tp + TP*(cp + CP*(dp + DP*pp)).
    for rank in range(world):
        c = grid.coords(rank)
        assert rank == c["tp"] + tp * (c["cp"] + cp * (c["dp"] + dp * c["pp"]))
        assert rank == c["etp"] + etp * (c["ep"] + ep * (c["edp"] + edp * c["pp"]))
    dense = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
             "mp": ("tp", "pp")}
    expert = {"ep": ("ep",), "expert_tp": ("etp",), "expert_dp": ("edp",)}
    for kind, varying in dense.items():
        assert normalise(grid.groups(kind)) == groups_by_loop(world, grid.dense.coords, varying), kind
    for kind, varying in expert.items():
        assert normalise(grid.groups(kind)) == groups_by_loop(world, grid.expert.coords, varying), kind
    # The two grids share the pipeline: the same pp groups computed from either grid.
    assert normalise(grid.dense.groups("pp")) == normalise(grid.expert.groups("pp"))


def test_megatron_known_example():
    # Megatron-Core's docstring example: 16 ranks, TP=2, PP=4 -> DP=2.
    grid = build_grid(16, tp=2, pp=4)
    assert grid.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert grid.groups("pp")[0] == [0, 4, 8, 12]
    assert grid.groups("dp")[:2] == [[0, 2], [1, 3]]
    assert grid.groups("embedding")[0] == [0, 12]
    assert grid.groups("mp")[0] == [0, 1, 4, 5, 8, 9, 12, 13]


def test_every_rank_in_exactly_one_group_of_each_kind():
    grid = build_grid(32, tp=2, pp=2, ep=4, cp=2, etp=2)
    for kind in GROUP_KINDS:
        members = sorted(r for g in grid.groups(kind) for r in g)
        assert members == list(range(32)), kind


def test_rank_grid_round_trip_and_bounds():
    g = RankGrid(("a", "b", "c"), (2, 3, 4))
    assert [g.rank(**g.coords(r)) for r in range(24)] == list(range(24))
    with pytest.raises(ValueError, match="rank 24 is outside 0..23"):
        g.coords(24)
    with pytest.raises(ValueError, match="coordinate b=3 is outside 0..2"):
        g.rank(a=0, b=3, c=0)


def test_custom_order_and_bad_order():
    grid = build_grid(8, tp=2, pp=2, ep=2, order="pp-dp-ep-cp-tp")
    assert grid.layout == "custom" and grid.groups("pp")[0] == [0, 1]
    with pytest.raises(ConfigError, match="must name each of tp, cp, ep, dp, pp exactly once"):
        parse_order("tp-tp-ep-dp-pp")


def test_cli_json_and_errors(capsys):
    assert main(["--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert set(groups) == set(GROUP_KINDS)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and groups["pp"][0] == [0, 4]
    assert main(["--world-size", "6", "--tp", "4"]) == 2
    assert "[rule 1] world_size (6)" in capsys.readouterr().err
