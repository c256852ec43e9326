"""Timelines drawn from traces: the numbers drawn, the helpers and the HTML.

A real launch: tests/dist/test_timeline.py; the page in chromium: tests/book/test_widgets.py.
"""
import json
import re

import pytest

from tutorial_lib.trace import Trace, TraceEvent
from tutorial_lib.viz import timeline as tlmod
from tutorial_lib.viz.draw import KIND_COLORS
from tutorial_lib.viz.timeline import (Span, Timeline, bubble_fraction, busy_fraction,
                                       event_label, format_bytes, overlap_fraction,
                                       overlap_seconds, timeline, timeline_from_spans,
                                       trace_spans)

# Times in units of 1/128 s (7.8125 ms): binary fractions, so shifting by T0 and scaling
# to ms are exact and every number below can be compared with ==.
U = 1 / 128
T0 = 1024.0
MS = U * 1000  # one unit in ms


def ev(rank, op, a, b, kind=None, name=None, group=(0, 1), **tags):
    if op == "compute":
        return TraceEvent(rank=rank, op="compute", t_start=T0 + a * U, t_end=T0 + b * U,
                          tags={**tags, "name": name})
    return TraceEvent(rank=rank, op=op, group_kind=kind, group_ranks=tuple(group),
                      shape=(256, 256), dtype="float32", bytes=262144,
                      t_start=T0 + a * U, t_end=T0 + b * U, tags=dict(tags))


def synthetic() -> Trace:
    """Rank 0: two bucket all-reduces in flight during backward; rank 1: a receive after it."""
    return Trace([
        ev(0, "compute", 0, 2, name="forward", microbatch=0),
        ev(0, "compute", 2, 6, name="backward", microbatch=0),
        ev(0, "all_reduce", 3, 7, "dp", bucket=0),
        ev(0, "all_reduce", 4, 5, "dp", bucket=1),
        ev(0, "compute", 7, 8, name="optimizer"),
        ev(1, "compute", 0, 2, name="forward", microbatch=0),
        ev(1, "compute", 2, 5, name="backward", microbatch=0),
        TraceEvent(rank=1, op="recv", group_kind="pp", group_ranks=(0, 1), peer=0, shape=(4,),
                   dtype="bfloat16", bytes=8, t_start=T0 + 5 * U, t_end=T0 + 6 * U),
    ])


def bars_of(tl: Timeline, **match):
    return [b for b in tl.data["bars"] if all(b[k] == v for k, v in match.items())]


# --- the numbers drawn ------------------------------------------------------------------------


def test_layout_of_a_synthetic_trace_is_exact():
    tl = timeline(synthetic(), width=900)
    d = tl.data
    assert d["unit"] == "ms" and d["domain"] == (0.0, 8 * MS)
    x0, pw = tlmod.LEFT, 900 - tlmod.LEFT - tlmod.RIGHT
    assert (d["x0"], d["plot_width"]) == (x0, pw)
    assert d["ranks"] == [0, 1] and d["lanes"] == ["compute", "comm"]
    k = pw / (8 * MS)

    # Every event is one bar, at its relative time in ms.
    assert len(d["bars"]) == len(synthetic())
    backward = bars_of(tl, rank=0, label="backward mb0")[0]
    assert (backward["start"], backward["end"]) == (2 * MS, 6 * MS)
    assert backward["x"] == x0 + 2 * MS * k and backward["w"] == pytest.approx(4 * MS * k, abs=1e-9)
    assert backward["lane"] == "compute" and backward["color"] == KIND_COLORS["compute"]

    # Lanes: compute on top, comm below, the two overlapping all-reduces in two rows.
    top = tlmod.AXIS_H + tlmod.BAND_PAD
    comm_top = top + tlmod.ROW_H + tlmod.LANE_GAP
    b0 = bars_of(tl, rank=0, label="all-reduce bucket 0")[0]
    b1 = bars_of(tl, rank=0, label="all-reduce bucket 1")[0]
    assert backward["y"] == top
    assert (b0["lane"], b0["row"], b0["y"]) == ("comm", 0, comm_top)
    assert (b1["row"], b1["y"]) == (1, comm_top + tlmod.ROW_H + tlmod.ROW_GAP)
    assert b0["color"] == KIND_COLORS["dp"] and b0["kind"] == "dp"
    assert b0["x"] == x0 + 3 * MS * k and b0["w"] == pytest.approx(4 * MS * k, abs=1e-9)
    boxes = {(b["rank"], b["lane"]): b for b in d["lane_boxes"]}
    assert boxes[(0, "comm")]["rows"] == 2 and boxes[(1, "comm")]["rows"] == 1
    # Rank 1's band starts where rank 0's ends.
    bands = {b["rank"]: b for b in d["bands"]}
    assert bands[1]["y"] == bands[0]["y"] + bands[0]["h"]

    # The point of the picture: an all-reduce drawn under backward, overlapping it in x.
    assert b0["x"] < backward["x"] + backward["w"] and backward["x"] < b0["x"] + b0["w"]
    assert b0["y"] > backward["y"]


