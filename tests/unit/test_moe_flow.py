"""The MoE token-flow widget, drawn from synthetic traces: untagged all-to-alls, layers,
several EP groups, large counts and the refusals.

The same widget over all-to-alls that real gloo ranks recorded: tests/dist/test_moe_flow.py;
in chromium: tests/book/test_widgets.py.
"""
import html
import re

import pytest

from tutorial_lib.trace import Trace, TraceEvent
from tutorial_lib.viz.moe_flow import animate_token_flow, dispatch_matrix
from tests.asserts import every


def _transpose(m):
    return [list(r) for r in zip(*m)]


# --- synthetic traces ----------------------------------------------------------------------


def _event(rank, matrix, t, tags=None, ranks=None, kind="ep"):
    ranks = tuple(ranks or range(len(matrix)))
    p = ranks.index(rank)
    return TraceEvent(rank=rank, op="all_to_all", group_kind=kind, group_ranks=ranks,
                      t_start=t, t_end=t + 0.5, tags=dict(tags or {}),
                      splits={"input": list(matrix[p]), "output": [row[p] for row in matrix]})


def _synthetic(*matrices_and_tags, ranks=None):
    """One all-to-all call per (matrix, tags), on every rank, in order."""
    events = []
    for t, (matrix, tags) in enumerate(matrices_and_tags):
        for r in (ranks or range(len(matrix))):
            events.append(_event(r, matrix, float(t), tags, ranks))
    return Trace(events)


def _tags(op_name, phase="forward", **extra):
    return {"op_name": op_name, "phase": phase, "payload": "tokens", **extra}


def test_a_next_all_to_all_that_is_no_mirror_is_not_a_combine():
    a = [[1, 2], [3, 0]]
    trace = _synthetic((a, {}), ([[1, 1], [1, 1]], {}))
    anim = animate_token_flow(trace)
    assert anim.flow.combine is None and len(anim) == 2 + 3


def test_experts_per_rank_labels_the_receivers_when_the_trace_does_not_say():
    a = [[1, 2], [3, 0]]
    page = html.unescape(animate_token_flow(_synthetic((a, {})), experts_per_rank=3).to_html())
    assert "experts e0\u2013e2" in page and "experts e3\u2013e5" in page
    assert "experts e0" not in html.unescape(animate_token_flow(_synthetic((a, {}))).to_html())


def test_a_combine_that_is_no_mirror_is_refused():
    a = [[1, 2], [3, 0]]
    trace = _synthetic((a, _tags("dispatch")), ([[1, 1], [1, 1]], _tags("combine")))
    with pytest.raises(ValueError, match="not the mirror of the dispatch"):
        animate_token_flow(trace)


def test_backward_adds_the_two_recorded_all_to_alls():
    a = [[1, 2, 0], [3, 0, 0], [2, 2, 0]]
    t = _transpose(a)
    trace = _synthetic((a, _tags("dispatch")), (t, _tags("combine")),
                       (a, _tags("combine", "backward")), (t, _tags("dispatch", "backward")))
    assert len(animate_token_flow(trace)) == 2 * 3 + 3
    anim = animate_token_flow(trace, include_backward=True)
    assert len(anim) == 2 * 3 + 5
    assert [d["phase"] for d in anim.data[-3:]] == ["backward:combine", "backward:dispatch",
                                                    "totals"]
    assert anim.flow.backward == {"combine": a, "dispatch": t}
    assert "<circle" in anim.frames[-2]  # gradients are drawn round
    forward_only = _synthetic((a, _tags("dispatch")), (t, _tags("combine")))
    with pytest.raises(ValueError, match="include_backward=True, but the trace holds no backward"):
        animate_token_flow(forward_only, include_backward=True)
    with pytest.raises(ValueError, match="needs all-to-alls tagged"):
        animate_token_flow(_synthetic((a, {})), include_backward=True)


