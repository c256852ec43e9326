"""Checkers for the chapters' exercises.

Each chapter's exercise gives the student a stub; a checker runs the student's
function on several cases (several world sizes, for code that talks to
processes) against the library's reference and returns a :class:`CheckResult`
that says what is wrong, not only that something is.  In a notebook the result
prints itself; ``assert check(...)`` works because a result is truthy only when
every case passed.

A checker never raises because the student's code did: exceptions, deadlocks
and stubs that still raise ``NotImplementedError`` become failed cases with a
hint.
"""
from __future__ import annotations

import html
import math
import traceback
from dataclasses import dataclass, field
from typing import Callable


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
        colour = "#1a7f37" if self.passed else "#b35900"
        body = html.escape(str(self)).replace("\n", "<br>")
        return (f'<div class="tl-check" data-passed="{str(self.passed).lower()}" '
                f'style="border-left:4px solid {colour};padding:6px 10px;'
                f'font-family:monospace;font-size:13px">{body}</div>')


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


def stub_hint(values: list[object]) -> str | None:
    """The hint for an unfilled stub, if any of the attempts hit one."""
    if any(isinstance(v, NotImplementedError) for v in values):
        return "replace the `raise NotImplementedError` line with your implementation, then re-run this cell."
    return None


def pick_hint(hint_pairs: list[tuple[str, str]], failing_matches: list[set], generic: str) -> str:
    """The hint of the first known mistake that explains *every* failing case, else ``generic``.

    ``hint_pairs`` lists (hint, mistake name) in order of preference; each entry of
    ``failing_matches`` is the set of mistake names that reproduce one failing case.
    """
    if not failing_matches:
        return generic
    common = set.intersection(*failing_matches)
    for hint, name in hint_pairs:
        if name in common:
            return hint
    return generic


def as_number(value) -> float | None:
    """``value`` as a finite float, or ``None`` when a student's answer is not a number."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
