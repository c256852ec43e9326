"""The course's widgets in Debian's chromium, on pages of their own fragments (no book build).

Each test puts two copies of a widget on one ``file://`` page (the ``fragment_page``
fixture of tests/conftest.py) and checks that the scripts run, that one copy never
drives the other, and that what the page shows after a click, a hover or Play is what
Python computed; nothing may be fetched.  Traces come from real gloo launches (the
workers of the dist tests: those tests are marked ``dist`` too) or synthetic ones.
The DOM contract they rely on: animation roots carry ``tl-animation``, ``data-frame``
and ``button.tl-play``; rank maps ``tl-rank-map`` and ``.tl-gpu`` cells.
"""
from __future__ import annotations

import pytest

from tests.dist.test_context_parallel import _attention_worker
from tests.dist.test_moe_flow import N, _dispatch_worker
from tests.dist.test_timeline import _overlap_worker
from tests.dist.test_viz_collectives import CAPTURE, _ring_worker
from tests.unit.test_fp8_tiles import outlier_tokens
from tests.unit.test_timeline import MS, synthetic
from tutorial_lib.launch import launch
from tutorial_lib.viz import draw, widget
from tutorial_lib.viz import timeline as tlmod
from tutorial_lib.viz.collective_animation import animate_ring_all_reduce
from tutorial_lib.viz.cp_ring import animate_ring_attention
from tutorial_lib import fp8
from tutorial_lib.viz.fp8_legs import dispatch_combine_figure
from tutorial_lib.viz.fp8_tiles import tile_explorer
from tutorial_lib.viz.moe_flow import animate_token_flow
from tutorial_lib.viz.rank_map import rank_map
from tutorial_lib.viz.timeline import timeline
from tests.asserts import every

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def dispatch_run():
    """The dist tests' MoE all-to-alls: counts, tokens with uneven splits, the combine."""
    return launch(_dispatch_worker, N, capture_values=64, timeout=90)


@pytest.fixture(scope="module")
def real_run():
    """The dist tests' transfer in flight during backward."""
    return launch(_overlap_worker, 2, timeout=60)


def play_the_first_of_two(view):
    """The page's two players: Play advances the first and leaves the second alone; then the
    first is paused.  Returns the two players' locators."""
    page = view.page
    first, second = page.locator(".tl-animation").nth(0), page.locator(".tl-animation").nth(1)
    assert first.get_attribute("data-frame") == "0"
    view.play_advances(first)
    assert second.get_attribute("data-frame") == "0"  # the other player is untouched
    first.locator(".tl-play").click()  # pause
    return first, second


# --- the rank map ---------------------------------------------------------------------------


def test_the_rank_map_in_chromium(tmp_path, chromium_browser):
    a = rank_map(16, 8, tp=2, pp=2, ep=2)
    b = rank_map(16, 8, tp=2, pp=2, ep=2, layout="course")
    page_file = tmp_path / "page.html"
    page_file.write_text(f"<!doctype html><meta charset='utf-8'><body>{a.to_html()}{b.to_html()}</body>",
                         encoding="utf-8")
    page = chromium_browser.new_page()
    try:
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(page_file.as_uri())
        root, other = page.locator(f"#{a.prefix}"), page.locator(f"#{b.prefix}")
        assert root.get_attribute("data-ready") == "1" and other.get_attribute("data-ready") == "1"

        # the script's first paint agrees with Python's: cell colour = its TP group's colour
        painted = page.locator(f"#{a.prefix} [data-side='dense'] .{a.prefix}-cell").evaluate_all(
            "cells => cells.map(c => [Number(c.dataset.rank), getComputedStyle(c).backgroundColor])")
        for i, group in enumerate(a.lookup()["groups"]["tp"]):
            hex_colour = draw.group_color(i, len(group))
            rgb = "rgb(%d, %d, %d)" % tuple(int(hex_colour[k:k + 2], 16) for k in (1, 3, 5))
            assert every(colour == rgb for rank, colour in painted if rank in group)

        # click rank 5: its TP group {4, 5} and EP group {5, 7} light up, others dim
        root.locator(".%s-cell[data-rank='5']" % a.prefix).first.click()
        assert root.get_attribute("data-selected-rank") == "5"
        dense = root.locator("[data-side='dense']")
        expert = root.locator("[data-side='expert']")
        selected = lambda panel: sorted(int(x) for x in panel.locator(".selected").evaluate_all(
            "cells => cells.map(c => c.dataset.rank)"))
        assert selected(dense) == a.lookup()["groups"]["tp"][2] == [4, 5]
        assert selected(expert) == [g for g in a.lookup()["groups"]["ep"] if 5 in g][0]
        assert other.get_attribute("data-selected-rank") == ""  # the second map is untouched

        # switch the dense panel to PP: rank 5's pipeline group crosses the node boundary
        dense.locator("[data-kind='pp']").click()
        assert selected(dense) == [5, 13]
        assert dense.locator(f".{a.prefix}-crosses").count() == 16
        assert "8 of 8 cross" in dense.locator(f".{a.prefix}-summary").text_content()

        # a knob switches to another precomputed configuration: Python's describe line
        root.locator("select[data-knob='pp']").select_option("4")
        assert root.locator(f".{a.prefix}-describe").text_content() == a.lookup(pp=4)["describe"]
        assert selected(dense) == [g for g in a.lookup(pp=4)["groups"]["pp"] if 5 in g][0]

        # an invalid setting shows Python's ConfigError message
        root.locator("select[data-knob='tp']").select_option("8")
        assert root.get_attribute("data-invalid") == "1"
        assert root.locator(f".{a.prefix}-error").text_content() == a.lookup(tp=8, pp=4)["error"]

        # hovering shows every coordinate, dense and expert
        root.locator("select[data-knob='tp']").select_option("2")
        root.locator(f".{a.prefix}-cell[data-rank='6']").first.hover()
        info = root.locator(f".{a.prefix}-info").text_content()
        coords = a.lookup(pp=4)["coords"]
        for dim in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"):
            assert f"{dim}={coords[dim][6]}" in info
        assert errors == []
    finally:
        page.close()


