"""The course in a classroom: student editions, nbgrader source notebooks and a grader.

    python -m tutorial_lib.classroom handout --out DIR [--exercises-only] [CHAPTER ...]
    python -m tutorial_lib.classroom grade SUBMISSIONS ... --csv grades.csv [--time-limit S]

Every exercise of a chapter is three code cells (``CONTRIBUTING.md``): a stub tagged
``exercise-stub`` (``def f(...): ... raise NotImplementedError``), a check tagged
``exercise-check`` (exactly ``check_f(f)``) and a worked solution tagged ``solution``
(``def f_solution ...; assert check_f(f_solution)``), under a heading that names the exercise
("Exercise 1.2").  :func:`chapter_exercises` reads them; everything here works from those
tags, so a new exercise needs no change in this module.

* :func:`student_edition`: the chapter without its solutions and outputs, checkers kept
  (``handout``).  :func:`exercises_only` cuts a chapter down to its setup cell and its
  exercises (a lab sheet; the grading tests use it because it runs in seconds).
* :func:`nbgrader_source`: the chapter as an nbgrader source notebook: each stub cell is
  nbgrader's answer cell, with the worked solution between ``### BEGIN SOLUTION`` and
  ``### END SOLUTION`` (``nbgrader generate_assignment`` removes it), each check cell an
  autograded test worth :func:`points_of`, every other cell locked (``scripts/nbgrader_metadata.py``).
  Under nbgrader a checker that does not pass raises (``exercises.kit.ExerciseNotPassed``),
  so the test cell fails and scores nothing.
* :func:`grade`: for graders who do not run nbgrader's database.  Submissions are one folder
  per student (the folder's name is the student); each notebook runs in a fresh kernel, cell
  by cell as "Run all" would, under one time limit per notebook.  The check cells do not run
  as the student left them: the grader runs the chapter's own call of each checker
  (``check_f(f)``) in their place and reads the verdict.  A notebook that is not JSON, a cell
  that raises, a deleted check cell, an endless loop (the time limit) or a worker that
  deadlocks (the checker's own timeout) fails the exercises it touches with the reason; the
  grader never raises for a submission, and kills every process the kernel started.
"""
from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .launch import descendants

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
"""The chapters of a source checkout (an installed package has no notebooks: pass a folder)."""

TAG_STUB, TAG_CHECK, TAG_SOLUTION = "exercise-stub", "exercise-check", "solution"
TAG_CONTEXT = "exercise-context"
"""A cell an exercise refers to (a table, a code cell whose names it uses): a lab sheet
(:func:`exercises_only`) keeps it."""
TAG_INSTALL = "install-course"
"""The Colab / Binder install cell every chapter opens with (a no-op where the library is
installed)."""

POINTS_BY_DIFFICULTY = {"warm-up": 1, "core": 2, "stretch": 3}
"""An exercise's points by its difficulty, in nbgrader and in the course grader alike."""

DIFFICULTY = {
    # warm-up: predict what a run shows, or choose among named answers
    **dict.fromkeys(("1.3", "2.3", "2.4", "3.2", "4.2", "5.4", "5.5", "6.4", "7.2", "7.3",
                     "8.4", "9.4"), "warm-up"),
    # core: one function from the chapter's formulas or rank arithmetic
    **dict.fromkeys(("1.1", "1.2", "2.2", "3.3", "4.1", "4.3", "5.1", "5.2", "5.3", "6.2",
                     "6.3", "8.2", "8.3", "9.2", "9.3", "10.1", "10.2", "11.2", "12.1",
                     "12.2", "13.1", "13.2"), "core"),
    # stretch: code that runs on gloo ranks, or a schedule or numerics to build
    **dict.fromkeys(("2.1", "3.1", "6.1", "7.1", "8.1", "9.1", "11.1"), "stretch"),
}
"""Every exercise's difficulty (a test checks that each chapter's exercises are listed)."""


def points_of(number: str, points: int | None = None) -> int:
    """The points of exercise ``number``: ``points`` when given (the same for every
    exercise), else :data:`POINTS_BY_DIFFICULTY` of its :data:`DIFFICULTY` (core when an
    exercise is not listed yet)."""
    if points is not None:
        return points
    return POINTS_BY_DIFFICULTY[DIFFICULTY.get(number, "core")]

