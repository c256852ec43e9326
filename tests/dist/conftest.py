"""Helpers for tests that start real gloo worker processes."""
import os
import time

import pytest


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until_gone(pids, seconds: float = 5.0) -> list[int]:
    """Wait for every pid to end; return the ones still running after ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        alive = [p for p in pids if process_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


def worker_pids() -> set[int]:
    """Every live process on this machine named like a tutorial_lib worker."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"forkserver" in cmdline and process_alive(int(entry)):
            pids.add(int(entry))
    return pids


@pytest.fixture
def no_leftover_workers():
    """Fail the test if it leaves any worker process running."""
    import multiprocessing
    yield
    children = multiprocessing.active_children()
    stuck = [c for c in children if c.name.startswith("tutorial_lib-rank")]
    assert not stuck, f"worker processes left behind: {stuck}"