# --- collectives -----------------------------------------------------------------------------


@pytest.mark.dist
def test_the_collective_player_plays_in_chromium(tmp_path, fragment_page):
    """Two players on one page: Play advances its own ``data-frame``, Next/Back/slider work."""
    out = launch(_ring_worker, 4, args=(8,), capture_values=CAPTURE, timeout=60)
    anim = animate_ring_all_reduce(out.trace)
    view = fragment_page(anim.to_html(), anim.to_html(), width=1000, height=800)
    page = view.page
    first, second = play_the_first_of_two(view)
    second.locator(".tl-next").click()
    second.locator(".tl-next").click()
    second.locator(".tl-prev").click()
    assert second.get_attribute("data-frame") == "1"
    visible = second.locator(".tl-frame:visible")
    assert visible.count() == 1
    assert second.locator(".tl-anim-caption").inner_text().startswith("reduce-scatter step 1/3")
    second.locator(".tl-slider").fill("6")
    assert second.get_attribute("data-frame") == "6"
    page.screenshot(path=str(tmp_path / "player.png"), full_page=True)
    view.assert_clean()


# --- timelines -------------------------------------------------------------------------------


@pytest.mark.dist
def test_the_timeline_plays_and_explains_itself_in_chromium(tmp_path, fragment_page, real_run):
    """Two timelines on one page: Play moves one cursor, hover shows a tooltip, drag zooms."""
    recorded = timeline(real_run.trace, title="A transfer in flight during backward")
    made_up = timeline(synthetic(), title="Two buckets overlap backward")
    view = fragment_page(recorded.to_html(), made_up.to_html(), width=1000, height=1100)
    page = view.page
    first, second = page.locator(".tl-animation").nth(0), page.locator(".tl-animation").nth(1)
    assert page.locator(".tl-animation").count() == 2
    assert first.get_attribute("data-frame") == "0"
    first_zoom = first.get_attribute("data-zoom")

    # Play advances the first cursor only.
    play_the_first_of_two(view)

    # The slider moves the second cursor: the caption and the revealed bars follow Python.
    second.locator(".tl-slider").fill("9")
    assert second.get_attribute("data-frame") == "9"
    frame = made_up.data["frames"][9]
    assert second.locator(".tl-anim-caption").inner_text() == frame["caption"]
    shown = second.locator(".tl-solid").evaluate_all(
        "rs => rs.filter(r => r.getAttribute('display') !== 'none').length")
    assert shown == sum(1 for b in made_up.data["bars"] if b["start"] <= frame["t"])
    assert second.locator(".tl-bar.tl-on").count() == sum(len(v) for v in frame["doing"].values())
    assert second.locator(".tl-cursor").get_attribute("display") == "inline"

    # Hovering a bar shows its tooltip; leaving hides it.
    tip = second.locator(".tl-tooltip")
    assert not tip.is_visible()
    second.locator(".tl-bar[data-kind='pp']").hover()  # not reached yet: its ghost shows
    assert tip.is_visible()
    text = tip.inner_text()
    assert "recv on the pp group" in text and "bfloat16" in text and "8 B" in text
    assert "duration" in text and f"{MS:.3f} ms" in text
    page.mouse.move(2, 2)
    assert not tip.is_visible()

    # Dragging across the chart zooms; Reset zoom goes back.
    before = second.get_attribute("data-zoom")
    chart = second.locator("svg.tl-chart").bounding_box()
    scale = chart["width"] / made_up.data["width"]
    x_a = chart["x"] + (tlmod.LEFT + 200) * scale
    x_b = chart["x"] + (tlmod.LEFT + 400) * scale
    y = chart["y"] + 60 * scale
    page.mouse.move(x_a, y)
    page.mouse.down()
    page.mouse.move(x_b, y, steps=4)
    page.mouse.up()
    z0, z1 = map(float, second.get_attribute("data-zoom").split())
    d0, d1 = made_up.data["domain"]
    pw = made_up.data["plot_width"]
    assert z0 == pytest.approx(d0 + 200 / pw * (d1 - d0), abs=0.2)
    assert z1 == pytest.approx(d0 + 400 / pw * (d1 - d0), abs=0.2)
    assert first.get_attribute("data-zoom") == first_zoom  # the other chart did not zoom
    page.mouse.move(2, 2)
    page.screenshot(path=str(tmp_path / "timeline_zoomed.png"), full_page=True)
    second.locator(".tl-zoom-reset").click()
    assert second.get_attribute("data-zoom") == before

    page.screenshot(path=str(tmp_path / "timeline.png"), full_page=True)
    view.assert_clean()