TIME_LIMIT = 300.0
"""Seconds one submitted notebook may run, kernel start included (the slowest chapter runs
in about a minute on 2 cores)."""

CSV_COLUMNS = ("student", "notebook", "exercise", "passed", "points", "hint")

CHECK_TIME_MIN = 60.0
"""Seconds the checks of one notebook get at least, after its cells ran (the rest of the
notebook's time limit when more is left)."""

WORKDIR_PREFIX = "tutorial-grade-"
"""The grader runs each kernel in a fresh temporary folder whose name starts with this (so
every process a submission starts can be told apart; the tests look for leftovers by it)."""

_HEADING = re.compile(r"^#+\s.*?Exercise\s+(\d+\.\d+)", re.M)


# --- the exercises of a chapter -------------------------------------------------------------


@dataclass(frozen=True)
class ExerciseCells:
    """One exercise of a chapter notebook: its number, its names and where its cells are."""

    number: str
    """As its heading says, e.g. ``"1.2"``."""
    stub: str
    """The function the student writes."""
    checker: str
    """The checker the check cell calls."""
    stub_cell: int
    check_cell: int
    solution_cell: int | None
    heading_cell: int | None
    """The markdown cell whose heading names the exercise (its statement)."""

    @property
    def check_source(self) -> str:
        """The check cell as the chapter has it: ``check_f(f)``."""
        return f"{self.checker}({self.stub})"


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def chapter_exercises(nb) -> list[ExerciseCells]:
    """Every exercise of a chapter notebook, in order.

    Raises ``ValueError`` naming the cell when a chapter breaks the three-cell convention
    (a stub without its check, a check that is not ``check_f(f)``, no heading)."""
    out = []
    stub = heading = None
    for i, cell in enumerate(nb.cells):
        tags = _tags(cell)
        if cell.cell_type == "markdown" and _HEADING.search(cell.source):
            heading = i
        if cell.cell_type != "code":
            continue
        if TAG_STUB in tags:
            found = re.search(r"^def\s+(\w+)\s*\(", cell.source, re.M)
            if found is None:
                raise ValueError(f"cell {i}: an exercise stub defines no function")
            stub = (i, found.group(1))
        elif TAG_CHECK in tags:
            call = re.fullmatch(r"\s*(\w+)\((\w+)\)\s*", cell.source)
            if stub is None or call is None or call.group(2) != stub[1]:
                raise ValueError(f"cell {i}: a check cell must be `check_f(f)` right after the "
                                 f"stub of f, got {cell.source!r}")
            if heading is None:
                raise ValueError(f"cell {i}: no 'Exercise N.M' heading before the exercise")
            number = _HEADING.search(nb.cells[heading].source).group(1)
            out.append(ExerciseCells(number, stub[1], call.group(1), stub[0], i, None, heading))
            stub = None
        elif TAG_SOLUTION in tags and out and out[-1].solution_cell is None \
                and f"def {out[-1].stub}_solution" in cell.source:
            last = out[-1]
            out[-1] = ExerciseCells(last.number, last.stub, last.checker, last.stub_cell,
                                    last.check_cell, i, last.heading_cell)
    return out


def chapters(notebooks: Path = NOTEBOOKS) -> list[Path]:
    """The chapter notebooks of a folder (``01_....ipynb`` to ``09_....ipynb``), in order."""
    return sorted(Path(notebooks).glob("[0-9][0-9]_*.ipynb"))


def setup_cell(nb) -> int:
    """The index of a chapter's setup cell: its first code cell after the install cell."""
    return next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and TAG_INSTALL not in _tags(c))


def _cleared(nb):
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def student_edition(nb):
    """The chapter as a student gets it: no solution cells, no outputs; stubs and checks kept."""
    nb = _cleared(nb)
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and TAG_SOLUTION in _tags(c))]
    return nb


def exercises_only(nb):
    """The chapter cut down to its install and setup cells, the cells its exercises refer to
    (tagged ``exercise-context``) and, per exercise, its statement, stub, check and solution
    cells (outputs cleared), in the chapter's order."""
    keep = {i for i, c in enumerate(nb.cells)
            if TAG_INSTALL in _tags(c) or TAG_CONTEXT in _tags(c)} | {setup_cell(nb)}
    for ex in chapter_exercises(nb):
        keep |= {ex.heading_cell, ex.stub_cell, ex.check_cell, ex.solution_cell} - {None}
    out = _cleared(nb)
    out.cells = [c for i, c in enumerate(out.cells) if i in keep]
    return out


