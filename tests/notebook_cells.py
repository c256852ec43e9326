"""Shared by the chapters' exercise tests: read a notebook's tagged cells and run them.

Every chapter's exercises follow one pattern (see CONTRIBUTING.md): a stub cell tagged
``exercise-stub`` defining a function whose body raises NotImplementedError, a cell tagged
``exercise-check`` that calls the checker on it, and a folded cell tagged ``solution``
that defines ``<name>_solution`` and asserts the checker passes.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def tagged_cells(notebook: Path, tag: str) -> list[str]:
    nb = nbformat.read(notebook, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def run_cell(notebook: Path, source: str, namespace: dict) -> dict:
    """Execute one cell's source with ``namespace`` standing in for the setup cell's imports."""
    namespace = dict(namespace)
    exec(compile(source, str(notebook), "exec"), namespace)
    return namespace


def exercise_tests(notebook: Path, exercises: list[tuple[str, object, str]], namespace: dict,
                   min_cases: int = 3):
    """The three tests every chapter's exercises must pass; assign them to module names.

    ``exercises`` lists, in notebook order, (function the stub defines, its checker,
    the solution's name).
    """

    def test_notebook_has_the_three_cells_of_each_exercise():
        stubs, checks = tagged_cells(notebook, "exercise-stub"), tagged_cells(notebook, "exercise-check")
        solutions = tagged_cells(notebook, "solution")
        assert len(stubs) == len(checks) == len(solutions) == len(exercises)
        for (name, checker, solution), stub, check, answer in zip(exercises, stubs, checks, solutions):
            assert f"def {name}(" in stub
            assert stub.rstrip().endswith("raise NotImplementedError")
            assert check.strip() == f"{checker.__name__}({name})"
            assert answer.rstrip().endswith(f"assert {checker.__name__}({solution})")

    @pytest.mark.parametrize("index", range(len(exercises)))
    def test_stub_fails_with_the_stub_hint(index):
        name, checker, _ = exercises[index]
        stub = run_cell(notebook, tagged_cells(notebook, "exercise-stub")[index], namespace)[name]
        result = checker(stub)  # must not raise
        assert not result.passed
        assert "NotImplementedError" in result.hint
        assert "Hint:" in str(result) and "NotImplementedError" in result._repr_html_()

    @pytest.mark.parametrize("index", range(len(exercises)))
    def test_solution_cell_passes(index):
        name, checker, solution = exercises[index]
        # the cell ends in `assert checker(solution)`: running it is the first check
        defined = run_cell(notebook, tagged_cells(notebook, "solution")[index], namespace)
        result = checker(defined[solution])
        assert result.passed, str(result)
        assert len(result.cases) >= min_cases and "PASS" in str(result)

    return (test_notebook_has_the_three_cells_of_each_exercise, test_stub_fails_with_the_stub_hint,
            test_solution_cell_passes)