def test_overlapping_ops_are_visibly_stacked_never_on_top_of_each_other():
    tl = timeline(synthetic())
    for rank in (0, 1):
        for lane in ("compute", "comm"):
            mine = bars_of(tl, rank=rank, lane=lane)
            for i, a in enumerate(mine):
                for b in mine[i + 1:]:
                    same_row = a["y"] == b["y"]
                    overlap = a["start"] < b["end"] and b["start"] < a["end"]
                    assert not (same_row and overlap), (a["label"], b["label"])


def test_labels_and_tooltips_say_what_the_event_was():
    tl = timeline(synthetic())
    recv = bars_of(tl, rank=1, kind="pp")[0]
    assert recv["label"] == "recv \u2190 r0"
    tip = recv["tip"]
    assert tip["group ranks"] == "[0, 1]" and tip["peer"] == "rank 0"
    assert tip["shape"] == "(4,)" and tip["dtype"] == "bfloat16" and tip["bytes"] == "8 B"
    assert tip["duration"] == f"{MS:.3f} ms" and tip["start"] == f"{5 * MS:.3f} ms"
    b0 = bars_of(tl, rank=0, label="all-reduce bucket 0")[0]
    assert b0["tip"]["tags"] == "bucket=0" and b0["tip"]["bytes"] == "256 KiB (262,144 B)"
    # [3, 7] inside compute [0, 6] u [7, 8]: 3 of its 4 units.
    assert b0["tip"]["overlaps compute"] == f"{3 * MS:.3f} ms (75%)"
    assert "compute" in bars_of(tl, rank=0, label="forward mb0")[0]["tip_title"]
    assert [kind for kind, _, _ in tl.data["legend"]] == ["compute", "dp", "pp"]


def test_cursor_frames_say_what_every_rank_is_doing():
    tl = timeline(synthetic(), frames=16)
    frames = tl.data["frames"]
    assert len(tl) == 17 and frames[0]["t"] is None and "2 ranks, 8 bars" in frames[0]["caption"]
    # Frame 9 of 16 is t = 4.5 units: rank 0 in backward with both buckets, rank 1 in backward.
    f = frames[9]
    assert f["t"] == 4.5 * MS
    assert f["doing"] == {0: ["backward mb0", "all-reduce [dp]", "all-reduce [dp]"],
                          1: ["backward mb0"]}
    assert "rank 0: backward mb0 + 2\u00d7 all-reduce [dp]" in f["caption"]
    assert "rank 1: backward mb0" in f["caption"]
    # t = 6.5 units: rank 0 waits for bucket 0, rank 1 is idle.
    assert frames[13]["doing"] == {0: ["all-reduce [dp]"], 1: []}
    assert "rank 1: idle" in frames[13]["caption"]
    assert frames[-1]["t"] == 8 * MS and "every rank has finished" in frames[-1]["caption"]


def test_ranks_kinds_and_t_range_filter_what_is_drawn():
    tl = timeline(synthetic(), ranks=[1, 0], kinds=["dp", "compute"])
    assert tl.data["ranks"] == [1, 0] and [b["rank"] for b in tl.data["bands"]] == [1, 0]
    assert {b["kind"] for b in tl.data["bars"]} == {"dp", "compute"}
    comm_only = timeline(synthetic(), kinds=["dp"])
    assert comm_only.data["lanes"] == [""] and comm_only.data["ranks"] == [0]

    clipped = timeline(synthetic(), t_range=(2.5 * MS, 6.5 * MS))
    assert clipped.data["domain"] == (2.5 * MS, 6.5 * MS)
    labels = {b["label"] for b in clipped.data["bars"]}
    assert "forward mb0" not in labels and "optimizer" not in labels
    backward = bars_of(clipped, rank=0, label="backward mb0")[0]
    assert backward["x"] == tlmod.LEFT  # starts before the range: drawn from its left edge
    assert backward["start"] == 2 * MS  # the number keeps the real start

    unsplit = timeline(synthetic(), split=False)
    assert unsplit.data["lanes"] == [""]
    assert bars_of(unsplit, rank=0, label="all-reduce bucket 0")[0]["row"] >= 1


