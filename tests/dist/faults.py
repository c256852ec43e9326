"""What every fault test shares: a CPU hog beside it, and the check that nothing is left.

``fault_bench`` starts ``python -c "while True: pass"`` (a busy core, as on a loaded
machine), gives the test an environment whose ``TMPDIR`` is a folder of its own (where the
command lines it starts make their run folders), and after the test kills the hog and
checks that no process the test started is still running and that no run folder
(:data:`tutorial_lib.launch.RUN_DIR`) is left in that ``TMPDIR``.
"""
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tutorial_lib.launch import RUN_DIR, descendants, proc_stat

from .conftest import wait_until_gone

ROOT = Path(__file__).resolve().parents[2]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _parent(pid: int) -> int | None:
    try:
        return int(proc_stat(pid)[1])
    except (OSError, ValueError, IndexError):
        return None


class FaultBench:
    def __init__(self, tmp_path: Path):
        self.tmpdir = tmp_path / "tmpdir"
        self.tmpdir.mkdir()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(self.tmpdir)}

    def run_dirs(self) -> list[str]:
        return sorted(name for name in os.listdir(self.tmpdir) if RUN_DIR.match(name))


@contextmanager
def cpu_hog():
    """A busy core beside what runs inside, as on a loaded machine; its process."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


@pytest.fixture
def fault_bench(tmp_path):
    me = os.getpid()
    before = set(descendants(me))
    bench = FaultBench(tmp_path)
    with cpu_hog() as hog:
        yield bench
    # this process's own forkserver and resource tracker (an in-process launch starts them)
    # stay, as in a notebook; the workers they forked must be gone
    started = [pid for pid in set(descendants(me)) - before - {hog.pid}
               if not (_parent(pid) == me and b"from multiprocessing." in _cmdline(pid))]
    assert wait_until_gone(started, 10) == [], "processes left behind"
    assert bench.run_dirs() == [], "run folders left behind"
