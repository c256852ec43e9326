"""tests/unit holds pure tests: a test here that starts a process fails, naming the rule.

Worker launches, subprocesses and browsers make a test slow and dependent on the machine;
they belong in tests/dist (processes) or tests/book (the browser).
"""
import multiprocessing.process
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

# the first import of matplotlib on a machine lists the fonts with ``fc-list`` (a process)
# and caches the list: on a fresh machine that happens here, before any test is guarded
import matplotlib.font_manager  # noqa: F401


def _refuse(*args, **kwargs):
    raise RuntimeError("a test in tests/unit started a process: tests/unit holds pure tests "
                       "only; move this test to tests/dist (workers, subprocesses) or "
                       "tests/book (the browser)")


@contextmanager
def _no_processes():
    patched = [(subprocess.Popen, "__init__"), (multiprocessing.process.BaseProcess, "start"),
               (os, "fork"), (os, "posix_spawn")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name, _ in saved:
        setattr(owner, name, _refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


UNIT = Path(__file__).resolve().parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # pytest calls this hook for every test of the session: guard only the ones here
    if UNIT not in Path(item.path).resolve().parents:
        yield
        return
    with _no_processes():
        yield
