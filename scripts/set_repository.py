"""Set the course's repository address in its one place, and where the chapters need it.

    python scripts/set_repository.py https://github.com/OWNER/REPO
    python scripts/set_repository.py ""          # no address: no launch buttons

Writes ``repository.url`` in ``_config.yml`` (the book's launch buttons and repository
links come from it, see _ext/course_book.py) and the ``REPOSITORY = "..."`` line of every
chapter's install cell (the first code cell, tagged ``install-course``), which installs
``tutorial_lib`` from that address on Colab or Binder. tests/unit/test_install_cells.py
checks that the two agree.

The address must be ``https://github.com/OWNER/REPO`` exactly: the book's Binder button
opens ``mybinder.org/v2/gh/OWNER/REPO/BRANCH`` and its Colab button
``colab.research.google.com/github/OWNER/REPO/blob/BRANCH/...``, both made from the last two
parts of the address, and neither opens another host (Jupyter Book also warns on one, which
fails the build). Anything else is refused before a file is written.

The book workflow (.github/workflows/book.yml) runs it with the repository it runs in.
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
GITHUB = "https://github.com/"
OWNER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")  # GitHub's rule for names
REPOSITORY = re.compile(r"[A-Za-z0-9._-]+")


def repository_url(given: str) -> str:
    """``given`` as the book stores it (no trailing slash), or ValueError naming the rule
    it breaks and a fix. An empty address is allowed: no launch buttons."""
    url = given.strip().rstrip("/")
    if not url:
        return ""
    example = "e.g. https://github.com/OWNER/REPO"
    if not url.startswith(GITHUB):
        raise ValueError(
            f"{given!r} is not on {GITHUB}: Binder's and Colab's launch links open GitHub "
            f"repositories only ({example}); leave the address empty for a book without "
            "launch buttons")
    parts = url[len(GITHUB):].split("/")
    if len(parts) != 2:
        raise ValueError(
            f"{given!r} has {len(parts)} path parts after {GITHUB}, not OWNER/REPO: the "
            f"launch links take the repository itself ({example}), not a branch or a folder")
    owner, repo = parts
    if not OWNER.fullmatch(owner):
        raise ValueError(f"owner {owner!r} in {given!r} is not a GitHub account name "
                         "(letters, digits and inner hyphens)")
    if repo.endswith(".git"):
        raise ValueError(f"{given!r} ends in .git: Colab's link would ask for a repository "
                         f"named {repo!r}; use {GITHUB}{owner}/{repo[:-4]}")
    if not REPOSITORY.fullmatch(repo) or repo in (".", ".."):
        raise ValueError(f"repository name {repo!r} in {given!r} is not a GitHub repository "
                         "name (letters, digits, '.', '-', '_')")
    return url


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        url = repository_url(argv[0])
    except ValueError as refused:
        print(f"set_repository.py: {refused}", file=sys.stderr)
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
