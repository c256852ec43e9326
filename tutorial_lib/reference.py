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
    """The machine's one-minute load average just before measuring."""
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


def save(name: str, rows: list[dict], command: str = "", notes: str = "",
         load: float | None = None, **extra) -> Reference:
    """Store ``rows`` as the reference ``name``, with this machine, today and its load.

    ``load``: the one-minute load average taken just before measuring
    (``os.getloadavg()[0]``); by default the load now, which after a run counts the
    run's own processes.
    """
    try:
        load_average = round(os.getloadavg()[0] if load is None else load, 2)
    except OSError:
        load_average = None
    ref = Reference(name=name, rows=list(rows), machine=describe_machine(),
                    date=datetime.date.today().isoformat(), load=load_average, command=command,
                    notes=notes, extra=dict(extra))
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in ref.__dict__.items() if k != "name"}
    _path(name).write_text(json.dumps(data, indent=1) + "\n")
    return ref
