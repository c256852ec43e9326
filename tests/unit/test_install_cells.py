"""Every chapter opens with the install cell that makes it run on Colab or Binder.

The cell (the first code cell, tagged ``install-course``) installs ``tutorial_lib`` from
the course's repository when the kernel lacks it; the address is the one in
``_config.yml`` (``repository.url``), and ``scripts/set_repository.py`` writes both.
Here the cell's real source runs with ``find_spec`` and ``subprocess.check_call``
replaced, so that nothing is installed.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tutorial_lib.chapters import notebook_paths
from tests.asserts import every

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = notebook_paths()
TAG = "install-course"


def configured_url() -> str:
    match = re.search(r'^repository:\n  url: "([^"]*)"$', (REPO / "_config.yml").read_text(),
                      re.MULTILINE)
    assert match, "_config.yml has no repository.url line"
    return match.group(1)


def install_cell(path: Path) -> nbformat.NotebookNode:
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return code[0]


def run_cell(source: str, monkeypatch, *, installed: bool, repository: str | None = None):
    """Run the cell's source; return the pip commands it would have run."""
    calls = []
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if installed else None)
    monkeypatch.setattr(subprocess, "check_call", lambda cmd, **kw: calls.append(cmd) or 0)
    if repository is not None:
        source = re.sub(r'^REPOSITORY = "[^"]*"', f'REPOSITORY = "{repository}"', source,
                        count=1, flags=re.MULTILINE)
    exec(compile(source, "<install cell>", "exec"), {})
    return calls


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_first_code_cell_is_the_install_cell(path):
    cell = install_cell(path)
    tags = cell.metadata.get("tags", [])
    assert TAG in tags and "hide-input" in tags, f"{path.name}: first code cell tags {tags}"
    line = re.search(r'^REPOSITORY = "([^"]*)"$', cell.source, re.MULTILINE)
    assert line, f"{path.name}: the install cell has no REPOSITORY line"
    assert line.group(1) == configured_url(), (
        f"{path.name} installs from {line.group(1)!r} but _config.yml says "
        f"{configured_url()!r}: run `python scripts/set_repository.py URL`")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_install_cell_does_nothing_where_the_library_is_installed(path, monkeypatch):
    assert run_cell(install_cell(path).source, monkeypatch, installed=True,
                    repository="https://github.com/o/r") == []


def test_the_install_cell_installs_from_the_repository_when_the_library_is_missing(monkeypatch):
    calls = run_cell(install_cell(CHAPTERS[0]).source, monkeypatch, installed=False,
                     repository="https://github.com/owner/course")
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet",
                      "git+https://github.com/owner/course"]]


def test_without_a_repository_the_install_cell_names_the_cpu_install_and_the_folder(
        monkeypatch, tmp_path):
    (tmp_path / "requirements-cpu.txt").write_text("")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where Jupyter runs a chapter
    with pytest.raises(ModuleNotFoundError) as raised:
        run_cell(install_cell(CHAPTERS[0]).source, monkeypatch, installed=False, repository="")
    message = str(raised.value)
    # requirements.txt would resolve PyPI's CUDA torch on a Linux laptop
    assert "pip install -r requirements-cpu.txt" in message
    assert f"In the course's folder ({tmp_path}) run" in message


def test_outside_the_course_the_install_cell_says_which_folder_to_look_for(
        monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match=r"\(the clone of the course's repository\)"):
        run_cell(install_cell(CHAPTERS[0]).source, monkeypatch, installed=False, repository="")


def test_every_chapter_has_the_same_install_cell():
    first = install_cell(CHAPTERS[0]).source
    assert every(install_cell(path).source == first for path in CHAPTERS)