def test_a_planned_lane_is_drawn_by_the_same_code():
    planned = [(0, 0.0, 2.0, "F0", "compute", "planned"), (0, 2.0, 6.0, "B0", "compute", "planned"),
               (1, 0.0, 2.0, "F0", "compute", "planned")]
    spans = [Span.coerce(p) for p in planned]
    assert spans[1] == Span(0, 2.0, 6.0, "B0", "compute", "planned")
    # The plan in units, the recording converted to the same units: one picture.
    recorded = [Span(s.rank, s.start / U, s.end / U, s.label, s.kind, s.lane, s.info)
                for s in trace_spans(synthetic())]
    tl = timeline_from_spans(planned + recorded, scale=1, unit="step", title="plan vs run")
    assert tl.data["lanes"] == ["planned", "compute", "comm"] and tl.data["unit"] == "step"
    plan_b = bars_of(tl, rank=0, lane="planned", label="B0")[0]
    run_b = bars_of(tl, rank=0, lane="compute", label="backward mb0")[0]
    assert (plan_b["x"], plan_b["w"]) == (run_b["x"], run_b["w"])  # the run kept to the plan
    assert plan_b["y"] < run_b["y"]
    assert plan_b["tip"]["duration"] == "4.000 step"
    with pytest.raises(ValueError, match="not in lanes"):
        timeline_from_spans(planned, lanes=["compute"])
    with pytest.raises(ValueError, match="rank, start, end, label, kind"):
        timeline_from_spans([(0, 0.0, 1.0)])


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="empty"):
        timeline(Trace([]))
    with pytest.raises(ValueError, match="end > start"):
        timeline(synthetic(), t_range=(5, 5))
    with pytest.raises(ValueError, match="nothing to draw"):
        timeline(synthetic(), ranks=[7])
    with pytest.raises(ValueError, match="no room"):
        timeline(synthetic(), width=200)
    with pytest.raises(ValueError, match="count must be"):
        busy_fraction(synthetic(), count="gpu")


def test_event_labels_and_byte_counts():
    assert event_label(TraceEvent(0, "send", peer=3)) == "send \u2192 r3"
    assert event_label(TraceEvent(0, "broadcast", peer=2, tags={"microbatch": 1})) == "broadcast from r2 mb1"
    assert event_label(TraceEvent(0, "compute", tags={"name": "fwd", "phase": "warmup"})) == "fwd warmup"
    assert event_label(TraceEvent(0, "all_to_all", tags={"bucket": 2}), tags=False) == "all-to-all"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(4096) == "4 KiB (4,096 B)"
    assert format_bytes(3 * 1024 ** 2) == "3 MiB (3,145,728 B)"


# --- overlap and idle time --------------------------------------------------------------------


def test_overlap_seconds_is_exact():
    t = synthetic()
    # bucket 0 [3, 7] meets backward [2, 6] for 3 units; bucket 1 [4, 5] lies inside it.
    assert overlap_seconds(t, 0, "backward") == 4 * U
    assert overlap_seconds(t, 0, "backward", op="all_reduce", group_kind="dp") == 4 * U
    assert overlap_seconds(t, 0, "backward", group_kind="tp") == 0.0
    assert overlap_seconds(t, 0, "forward") == 0.0
    assert overlap_seconds(t, 0, "optimizer") == 0.0  # [3, 7] ends where the optimizer starts
    assert overlap_seconds(t, 1, "backward", op=["send", "recv"]) == 0.0  # recv starts after it
    assert overlap_fraction(t, 0, "backward", op="all_reduce") == 4 / 5
    assert overlap_fraction(t, 1, "backward", op="all_reduce") == 0.0  # no such ops


def test_overlap_counts_nested_spans_of_one_name_once():
    t = Trace([ev(0, "compute", 0, 4, name="backward"), ev(0, "compute", 1, 2, name="backward"),
               ev(0, "compute", 6, 8, name="backward"), ev(0, "all_reduce", 3, 7, "dp")])
    assert overlap_seconds(t, 0, "backward") == 2 * U  # [3, 4] and [6, 7]


