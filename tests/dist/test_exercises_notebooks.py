"""The exercise stubs and solutions whose checkers launch gloo workers: each stub fails with
the stub hint, each solution passes (the cells themselves: tests/unit)."""
from __future__ import annotations

import pytest

from ..notebook_cells import exercise_cell_tests

pytestmark = pytest.mark.dist

test_stub_fails_with_the_stub_hint, test_solution_cell_passes = exercise_cell_tests(launching=True)