def test_a_dualpipe_timeline_keeps_its_pair_outlines_and_explains_its_bars_in_chromium(
        tmp_path, fragment_page):
    """Chapter 11's figures: overlapped pairs outlined (after a zoom too), W's drawn, the
    tooltip of a pair's half and of a split B saying what they are."""
    from tutorial_lib.pipeline_parallel import build_schedules
    from tutorial_lib.pipeline_parallel.simulator import simulate
    plan = simulate(build_schedules("dualpipe", 4, 8))
    drawn = tlmod.timeline_from_spans(tlmod.plan_spans(plan), scale=1, unit="F", bubble=True,
                                      title="DualPipe, PP = 4, M = 8")
    view = fragment_page(drawn.to_html(), width=1000, height=700)
    page = view.page
    pairs = sum(1 for ts in plan.values() for t in ts if t.action.overlapped)
    outlined = "rs => rs.filter(r => r.getAttribute('stroke') === '%s').length" % tlmod.PAIR_EDGE
    assert page.locator(".tl-solid").evaluate_all(outlined) == pairs > 0
    assert page.locator(".tl-bar[data-kind='weight']").count() == sum(
        1 for ts in plan.values() for t in ts if t.action.kind == "weight")
    tip = page.locator(".tl-tooltip")
    first_pair = next(i for i, b in enumerate(drawn.data["bars"]) if b["outline"])
    page.locator(f".tl-bar[data-i='{first_pair}']").hover()
    assert "with the other half of its pair" in tip.inner_text()
    split_b = next(i for i, b in enumerate(drawn.data["bars"]) if "computes" in b["tip"])
    page.locator(f".tl-bar[data-i='{split_b}']").hover()
    assert "input's gradient only" in tip.inner_text()
    page.mouse.move(2, 2)
    chart = page.locator("svg.tl-chart").bounding_box()
    scale = chart["width"] / drawn.data["width"]
    y = chart["y"] + 60 * scale
    page.mouse.move(chart["x"] + (tlmod.LEFT + 300) * scale, y)
    page.mouse.down()
    page.mouse.move(chart["x"] + (tlmod.LEFT + 600) * scale, y, steps=4)
    page.mouse.up()
    assert page.locator(".tl-solid").evaluate_all(outlined) == pairs  # zoom keeps them
    page.screenshot(path=str(tmp_path / "dualpipe.png"), full_page=True)
    view.assert_clean()


# --- MoE token flow ----------------------------------------------------------------------------


