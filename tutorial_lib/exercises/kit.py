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
  preference, and the hint for a failure none of them explains.
* :func:`check_answers`: the whole checker for exercises whose answer is a dict with
  one entry per situation.
* Normalizers that read a student's answer however it was spelled:
  :func:`as_number`, :func:`as_whole_numbers`, :func:`as_rank_list`,
  :func:`as_group_kinds`, :func:`is_close`; and :func:`deadlock_kind` /
  :func:`deadlock_summary` to read a launcher's deadlock report.

A checker never raises because the student's code did.
"""
from __future__ import annotations

import html
import math
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..launch import LaunchTimeout, WorkerError, launch

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
    """For a failure: what came back against what was expected."""


@dataclass
class CheckResult:
    """The verdict of a checker: every case, and one hint for the first failure."""

    exercise: str
    """The exercise's title."""
    cases: list[Case] = field(default_factory=list)
    """Every case tried, in order."""
    hint: str = ""
    """What the first failure suggests is wrong, and how to think about it."""

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"PASS {self.exercise}: all {len(self.cases)} cases agree with the reference."
        lines = [f"NOT YET {self.exercise}: "
                 f"{sum(c.passed for c in self.cases)}/{len(self.cases)} cases pass."]
        for c in self.cases:
            if not c.passed:
                lines.append(f"  - {c.name}: {c.detail}")
        if self.hint:
            lines.append(f"Hint: {self.hint}")
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
        hint = f'<div style="margin-top:4px"><b>Hint:</b> {e(self.hint)}</div>' if self.hint else ""
        return (f'<div class="tl-check" data-passed="false" style="{style}">'
                f'<div style="font-weight:600">Your turn: {e(self.exercise)}</div>'
                f"<div>{passing} of {len(self.cases)} cases pass so far. Complete the function "
                "in the cell above, run it, then run this check again; a worked solution "
                "follows, folded.</div>"
                f'<ul style="margin:4px 0 0;padding-left:1.3em">{failing}</ul>{hint}</div>')


def run_case(name: str, attempt: Callable[[], object], expected: object,
             compare: Callable[[object, object], bool] | None = None) -> tuple[Case, object]:
    """Run ``attempt()``; a :class:`Case` comparing its value with ``expected``, and the value.

    The value is the exception itself when the attempt raised, so checkers can
    recognise a stub (``NotImplementedError``) and give the right hint.
    """
    compare = compare or (lambda got, want: got == want)
    try:
        got = attempt()
    except NotImplementedError as err:
        return Case(name, False, "the stub still raises NotImplementedError: fill in its body"), err
    except Exception as err:  # noqa: BLE001 - the student's bug becomes a readable case
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        return Case(name, False, f"raised {last}"), err
    if compare(got, expected):
        return Case(name, True), got
    return Case(name, False, f"got {_short(got)}, expected {_short(expected)}"), got


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- named mistakes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Mistake:
    """A classic wrong answer a checker recognises, and what to tell its author."""

    name: str
    """How the checker calls it, e.g. ``"slowest_first"``."""
    hint: str
    """What to tell the student whose answer shows it."""
    any_case: bool = False
    """Named as soon as one failing case shows it (a wrong format, an exception);
    otherwise named only when it explains every failing case."""


