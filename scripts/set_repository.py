"""Set the course's repository address in its one place, and where the chapters need it.

    python scripts/set_repository.py https://github.com/OWNER/REPO
    python scripts/set_repository.py ""          # no address: no launch buttons

Writes ``repository.url`` in ``_config.yml`` (the book's launch buttons and repository
links come from it, see _ext/course_book.py) and the ``REPOSITORY = "..."`` line of every
chapter's install cell (the first code cell, tagged ``install-course``), which installs
``tutorial_lib`` from that address on Colab or Binder. tests/unit/test_install_cells.py
checks that the two agree.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
URL_LINE = re.compile(r'^(  url: )"[^"]*"$', re.MULTILINE)
CELL_LINE = re.compile(r'^REPOSITORY = "[^"]*"', re.MULTILINE)
TAG = "install-course"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    url = argv[0].strip().rstrip("/")
    if url and not re.fullmatch(r"https://[\w.-]+/[\w.-]+/[\w.-]+", url):
        print(f"set_repository.py: {url!r} is not a repository address such as "
              f"https://github.com/OWNER/REPO", file=sys.stderr)
        return 2
    config = REPO / "_config.yml"
    text, n = URL_LINE.subn(lambda m: f'{m.group(1)}"{url}"', config.read_text(), count=1)
    if n != 1:
        print("set_repository.py: _config.yml has no `repository:` / `url:` line", file=sys.stderr)
        return 1
    config.write_text(text)
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        notebook = json.loads(path.read_text())
        for cell in notebook["cells"]:
            if TAG in cell.get("metadata", {}).get("tags", []):
                source = "".join(cell["source"])
                source = CELL_LINE.sub(f'REPOSITORY = "{url}"', source, count=1)
                cell["source"] = source.splitlines(keepends=True)  # as Jupyter stores it
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    print(f"repository.url = {url!r} in _config.yml and every chapter's install cell")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
