"""The classroom tools without a process: the student edition keeps every checker and no
solution, the lab sheet keeps the cells its exercises refer to, the nbgrader source notebook
marks every cell and grades with the sealed check, points come from one table, the grader's
CSV row names a raised exception, the submissions it can grade without a kernel (not JSON,
not a chapter), and every bad value of the command line exits 2 with the flag, the value and
a fix, writing nothing.  The real nbgrader and the grader's kernels:
tests/dist/test_classroom_nbgrader.py and tests/dist/test_classroom_grade.py."""
from __future__ import annotations

import csv
import json
import re

import nbformat
import pytest

from tutorial_lib import classroom
from tutorial_lib.exercises import sealed
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
    module = classroom.chapter_module(path)
    source = classroom.nbgrader_source(chapter, module, points=2)
    metas = [c.metadata["nbgrader"] for c in source.cells]
    assert len({m["grade_id"] for m in metas}) == len(metas)
    assert every(re.fullmatch(r"[A-Za-z0-9_-]+", m["grade_id"]) for m in metas)
    answers = [c for c, m in zip(source.cells, metas) if m["solution"]]
    tests = [c for c, m in zip(source.cells, metas) if m["grade"]]
    assert len(answers) == len(tests) == len(exercises)
    assert every(m["locked"] for m in metas if not m["solution"])
    assert every(m["points"] == 2 for m in metas if m["grade"])
    for ex, answer, test in zip(exercises, answers, tests):
        assert test.source == sealed.check_cell(module, ex.checker, ex.stub)
        before, region = answer.source.split(classroom.BEGIN_SOLUTION)
        assert before.strip() == chapter.cells[ex.stub_cell].source.strip()
        assert region.rstrip().endswith(f"{ex.stub} = {ex.stub}_solution\n{classroom.END_SOLUTION}")
        assert f"def {ex.stub}_solution" in region and f"assert {ex.checker}(" not in region
    assert not any("solution" in c.metadata.get("tags", []) for c in source.cells)


def test_the_answer_cell_runs_the_worked_solution_where_the_stub_raises():
    """The source notebook passes its own checks (what nbgrader's validate runs): the
    answer cell defines the stub, then rebinds it to the worked solution."""
    chapter = read(CHAPTERS[0])
    source = classroom.nbgrader_source(chapter, classroom.chapter_module(CHAPTERS[0]))
    answer = next(c for c in source.cells if c.metadata["nbgrader"]["solution"])
    namespace = {}
    exec(answer.source, namespace)
    from tutorial_lib.exercises.ch01 import check_rank_to_coords
    assert check_rank_to_coords(namespace["rank_to_coords"])


def _names(source: str, kinds) -> set[str]:
    import ast
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if "defined" in kinds:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.add(node.id)
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name[:2])
def test_a_lab_sheet_keeps_every_cell_its_exercises_refer_to(path):
    """Every name a lab sheet's code uses is defined in the lab sheet (no cell it needs was
    cut), and the tables 2.3, 3.2 and 4.2 ask about (tagged exercise-context) are there."""
    import builtins
    sheet = classroom.exercises_only(read(path))
    code = [c.source for c in sheet.cells if c.cell_type == "code"]
    known = set(dir(builtins)).union(*(_names(c, {"defined"}) for c in code))
    missing = {name for c in code for name in _names(c, {"used"}) - known}
    assert not missing, (path.name, sorted(missing))
    tables = {"02": "SCENARIOS.items()", "03": "GRADIENT_CASES.items()",
              "04": "GRADIENT_DOMAIN_CASES.items()"}
    if path.name[:2] in tables:
        assert any(tables[path.name[:2]] in c for c in code)


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


def test_a_row_names_the_exception_a_case_raised_before_the_checkers_hint():
    """A ``raise RuntimeError("I give up")`` showed only 2.3's format hint in the CSV."""
    from tutorial_lib.exercises.ch02 import check_choose_collectives

    def gives_up():
        raise RuntimeError("I give up")

    verdict = check_choose_collectives(gives_up).to_dict()
    assert classroom.row_hint(verdict).startswith("the answers: raised RuntimeError: I give up; ")
    assert classroom.row_hint(verdict).endswith(verdict["hint"])
    no_hint = {"hint": "", "cases": [{"name": "a", "passed": False, "detail": "got 3"}]}
    assert classroom.row_hint(no_hint) == "a: got 3"


def test_points_come_from_one_table_by_difficulty():
    numbers = [ex.number for path in CHAPTERS for ex in classroom.chapter_exercises(read(path))]
    assert sorted(classroom.DIFFICULTY) == sorted(numbers)  # every exercise, and no other
    assert set(classroom.DIFFICULTY.values()) == set(classroom.POINTS_BY_DIFFICULTY)
    assert classroom.points_of("2.3") == 1 and classroom.points_of("7.1") == 3
    assert classroom.points_of("7.1", 5) == 5
    source = classroom.nbgrader_source(read(CHAPTERS[6]), classroom.chapter_module(CHAPTERS[6]))
    assert {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"]["points"]
            for c in source.cells if c.metadata["nbgrader"]["grade"]} == {
        "exercise-7-1-check": 3, "exercise-7-2-check": 1, "exercise-7-3-check": 1}


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


