"""Write one cheat sheet per chapter: a standalone HTML page for slides and handouts.

    python scripts/cheat_sheets.py                    # -> _build/html/cheatsheets/
    python scripts/cheat_sheets.py --out DIR [01 05]  # some chapters, elsewhere

Each sheet (``NN_name.html``) holds the chapter's title, its "You will be able to" list and
its takeaways, read from the notebook, and its key table, computed by
``tutorial_lib.viz.cheatsheet``; ``index.html`` links them. ``scripts/build_book.sh`` runs
this after the build, so the sheets sit beside the chapters in the built book.
"""
from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tutorial_lib.chapters import CHAPTERS  # noqa: E402
from tutorial_lib.viz.cheatsheet import cheat_sheet_html, page_head  # noqa: E402

OBJECTIVES = "**You will be able to**"


def bullets(block: str) -> list[str]:
    """The items of a Markdown list, each joined onto one line."""
    items = [" ".join(item.split()) for item in re.split(r"(?m)^- ", block) if item.strip()]
    return items


def chapter_text(path: Path) -> tuple[int, str, list[str], list[str]]:
    """``(number, title, objectives, takeaways)`` of a chapter notebook."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "markdown"]
    first = cells[0]
    match = re.match(r"# (\d+)\. (.+)", first)
    if match is None:
        raise ValueError(f"{path.name}: its first cell does not open with '# N. Title'")
    if OBJECTIVES not in first:
        raise ValueError(f"{path.name}: no '{OBJECTIVES}' list in its first cell")
    objectives = bullets(first.split(OBJECTIVES, 1)[1].split("\n\n")[1])
    source = next((s for s in cells if "## Takeaways" in s), None)
    if source is None:
        raise ValueError(f"{path.name}: no '## Takeaways' section")
    block = source.split("## Takeaways", 1)[1].split("\n## ", 1)[0]
    takeaways = bullets("\n".join(line for line in block.strip().splitlines()))
    return int(match.group(1)), match.group(2).strip(), objectives, takeaways


def write_sheets(out: Path, chapters: list[str] | None = None) -> list[Path]:
    """Write the sheets of ``chapters`` (numbers as notebook names start, ``"05"``; every
    chapter of :data:`tutorial_lib.chapters.CHAPTERS` by default) and an index into
    ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    notebooks = [ROOT / "notebooks" / entry.notebook for entry in CHAPTERS
                 if not chapters or entry.key in chapters]
    written, links = [], []
    for path in notebooks:
        number, title, objectives, takeaways = chapter_text(path)
        target = out / f"{path.stem}.html"
        # the sheets sit in cheatsheets/ beside notebooks/ in the built book
        sheet = cheat_sheet_html(number, title, objectives, takeaways,
                                 chapter_href=f"../notebooks/{path.stem}.html")
        target.write_text(sheet, encoding="utf-8")
        written.append(target)
        links.append(f'<li><a href="{target.name}">{number}. {html.escape(title)}</a></li>')
    index = out / "index.html"
    index.write_text(page_head("Cheat sheets") + '<body><nav><a href="../intro.html">The '
                     "book</a></nav><h1>Cheat sheets</h1><ul>" + "".join(links)
                     + "</ul></body></html>\n", encoding="utf-8")
    return written + [index]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "_build" / "html" / "cheatsheets",
                        help="folder to write into (default: _build/html/cheatsheets)")
    parser.add_argument("chapters", nargs="*", help="chapter numbers, e.g. 01 05 (default: all)")
    args = parser.parse_args(argv)
    for path in write_sheets(args.out, args.chapters or None):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
