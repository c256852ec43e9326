"""The exercise kit: what every chapter's checker is built from.

A checker is its cases, its reference and its mistakes.  The kit holds the rest:

* :class:`Case` and :class:`CheckResult`: one input tried, and the verdict the student
  sees (it prints itself in a notebook, and is truthy only when every case passed).
* :class:`Checking`: one run of a checker.  It runs the student's code on each case,
  here (:meth:`Checking.run`) or on real gloo ranks (:meth:`Checking.run_on_ranks`),
  turning a stub that still raises ``NotImplementedError``, an exception, an exception
  on one rank (``WorkerError``) and a deadlock (``LaunchTimeout``) into failed cases;
  it collects the named mistakes each failing case shows, and
  :meth:`Checking.verdict` picks the hint.
* :class:`Mistakes`: a checker's named mistakes, each with its hint, in order of
  preference, and the hint for a failure none of them explains.  A hint may come in
  stages, ``("a nudge", "more specific")``: a case that fails for the first time gets
  the first, a case that failed the time before too gets the next (the kernel keeps
  count, :func:`forget_attempts` starts over).
* :func:`check_answers`: the whole checker for exercises whose answer is a dict with
  one entry per situation.
* Normalizers that read a student's answer however it was spelled:
  :func:`as_number`, :func:`as_whole_numbers`, :func:`as_rank_list`,
  :func:`as_group_kinds`, :func:`is_close`; and :func:`deadlock_kind` /
  :func:`deadlock_summary` to read a launcher's deadlock report.

A checker never raises because the student's code did, and it never prints the
reference's answer to a case the student has not solved: a failing case says what is
wrong with the student's answer and why, not what the answer should have been.  Under
nbgrader's autograder and validator (``NBGRADER_EXECUTION`` set) a checker that did not
pass raises :class:`ExerciseNotPassed`, so the check cell fails and scores no points, and
one that passed prints its verdict (:func:`finish`); in the book and in a plain notebook it
only shows its verdict.
"""
from __future__ import annotations

import hashlib
import html
import itertools
import math
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..launch import LaunchTimeout, StartupTimeout, WorkerError, launch

STUB_HINT = "replace the `raise NotImplementedError` line with your implementation, then re-run this cell."
"""The hint whenever an attempt hit a stub that was not filled in yet."""


# --- cases and the verdict ------------------------------------------------------------


@dataclass
class Case:
    """One input the student's code was run on."""

    name: str
    """What was tried, e.g. ``"world_size=3"``."""
    passed: bool
    """Whether the student's answer matched the reference."""
    detail: str = ""
    """For a failure: what came back and what is wrong with it (never the reference's
    answer: the student has not solved this case yet)."""


@dataclass
class CheckResult:
    """The verdict of a checker: every case, and the hints for what failed."""

    exercise: str
    """The exercise's title."""
    cases: list[Case] = field(default_factory=list)
    """Every case tried, in order."""
    hint: str = ""
    """What the failures suggest is wrong, and how to think about it: one hint per line
    when several apply."""

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def hints(self) -> list[str]:
        """Each hint of :attr:`hint` (one per line)."""
        return [h for h in self.hint.split("\n") if h.strip()]

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        """The verdict as plain data (what a grader records): exercise, passed, hint, cases."""
        return {"exercise": self.exercise, "passed": self.passed, "hint": self.hint,
                "cases": [{"name": c.name, "passed": c.passed, "detail": c.detail}
                          for c in self.cases]}

    def __str__(self) -> str:
        if self.passed:
            return f"PASS {self.exercise}: all {len(self.cases)} cases agree with the reference."
        lines = [f"NOT YET {self.exercise}: "
                 f"{sum(c.passed for c in self.cases)}/{len(self.cases)} cases pass."]
        for c in self.cases:
            if not c.passed:
                lines.append(f"  - {c.name}: {c.detail}")
        lines += [f"Hint: {h}" for h in self.hints]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """A box that reads as a result when every case passes, and otherwise as an
        invitation: whose turn it is, what the cases found, the hint, where the solution is.
        (In the built book the stubs are unfilled, so this is what every checker shows.)"""
        e = html.escape
        box = ("border:1px solid {edge};border-left:4px solid {bar};background:{bg};"
               "border-radius:6px;padding:8px 12px;margin:4px 0;font-size:14px;"
               "line-height:1.45;overflow-wrap:anywhere")
        if self.passed:
            style = box.format(edge="#b7dfc2", bar="#1a7f37", bg="#f2faf4")
            return (f'<div class="tl-check" data-passed="true" style="{style}">'
                    f"<b>Passed: {e(self.exercise)}</b>. All {len(self.cases)} cases agree "
                    "with the reference.</div>")
        style = box.format(edge="#c8d7ea", bar="#4e79a7", bg="#f3f7fc")
        passing = sum(c.passed for c in self.cases)
        failing = "".join(f"<li><code>{e(c.name)}</code>: {e(c.detail)}</li>"
                          for c in self.cases if not c.passed)
        hint = "".join(f'<div style="margin-top:4px"><b>Hint:</b> {e(h)}</div>' for h in self.hints)
        return (f'<div class="tl-check" data-passed="false" style="{style}">'
                f'<div style="font-weight:600">Your turn: {e(self.exercise)}</div>'
                f"<div>{passing} of {len(self.cases)} cases pass so far. Complete the function "
                "in the cell above, run it, then run this check again; a worked solution "
                "follows, folded.</div>"
                f'<ul style="margin:4px 0 0;padding-left:1.3em">{failing}</ul>{hint}</div>')


