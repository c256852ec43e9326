"""Chapters are committed without outputs and follow the exercise conventions."""
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_solution_is_folded_and_every_stub_has_a_check(path):
    nb = nbformat.read(path, as_version=4)
    tags = [set(c.metadata.get("tags", [])) for c in nb.cells]
    for i, t in enumerate(tags):
        if "solution" in t:
            assert "hide-cell" in t, f"{path.name} cell {i}: solutions must be folded (hide-cell)"
    stubs = sum("exercise-stub" in t for t in tags)
    checks = sum("exercise-check" in t for t in tags)
    solutions = sum("solution" in t for t in tags)
    assert stubs >= 2 and stubs == checks == solutions, (path.name, stubs, checks, solutions)
