"""Chapter 9's checkers: the reference passes, the stub and the classic mistakes get their hints
(all pure: no processes; the notebook's exercise cells: tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib import context_parallel as cp
from tutorial_lib.exercises import ch09
from tutorial_lib.exercises.kit import STUB_HINT
from tutorial_lib.exercises.ch09 import check_held_chunks, check_merge_partials, check_ring_pass_bytes

from ..notebook_cells import assert_hint, assert_staged_hint, raising


# --- 9.1 ---------------------------------------------------------------------------------------


def merge_the_other_way_round(out_a, lse_a, out_b, lse_b):
    """Right, written differently: weights from a softmax over the two lse values."""
    w = torch.softmax(torch.stack([lse_a, lse_b]), dim=0)
    return out_a * w[0].unsqueeze(-1) + out_b * w[1].unsqueeze(-1), torch.logaddexp(lse_a, lse_b)


def merge_overflowing(out_a, lse_a, out_b, lse_b):
    ea, eb = torch.exp(lse_a), torch.exp(lse_b)
    return ((out_a * ea.unsqueeze(-1) + out_b * eb.unsqueeze(-1)) / (ea + eb).unsqueeze(-1),
            torch.log(ea + eb))


def merge_nan_when_empty(out_a, lse_a, out_b, lse_b):
    top = torch.maximum(lse_a, lse_b)
    lse = top + torch.log(torch.exp(lse_a - top) + torch.exp(lse_b - top))
    wa = torch.exp(lse_a - lse_a) * torch.exp(lse_a - lse)  # lse_a - lse_a: -inf - -inf = NaN
    return out_a * wa.unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1), lse


def test_the_reference_and_an_equivalent_merge_pass():
    assert check_merge_partials(cp.merge_partials)
    assert check_merge_partials(merge_the_other_way_round)


@pytest.mark.parametrize("wrong,hint", [
    (lambda a, la, b, lb: ((a + b) / 2, torch.logaddexp(la, lb)), ch09.HINT_MERGE_AVERAGE),
    (lambda a, la, b, lb: (a + b, torch.logaddexp(la, lb)), ch09.HINT_MERGE_SUM),
    (lambda a, la, b, lb: (torch.where((la >= lb).unsqueeze(-1), a, b), torch.maximum(la, lb)),
     ch09.HINT_MERGE_MAX),
    (lambda a, la, b, lb: (cp.merge_partials(a, la, b, lb)[0], torch.maximum(la, lb)), ch09.HINT_MERGE_LSE),
    (lambda a, la, b, lb: (a * la.exp().unsqueeze(-1) + b * lb.exp().unsqueeze(-1), la + lb),
     ch09.HINT_MERGE_UNNORMALISED),
    (merge_overflowing, ch09.HINT_MERGE_OVERFLOW),
    (merge_nan_when_empty, ch09.HINT_MERGE_EMPTY),
    (lambda a, la, b, lb: a + b, ch09.HINT_MERGE_FORMAT),
])
def test_each_merge_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_merge_partials(wrong), hint)


def test_a_stub_or_a_crash_is_a_failed_case_not_a_crash():
    assert_hint(check_merge_partials(raising(NotImplementedError())), STUB_HINT)
    result = check_merge_partials(raising(ValueError("boom")))
    assert not result.passed and "ValueError: boom" in str(result)


def test_the_cases_are_what_they_say():
    """Every case's two parts merge (by the library's rule) to attention over all keys."""
    for name, parts, want, want_lse in ch09.merge_cases():
        out, lse = cp.merge_partials(*parts)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert any(parts[1].min() > 900 for _, parts, _, _ in ch09.merge_cases())
    assert any(torch.isinf(parts[1]).all() for _, parts, _, _ in ch09.merge_cases())


# --- 9.2 ---------------------------------------------------------------------------------------


def test_held_chunks_in_any_order_and_spelling_pass():
    assert check_held_chunks(lambda r, c: (2 * c - 1 - r, r))
    assert check_held_chunks(lambda r, c: torch.tensor([r, 2 * c - 1 - r]))


@pytest.mark.parametrize("wrong,hint", [
    (lambda r, c: [r], ch09.HINT_HELD_NAIVE),
    (lambda r, c: [r, r + c], ch09.HINT_HELD_STRIPED),
    (lambda r, c: [r, 2 * c - r], ch09.HINT_HELD_OFF_BY_ONE),
    (lambda r, c: [r, c - 1 - r], ch09.HINT_HELD_MIRROR_CP),
    (lambda r, c: "r and its mirror", ch09.HINT_HELD_FORMAT),
    (lambda r, c: [r, 0], ch09.HINT_HELD_NUDGE),
])
def test_each_held_chunks_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_held_chunks(wrong), hint)


def test_held_chunks_stub_gets_the_stub_hint():
    assert_hint(check_held_chunks(raising(NotImplementedError())), STUB_HINT)


# --- 9.3 ---------------------------------------------------------------------------------------


def ring_bytes(b, h, s, d, c, e):
    return (c - 1) * 2 * b * h * (s // c) * d * e


def test_the_ring_pass_formula_passes_and_is_the_traced_one():
    assert check_ring_pass_bytes(ring_bytes)
    # b=2, h=4, s=16, d=8, CP=4, fp32: three sends of K and V, 2 x (2 x 4 x 4 x 8) = 512 values
    assert ch09.reference_ring_pass_bytes(2, 4, 16, 8, 4, 4) == 3 * 512 * 4


@pytest.mark.parametrize("wrong,hint", [
    (lambda b, h, s, d, c, e: c * 2 * b * h * (s // c) * d * e, ch09.HINT_RING_STEPS),
    (lambda b, h, s, d, c, e: ring_bytes(b, h, s, d, c, e) / 2, ch09.HINT_RING_K_ONLY),
    (lambda b, h, s, d, c, e: (c - 1) * 2 * b * h * s * d * e, ch09.HINT_RING_WHOLE_SEQUENCE),
    (lambda b, h, s, d, c, e: 8 * ring_bytes(b, h, s, d, c, e), ch09.HINT_RING_BITS),
    (lambda b, h, s, d, c, e: 3 * (c - 1) * 2 * b * h * (s // c) * d * e, ch09.HINT_RING_BACKWARD),
    (lambda b, h, s, d, c, e: "a lot", ch09.HINT_RING_FORMAT),
    (lambda b, h, s, d, c, e: 12345, ch09.HINT_RING_NUDGE),
])
def test_each_ring_bytes_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_ring_pass_bytes(wrong), hint)


def test_the_formula_comes_only_when_the_same_cases_fail_again():
    """Exercises that teach: staged hints; the generic hints of 9.2 and 9.3 are the answer's formula."""
    assert_staged_hint(check_held_chunks, lambda r, c: [r, 0], ch09.HINT_HELD_NUDGE,
                       ch09.HINT_HELD_GENERIC)
    assert_staged_hint(check_ring_pass_bytes, lambda b, h, s, d, c, e: 12345,
                       ch09.HINT_RING_NUDGE, ch09.HINT_RING_GENERIC)
