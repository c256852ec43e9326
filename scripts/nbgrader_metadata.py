"""Write an nbgrader course folder from the chapters: nbgrader's cell metadata from the tags.

    python scripts/nbgrader_metadata.py --course COURSE --course-id dl101 --exchange /srv/exchange
    python scripts/nbgrader_metadata.py --course COURSE --course-id dl101 01 03   # two chapters
    python scripts/nbgrader_metadata.py --course COURSE --course-id dl101 --exercises-only --points 2

Writes ``COURSE/source/ch01/01_communicator_groups.ipynb`` ... (one nbgrader assignment per
chapter, or ``--assignment NAME`` for all of them in one) and the course's
``nbgrader_config.py`` (with the course id and the exchange folder, which
``release_assignment``, ``collect`` and the students' ``fetch_assignment`` and ``submit`` need).
In each notebook (``tutorial_lib.classroom.nbgrader_source``):

* the stub cell (tag ``exercise-stub``) is nbgrader's answer cell: the stub, then the
  chapter's worked solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
* the check cell (``exercise-check``) is an autograded test worth the exercise's points
  (``classroom.points_of``: by difficulty, or ``--points`` for all), which grades the
  student's function with the real checker in a fresh Python (``exercises.sealed``);
* the folded solution cell (``solution``) is gone (it is in the answer cell now);
* every other cell is locked.

Then, in COURSE: ``nbgrader generate_assignment ch01``, ``nbgrader release_assignment ch01``;
the students ``fetch_assignment`` and ``submit``; then ``nbgrader collect ch01``,
``nbgrader autograde ch01`` and ``nbgrader generate_feedback ch01``.  See book/teaching.md.
A bad value exits 2 with the flag, the value and a fix, before anything is written.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tutorial_lib import classroom  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/nbgrader_metadata.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--course", type=Path, required=True, help="the nbgrader course folder")
    parser.add_argument("--course-id", help="nbgrader's course id (needed to release and collect)")
    parser.add_argument("--exchange", type=Path,
                        help="nbgrader's exchange folder, shared with the students "
                             "(default: nbgrader's, /srv/nbgrader/exchange)")
    parser.add_argument("chapter", nargs="*", help="chapter numbers, e.g. 01 03 (default: all)")
    parser.add_argument("--points", help="points of every exercise (default: by difficulty)")
    parser.add_argument("--assignment", help="one assignment for every chapter, named so")
    parser.add_argument("--exercises-only", action="store_true",
                        help="only the setup cell, the exercises and the cells they refer to")
    parser.add_argument("--notebooks", type=Path, default=classroom.NOTEBOOKS)
    args = parser.parse_args(argv)
    name = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
    try:
        found = classroom.chapter_folder("--notebooks", args.notebooks)
        only = classroom.chapter_prefixes(found, args.chapter)
        points = classroom.whole_points("--points", args.points)
        course = classroom.writable_folder("--course", args.course, args.notebooks)
        if args.course_id is not None and not re.fullmatch(name, args.course_id):
            raise classroom.UsageError("--course-id", args.course_id, "is not a course id "
                                       "(letters, digits, '.', '_' and '-')", "e.g. --course-id dl101")
        if args.assignment is not None and not re.fullmatch(name, args.assignment):
            raise classroom.UsageError("--assignment", args.assignment, "is not an assignment "
                                       "name (letters, digits, '.', '_' and '-')",
                                       "e.g. --assignment lab1")
        exchange = None if args.exchange is None else classroom.writable_folder(
            "--exchange", args.exchange)
    except classroom.UsageError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    written = classroom.write_nbgrader_course(course, args.notebooks, only, points,
                                              args.exercises_only, args.assignment,
                                              args.course_id, exchange)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
