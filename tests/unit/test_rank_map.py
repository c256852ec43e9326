"""The rank map widget: its embedded data is ProcessGrid's, and its page stays self-contained."""
from __future__ import annotations

import html
import json
import re
from itertools import product

import pytest

from tutorial_lib.config import LAYOUTS, ConfigError
from tutorial_lib.grid import EXTRA_GROUP_KINDS, GROUP_KINDS, build_grid
from tutorial_lib.viz import draw
from tutorial_lib.viz.rank_map import (
    ALL_KINDS, KIND_TRAFFIC, KNOBS, RankMap, crossing_flags, rank_formula, rank_map,
    traffic_line,
)
from tests.asserts import every

KINDS = GROUP_KINDS + EXTRA_GROUP_KINDS


def json_size(m: RankMap) -> int:
    return len(json.dumps(m.data, separators=(",", ":")))


@pytest.fixture(scope="module")
def world16():
    return rank_map(16, 8, tp=2, pp=2, ep=2)


# --- the data is Python's ----------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_initial_config_equals_process_grid(layout):
    m = rank_map(16, 8, tp=2, pp=2, ep=2, layout=layout, knobs=False)
    grid = build_grid(16, 2, 2, 2, 1, 1, layout)
    seen = m.lookup()
    assert seen["describe"] == grid.describe()
    for kind in KINDS:
        assert seen["groups"][kind] == grid.groups(kind), kind
    for rank in range(16):
        assert {d: seen["coords"][d][rank] for d in seen["coords"]} == grid.coords(rank)


def test_every_knob_setting_equals_process_grid(world16):
    """Sweep every combination the static page can reach: groups, coords, or Python's error."""
    values = {k["name"]: k["values"] for k in world16.data["knobs"]}
    assert values["layout"] == list(LAYOUTS)
    assert values["tp"] == [1, 2, 4, 8]
    valid = 0
    for combo in product(*(values[k] for k in KNOBS)):
        setting = dict(zip(KNOBS, combo))
        seen = world16.lookup(**setting)
        try:
            grid = build_grid(16, setting["tp"], setting["pp"], setting["ep"], setting["cp"],
                              setting["etp"], setting["layout"])
        except ConfigError as err:
            assert seen == {"error": str(err)}
            continue
        valid += 1
        assert seen["layout"] == setting["layout"]
        assert seen["describe"] == grid.describe()
        for kind in KINDS:
            assert seen["groups"][kind] == grid.groups(kind), (setting, kind)
            assert seen["crosses"][kind] == crossing_flags(grid.groups(kind), 8)
        assert seen["coords"]["pp"] == [grid.coords(r)["pp"] for r in range(16)]
    assert valid == len(world16.data["configs"])


def test_crossing_flags_hand_worked():
    # Ranks 0-7 sit on node 0, ranks 8-15 on node 1.
    assert crossing_flags([[0, 7], [7, 8], [3], [8, 15]], 8) == [False, True, False, False]
    seen = rank_map(16, 8, tp=2, pp=2, ep=2, layout="megatron").lookup()
    # PP stages are world / PP = 8 ranks apart: each stage pair straddles the two nodes.
    assert seen["groups"]["pp"] == [[r, r + 8] for r in range(8)]
    assert seen["crosses"]["pp"] == [True] * 8
    # TP pairs are neighbours (2r, 2r+1): never split across nodes.
    assert seen["groups"]["tp"] == [[2 * r, 2 * r + 1] for r in range(8)]
    assert seen["crosses"]["tp"] == [False] * 8
    # DP = 4 varies third in tp-cp-dp-pp: strides of 2 inside one pipeline stage, one node.
    assert seen["groups"]["dp"][0] == [0, 2, 4, 6]
    assert seen["crosses"]["dp"] == [False] * 4
    # With 4 GPUs per node the same DP groups {0,2,4,6} span nodes 0 and 1.
    assert rank_map(16, 4, tp=2, pp=2, ep=2).lookup()["crosses"]["dp"] == [True] * 4


