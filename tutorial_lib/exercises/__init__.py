"""Checkers for the chapters' exercises.

Each chapter's exercise gives the student a stub; a checker runs the student's
function on several cases (several world sizes, for code that talks to
processes) against the library's reference and returns a :class:`CheckResult`
that says what is wrong, not only that something is.  In a notebook the result
prints itself; ``assert check(...)`` works because a result is truthy only when
every case passed.

One module per chapter (``ch01`` .. ``ch09``, ``ch11``) holds that chapter's checkers: their
cases, their references and their named mistakes.  Everything else, running the
student's code (here or on gloo ranks), turning exceptions, deadlocks and stubs
that still raise ``NotImplementedError`` into failed cases, choosing the hint and
reading answers however they are spelled, lives in :mod:`.kit`.  A checker never
raises because the student's code did.
"""
from __future__ import annotations

from .kit import (STUB_HINT, Case, Checking, CheckResult, Mistake, Mistakes, as_group_kinds,
                  as_number, as_rank_list, as_whole_numbers, check_answers, check_formula,
                  deadlock_kind, deadlock_summary, is_close, run_case)

__all__ = ["Case", "CheckResult", "Checking", "Mistake", "Mistakes", "STUB_HINT",
           "as_group_kinds", "as_number", "as_rank_list", "as_whole_numbers", "check_answers",
           "check_formula", "deadlock_kind", "deadlock_summary", "is_close", "run_case"]
