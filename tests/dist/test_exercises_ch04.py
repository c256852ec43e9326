"""Chapter 4's layer-bytes checker names the classic mistakes: it launches 4 gloo workers
once per session (``measured_layer_bytes`` is cached), so the wrong formulas below cost no
further launches.  The pure checks: tests/unit/test_exercises_ch04.py."""
from __future__ import annotations

import pytest

from tutorial_lib import costs
from tutorial_lib.exercises import ch04
from tutorial_lib.exercises.ch04 import check_layer_bytes_sent, reference_layer_bytes_sent

pytestmark = pytest.mark.dist  # the checker launches real gloo workers


# --- exercise 4.3: the bytes of one layer ------------------------------------------------------


def _right_bytes(counts, rank, hidden, num_experts, bytes_per_element):
    return reference_layer_bytes_sent(counts, rank, hidden, num_experts, bytes_per_element)


def test_the_reference_formula_matches_costs_and_the_trace():
    measured = ch04.measured_layer_bytes()
    for (name, routings), per_rank in zip(ch04.bytes_cases(), measured):
        counts = ch04.send_count_matrix(routings)
        for rank, traced in enumerate(per_rank):
            want = reference_layer_bytes_sent(counts, rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS)
            assert traced == want, (name, rank)
            # the same from costs: every all-to-all of the rank, minus the rows it keeps
            local = ch04.BYTES_EXPERTS // len(counts)
            from_costs = 0
            for op in costs.moe_rank_all_to_alls(counts, rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS, 4):
                row_bytes = local * 8 if op.payload == "counts" else ch04.BYTES_HIDDEN * 4
                from_costs += op.bytes - op.input_splits[rank] * row_bytes
            assert from_costs == want, (name, rank)
    assert check_layer_bytes_sent(_right_bytes)


@pytest.mark.parametrize("mistake", list(ch04.BYTES_MISTAKES))
def test_each_bytes_mistake_gets_its_hint(mistake):
    switches = ch04.BYTES_MISTAKES[mistake]
    result = check_layer_bytes_sent(
        lambda c, r, h, n, d: reference_layer_bytes_sent(c, r, h, n, d, **switches))
    assert not result.passed
    expected = ch04.BYTES_HINTS.hint_of(mistake)
    assert result.hint == expected, result.hint


@pytest.mark.parametrize("garbage", [None, "lots", [1, 2], {"tp": 1}])
def test_bytes_checker_never_raises_on_garbage(garbage):
    result = check_layer_bytes_sent(lambda *a: garbage)
    assert not result.passed and result.hint == ch04.HINT_BYTES_FORMAT


def test_an_unknown_wrong_formula_gets_a_nudge_then_the_generic_hint():
    wrong = lambda *a: _right_bytes(*a) + 1  # noqa: E731
    assert check_layer_bytes_sent(wrong).hint == ch04.HINT_BYTES_NUDGE
    assert check_layer_bytes_sent(wrong).hint == ch04.HINT_BYTES_GENERIC


@pytest.mark.parametrize("where", ["diagonal_rows", "diagonal_counts"])
def test_counting_the_diagonal_in_one_exchange_only_is_named(where):
    """Exercises that teach: counting what a rank hands itself in the token exchanges only (or in the
    counts exchange only) got the generic hint. torch.distributed.all_to_all_single (the
    dispatcher's all-to-all, torch 2.13) copies a rank's own split locally; on gloo the
    traced bytes leaving a rank exclude it (bytes_left_rank), so the diagonal is never on
    the wire, in either exchange."""
    result = check_layer_bytes_sent(
        lambda c, r, h, n, d: reference_layer_bytes_sent(c, r, h, n, d, **{where: True}))
    assert result.hint == ch04.HINT_BYTES_DIAGONAL, result.hint
    assert not any("trace says" in c.detail for c in result.cases)


def test_a_formula_that_raises_is_reported_per_case():
    def broken(counts, rank, hidden, num_experts, bytes_per_element):
        if sum(counts[rank]) == 0:
            raise ZeroDivisionError("no tokens")
        return _right_bytes(counts, rank, hidden, num_experts, bytes_per_element)

    result = check_layer_bytes_sent(broken)
    failed = [c for c in result.cases if not c.passed]
    assert len(failed) == 1 and "raised ZeroDivisionError" in failed[0].detail
    assert result.hint == ch04.HINT_BYTES_RAISED
