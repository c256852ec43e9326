"""Every chapter's exercise cells, and the helpers the exercise tests share.

Each exercise in a chapter notebook is three cells: a stub tagged ``exercise-stub``
that ends in ``raise NotImplementedError``, a check tagged ``exercise-check`` that is
exactly ``checker(name)``, and a solution tagged ``solution`` (folded in the book) that
defines ``<name>_solution`` and ends in ``assert checker(<name>_solution)``.

:data:`CHAPTERS` lists them all, one entry per chapter of
:data:`tutorial_lib.chapters.CHAPTERS` that has exercises.
``tests/unit/test_exercises_notebooks.py`` checks the cells and runs the stubs and solutions whose checkers start no process;
``tests/dist/test_exercises_notebooks.py`` runs the ones that launch gloo workers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import comm, moe_balance, p2p
from tutorial_lib.chapters import chapter as registered
from tutorial_lib.deepseek import layer_range
from tutorial_lib.config import ConfigError
from tutorial_lib.exercises import (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09,
                                    ch10, ch11, ch12, ch13)
from tutorial_lib.costs.step_time import Layout, predict_step
from tutorial_lib.memory import heaviest_rank_bytes
from tutorial_lib.plan import MATMUL_EFFICIENCY, plan
from tutorial_lib.recompute import Recompute
from tutorial_lib.pipeline_parallel.actions import Action
from tutorial_lib.pipeline_parallel.schedules import one_f_one_b
from tutorial_lib.viz.table import table

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@dataclass(frozen=True)
class Exercise:
    """One exercise of a chapter notebook."""

    stub: str
    """The function the stub defines; the solution cell defines ``<stub>_solution``."""
    checker: Callable
    """Its checker (the check cell calls it by its ``__name__``)."""
    launches: tuple[str, ...] = ()
    """Which of its runs, ``"stub"`` and ``"solution"``, start gloo workers (they are
    tested in tests/dist)."""
    min_cases: int | None = None
    """The fewest cases its passing checker may have run, when not the chapter's (a
    prediction exercise asks about a few situations, not many shapes)."""


@dataclass(frozen=True)
class Chapter:
    """A notebook's exercises, in notebook order, and what their cells need."""

    number: int
    """The chapter's number (its notebook and checkers are its entry in
    :data:`tutorial_lib.chapters.CHAPTERS`)."""
    exercises: tuple[Exercise, ...]
    setup: dict = field(default_factory=dict)
    """What the notebook's setup cell imports that the exercise cells use (the checkers
    are added by name)."""
    min_cases: int = 3
    """The fewest cases a passing checker of this chapter may have run."""

    @property
    def notebook(self) -> str:
        """The notebook's file name in ``notebooks/``."""
        return registered(self.number).notebook

    @property
    def path(self) -> Path:
        return NOTEBOOKS / self.notebook

    def namespace(self) -> dict:
        return {**self.setup, **{e.checker.__name__: e.checker for e in self.exercises}}


BOTH = ("stub", "solution")  # the checker launches workers before it calls the student's code