def handout(out: Path, notebooks: Path = NOTEBOOKS, only: list[str] | None = None,
            lab_sheet: bool = False) -> list[Path]:
    """Write the student edition of every chapter (``only``: those whose file name starts
    with one of these prefixes, e.g. ``["01", "03"]``) into ``out``; the paths written."""
    import nbformat
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in chapters(notebooks):
        if only and not any(path.name.startswith(p) for p in only):
            continue
        nb = nbformat.read(path, as_version=4)
        edition = student_edition(exercises_only(nb) if lab_sheet else nb)
        nbformat.write(edition, out / path.name)
        written.append(out / path.name)
    return written


# --- nbgrader ---------------------------------------------------------------------------------

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"


def _nbgrader(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution, "task": False}
    if grade:
        meta["points"] = points
    return meta


def _without_final_assert(source: str, checker: str) -> str:
    """A solution cell without its closing ``assert check_f(f_solution)``."""
    lines = source.rstrip().split("\n")
    while lines and not lines[-1].startswith(f"assert {checker}("):
        lines.pop()
    return "\n".join(lines[:-1]).rstrip() if lines else source.rstrip()


def nbgrader_source(nb, module: str, points: int | None = None):
    """The chapter as an nbgrader source notebook (see the module docstring); its checkers
    are those of ``module`` (``tutorial_lib.exercises.ch01``), each test cell grading with
    ``exercises.sealed.graded``."""
    from .exercises import sealed
    exercises = chapter_exercises(nb)
    by_stub = {ex.stub_cell: ex for ex in exercises}
    by_check = {ex.check_cell: ex for ex in exercises}
    solutions = {ex.solution_cell for ex in exercises}
    out = _cleared(nb)
    cells = []
    for i, cell in enumerate(out.cells):
        if i in solutions:
            continue  # moved into the answer cell, between the solution markers
        cell.metadata.pop("nbgrader", None)
        if i in by_stub:
            ex = by_stub[i]
            worked = _without_final_assert(nb.cells[ex.solution_cell].source, ex.checker) \
                if ex.solution_cell is not None else f"{ex.stub}_solution = None"
            cell.source = (f"{cell.source.rstrip()}\n{BEGIN_SOLUTION}\n{worked}\n\n\n"
                           f"{ex.stub} = {ex.stub}_solution\n{END_SOLUTION}")
            cell.metadata["nbgrader"] = _nbgrader(_grade_id(ex, "answer"), solution=True)
        elif i in by_check:
            ex = by_check[i]
            cell.source = sealed.check_cell(module, ex.checker, ex.stub)
            cell.metadata["nbgrader"] = _nbgrader(_grade_id(ex, "check"), grade=True, locked=True,
                                                  points=points_of(ex.number, points))
        else:
            cell.metadata["nbgrader"] = _nbgrader(f"cell-{i:03d}", locked=True)
        cells.append(cell)
    out.cells = cells
    return out


def _grade_id(ex: ExerciseCells, part: str) -> str:
    return f"exercise-{ex.number.replace('.', '-')}-{part}"


def chapter_module(chapter: Path) -> str:
    """The module of a chapter's checkers: ``tutorial_lib.exercises.ch01`` for ``01_...``."""
    return f"tutorial_lib.exercises.ch{Path(chapter).name[:2]}"


def assignment_name(chapter: Path) -> str:
    """The nbgrader assignment of one chapter: ``ch01`` for ``01_communicator_groups``."""
    return f"ch{chapter.name[:2]}"


