"""Where the test command's time goes: seconds per folder and per file, printed at the end.

pytest's ``--durations`` lists the slowest single tests; the README's budget is for the whole
command, and most of it is spent in files of many short tests. This plugin adds up each
test's setup, call and teardown by the file it is in (a notebook counts as one file) and
prints the folders and the slowest files, with their share of the session's wall time, so
that a CI log says which part of the suite to make faster.
"""
from __future__ import annotations

import posixpath
import time
from collections import defaultdict

import pytest

_TOTALS: defaultdict[str, float] = defaultdict(float)
"""Seconds per file of this session (one session per process)."""
_STARTED = pytest.StashKey[float]()
SLOWEST_FILES = 25
"""How many files the summary lists."""


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = time.monotonic()
    _TOTALS.clear()


def pytest_runtest_logreport(report):
    """Called once per phase (setup, call, teardown) of every test: add its duration."""
    _TOTALS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    totals = dict(_TOTALS)
    if not totals or _STARTED not in config.stash:
        return
    wall = time.monotonic() - config.stash[_STARTED]
    folders: dict[str, float] = defaultdict(float)
    for path, seconds in totals.items():
        folders[posixpath.dirname(path) or "."] += seconds
    write = terminalreporter.write_line
    terminalreporter.section("time by folder and by file (setup + call + teardown)")
    write(f"{'folder':<44}{'seconds':>9}{'share':>8}")
    for folder, seconds in sorted(folders.items(), key=lambda kv: -kv[1]):
        write(f"{folder:<44}{seconds:>9.1f}{seconds / wall:>8.0%}")
    write(f"{'(session wall time)':<44}{wall:>9.1f}")
    write("")
    write(f"{'slowest files':<60}{'seconds':>9}{'share':>8}")
    for path, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        write(f"{path:<60}{seconds:>9.1f}{seconds / wall:>8.0%}")
