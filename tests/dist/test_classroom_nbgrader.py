"""Issue 14: the real nbgrader on the course.  ``scripts/nbgrader_metadata.py`` writes the
source notebooks from the cell tags; ``nbgrader generate_assignment`` makes the student
edition of every chapter (no solution left, every checker and stub still there), and
``nbgrader autograde`` gives chapter 1's lab sheet (its setup cell and two exercises, whose
checkers start no process) the expected points for a right, a wrong and a broken (syntax
error) submission; a failing check cell says "NOT YET" and why."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tutorial_lib import classroom

from ..classroom_submissions import CH01, SYNTAX_ERROR_1_1, WRONG_1_2, worked_solution
from tests.asserts import every

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(*command, cwd):
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=ENV)
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
            assert ex.check_source in sources, (chapter.name, ex.number)
            stub = original.cells[ex.stub_cell].source
            assert any(s.startswith(stub) for s in sources), (chapter.name, ex.number)
        # every other cell of the chapter is there, locked
        assert len(released.cells) == len(original.cells) - len(classroom.chapter_exercises(original))
        assert every(c.metadata["nbgrader"]["locked"] or c.metadata["nbgrader"]["solution"]
                   for c in released.cells)


def test_autograde_gives_the_expected_points(tmp_path):
    run(sys.executable, str(ROOT / "scripts" / "nbgrader_metadata.py"), "--course", str(tmp_path),
        "--exercises-only", "01", cwd=ROOT)
    run("nbgrader", "generate_assignment", "ch01", "--force", cwd=tmp_path)
    release = tmp_path / "release" / "ch01" / CH01.name
    answers = {
        "alice": {"1-1": worked_solution(CH01, "1.1"), "1-2": worked_solution(CH01, "1.2")},
        "bob": {"1-1": worked_solution(CH01, "1.1"), "1-2": WRONG_1_2},
        "carol": {"1-1": SYNTAX_ERROR_1_1, "1-2": worked_solution(CH01, "1.2")},
    }
    for student, typed in answers.items():
        nb = nbformat.read(release, as_version=4)
        for cell in nb.cells:
            grade_id = cell.metadata["nbgrader"]["grade_id"]
            for number, text in typed.items():
                if grade_id == f"exercise-{number}-answer":
                    cell.source = text
        target = tmp_path / "submitted" / student / "ch01" / CH01.name
        target.parent.mkdir(parents=True)
        nbformat.write(nb, target)
    run("nbgrader", "autograde", "ch01", "--force", cwd=tmp_path)
    from nbgrader.api import Gradebook
    scores = {}
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        for student in answers:
            graded = gradebook.find_submission_notebook(CH01.stem, "ch01", student)
            scores[student] = {g.name: g.score for g in graded.grades}
    check = ["exercise-1-1-check", "exercise-1-2-check"]
    assert [[scores[s][c] for c in check] for s in answers] == [[1, 1], [1, 0], [0, 1]]
    wrong = nbformat.read(tmp_path / "autograded" / "bob" / "ch01" / CH01.name, as_version=4)
    outputs = {c.metadata["nbgrader"]["grade_id"]: c.get("outputs", []) for c in wrong.cells}
    [error] = outputs["exercise-1-2-check"]
    assert error.ename == "ExerciseNotPassed" and "NOT YET Exercise 1.2" in error.evalue
    assert "PASS Exercise 1.1" in outputs["exercise-1-1-check"][0].text
