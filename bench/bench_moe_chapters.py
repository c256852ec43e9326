"""Chapters 4 and 5 end to end: how long their cells take, stored as the chapters' reference.

    python bench/bench_moe_chapters.py          # ~1-2 minutes on 2 cores
    python bench/bench_moe_chapters.py --dry    # measure and print, store nothing

Runs ``notebooks/04_moe_ep.ipynb`` and ``notebooks/05_moe_aux_losses.ipynb`` with nbclient,
each in a fresh kernel, the way a reader's Jupyter runs them, up to the cell that prints the
chapter's clock beside the stored one (what follows it is prose), which is replaced by one
that reports the chapter's clock (started by its first cell) and, for chapter 5, the wall time
of its training launch.  The result is saved with :func:`tutorial_lib.reference.save` as
``tutorial_lib/reference/ch04_ch05_runtime.json``, with the machine, the date and the load
average; run it on a machine that is as quiet as you can make it.  The chapters assert no
timing: they print theirs next to this one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tutorial_lib import reference  # noqa: E402

NAME = "ch04_ch05_runtime"
CHAPTERS = {4: "notebooks/04_moe_ep.ipynb", 5: "notebooks/05_moe_aux_losses.ipynb"}
REPORT = {4: 'print("BENCH", json.dumps({"seconds": time.time() - chapter_started}))',
          5: 'print("BENCH", json.dumps({"seconds": time.time() - chapter_started, '
             '"training_seconds": training.wall_time}))'}


def measure(chapter: int) -> dict:
    nb = nbformat.read(REPO / CHAPTERS[chapter], as_version=4)
    clock = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and "chapter_started" in cell.source]
    if len(clock) < 2:
        raise SystemExit(f"{CHAPTERS[chapter]} should start its clock (chapter_started) in "
                         "one cell and print it in a later one; the notebook changed, "
                         "update this script")
    # everything up to the cell that prints the chapter's clock, which reports it instead
    nb.cells = nb.cells[:clock[-1]] + [
        nbformat.v4.new_code_cell("import json\n" + REPORT[chapter])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}})
    os.environ, saved = env, os.environ
    try:
        started = time.time()
        client.execute()
        wall = time.time() - started
    finally:
        os.environ = saved
    text = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    line = next(ln for ln in text.splitlines() if ln.startswith("BENCH "))
    row = {"chapter": chapter, **json.loads(line[len("BENCH "):]),
           "kernel_seconds": round(wall, 1)}
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="print the rows, store nothing")
    args = parser.parse_args(argv)
    load_before = reference.load_average()
    rows = [measure(chapter) for chapter in CHAPTERS]
    for row in rows:
        print(row)
    if not args.dry:
        ref = reference.save(NAME, rows, command="python bench/bench_moe_chapters.py",
                             notes="seconds: the chapter's clock from its first cell to its "
                                   "last; kernel_seconds: with the kernel's start; "
                                   "training_seconds: chapter 5's training launch",
                             load=load_before)
        print(ref.caption())
    return 0


if __name__ == "__main__":
    sys.exit(main())