class ExerciseNotPassed(AssertionError):
    """Raised by a checker that did not pass while nbgrader grades or validates the notebook
    (``NBGRADER_EXECUTION`` is set), so that the check cell fails; the message is the
    verdict the student would have seen."""

    def __init__(self, result: CheckResult):
        super().__init__(str(result))
        self.result = result


GRADING_ENVIRONMENT = "NBGRADER_EXECUTION"
"""nbgrader sets it (``autograde`` or ``validate``) in the kernels it runs notebooks in."""


def grading() -> bool:
    """Whether this kernel runs under nbgrader's autograder or validator."""
    return bool(os.environ.get(GRADING_ENVIRONMENT))


def run_case(name: str, attempt: Callable[[], object], expected: object,
             compare: Callable[[object, object], bool] | None = None) -> tuple[Case, object]:
    """Run ``attempt()``; a :class:`Case` comparing its value with ``expected``, and the value.

    The value is the exception itself when the attempt raised, so checkers can
    recognise a stub (``NotImplementedError``) and give the right hint.  A failing case's
    detail shows what came back, never ``expected``: the checker adds what is wrong.
    """
    compare = compare or (lambda got, want: got == want)
    try:
        got = attempt()
    except NotImplementedError as err:
        return Case(name, False, "the stub still raises NotImplementedError: fill in its body"), err
    except Exception as err:  # noqa: BLE001 - the student's bug becomes a readable case
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Case(name, False, f"raised {last}"), err
    try:
        same = bool(compare(got, expected))
    except Exception:  # noqa: BLE001 - an answer the comparison cannot even read is wrong
        same = False
    if same:
        return Case(name, True), got
    return Case(name, False, f"got {_short(got)}, which is not the reference's answer"), got


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- staged hints: what this kernel remembers of earlier attempts ----------------------------

_ATTEMPTS: dict[str, dict[str, int]] = {}
"""exercise -> case name -> how many verdicts in a row that case failed (this kernel)."""


def stages_of(hint) -> tuple[str, ...]:
    """A hint's stages: ``"text"`` -> ``("text",)``; a tuple or list as it is."""
    if isinstance(hint, str):
        return (hint,)
    stages = tuple(hint)
    if not stages or not all(isinstance(s, str) for s in stages):
        raise ValueError(f"a hint is a text or a tuple of texts, not {hint!r}")
    return stages


def at_stage(hint, stage: int) -> str:
    """The text of ``hint`` at ``stage`` (its last stage once the stages run out)."""
    stages = stages_of(hint)
    return stages[min(max(stage, 0), len(stages) - 1)]


def failed_before(exercise: str, case: str) -> int:
    """How many verdicts in a row, before this one, found ``case`` of ``exercise`` failing."""
    return _ATTEMPTS.get(exercise, {}).get(case, 0)