CHAPTERS = [
    Chapter(1, (
        Exercise("rank_to_coords", ch01.check_rank_to_coords),
        Exercise("data_parallel_group", ch01.check_data_parallel_group),
        Exercise("node_crossings", ch01.check_node_crossings, min_cases=4),
    ), min_cases=7),
    Chapter(2, (
        Exercise("my_ring_all_gather", ch02.check_ring_all_gather, launches=BOTH),
        Exercise("ring_all_reduce_bytes", ch02.check_ring_all_reduce_bytes, launches=BOTH),
        Exercise("choose_collectives", ch02.check_choose_collectives),
        Exercise("dispatch", ch02.check_dispatch, launches=("solution",)),
    ), {"torch": torch, "comm": comm, "SCENARIOS": ch02.SCENARIOS}),
    Chapter(3, (
        Exercise("row_parallel_linear", ch03.check_row_parallel_linear, launches=BOTH),
        Exercise("gradient_groups", ch03.check_gradient_groups),
        Exercise("step_bytes", ch03.check_step_bytes, launches=("solution",)),
    ), {"torch": torch, "F": F, "comm": comm, "GRADIENT_CASES": ch03.GRADIENT_CASES,
        "StepConfig": ch03.StepConfig}),
    Chapter(4, (
        Exercise("send_splits", ch04.check_send_splits),
        Exercise("gradient_domains", ch04.check_gradient_domains),
        Exercise("layer_bytes_sent", ch04.check_layer_bytes_sent, launches=("solution",)),
    ), {"torch": torch, "table": table, "GRADIENT_DOMAIN_CASES": ch04.GRADIENT_DOMAIN_CASES},
        min_cases=6),
    Chapter(5, (
        Exercise("expert_balance_loss", ch05.check_expert_balance_loss),
        Exercise("biased_topk", ch05.check_biased_topk),
        Exercise("update_bias", ch05.check_update_bias),
        Exercise("blind_routing", ch05.check_blind_routing),
        Exercise("predicted_balance", ch05.check_predicted_balance),
    ), {"torch": torch, "F": F, "moe_balance": moe_balance}),
    Chapter(6, (
        Exercise("my_one_f_one_b", ch06.check_one_f_one_b),
        Exercise("bubble", ch06.check_bubble),
        Exercise("holdings", ch06.check_stage_holdings),
        Exercise("mixed_deadlock", ch06.check_mixed_deadlock),
    ), {"Action": Action, "layer_range": layer_range}),
    Chapter(7, (
        Exercise("my_send_forward_recv_backward", ch07.check_send_forward_recv_backward,
                 launches=BOTH),
        Exercise("send_first", ch07.check_send_first, launches=BOTH),
        Exercise("megatron_p2p_mode", ch07.check_megatron_p2p_mode),
    ), {"torch": torch, "comm": comm, "p2p": p2p}),
    Chapter(8, (
        Exercise("quantize_1x128", ch08.check_quantize_1x128),
        Exercise("payload_bytes", ch08.check_payload_bytes),
        Exercise("keep_ends_in_bf16", ch08.check_keep_ends_in_bf16),
        Exercise("flushed_values", ch08.check_flushed_values),
    ), {"torch": torch, "dataclasses": dataclasses}, min_cases=4),
    Chapter(9, (
        Exercise("merge", ch09.check_merge_partials),
        Exercise("held", ch09.check_held_chunks),
        Exercise("ring_pass_bytes", ch09.check_ring_pass_bytes),
        Exercise("ring_work", ch09.check_ring_work, launches=("solution",)),
    ), {"torch": torch}, min_cases=4),
    Chapter(10, (
        Exercise("dense_layer_bytes", ch10.check_dense_layer_bytes),
        Exercise("smallest_layout", ch10.check_smallest_layout),
    ), {"heaviest_rank_bytes": heaviest_rank_bytes, "Recompute": Recompute,
        "ConfigError": ConfigError}, min_cases=4),
    Chapter(11, (
        Exercise("place_weights", ch11.check_place_weights),
        Exercise("idle_times", ch11.check_idle_times),
    ), {"Action": Action, "one_f_one_b": one_f_one_b}, min_cases=5),
    Chapter(12, (
        Exercise("state_bytes", ch12.check_state_bytes),
        Exercise("backward_gathers", ch12.check_backward_gathers),
    ), min_cases=6),
    Chapter(13, (
        Exercise("pick_layout", ch13.check_pick_layout),
        Exercise("tp_stops_paying", ch13.check_tp_stops_paying),
    ), {"Layout": Layout, "plan": plan, "predict_step": predict_step, "ConfigError": ConfigError,
        "MATMUL_EFFICIENCY": MATMUL_EFFICIENCY}),
]


