"""Each chapter runs once per test session, and both nbval and the book build use that run.

The README's test command runs every chapter under nbval (the ``notebooks/`` items: one
kernel per chapter, cell by cell) and builds the whole book (``tests/book``'s ``book_html``),
which used to execute every chapter a second time: about three of the suite's minutes on two
cores. This plugin keeps what nbval's kernel answered for each cell (nbval stores it on the
item as ``test_outputs``). When every code cell of a chapter passed, :func:`executed_chapters`
returns that chapter with those outputs in its cells, and ``book_html`` builds the book from a
copy of the repository in which those chapters are already executed and excluded from
execution (myst-nb's ``exclude_patterns``); the build renders their outputs as they are.

A chapter is executed by the build as before when nbval did not run it in this session
(``pytest tests/book`` alone), when any of its cells failed or was skipped, or when it shows
something that depends on running inside the build (:data:`BUILD_DEPENDENT`: the book build
sets ``TUTORIAL_BOOK_BUILD=1`` and ``live_or_static`` then shows a static stand-in instead of
live ipywidgets, which nbval's kernel would have drawn). ``pyproject.toml`` lists
``notebooks`` before ``tests`` so that nbval runs first.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

BUILD_DEPENDENT = ("live_or_static(", "in_live_kernel(")
"""A chapter whose code contains one of these is always executed by the book build."""

_RECORD = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After nbval ran a cell, keep its verdict and its outputs (kept per notebook)."""
    outcome = yield
    if call.when != "call" or type(item).__name__ != "IPyNbCell":
        return
    report = outcome.get_result()
    notebook = Path(str(item.parent.fspath)).resolve()
    cells = item.config.stash.setdefault(_RECORD, {}).setdefault(notebook, {})
    cells[item.cell_num] = (report.passed, copy.deepcopy(item.test_outputs or []))


def executed_chapters(config) -> dict[Path, "nbformat.NotebookNode"]:
    """Every notebook nbval ran in full, cleanly, in this session, with its outputs filled in.

    Keys are the notebooks' resolved paths. A notebook with a failed, skipped or unrun code
    cell, or one that is :data:`BUILD_DEPENDENT`, is left out.
    """
    import nbformat

    executed = {}
    for path, cells in config.stash.get(_RECORD, {}).items():
        notebook = nbformat.read(path, as_version=4)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        if any(marker in cell.source for cell in code for marker in BUILD_DEPENDENT):
            continue
        if len(cells) != len(code) or not all(passed for passed, _ in cells.values()):
            continue
        for number, cell in enumerate(code):
            outputs = [nbformat.from_dict(dict(out)) for out in cells[number][1]]
            for out in outputs:
                if out.output_type == "execute_result":
                    out.execution_count = number + 1
            cell.outputs = outputs
            cell.execution_count = number + 1
        nbformat.validate(notebook)
        executed[path] = notebook
    return executed
