"""No checker hands out its answer key, for the checkers that launch gloo workers
(2.1, 2.2, 3.1, 3.3, 4.3, 7.1, 7.2): empty, constant and typical-mistake answers; no failing
case shows its reference answer, nothing reads "expected <value>", every hint is one of the
checker's (tests/answer_keys.py). The measuring launches of 2.2, 3.3 and 4.3 are cached, so
their answers share one launch each; a deadlocking answer is checked with a short launcher
timeout (answer_keys.DEADLOCK_TIMEOUT).

Hints stop at the text: each exercise failed five times in a row with wrong answers that
really run (on ranks for 2.1, 3.1, 7.1, 7.2), and no output shows the worked solution's code
or formula, nor a case's answer."""
from __future__ import annotations

import pytest

from ..answer_keys import (KEYS, assert_keeps_its_key, fail_five_times, key_params,
                           solution_pieces_of)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("key,label", key_params(launching=True))
def test_no_checker_shows_the_answer_to_an_unsolved_case(key, label):
    assert_keeps_its_key(key, label)


FIVE_TIMES = {
    "2.1": ("no_wrap",),  # a rank raises: the generic hint, whose stages run out
    "3.1": ("forgot_transpose",),  # every rank raises: the generic hint, in two stages
    "7.1": ("dtype_as_a_size",),  # a stage raises: the generic hint
    "7.2": ("parity_as_a_number",),  # the rule's raise, reported from the rank
}
"""The answers failed five times in a row, by exercise, when each check launches workers:
those that reach the generic hint (the staged one) through a rank's exception. The other
answers' hints (a single stage each) and deadlock reports are checked once above, and
every stage of every hint in tests/unit/test_exercises_answer_keys.py. 2.2, 3.3 and 4.3
measure once (cached): all their answers, five times each."""

SMALLEST_WORLD = {"2.1": ("ch02", "ALL_GATHER_CASES", [(2, 1)]),
                  "3.1": ("ch03", "ROW_PARALLEL_CASES", [(2, 1)]),
                  "7.1": ("ch07", "FIX_PIPELINES", (2,)),
                  "7.2": ("ch07", "ORDER_PIPELINES", (2,))}
"""Five launches, not fifteen: the answers above are failed five times on the smallest world
their checker runs (2 ranks; each case's count of failures in a row, which picks a hint's
stage, is per case), while the test above runs every world once."""


@pytest.mark.parametrize("key", [k for k in KEYS if k.launches], ids=lambda k: k.exercise)
def test_five_failures_in_a_row_never_reach_the_solution(key, monkeypatch):
    """The hints move to their last stage, and neither the details (what a rank raised,
    the values returned) nor the hints show a line or a formula of the worked solution, or
    a case's answer.  (The answers of 2.1, 3.1 and 7.1 end at the last stage of their
    generic hint.)"""
    import importlib
    if key.exercise in SMALLEST_WORLD:
        module, name, smallest = SMALLEST_WORLD[key.exercise]
        module = importlib.import_module(f"tutorial_lib.exercises.{module}")
        assert list(smallest)[0] == list(getattr(module, name))[0]  # the first world it runs
        monkeypatch.setattr(module, name, smallest)

    def still_keeps_its_key(label, fifth):
        assert_keeps_its_key(key, label, fifth)
        if key.exercise in ("2.1", "3.1", "7.1"):  # the generic hint, at its last stage
            assert fifth.hint == key.table.generic[-1], fifth.hint

    labels = FIVE_TIMES.get(key.exercise, tuple(key.answers))
    fail_five_times(key, labels, solution_pieces_of(key.exercise), then=still_keeps_its_key)
