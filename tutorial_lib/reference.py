"""Measurements from a quiet machine, stored, shown beside what the reader's run measures.

A timing depends on the machine and on whatever else it is doing, so no chapter asserts
one, and no sentence of a chapter describes the reader's numbers.  Instead each timed
table has a *reference*: the same measurement taken once on a quiet machine, saved as a
JSON file in ``tutorial_lib/reference/`` with the machine, the date and the load it ran
under.  The chapter shows the two side by side and its prose describes the reference.

    ref = reference.load("ch02_alpha_beta")     # rows + where and when they were measured
    ref.caption()                                # "reference: 2 cores (...), 2026-11-25, load 0.1"
    reference.save("ch02_alpha_beta", rows, command="python bench/...")   # measuring scripts

Nothing here imports torch.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
"""Where the stored references live (package data)."""


@dataclass
class Reference:
    """One stored measurement: its rows and where, when and how it was taken."""

    name: str
    rows: list[dict]
    """The measured values, one dict per row (the columns are the keys)."""
    machine: str = ""
    """Processor, cores and memory of the machine it ran on."""
    date: str = ""
    """When it was measured (ISO date)."""
    load: float | None = None
    """The machine's one-minute load average before measuring (as the measuring script
    read it), or when the reference was saved if the script did not say."""
    command: str = ""
    """What to run to measure it again."""
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def caption(self) -> str:
        """One line for under a table: where and when the reference was measured."""
        load = f", load {self.load:.1f}" if self.load is not None else ""
        return f"reference: {self.machine}, {self.date}{load}"

    def column(self, key: str) -> list:
        return [row[key] for row in self.rows]


def _path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a reference name is a plain file stem such as 'ch02_alpha_beta', got {name!r}")
    return REFERENCE_DIR / f"{name}.json"


def load(name: str) -> Reference:
    """The stored reference called ``name`` (``tutorial_lib/reference/<name>.json``)."""
    path = _path(name)
    if not path.exists():
        known = sorted(p.stem for p in REFERENCE_DIR.glob("*.json")) if REFERENCE_DIR.exists() else []
        raise FileNotFoundError(f"no stored reference {name!r} in {REFERENCE_DIR}; stored: "
                                f"{', '.join(known) or 'none'}")
    data = json.loads(path.read_text())
    return Reference(name=name, **data)


def describe_machine() -> str:
    """Processor model, cores and memory of this machine, in one line."""
    model = platform.machine()  # (platform.processor() would start `uname -p`)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = ""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages * page_size / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    return f"{os.cpu_count()} cores ({model}){memory}"


def load_average() -> float | None:
    """This machine's one-minute load average (``None`` where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def save(name: str, rows: list[dict], command: str = "", notes: str = "",
         load: float | None = None, **extra) -> Reference:
    """Store ``rows`` as the reference ``name``, with this machine, today and its load:
    ``load`` as the script read it before measuring (:func:`load_average`), else now."""
    load_average_ = load if load is not None else load_average()
    ref = Reference(name=name, rows=list(rows), machine=describe_machine(),
                    date=datetime.date.today().isoformat(), load=load_average_, command=command,
                    notes=notes, extra=dict(extra))
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in ref.__dict__.items() if k != "name"}
    _path(name).write_text(json.dumps(data, indent=1) + "\n")
    return ref


UNTIMED_SECTIONS = ("Further reading",)
"""``## `` sections of a chapter that hold no code (reading lists): not timed, not listed."""


def chapter_time_rows(chapter: str, stored: Reference | None = None) -> list[list]:
    """What each part of ``chapter`` (a notebook stem such as ``"03_tp_dp"``) took to run on
    the reference machine: ``[part, seconds]`` for each section, then each exercise (its
    stub, check and solution cells), then the whole chapter, kernel start included; as
    ``scripts/time_chapters.py`` stored them in the reference ``chapter_times`` (``stored``:
    that reference, when the caller has already loaded it)."""
    from .chapters import chapter as registered

    registered(chapter)  # a name that is no chapter's fails here, naming the chapters
    rows = {row["chapter"]: row for row in (stored or load("chapter_times")).rows}
    if chapter not in rows:
        raise KeyError(f"chapter {chapter!r} was never timed: python scripts/time_chapters.py "
                       f"{chapter[:2]}")
    row = rows[chapter]  # (a row stored before sections were timed has only the whole)
    return ([[title, seconds] for title, seconds in row.get("sections", [])]
            + [[f"Exercise {number}", seconds] for number, seconds in row.get("exercises", [])]
            + [["the whole chapter", row["seconds"]]])


def chapter_times_table(chapter: str):
    """:func:`chapter_time_rows` as a table with the reference's caption (for a notebook)."""
    from .viz.table import table

    stored = load("chapter_times")
    rows = [[part, f"{seconds:.0f} s" if seconds >= 1 else "< 1 s"]
            for part, seconds in chapter_time_rows(chapter, stored)]
    return table(["part of the chapter", f"run time ({stored.caption()})"], rows)


def chapter_time_here(chapter: str, seconds_here: float) -> str:
    """Three short lines for a chapter's last cell: this run's time (``seconds_here``, from the
    chapter's first cell) beside the whole chapter's stored time, the opening table's last
    row, and the reference it comes from."""
    stored = load("chapter_times")
    seconds = chapter_time_rows(chapter, stored)[-1][1]
    return (f"this notebook ran in {seconds_here:.0f} s here;\n"
            f"on the reference machine the whole chapter took {seconds:.0f} s, its kernel's "
            f"start included\n({stored.caption()})")

