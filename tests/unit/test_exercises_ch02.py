"""Chapter 2's collective-choice checker names the wrong choices; the launching checkers'
tests are in tests/dist/test_exercises_ch02.py."""
from __future__ import annotations

import pytest

from tutorial_lib.exercises import ch02
from tutorial_lib.exercises.ch02 import SCENARIOS, check_choose_collectives

from ..answer_keys import COLLECTIVE_KEY
from ..notebook_cells import answers_checker_tests, assert_reason


def test_receive_first_hint_says_nobody_sends():
    assert "every rank receives first, so nobody sends" in ch02.HINT_ALL_RECV_FIRST


# --- exercise 2.3: which collective --------------------------------------------------------------


ANSWERS = dict(COLLECTIVE_KEY)


def test_every_spelling_of_an_op_is_accepted():
    spelled = {name: op.replace("_", "-").upper() for name, op in ANSWERS.items()}
    assert check_choose_collectives(lambda: spelled)
    assert ch02.normalize_op("AllToAll") == "all_to_all"
    assert ch02.normalize_op("send/recv") == "send"
    assert ch02.normalize_op("gather") is None


@pytest.mark.parametrize("situation,wrong,phrase", [
    ("zero_gradients", "all_reduce", "twice the bytes"),
    ("zero_parameters", "all_reduce", "nothing to add"),
    ("moe_dispatch", "all_gather", "N times the traffic"),
    ("tp_row_parallel_output", "all_gather", "concatenates"),
    # the backward all-reduce of a TP block is the column-parallel layer's dX
    ("tp_column_parallel_input_grad", "reduce_scatter", "whole on every TP rank"),
    ("tp_column_parallel_input_grad", "all_gather", "must be added"),
    ("pipeline_activations", "broadcast", "only the next stage"),
])
def test_a_wrong_choice_gets_its_reason(situation, wrong, phrase):
    """The column-parallel case follows NVIDIA/Megatron-LM, Megatron-Core 0.20.0
    (d98e8a64), megatron/core/tensor_parallel/mappings.py: the backward of
    ``_CopyToModelParallelRegion``, through which ColumnParallelLinear's input enters,
    all-reduces the input gradient over the TP group."""
    answers = {**ANSWERS, situation: wrong}
    assert_reason(check_choose_collectives(lambda: answers), situation, phrase)


def test_a_missing_situation_and_an_unknown_name_get_the_format_hint():
    partial = dict(ANSWERS)
    del partial["moe_dispatch"]
    result = check_choose_collectives(lambda: partial)
    assert not result.passed and result.hint == ch02.HINT_CHOOSE_FORMAT
    assert "missing from the dict" in str(result)
    result = check_choose_collectives(lambda: {**ANSWERS, "dp_gradients": "allsum"})
    assert result.hint == ch02.HINT_CHOOSE_FORMAT


test_choose_collectives_never_raises_on_garbage, test_choose_collectives_turns_an_exception_into_a_case = \
    answers_checker_tests(check_choose_collectives, [None, "all_reduce", ["all_reduce"], 42],
                          KeyError("moe_dispatch"))


def test_every_wrong_choice_is_explained_not_only_the_first():
    """Exercises that teach: 2.3 showed only ``hints[0]`` although its text says every wrong choice is
    explained. Two wrong situations: two hints, one per situation, in the situations' order."""
    answers = {**ANSWERS, "zero_gradients": "all_reduce", "moe_dispatch": "all_gather"}
    result = check_choose_collectives(lambda: answers)
    assert [h.split(":")[0] for h in result.hints] == [
        s for s in SCENARIOS if s in ("zero_gradients", "moe_dispatch")]
    assert "twice the bytes" in result.hint and "N times the traffic" in result.hint
