"""Write an nbgrader course folder from the chapters: nbgrader's cell metadata from the tags.

    python scripts/nbgrader_metadata.py --course COURSE            # every chapter
    python scripts/nbgrader_metadata.py --course COURSE 01 03      # chapters 1 and 3
    python scripts/nbgrader_metadata.py --course COURSE --exercises-only --points 2

Writes ``COURSE/source/ch01/01_communicator_groups.ipynb`` ... (one nbgrader assignment per
chapter, or ``--assignment NAME`` for all of them in one) and the course's
``nbgrader_config.py``.  In each notebook (``tutorial_lib.classroom.nbgrader_source``):

* the stub cell (tag ``exercise-stub``) is nbgrader's answer cell: the stub, then the
  chapter's worked solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
* the check cell (``exercise-check``) is an autograded test worth ``--points``;
* the folded solution cell (``solution``) is gone (it is in the answer cell now);
* every other cell is locked.

Then, in COURSE: ``nbgrader generate_assignment ch01`` (the student edition in
``release/ch01``) and, once submissions are in ``submitted/<student>/ch01``,
``nbgrader autograde ch01``.  See book/teaching.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tutorial_lib import classroom  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--course", type=Path, required=True, help="the nbgrader course folder")
    parser.add_argument("chapter", nargs="*", help="chapter prefixes, e.g. 01 03 (default: all)")
    parser.add_argument("--points", type=int, default=classroom.POINTS, help="points per exercise")
    parser.add_argument("--assignment", help="one assignment for every chapter, named so")
    parser.add_argument("--exercises-only", action="store_true",
                        help="only the setup cell and the exercises of each chapter")
    parser.add_argument("--notebooks", type=Path, default=classroom.NOTEBOOKS)
    args = parser.parse_args(argv)
    written = classroom.write_nbgrader_course(args.course, args.notebooks, args.chapter,
                                              args.points, args.exercises_only, args.assignment)
    if not written:
        parser.error(f"no chapter notebook matched in {args.notebooks}")
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