def write_nbgrader_course(course: Path, notebooks: Path = NOTEBOOKS, only: list[str] | None = None,
                          points: int | None = None, lab_sheet: bool = False,
                          assignment: str | None = None, course_id: str | None = None,
                          exchange: Path | None = None) -> list[Path]:
    """``course/source/<assignment>/<chapter>.ipynb`` for each chapter (one assignment per
    chapter, ``ch01`` ..., unless ``assignment`` names one for all) and the course's
    ``nbgrader_config.py`` beside them (rewritten: this repository's settings, then the
    course id and the exchange folder when given, which ``release_assignment`` and
    ``collect`` need); the notebooks written."""
    import nbformat
    course = Path(course)
    written = []
    for path in chapters(notebooks):
        if only and not any(path.name.startswith(p) for p in only):
            continue
        nb = nbformat.read(path, as_version=4)
        if lab_sheet:
            nb = exercises_only(nb)
        target = course / "source" / (assignment or assignment_name(path)) / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nbgrader_source(nb, chapter_module(path), points), target)
        written.append(target)
    config = Path(__file__).resolve().parents[1] / "nbgrader_config.py"
    text = config.read_text() if config.exists() else "c = get_config()  # noqa: F821\n"
    if course_id:
        text += f"\nc.CourseDirectory.course_id = {course_id!r}\n"
    if exchange:
        Path(exchange).mkdir(parents=True, exist_ok=True)
        text += f"c.Exchange.root = {str(Path(exchange).resolve())!r}\n"
    (course / "nbgrader_config.py").write_text(text)
    return written


# --- grading ------------------------------------------------------------------------------------


@dataclass
class Grade:
    """One row of the grades: a student's result on one exercise."""

    student: str
    notebook: str
    exercise: str
    passed: bool
    points: int
    hint: str
    """Why it failed (the checker's hint, or what broke), empty when it passed."""


def _chapter_of(path: Path, notebooks: Path) -> Path | None:
    for chapter in chapters(notebooks):
        if path.name == chapter.name or path.name[:3] == chapter.name[:3]:
            return chapter
    return None


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _error_of(cell) -> str | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return f"{out.get('ename')}: {out.get('evalue')}"
    return None


def grade_notebook(path: Path, student: str, notebooks: Path = NOTEBOOKS,
                   time_limit: float = TIME_LIMIT, points: int | None = None) -> list[Grade]:
    """Grade one submitted notebook (see the module docstring); one :class:`Grade` per
    exercise of its chapter, or one row saying why the file is not a chapter."""
    import nbformat
    path = Path(path)
    chapter = _chapter_of(path, notebooks)
    if chapter is None:
        return [Grade(student, path.name, "", False, 0,
                      "not a chapter of the course: keep the handout's file name")]
    exercises = chapter_exercises(nbformat.read(chapter, as_version=4))

    def rows(verdicts: dict[str, tuple[bool, str]], missing: str) -> list[Grade]:
        return [Grade(student, path.name, ex.number, *(
            (verdicts[ex.number][0], points_of(ex.number, points) if verdicts[ex.number][0] else 0,
             verdicts[ex.number][1])
            if ex.number in verdicts else (False, 0, missing))) for ex in exercises]

    try:
        submitted = nbformat.read(path, as_version=4)
        nbformat.validate(submitted)
    except Exception as err:  # noqa: BLE001 - not JSON, not a notebook: graded, not raised
        return rows({}, f"the file is not a readable notebook ({type(err).__name__}: "
                        f"{str(err)[:200]})")
    verdicts, deleted = _run_submission(submitted, exercises, time_limit,
                                        chapter_module(chapter))
    for number in deleted:
        verdicts.setdefault(number, (False, "its check cell was deleted"))
    return rows(verdicts, verdicts.pop("", (False, "not graded"))[1])


def _graded_cells(nb, exercises: list[ExerciseCells], handoff: Path):
    """The submission's cells to run, check cells (tagged, or exactly ``check_f(f)`` in a
    notebook that lost its tags) replaced by a cell that writes the exercise's function to
    ``handoff/<number>.pickle`` (:func:`handoff_cell`); the exercises whose check cell is gone;
    and which cell defines each exercise's function."""
    import nbformat
    waiting = list(exercises)
    cells, stub_of = [], {}
    for cell in nb.cells:
        if cell.cell_type != "code" or TAG_SOLUTION in _tags(cell):
            continue
        untagged_check = any(cell.source.strip() == e.check_source for e in waiting)
        if (TAG_CHECK in _tags(cell) or untagged_check) and waiting:
            ex = next((e for e in waiting if e.checker in cell.source), waiting[0])
            waiting.remove(ex)
            cells.append((nbformat.v4.new_code_cell(handoff_cell(ex, handoff)), ex))
            continue
        cells.append((nbformat.v4.new_code_cell(cell.source), None))
        for ex in exercises:
            if re.search(rf"^def\s+{ex.stub}\s*\(", cell.source, re.M):
                stub_of[ex.number] = len(cells) - 1
    return cells, [e.number for e in waiting], stub_of