def remember(result: CheckResult) -> None:
    """Count this verdict: a failing case's count goes up, a passing case's goes back to 0."""
    counts = _ATTEMPTS.setdefault(result.exercise, {})
    for c in result.cases:
        counts[c.name] = counts.get(c.name, 0) + 1 if not c.passed else 0


def forget_attempts(exercise: str | None = None) -> None:
    """Start the staged hints over: for one exercise, or (``None``) for all of them."""
    if exercise is None:
        _ATTEMPTS.clear()
    else:
        _ATTEMPTS.pop(exercise, None)


# --- named mistakes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mistake:
    """One classic wrong answer: how to recognise it is the checker's business, what to
    tell its author."""

    name: str
    """How the checker calls it, e.g. ``"slowest_first"``."""
    stages: tuple[str, ...]
    """What to tell the student whose answer shows it: the first stage at a case's first
    failure, the next ones when the same case fails again."""
    any_case: bool = False
    """Named as soon as one failing case shows it (a wrong format, an exception);
    otherwise named only when it explains every failing case."""

    @property
    def hint(self) -> str:
        """The first stage."""
        return self.stages[0]


class Mistakes:
    """A checker's named mistakes in order of preference, and its generic hint.

    ``Mistakes(generic, any_case={"format"}, format=HINT_FORMAT, two_b=HINT_TWO_B, ...)``:
    the keywords name the mistakes, in order; ``any_case`` lists those named as soon as
    one failing case shows them (``True``: all of them).  Two names may share a hint.  Any
    hint, the generic one included, may be a tuple of stages (see :func:`stages_of`).
    ``single``: name only the first mistake that applies, for a checker whose diagnoses
    of one wrong answer may differ from case to case (the first is the root cause).
    """

    def __init__(self, generic, *, any_case: Iterable[str] | bool = (), single: bool = False,
                 **hints):
        any_case = set(hints) if any_case is True else set(any_case or ())
        unknown = any_case - set(hints)
        if unknown:
            raise ValueError(f"any_case names mistakes that have no hint: {sorted(unknown)}")
        self.generic = stages_of(generic)
        """The hint's stages when no named mistake explains the failures."""
        self.entries = tuple(Mistake(name, stages_of(hint), name in any_case)
                             for name, hint in hints.items())
        """Every :class:`Mistake`, in order of preference."""
        self.single = single
        """Whether only the first mistake that applies is named."""

    def __iter__(self):
        return iter(self.entries)

    def __contains__(self, name: str) -> bool:
        return any(m.name == name for m in self.entries)

    def hint_of(self, name: str, stage: int = 0) -> str:
        """The hint of the mistake called ``name`` (at ``stage``)."""
        for m in self.entries:
            if m.name == name:
                return at_stage(m.stages, stage)
        raise KeyError(name)

    def chosen(self, failing: list[set[str]]) -> list[Mistake | None]:
        """Every mistake that applies to the failing cases (each given as the set of
        mistake names it shows), in order of preference; ``None`` stands for the generic.

        The first mistake that every failing case shows explains them all: it alone.
        Otherwise each ``any_case`` mistake that one failing case shows; then, among the
        failing cases none of those explains, the first other mistake (in order of
        preference) that every one of them shows, or else the generic hint.
        """
        if not failing:
            return [None]
        shown_by_every = set.intersection(*(set(f) for f in failing))
        first = next((m for m in self.entries if m.name in shown_by_every), None)
        if first is not None:
            return [first]
        out = [m for m in self.entries if m.any_case and any(m.name in f for f in failing)]
        named = {m.name for m in out}
        rest = [set(f) for f in failing if not named & set(f)]
        if rest:
            shown_by_all = set.intersection(*rest)
            first = next((m for m in self.entries if not m.any_case and m.name in shown_by_all), None)
            out.append(first)
        unique, said = [], set()  # two names may share a hint: say it once
        for m in out:
            key = None if m is None else m.stages
            if key not in said:
                said.add(key)
                unique.append(m)
        return unique[:1] if self.single else unique

    def hint(self, failing: list[set[str]], generic=None, stage: int = 0) -> str:
        """The hints for failing cases (see :meth:`chosen`), one per line, at ``stage``;
        ``generic`` replaces the table's own generic hint."""
        generic = self.generic if generic is None else stages_of(generic)
        return "\n".join(at_stage(generic if m is None else m.stages, stage)
                         for m in self.chosen(failing))


