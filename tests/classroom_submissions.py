"""Submissions as students hand them in, for the grading tests.

Chapter 1's lab sheet (``classroom.exercises_only``: its setup cell and two exercises whose
checkers start no process) keeps a kernel's work to seconds; chapter 7's exercise 7.1 is the
one whose checker launches gloo workers, for the submission that deadlocks.  Answers are
written as source text, as a student types them into the stub cell.
"""
from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from tutorial_lib import classroom

CH01 = classroom.NOTEBOOKS / "01_communicator_groups.ipynb"
CH07 = classroom.NOTEBOOKS / "07_p2p_modes.ipynb"


def worked_solution(chapter: Path, number: str) -> str:
    """The chapter's worked solution of exercise ``number``, written as the stub's function."""
    nb = nbformat.read(chapter, as_version=4)
    ex = next(e for e in classroom.chapter_exercises(nb) if e.number == number)
    source = nb.cells[ex.solution_cell].source
    return source[:source.rindex(f"assert {ex.checker}(")].replace(f"{ex.stub}_solution", ex.stub)


WRONG_1_2 = ("def data_parallel_group(rank, world_size, tp, pp, cp=1):\n"
             "    return [rank]\n")
SYNTAX_ERROR_1_1 = "def rank_to_coords(rank, order, sizes)\n    return {}\n"
ENDLESS_1_2 = "def data_parallel_group(rank, world_size, tp, pp, cp=1):\n    return [rank]\n\n\nwhile True:\n    pass\n"
DEADLOCK_7_1 = '''def my_send_forward_recv_backward(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype=dtype)
    prev = p2p.prev_rank(wrap=True)  # the gradient from the previous stage: the wrong peer
    comm.wait_all(comm.batch_isend_irecv([("send", tensor, peer), ("recv", buffer, prev)],
                                         group="pp"))
    return buffer
'''


GIVES_UP_1_3 = 'def node_crossings():\n    raise RuntimeError("I give up")\n'

#: Wrong answers that try to get a pass by replacing the checker, one trick per exercise of
#: chapter 1 (one notebook, one kernel, three verdicts).
TRICKS = {
    "1.1": ("rebinds the checker's name", """def rank_to_coords(rank, order, sizes):
    return {}


check_rank_to_coords = lambda fn: True
"""),
    "1.2": ("patches the checker's module and its helpers", WRONG_1_2 + """
import tutorial_lib.exercises.ch01 as _ch01
import tutorial_lib.exercises.kit as _kit
_ch01.check_data_parallel_group = lambda fn: None
_kit.CheckResult.passed = property(lambda self: True)
_kit.finish = lambda result: None
_kit.Checking.verdict = lambda self, hint=None: None
"""),
    "1.3": ("replaces tutorial_lib.exercises in sys.modules", """def node_crossings():
    return {}


import sys, types
_fake = types.ModuleType("tutorial_lib.exercises")
_fake.ch01 = types.ModuleType("tutorial_lib.exercises.ch01")
_fake.ch01.check_node_crossings = lambda fn: print("PASS") or None
sys.modules["tutorial_lib.exercises"] = _fake
sys.modules["tutorial_lib.exercises.ch01"] = _fake.ch01
check_node_crossings = _fake.ch01.check_node_crossings
"""),
}


def filled(notebook, answers: dict[str, str], delete_checks: tuple[str, ...] = (),
           keep: tuple[str, ...] | None = None):
    """``notebook`` (a student edition) with the stub of each exercise in ``answers``
    replaced by its text, the check cells of ``delete_checks`` deleted, and (``keep``) only
    those exercises' cells left."""
    nb = copy.deepcopy(notebook)
    exercises = classroom.chapter_exercises(nb)
    drop = set()
    for ex in exercises:
        if ex.number in answers:
            nb.cells[ex.stub_cell].source = answers[ex.number]
        if ex.number in delete_checks:
            drop.add(ex.check_cell)
        if keep is not None and ex.number not in keep:
            drop |= {ex.stub_cell, ex.check_cell, ex.heading_cell}
    nb.cells = [c for i, c in enumerate(nb.cells) if i not in drop]
    return nb


def lab_sheet(chapter: Path):
    """The student edition of a chapter's lab sheet (setup cell and exercises)."""
    return classroom.student_edition(classroom.exercises_only(nbformat.read(chapter, as_version=4)))


def write(folder: Path, student: str, nb, name: str) -> Path:
    path = folder / student / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path
