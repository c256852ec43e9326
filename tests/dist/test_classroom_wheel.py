"""A shared hub without the solutions: the wheel students install the library from
(``pip wheel . --no-deps``, as book/teaching.md says) carries no notebook and no worked
solution, and its classroom module finds no chapters beside it (an editable install would
point at the teacher's notebooks)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_no_notebook_and_no_solution(tmp_path):
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "_build", "build", "*.egg-info", "__pycache__", ".venv", "venv", "node_modules"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "wheel"), "-q"],
                          cwd=source, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("tutorial_lib-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        texts = {n: archive.read(n).decode(errors="replace") for n in names}
    assert "tutorial_lib/exercises/ch01.py" in names  # the checkers are there
    assert not [n for n in names if n.endswith(".ipynb") or "notebooks/" in n]
    leaks = [n for n, text in texts.items() if "### BEGIN SOLUTION" in text
             and not n.endswith("classroom.py") or "_solution(" in text]
    assert not leaks, leaks
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    found = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                            "from tutorial_lib import classroom; "
                            "print(classroom.NOTEBOOKS.exists(), len(classroom.chapters()))",
                            str(installed)], capture_output=True, text=True, timeout=300)
    assert found.stdout.split() == ["False", "0"], found.stderr[-2000:]