# --- one run of a checker ---------------------------------------------------------------


HINT_RUN_FAILED = (
    "the checker's own run of the workers failed (a busy machine can time it out), so "
    "nothing was compared: run the check cell again."
)
"""The hint of a predict-then-run checker whose own run failed (:meth:`Checking.reference_run`)."""


RETRY_TIMEOUT_FACTOR = 4.0
"""A case on ranks that runs past its timeout is run once more with this many times the
limit before it counts as a deadlock, so that a right answer on a busy machine is not failed
(``0``: no second run)."""


def retry_limits(timeout: float) -> list[float]:
    """The launcher timeouts a launch of a checker gets: ``timeout``, then (unless
    :data:`RETRY_TIMEOUT_FACTOR` is 0) that many times longer."""
    return [timeout] + ([timeout * RETRY_TIMEOUT_FACTOR] if RETRY_TIMEOUT_FACTOR else [])


def launch_retrying(worker: Callable, world_size: int, *, args: tuple = (), timeout: float):
    """``launch(worker, world_size, args=args, timeout=timeout)`` without printing, run once
    more with the longer limit of :func:`retry_limits` when it times out or its ranks do not
    start in time: a busy machine, or a deadlock, and the longer limit tells them apart.  The
    second :class:`~tutorial_lib.launch.LaunchTimeout` (or ``StartupTimeout``) is raised;
    any other error at once.  Every launch of a checker goes through here, the student's
    code on ranks (:meth:`Checking.run_on_ranks`) and the checkers' own measuring runs."""
    limits = retry_limits(timeout)
    for limit in limits:
        try:
            return launch(worker, world_size, args=args, timeout=limit, print_output=False)
        except (LaunchTimeout, StartupTimeout):
            if limit == limits[-1]:
                raise


