"""Chapter 3's row-parallel and step-bytes checkers name the classic mistakes: they launch
real gloo workers (2 and 4 ranks); the step's byte counts are measured once per session
(``measured_step_bytes`` is cached), so the many wrong formulas below cost no further
launches.  The pure checks: tests/unit/test_exercises_ch03.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import comm, parallel_state
from tutorial_lib.exercises import ch03, kit
from tutorial_lib.exercises.ch03 import (STEP_CASES, check_row_parallel_linear, check_step_bytes,
                                         measured_step_bytes, reference_step_bytes)
from tutorial_lib.tensor_parallel import reduce_from_tensor_model_parallel_region

from ..notebook_cells import assert_hint, hint_cases
from tests.asserts import every

pytestmark = pytest.mark.dist  # the checkers launch real gloo workers


# --- exercise 3.1: a row-parallel linear layer -----------------------------------------------


def _sum_over(group: str, backward_too: bool = False):
    """Sum the partial products over ``group`` in an autograd function whose backward is the
    identity, or (``backward_too``) all-reduces dY as well."""

    class SumOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            return comm.all_reduce(partial.clone(), group=group)

        @staticmethod
        def backward(ctx, grad):
            return comm.all_reduce(grad.clone(), group=group) if backward_too else grad

    return SumOver


_SumOverTP = _sum_over("tp")
_SumOverTPBothWays = _sum_over("tp", backward_too=True)  # the mistake: the backward all-reduces dY too
_SumOverWorld = _sum_over("world")  # adds the other replica too


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


@hint_cases([
    (row_bias_before, ch03.HINT_ROW_BIAS_BEFORE),
    (row_no_reduce, ch03.HINT_ROW_NO_REDUCE),
    (row_reduce_both_ways, ch03.HINT_ROW_BACKWARD_REDUCE),
    (row_world_group, ch03.HINT_ROW_WRONG_GROUP),
    (row_averaged, ch03.HINT_ROW_AVERAGED),
    (row_untracked_in_place, ch03.HINT_ROW_UNTRACKED),
    (row_detached, ch03.HINT_ROW_NO_GRAD),
    (row_wrong_shape, ch03.HINT_ROW_SHAPE),
])
def test_row_parallel_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_row_parallel_linear(wrong), hint)


def test_a_reduction_over_the_world_fails_only_beside_data_parallelism():
    result = check_row_parallel_linear(row_world_group)
    assert [c.passed for c in result.cases] == [dp == 1 for _, dp in ch03.ROW_PARALLEL_CASES]


def test_a_deadlock_becomes_a_case_not_a_hang():
    def only_rank_zero_reduces(x, weight, bias):
        if parallel_state.get_rank_in("tp") == 0:
            return _SumOverTP.apply(F.linear(x, weight)) + bias
        return F.linear(x, weight) + bias

    result = check_row_parallel_linear(only_rank_zero_reduces, timeout=1)
    assert not result.passed and len(result.cases) == 1
    # a verdict that depends on a timeout: run once more, at four times the limit
    assert result.cases[0].detail.startswith(
        f"deadlocked after 1 s, and again after {kit.RETRY_TIMEOUT_FACTOR:g} s: some rank"), \
        result.cases[0].detail
    assert result.hint


# --- exercise 3.3: the bytes of one step ------------------------------------------------------


def test_the_reference_formula_matches_every_traced_step():
    for configs in ch03._launch_groups():
        for cfg, measured in zip(configs, measured_step_bytes(configs)):
            want = reference_step_bytes(cfg)
            assert measured == pytest.approx(want, rel=1e-9), cfg
    assert check_step_bytes(reference_step_bytes)


@pytest.mark.parametrize("mistake", list(ch03.STEP_MISTAKES))
def test_each_step_bytes_mistake_gets_its_hint(mistake):
    part, switches = ch03.STEP_MISTAKES[mistake]
    result = check_step_bytes(lambda cfg: reference_step_bytes(cfg, **switches))
    assert not result.passed
    expected = ch03.STEP_HINTS.hint_of(mistake)
    assert result.hint == expected, result.hint


def test_two_mistakes_get_both_hints():
    result = check_step_bytes(lambda cfg: reference_step_bytes(cfg, backward=False, dp_unsharded=True))
    assert result.hints == [ch03.HINT_STEP_FORWARD_ONLY, ch03.HINT_STEP_DP_UNSHARDED]


def test_dividing_the_replicated_parameters_by_t_is_named():
    """Exercises that teach: counting every parameter of the block as split over TP got the generic
    hint. Megatron-Core 0.20.0 (d98e8a64), megatron/core/tensor_parallel/layers.py,
    RowParallelLinear.__init__: the bias has the full output size on every TP rank ("bias
    is not parallelized"), as do the LayerNorms; only the weights (and ColumnParallelLinear's
    bias, output_size_per_partition) are split. So a rank's DP all-reduce carries 6h whole
    values per block plus 1/T of the rest."""
    result = check_step_bytes(lambda cfg: reference_step_bytes(cfg, dp_replicated_split=True))
    assert result.hint == ch03.HINT_STEP_DP_REPLICATED_SPLIT, result.hint
    failed = [c for c in result.cases if not c.passed]
    assert failed and all(c.detail.endswith("the traced step sends other dp bytes") for c in failed)
    assert every(c.passed for c in result.cases if "T=1," in c.name)  # no TP: nothing to divide


@pytest.mark.parametrize("garbage", [3, None, {"tp": 1}, {"tp": "a lot", "dp": 0}, (1, 2)])
def test_step_bytes_checker_never_raises_on_garbage(garbage):
    result = check_step_bytes(lambda cfg: garbage)
    assert not result.passed and result.hint == ch03.HINT_STEP_FORMAT


def test_an_unknown_wrong_formula_gets_nudges_then_the_generic_hints():
    """Exercises that teach: staged hints; the generic hints are the whole formula."""
    wrong = lambda cfg: {k: v + 1 for k, v in reference_step_bytes(cfg).items()}  # noqa: E731
    assert check_step_bytes(wrong).hints == [ch03.HINT_STEP_TP_NUDGE, ch03.HINT_STEP_DP_NUDGE]
    assert check_step_bytes(wrong).hints == [ch03.HINT_STEP_TP_GENERIC, ch03.HINT_STEP_DP_GENERIC]


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
