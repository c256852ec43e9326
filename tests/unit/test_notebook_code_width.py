"""Every line of code a chapter shows fits the book's column: at most 88 characters.

At 1440 px the built book's code column holds 89 characters of its monospace font (measured
in chromium: 786 px less 2 x 16 px padding, 8.43 px a character), so a longer line makes
the cell scroll sideways and hides its end.  A reading of the book found 146 of 269 code cells of
chapters 2-8 doing so (up to 171 characters); chapter 1 already kept to 88.  Every code
cell counts, the folded solutions and the exercise stubs included: a reader unfolds them.
(The browser test tests/book/test_reader.py checks the same on the built pages.)
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MAX_CHARS = 88
NOT_SHOWN = {"remove-input", "remove-cell"}  # tags whose code the book does not print


def long_lines(path: Path) -> list[str]:
    """``"cell N, line L: C chars: <start of the line>"`` for every shown line over the limit."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or NOT_SHOWN & set(cell.metadata.get("tags", [])):
            continue
        for number, line in enumerate(cell.source.splitlines(), 1):
            if len(line) > MAX_CHARS:
                out.append(f"cell {index}, line {number}: {len(line)} chars: {line[:60]}...")
    return out


@pytest.mark.parametrize("notebook", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_shown_code_lines_fit_the_column(notebook):
    found = long_lines(NOTEBOOKS / notebook)
    cells = len({line.split(",")[0] for line in found})
    assert not found, (f"{notebook}: {len(found)} code lines in {cells} cells are longer than "
                       f"{MAX_CHARS} characters:\n  " + "\n  ".join(found))


def test_the_check_sees_a_long_line(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1\n" + "y = " + "1 + " * 30 + "1"),
                nbformat.v4.new_code_cell("z = " + "2" * 200, metadata={"tags": ["remove-cell"]})]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    assert [line.split(":")[0] for line in long_lines(path)] == ["cell 0, line 2"]