class Checking:
    """One run of a checker: its cases, the mistakes its failing cases show, its verdict.

        check = Checking("Exercise 1.1: rank_to_coords", MISTAKES)
        for ...:
            case, got = check.run(name, lambda: fn(...), want)
            if check.stub:
                break
            if not case.passed:
                check.shows({name for name, model in models if ...})
        return check.verdict()
    """

    def __init__(self, exercise: str, mistakes: Mistakes | None = None):
        self.result = CheckResult(exercise)
        """The result being built; :meth:`verdict` adds its hint."""
        self.mistakes = mistakes
        """The checker's named mistakes (``None`` when it chooses its hint itself)."""
        self.failing: list[set[str]] = []
        """For each failing case that was judged, the names of the mistakes it shows."""
        self.stub = False
        """Whether some attempt hit a stub that still raises ``NotImplementedError``."""
        self.decided = None
        """A hint the opening already chose (:meth:`prediction`), for :meth:`verdict`."""

    @property
    def cases(self) -> list[Case]:
        return self.result.cases

    @property
    def stage(self) -> int:
        """Which stage of the hints this verdict gives: how many verdicts in a row before
        this one found a case that fails now failing too (the most of any such case)."""
        exercise = self.result.exercise
        return max((failed_before(exercise, c.name) for c in self.cases if not c.passed), default=0)

    def attempt(self, name: str, attempt: Callable[[], object], expected: object = None,
                compare: Callable[[object, object], bool] | None = None) -> tuple[Case, object]:
        """:func:`run_case`, noting a stub; the case is not recorded (see :meth:`add`)."""
        case, got = run_case(name, attempt, expected, compare)
        if isinstance(got, NotImplementedError):
            self.stub = True
        return case, got

    def run(self, name: str, attempt: Callable[[], object], expected: object = None,
            compare: Callable[[object, object], bool] | None = None) -> tuple[Case, object]:
        """Run ``attempt()`` as one case and record it; ``(case, value or exception)``."""
        case, got = self.attempt(name, attempt, expected, compare)
        self.add(case)
        return case, got

    def run_on_ranks(self, name: str, worker: Callable, world_size: int, *, args: tuple = (),
                     timeout: float, expected: object = None,
                     compare: Callable[[object, object], bool] | None = None,
                     unpack: Callable | None = None) -> tuple[Case, object]:
        """Launch ``worker(ctx, *args)`` on ``world_size`` gloo ranks as one case; record it.

        The value is ``unpack(launch_result)`` (the launch result itself by default),
        compared with ``expected``; or what went wrong, with the case's detail set:
        ``NotImplementedError`` when the student's code on some rank is still a stub,
        :class:`~tutorial_lib.launch.WorkerError` (``"rank r raised ..."``),
        :class:`~tutorial_lib.launch.LaunchTimeout` (``"deadlocked after t s, and again after
        4t s (rank 0: waiting in recv from rank 1; ...)"``: a launch that times out, or whose
        ranks do not start in time, is run once more, with :data:`RETRY_TIMEOUT_FACTOR` times
        the limit), or any other exception.
        """
        limits = retry_limits(timeout)

        def attempt():
            try:
                out = launch_retrying(worker, world_size, args=args, timeout=timeout)
            except WorkerError as err:
                if err.summary.startswith("NotImplementedError"):
                    raise NotImplementedError from None
                raise
            return out if unpack is None else unpack(out)

        case, got = self.run(name, attempt, expected, compare)
        if isinstance(got, LaunchTimeout):
            again = f", and again after {limits[-1]:g} s" if len(limits) > 1 else ""
            case.detail = (f"deadlocked after {timeout:g} s{again} "
                           f"({deadlock_summary(got.report)})")
        elif isinstance(got, WorkerError):
            case.detail = f"rank {got.rank} raised {got.summary}"
        return case, got

    def answers(self, fn: Callable[[], object], name: str = "the answers") -> dict | None:
        """Run ``fn()``, a student's answers or prediction as a dict, as one case: the dict,
        or ``None`` when it is a stub, raised or is no dict (the case is then recorded and,
        unless it is a stub, shows the ``"format"`` mistake)."""
        case, got = self.attempt(name, fn, None, compare=lambda got, want: isinstance(got, dict))
        if case.passed:
            return got
        self.add(case)
        if not self.stub:
            self.shows({"format"})
        return None

    def prediction(self, fn: Callable[[], object], name: str = "the answers",
                   measured: Callable[[], object] | None = None) -> tuple[dict, object] | None:
        """The opening every predict-then-run checker shares: ``(the student's dict, what
        measured() returned)``; or ``None`` when the verdict is already decided, which
        :meth:`verdict` then gives: the prediction is no dict (or a stub, or raised; see
        :meth:`answers`), or the checker's own run failed (:meth:`reference_run`,
        :data:`HINT_RUN_FAILED`).  ``measured`` runs only once a prediction is committed."""
        got = self.answers(fn, name)
        if got is None:
            return None
        if measured is None:
            return got, None
        ran_ok, ran = self.reference_run(measured)
        if not ran_ok:
            self.decided = HINT_RUN_FAILED
            return None
        return got, ran

    def reference_run(self, measured: Callable[[], object]) -> tuple[bool, object]:
        """``(True, measured())``, the checker's own run of the workers; or ``(False, None)``
        with a failing case recorded when that run failed (a busy machine can time it
        out): then nothing can be compared, and :data:`HINT_RUN_FAILED` says so."""
        try:
            return True, measured()
        except Exception as err:  # noqa: BLE001 - the workers failed, not the prediction
            self.add(Case("the run", False, f"the reference run failed: {err}"[:300]))
            return False, None

    def add(self, case: Case) -> Case:
        """Record a case built by the checker itself."""
        self.result.cases.append(case)
        return case

    def shows(self, mistakes: Iterable[str] = ()) -> None:
        """A failing case shows these mistakes (none: a failure no named mistake explains)."""
        self.failing.append(set(mistakes))

    def formula(self, name: str, attempt: Callable[[], object], want: float,
                mistakes: dict[str, float], wrong: str = "", *, rel_tol: float = 0.0,
                abs_tol: float = 0.0) -> None:
        """Run ``attempt()``, a student's formula, as the case ``name``: passed when it returns
        ``want`` (within the tolerances).  A wrong number shows the mistakes of ``mistakes``
        (name -> the number that mistake gives) that it equals (to ``rel_tol``) and, with
        ``wrong``, the case says ``"got n " + wrong``; an exception shows none (the other
        cases choose the hint)."""
        case, got = self.run(name, attempt, want,
                             compare=lambda g, w: is_close(g, w, rel_tol=rel_tol, abs_tol=abs_tol))
        number = None if isinstance(got, BaseException) else as_number(got)
        if not case.passed and number is not None and wrong:
            case.detail = f"got {number:g} {wrong}"
        self.judge(case, got, as_number, lambda n: {
            m for m, v in mistakes.items() if v != want and math.isclose(n, v, rel_tol=rel_tol)},
            exceptions=False)

    def count(self, name: str, given, want: int, wrong: str,
              shown_by: Callable[[int], Iterable[str]]) -> None:
        """Record one count of a predicted dict as the case ``name``: passed when ``given`` is
        ``want``; a missing or fractional count shows ``"format"``, a wrong one ``"got n: " +
        wrong`` and the mistakes ``shown_by(n)`` names (those whose rule gives ``n``)."""
        number = as_number(given)
        if number is None or not number.is_integer():
            self.add(Case(name, False, "missing from the dict" if given is None else
                          f"got {given!r}, not a whole number"))
            self.shows({"format"})
        elif int(number) == want:
            self.add(Case(name, True))
        else:
            self.add(Case(name, False, f"got {int(number)}: {wrong}"))
            self.shows(shown_by(int(number)))

    def judge(self, case: Case, got, read: Callable[[object], object],
              explain: Callable[[object], Iterable[str]], *, unreadable: str = "format",
              exceptions: bool = True) -> None:
        """Record what ``case`` shows, if it failed: nothing named for an exception (and
        nothing at all unless ``exceptions``: then the other cases choose the hint);
        ``unreadable`` for an answer ``read`` returns ``None`` for; else ``explain(read(got))``."""
        if case.passed:
            return
        if isinstance(got, BaseException):
            if exceptions:
                self.shows()
            return
        answer = read(got)
        self.shows({unreadable} if answer is None else explain(answer))

    def verdict(self, hint=None) -> CheckResult:
        """The result; unless it passed, with its hints: the stub's, else ``hint`` (a text
        or its stages), else those :attr:`mistakes` picks for the failing cases, at the
        stage this kernel's earlier attempts call for (:attr:`stage`).

        Under nbgrader (:func:`grading`) a result that did not pass is raised as
        :class:`ExerciseNotPassed` instead of returned.
        """
        hint = self.decided if hint is None else hint
        if not self.result.passed:
            stage = self.stage
            if self.stub:
                self.result.hint = STUB_HINT
            elif hint is not None or self.mistakes is None:
                self.result.hint = at_stage(hint or "", stage)
            else:
                self.result.hint = self.mistakes.hint(self.failing, stage=stage)
        return finish(self.result)


