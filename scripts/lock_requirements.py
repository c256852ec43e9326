"""Write constraints.txt: every package that requirements.txt resolves to, pinned.

    python scripts/lock_requirements.py            # rewrite constraints.txt from this Python
    python scripts/lock_requirements.py --check    # exit 1 if constraints.txt is out of date

requirements.txt names what the project uses directly (jupyter-book, torch, ...); what
those pull in (sphinx-book-theme, pydata-sphinx-theme, myst-nb, Sphinx, ...) is resolved
by pip at install time, so without pins the next install could bring a theme that draws
the page differently. This script walks the installed distributions from the lines of
requirements.txt through their ``Requires-Dist`` (markers evaluated for this Python, extras
followed where requested) and writes each one's installed version. requirements.txt reads
constraints.txt itself (its ``-c constraints.txt`` line), so ``pip install -r
requirements.txt`` installs exactly these versions.

To upgrade: change a pin in requirements.txt (or run ``pip install -U thing``), install,
run the tests, then run this script and commit both files.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements.txt"
CONSTRAINTS = ROOT / "constraints.txt"

HEADER = """\
# Every package `pip install -r requirements.txt` resolves to, pinned (read by
# requirements.txt through its `-c constraints.txt` line). Python {python}, Linux x86-64.
# Written by `python scripts/lock_requirements.py`; do not edit by hand: change
# requirements.txt, install, test, then run the script again.
# torch is the CPU build (2.13.0+cpu); `torch==2.13.0` also admits the CUDA build of the
# same release, which a GPU box installs first (see README).
"""


def top_level_requirements(path: Path = REQUIREMENTS) -> list[Requirement]:
    """The package lines of a requirements file and of the files it reads with ``-r``
    (requirements.txt reads requirements-reader.txt); options and ``-e .`` skipped."""
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out += top_level_requirements(path.parent / line[3:].strip())
        if not line or line.startswith("-"):
            continue
        out.append(Requirement(line))
    return out


def project_requirements() -> list[Requirement]:
    """The dependencies of the project itself (``-e .``), from pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project.get("dependencies", [])]


def resolve(roots: list[Requirement]) -> dict[str, str]:
    """``{distribution name: installed version}`` for the closure of ``roots``."""
    env = default_environment()
    found: dict[str, str] = {}
    todo: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset(r.extras)) for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        key = (canonicalize_name(req.name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{req.name} is required but not installed here: "
                     "pip install -r requirements.txt first")
        name = dist.metadata["Name"]
        found[name] = dist.version
        for line in dist.requires or []:
            child = Requirement(line)
            if child.marker is not None:
                wanted = [""] + sorted(extras)
                if not any(child.marker.evaluate({**env, "extra": e}) for e in wanted):
                    continue
            todo.append((child, frozenset(child.extras)))
    return found


def render(pins: dict[str, str]) -> str:
    lines = []
    for name in sorted(pins, key=canonicalize_name):
        version = re.sub(r"\+.*$", "", pins[name])  # 2.13.0+cpu -> 2.13.0 (see HEADER)
        lines.append(f"{name}=={version}")
    python = ".".join(map(str, sys.version_info[:2]))
    return HEADER.format(python=python) + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with constraints.txt instead of writing it")
    args = parser.parse_args(argv)
    roots = top_level_requirements() + project_requirements()
    text = render(resolve(roots))
    if args.check:
        if CONSTRAINTS.read_text() != text:
            print("constraints.txt differs from what is installed: "
                  "python scripts/lock_requirements.py", file=sys.stderr)
            return 1
        print("constraints.txt matches the installed packages")
        return 0
    CONSTRAINTS.write_text(text)
    print(f"wrote {CONSTRAINTS.relative_to(ROOT)}: {text.count(chr(10)) - HEADER.count(chr(10))} pins")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
