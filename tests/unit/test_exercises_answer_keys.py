"""No checker hands out its answer key. Every exercise whose checker starts no
process, fed empty, constant and typical-mistake answers: no failing case shows its
reference answer, nothing reads "expected <value>", and every hint is one of the checker's
fixed hints (tests/answer_keys.py; the checkers that launch workers: tests/dist). The
answers-per-situation checkers build a reason for each wrong answer: every reason of every
wrong choice, at every stage, is checked not to name the right one."""
from __future__ import annotations

import re

import pytest

from ..answer_keys import (KEYS, assert_keeps_its_key, collective_whys, compact, domain_whys,
                           fail_five_times, group_whys, key_params, solution_pieces,
                           solution_pieces_of, why_names_the_answer, worked_solutions)
from tests.asserts import every


@pytest.mark.parametrize("key,label", key_params(launching=False))
def test_no_checker_shows_the_answer_to_an_unsolved_case(key, label):
    assert_keeps_its_key(key, label)


@pytest.mark.parametrize("whys", [collective_whys, group_whys, domain_whys],
                         ids=["2.3", "3.2", "4.2"])
def test_no_reason_for_a_wrong_choice_names_the_right_one(whys):
    """2.3 said "a reduce-scatter delivers it at half the cost" to the student who chose an
    all-reduce, 3.2 "Name the groups: here ['dp']", 4.2 "divide by DP = 8"."""
    leaks = [(case, given, named) for case, given, why, answer in whys()
             if (named := why_names_the_answer(why, answer))]
    assert not leaks, leaks[:5]


def test_every_exercise_of_every_chapter_has_an_answer_key():
    """The leak test covers every exercise: one key per exercise the chapters hold (read from
    their cell tags, so a new exercise without a key fails here), each with at least two
    wrong answers to try. The keys of the predict-then-run exercises live beside their
    worked answers, in tests/unit/test_exercises_predictions.py."""
    import nbformat

    from tutorial_lib import classroom
    from tutorial_lib.chapters import notebook_paths

    from ..answer_keys import KEYS as CHECKER_KEYS
    from .test_exercises_predictions import KEYS as PREDICTION_KEYS

    def number(key):
        return tuple(int(part) for part in key.exercise.split("."))

    KEYS = sorted(CHECKER_KEYS + PREDICTION_KEYS, key=number)
    numbers = [ex.number for path in notebook_paths()
               for ex in classroom.chapter_exercises(nbformat.read(path, as_version=4))]
    assert [key.exercise for key in KEYS] == numbers
    assert every(len(key.answers) >= 2 for key in KEYS), [k.exercise for k in KEYS if len(k.answers) < 2]


def _every_key() -> dict[str, dict]:
    """The choice keys the library keeps as digests, and the worked answers of the
    predict-then-run exercises (the library computes those by running the workers)."""
    from ..answer_keys import CHOICE_KEYS
    from . import test_exercises_predictions as predictions
    return {**CHOICE_KEYS, "1.3": predictions.CROSSINGS, "5.5": predictions.BALANCE,
            "6.4": predictions.DEADLOCKS, "8.4": predictions.FLUSHED, "9.4": predictions.WORK,
            "2.4": predictions.ARRIVED}


def test_no_answer_key_can_be_read_off_the_library():
    """Every object reachable from tutorial_lib (module globals of every submodule, class
    attributes, closures, defaults and code constants of the checkers) is searched for a
    table of each key's answers: 2.3, 3.2 and 4.2 shipped theirs as data (SCENARIOS[name][1])."""
    from ..answer_keys import keys_read_off, library_objects
    objects = list(library_objects())
    assert len(objects) > 10_000  # the walk reached into the library
    assert keys_read_off(_every_key(), objects) == []


def test_the_search_finds_a_key_held_as_data_or_in_a_closure(monkeypatch):
    """The search above can fail: a table like the old SCENARIOS, as a module global, or
    held only by a checker's closure, is found."""
    from tutorial_lib.exercises import ch02, ch03

    from ..answer_keys import COLLECTIVE_KEY, GROUPS_KEY, keys_read_off, library_objects
    table = {name: (text, COLLECTIVE_KEY[name]) for name, text in ch02.SCENARIOS.items()}
    monkeypatch.setattr(ch02, "OLD_SCENARIOS", table, raising=False)
    groups = {name: sorted(g) for name, g in GROUPS_KEY.items()}
    monkeypatch.setattr(ch03, "check_old", (lambda: lambda fn: groups)(), raising=False)
    found = {exercise for exercise, _ in keys_read_off(_every_key(), library_objects())}
    assert found == {"2.3", "3.2"}


def test_the_digests_are_of_the_keys_and_the_checkers_pass_the_keys():
    from tutorial_lib.exercises import ch02, ch03, ch04, kit

    from ..answer_keys import COLLECTIVE_KEY, DOMAINS_KEY, GROUPS_KEY
    assert ch02.SCENARIO_DIGESTS == {n: kit.answer_digest("2.3", n, op)
                                     for n, op in COLLECTIVE_KEY.items()}
    assert ch03.GRADIENT_DIGESTS == {n: kit.answer_digest("3.2", n, kit.group_text(g))
                                     for n, g in GROUPS_KEY.items()}
    assert ch04.GRADIENT_DOMAIN_DIGESTS == {
        n: kit.answer_digest("4.2", n, f"{kit.group_text(g)}/{d}") for n, (g, d) in DOMAINS_KEY.items()}
    assert list(ch02.SCENARIOS) == list(COLLECTIVE_KEY)
    assert every(isinstance(text, str) for text in ch02.SCENARIOS.values())  # statements only
    assert ch02.check_choose_collectives(lambda: COLLECTIVE_KEY)
    assert ch03.check_gradient_groups(lambda: GROUPS_KEY)
    assert ch04.check_gradient_domains(lambda: DOMAINS_KEY)


