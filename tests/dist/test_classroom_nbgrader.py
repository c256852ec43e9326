"""The real nbgrader on the course.  ``scripts/nbgrader_metadata.py`` writes the source
notebooks from the cell tags; ``nbgrader generate_assignment`` makes the student edition of
every chapter (no solution left, every stub there, every test cell the sealed check of its
exercise), and a whole course runs with a temporary exchange: release, fetch, submit,
collect, autograde (right answers score their points, wrong ones and wrong ones that
replace the checker score nothing) and feedback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tutorial_lib import classroom

from tutorial_lib.exercises import sealed

from ..classroom_submissions import CH01, TRICKS, worked_solution
from tests.asserts import every

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(*command, cwd):
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_generate_assignment_removes_every_solution_and_keeps_every_checker(tmp_path):
    run(sys.executable, str(ROOT / "scripts" / "nbgrader_metadata.py"), "--course", str(tmp_path),
        "--assignment", "course", cwd=ROOT)
    run("nbgrader", "generate_assignment", "course", "--force", cwd=tmp_path)
    for chapter in classroom.chapters():
        original = nbformat.read(chapter, as_version=4)
        released = nbformat.read(tmp_path / "release" / "course" / chapter.name, as_version=4)
        code = "\n".join(c.source for c in released.cells if c.cell_type == "code")
        assert "_solution" not in code and classroom.BEGIN_SOLUTION not in code, chapter.name
        sources = [c.source for c in released.cells]
        for ex in classroom.chapter_exercises(original):
            check = sealed.check_cell(classroom.chapter_module(chapter), ex.checker, ex.stub)
            assert check in sources, (chapter.name, ex.number)
            stub = original.cells[ex.stub_cell].source
            assert any(s.startswith(stub) for s in sources), (chapter.name, ex.number)
        # every other cell of the chapter is there, locked
        assert len(released.cells) == len(original.cells) - len(classroom.chapter_exercises(original))
        assert every(c.metadata["nbgrader"]["locked"] or c.metadata["nbgrader"]["solution"]
                   for c in released.cells)


def test_a_course_runs_release_fetch_submit_collect_autograde_and_feedback(tmp_path):
    """teaching.md's steps, with a temporary exchange: the course id and the exchange come
    from nbgrader_metadata.py; the student (this user) fetches and submits a right 1.1; the
    grader collects, autogrades and writes feedback.  Beside that submission, mallory's
    (put in submitted/ as collect would) tries one trick per exercise to pass wrong answers
    (rebinding the checker's name, patching its module and helpers, a fake
    tutorial_lib.exercises in sys.modules): every test cell grades with the real checker."""
    course, exchange, home = tmp_path / "course", tmp_path / "exchange", tmp_path / "student"
    home.mkdir()
    run(sys.executable, str(ROOT / "scripts" / "nbgrader_metadata.py"), "--course", str(course),
        "--course-id", "dl101", "--exchange", str(exchange), "--exercises-only", "01", cwd=ROOT)
    run("nbgrader", "generate_assignment", "ch01", "--force", cwd=course)
    run("nbgrader", "release_assignment", "ch01", cwd=course)
    student = ("--course", "dl101", f"--Exchange.root={exchange}")
    run("nbgrader", "fetch_assignment", "ch01", *student, cwd=home)
    fetched = home / "ch01" / CH01.name
    answer(fetched, {"1-1": worked_solution(CH01, "1.1")})
    run("nbgrader", "submit", "ch01", *student, cwd=home)
    run("nbgrader", "collect", "ch01", cwd=course)
    [me] = [p.name for p in (course / "submitted").iterdir()]
    mallory = course / "submitted" / "mallory" / "ch01" / CH01.name
    mallory.parent.mkdir(parents=True)
    mallory.write_text(fetched.read_text())
    answer(mallory, {n.replace(".", "-"): source for n, (_, source) in TRICKS.items()})
    run("nbgrader", "autograde", "ch01", "--force", cwd=course)
    run("nbgrader", "generate_feedback", "ch01", "--force", cwd=course)
    scores = points(course, [me, "mallory"])
    check = ["exercise-1-1-check", "exercise-1-2-check", "exercise-1-3-check"]
    assert [scores[me][c] for c in check] == [classroom.points_of("1.1"), 0, 0]
    assert [scores["mallory"][c] for c in check] == [0, 0, 0]
    feedback = (course / "feedback" / me / "ch01" / CH01.with_suffix(".html").name).read_text()
    assert "PASS Exercise 1.1" in feedback and "NOT YET Exercise 1.2" in feedback
    graded = nbformat.read(course / "autograded" / "mallory" / "ch01" / CH01.name, as_version=4)
    outputs = {c.metadata["nbgrader"]["grade_id"]: c.get("outputs", []) for c in graded.cells}
    for number in TRICKS:
        [error] = outputs[f"exercise-{number.replace('.', '-')}-check"]
        assert error.ename == "AssertionError" and f"NOT YET Exercise {number}" in error.evalue


def answer(path, typed: dict[str, str]) -> None:
    """Type each answer into the answer cell of its grade id (``"1-1"``: exercise 1.1)."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        for number, text in typed.items():
            if grade_id == f"exercise-{number}-answer":
                cell.source = text
    nbformat.write(nb, path)


def points(course, students) -> dict[str, dict[str, float]]:
    from nbgrader.api import Gradebook
    out = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for student in students:
            graded = gradebook.find_submission_notebook(CH01.stem, "ch01", student)
            out[student] = {g.name: g.score for g in graded.grades}
    return out