@pytest.mark.dist
def test_the_token_flow_plays_in_chromium(dispatch_run, tmp_path, fragment_page):
    anim = animate_token_flow(dispatch_run.trace)
    view = fragment_page(anim.to_html(), anim.to_html(), width=1200, height=900)
    first, second = play_the_first_of_two(view)
    second.locator(".tl-next").click()
    assert second.get_attribute("data-frame") == "1"
    assert second.locator(".tl-frame:visible").count() == 1
    caption = second.locator(".tl-anim-caption").inner_text()
    assert caption.startswith("Dispatch 1/4: rank 0 sends 12 copies")
    # the flying squares animate (CSS), and land where the frame draws them
    assert second.locator(".tl-frame:visible .tl-moe-fly").count() == 12
    # the screenshot shows them landed: each flying square's animation has finished
    view.page.wait_for_function(
        "() => [...document.querySelectorAll('.tl-moe-fly')].flatMap(e => e.getAnimations())"
        ".every(a => a.playState === 'finished')", timeout=10_000)
    second.screenshot(path=str(tmp_path / "flow.png"))
    view.assert_clean()


@pytest.mark.dist
def test_the_token_flow_phase_pills_jump_to_their_phase_in_chromium(dispatch_run, fragment_page):
    """Found reading the book: the phase pills above chapter 4's token flow looked like buttons and did
    nothing.  A click (or Enter) on a pill now moves the player to that phase's first
    frame, and Next goes on from there."""
    anim = animate_token_flow(dispatch_run.trace)
    first = {}
    for index, frame in enumerate(anim.data):
        first.setdefault(frame["phase"].split(":")[0], index)
    view = fragment_page(anim.to_html(), width=1200, height=900)
    root = view.page.locator(".tl-animation").first
    root.locator(".tl-frame:visible .tl-moe-step[aria-label='go to combine']").click()
    assert root.get_attribute("data-frame") == str(first["combine"])
    assert root.locator(".tl-anim-caption").inner_text().startswith("Combine 1/4")
    root.locator(".tl-frame:visible .tl-moe-step[aria-label='go to experts']").focus()
    view.page.keyboard.press("Enter")
    assert root.get_attribute("data-frame") == str(first["experts"])
    root.locator(".tl-next").click()
    assert root.get_attribute("data-frame") == str(first["combine"])
    view.assert_clean()


# --- FP8 tiles ---------------------------------------------------------------------------------


def test_the_fp8_tile_explorer_works_in_chromium(fragment_page):
    tokens = outlier_tokens()
    view = fragment_page(tile_explorer(tokens).to_html(), tile_explorer(tokens).to_html())
    root = view.page.locator(".tl-fp8-tiles").first
    assert root.locator("rect.tl-fp8-bar").count() == 128
    before = root.locator(".tl-fp8-stats").inner_text()
    assert "amax" in before and "scale" in before
    root.locator(".tl-fp8-tokens button").nth(1).click()
    assert root.get_attribute("data-token") == "1"
    assert root.locator(".tl-fp8-stats").inner_text() != before
    assert "300" in root.locator(".tl-fp8-stats").inner_text()  # the outlier is the amax
    root.locator(".tl-fp8-modes button").nth(2).click()
    assert root.get_attribute("data-mode") == "per_tensor"
    root.locator(".tl-fp8-tilebtns button").nth(1).click()
    assert root.get_attribute("data-tile") == "1"
    root.locator("rect.tl-fp8-bar").nth(3).hover()
    assert "channel 131" in root.locator(".tl-fp8-hover").inner_text()
    # the second widget on the page did not move
    assert view.page.locator(".tl-fp8-tiles").nth(1).get_attribute("data-token") == "0"
    view.assert_clean()


# --- every widget on a phone ----------------------------------------------------------------

_LABELS = """() => {
    document.querySelectorAll(".tl-frame").forEach(f => { f.style.display = ""; });
    const sizes = [];
    document.querySelectorAll("[data-ready='1'] svg text").forEach(t => {
        const m = t.getScreenCTM();
        if (m && t.textContent.trim()) sizes.push(parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b));
    });
    return [sizes.length, Math.min(...sizes), document.documentElement.scrollWidth];
}"""


@pytest.mark.parametrize("width", [390, 1440])
def test_labels_stay_readable_and_the_page_stays_put(fragment_page, width):
    """widget.css + widget.js: a drawing wider than a 390 px phone keeps every
    label at 9 px or more and scrolls inside its box; the page never scrolls sideways.
    Before, a 940-unit drawing shrank to the column and its 11-unit labels to ~4 px."""
    wide = draw.svg(940, 120, [draw.text(20 + 90 * i, 60, f"rank {i}", size=11)
                               for i in range(10)])
    view = fragment_page(timeline(synthetic(), title="t").to_html(),
                         widget.Animation([wide, wide], ["a", "b"], title="wide").to_html(),
                         tile_explorer(outlier_tokens()).to_html(), width=width)
    count, smallest, page_width = view.page.evaluate(_LABELS)
    assert count > 20 and smallest >= 8.95, f"{count} labels, smallest {smallest:.1f} px"
    assert page_width <= width, f"the page is {page_width} px wide on a {width} px screen"
    view.assert_clean()


