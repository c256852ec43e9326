"""Measure every stored reference again, each one alone on an idle machine.

    python scripts/measure_references.py                 # every reference in tutorial_lib/reference/
    python scripts/measure_references.py ch02_alpha_beta chapter_times   # only these
    python scripts/measure_references.py --list          # the commands, run nothing

Each stored reference records the command that measured it (its ``command`` field).  This
script runs those commands one after another (a command that stores two references runs
once), and before each one waits until the machine's one-minute load average is under
``--idle`` (0.5 by default), so that no measurement starts while the previous one, or
anything else, is still loading the machine.  A command does not start at all if the
machine does not become idle within ``--wait`` seconds: a reference measured on a busy
machine is worse than an old one.  At the end it prints each reference's stored load;
``tests/unit/test_reference.py`` refuses any stored at load 1 or above.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tutorial_lib import reference  # noqa: E402

NOT_YET_MEASURED: dict[str, str] = {}
"""References whose measuring script exists but which have not been stored yet (a
reference is stored only from an idle machine): name -> command, run like the others'.
A new chapter's reference goes here until an idle machine has stored it; none is now."""


def commands(names: list[str]) -> dict[str, list[str]]:
    """Each measuring command and the references it stores, in file-name order."""
    by_command: dict[str, list[str]] = {}
    for name in names:
        stored = (reference.REFERENCE_DIR / f"{name}.json").exists()
        command = reference.load(name).command if stored else NOT_YET_MEASURED[name]
        by_command.setdefault(command, []).append(name)
    return by_command


def wait_until_idle(idle: float, wait: float) -> float:
    """Block until the one-minute load average is under ``idle``; return it."""
    deadline = time.monotonic() + wait
    while True:
        load = os.getloadavg()[0]
        if load < idle:
            return load
        if time.monotonic() > deadline:
            raise SystemExit(f"the machine did not become idle: load {load:.2f} is still over "
                             f"--idle {idle} after --wait {wait:.0f} s; stop what is running "
                             f"and try again")
        time.sleep(5)


def main() -> int:
    stored = sorted({p.stem for p in reference.REFERENCE_DIR.glob("*.json")}
                    | set(NOT_YET_MEASURED))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help=f"references to measure (default: all of "
                        f"{', '.join(stored)})")
    parser.add_argument("--idle", type=float, default=0.5,
                        help="start a command only under this one-minute load (default 0.5)")
    parser.add_argument("--wait", type=float, default=600.0,
                        help="seconds to wait for the machine to become idle (default 600)")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(stored))
    if unknown:
        parser.error(f"no stored reference {', '.join(unknown)}; stored: {', '.join(stored)}")
    if not 0 < args.idle <= 1:
        parser.error(f"--idle {args.idle}: a stored reference must be taken under load 1; "
                     f"give a value in (0, 1]")
    plan = commands(args.names or stored)
    for command, names in plan.items():
        print(f"{command}    # {', '.join(names)}")
    if args.list:
        return 0
    for command, names in plan.items():
        load = wait_until_idle(args.idle, args.wait)
        print(f"\n== {command} (load {load:.2f}) ==", flush=True)
        started = time.perf_counter()
        subprocess.run(shlex.split(command), cwd=ROOT, check=True)
        print(f"== {time.perf_counter() - started:.0f} s ==", flush=True)
    print()
    for names in plan.values():
        for name in names:
            print(f"{name}: {reference.load(name).caption()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
