"""Chapter 11's checkers name the classic mistakes (pure: no processes; the notebook's
exercise cells: tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import pytest

from tutorial_lib.exercises import ch11
from tutorial_lib.exercises.ch11 import check_idle_times, check_place_weights
from tutorial_lib.pipeline_parallel.actions import Action
from tutorial_lib.pipeline_parallel.schedules import one_f_one_b
from tutorial_lib.pipeline_parallel.zero_bubble import zb_h1
from tests.asserts import every



# --- exercise 11.1: place the W's --------------------------------------------------------------


def with_weights(place):
    """1F1B with W's placed by ``place(actions, i)``: the index to insert W i before."""
    def fn(pp, m, rank):
        out = list(one_f_one_b(pp, m, rank))
        for i in range(m):
            out.insert(place(out, i), Action("weight", i))
        return out
    return fn


def right_after(actions, i):
    return next(k for k, a in enumerate(actions) if a.kind == "backward" and a.microbatch == i) + 1


def test_zb_h1_passes_and_so_does_another_placement_with_its_bubble_and_memory():
    assert check_place_weights(zb_h1)

    def trailing_ws_reversed(pp, m, rank):  # the W's owed at the end, newest first
        out = list(zb_h1(pp, m, rank))
        last_b = max(k for k, a in enumerate(out) if a.kind == "backward")
        tail = [a for a in out[last_b + 1:] if a.kind == "weight"]
        rest = [a for a in out[last_b + 1:] if a.kind != "weight"]
        return out[:last_b + 1] + rest + tail[::-1]
    assert trailing_ws_reversed(4, 8, 3) != zb_h1(4, 8, 3)
    assert check_place_weights(trailing_ws_reversed)


def test_a_w_right_after_its_b_keeps_1f1bs_bubble():
    result = check_place_weights(with_weights(right_after))
    assert not result.passed and result.hint == ch11.HINT_RIGHT_AFTER[0]
    assert "as long as in 1F1B" in str(result)
    again = check_place_weights(with_weights(right_after))  # the same case fails again
    assert again.hint == ch11.HINT_RIGHT_AFTER[1]


def test_ws_saved_for_the_end_are_named():
    result = check_place_weights(with_weights(lambda actions, i: len(actions)))
    assert not result.passed and result.hint == ch11.HINT_HOARDING


def test_a_w_before_its_b_a_missing_w_and_a_changed_1f1b_are_named():
    before = check_place_weights(with_weights(lambda actions, i: 0))
    assert not before.passed and before.hint == ch11.HINT_W_BEFORE_B
    missing = check_place_weights(lambda pp, m, rank: one_f_one_b(pp, m, rank))
    assert not missing.passed and missing.hint == ch11.HINT_W_COUNT
    gpipe_like = check_place_weights(
        lambda pp, m, rank: [Action("forward", i) for i in range(m)]
        + [x for i in range(m) for x in (Action("backward", i), Action("weight", i))])
    assert not gpipe_like.passed and gpipe_like.hint == ch11.HINT_NOT_1F1B
    wrong_type = check_place_weights(lambda pp, m, rank: "F0 B0 W0")
    assert not wrong_type.passed and wrong_type.hint == ch11.HINT_PLACE_TYPE


# --- exercise 11.2: the idle times ---------------------------------------------------------------


def idle_times(pp, f, b, w, v_pp=None, v_costs=1.0, dual_stages=None, zb_w=2):
    v_pp = pp - 1 if v_pp is None else v_pp
    dual = pp // 2 - 1 if dual_stages is None else dual_stages
    h = 0.5 * v_costs
    return {"1f1b": (pp - 1) * (f + b), "zb-h1": (pp - 1) * (f + b - zb_w * w),
            "dualpipev": v_pp * (h * f + h * b + h * b - 3 * h * w),
            "dualpipe": dual * (f + b + b - 3 * w)}


def test_the_table_read_right_passes():
    assert check_idle_times(idle_times)
    assert every(ch11.simulated_idle_times(pp, f, b, w) == {
        k: v for k, v in idle_times(pp, f, b, w).items()} for pp, f, b, w in ch11.IDLE_CASES)


@pytest.mark.parametrize("mistake,fn", [
    ("v_ranks", lambda pp, f, b, w: idle_times(pp, f, b, w, v_pp=pp / 2 - 1)),
    ("v_halves", lambda pp, f, b, w: idle_times(pp, f, b, w, v_costs=2.0)),
    ("dual_stages", lambda pp, f, b, w: idle_times(pp, f, b, w, dual_stages=pp - 1)),
    ("zb", lambda pp, f, b, w: idle_times(pp, f, b, w, zb_w=0)),
])
def test_each_misreading_of_the_table_is_named(mistake, fn):
    result = check_idle_times(fn)
    assert not result.passed
    assert result.hint == ch11.IDLE_HINTS.hint_of(mistake)


def test_an_answer_that_is_no_dict_is_a_format_mistake():
    result = check_idle_times(lambda pp, f, b, w: 3)
    assert not result.passed and result.hint == ch11.HINT_IDLE_FORMAT