# --- hints stop at the text ---------------------------------------------------------------------


def _hint_texts(module) -> list[tuple[str, str]]:
    """Every hint text a chapter's checkers can give: each stage of each ``Mistakes`` table
    and of each ``HINT_*`` constant, and every text of a table of reasons (a dict of texts)."""
    from tutorial_lib.exercises import kit
    out = []
    for name, value in vars(module).items():
        if isinstance(value, kit.Mistakes):
            out += [(name, t) for t in value.generic]
            out += [(f"{name}.{m.name}", t) for m in value for t in m.stages]
        elif name.startswith("HINT") and isinstance(value, (str, tuple)):
            out += [(name, t) for t in kit.stages_of(value)]
        elif isinstance(value, dict) and value and all(isinstance(v, (str, tuple))
                                                       for v in value.values()):
            out += [(f"{name}[{k!r}]", t) for k, v in value.items()
                    for t in ((v,) if isinstance(v, str) else v) if isinstance(t, str)]
    return out


def test_no_hint_shows_the_worked_solutions_code_or_formula():
    """8.1's generic hint was the solution's code, 7.3's the two-step formula, 9.1's the
    merge's code: no stage of any hint of a chapter holds a line or a formula of that
    chapter's worked solutions."""
    import importlib
    by_chapter: dict[str, set[str]] = {}
    for number, source in worked_solutions():
        by_chapter.setdefault(number.split(".")[0], set()).update(solution_pieces(source))
    shown = []
    for chapter, pieces in by_chapter.items():
        module = importlib.import_module(f"tutorial_lib.exercises.ch{int(chapter):02d}")
        for name, text in _hint_texts(module):
            shown += [(name, piece) for piece in pieces if piece in compact(text)]
    assert not shown, shown[:10]


def test_the_search_for_solution_pieces_finds_a_leak():
    pieces = solution_pieces("def f_solution(n, b):\n    sent = 2 * (n - 1) * b\n"
                             "    return sent // n\n")
    assert "2*(n-1)*b" in pieces
    assert any(p in compact("a rank sends 2 * (n - 1) * b bytes") for p in pieces)
    # a formula built from names assigned before is found written out in one piece
    # (2.2's hint once printed `2 * (n - 1) * nbytes // n`, the solution's steps * nbytes // n)
    assert "2*(n-1)*b//n" in pieces
    assert "2*(n-1)*nbytes//n" in solution_pieces(
        "def g(nbytes, n):\n    steps = 2 * (n - 1)\n    return steps * nbytes // n\n")


def test_every_section_a_hint_sends_back_to_is_a_heading_of_its_chapter():
    """A last stage names the section to re-read: each ``re-read 'X'`` of a chapter's hints
    is a heading of that chapter (or of a chapter the hint names: "chapter 2")."""
    import importlib

    import nbformat

    from tutorial_lib.chapters import notebook_paths

    headings = {}
    for path in notebook_paths():
        chapter = int(path.name.split("_")[0])
        nb = nbformat.read(path, as_version=4)
        headings[chapter] = {line.lstrip("#").strip() for cell in nb.cells
                             if cell.cell_type == "markdown"
                             for line in cell.source.split("\n") if line.startswith("#")}
    wrong = []
    for chapter in headings:
        module = importlib.import_module(f"tutorial_lib.exercises.ch{chapter:02d}")
        for name, text in _hint_texts(module):
            named = {chapter} | {int(n) for n in re.findall(r"chapter (\d+)", text)}
            titles = set().union(*(headings.get(c, set()) for c in named))
            for start in (m.end() for m in re.finditer(r"[Rr]e-read '", text)):
                rest = text[start:]
                while True:  # 'A' and 'B': every quoted title, apostrophes and all
                    title = max((t for t in titles if rest.startswith(t + "'")), key=len,
                                default=None)
                    if title is None:
                        wrong.append((chapter, name, rest[:40]))
                        break
                    rest = rest[len(title) + 1:]
                    if not rest.startswith(" and '"):
                        break
                    rest = rest[len(" and '"):]
    assert not wrong, wrong


@pytest.mark.parametrize("key", [k for k in KEYS if not k.launches], ids=lambda k: k.exercise)
def test_five_failures_in_a_row_never_reach_the_solution(key):
    """Each exercise's reference cases, failed five times in a row with each wrong answer:
    the hints move through their stages, and no output shows a failing case's answer, the
    worked solution's code or formula, or (2.3, 3.2, 4.2) the key. (The checkers that
    launch workers: tests/dist/test_exercises_answer_keys.py.)"""
    from ..answer_keys import CHOICE_KEYS, output_of

    def still_keeps_its_key(label, fifth):
        if key.exercise in CHOICE_KEYS:  # the last stage of every reason, too
            for name, answer in CHOICE_KEYS[key.exercise].items():
                if isinstance(answer, frozenset) and len(answer) > 1:
                    assert repr(sorted(answer)) not in output_of(fifth)
        assert_keeps_its_key(key, label, fifth)  # after five failures, still no case's answer

    fail_five_times(key, key.answers, solution_pieces_of(key.exercise), then=still_keeps_its_key)