def handoff_cell(ex: ExerciseCells, handoff: Path) -> str:
    """What the course grader runs in place of a check cell: the function, written to a file
    for the checking interpreter (``exercises.sealed``); no checker runs in the kernel."""
    target = str(Path(handoff) / f"{ex.number}.pickle")
    return ("import cloudpickle as _cloudpickle\n"
            f"with open({target!r}, 'wb') as _file:\n"
            f"    _cloudpickle.dump({ex.stub}, _file)")


def _run_submission(nb, exercises, time_limit: float, module: str):
    """Run the cells of one submission in a fresh kernel, then check the functions it handed
    over with the real checkers of ``module`` (``exercises.sealed.run_checks``);
    ``({number: (passed, hint)}, the numbers whose check cell was deleted)``.  The key ``""``
    holds why the rest was not graded."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from .exercises import sealed

    verdicts: dict[str, tuple[bool, str]] = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    deadline = time.monotonic() + time_limit
    with tempfile.TemporaryDirectory(prefix=WORKDIR_PREFIX) as workdir:
        handoff = Path(workdir) / ".handoff"
        handoff.mkdir()
        cells, deleted, stub_of = _graded_cells(nb, exercises, handoff)
        run = nbformat.v4.new_notebook(cells=[c for c, _ in cells])
        run.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}
        client = NotebookClient(run, timeout=max(1, int(time_limit)), kernel_name="python3",
                                allow_errors=True, shutdown_kernel="immediate",
                                resources={"metadata": {"path": workdir}})
        tree: list[int] = []
        ran = []
        try:
            with client.setup_kernel(env=env, cwd=workdir):
                pid = _kernel_pid(client)
                try:
                    for index, (cell, ex) in enumerate(cells):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise CellTimeoutError("time limit")
                        client.timeout = max(1, int(left))
                        client.execute_cell(cell, index)
                        if ex is not None:
                            ran.append((ex, cell))
                finally:
                    tree = descendants(pid) if pid else []
        except CellTimeoutError:
            verdicts[""] = (False, f"the notebook ran past the time limit of {time_limit:g} s "
                                   "(an endless loop, or a cell that waits forever)")
        except DeadKernelError:
            verdicts[""] = (False, "the kernel died while the notebook ran")
        except Exception as err:  # noqa: BLE001 - a grader reports, it never stops
            verdicts[""] = (False, f"the grader could not run the notebook: "
                                   f"{type(err).__name__}: {err}")
        finally:
            _kill(tree)
        files = {ex.number: handoff / f"{ex.number}.pickle" for ex, _ in ran}
        checks = [(ex.number, module, ex.checker, files[ex.number].read_bytes())
                  for ex, _ in ran if files[ex.number].exists()]
        checked = sealed.run_checks(checks, sealed.library_root(), max(
            CHECK_TIME_MIN, deadline - time.monotonic()), cwd=workdir) if checks else {}
    for ex, cell in ran:
        verdicts[ex.number] = _verdict(checked.get(ex.number), cell, ex, cells, stub_of)
    return verdicts, deleted


def _kernel_pid(client) -> int | None:
    provisioner = getattr(client.km, "provisioner", None)
    process = getattr(provisioner, "process", None)
    return getattr(process, "pid", None)


def _verdict(checked: dict | None, cell, ex: ExerciseCells, cells, stub_of) -> tuple[bool, str]:
    """``(passed, hint)`` of one exercise from its checker's verdict (``None``: there is none,
    and what its hand-off cell raised says why)."""
    if checked is None:
        error = _error_of(cell)
        if error and error.startswith("NameError"):
            return False, f"{error}: its cell raised, was not run or was deleted"
        if error:
            return False, f"the function could not be handed to the checker: {error}"
        return False, "the check gave no verdict (it ran past the time limit)"
    if checked["passed"]:
        return True, ""
    hint = row_hint(checked)
    if ex.number in stub_of:
        error = _error_of(cells[stub_of[ex.number]][0])
        if error:
            hint = f"the cell defining {ex.stub} raised {error}; {hint}"
    return False, hint


def row_hint(verdict: dict) -> str:
    """A verdict that did not pass, as one line of the grades: the first failing case that
    raised (its name, the exception's type and message), then the checker's hint, or else
    every failing case's detail."""
    failing = [c for c in verdict.get("cases", []) if not c["passed"]]
    raised = next((c for c in failing if re.search(r"\braised\b", c["detail"])), None)
    hint = verdict.get("hint", "") or "; ".join(f"{c['name']}: {c['detail']}" for c in failing)
    if raised is not None and raised["detail"] not in hint:
        hint = f"{raised['name']}: {raised['detail']}" + (f"; {hint}" if hint else "")
    return hint


def submission_notebooks(submissions: list[Path]) -> list[tuple[str, Path]]:
    """``(student, notebook)`` for each student folder given (or each student folder inside
    a folder that holds no notebook itself), notebooks in name order."""
    out = []
    for folder in map(Path, submissions):
        if folder.is_file():
            out.append((folder.parent.name, folder))
            continue
        own = sorted(folder.glob("*.ipynb"))
        if own:
            out += [(folder.name, nb) for nb in own]
        else:
            for student in sorted(p for p in folder.iterdir() if p.is_dir()):
                out += [(student.name, nb) for nb in sorted(student.glob("*.ipynb"))]
    return out


def grade(submissions: list[Path], notebooks: Path = NOTEBOOKS, time_limit: float = TIME_LIMIT,
          points: int | None = None, progress=None) -> list[Grade]:
    """Grade every notebook of every student folder (see :func:`submission_notebooks`)."""
    grades = []
    for student, path in submission_notebooks(submissions):
        rows = grade_notebook(path, student, notebooks, time_limit, points)
        if progress:
            progress(student, path, rows)
        grades += rows
    return grades


def write_csv(grades: list[Grade], path: Path) -> None:
    """The grades as CSV: one row per student and exercise (:data:`CSV_COLUMNS`)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for g in grades:
            writer.writerow(asdict(g))


# --- the command line ----------------------------------------------------------------------------


class UsageError(ValueError):
    """A bad value on the command line: the flag, the value, the rule it breaks, a fix."""

    def __init__(self, flag: str, value, rule: str, fix: str):
        super().__init__(f"{flag} {value}: {rule}; {fix}")


def positive_seconds(flag: str, text: str) -> float:
    """``text`` as a finite number of seconds > 0, for ``flag``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise UsageError(flag, text, "must be a finite number of seconds > 0",
                         f"try {flag} {TIME_LIMIT:g}")
    return value


def whole_points(flag: str, text: str | None) -> int | None:
    """``text`` as a whole number of points >= 1 (``None``: the difficulty table's)."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*\d+\s*", str(text)) or int(text) < 1:
        raise UsageError(flag, text, "must be a whole number of points >= 1",
                         f"try {flag} 1, or leave it out for the points of DIFFICULTY "
                         f"({', '.join(f'{k} {v}' for k, v in POINTS_BY_DIFFICULTY.items())})")
    return int(text)


def chapter_folder(flag: str, folder: Path) -> list[Path]:
    """The chapters of ``folder``, which must hold some."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(flag, folder, "is not a folder", f"pass {flag} DIR, the folder of the "
                         "chapter notebooks (01_....ipynb)")
    found = chapters(folder)
    if not found:
        raise UsageError(flag, folder, "holds no chapter notebook (01_....ipynb)",
                         f"pass {flag} DIR, the folder of the chapters")
    return found


