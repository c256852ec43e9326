"""What the test session sets up before any process starts (tests/conftest.py)."""
import importlib.util
import os

import tutorial_lib.train_4d
from tests.conftest import BYTE_COMPILED, ROOT


def test_the_library_tests_and_examples_are_byte_compiled():
    """Every module of the library, the tests and the examples has a current ``.pyc``,
    written at session start even under ``PYTHONDONTWRITEBYTECODE``: workers, kernels and
    scripts load it instead of compiling the module again."""
    sources = [p for folder in BYTE_COMPILED for p in (ROOT / folder).rglob("*.py")]
    assert tutorial_lib.train_4d.__file__ in {str(p) for p in sources}
    stale = [str(p.relative_to(ROOT)) for p in sources
             if not os.path.exists(cached := importlib.util.cache_from_source(str(p)))
             or os.path.getmtime(cached) < os.path.getmtime(p)]
    assert stale == [], stale[:10]
