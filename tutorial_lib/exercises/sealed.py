"""Grading with the real checker, in a fresh Python the student's notebook never touched.

A check cell that calls ``check_f(f)`` in the student's kernel trusts that kernel: a
submission could rebind ``check_f``, patch the checker's module or its helpers
(``kit.Checking.verdict = ...``), or put a module of its own in
``sys.modules["tutorial_lib.exercises"]``, and the cell would report a pass.  So the graders
never run a checker there.  The student's function leaves the kernel by value (cloudpickle,
as the launcher ships workers to ranks) for a new interpreter started isolated
(``python -I``: no ``PYTHONPATH``, no user site, not the current folder) with the folder of
the real library first on its path.  That interpreter imports the checker from its module,
runs it, and prints each verdict behind a random prefix it was given on its standard input;
lines without the prefix (the student's own prints) are ignored.

* The course grader (``tutorial_lib.classroom.grade``) asks the kernel only to write the
  function to a file at each check cell, then starts the checking interpreter itself, from
  the library the grader was imported from: nothing done in the kernel reaches the verdict
  but the function handed over.
* nbgrader scores a test cell by whether it raises, in the student's kernel.  Its test cells
  (:func:`check_cell`) find this file with the import path's finder (not ``sys.modules``),
  run it in a namespace of their own and call :func:`graded`, which starts the same checking
  interpreter and raises ``AssertionError`` with the verdict unless it passed.

What this does not cover, said plainly:

* Code in the student's function runs inside the checking interpreter when the checker
  calls it (and a crafted pickle runs code when it is loaded).  A function written to attack
  the checker from there (patching it while it runs, reading the prefix off the stack) is
  not stopped; it is in the submitted notebook for the teacher to read.
* Under nbgrader the test cell itself runs in the student's kernel: a submission that
  rewrites the kernel's machinery (IPython's input transformers, ``builtins``, the
  ``subprocess`` or ``importlib`` modules) can still fake a passing cell.  The course grader
  is not exposed to that: it reads no verdict from the kernel.
* The checker is a fresh process, so staged hints start over at every check: a grader shows
  every failing case's first-stage hint.

This file is also run by ``exec`` in a kernel (nbgrader's test cells): it imports only the
standard library and cloudpickle at the top, and nothing from ``tutorial_lib``.
"""
from __future__ import annotations

import json
import os
import pickle
import secrets
import signal
import subprocess
import sys
from pathlib import Path

CHECK_TIME_LIMIT = 240.0
"""Seconds the checking interpreter of one nbgrader test cell may run."""

_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from tutorial_lib.exercises.sealed import serve; serve()")


def library_root(here: str | None = None) -> str:
    """The folder that holds the ``tutorial_lib`` package this file belongs to."""
    return str(Path(here or __file__).resolve().parents[2])


def run_checks(checks: list[tuple[str, str, str, bytes]], root: str,
               timeout: float, cwd: str | None = None) -> dict[str, dict]:
    """Run each ``(label, module, checker, pickled function)`` in one new isolated
    interpreter that imports ``module`` from ``root``; ``{label: verdict}``.

    A verdict is the checker's ``CheckResult.to_dict()`` plus ``"text"`` (the result as the
    student sees it printed).  A check with no verdict (the interpreter died, or ran past
    ``timeout`` seconds: then it is killed with every process it started) is left out.
    ``cwd``: the folder it runs in (the course grader's kernel folder)."""
    prefix = "@@verdict-" + secrets.token_hex(12) + "@@"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBGRADER", "PYTHON"))}
    process = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, root], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                               cwd=cwd, start_new_session=True)
    try:
        out, _ = process.communicate(pickle.dumps({"prefix": prefix, "checks": checks}),
                                     timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        out, _ = process.communicate()
    finally:
        _kill_group(process.pid)  # the forkserver and ranks a checker started, if any are left
    verdicts = {}
    for line in out.decode(errors="replace").split("\n"):
        if line.startswith(prefix):
            verdict = json.loads(line[len(prefix):])
            verdicts[verdict.pop("label")] = verdict
    return verdicts


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve() -> None:
    """The checking interpreter: read the checks from standard input, print each verdict."""
    import importlib
    import traceback

    request = pickle.loads(sys.stdin.buffer.read())
    prefix = request["prefix"]
    for label, module, checker, payload in request["checks"]:
        try:
            import cloudpickle
            fn = cloudpickle.loads(payload)
        except Exception as err:  # noqa: BLE001 - a function that cannot travel fails its check
            verdict = _failed(f"the function could not be read back: {type(err).__name__}: {err}")
        else:
            try:
                result = getattr(importlib.import_module(module), checker)(fn)
                verdict = {**result.to_dict(), "text": str(result)}
            except BaseException as err:  # noqa: BLE001 - a grader reports, it never stops
                last = traceback.format_exception_only(type(err), err)[-1].strip()
                verdict = _failed(f"the checker raised {last}")
        print(prefix + json.dumps({"label": label, **verdict}), flush=True)


def _failed(why: str) -> dict:
    return {"passed": False, "hint": why, "cases": [], "text": f"NOT GRADED: {why}"}


def graded(module: str, checker: str, fn, timeout: float = CHECK_TIME_LIMIT) -> None:
    """nbgrader's test cell: check ``fn`` with ``module.checker`` in a fresh interpreter;
    print the verdict, and raise ``AssertionError`` with it unless it passed."""
    import cloudpickle
    try:
        payload = cloudpickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - said as the verdict
        raise AssertionError(f"NOT GRADED: the function cannot be sent to the checker "
                             f"({type(err).__name__}: {err})") from None
    verdict = run_checks([("", module, checker, payload)], library_root(__file__), timeout)
    verdict = verdict.get("", _failed(f"the check gave no verdict within {timeout:g} s"))
    if not verdict["passed"]:
        raise AssertionError(verdict["text"])
    print(verdict["text"])


def check_cell(module: str, checker: str, function: str) -> str:
    """The source of a test cell that grades ``function`` with :func:`graded`."""
    return ("# Graded by the real checker in a fresh Python, not by anything this notebook\n"
            "# defines (tutorial_lib/exercises/sealed.py says how).\n"
            "import importlib.machinery as _m, importlib.util as _u\n"
            '_spec = _m.PathFinder.find_spec("tutorial_lib") or _u.find_spec("tutorial_lib")\n'
            '_sealed = _spec.submodule_search_locations[0] + "/exercises/sealed.py"\n'
            '_ns = {"__file__": _sealed, "__name__": "tutorial_lib_sealed"}\n'
            "exec(compile(open(_sealed).read(), _sealed, \"exec\"), _ns)\n"
            f'_ns["graded"]({module!r}, {checker!r}, {function})')


__all__ = ["CHECK_TIME_LIMIT", "check_cell", "graded", "library_root", "run_checks", "serve"]