# --- context parallelism: the ring of K/V blocks (chapter 9) ------------------------------------


@pytest.mark.dist
def test_the_ring_attention_player_plays_in_chromium(fragment_page):
    """The dist tests' ring at CP 4: Play advances one player only; Next shows the next
    step, whose caption and K/V labels are Python's."""
    run = launch(_attention_worker, 4, timeout=120)
    anim = animate_ring_attention(run.trace.filter(case="p2p-causal-balanced"))
    view = fragment_page(anim.to_html(), anim.to_html(), width=1000, height=900)
    first, second = play_the_first_of_two(view)
    second.locator(".tl-next").click()
    assert second.get_attribute("data-frame") == "1"
    visible = second.locator(".tl-frame:visible")
    assert visible.count() == 1
    assert second.locator(".tl-anim-caption").inner_text() == anim.captions[1]
    text = visible.inner_text()
    for p, owner in anim.data[1]["holds"].items():
        assert f"K/V of CP {owner}" in text
    second.locator(".tl-slider").fill(str(len(anim) - 1))
    assert "every rank's block" in second.locator(".tl-frame:visible").inner_text()
# The column of the built book at 1440 px is about 740 px wide; a phone's (390 px) about 340.
COLUMN = "<div style='max-width:740px'>{}</div>"
_FIT = """root => {
  const box = root.getBoundingClientRect();
  const bars = [...root.querySelectorAll('rect.tl-fp8-bar')].map(b => b.getBoundingClientRect());
  const fonts = [...root.querySelectorAll('text, button, div')].filter(e => e.textContent.trim())
    .map(e => parseFloat(getComputedStyle(e).fontSize) *
         (e.ownerSVGElement ? e.ownerSVGElement.getBoundingClientRect().width /
          e.ownerSVGElement.viewBox.baseVal.width : 1));
  return {bars: bars.length, inside: bars.filter(b => b.left >= box.left && b.right <= box.right
            && b.width > 0).length,
          overflow: root.scrollWidth - root.clientWidth,
          page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
          smallest: Math.min(...fonts)};
}"""


@pytest.mark.parametrize("width", [1440, 390])
def test_the_fp8_tile_explorer_fits_its_column_with_every_channel_and_a_value_scale(
        fragment_page, width):
    """Found reading the book: the widget was a fixed 940 px, so a 740 px column hid channels 104-127, and
    its value axis had no scale.  Now: all 128 channels inside the widget at 1440 and 390
    px, no sideways scroll, text at least 9 px, and a value axis whose ticks are the tile's
    amax, half of it and 0 (either sign), redrawn when the tile changes."""
    tokens = outlier_tokens()
    view = fragment_page(COLUMN.format(tile_explorer(tokens).to_html()), width=width)
    root = view.page.locator(".tl-fp8-tiles").first
    fit = root.evaluate(_FIT)
    assert fit["bars"] == 128 and fit["inside"] == 128, fit
    assert fit["overflow"] <= 0 and fit["page"] <= 0, fit
    assert fit["smallest"] >= 9, fit

    def ticks():
        return [float(t) for t in root.locator("text.tl-fp8-tick").all_text_contents()]
    amax = tokens[0, :128].abs().max().item()
    assert ticks() == pytest.approx([-amax, -amax / 2, 0, amax / 2, amax], rel=5e-3)
    channels = root.locator("text.tl-fp8-channel").all_text_contents()
    assert channels[0] == "0" and channels[-1] == "127"
    root.locator(".tl-fp8-tokens button").nth(1).click()  # the outlier (300) sets the scale
    assert max(ticks()) == pytest.approx(300) and min(ticks()) == pytest.approx(-300)
    root.locator(".tl-fp8-tilebtns button").nth(1).click()
    channels = root.locator("text.tl-fp8-channel").all_text_contents()
    assert channels[0] == "128" and channels[-1] == "255"
    # narrower after the first paint (a phone turned, a side panel opened): drawn again
    view.page.set_viewport_size({"width": 360, "height": 900})
    view.page.wait_for_timeout(200)
    fit = root.evaluate(_FIT)
    assert fit["inside"] == 128 and fit["overflow"] <= 0 and fit["page"] <= 0, fit
    view.assert_clean()