def test_crossing_summary_is_in_the_static_html():
    html = rank_map(16, 8, tp=2, pp=2, ep=2, kind="pp").to_html()
    assert "PP: 8 groups of 2 ranks \u2014 8 of 8 cross a node boundary" in html
    assert "EP: 8 groups of 2 ranks \u2014 all inside one node (NVLink)" in html
    assert "TP: 8 groups" not in html  # the dense panel starts on the requested kind


def test_initial_paint_matches_groups():
    """Python paints the first state (readable without JavaScript): cell colour = its group's."""
    m = rank_map(16, 8, tp=4, pp=2, ep=2, knobs=False)
    groups = m.lookup()["groups"]["tp"]
    dense = m.to_html().split('data-side="dense"')[1].split('data-side="expert"')[0]
    cells = re.findall(r'data-rank="(\d+)" data-group="(\d+)".*?style="background:(#\w+)', dense)
    assert len(cells) == 16
    for rank, group, background in cells:
        assert int(rank) in groups[int(group)]
        assert background == draw.group_color(int(group), 4)


def test_rank_formula_matches_the_grids():
    assert rank_formula("tp-cp-dp-pp") == "rank = tp + TP\u00b7(cp + CP\u00b7(dp + DP\u00b7pp))"
    for layout in LAYOUTS:
        grid = build_grid(16, tp=2, pp=2, ep=2, layout=layout)
        for rank_grid in {id(g): g for g in (grid.dense, grid.expert)}.values():
            formula = rank_formula("-".join(rank_grid.order)).removeprefix("rank = ").replace("\u00b7", "*")
            sizes = {d.upper(): rank_grid.size(d) for d in rank_grid.order}
            for rank in range(16):
                assert eval(formula, {}, {**sizes, **rank_grid.coords(rank)}) == rank


# --- the page is self-contained ---------------------------------------------------


def test_html_is_self_contained(world16):
    html = world16._repr_html_()
    assert html == world16.to_html()
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", html)
    assert "require(" not in html and "@import" not in html
    # the embedded JSON is exactly .data
    payload = re.search(r'<script type="application/json" class="[^"]+">(.*?)</script>', html).group(1)
    assert json.loads(payload) == world16.data


def test_two_maps_never_share_ids_or_classes():
    a, b = rank_map(), rank_map()
    assert a.prefix != b.prefix
    for m in (a, b):
        html = m.to_html()
        ids = re.findall(r'\bid="([^"]+)"', html)
        assert ids == [m.prefix]
        # Only the shared hook classes the browser test looks for (tl-rank-map, tl-gpu) are unprefixed.
        for attr in re.findall(r'\bclass="([^"]+)"', html):
            assert every(token.startswith(m.prefix + "-") or token in ("tl-rank-map", "tl-gpu")
                       for token in attr.split()), attr
        # every CSS rule is scoped under this instance's root id
        css = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
        for selector in re.findall(r"([^{}]+)\{", css):
            assert every(s.strip().startswith("#" + m.prefix) for s in selector.split(",")), selector
        # the script is wrapped in an IIFE: nothing at top level but the function call
        script = re.findall(r"<script>(.*?)</script>", html, re.S)[-1].strip()
        assert script.startswith("(function () {") and script.endswith("})();")


def test_knobs_json_stays_small(world16):
    assert len(world16.data["configs"]) > 400  # every layout and size combination is there
    assert json_size(world16) < 300_000
    for world in (8, 32, 64, 128):
        assert json_size(rank_map(world, 8)) < 300_000


def test_big_worlds_freeze_knobs_but_keep_the_start():
    m = rank_map(128, 8, tp=2, pp=2, ep=2, cp=2)
    frozen = [k["name"] for k in m.data["knobs"] if k["frozen"]]
    assert set(frozen) == {"etp", "cp"}
    assert {k["name"]: k["values"] for k in m.data["knobs"]}["cp"] == [2]
    assert m.lookup()["groups"]["cp"] == build_grid(128, 2, 2, 2, 2).groups("cp")