def finish(result: CheckResult) -> CheckResult | None:
    """Count ``result`` for the staged hints (:func:`remember`) and hand it back.

    Under nbgrader (:func:`grading`) a result that did not pass is raised
    (:class:`ExerciseNotPassed`: the test cell fails, no points), and one that passed is
    printed and not returned: nbgrader reads a test cell's value as a partial grade, and a
    verdict is not a number."""
    remember(result)
    if grading():
        if not result.passed:
            raise ExerciseNotPassed(result)
        print(result)
        return None
    return result


def check_formula(exercise: str, mistakes: Mistakes, fn: Callable, cases: dict[str, tuple],
                  reference: Callable[..., float], numbers: Callable[..., dict[str, float]],
                  wrong: str = "", *, rel_tol: float = 0.0, abs_tol: float = 0.0) -> CheckResult:
    """A formula exercise: for each case (``name -> args``), ``fn(*args)`` against
    ``reference(*args)``, a wrong number judged by :meth:`Checking.formula` against
    ``numbers(*args)`` (mistake name -> the number that mistake gives)."""
    check = Checking(exercise, mistakes)
    for name, args in cases.items():
        check.formula(name, lambda: fn(*args), reference(*args), numbers(*args), wrong,
                      rel_tol=rel_tol, abs_tol=abs_tol)
    return check.verdict()


