"""How the README's test command splits the suite between its two pytest-xdist workers.

``pyproject.toml`` runs the suite in two worker processes (``-n 2 --dist loadgroup``): the
multi-process tests wait on their workers, a browser or a kernel for about a third of their
time, which the other worker's tests fill. pytest-xdist hands a worker one *group* at a
time (the ``xdist_group`` mark); this plugin marks every test before xdist reads the marks:

* each test file is a group, as ``--dist loadfile`` would make it: the tests of a file
  share module fixtures and launches (``tests/dist/launch_once.py``) in one process;
* every chapter (nbval's cells must run in order in one kernel) and the book's tests are
  one group, ``book``: the book build reuses the outputs nbval's kernels produced in the
  same process (``tests/executed_chapters.py``), so the chapters run before the build in
  one worker, in the collection's order (``notebooks`` before ``tests``).

Without ``-n`` (``python -m pytest -p no:xdist`` or ``-n 0``) the marks change nothing.
"""
from __future__ import annotations

import pytest

BOOK_GROUP = "book"
"""The chapters and the book's tests, run by one worker."""


def group_of(path: str) -> str:
    """The group of the test file ``path`` (relative to the repository, ``/``-separated)."""
    if path.startswith(("notebooks/", "tests/book/")):
        return BOOK_GROUP
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist adds each mark's group to the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid.split("::")[0])))
