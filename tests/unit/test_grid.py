"""Grid math against hand-written loops, for many shapes and every layout."""
import itertools
import json
import math

import pytest

from tutorial_lib.config import ConfigError, ParallelConfig
from tutorial_lib.grid import (EXTRA_GROUP_KINDS, GROUP_KINDS, MEGATRON_ORDER, RankGrid, build_grid,
                               format_groups, main, parse_order)

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
    with pytest.raises(ConfigError, match="names tp 2 times; name each of tp, cp, ep, dp, pp once"):
        parse_order("tp-tp-ep-dp-pp")
    with pytest.raises(ConfigError, match="names 'xp', which is not a dimension"):
        parse_order("tp-xp-dp-pp")
    with pytest.raises(ConfigError, match="leaves out ep; name each of"):
        parse_order("tp-cp-dp-pp")  # no sizes: every dimension must be named
    with pytest.raises(ConfigError, match="the 'course' layout has its own order"):
        build_grid(8, tp=2, layout="course", order="tp-cp-ep-dp-pp")


def test_cli_json_and_errors(capsys):
    assert main(["--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert set(groups) == set(GROUP_KINDS)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and groups["pp"][0] == [0, 4]
    assert main(["--world-size", "6", "--tp", "4"]) == 2
    assert "[rule 1] world_size (6)" in capsys.readouterr().err


# --- Megatron-Core's groups, re-derived, against the megatron layout -------------------------
#
# Upstream: NVIDIA/Megatron-LM, megatron/core/parallel_state.py at d98e8a64 (Megatron-Core
# 0.20.0): `initialize_model_parallel` builds a decoder `RankGenerator` (tp=TP, cp=CP, ep=1,
# dp=DP, pp=PP) and an expert one (tp=ETP, cp=1, ep=EP, dp=EDP, pp=PP) from the same `order`
# (default "tp-cp-ep-dp-pp"), with ETP = TP when not given; `RankGenerator` appends a name
# left out of the order if its size is 1 and raises naming it otherwise; its `get_ranks` are
# `generate_masked_orthogonal_rank_groups`. The helpers below restate those rules from that
# reading, without tutorial_lib.

ALL_NAMES = ("tp", "cp", "ep", "dp", "pp")

#: Every order an order string can be: each arrangement of each non-empty subset of names.
ALL_ORDERS = sorted({"-".join(p[:k]) for p in itertools.permutations(ALL_NAMES) for k in range(1, 6)})


class MegatronRefuses(Exception):
    """What initialize_model_parallel would refuse (raise or assert on)."""


def mixed_radix(number, radices):
    """``number`` as digits in ``radices``, the lowest digit first."""
    digits = []
    for radix in radices:
        digits.append(number % radix)
        number //= radix
    return digits


def rank_generator(order, sizes):
    """A RankGenerator: the order's names, then the left-out ones of size 1; and their sizes."""
    names = order.split("-")
    for name in ("tp", "pp", "dp", "ep", "cp"):  # the order RankGenerator appends in
        if name not in names:
            if sizes[name] != 1:
                raise MegatronRefuses(f"{name} (size {sizes[name]}) is not in {order!r}")
            names.append(name)
    return names, [sizes[n] for n in names]


def get_ranks(generator, token):
    """The groups of ranks that differ only in the names of ``token``, in Megatron's order.

    A rank is the sum of coordinate x stride, a name's stride the product of the sizes
    before it.  Group ``g`` takes the other names' coordinates from ``g`` read in their
    radices (earliest name lowest); its ``m``-th member takes the token names' likewise.
    """
    names, sizes = generator
    strides = [math.prod(sizes[:i]) for i in range(len(names))]
    inside = [i for i, name in enumerate(names) if name in token.split("-")]
    outside = [i for i in range(len(names)) if i not in inside]

    def offset(number, axes):
        digits = mixed_radix(number, [sizes[i] for i in axes])
        return sum(d * strides[i] for d, i in zip(digits, axes))

    return [[offset(g, outside) + offset(m, inside) for m in range(math.prod(sizes[i] for i in inside))]
            for g in range(math.prod(sizes[i] for i in outside))]


def megatron_groups(world, tp, pp, ep, cp, etp, order):
    """Each group kind of the course, as initialize_model_parallel would build it from ``order``."""
    etp = tp if etp is None else etp
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    dense = rank_generator(order, {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp})
    expert = rank_generator(order, {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp})
    if not order.endswith("pp") and pp > 1 and dp != edp:
        raise MegatronRefuses("pp is not last and DP != EDP")
    if get_ranks(dense, "pp") != get_ranks(expert, "pp"):
        raise MegatronRefuses("the dense and expert pipeline groups differ")
    groups = {kind: get_ranks(dense, token) for kind, token in
              (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp"), ("dp_cp", "dp-cp"), ("mp", "tp-pp"))}
    groups.update({kind: get_ranks(expert, token) for kind, token in
                   (("ep", "ep"), ("expert_tp", "tp"), ("expert_dp", "dp"))})
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pp"]]
    return groups


ALL_KINDS = GROUP_KINDS + EXTRA_GROUP_KINDS

#: (world, tp, pp, ep, cp, etp): CP and EP together, ETP below, equal to (None) and above
#: TP, DP = EDP (orders without pp last can be taken) and DP != EDP, sizes of 3, PP = 1.
MEGATRON_SHAPES = [
    (16, 2, 2, 2, 2, None), (16, 2, 2, 4, 1, 1), (24, 2, 3, 2, 1, None), (12, 1, 3, 2, 2, 1),
    (8, 2, 1, 2, 2, 4), (8, 4, 1, 2, 1, 1), (18, 3, 2, 3, 1, 1), (4, 1, 4, 1, 1, None),
    (1, 1, 1, 1, 1, None),
]


def test_megatron_layout_gives_megatrons_groups_for_every_order_it_takes():
    """Megatron's folded grids: ``layout="megatron", order=...`` is Megatron-Core's folding.

    For every order string (each arrangement of each subset of tp, cp, ep, dp, pp) and
    the shapes above, the layout refuses exactly what the re-derivation of
    ``initialize_model_parallel`` / ``RankGenerator`` /
    ``generate_masked_orthogonal_rank_groups`` (Megatron-Core 0.20.0, d98e8a64) refuses,
    and otherwise gives its groups, list for list.  One caveat, of 0.20.0 only: it injects
    a ``gtp_remat`` name whose text contains "tp", so `RankGenerator`'s substring test never
    appends a left-out ``tp`` and an order without tp fails later; the rule followed here,
    and by the library, is RankGenerator's (a left-out tp of size 1 is appended).
    """
    seen = {"taken": 0, "taken without pp last": 0, "taken with a name left out": 0, "refused": 0}
    for world, tp, pp, ep, cp, etp in MEGATRON_SHAPES:
        for order in ALL_ORDERS:
            where = (world, tp, pp, ep, cp, etp, order)
            try:
                want = megatron_groups(world, tp, pp, ep, cp, etp, order)
            except MegatronRefuses:
                with pytest.raises(ConfigError):
                    build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, layout="megatron", order=order)
                seen["refused"] += 1
                continue
            grid = build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, layout="megatron", order=order)
            assert grid.all_groups(ALL_KINDS) == want, where
            seen["taken"] += 1
            seen["taken without pp last"] += not order.endswith("pp")
            seen["taken with a name left out"] += order.count("-") < 4
    assert min(seen.values()) > 100, seen  # every branch of the rules was exercised


def test_megatron_layout_defaults_etp_to_tp():
    """Megatron's folded grids: without an ETP the megatron layout uses ETP = TP, as Megatron-Core does.

    ``initialize_model_parallel`` (megatron/core/parallel_state.py, Megatron-Core 0.20.0,
    d98e8a64) sets ``expert_tensor_parallel_size = tensor_model_parallel_size`` when it is
    None (``ModelParallelConfig.__post_init__`` does the same).  Every valid shape with
    TP > 1 up to 32 ranks; the single-grid layouts keep ETP = 1.
    """
    checked = 0
    for world, tp, pp, ep, cp in itertools.product((4, 8, 12, 16, 24, 32), (2, 4), (1, 2, 3), (1, 2, 4), (1, 2)):
        if world % (tp * cp * pp) or world % (tp * ep * pp):
            continue
        want = megatron_groups(world, tp, pp, ep, cp, None, "tp-cp-ep-dp-pp")
        assert build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp).all_groups(ALL_KINDS) == want, (world, tp, pp, ep, cp)
        checked += 1
    assert checked > 50
    course = build_grid(16, tp=2, pp=2, ep=2, layout="course")
    assert course.config.expert_tensor_parallel_size == 1
    assert course.groups("expert_tp") == [[r] for r in range(16)]


def test_cli_megatron_etp_default_and_order(capsys):
    """Defects 7, 8 and 11 at the command line: the megatron layout takes ``--order``; ``--etp``
    defaults to TP there; a bare ``--order`` is one grid, and the help says so; a left-out
    dimension of size 1 is taken, a larger one refused with exit 2 and its name
    (Megatron-Core 0.20.0, d98e8a64, parallel_state.py: ``initialize_model_parallel``,
    ``RankGenerator``)."""
    shape = ["--world-size", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--cp", "2"]
    assert main(shape + ["--json", "--all-kinds"]) == 0  # no --etp: ETP = TP
    assert json.loads(capsys.readouterr().out) == megatron_groups(16, 2, 2, 2, 2, None, "tp-cp-ep-dp-pp")
    order = "tp-pp-cp-ep-dp"  # pp not last: taken here, since DP = EDP = 2
    assert main(shape + ["--layout", "megatron", "--order", order, "--json", "--all-kinds"]) == 0
    assert json.loads(capsys.readouterr().out) == megatron_groups(16, 2, 2, 2, 2, None, order)
    # a bare --order builds one grid with EP a dimension of its own: not Megatron's EP groups
    assert main(shape + ["--order", "tp-cp-ep-dp-pp", "--json"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["ep"] != megatron_groups(16, 2, 2, 2, 2, None, "tp-cp-ep-dp-pp")["ep"]
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "A bare --order (no --layout) builds ONE grid in that order with EP a dimension of its own" in help_text
    assert "differ from Megatron-Core's exactly when EP > 1 and CP > 1 or ETP != TP" in help_text
    for world, tp, pp, ep, cp, etp in itertools.product((8, 16), (1, 2), (1, 2), (1, 2, 4), (1, 2), (1, 2)):
        try:
            one = build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, order=MEGATRON_ORDER)
        except ConfigError:
            continue
        same = one.all_groups(ALL_KINDS) == megatron_groups(world, tp, pp, ep, cp, etp, MEGATRON_ORDER)
        assert same == (ep == 1 or (cp == 1 and etp == tp)), (world, tp, pp, ep, cp, etp)  # as the help says
    assert "(default: TP in the megatron layout" in help_text
    # size-1 dimensions may be left out, in both kinds of grid
    for extra in (["--order", "tp-pp-dp"], ["--layout", "megatron", "--order", "tp-dp-pp"]):
        assert main(["--world-size", "8", "--tp", "2", "--pp", "2", *extra, "--json"]) == 0, extra
        groups = json.loads(capsys.readouterr().out)
        full = extra[-1].replace("tp-", "tp-cp-ep-")
        assert main(["--world-size", "8", "--tp", "2", "--pp", "2", *extra[:-1], full, "--json"]) == 0
        assert groups == json.loads(capsys.readouterr().out), extra
    # a left-out dimension of size > 1 is refused, by name
    for extra in (["--order", "tp-dp-pp"], ["--layout", "megatron", "--order", "tp-dp-pp"]):
        assert main(["--world-size", "8", "--cp", "2", *extra]) == 2
        assert "leaves out cp, whose size" in capsys.readouterr().err
    assert main(["--world-size", "8", "--tp", "2", "--ep", "2", "--layout", "megatron", "--order", "cp-ep-dp-pp"]) == 2
    assert "leaves out tp, whose size in the dense grid is 2" in capsys.readouterr().err


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-pp-dp", "tp-dp-pp", "pp-dp-tp"])
def test_an_order_may_leave_out_dimensions_of_size_1(order):
    """Defect 11: as Megatron-Core's ``RankGenerator`` (parallel_state.py, 0.20.0, d98e8a64),
    an order may leave out a dimension of size 1 (appended: it moves no rank) and not a
    larger one, which is named.  In one grid and in the megatron layout alike."""
    full = {"tp-cp-dp-pp": "tp-cp-ep-dp-pp", "tp-pp-dp": "tp-cp-ep-pp-dp",
            "tp-dp-pp": "tp-cp-ep-dp-pp", "pp-dp-tp": "pp-dp-tp-cp-ep"}[order]
    for layout in (None, "megatron"):
        short = build_grid(8, tp=2, pp=2, layout=layout, order=order)
        assert short.all_groups(ALL_KINDS) == build_grid(8, tp=2, pp=2, layout=layout, order=full).all_groups(ALL_KINDS)
        if "cp" not in order:
            with pytest.raises(ConfigError, match=r"\[order\] order .* leaves out cp, whose size.* is 2"):
                build_grid(16, tp=2, pp=2, cp=2, layout=layout, order=order)
    with pytest.raises(ConfigError, match=r"leaves out ep, whose size is 2"):
        build_grid(16, tp=2, pp=2, ep=2, order=order)  # in one grid EP is a dimension
    with pytest.raises(ConfigError, match=r"leaves out ep, whose size in the expert grid .* is 2"):
        build_grid(16, tp=2, pp=2, ep=2, layout="megatron", order=order)


# --- huge worlds answer at once, with a summary ----------------------------------


def test_groups_computed_one_member_at_a_time_equal_the_listed_groups():
    """``group_count`` / ``group_size`` / ``group_member`` (what the summary uses, without
    listing a world's groups) give exactly ``groups(kind)``, for every kind, in every
    layout, for the megatron shapes in several orders and the single-grid shapes."""
    grids = [build_grid(world, tp=tp, pp=pp, ep=ep, cp=cp, etp=etp, layout="megatron", order=order)
             for world, tp, pp, ep, cp, etp in MEGATRON_SHAPES
             for order in ("tp-cp-ep-dp-pp", "tp-ep-cp-dp-pp", "tp-cp-ep-pp-dp")
             if _megatron_takes(world, tp, pp, ep, cp, etp, order)]
    grids += [build_grid(*shape, layout=layout) for shape in SHAPES for layout in ("course", "visualizer")]
    grids += [build_grid(*shape, order="pp-dp-cp-ep-tp") for shape in SHAPES]
    for grid in grids:
        for kind in ALL_KINDS:
            lazy = [[grid.group_member(kind, g, i) for i in range(grid.group_size(kind))]
                    for g in range(grid.group_count(kind))]
            assert lazy == grid.groups(kind), (grid.describe(), kind)
    assert len(grids) > 40


def _megatron_takes(*shape) -> bool:
    try:
        megatron_groups(*shape)
    except MegatronRefuses:
        return False
    return True


def test_cli_summarizes_a_world_of_a_million_ranks(capsys):
    """Hardening: ``--world-size 2**20`` took about a minute and printed 62 MB.  Above 256
    ranks the command prints a summary (each kind's count x size, its first groups, a
    group's first ranks and its last), computed without listing the groups; ``--all``
    prints everything, as before, and small worlds are printed whole as before."""
    assert main(["--world-size", str(2**20), "--tp", "8", "--pp", "4", "--ep", "2", "--all-kinds"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 5000, len(out)
    lines = out.splitlines()
    assert lines[1].startswith("  tp         131072 x 8: [0, 1, 2, 3, 4, 5, 6, 7] [8, 9,")
    assert lines[1].endswith("... (131,068 more)")
    pp = next(line for line in lines if line.startswith("  pp "))
    assert "262144 x 4: [0, 262144, 524288, 786432] [1, 262145, 524289, 786433]" in pp
    dp = next(line for line in lines if line.startswith("  dp "))
    assert "32 x 32768: [0, 8, 16, 24, 32, 40, 48, ..., 262136]" in dp  # first ranks ... last
    assert "--all prints every group" in lines[-1]
    # 256 ranks and fewer: every group, as before
    assert main(["--world-size", "16", "--tp", "2", "--pp", "2"]) == 0
    small = capsys.readouterr().out
    assert small.strip() == format_groups(build_grid(16, tp=2, pp=2))
    assert "summary" not in small
    # --all above 256 ranks lists every group; --json needs --all there
    assert main(["--world-size", "512", "--tp", "2", "--all"]) == 0
    assert capsys.readouterr().out.strip() == format_groups(build_grid(512, tp=2))
    assert main(["--world-size", "512", "--tp", "2", "--json"]) == 2
    assert "--json lists every group, 3,584 numbers" in capsys.readouterr().err
    assert main(["--world-size", "512", "--tp", "2", "--json", "--all"]) == 0
    assert json.loads(capsys.readouterr().out)["tp"][255] == [510, 511]


@pytest.mark.parametrize("world,sizes,smaller", [
    (2**24 + 8, ["--tp", "2", "--pp", "4"], "--world-size 32 --tp 2 --pp 4"),
    (10**12 + 1, [], "--world-size 4"),
    (10**18, ["--tp", "2", "--pp", "4"], "--world-size 32 --tp 2 --pp 4"),
    (10**30, ["--tp", "2", "--pp", "4"], "--world-size 32 --tp 2 --pp 4"),
])
def test_cli_refuses_absurd_worlds_with_a_smaller_one_that_shows_the_same(world, sizes, smaller, capsys):
    """Hardening: 10**12 + 1 never answered (a divisor scan), 10**18 and 10**30 ended in
    MemoryError / OverflowError tracebacks.  Above 2**24 ranks the command refuses, with
    exit 2, and names a world with the same sizes (the groups repeat every TP x CP x EP x
    PP ranks, in the megatron layout every lcm of its two grids)."""
    assert main(["--world-size", str(world), *sizes]) == 2
    err = capsys.readouterr().err
    assert f"world_size ({world:,}) is more ranks than this command describes" in err
    assert f"{smaller} shows the same pattern" in err
    assert "Traceback" not in err


def test_cli_lists_every_group_only_up_to_a_million_ranks(capsys):
    for flags, named in ((["--all"], "--all"), (["--json", "--all"], "--json")):
        assert main(["--world-size", str(2**21), "--tp", "2", *flags]) == 2
        err = capsys.readouterr().err
        assert f"error: {named} lists every group, 14,680,064 numbers for world_size 2,097,152" in err
    assert main(["--world-size", str(2**21), "--tp", "2"]) == 0  # the summary answers
    assert "1048576 x 2" in capsys.readouterr().out


def test_an_empty_order_is_refused_not_replaced(capsys):
    """Hardening: ``--order ""`` printed Megatron-Core's default order (with ``--layout
    megatron``), which the user never typed, or a KeyError traceback (without).  An order
    given is the order used, as ``initialize_model_parallel`` (Megatron-Core 0.20.0,
    d98e8a64) uses its ``order`` argument as given; an empty one names no dimension."""
    for layout in (None, "megatron"):
        with pytest.raises(ConfigError, match="order '' is empty"):
            build_grid(8, tp=2, layout=layout, order="")
        assert main(["--world-size", "8", "--order", ""] + (["--layout", layout] if layout else [])) == 2
        assert "order '' is empty" in capsys.readouterr().err


def test_megatron_order_rules_name_the_sizes_and_the_fix():
    """TP and EP together: the folded grids' own rules with their messages.  Megatron-Core 0.20.0
    (d98e8a64, megatron/core/parallel_state.py, ``initialize_model_parallel``) asserts that an
    order not ending in ``pp`` with PP > 1 keeps the dense and expert data-parallel sizes
    equal, and that the dense and expert ``RankGenerator``s give the same pipeline groups."""
    # DP = 8 / (2 * 2) = 2, EDP = 8 / (1 * 4 * 2) = 1: pp not last is refused
    config = ParallelConfig(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    with pytest.raises(ConfigError) as info:
        build_grid(8, tp=2, pp=2, ep=4, etp=1, layout="megatron", order="tp-cp-ep-pp-dp")
    assert info.value.rule == "order"
    for fragment in ("does not end in pp", "DP = 2 and EDP = 1", "put pp last",
                     "make TP * CP equal ETP * EP"):
        assert fragment in str(info.value), (fragment, str(info.value))
    assert config.data_parallel_size == 2 and config.expert_data_parallel_size == 1
    # the same sizes with pp last: both grids agree on the pipelines
    grid = build_grid(8, tp=2, pp=2, ep=4, etp=1, layout="megatron")
    assert grid.group_of("pp", 0) == [0, 4]