def check_answers(exercise: str, fn: Callable[[], object], names: Iterable[str],
                  judge: Callable[[str, object], tuple[str, object] | None],
                  format_hint) -> CheckResult:
    """Check ``fn() -> {name: answer}``: one case per name, a hint for every wrong answer.

    ``judge(name, answer)`` returns ``None`` for a right answer, else ``(detail, why)``:
    the hint for that name is then ``f"{name}: {why}"``, or ``format_hint`` when ``why``
    is ``None`` (an answer that cannot be read).  A missing name also gets
    ``format_hint``, once.  ``why`` may come in stages (see :func:`stages_of`): each
    name's stage is how many verdicts in a row found that name wrong before.
    """
    check = Checking(exercise)
    got = check.answers(fn)
    if got is None:
        return check.verdict(format_hint)
    hints = []
    for name in names:
        if name not in got:
            check.add(Case(name, False, "missing from the dict"))
            hints.append(at_stage(format_hint, 0))
            continue
        wrong = judge(name, got[name])
        if wrong is None:
            check.add(Case(name, True))
            continue
        detail, why = wrong
        check.add(Case(name, False, detail))
        stage = failed_before(exercise, name)
        hints.append(at_stage(format_hint, 0) if why is None else f"{name}: {at_stage(why, stage)}")
    return check.verdict("\n".join(dict.fromkeys(hints)) if hints else "")


# --- answer keys kept as salted digests ---------------------------------------------------

KEY_SALT = "distributed-llm-training-hands-on/exercise-keys/1"
"""Mixed into every digest of an answer, so a digest found elsewhere says nothing."""


def answer_digest(exercise: str, case: str, answer: str) -> str:
    """The digest the library keeps instead of ``answer``, the canonical text of the right
    answer to ``case`` of ``exercise`` (e.g. ``"all_reduce"``, ``"dp+tp"``)."""
    text = f"{KEY_SALT}|{exercise}|{case}|{answer}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def recover_answer(exercise: str, case: str, digest: str, candidates: Iterable[tuple[str, object]]):
    """The value of the candidate ``(canonical text, value)`` whose digest is ``digest``
    (``None`` when none is): a checker finds a case's answer among the possible ones while it
    runs, and keeps it nowhere.

    Honestly: with a handful of possible answers, the digests protect a key from being read
    off the library, not from being found by trying every answer, which the checker itself
    allows too (it says which cases pass).  They keep a grade from being had by copying data."""
    for text, value in candidates:
        if answer_digest(exercise, case, text) == digest:
            return value
    return None


def group_text(groups: Iterable[str]) -> str:
    """The canonical text of a set of group kinds: ``{"tp", "dp"}`` -> ``"dp+tp"``."""
    return "+".join(sorted(groups))


def misnamed_groups(given: frozenset, known: Iterable[str], use: str, world: str) -> str | None:
    """Why a set of group kinds is wrong for any parameter, before what the parameter is: a
    kind the exercise's grid does not have (``use`` names those to choose from), or the
    ``world`` group (the text says what it mixes).  ``None`` when neither."""
    unknown = sorted(given - set(known))
    if unknown:
        return f"unknown group kind(s) {unknown}: use {use}."
    return world if "world" in given else None


def group_sets(kinds: Iterable[str], largest: int) -> list[frozenset]:
    """Every set of at most ``largest`` of ``kinds`` (the empty set included)."""
    kinds = list(kinds)
    return [frozenset(c) for n in range(largest + 1) for c in itertools.combinations(kinds, n)]


# --- reading a launcher's deadlock report -------------------------------------------------


def deadlock_summary(report: dict[int, str]) -> str:
    """``"rank 0: waiting in recv from rank 1; rank 1: finished its function"``: what each
    rank of a :class:`~tutorial_lib.launch.LaunchTimeout` report was doing, in short."""
    return "; ".join(f"rank {r}: {_short_wait(text)}" for r, text in sorted(report.items()))


