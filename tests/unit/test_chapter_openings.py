"""For the instructor, exercises that teach: every chapter opens with 3 to
5 learning objectives ("you will be able to ..."), its prerequisites and the time it takes,
and asks at least two concept checks inside its text, each a question whose answer is
folded in the book (an ``{admonition}`` of class ``dropdown``, folded by
sphinx-togglebutton as the solution cells are) and comes before the takeaways."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tutorial_lib.chapters import CHAPTERS as MANIFEST
from tests.asserts import every

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHAPTERS = [entry.notebook for entry in MANIFEST]
OBJECTIVES = "**You will be able to**"
CHECK = re.compile(r"\*\*Concept check (\d+)\.(\d+)\.\*\* (?P<question>.+?)\n\n"
                   r":::\{admonition\} Answer\n:class: dropdown\n\n(?P<answer>.+?)\n:::",
                   re.S)


def markdown(name: str) -> list[str]:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


@pytest.mark.parametrize("name", CHAPTERS)
def test_the_chapter_opens_with_objectives_prerequisites_and_time(name):
    opening = markdown(name)[0]
    assert OBJECTIVES in opening, f"{name}: no '{OBJECTIVES}' block in its first cell"
    block = opening.split(OBJECTIVES, 1)[1].split("\n\n")[1]
    assert block.startswith("- "), block
    objectives = [" ".join(item.split()) for item in block[2:].split("\n- ")]
    assert 3 <= len(objectives) <= 5, objectives
    assert every(o[0].islower() and o.endswith((";", ".")) for o in objectives), objectives
    assert "**Prerequisites.**" in opening
    assert opening.index(OBJECTIVES) < opening.index("**Prerequisites.**") \
        < opening.index("**How long it takes")


@pytest.mark.parametrize("name", CHAPTERS)
def test_the_text_asks_two_concept_checks_with_folded_answers(name):
    cells = markdown(name)
    number = int(name[:2])
    takeaways = next(i for i, s in enumerate(cells) if "## Takeaways" in s)
    found = []
    for i, source in enumerate(cells):
        for match in CHECK.finditer(source):
            before_takeaways = i < takeaways or (
                i == takeaways and match.start() < source.index("## Takeaways"))
            assert before_takeaways, f"{name}: a concept check after the takeaways"
            assert int(match.group(1)) == number
            assert match.group("question").rstrip().endswith("?")
            assert len(match.group("answer").split()) >= 10
            found.append(int(match.group(2)))
    # every "Concept check" the text mentions is one of the folded ones
    mentions = sum(s.count("**Concept check") for s in cells)
    assert mentions == len(found) >= 2, (name, found)
    assert found == list(range(1, len(found) + 1)), found


def test_the_fold_is_the_admonition_the_book_folds():
    """A dropdown admonition is folded by sphinx-togglebutton, which _config.yml loads (the
    solution cells' `hide-cell` uses it too); colon fences need MyST's colon_fence."""
    config = (NOTEBOOKS.parent / "_config.yml").read_text()
    assert "sphinx_togglebutton" in config and "colon_fence" in config