def tagged_cells(notebook: Path, tag: str) -> list[str]:
    import nbformat  # here: gloo workers import this module to unpickle its functions,
    # and nbformat's schema checks take over a second to import
    nb = nbformat.read(notebook, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def run_cell(notebook: Path, source: str, namespace: dict) -> dict:
    """Execute one cell's source with ``namespace`` standing in for the setup cell's imports."""
    namespace = dict(namespace)
    exec(compile(source, str(notebook), "exec"), namespace)
    return namespace


def exercise_cell_tests(*, launching: bool):
    """The tests every chapter's exercises must pass; assign them to module names.

    ``launching``: run the stubs and solutions whose checkers start gloo workers (for
    tests/dist), or the others (for tests/unit, which also checks the cells).
    """
    runs = [(chapter, index) for chapter in CHAPTERS for index in range(len(chapter.exercises))]

    def params(run: str):
        return [pytest.param(chapter, index, id=f"{chapter.notebook[:2]}-{chapter.exercises[index].stub}")
                for chapter, index in runs if (run in chapter.exercises[index].launches) == launching]

    @pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda chapter: chapter.notebook[:2])
    def test_notebook_has_the_three_cells_of_each_exercise(chapter):
        stubs, checks, solutions = (tagged_cells(chapter.path, tag)
                                    for tag in ("exercise-stub", "exercise-check", "solution"))
        assert len(stubs) == len(checks) == len(solutions) == len(chapter.exercises)
        for exercise, stub, check, answer in zip(chapter.exercises, stubs, checks, solutions):
            name, checker = exercise.stub, exercise.checker.__name__
            assert f"def {name}(" in stub
            assert stub.rstrip().endswith("raise NotImplementedError")
            assert check.strip() == f"{checker}({name})"
            assert answer.rstrip().endswith(f"assert {checker}({name}_solution)")

    @pytest.mark.parametrize("chapter,index", params("stub"))
    def test_stub_fails_with_the_stub_hint(chapter, index):
        exercise = chapter.exercises[index]
        cell = tagged_cells(chapter.path, "exercise-stub")[index]
        stub = run_cell(chapter.path, cell, chapter.namespace())[exercise.stub]
        result = exercise.checker(stub)  # must not raise
        assert not result.passed
        assert "NotImplementedError" in result.hint
        assert "Hint:" in str(result) and "NotImplementedError" in result._repr_html_()

    @pytest.mark.parametrize("chapter,index", params("solution"))
    def test_solution_cell_passes(chapter, index):
        exercise = chapter.exercises[index]
        # the cell ends in `assert checker(solution)`: running it is the first check
        cell = tagged_cells(chapter.path, "solution")[index]
        defined = run_cell(chapter.path, cell, chapter.namespace())
        result = exercise.checker(defined[f"{exercise.stub}_solution"])
        assert result.passed, str(result)
        least = chapter.min_cases if exercise.min_cases is None else exercise.min_cases
        assert len(result.cases) >= least and "PASS" in str(result)

    if launching:
        return test_stub_fails_with_the_stub_hint, test_solution_cell_passes
    return (test_notebook_has_the_three_cells_of_each_exercise, test_stub_fails_with_the_stub_hint,
            test_solution_cell_passes)


def assert_hint(result, hint: str) -> None:
    """The checker failed and gave exactly ``hint``, which its printed result shows."""
    assert not result.passed
    assert result.hint == hint, str(result)
    assert hint in str(result)


def assert_staged_hint(check, wrong, nudge: str, specific: str) -> None:
    """``check(wrong)`` fails with ``nudge`` the first time and with ``specific`` when the
    same cases fail again (the kit's staged hints, counted per process)."""
    assert_hint(check(wrong), nudge)
    assert_hint(check(wrong), specific)


def assert_reason(result, situation: str, reason: str) -> None:
    """Only ``situation`` failed, and the hint names it and gives ``reason``."""
    assert not result.passed
    assert [c.name for c in result.cases if not c.passed] == [situation]
    assert result.hint.startswith(f"{situation}: ") and reason in result.hint, result.hint


def raising(error: Exception):
    """A student's answer that raises ``error`` whatever it is given."""
    def answer(*args, **kwargs):
        raise error
    return answer


def answers_checker_tests(checker, garbage: list, error: Exception):
    """Two tests for a checker of ``fn() -> {situation: answer}``; assign them to module names.

    Garbage instead of the dict fails with a hint, and ``fn`` raising ``error`` becomes a
    failed case that names it: the checker never raises.
    """
    @pytest.mark.parametrize("garbage", garbage)
    def test_never_raises_on_garbage(garbage):
        result = checker(lambda: garbage)
        assert not result.passed and result.hint

    def test_turns_an_exception_into_a_case():
        result = checker(raising(error))
        assert not result.passed and f"raised {type(error).__name__}" in result.cases[0].detail

    return test_never_raises_on_garbage, test_turns_an_exception_into_a_case


def hint_cases(pairs: list, ids=None):
    """Parametrize a test over ``(wrong answer, its hint)`` pairs, named after the answers."""
    return pytest.mark.parametrize("wrong,hint", pairs,
                                   ids=ids or (lambda value: getattr(value, "__name__", "hint")))
