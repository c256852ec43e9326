"""Chapter 8's page structure: each takeaway in the Takeaways list, each exercise statement
free of stray list items (the last takeaway was written after exercise 8.1's
statement, where Markdown rendered it as part of the exercise)."""
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "08_fp8_communication.ipynb"


def _sections():
    """{heading: text} of every ``##``/``###`` section of the notebook's markdown."""
    sections, current = {}, None
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        if cell.cell_type != "markdown":
            current = None  # a code cell ends the statement of an exercise
            continue
        for line in cell.source.splitlines():
            if line.startswith(("## ", "### ")):
                current = line.lstrip("# ").strip()
                sections[current] = []
            elif current is not None:
                sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def test_every_takeaway_sits_in_the_takeaways_list():
    sections = _sections()
    takeaways = ("\n" + sections["Takeaways"]).split("\n- ")[1:]  # one item per bullet
    assert any("--precision-recipe" in t for t in takeaways)  # the one that had strayed
    assert any("128x1" in t for t in takeaways)  # the recipe card's takeaway
    for heading, text in sections.items():
        if heading.startswith("Exercise 8."):
            assert not [line for line in text.splitlines() if line.startswith("- ")], heading
