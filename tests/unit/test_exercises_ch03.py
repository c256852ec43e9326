"""Chapter 3's exercises: the notebook's stubs fail with a hint, its solutions pass, and
the checkers name the classic mistakes.

The row-parallel and step-bytes checkers launch real gloo workers (2 and 4 ranks); the
step's byte counts are measured once per session (``measured_step_bytes`` is cached), so
the many wrong formulas below cost no further launches.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import comm, parallel_state
from tutorial_lib.exercises import ch03
from tutorial_lib.exercises.ch03 import (GRADIENT_CASES, STEP_CASES, StepConfig, check_gradient_groups,
                                         check_row_parallel_linear, check_step_bytes,
                                         measured_step_bytes, reference_step_bytes)
from tutorial_lib.tensor_parallel import reduce_from_tensor_model_parallel_region

from ..notebook_cells import NOTEBOOKS, exercise_tests

pytestmark = pytest.mark.dist  # the checkers launch real gloo workers

NOTEBOOK = NOTEBOOKS / "03_tp_dp.ipynb"

#: The exercises in notebook order: (function the stub defines, its checker, solution name).
EXERCISES = [
    ("row_parallel_linear", check_row_parallel_linear, "row_parallel_linear_solution"),
    ("gradient_groups", check_gradient_groups, "gradient_groups_solution"),
    ("step_bytes", check_step_bytes, "step_bytes_solution"),
]

(test_notebook_has_the_three_cells_of_each_exercise, test_stub_fails_with_the_stub_hint,
 test_solution_cell_passes) = exercise_tests(
    NOTEBOOK, EXERCISES, {"torch": torch, "F": F, "comm": comm, "GRADIENT_CASES": GRADIENT_CASES,
                          "StepConfig": StepConfig,
                          "check_row_parallel_linear": check_row_parallel_linear,
                          "check_gradient_groups": check_gradient_groups,
                          "check_step_bytes": check_step_bytes})


# --- exercise 3.1: a row-parallel linear layer -----------------------------------------------


class _SumOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        return comm.all_reduce(partial.clone(), group="tp")

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SumOverTPBothWays(torch.autograd.Function):
    """The mistake: the backward all-reduces dY too."""

    @staticmethod
    def forward(ctx, partial):
        return comm.all_reduce(partial.clone(), group="tp")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.clone(), group="tp")


class _SumOverWorld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        return comm.all_reduce(partial.clone())  # group "world": adds the other replica too

    @staticmethod
    def backward(ctx, grad):
        return grad


def row_correct(x, weight, bias):
    return _SumOverTP.apply(F.linear(x, weight)) + bias


def row_with_library_pair(x, weight, bias):
    return reduce_from_tensor_model_parallel_region(F.linear(x, weight)) + bias


def row_bias_before(x, weight, bias):
    return _SumOverTP.apply(F.linear(x, weight, bias))


def row_no_reduce(x, weight, bias):
    return F.linear(x, weight) + bias


def row_reduce_both_ways(x, weight, bias):
    return _SumOverTPBothWays.apply(F.linear(x, weight)) + bias


def row_world_group(x, weight, bias):
    return _SumOverWorld.apply(F.linear(x, weight)) + bias


def row_averaged(x, weight, bias):
    return _SumOverTP.apply(F.linear(x, weight)) / parallel_state.get_size("tp") + bias


def row_untracked_in_place(x, weight, bias):
    partial = F.linear(x, weight)
    comm.all_reduce(partial, group="tp")  # autograd never hears of it
    return partial + bias


def row_detached(x, weight, bias):
    return _SumOverTP.apply(F.linear(x, weight).detach()) + bias


def row_wrong_shape(x, weight, bias):
    return row_correct(x, weight, bias)[..., :1]


@pytest.mark.parametrize("answer", [row_correct, row_with_library_pair], ids=lambda f: f.__name__)
def test_correct_row_parallel_layers_pass(answer):
    result = check_row_parallel_linear(answer)
    assert result.passed, str(result)
    assert len(result.cases) == len(ch03.ROW_PARALLEL_CASES)


@pytest.mark.parametrize("wrong,hint", [
    (row_bias_before, ch03.HINT_ROW_BIAS_BEFORE),
    (row_no_reduce, ch03.HINT_ROW_NO_REDUCE),
    (row_reduce_both_ways, ch03.HINT_ROW_BACKWARD_REDUCE),
    (row_world_group, ch03.HINT_ROW_WRONG_GROUP),
    (row_averaged, ch03.HINT_ROW_AVERAGED),
    (row_untracked_in_place, ch03.HINT_ROW_UNTRACKED),
    (row_detached, ch03.HINT_ROW_NO_GRAD),
    (row_wrong_shape, ch03.HINT_ROW_SHAPE),
], ids=lambda value: getattr(value, "__name__", "hint"))
def test_row_parallel_mistake_gets_its_hint(wrong, hint):
    result = check_row_parallel_linear(wrong)
    assert not result.passed
    assert result.hint == hint, str(result)
    assert hint in str(result)


def test_a_reduction_over_the_world_fails_only_beside_data_parallelism():
    result = check_row_parallel_linear(row_world_group)
    assert [c.passed for c in result.cases] == [dp == 1 for _, dp in ch03.ROW_PARALLEL_CASES]


def test_a_deadlock_becomes_a_case_not_a_hang():
    def only_rank_zero_reduces(x, weight, bias):
        if parallel_state.get_rank_in("tp") == 0:
            return _SumOverTP.apply(F.linear(x, weight)) + bias
        return F.linear(x, weight) + bias

    result = check_row_parallel_linear(only_rank_zero_reduces, timeout=3)
    assert not result.passed and len(result.cases) == 1
    assert "deadlocked" in result.cases[0].detail and result.hint


# --- exercise 3.2: which groups? ------------------------------------------------------------


def _answers(**changes):
    right = {name: set(groups) for name, (_, groups) in GRADIENT_CASES.items()}
    right.update(changes)
    return lambda: right


def test_correct_groups_pass_in_any_spelling():
    assert check_gradient_groups(_answers())
    spelled = {name: "+".join(sorted(groups, reverse=True)) for name, (_, groups) in GRADIENT_CASES.items()}
    assert check_gradient_groups(lambda: spelled)  # "tp+dp", "dp"
    assert check_gradient_groups(lambda: {name: list(g) for name, (_, g) in GRADIENT_CASES.items()})


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
    result = check_gradient_groups(_answers(**{case: answer}))
    assert not result.passed
    assert [c.name for c in result.cases if not c.passed] == [case]
    assert result.hint.startswith(f"{case}: ") and reason in result.hint, result.hint


@pytest.mark.parametrize("garbage", [None, "dp", [1, 2], {"qkv_weight": 3}])
def test_groups_checker_never_raises_on_garbage(garbage):
    result = check_gradient_groups(lambda: garbage)
    assert not result.passed and result.hint


def test_groups_checker_turns_an_exception_into_a_case():
    def broken():
        raise KeyError("tp")

    result = check_gradient_groups(broken)
    assert not result.passed and "raised KeyError" in result.cases[0].detail


# --- exercise 3.3: the bytes of one step ------------------------------------------------------


def test_the_reference_formula_matches_every_traced_step():
    for configs in ch03._launch_groups():
        for cfg, measured in zip(configs, measured_step_bytes(configs)):
            want = reference_step_bytes(cfg)
            assert measured == pytest.approx(want, rel=1e-9), cfg
    assert check_step_bytes(reference_step_bytes)


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


@pytest.mark.parametrize("mistake", list(ch03.STEP_MISTAKES))
def test_each_step_bytes_mistake_gets_its_hint(mistake):
    part, switches = ch03.STEP_MISTAKES[mistake]
    result = check_step_bytes(lambda cfg: reference_step_bytes(cfg, **switches))
    assert not result.passed
    expected = dict((name, hint) for hint, name in ch03._STEP_HINTS)[mistake]
    assert result.hint == expected, result.hint


def test_two_mistakes_get_both_hints():
    result = check_step_bytes(lambda cfg: reference_step_bytes(cfg, backward=False, dp_unsharded=True))
    assert result.hint == f"{ch03.HINT_STEP_FORWARD_ONLY} Also, {ch03.HINT_STEP_DP_UNSHARDED}"


@pytest.mark.parametrize("garbage", [3, None, {"tp": 1}, {"tp": "a lot", "dp": 0}, (1, 2)])
def test_step_bytes_checker_never_raises_on_garbage(garbage):
    result = check_step_bytes(lambda cfg: garbage)
    assert not result.passed and result.hint == ch03.HINT_STEP_FORMAT


def test_an_unknown_wrong_formula_gets_the_generic_hints():
    result = check_step_bytes(lambda cfg: {k: v + 1 for k, v in reference_step_bytes(cfg).items()})
    assert result.hint == f"{ch03.HINT_STEP_TP_GENERIC} Also, {ch03.HINT_STEP_DP_GENERIC}"


def test_a_formula_that_raises_is_reported_per_case():
    def broken(cfg):
        if cfg.sequence_parallel:
            raise ZeroDivisionError("oops")
        return reference_step_bytes(cfg)

    result = check_step_bytes(broken)
    failed = [c for c in result.cases if not c.passed]
    assert failed and all("raised ZeroDivisionError" in c.detail for c in failed)
    assert len(failed) == sum(c.sequence_parallel for c in STEP_CASES)
    assert result.hint == ch03.HINT_STEP_RAISED


def test_step_config_is_hashable_and_readable():
    cfg = dataclasses.replace(STEP_CASES[0], num_layers=3)
    assert hash(cfg) != hash(STEP_CASES[0])
    assert "L=3" in ch03._describe(cfg)
