"""Measure how long each chapter takes to run, and store it as the reference "chapter_times".

    python scripts/time_chapters.py                 # every chapter, stored
    python scripts/time_chapters.py 06 08           # only these (by number prefix), merged
    python scripts/time_chapters.py --dry-run       # print, store nothing

Each chapter is executed top to bottom in a fresh kernel (nbclient, the engine the book
build uses), from the notebooks folder, as a reader's "Run all" would; the wall-clock
seconds, kernel start included, go into ``tutorial_lib/reference/chapter_times.json``
with the machine, the date and the load it ran under (``tutorial_lib.reference.save``).
Run it on a machine as quiet as you can get: the chapters state these numbers in their
"How long it takes" line, and tests/unit/test_chapter_times.py checks that they agree.
The notebook files are only read: their outputs are not written back.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
REFERENCE_NAME = "chapter_times"
COMMAND = "python scripts/time_chapters.py"


def chapters() -> list[Path]:
    """The chapter notebooks, in book order (``tutorial_lib.chapters``, which a unit test
    checks against _toc.yml)."""
    sys.path.insert(0, str(ROOT))
    from tutorial_lib.chapters import CHAPTERS

    return [NOTEBOOKS / entry.notebook for entry in CHAPTERS]


def cell_seconds(cell) -> float:
    """How long an executed cell ran, from the timestamps nbclient records in its metadata
    (``execute_input`` to ``execute_reply``); 0 for a cell that was not executed."""
    import datetime as dt

    stamps = cell.get("metadata", {}).get("execution", {})
    start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    parse = dt.datetime.fromisoformat
    return max(0.0, (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))
                     ).total_seconds())


def split_times(nb) -> tuple[list[list], list[list]]:
    """``(sections, exercises)`` of an executed chapter: ``[title, seconds]`` per ``## ``
    section (the cells before the first one are "Opening"), and ``[number, seconds]`` per
    exercise (its stub, check and solution cells, found as the classroom tools find them)."""
    from tutorial_lib.classroom import chapter_exercises

    sections: list[list] = [["Opening", 0.0]]
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            sections.append([cell.source.splitlines()[0][3:].strip(), 0.0])
        sections[-1][1] += cell_seconds(cell)
    exercises = []
    for ex in chapter_exercises(nb):
        cells = [i for i in (ex.stub_cell, ex.check_cell, ex.solution_cell) if i is not None]
        exercises.append([ex.number, sum(cell_seconds(nb.cells[i]) for i in cells)])
    from tutorial_lib.reference import UNTIMED_SECTIONS

    rounded = [[name, round(sec, 1)] for name, sec in sections
               if (sec > 0 or name != "Opening") and name not in UNTIMED_SECTIONS]
    return rounded, [[n, round(sec, 1)] for n, sec in exercises]


def time_notebook(path: Path, timeout: int = 900) -> tuple[float, list[list], list[list]]:
    """Seconds to execute ``path`` in a fresh kernel, from its own folder, and the seconds
    of its sections and exercises (:func:`split_times`)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=True,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    return (seconds, *split_times(nb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="chapter number prefixes, e.g. 06 08")
    parser.add_argument("--dry-run", action="store_true", help="print the times, store nothing")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from tutorial_lib import reference

    # The kernels import tutorial_lib from this checkout, whatever is installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

    todo = [p for p in chapters() if not args.only or any(p.name.startswith(o) for o in args.only)]
    if not todo:
        parser.error(f"no chapter starts with {args.only}")
    try:
        rows = {r["chapter"]: r for r in reference.load(REFERENCE_NAME).rows}
    except FileNotFoundError:
        rows = {}
    load_before = reference.load_average()
    for path in todo:
        load = round(os.getloadavg()[0], 2)
        seconds, sections, exercises = time_notebook(path)
        rows[path.stem] = {"chapter": path.stem, "seconds": round(seconds, 1),
                           "date": datetime.date.today().isoformat(), "load": load,
                           "sections": sections, "exercises": exercises}
        print(f"{path.stem:32s} {seconds:7.1f} s", flush=True)
    if args.dry_run:
        return 0
    ordered = [rows[p.stem] for p in chapters() if p.stem in rows]
    ref = reference.save(REFERENCE_NAME, ordered, command=COMMAND,
                         notes="Wall-clock seconds to run every cell of each chapter in a "
                               "fresh kernel (nbclient), kernel start included; each row "
                               "has the date and the one-minute load it started under, "
                               "and the seconds of each section (cells from one '## ' "
                               "heading to the next) and of each exercise (stub, check "
                               "and solution cells).",
                         load=load_before)
    print(f"stored {len(ordered)} chapters: {ref.caption()} "
          f"(load {load_before} before the first chapter)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
