"""No checker hands out its answer key, for the checkers that launch gloo workers
(2.1, 2.2, 3.1, 3.3, 4.3, 7.1, 7.2): empty, constant and typical-mistake answers; no failing
case shows its reference answer, nothing reads "expected <value>", every hint is one of the
checker's (tests/answer_keys.py). The measuring launches of 2.2, 3.3 and 4.3 are cached, so
their answers share one launch each."""
from __future__ import annotations

import pytest

from ..answer_keys import assert_keeps_its_key, key_params

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("key,label", key_params(launching=True))
def test_no_checker_shows_the_answer_to_an_unsolved_case(key, label):
    assert_keeps_its_key(key, label)