def _short_wait(text: str) -> str:
    """'waiting in recv from rank 1 on world group ...; stack: ...' -> 'waiting in recv from rank 1'."""
    text = text.split(";")[0]
    return text.split(" on ")[0] if text.startswith("waiting in") else text


def deadlock_kind(report: dict[int, str]) -> str:
    """``"all_recv"`` (every rank waits in a receive), ``"all_send"``, ``"unmatched"``
    (every rank still running waits in the same op, some have finished) or ``"deadlock"``."""
    # A rank whose function returned is reported as "finished" (perhaps followed by what
    # it waits for: the launcher lets the ranks leave together).
    waiting = {r: text for r, text in report.items() if not text.startswith("finished")}
    if waiting and all(text.startswith("waiting in recv") for text in waiting.values()):
        return "all_recv" if len(waiting) == len(report) else "unmatched"
    if waiting and all(text.startswith("waiting in send") for text in waiting.values()):
        return "all_send" if len(waiting) == len(report) else "unmatched"
    return "deadlock"


WAITING_IN = re.compile(r"waiting in (send to|recv from) rank (\d+)")
"""A deadlock report's ``waiting in send to rank 3`` / ``waiting in recv from rank 1``."""


# --- normalizers: the student's answer, however it was spelled ----------------------------


def as_number(value) -> float | None:
    """``value`` as a finite float, or ``None`` when a student's answer is not a number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def is_close(value, want: float, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    """Whether ``value`` is a number (:func:`as_number`) within the tolerances of ``want``."""
    number = as_number(value)
    return number is not None and math.isclose(number, want, rel_tol=rel_tol, abs_tol=abs_tol)


def as_whole_numbers(answer) -> list[int] | None:
    """A list, tuple, 1-D tensor or array of whole numbers as ``list[int]``; None if it is not one."""
    try:
        import torch
        if isinstance(answer, torch.Tensor):
            if answer.dim() != 1 or answer.is_floating_point() and not bool(
                    (answer == answer.round()).all()):
                return None
            return [int(v) for v in answer.tolist()]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if hasattr(answer, "tolist") and not isinstance(answer, (list, tuple)):
        answer = answer.tolist()
    if not isinstance(answer, (list, tuple)):
        return None
    numbers = [as_number(v) for v in answer]
    if any(n is None or not n.is_integer() for n in numbers):
        return None
    return [int(n) for n in numbers]


def as_rank_list(value) -> list[int] | None:
    """A group of ranks as a sorted list of ints (any order, any iterable); None if it is not one."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        return None
    try:
        return sorted(int(x) for x in value)
    except Exception:  # noqa: BLE001 - whatever the student returned, it is not a group
        return None


def as_group_kinds(answer) -> frozenset | None:
    """``"dp"``, ``["tp", "dp"]``, ``"tp+dp"``, ``set()`` -> a frozenset of group kinds;
    None if unreadable."""
    if answer is None:
        return frozenset()
    if isinstance(answer, str):
        parts = [p for p in re.split(r"[^a-z_]+", answer.lower()) if p]
        return frozenset(p for p in parts if p not in ("none", "and"))
    if isinstance(answer, (set, frozenset, list, tuple)):
        if not all(isinstance(p, str) for p in answer):
            return None
        return frozenset(p.strip().lower() for p in answer)
    return None


__all__ = ["Case", "CheckResult", "Checking", "ExerciseNotPassed", "GRADING_ENVIRONMENT", "Mistake",
           "Mistakes", "KEY_SALT", "RETRY_TIMEOUT_FACTOR", "STUB_HINT", "WAITING_IN", "answer_digest", "as_group_kinds", "as_number", "as_rank_list",
           "as_whole_numbers", "at_stage", "check_answers", "check_formula", "deadlock_kind", "deadlock_summary",
           "failed_before", "finish", "forget_attempts", "grading", "group_sets", "group_text",
           "is_close", "launch_retrying", "misnamed_groups", "recover_answer", "remember",
           "retry_limits", "run_case", "stages_of"]