def test_knobs_off_embeds_one_config():
    m = rank_map(8, 4, tp=2, pp=1, ep=1, knobs=False)
    assert len(m.data["configs"]) == 1
    assert "<select class=" not in m.to_html()


def test_sizes_outside_the_knob_range_are_kept():
    m = rank_map(16, 8, tp=16, pp=1, ep=1)
    assert 16 in {k["name"]: k["values"] for k in m.data["knobs"]}["tp"]
    assert m.lookup()["groups"]["tp"] == [list(range(16))]


def test_invalid_configs_raise():
    with pytest.raises(ConfigError, match="rule 1"):
        rank_map(16, 8, tp=3, pp=1, ep=1)
    with pytest.raises(ConfigError, match="rule 1"):
        rank_map(16, 8, tp=2, pp=2, ep=2, etp=4, layout="course")
    with pytest.raises(ConfigError, match="gpus_per_node"):
        rank_map(16, 0)
    with pytest.raises(ValueError, match="unknown group kind"):
        rank_map(kind="world")


def test_invalid_knob_setting_carries_pythons_message(world16):
    seen = world16.lookup(tp=8, pp=4)
    with pytest.raises(ConfigError) as err:
        build_grid(16, tp=8, pp=4, ep=2)
    assert seen == {"error": str(err.value)}
    assert seen["error"].startswith("[rule 1]")
    with pytest.raises(KeyError):
        world16.lookup(tp=3)


def test_kind_colors_cover_every_kind():
    assert set(ALL_KINDS) <= set(draw.KIND_COLORS)
    assert len(set(draw.KIND_COLORS.values())) == len(draw.KIND_COLORS)
    assert draw.group_color(0, 1) == draw.SINGLETON_COLOR
    assert draw.group_color(len(draw.PALETTE), 2) == draw.PALETTE[0]
    assert draw.text_color("#ffffff") != draw.text_color("#000000")


# --- what each group carries --------------------------------------------------------


def test_every_kind_says_which_collective_it_runs_and_on_how_many_bytes():
    """Found reading the book: each group kind on the map is labelled with its collective and volume.

    Upstream rules (NVIDIA/Megatron-LM, Megatron-Core 0.20.0, d98e8a64): DP reduces
    gradients once per optimizer step (the schedules' ``no_sync_func`` holds back every
    microbatch but the last); ``megatron/core/optimizer/optimizer.py``
    ``MegatronOptimizer.get_grad_stats_parallel_group`` is the model-parallel group (mp)
    without a distributed optimizer; ``megatron/core/distributed/finalize_model_grads.py``
    ``_allreduce_word_embedding_grads`` all-reduces over the embedding group;
    ``megatron/core/transformer/moe/token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher``
    all-gathers dispatched tokens and reduce-scatters expert outputs over expert TP.
    """
    m = rank_map(16, 8, tp=2, pp=2, ep=2, kind="dp")
    assert set(m.data["kind_traffic"]) == set(ALL_KINDS)
    page = m.to_html()
    # the two panels start on dp and ep: their lines are in the static markup
    for kind in ("dp", "ep"):
        assert html.escape(traffic_line(kind)) in page
    assert "DP groups run all-reduce of gradients" in page
    assert "once per optimizer step" in traffic_line("dp")  # not once per microbatch
    assert "EP groups run all-to-all" in page


def test_the_traffic_labels_agree_with_the_bandwidth_table():
    """The five kinds of chapter 1's bandwidth table: same collective, frequency, volume."""
    from tutorial_lib import costs

    rows = {r.parallelism.lower(): r for r in costs.bandwidth_table()}
    for kind, row in rows.items():
        collective, when, volume = KIND_TRAFFIC[kind]
        formula = volume.split(" ")[0]
        assert row.volume_per_op.startswith(formula + " bytes"), (kind, volume)
        first = collective.split(" ")[0]
        assert first in row.collective or (kind == "cp" and "send/recv" in row.collective)
    assert KIND_TRAFFIC["dp"][1] in rows["dp"].frequency
