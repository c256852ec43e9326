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


def test_an_unknown_wrong_formula_gets_the_generic_hint():
    result = check_layer_bytes_sent(lambda *a: _right_bytes(*a) + 1)
    assert result.hint == ch04.HINT_BYTES_GENERIC


def test_a_formula_that_raises_is_reported_per_case():
    def broken(counts, rank, hidden, num_experts, bytes_per_element):
        if sum(counts[rank]) == 0:
            raise ZeroDivisionError("no tokens")
        return _right_bytes(counts, rank, hidden, num_experts, bytes_per_element)

    result = check_layer_bytes_sent(broken)
    failed = [c for c in result.cases if not c.passed]
    assert len(failed) == 1 and "raised ZeroDivisionError" in failed[0].detail
    assert result.hint == ch04.HINT_BYTES_RAISED