def chapter_prefixes(found: list[Path], prefixes: list[str]) -> list[str]:
    """Chapter prefixes (``01``, ``3``...) that each match a chapter of ``found``; as ``01``."""
    names = ", ".join(p.name[:2] for p in found)
    out = []
    for prefix in prefixes:
        if not re.fullmatch(r"\d{1,2}", prefix):
            raise UsageError("CHAPTER", prefix, "is not a chapter number",
                             f"give two-digit chapter numbers: {names}")
        padded = f"{int(prefix):02d}"
        if not any(p.name.startswith(padded) for p in found):
            raise UsageError("CHAPTER", prefix, "matches no chapter", f"choose among {names}")
        out.append(padded)
    return out


def writable_folder(flag: str, folder: Path, notebooks: Path | None = None) -> Path:
    """A folder that exists or can be made, can be written, and is not ``notebooks``."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(flag, folder, "is a file, not a folder", f"pass {flag} a new folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(flag, folder, f"cannot be made: {existing} is not a folder",
                         f"pass {flag} a folder under a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(flag, folder, f"cannot be written ({existing} is not writable)",
                         f"pass {flag} a folder you can write to")
    if notebooks is not None and folder.resolve() == Path(notebooks).resolve():
        raise UsageError(flag, folder, "is the chapters' own folder (it would overwrite the "
                         "chapters and their solutions)", f"pass {flag} another folder")
    return folder


def writable_file(flag: str, path: Path) -> Path:
    """A file that can be written: not a folder, in a folder that exists and is writable."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(flag, path, "is a folder", f"pass {flag} a file name, e.g. {path}/grades.csv")
    if not path.parent.is_dir():
        raise UsageError(flag, path, f"its folder {path.parent} does not exist",
                         f"make the folder first, or pass {flag} grades.csv")
    if not os.access(path.parent, os.W_OK) or path.exists() and not os.access(path, os.W_OK):
        raise UsageError(flag, path, "cannot be written", f"pass {flag} a file you can write")
    return path


