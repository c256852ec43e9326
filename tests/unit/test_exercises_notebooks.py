"""Every chapter's exercise cells: three per exercise, the stubs fail with the stub hint and
the solutions pass, for the checkers that start no process (the others: tests/dist)."""
from __future__ import annotations

from ..notebook_cells import exercise_cell_tests

(test_notebook_has_the_three_cells_of_each_exercise, test_stub_fails_with_the_stub_hint,
 test_solution_cell_passes) = exercise_cell_tests(launching=False)