def test_layer_and_call_pick_one_dispatch():
    a, b = [[1, 2], [3, 0]], [[0, 4], [4, 1]]
    trace = _synthetic((a, _tags("dispatch", layer=0)), (_transpose(a), _tags("combine", layer=0)),
                       (b, _tags("dispatch", layer=1)), (_transpose(b), _tags("combine", layer=1)))
    assert animate_token_flow(trace).flow.dispatch == a
    assert animate_token_flow(trace, layer=1).flow.dispatch == b
    assert animate_token_flow(trace, call=1).flow.dispatch == b
    assert dispatch_matrix(trace, "dispatch", layer=1) == b
    assert "layer 1" in animate_token_flow(trace, layer=1).title
    with pytest.raises(ValueError, match=r"layer=2.*layer tags \['0', '1'\]"):
        animate_token_flow(trace, layer=2)


def test_ranks_picks_one_of_several_ep_groups():
    a, b = [[1, 2], [3, 0]], [[5, 0], [0, 5]]
    events = [_event(r, a, 0.0, _tags("dispatch"), (0, 1)) for r in (0, 1)]
    events += [_event(r, b, 0.0, _tags("dispatch"), (2, 3)) for r in (2, 3)]
    trace = Trace(events)
    assert animate_token_flow(trace).flow.ranks == [0, 1]
    anim = animate_token_flow(trace, ranks=[2, 3])
    assert anim.flow.ranks == [2, 3] and anim.data[1]["labels"] == ["r2 \u2192 r2: 5 copies"]
    with pytest.raises(ValueError, match=r"no all_to_all on ranks \[0, 3\]"):
        dispatch_matrix(trace, ranks=[0, 3])


def test_large_counts_draw_one_square_for_several_copies():
    a = [[300, 120], [80, 500]]
    anim = animate_token_flow(_synthetic((a, _tags("dispatch")), (_transpose(a), _tags("combine"))))
    assert anim.flow.scale == 7  # the busiest box, 620 copies, in at most 96 squares
    assert "one square = 7 copies" in anim.captions[0]
    assert anim.data[1]["labels"] == ["r0 \u2192 r0: 300 copies", "r0 \u2192 r1: 120 copies"]
    assert anim.frames[0].count("<rect") < 400


def test_per_expert_counts_from_tags_must_add_up():
    a = [[1, 2], [3, 0]]
    good = [dict(_tags("dispatch"), tokens_per_expert=[1, 0, 2, 0]),
            dict(_tags("dispatch"), tokens_per_expert=[2, 1, 0, 0])]
    trace = Trace([_event(r, a, 0.0, good[r]) for r in (0, 1)])
    anim = animate_token_flow(trace)
    assert anim.flow.experts_per_rank == 2 and anim.flow.per_local_expert(0) == [3, 1]
    bad = [dict(t, tokens_per_expert=[1, 0, 1, 0]) for t in good]
    with pytest.raises(ValueError, match="per-expert counts disagree with the token splits"):
        animate_token_flow(Trace([_event(r, a, 0.0, bad[r]) for r in (0, 1)]))


def test_the_phase_pills_are_buttons_to_each_phases_first_frame():
    """Found reading the book: chapter 4's phase pills looked like buttons and did nothing.  Each pill
    now carries the first frame of its phase, which moe_flow.js jumps to on a click
    (tests/book/test_widgets.py clicks one in chromium), and the squares are labelled
    as what they are: copies, one per (token, chosen expert)."""
    a = [[1, 2, 0], [3, 0, 0], [2, 2, 0]]
    t = _transpose(a)
    trace = _synthetic((a, _tags("dispatch")), (t, _tags("combine")),
                       (a, _tags("combine", "backward")), (t, _tags("dispatch", "backward")))
    anim = animate_token_flow(trace, include_backward=True)
    phases = [d["phase"].split(":")[0] for d in anim.data]
    first = {p: phases.index(p) for p in phases}
    assert first == {"start": 0, "dispatch": 1, "experts": 4, "combine": 5, "backward": 8,
                     "totals": 10}
    for frame in anim.frames:
        pills = re.findall(r'<g class="tl-moe-step" data-goto="(\d+)"[^>]*aria-label="go to '
                           r'(\w+)"', frame)
        assert [(name, int(goto)) for goto, name in pills] == list(first.items())
    page = anim.to_html()
    assert "startTokenFlow" in page and 'role="button"' in page
    assert every(label.endswith(("copies", "copy")) for d in anim.data for label in d["labels"])