@pytest.mark.parametrize("width", [1440, 390])
def test_the_fp8_legs_figure_reads_at_every_width(fragment_page, width):
    """The four dispatch/combine legs: drawn from fp8.DEEPSEEK_V3_DISPATCH / _COMBINE, in
    the order they run, readable (text >= 9 px, no overlap) and inside the column."""
    figure = dispatch_combine_figure()
    view = fragment_page(COLUMN.format(figure.to_html()), width=width)
    root = view.page.locator(".tl-fp8-legs").first
    fit = root.evaluate(_FIT)
    assert fit["overflow"] <= 0 and fit["page"] <= 0 and fit["smallest"] >= 9, fit
    legs = root.locator("g.tl-fp8-leg")
    assert legs.count() == 4
    pairs = {"dispatch": fp8.DEEPSEEK_V3_DISPATCH, "combine": fp8.DEEPSEEK_V3_COMBINE}
    for i in range(4):
        leg = legs.nth(i)
        op, phase = leg.get_attribute("data-op"), leg.get_attribute("data-phase")
        assert leg.get_attribute("data-precision") == pairs[op][phase == "backward"]
        boxes = leg.locator("text").evaluate_all(
            "ts => ts.map(t => { const b = t.getBoundingClientRect(); "
            "return [b.left, b.top, b.right, b.bottom]; })")
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                (l1, t1, r1, b1), (l2, t2, r2, b2) = boxes[a], boxes[b]
                assert r1 <= l2 or r2 <= l1 or b1 <= t2 or b2 <= t1, (i, boxes[a], boxes[b])
    assert [legs.nth(i).get_attribute("data-op") for i in range(4)] == \
        ["dispatch", "combine", "combine", "dispatch"]
    view.assert_clean()


# --- the memory explorer (chapter 10) ------------------------------------------------------


def test_the_memory_explorer_plays_the_models_numbers_in_chromium(fragment_page):
    """Chapter 10's memory: every click shows what ``costs.memory_per_rank`` computed for that layout
    (the bars' MiB are the island's numbers, the heaviest rank and the verdict follow; under
    ZeRO-3 no whole weight and a gathered peak), a refused layout says why, and the second
    copy on the page does not move."""
    from tutorial_lib.viz.memory_explorer import explorer_data, memory_explorer
    data = explorer_data()
    a, b = memory_explorer(), memory_explorer()
    view = fragment_page(a.to_html(), b.to_html())
    root, other = view.page.locator(".tl-memory-explorer").nth(0), view.page.locator(".tl-memory-explorer").nth(1)
    first_key = root.get_attribute("data-key")
    assert first_key == "deepseek-v3|1|16|64|1|none"

    def shown(key):
        bars = root.locator("rect.tl-mem-bar").evaluate_all("rs => rs.map(r => +r.dataset.mib)")
        expected = [v for rank in data["results"][key]["ranks"] for v in rank]
        assert bars == expected, key
        totals = [sum(r) for r in data["results"][key]["ranks"]]
        assert int(root.get_attribute("data-heaviest")) == totals.index(max(totals))
        return max(totals)

    heaviest = shown(first_key)
    assert root.get_attribute("data-fits") == ("yes" if heaviest <= 80 * 1024 else "no")
    root.locator(".tl-mem-recompute button", has_text="full").click()
    assert root.get_attribute("data-key") == "deepseek-v3|1|16|64|1|full"
    shown_recomputed = shown("deepseek-v3|1|16|64|1|full")
    assert shown_recomputed < heaviest  # recomputation frees activations
    root.locator(".tl-mem-zero button", has_text="ZeRO-3").click()  # chapter 12's strategies
    assert root.get_attribute("data-key") == "deepseek-v3|1|16|64|3|full"
    assert "error" not in data["results"]["deepseek-v3|1|16|64|3|full"]  # experts over EDP
    sharded = shown("deepseek-v3|1|16|64|3|full")
    assert sharded < shown_recomputed  # ZeRO-3 keeps less than ZeRO-1
    assert root.get_attribute("data-fits") == ("yes" if sharded <= 80 * 1024 else "no")
    root.locator(".tl-mem-zero button", has_text="ZeRO-1").click()
    root.locator(".tl-mem-budget button", has_text="141 GiB").click()
    root.locator(".tl-mem-preset button", has_text="llama-3.1-405b").click()
    assert root.locator(".tl-mem-ep button").count() == 1  # a dense model: EP 1 only
    root.locator(".tl-mem-tp button", has_text="8").click()
    key = root.get_attribute("data-key")
    assert key == "llama-3.1-405b|8|16|1|1|full"
    total = shown(key)
    assert root.get_attribute("data-fits") == ("yes" if total <= 141 * 1024 else "no")
    root.locator(".tl-mem-zero button", has_text="ZeRO-3").click()
    assert root.get_attribute("data-key") == "llama-3.1-405b|8|16|1|3|full"
    assert shown("llama-3.1-405b|8|16|1|3|full") < total  # ZeRO-3 on this dense model
    parts = root.locator("rect.tl-mem-bar").evaluate_all(
        "rs => rs.map(r => [r.dataset.part, +r.dataset.mib])")
    assert {mib for part, mib in parts if part == "weights"} == {0}  # no whole weight kept
    assert min(mib for part, mib in parts if part == "gathered") > 0  # but a gathered peak
    root.locator(".tl-mem-zero button", has_text="ZeRO-1").click()
    root.locator(".tl-mem-tp button", has_text="1").click()
    root.locator(".tl-mem-pp button", has_text="4").click()  # DP 4096: 2048 sequences do not split
    refused = data["results"][root.get_attribute("data-key")]
    assert root.get_attribute("data-fits") == "refused" and "error" in refused
    assert data["errors"][refused["error"]] in root.locator(".tl-mem-summary").inner_text()
    assert other.get_attribute("data-key") == first_key  # the second copy did not move
    view.assert_clean()


