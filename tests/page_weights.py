"""What each page of the built book loads, weighed by ``tests/book/test_reader.py`` and
printed at the end of the session.

A test records a page's weight on its own report (``user_properties``); pytest-xdist sends
reports from the worker that ran the test to the process that prints the summary, where
this plugin reads them back (a root plugin, as that process loads no folder's conftest).
"""
from __future__ import annotations

import pytest

PROPERTY = "page_weight"
WEIGHTS: dict[str, dict] = {}
"""``docname -> {"requests", "bytes", "gzip_bytes", "largest"}`` for each page weighed."""


@pytest.fixture
def record_page_weight(record_property):
    """``record_page_weight(docname, weight)``: keep a page's weight for the summary."""
    def record(docname: str, weight: dict) -> None:
        record_property(PROPERTY, [docname, weight])
    return record


def pytest_sessionstart(session):
    WEIGHTS.clear()


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == PROPERTY:
            docname, weight = value
            WEIGHTS[docname] = weight


def pytest_terminal_summary(terminalreporter):
    if not WEIGHTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("page weight (every file a page loads, 1440 x 900)")
    write(f"{'page':36s} {'files':>5s} {'bytes':>11s} {'gzipped':>11s}  largest")
    for name, w in WEIGHTS.items():
        largest = ", ".join(f"{n} {b / 1e3:.0f} kB" for n, b in w["largest"])
        write(f"{name:36s} {w['requests']:5d} {w['bytes']:11,d} {w['gzip_bytes']:11,d}  {largest}")