def _cli_cases(tmp):
    """(arguments, the flag named, the value named) for every bad value of the command line."""
    student = tmp / "class" / "ann"
    student.mkdir(parents=True)
    (student / CHAPTERS[0].name).write_text("{}")
    (tmp / "empty").mkdir()
    (tmp / "a_file.txt").write_text("x")
    (tmp / "readonly").mkdir(mode=0o555)
    good = [str(tmp / "class"), "--csv", str(tmp / "g.csv")]
    return [
        (["handout", "--out", "/dev/null/x"], "--out", "/dev/null/x"),
        (["handout", "--out", str(tmp / "a_file.txt")], "--out", "a_file.txt"),
        (["handout", "--out", str(tmp / "readonly" / "h")], "--out", "readonly"),
        (["handout", "--out", str(classroom.NOTEBOOKS)], "--out", "notebooks"),
        (["handout", "--out", str(tmp / "h"), "99"], "CHAPTER", "99"),
        (["handout", "--out", str(tmp / "h"), "one"], "CHAPTER", "one"),
        (["handout", "--out", str(tmp / "h"), "01", "123"], "CHAPTER", "123"),
        (["handout", "--out", str(tmp / "h"), "--notebooks", str(tmp / "nowhere")],
         "--notebooks", "nowhere"),
        (["handout", "--out", str(tmp / "h"), "--notebooks", str(tmp / "empty")],
         "--notebooks", "empty"),
        (["grade", *good, "--time-limit", "-5"], "--time-limit", "-5"),
        (["grade", *good, "--time-limit", "nan"], "--time-limit", "nan"),
        (["grade", *good, "--time-limit", "inf"], "--time-limit", "inf"),
        (["grade", *good, "--time-limit", "0"], "--time-limit", "0"),
        (["grade", *good, "--time-limit=-inf"], "--time-limit", "-inf"),
        (["grade", *good, "--time-limit", "soon"], "--time-limit", "soon"),
        (["grade", *good, "--points", "-1"], "--points", "-1"),
        (["grade", *good, "--points", "0"], "--points", "0"),
        (["grade", *good, "--points", "1.5"], "--points", "1.5"),
        (["grade", str(tmp / "class"), "--csv", str(tmp)], "--csv", str(tmp)),
        (["grade", str(tmp / "class"), "--csv", str(tmp / "no" / "g.csv")], "--csv", "g.csv"),
        (["grade", str(tmp / "class"), "--csv", str(tmp / "a_file.txt" / "g.csv")], "--csv",
         "g.csv"),
        (["grade", str(tmp / "class"), "--csv", str(tmp / "readonly" / "g.csv")], "--csv",
         "readonly"),
        (["grade", str(tmp / "missing"), "--csv", str(tmp / "g.csv")], "SUBMISSIONS", "missing"),
        (["grade", str(tmp / "empty"), "--csv", str(tmp / "g.csv")], "SUBMISSIONS", "empty"),
        (["grade", str(tmp / "a_file.txt"), "--csv", str(tmp / "g.csv")], "SUBMISSIONS",
         "a_file.txt"),
        (["grade", *good, "--notebooks", str(tmp / "empty")], "--notebooks", "empty"),
        (["grade", *good, "--notebooks", str(tmp / "a_file.txt")], "--notebooks", "a_file.txt"),
    ]


def test_every_bad_value_exits_2_with_the_flag_the_value_and_a_fix(tmp_path, capsys):
    """24 and more bad values (the ones a new user typed among them: --out /dev/null/x,
    --csv DIR, a missing or empty submissions folder, --time-limit -5 or nan, --points -1,
    chapter 99): each exits 2 before anything runs, says the flag, the value and a fix on
    one line, prints no traceback and writes nothing."""
    import os
    if os.geteuid() == 0:  # root writes anywhere: the read-only folder cases do not apply
        cases = [c for c in _cli_cases(tmp_path) if c[2] != "readonly"]
    else:
        cases = _cli_cases(tmp_path)
    assert len(cases) >= 24
    before = sorted(p for p in tmp_path.rglob("*"))
    for argv, flag, value in cases:
        assert classroom.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, (argv, err)
        assert flag in err and value in err, (argv, err)
        assert "; " in err.split(value, 1)[1], (argv, err)  # a fix follows the rule
        assert sorted(p for p in tmp_path.rglob("*")) == before, argv
    assert not (tmp_path / "g.csv").exists() and not (tmp_path / "h").exists()


NBGRADER_STEPS = ["generate_assignment", "release_assignment", "fetch_assignment", "submit",
                  "collect", "autograde", "generate_feedback"]
"""What tests/dist/test_classroom_nbgrader.py runs, in its order."""


def test_teaching_md_gives_exactly_the_nbgrader_steps_the_test_runs():
    from pathlib import Path
    root = Path(classroom.__file__).resolve().parents[1]
    page = (root / "book" / "teaching.md").read_text()
    steps = re.findall(r"^\s*#?\s*nbgrader (\w+)", page, re.M)
    assert steps == NBGRADER_STEPS
    assert "--course-id" in page and "--exchange" in page
    test = (root / "tests" / "dist" / "test_classroom_nbgrader.py").read_text()
    course = test[test.index("def test_a_course_runs"):]
    assert re.findall(r'run\("nbgrader", "(\w+)"', course) == NBGRADER_STEPS
    total = sum(classroom.POINTS_BY_DIFFICULTY[d] for d in classroom.DIFFICULTY.values())
    assert f"the {total} points of the graded exercises" in page.replace("\n", " ")
