"""Issue 14: no checker hands out its answer key. Every exercise whose checker starts no
process, fed empty, constant and typical-mistake answers: no failing case shows its
reference answer, nothing reads "expected <value>", and every hint is one of the checker's
fixed hints (tests/answer_keys.py; the checkers that launch workers: tests/dist). The
answers-per-situation checkers build a reason for each wrong answer: every reason of every
wrong choice, at every stage, is checked not to name the right one."""
from __future__ import annotations

import pytest

from ..answer_keys import (assert_keeps_its_key, collective_whys, domain_whys, group_whys,
                           key_params, why_names_the_answer)
from tests.asserts import every


@pytest.mark.parametrize("key,label", key_params(launching=False))
def test_no_checker_shows_the_answer_to_an_unsolved_case(key, label):
    assert_keeps_its_key(key, label)


@pytest.mark.parametrize("whys", [collective_whys, group_whys, domain_whys],
                         ids=["2.3", "3.2", "4.2"])
def test_no_reason_for_a_wrong_choice_names_the_right_one(whys):
    """2.3 said "a reduce-scatter delivers it at half the cost" to the student who chose an
    all-reduce, 3.2 "Name the groups: here ['dp']", 4.2 "divide by DP = 8"."""
    leaks = [(case, given, named) for case, given, why, answer in whys()
             if (named := why_names_the_answer(why, answer))]
    assert not leaks, leaks[:5]


def test_every_exercise_of_every_chapter_has_an_answer_key():
    """The leak test covers every exercise: one key per exercise the chapters hold (read from
    their cell tags, so a new exercise without a key fails here), each with at least two
    wrong answers to try. The keys of the predict-then-run exercises live beside their
    worked answers, in tests/unit/test_exercises_predictions.py."""
    import nbformat

    from tutorial_lib import classroom
    from tutorial_lib.chapters import notebook_paths

    from ..answer_keys import KEYS as CHECKER_KEYS
    from .test_exercises_predictions import KEYS as PREDICTION_KEYS

    def number(key):
        return tuple(int(part) for part in key.exercise.split("."))

    KEYS = sorted(CHECKER_KEYS + PREDICTION_KEYS, key=number)
    numbers = [ex.number for path in notebook_paths()
               for ex in classroom.chapter_exercises(nbformat.read(path, as_version=4))]
    assert [key.exercise for key in KEYS] == numbers
    assert every(len(key.answers) >= 2 for key in KEYS), [k.exercise for k in KEYS if len(k.answers) < 2]
