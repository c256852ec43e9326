"""``python -m tutorial_lib.classroom grade`` on correct, wrong, broken and cheating
submissions, as an instructor runs it: one folder per student, one CSV row per student and
exercise, each notebook in a fresh kernel under a time limit, each function checked by the
real checker in a fresh Python (``exercises.sealed``).  A syntax error, a raised exception
(its type and message in the row), a deleted check cell, a file that is not JSON, a worker
that deadlocks and an endless loop each fail what they touch with the reason; a wrong answer
that rebinds the checker's name, patches its module and helpers, or replaces
``tutorial_lib.exercises`` in ``sys.modules`` is failed by the real checker; the grader
finishes and leaves no process behind (every process it started has the kernel's working
folder, ``classroom.WORKDIR_PREFIX``, or was a checking interpreter it killed)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tutorial_lib import classroom

from ..classroom_submissions import (CH01, CH07, DEADLOCK_7_1, ENDLESS_1_2, GIVES_UP_1_3,
                                     SYNTAX_ERROR_1_1, TRICKS, WRONG_1_2, filled, lab_sheet,
                                     worked_solution, write)
from tests.asserts import every

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def grading_processes() -> list[int]:
    """Processes whose working folder is one the grader made (Linux: /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            if Path(cwd.removesuffix(" (deleted)")).name.startswith(classroom.WORKDIR_PREFIX):
                out.append(int(entry.name))
    return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One run of the command line over four students; the CSV rows by (student, exercise).
    erin hands in chapter 7 with only exercise 7.1: the other two check cells are deleted."""
    folder = tmp_path_factory.mktemp("submissions")
    sheet = lab_sheet(CH01)
    write(folder, "alice", filled(sheet, {"1.1": worked_solution(CH01, "1.1"),
                                          "1.2": worked_solution(CH01, "1.2")}), CH01.name)
    write(folder, "bob", filled(sheet, {"1.1": SYNTAX_ERROR_1_1, "1.2": WRONG_1_2,
                                        "1.3": GIVES_UP_1_3}), CH01.name)
    write(folder, "mallory", filled(sheet, {n: source for n, (_, source) in TRICKS.items()}),
          CH01.name)
    (folder / "dan").mkdir()
    (folder / "dan" / CH01.name).write_text('{"cells": [')  # saved half-way: not JSON
    write(folder, "erin", filled(lab_sheet(CH07), {"7.1": DEADLOCK_7_1}, keep=("7.1",)), CH07.name)
    out = folder / "grades.csv"
    before = set(grading_processes())
    done = subprocess.run([sys.executable, "-m", "tutorial_lib.classroom", "grade", str(folder),
                           "--csv", str(out), "--time-limit", "240"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    return {(r["student"], r["exercise"]): r for r in rows}, rows, before, done.stdout


def test_the_csv_has_a_row_per_student_and_exercise(graded):
    by_key, rows, _, stdout = graded
    assert list(rows[0]) == list(classroom.CSV_COLUMNS)
    ch01 = [e.number for e in classroom.chapter_exercises(lab_sheet(CH01))]
    assert ch01[:2] == ["1.1", "1.2"]  # (and those after, left unanswered: not passed)
    assert sorted(by_key) == sorted([(s, n) for s in ("alice", "bob", "dan", "mallory")
                                     for n in ch01] + [("erin", n) for n in ("7.1", "7.2", "7.3")])
    assert {r["notebook"] for r in rows if r["student"] == "erin"} == {CH07.name}
    assert f"alice/01_communicator_groups.ipynb: 2/{len(ch01)} exercises passed" in stdout
    assert every(by_key["alice", n]["passed"] == "False" for n in ch01[2:])


def test_right_answers_score_and_wrong_ones_get_the_checkers_hint(graded):
    by_key = graded[0]
    assert [(by_key["alice", n]["passed"], by_key["alice", n]["points"]) for n in ("1.1", "1.2")] \
        == [("True", str(classroom.points_of("1.1"))), ("True", str(classroom.points_of("1.2")))]
    assert by_key["alice", "1.1"]["hint"] == ""
    bob = by_key["bob", "1.2"]
    assert (bob["passed"], bob["points"]) == ("False", "0")
    from tutorial_lib.exercises import ch01
    assert bob["hint"] in ch01.DATA_PARALLEL_MISTAKES.generic or any(
        bob["hint"] in m.stages for m in ch01.DATA_PARALLEL_MISTAKES)


def test_broken_submissions_fail_with_the_reason(graded):
    by_key = graded[0]
    assert by_key["bob", "1.1"]["passed"] == "False"
    assert "raised SyntaxError" in by_key["bob", "1.1"]["hint"]
    assert every("not a readable notebook" in by_key["dan", n]["hint"] for n in ("1.1", "1.2"))
    erin = by_key["erin", "7.1"]  # passes at PP = 2, deadlocks at PP = 3
    from tutorial_lib.exercises import ch07
    assert (erin["passed"], erin["hint"]) == ("False", ch07.HINT_RECV_FROM_PREVIOUS)
    assert [by_key["erin", n]["hint"] for n in ("7.2", "7.3")] == ["its check cell was deleted"] * 2


@pytest.mark.parametrize("number", list(TRICKS), ids=[trick for trick, _ in TRICKS.values()])
def test_a_wrong_answer_that_replaces_the_checker_is_failed_by_the_real_one(graded, number):
    """mallory's wrong answers each try one trick (rebinding the checker's name, patching its
    module and helpers, a fake tutorial_lib.exercises in sys.modules): each scores nothing,
    with the real checker's hint."""
    from tutorial_lib.exercises import ch01
    row = graded[0]["mallory", number]
    assert (row["passed"], row["points"]) == ("False", "0")
    table = {"1.1": ch01.COORDS_MISTAKES, "1.2": ch01.DATA_PARALLEL_MISTAKES,
             "1.3": ch01.NODE_MISTAKES}[number]
    assert every(any(line in m.stages for m in table) or line in table.generic
               for line in row["hint"].split("\n")), row["hint"]


def test_a_row_carries_the_exception_a_case_raised(graded):
    """bob's 1.3 raises RuntimeError("I give up"): the row says so, not only the format hint."""
    assert graded[0]["bob", "1.3"]["hint"].startswith("the answers: raised RuntimeError: I give up")


def test_the_grader_leaves_no_process_behind(graded):
    before = graded[2]
    assert set(grading_processes()) - before == set()


def test_an_endless_loop_is_stopped_by_the_time_limit_and_the_rest_still_counts(tmp_path):
    sheet = lab_sheet(CH01)
    path = write(tmp_path, "fay", filled(sheet, {"1.1": worked_solution(CH01, "1.1"),
                                                 "1.2": ENDLESS_1_2}), CH01.name)
    before = set(grading_processes())
    grades = classroom.grade_notebook(path, "fay", time_limit=30)
    assert [(g.exercise, g.passed) for g in grades][:2] == [("1.1", True), ("1.2", False)]
    assert "time limit of 30 s" in grades[1].hint
    assert set(grading_processes()) - before == set()
