"""Pipeline schedules drawn by the timeline: forward / backward colours, chunk shades, short
labels on narrow bars, the bubble hatched, and a labels isend as a tick (pure: no process;
a real launch: tests/dist/test_timeline.py).
"""
import re

import pytest

from tutorial_lib.pipeline_parallel import build_schedules
from tutorial_lib.pipeline_parallel.formulas import expected_bubble
from tutorial_lib.pipeline_parallel.simulator import bubble_fraction, makespan, simulate
from tutorial_lib.trace import Trace
from tutorial_lib.viz import timeline as tlmod
from tutorial_lib.viz.timeline import timeline, timeline_from_spans

from .test_timeline import MS, bars_of, ev


# --- pipeline schedules: forward / backward colours, chunks, short labels, the bubble -----------
# Found reading the book: the pipeline figures drew forwards and backwards in one grey, dropped the label
# of every bar narrower than its text, did not say which chunk a block belongs to, did not
# mark the bubble, and drew each labels isend (posted before a forward, waited on at the end
# of the step) as a bar across the whole step, four rows of them on the first stage.


def _plan(schedule, pp, m, v=1):
    return simulate(build_schedules(schedule, pp, m, v), 1.0 / v, 2.0 / v)


def test_a_schedule_draws_forwards_and_backwards_apart_and_each_chunk_in_its_shade():
    tl = timeline_from_spans(tlmod.plan_spans(_plan("interleaved", 2, 2, 2)), scale=1,
                             unit="slot")
    colors = {(b["kind"], b["chunk"]): b["color"] for b in tl.data["bars"]}
    assert set(colors) == {("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)}
    assert colors["forward", 0] == tlmod.SCHEDULE_COLORS["forward"]
    assert colors["backward", 0] == tlmod.SCHEDULE_COLORS["backward"]
    assert len(set(colors.values())) == 4  # forward != backward, chunk 1 != chunk 0
    assert colors["forward", 1] == tlmod.darken(colors["forward", 0], tlmod.CHUNK_DARKEN)
    assert [text for _, _, text in tl.data["legend"]] == [
        "forward, chunk 0", "forward, chunk 1", "backward, chunk 0", "backward, chunk 1"]
    f = bars_of(tl, rank=0, label="F1.1")[0]  # chunk 1 of microbatch 1, as Action.label says
    assert f["kind"] == "forward" and f["tip"]["chunk"] == "1"
    one_chunk = timeline_from_spans(tlmod.plan_spans(_plan("1f1b", 2, 2)), scale=1)
    assert [text for _, _, text in one_chunk.data["legend"]] == ["forward", "backward"]


def test_a_bar_too_narrow_for_its_label_shows_the_microbatch():
    spans = [tlmod.schedule_span(0, 0.0, 0.008, "forward", 3, chunk=1),   # 8 ms of 600 ms
             tlmod.schedule_span(0, 0.1, 0.6, "backward", 3, chunk=1),
             tlmod.schedule_span(0, 0.008, 0.0085, "forward", 4)]         # too narrow for "4"
    tl = timeline_from_spans(spans, width=900)
    narrow, wide, tiny = (bars_of(tl, label=label)[0] for label in ("F3.1", "B3.1", "F4"))
    assert narrow["w"] < len("F3.1") * tlmod.CHAR_W + 8 and narrow["shown_label"] == "3"
    assert wide["shown_label"] == "B3.1" and tiny["shown_label"] == ""
    page = tl.to_html()
    assert 'data-label="F3.1" data-short="3"' in page  # the script switches on zoom
    assert re.search(r'class="tl-label"[^>]*>3</text>', page)
    assert "shortpad" in page


def test_the_bubble_is_marked_and_adds_up_to_the_simulated_idle_time():
    plan = _plan("1f1b", 4, 4)
    tl = timeline_from_spans(tlmod.plan_spans(plan), scale=1, unit="slot", bubble=True)
    idle = bars_of(tl, kind=tlmod.BUBBLE)
    span = makespan(plan)
    per_rank = {r: sum(b["end"] - b["start"] for b in idle if b["rank"] == r) for r in range(4)}
    for rank in range(4):
        assert per_rank[rank] == pytest.approx(span * bubble_fraction(plan, rank))
    assert sum(per_rank.values()) / (4 * span) == pytest.approx(expected_bubble(4, 4))
    assert per_rank[0] == pytest.approx(3 * 3.0)  # PP - 1 stages' forward + backward
    assert tl.data["legend"][-1][0] == tlmod.BUBBLE
    page = tl.to_html()
    uid = re.search(r'id="(tl-timeline-[0-9a-f]+)"', page).group(1)
    assert f'id="{uid}-hatch"' in page and f'fill="url(#{uid}-hatch)"' in page
    assert "repeating-linear-gradient" in page  # the legend's swatch
    caption = tl.data["frames"][1]["caption"]
    assert "idle (bubble)" in caption  # the player names it too
    assert not bars_of(timeline_from_spans(tlmod.plan_spans(plan), scale=1), kind="bubble")


def test_a_recorded_pipeline_step_is_drawn_as_its_schedule():
    """Rank 0 posts microbatch 0's labels, computes, and waits for the isend at the end."""
    trace = Trace([
        ev(0, "send", 0, 9, "pp", group=(0, 1), microbatch=0, p2p_op="send_labels"),
        ev(0, "compute", 0, 2, name="forward", microbatch=0, chunk=0),
        ev(0, "send", 2, 3, "pp", group=(0, 1), microbatch=0, p2p_op="send_forward"),
        ev(0, "compute", 6, 9, name="backward", microbatch=0, chunk=0),
        ev(1, "compute", 3, 4, name="forward", microbatch=0, chunk=0),
        ev(1, "compute", 4, 6, name="backward", microbatch=0, chunk=0),
    ])
    plain = timeline(trace)
    assert bars_of(plain, rank=0, kind="pp")[0]["end"] == 9 * MS  # the old picture
    tl = timeline(trace, pipeline=True)
    labels, activation = bars_of(tl, rank=0, kind="pp")
    assert (labels["start"], labels["end"]) == (0.0, 0.0)  # a tick where it was posted
    assert f"{9 * MS:.3f} ms after it was posted" in labels["tip"]["waited on"]
    assert activation["end"] == 3 * MS  # waited on at once: drawn as it ran
    assert [b["label"] for b in bars_of(tl, rank=0, lane="compute") if b["label"]] == ["F0", "B0"]
    assert {b["kind"] for b in tl.data["bars"]} == {"forward", "backward", "pp", "bubble"}
    idle = {(b["rank"], b["start"], b["end"]) for b in bars_of(tl, kind="bubble")}
    assert idle == {(0, 2 * MS, 6 * MS), (1, 0.0, 3 * MS), (1, 6 * MS, 9 * MS)}
    assert tl.title.startswith("Timeline of ranks [0, 1]: 2 communication ops, 4 compute")
    assert tl.note.startswith("Forwards blue, backwards orange; each rank's idle time (the "
                              "bubble) hatched; a send posted before a compute and waited on")
    assert plain.note.startswith("A bar runs from when the op was issued")


# --- chapter 11: W's, overlapped pairs, chunks named by direction -------------------------------


def test_a_split_schedule_draws_its_ws_green_and_its_pairs_outlined():
    plan = simulate(build_schedules("dualpipev", 2, 4))
    spans = tlmod.plan_spans(plan)
    tl = timeline_from_spans(spans, scale=1, unit="F")
    weights = [b for b in tl.data["bars"] if b["kind"] == "weight"]
    assert weights and {b["color"] for b in weights if not b["chunk"]} == {
        tlmod.SCHEDULE_COLORS["weight"]}
    pairs = [b for b in tl.data["bars"] if b["outline"]]
    want = sum(1 for ts in plan.values() for t in ts if t.action.overlapped)
    assert want and len(pairs) == want  # every half of every F&B pair, and nothing else
    html = tl.to_html()
    assert html.count(f'stroke="{tlmod.PAIR_EDGE}" stroke-width="1.8"') == want
    legend = [text for _, _, text in tl.data["legend"]]
    assert "forward, down" in legend and "weight, up" in legend
    assert "outlined: an overlapped F&B pair" in legend
    split_b = [s for s in spans if s.kind == "backward" and "computes" in s.info]
    assert split_b and all(s.info["computes"] == tlmod.PART_NAMES["input"] for s in split_b)


def test_dualpipe_names_its_chunks_by_copy_and_direction():
    spans = tlmod.plan_spans(simulate(build_schedules("dualpipe", 2, 4)))
    assert {s.chunk_name for s in spans} == {"down (copy 0)", "up (copy 1)"}
    assert {s.chunk_name for s in tlmod.plan_spans(_plan("interleaved", 2, 2, 2))} == {""}


def _recorded(actions_by_rank):
    """A trace whose compute spans are the lists' computes, one slot each, as the
    executor records them (named by kind, tagged microbatch and chunk)."""
    events = []
    for rank, actions in actions_by_rank.items():
        for k, a in enumerate(x for x in actions if x.is_compute):
            events.append(ev(rank, "compute", k, k + 1, name=a.kind, microbatch=a.microbatch,
                             chunk=a.chunk))
    return Trace(events)


def test_a_recorded_step_takes_its_pairs_from_its_schedule_and_must_follow_it():
    lists = build_schedules("dualpipe", 2, 4)
    spans = tlmod.pipeline_spans(_recorded(lists), schedules=lists)
    outlined = [(s.rank, s.label) for s in spans if s.outline]
    want = [(r, a.label) for r, acts in lists.items() for a in acts if a.overlapped]
    assert sorted(outlined) == sorted(want) and want
    swapped = dict(lists)
    computes = [a for a in lists[1] if a.is_compute]
    i = next(k for k, a in enumerate(computes) if a.kind == "weight")
    swapped[1] = computes[:i - 1] + [computes[i], computes[i - 1]] + computes[i + 1:]
    with pytest.raises(ValueError, match="rank 1 recorded"):
        tlmod.pipeline_spans(_recorded(swapped), schedules=lists)