# --- the layout explorer (chapter 13) ------------------------------------------------------


def test_the_layout_explorer_shows_the_planners_tables_in_chromium(fragment_page):
    """Chapter 13's explorer: each click shows the table ``plan`` made in Python for that
    choice (cell for cell), a choice where nothing fits shows the planner's reason, the
    second copy on the page does not move, and on a phone only the table's box scrolls."""
    from tutorial_lib.viz.layout_explorer import LayoutExplorer, explorer_data
    data = explorer_data(sizes=("1.3B", "70B"), gpus=("h100-sxm",), counts=(8,))
    view = fragment_page(LayoutExplorer(data).to_html(), LayoutExplorer(data).to_html(),
                         width=390, height=900)
    root = view.page.locator(".tl-layout-explorer").nth(0)
    other = view.page.locator(".tl-layout-explorer").nth(1)
    first = "1.3B|h100-sxm|8"
    assert root.get_attribute("data-key") == first
    cells = root.locator(".tl-lay-result td").all_inner_texts()
    assert cells == [value for row in data["results"][first]["rows"] for value in row]
    root.locator(".tl-lay-size button", has_text="70B").click()
    assert root.get_attribute("data-key") == "70B|h100-sxm|8"
    assert data["results"]["70B|h100-sxm|8"]["refused"] in \
        root.locator(".tl-lay-result").inner_text()
    assert other.get_attribute("data-key") == first  # the second copy did not move
    assert view.page.evaluate("document.documentElement.scrollWidth") <= 390
    view.assert_clean()


_OVERFLOW = """root => {
    const svg = root.querySelector("svg"), box = svg.getBoundingClientRect();
    const out = [...svg.querySelectorAll("text, rect")].map(e => e.getBoundingClientRect())
        .filter(r => r.left < box.left - 0.5 || r.right > box.right + 0.5).length;
    const fonts = [...svg.querySelectorAll("text")].map(
        t => parseFloat(getComputedStyle(t).fontSize) * svg.getScreenCTM().a);
    return [Math.round(box.width), svg.parentNode.scrollWidth - svg.parentNode.clientWidth,
            out, Math.min(...fonts)];
}"""


@pytest.mark.parametrize("width", [390, 1000])
def test_the_memory_explorer_draws_at_the_width_of_its_box(fragment_page, width):
    """On a phone the explorer's box is about 330 px: the bars and their labels are drawn
    at that width (11 px labels), nothing cut off and nothing to scroll; a resize redraws."""
    from tutorial_lib.viz.memory_explorer import memory_explorer
    view = fragment_page(memory_explorer().to_html(), width=width, height=900)
    root = view.page.locator(".tl-memory-explorer").first
    drawn, scroll, outside, smallest = root.evaluate(_OVERFLOW)
    inner = root.evaluate("r => r.clientWidth - 28")  # less its padding
    assert drawn == min(inner, 720) and scroll == 0 and outside == 0, (drawn, inner, scroll, outside)
    assert smallest >= 10.9
    if width == 390:
        view.page.set_viewport_size({"width": 700, "height": 900})
        view.page.wait_for_function("r => r.querySelector('svg').getBoundingClientRect().width > 500",
                                    arg=root.element_handle())
    view.assert_clean()


# --- touch screens and keyboards ---------------------------------------------------------------