def submission_folders(paths: list[Path]) -> list[tuple[str, Path]]:
    """Every ``(student, notebook)`` of the submissions given; each path must exist and be a
    notebook or a folder, and some notebook must be found."""
    for path in map(Path, paths):
        if not path.exists():
            raise UsageError("SUBMISSIONS", path, "does not exist",
                             "pass the folder that holds one folder per student")
        if path.is_file() and path.suffix != ".ipynb":
            raise UsageError("SUBMISSIONS", path, "is a file but not a notebook (.ipynb)",
                             "pass a student's folder or the folder of students' folders")
    found = submission_notebooks(paths)
    if not found:
        raise UsageError("SUBMISSIONS", " ".join(map(str, paths)), "holds no notebook (.ipynb), "
                         "in it or in a folder inside it",
                         "pass the folder that holds one folder per student, each with notebooks")
    return found


def main(argv: list[str] | None = None) -> int:
    """The command line; a bad value exits 2 with the flag, the value and a fix, before
    anything is written or run."""
    parser = argparse.ArgumentParser(prog="python -m tutorial_lib.classroom",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("handout", help="write the student edition of the chapters")
    out.add_argument("--out", required=True, type=Path, help="folder to write the notebooks to")
    out.add_argument("--exercises-only", action="store_true",
                     help="only the setup cell, the exercises and the cells they refer to "
                          "(a lab sheet)")
    out.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the chapters' folder")
    out.add_argument("chapter", nargs="*", help="chapter numbers, e.g. 01 03 (default: all)")
    run = commands.add_parser("grade", help="run the checkers of submitted notebooks")
    run.add_argument("submissions", nargs="+", type=Path,
                     help="one folder per student (its name is the student's), or a folder of them")
    run.add_argument("--csv", required=True, type=Path, help="where to write the grades")
    run.add_argument("--time-limit", default=str(TIME_LIMIT),
                     help=f"seconds per notebook (default {TIME_LIMIT:g})")
    run.add_argument("--points", help="points of every exercise (default: by difficulty, "
                                      "DIFFICULTY and POINTS_BY_DIFFICULTY)")
    run.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the chapters' folder")
    args = parser.parse_args(argv)
    try:
        found = chapter_folder("--notebooks", args.notebooks)
        if args.command == "handout":
            only = chapter_prefixes(found, args.chapter)
            target = writable_folder("--out", args.out, args.notebooks)
        else:
            time_limit = positive_seconds("--time-limit", args.time_limit)
            points = whole_points("--points", args.points)
            target = writable_file("--csv", args.csv)
            submission_folders(args.submissions)
    except UsageError as err:
        print(f"{parser.prog} {args.command}: error: {err}", file=sys.stderr)
        return 2
    if args.command == "handout":
        for path in handout(target, args.notebooks, only, args.exercises_only):
            print(path)
        return 0

    def progress(student, path, rows):
        passed = sum(r.passed for r in rows)
        print(f"{student}/{path.name}: {passed}/{len(rows)} exercises passed", flush=True)

    grades = grade(args.submissions, args.notebooks, time_limit, points, progress)
    write_csv(grades, target)
    print(f"{len(grades)} rows written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
