"""Issue 14, the classroom tools without a process: the student edition keeps every checker
and no solution, the nbgrader source notebook marks every cell, the grader's CSV and its
verdict line, and the submissions it can grade without a kernel (not JSON, not a chapter).
The real nbgrader and the grader's kernels: tests/dist/test_classroom_nbgrader.py and
tests/dist/test_classroom_grade.py."""
from __future__ import annotations

import csv
import json
import re

import nbformat
import pytest

from tutorial_lib import classroom
from tests.asserts import every

CHAPTERS = classroom.chapters()


def read(path):
    return nbformat.read(path, as_version=4)


def test_every_chapter_has_its_exercises_numbered_by_their_headings():
    assert len(CHAPTERS) >= 10  # 1 to 9 and 11 at least
    for path in CHAPTERS:
        exercises = classroom.chapter_exercises(read(path))
        chapter = str(int(path.name[:2]))
        assert exercises and all(ex.number.split(".")[0] == chapter for ex in exercises), path.name
        assert len({ex.number for ex in exercises}) == len(exercises)
        assert every(ex.solution_cell is not None for ex in exercises), path.name


def test_a_check_cell_that_is_not_check_f_of_f_is_refused():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("### Exercise 0.1: f"),
        nbformat.v4.new_code_cell("def f(x):\n    raise NotImplementedError",
                                  metadata={"tags": ["exercise-stub"]}),
        nbformat.v4.new_code_cell("check_f(g)", metadata={"tags": ["exercise-check"]})])
    with pytest.raises(ValueError, match="cell 2: a check cell must be `check_f\\(f\\)`"):
        classroom.chapter_exercises(nb)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_the_student_edition_has_every_checker_and_no_solution(path):
    chapter = read(path)
    edition = classroom.student_edition(chapter)
    code = "\n".join(c.source for c in edition.cells if c.cell_type == "code")
    assert "_solution" not in code
    assert not any("solution" in c.metadata.get("tags", []) for c in edition.cells)
    assert every(c.outputs == [] for c in edition.cells if c.cell_type == "code")
    for ex in classroom.chapter_exercises(chapter):
        assert ex.check_source in [c.source.strip() for c in edition.cells]
        assert chapter.cells[ex.stub_cell].source in [c.source for c in edition.cells]
    assert len(edition.cells) == len(chapter.cells) - len(classroom.chapter_exercises(chapter))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_the_nbgrader_source_marks_every_cell(path):
    chapter = read(path)
    exercises = classroom.chapter_exercises(chapter)
    source = classroom.nbgrader_source(chapter, points=2)
    metas = [c.metadata["nbgrader"] for c in source.cells]
    assert len({m["grade_id"] for m in metas}) == len(metas)
    assert every(re.fullmatch(r"[A-Za-z0-9_-]+", m["grade_id"]) for m in metas)
    answers = [c for c, m in zip(source.cells, metas) if m["solution"]]
    tests = [c for c, m in zip(source.cells, metas) if m["grade"]]
    assert len(answers) == len(tests) == len(exercises)
    assert every(m["locked"] for m in metas if not m["solution"])
    assert every(m["points"] == 2 for m in metas if m["grade"])
    for ex, answer, test in zip(exercises, answers, tests):
        assert test.source.strip() == ex.check_source
        before, region = answer.source.split(classroom.BEGIN_SOLUTION)
        assert before.strip() == chapter.cells[ex.stub_cell].source.strip()
        assert region.rstrip().endswith(f"{ex.stub} = {ex.stub}_solution\n{classroom.END_SOLUTION}")
        assert f"def {ex.stub}_solution" in region and f"assert {ex.checker}(" not in region
    assert not any("solution" in c.metadata.get("tags", []) for c in source.cells)


def test_the_answer_cell_runs_the_worked_solution_where_the_stub_raises():
    """The source notebook passes its own checks (what nbgrader's validate runs): the
    answer cell defines the stub, then rebinds it to the worked solution."""
    chapter = read(CHAPTERS[0])
    source = classroom.nbgrader_source(chapter)
    answer = next(c for c in source.cells if c.metadata["nbgrader"]["solution"])
    namespace = {}
    exec(answer.source, namespace)
    from tutorial_lib.exercises.ch01 import check_rank_to_coords
    assert check_rank_to_coords(namespace["rank_to_coords"])


def test_the_lab_sheet_keeps_the_setup_and_the_exercises_only():
    chapter = read(CHAPTERS[0])
    sheet = classroom.exercises_only(chapter)
    exercises = classroom.chapter_exercises(chapter)
    assert classroom.chapter_exercises(sheet)[-1].number == exercises[-1].number
    assert sheet.cells[classroom.setup_cell(sheet)].source == chapter.cells[classroom.setup_cell(chapter)].source
    assert len(sheet.cells) < len(chapter.cells) / 3