def test_a_timeline_answers_a_tap_and_says_tap_on_a_touch_screen(chromium_browser, tmp_path):
    """On a phone a tap on a bar opens its tooltip and leaves it open (with mouse events a
    tap opened it and the emulated mousedown shut it); a second tap shuts it; the notes say
    "tap" and leave out the mouse's drag-to-zoom."""
    path = tmp_path / "touch.html"
    path.write_text("<!doctype html><meta charset='utf-8'><body>"
                    + timeline(synthetic(), title="t").to_html() + "</body>", encoding="utf-8")
    context = chromium_browser.new_context(viewport={"width": 390, "height": 844},
                                           has_touch=True, is_mobile=True)
    try:
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        assert page.evaluate("matchMedia('(hover: none)').matches")
        root = page.locator(".tl-animation")
        notes = root.locator(".tl-anim-caption").inner_text() + root.locator(".tl-anim-note").inner_text()
        assert "tap a bar" in notes.lower() and "hover" not in notes.lower()
        assert "drag" not in notes.lower()
        tip = root.locator(".tl-tooltip")
        bar = root.locator(".tl-bar[data-kind='pp'] .tl-solid")
        bar.scroll_into_view_if_needed()
        bar.tap()
        page.wait_for_timeout(400)  # the emulated mouse events that follow a tap have fired
        assert tip.is_visible() and "recv on the pp group" in tip.inner_text()
        bar.tap()
        page.wait_for_timeout(400)
        assert not tip.is_visible()
        assert errors == []
    finally:
        context.close()


def test_the_widgets_work_from_the_keyboard(fragment_page):
    """Tab reaches the player's buttons, Enter and Space press them (Next, then Play); Tab
    reaches a rank-map cell and Enter selects its groups, Escape clears them."""
    anim = timeline(synthetic(), title="t")
    view = fragment_page(anim.to_html(), rank_map(world_size=8, gpus_per_node=4, tp=2, pp=2).to_html(),
                         width=1000, height=1400)
    page = view.page
    root = page.locator(".tl-animation").first
    focused = "() => document.activeElement.className + ' ' + document.activeElement.textContent"

    def tab_to(css_class: str) -> None:  # Tab until an element of that class has the focus
        for _ in range(40):
            page.keyboard.press("Tab")
            if css_class in page.evaluate(focused):
                return
        raise AssertionError(f"Tab never reached .{css_class}: {page.evaluate(focused)}")

    tab_to("tl-next")
    page.keyboard.press("Enter")
    assert root.get_attribute("data-frame") == "1"
    page.keyboard.press("Space")
    assert root.get_attribute("data-frame") == "2"
    page.keyboard.press("Shift+Tab")  # Back
    page.keyboard.press("Shift+Tab")  # Play
    assert "tl-play" in page.evaluate(focused)
    page.keyboard.press("Space")
    page.wait_for_function("r => +r.getAttribute('data-frame') > 2", arg=root.element_handle())
    page.keyboard.press("Space")  # pause
    rank_map_root = page.locator(".tl-rank-map").first
    tab_to("tl-gpu")
    page.keyboard.press("Enter")
    assert rank_map_root.get_attribute("data-selected-rank") == "0"
    page.keyboard.press("Escape")
    assert rank_map_root.get_attribute("data-selected-rank") == ""
    view.assert_clean()


# --- cheat sheets ------------------------------------------------------------------------------

_SHEET_LAYOUT = """() => {
    const boxes = [...document.querySelectorAll("h1, h2, nav, li, table, footer")]
        .map(e => [e.tagName, e.getBoundingClientRect()]);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const [ta, a] = boxes[i], [tb, b] = boxes[j];
        if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1
            && b.top < a.bottom - 1 && !(ta === "TABLE" || tb === "TABLE"))
            overlaps.push(ta + "/" + tb);
    }
    return [document.documentElement.scrollWidth, overlaps.slice(0, 5)];
}"""


def test_every_cheat_sheet_fits_a_phone(chromium_browser, tmp_path):
    """At 390 px each sheet (and the index) is as wide as the screen (its key table scrolls
    in its own box if it must), and no heading, item or footer sits on another."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("cheat_sheets", root / "scripts" / "cheat_sheets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pages = module.write_sheets(tmp_path)
    page = chromium_browser.new_page(viewport={"width": 390, "height": 844})
    try:
        for path in pages:
            page.goto(path.as_uri())
            width, overlaps = page.evaluate(_SHEET_LAYOUT)
            assert width <= 390 and not overlaps, (path.name, width, overlaps)
    finally:
        page.close()
