"""Chapter 3's gradient-groups checker names the wrong groups, and the step-bytes cases and
reference cover every knob; the launching checkers' tests are in
tests/dist/test_exercises_ch03.py."""
from __future__ import annotations

import dataclasses

import pytest

from tutorial_lib.exercises import ch03
from tutorial_lib.exercises.ch03 import (GRADIENT_CASES, STEP_CASES, check_gradient_groups,
                                         reference_step_bytes)

from ..answer_keys import GROUPS_KEY
from ..notebook_cells import answers_checker_tests, assert_reason


# --- exercise 3.2: which groups? ------------------------------------------------------------


def _answers(**changes):
    right = {name: set(groups) for name, groups in GROUPS_KEY.items()}
    right.update(changes)
    return lambda: right


def test_correct_groups_pass_in_any_spelling():
    assert check_gradient_groups(_answers())
    spelled = {name: "+".join(sorted(groups, reverse=True)) for name, groups in GROUPS_KEY.items()}
    assert check_gradient_groups(lambda: spelled)  # "tp+dp", "dp"
    assert check_gradient_groups(lambda: {name: list(g) for name, g in GROUPS_KEY.items()})


@pytest.mark.parametrize("case,answer,reason", [
    ("qkv_weight", {"tp", "dp"}, "different pieces of this weight"),
    ("fc2_weight", {"tp", "dp"}, "dY is the same full gradient on every TP rank"),
    ("embedding_weight", {"tp", "dp"}, "its own vocabulary range"),
    ("fc1_weight_sp", {"tp", "dp"}, "all-gathered before the matmul"),
    ("layernorm_weight", {"tp", "dp"}, "multiply the gradient by T"),
    ("fc2_bias", {"tp", "dp"}, "already identical"),
    ("layernorm_weight_sp", {"dp"}, "a partial sum"),
    ("fc2_bias_sp", {"dp"}, "after the reduce-scatter"),
    ("qkv_weight", set(), "drift apart"),
    ("layernorm_weight_sp", {"tp"}, "drift apart"),
    ("fc2_weight", {"world"}, "the world group mixes everything"),
    ("fc2_weight", {"pp", "dp"}, "no pipeline here"),
    ("fc2_weight", {"ep"}, "unknown group kind"),
])
def test_each_wrong_group_gets_its_reason(case, answer, reason):
    assert_reason(check_gradient_groups(_answers(**{case: answer})), case, reason)


test_groups_checker_never_raises_on_garbage, test_groups_checker_turns_an_exception_into_a_case = \
    answers_checker_tests(check_gradient_groups, [None, "dp", [1, 2], {"qkv_weight": 3}], KeyError("tp"))


# --- exercise 3.3: the bytes of one step ------------------------------------------------------


def test_the_cases_cover_every_knob():
    assert {c.tensor_parallel for c in STEP_CASES} >= {1, 2, 4}
    assert {c.data_parallel for c in STEP_CASES} >= {1, 2, 4}
    assert {c.sequence_parallel for c in STEP_CASES} == {False, True}
    assert {c.num_microbatches for c in STEP_CASES} >= {1, 2, 3}
    assert any(c.ffn_hidden_size != 4 * c.hidden_size for c in STEP_CASES)
    # every mistake changes the answer of at least one case
    for name, (part, switches) in ch03.STEP_MISTAKES.items():
        assert any(reference_step_bytes(c, **switches)[part] != reference_step_bytes(c)[part]
                   for c in STEP_CASES), name


def test_step_config_is_hashable_and_readable():
    cfg = dataclasses.replace(STEP_CASES[0], num_layers=3)
    assert hash(cfg) != hash(STEP_CASES[0])
    assert "L=3" in ch03._describe(cfg)


def test_every_wrong_group_is_explained_not_only_the_first():
    """Exercises that teach: 3.2 showed only ``hints[0]``; each wrong situation now gets its reason."""
    result = check_gradient_groups(_answers(qkv_weight={"tp", "dp"}, fc2_bias={"tp", "dp"},
                                            layernorm_weight_sp={"dp"}))
    assert sorted(h.split(":")[0] for h in result.hints) == sorted(
        ["qkv_weight", "fc2_bias", "layernorm_weight_sp"])
    assert "different pieces of this weight" in result.hint and "a partial sum" in result.hint