class Mistakes:
    """A checker's named mistakes in order of preference, and its generic hint.

    ``Mistakes(generic, any_case={"format"}, format=HINT_FORMAT, two_b=HINT_TWO_B, ...)``:
    the keywords name the mistakes, in order; ``any_case`` lists those named as soon as
    one failing case shows them (``True``: all of them).  Two names may share a hint.
    """

    def __init__(self, generic: str, *, any_case: Iterable[str] | bool = (), **hints: str):
        any_case = set(hints) if any_case is True else set(any_case or ())
        unknown = any_case - set(hints)
        if unknown:
            raise ValueError(f"any_case names mistakes that have no hint: {sorted(unknown)}")
        self.generic = generic
        """The hint when no named mistake explains the failures."""
        self.entries = tuple(Mistake(name, hint, name in any_case) for name, hint in hints.items())
        """Every :class:`Mistake`, in order of preference."""

    def __iter__(self):
        return iter(self.entries)

    def __contains__(self, name: str) -> bool:
        return any(m.name == name for m in self.entries)

    def hint_of(self, name: str) -> str:
        """The hint of the mistake called ``name``."""
        for m in self.entries:
            if m.name == name:
                return m.hint
        raise KeyError(name)

    def hint(self, failing: list[set[str]], generic: str | None = None) -> str:
        """The hint for failing cases, each given as the set of mistake names it shows.

        The first mistake (in order of preference) that one failing case shows, if it
        is ``any_case``, or that every failing case shows; else ``generic`` (by default
        the table's own).
        """
        generic = self.generic if generic is None else generic
        if not failing:
            return generic
        shown_once = set().union(*failing)
        shown_by_all = set.intersection(*(set(f) for f in failing))
        for m in self.entries:
            if m.name in (shown_once if m.any_case else shown_by_all):
                return m.hint
        return generic


# --- one run of a checker ---------------------------------------------------------------


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

    @property
    def cases(self) -> list[Case]:
        return self.result.cases

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
        :class:`~tutorial_lib.launch.LaunchTimeout` (``"deadlocked after t s (rank 0:
        waiting in recv from rank 1; ...)"``), or any other exception.
        """
        def attempt():
            try:
                out = launch(worker, world_size, args=args, timeout=timeout, print_output=False)
            except WorkerError as err:
                if err.summary.startswith("NotImplementedError"):
                    raise NotImplementedError from None
                raise
            return out if unpack is None else unpack(out)

        case, got = self.run(name, attempt, expected, compare)
        if isinstance(got, LaunchTimeout):
            case.detail = f"deadlocked after {timeout:g} s ({deadlock_summary(got.report)})"
        elif isinstance(got, WorkerError):
            case.detail = f"rank {got.rank} raised {got.summary}"
        return case, got

    def add(self, case: Case) -> Case:
        """Record a case built by the checker itself."""
        self.result.cases.append(case)
        return case

    def shows(self, mistakes: Iterable[str] = ()) -> None:
        """A failing case shows these mistakes (none: a failure no named mistake explains)."""
        self.failing.append(set(mistakes))

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

    def verdict(self, hint: str | None = None) -> CheckResult:
        """The result; unless it passed, with a hint: the stub's, else ``hint``, else the
        one :attr:`mistakes` picks for the failing cases."""
        if not self.result.passed:
            if self.stub:
                self.result.hint = STUB_HINT
            elif hint is not None or self.mistakes is None:
                self.result.hint = hint or ""
            else:
                self.result.hint = self.mistakes.hint(self.failing)
        return self.result


def check_answers(exercise: str, fn: Callable[[], object], names: Iterable[str],
                  judge: Callable[[str, object], tuple[str, str | None] | None],
                  format_hint: str) -> CheckResult:
    """Check ``fn() -> {name: answer}``: one case per name, the first failure's hint.

    ``judge(name, answer)`` returns ``None`` for a right answer, else ``(detail, why)``:
    the hint is then ``f"{name}: {why}"``, or ``format_hint`` when ``why`` is ``None``
    (an answer that cannot be read).  A missing name also gets ``format_hint``.
    """
    check = Checking(exercise)
    case, got = check.attempt("the answers", fn, None, compare=lambda got, want: isinstance(got, dict))
    if not case.passed:
        check.add(case)
        return check.verdict(format_hint)
    hints = []
    for name in names:
        if name not in got:
            check.add(Case(name, False, "missing from the dict"))
            hints.append(format_hint)
            continue
        wrong = judge(name, got[name])
        if wrong is None:
            check.add(Case(name, True))
            continue
        detail, why = wrong
        check.add(Case(name, False, detail))
        hints.append(format_hint if why is None else f"{name}: {why}")
    return check.verdict(hints[0] if hints else "")


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


__all__ = ["Case", "CheckResult", "Checking", "Mistake", "Mistakes", "STUB_HINT", "WAITING_IN",
           "as_group_kinds", "as_number", "as_rank_list", "as_whole_numbers", "check_answers",
           "deadlock_kind", "deadlock_summary", "is_close", "run_case"]