def test_busy_and_bubble_fractions():
    t = synthetic()  # window [0, 8]
    assert busy_fraction(t) == {0: 7 / 8, 1: 5 / 8}
    assert bubble_fraction(t) == {0: 1 / 8, 1: 3 / 8}
    assert busy_fraction(t, count="all") == {0: 1.0, 1: 6 / 8}
    assert busy_fraction(t, count="comm") == {0: 4 / 8, 1: 1 / 8}
    assert busy_fraction(t, ranks=[1], window="rank") == {1: 5 / 6}  # rank 1 ends at 6
    assert busy_fraction(t, ranks=[5]) == {5: 0.0}
    # A textbook pipeline bubble: 2 stages, 1 microbatch, forward then backward.
    pipe = Trace([ev(0, "compute", 0, 1, name="F"), ev(1, "compute", 1, 2, name="F"),
                  ev(1, "compute", 2, 4, name="B"), ev(0, "compute", 4, 6, name="B")])
    assert bubble_fraction(pipe) == {0: 0.5, 1: 0.5}


# --- the HTML -----------------------------------------------------------------------------------


def test_html_is_a_self_contained_player():
    tl = timeline(synthetic(), title="Buckets <overlap> backward")
    page = tl.to_html()
    assert re.search(r'<div class="tl-timeline tl-animation" id="tl-timeline-[0-9a-f]+" '
                     r'data-frame="0" data-frames="41"', page)
    for cls in ("tl-play", "tl-prev", "tl-next", "tl-slider", "tl-anim-caption", "tl-tooltip",
                "tl-zoom-reset", "tl-cursor", "tl-legend"):
        assert f'class="{cls}"' in page, cls
    assert page.count('class="tl-bar"') == len(synthetic())
    assert not re.search(r"https?://|src=|href=|require|import\(|@import", page)  # nothing fetched
    assert "Buckets &lt;overlap&gt; backward" in page and "<overlap>" not in page
    script = page.split("<script>")[1].split("</script>")[0]
    assert script.strip().startswith("(function () {") and script.strip().endswith("})();")
    assert script.isascii() and page.isascii()
    blob = re.search(r'<script type="application/json" class="tl-data">(.*?)</script>', page).group(1)
    payload = json.loads(blob)
    assert payload["captions"] == [f["caption"] for f in tl.data["frames"]]
    assert len(payload["tips"]) == len(tl.data["bars"])


def test_two_timelines_on_one_page_do_not_clash():
    tl = timeline(synthetic())
    a, b = tl.to_html(), tl.to_html()
    ids = re.findall(r'id="(tl-timeline-[0-9a-f]+)"', a + b)
    assert len(ids) == 2 and ids[0] != ids[1]
    for uid, page in zip(ids, (a, b)):
        # every id, CSS rule, clip path and script lookup of a copy is prefixed with its own id
        assert re.findall(r'\bid="([^"]+)"', page) == [uid, f"{uid}-clip"]
        assert f"url(#{uid}-clip)" in page
        assert f'boot("{uid}", startTimeline);' in page
        css = page.split("<style>")[1].split("</style>")[0]
        rules = [r.strip() for r in re.findall(r"([^{}]+)\{", css)]
        assert rules and all(r.startswith(f"#{uid}") for r in rules)


def test_script_cannot_be_closed_by_a_label():
    t = Trace([TraceEvent(0, "compute", t_start=0.0, t_end=1.0, tags={"name": "</script><b>x"})])
    page = timeline(t).to_html()
    assert page.count("</script>") == 2 and "<b>x" not in page  # the JSON island and the script


def test_without_the_player_there_is_no_animation_root():
    page = timeline(synthetic(), playable=False).to_html()
    assert 'class="tl-timeline"' in page and "tl-animation" not in page
    assert 'class="tl-play"' not in page and "data-frame=" not in page
    assert 'class="tl-ghost"' not in page  # no cursor, so nothing waits to be revealed


def test_save_writes_a_standalone_page(tmp_path):
    path = timeline(synthetic(), title="saved").save(str(tmp_path / "t.html"))
    text = open(path, encoding="utf-8").read()
    assert text.startswith("<!doctype html>") and "<title>saved</title>" in text
    assert "tl-timeline" in repr(timeline(synthetic())._repr_html_())