def test_handout_writes_the_student_editions(tmp_path):
    written = classroom.handout(tmp_path, only=["01", "09"])
    assert [p.name for p in written] == [CHAPTERS[0].name, CHAPTERS[8].name]
    for path in written:
        assert "_solution" not in path.read_text()


def test_the_nbgrader_course_has_one_assignment_per_chapter_and_the_config(tmp_path):
    written = classroom.write_nbgrader_course(tmp_path, only=["02"])
    assert written == [tmp_path / "source" / "ch02" / CHAPTERS[1].name]
    assert "ClearSolutions.code_stub" in (tmp_path / "nbgrader_config.py").read_text()


def test_a_verdict_is_one_line_after_the_nonce_whatever_the_checker_does(capsys):
    from tutorial_lib.exercises.ch01 import check_rank_to_coords
    classroom.report("@@n@@", "1.1", lambda: check_rank_to_coords(lambda *a: {}))
    classroom.report("@@n@@", "1.1", lambda: undefined_name)  # noqa: F821
    classroom.report("@@n@@", "1.1", lambda: 1 / 0)
    lines = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines()
             if line.startswith("@@n@@")]
    assert [v["passed"] for v in lines] == [False, False, False]
    assert lines[0]["hint"] and "undefined_name" in lines[1]["hint"]
    assert "ZeroDivisionError" in lines[2]["hint"]


def test_a_file_that_is_not_json_fails_every_exercise_of_its_chapter_with_the_reason(tmp_path):
    path = tmp_path / "eve" / CHAPTERS[0].name
    path.parent.mkdir()
    path.write_text("{ not json")
    grades = classroom.grade_notebook(path, "eve")
    numbers = [e.number for e in classroom.chapter_exercises(read(CHAPTERS[0]))]
    assert numbers[:3] == ["1.1", "1.2", "1.3"]
    assert [(g.exercise, g.passed, g.points) for g in grades] == [(n, False, 0) for n in numbers]
    assert every("not a readable notebook" in g.hint for g in grades)


def test_a_notebook_that_is_no_chapter_gets_one_row_saying_so(tmp_path):
    path = tmp_path / "eve" / "homework.ipynb"
    path.parent.mkdir()
    path.write_text("{}")
    [row] = classroom.grade_notebook(path, "eve")
    assert not row.passed and "not a chapter" in row.hint


def test_submissions_are_one_folder_per_student(tmp_path):
    for student in ("ann", "ben"):
        (tmp_path / "class" / student).mkdir(parents=True)
        (tmp_path / "class" / student / "01_x.ipynb").write_text("{}")
    found = classroom.submission_notebooks([tmp_path / "class"])
    assert [(s, p.name) for s, p in found] == [("ann", "01_x.ipynb"), ("ben", "01_x.ipynb")]
    assert classroom.submission_notebooks([tmp_path / "class" / "ben"]) == found[1:]


def test_the_csv_has_the_issues_columns(tmp_path):
    rows = [classroom.Grade("ann", "01_x.ipynb", "1.1", True, 1, ""),
            classroom.Grade("ann", "01_x.ipynb", "1.2", False, 0, "a hint, with a comma")]
    classroom.write_csv(rows, tmp_path / "g.csv")
    with open(tmp_path / "g.csv") as f:
        read_back = list(csv.DictReader(f))
    assert list(read_back[0]) == ["student", "notebook", "exercise", "passed", "points", "hint"]
    assert read_back[1]["hint"] == "a hint, with a comma" and read_back[0]["passed"] == "True"


def test_the_handout_command_writes_every_chapter(tmp_path, capsys):
    assert classroom.main(["handout", "--out", str(tmp_path / "handout")]) == 0
    written = sorted(p.name for p in (tmp_path / "handout").glob("*.ipynb"))
    assert written == [p.name for p in CHAPTERS]
    assert capsys.readouterr().out.count(".ipynb") == len(CHAPTERS)
    assert classroom.main(["handout", "--out", str(tmp_path / "lab"), "--exercises-only", "08"]) == 0
    sheet = read(tmp_path / "lab" / CHAPTERS[7].name)
    assert len(classroom.chapter_exercises(sheet)) == 4 and "_solution" not in str(sheet.cells)


def test_the_grade_command_refuses_a_folder_without_chapters(tmp_path):
    with pytest.raises(SystemExit):
        classroom.main(["grade", str(tmp_path), "--csv", str(tmp_path / "g.csv"),
                        "--notebooks", str(tmp_path)])
