"""Helpers for tests that start real gloo worker processes.

A test waits for another process by what it shows, never by a pause: a printed line
(:func:`wait_for_line`), files it writes (:func:`wait_for_files`), or its end
(:func:`wait_until_gone`, on the kernel's process handle).
"""
import os
import select
import subprocess
import sys
import threading
import time

import cloudpickle
import pytest

from tutorial_lib.launch import process_running

# The launcher ships a worker function by reference when its module can be imported, so a
# worker defined in a test module made every rank import that module, pytest and nbformat
# with it: about 0.5 s of CPU per rank and launch, most of a checker's time on 2 cores.
# Shipped by value (as a notebook's functions are), a rank imports only what the function
# itself uses.
cloudpickle.register_pickle_by_value(sys.modules["tests"])


def wait_until_gone(pids, seconds: float = 5.0) -> list[int]:
    """Wait for every pid to end; return the ones still running after ``seconds``.

    Each wait is on the process's pidfd, which turns readable when the process ends
    (``os.pidfd_open``, Linux 5.3): no polling, and any process, not only a child."""
    deadline = time.monotonic() + seconds
    for pid in pids:
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([handle], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(handle)
    return [p for p in pids if process_running(p)]


def wait_for_line(stream, marker: str, seconds: float = 180) -> list[str]:
    """Read ``stream`` (a process's text pipe) up to the first line holding ``marker``; the
    lines read.  Fails, with them, when the stream ends first (the process exited) or
    ``seconds`` pass (it stalled)."""
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in stream:
            lines.append(line)
            if marker in line:
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)  # ends with the stream
    reader.start()
    reader.join(seconds)
    if not found.is_set():
        pytest.fail(f"no line with {marker!r} within {seconds:g} s (the process ended or "
                    f"stalled); it printed:\n{''.join(lines)[-3000:]}")
    return lines


def wait_for_files(folder, count: int, process=None, seconds: float = 300) -> list[str]:
    """Wait until ``folder`` holds ``count`` files (each written whole: written as
    ``NAME.tmp``, then renamed; a ``.tmp`` file is not counted), checking every 20 ms that
    ``process`` still runs; their names."""
    deadline = time.monotonic() + seconds
    while len(names := sorted(n for n in os.listdir(folder) if not n.endswith(".tmp"))) < count:
        if process is not None and process.poll() is not None:
            pytest.fail(f"the process ended (rc {process.returncode}) before writing "
                        f"{count} files: {process.communicate()}")
        assert time.monotonic() < deadline, f"{len(names)} of {count} files in {seconds:g} s"
        time.sleep(0.02)  # the file system has no wake-up for a new file: look again
    return names


def start_reporting_script(tmp_path, source: str, ranks: int, env=None):
    """Start ``source`` as a script (``python script.py FOLDER``) whose ``ranks`` ranks each
    write a file into FOLDER once they run (:func:`wait_for_files`'s rule); return the
    process and the files' names when all are there."""
    script, folder = tmp_path / "script.py", tmp_path / "reports"
    script.write_text(source)
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    return proc, [folder / name for name in wait_for_files(folder, ranks, proc)]


def run_two_notebooks(tmp_path, source: str, seconds: float) -> None:
    """Run ``source`` as two processes at once (two notebooks' kernels on one machine),
    with the tags 1 and 2 as their argument; each must exit cleanly and print ``ok TAG``."""
    script = tmp_path / "two_notebooks.py"
    script.write_text(source)
    procs = [subprocess.Popen([sys.executable, str(script), str(tag)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in (1, 2)]
    for tag, proc in zip((1, 2), procs):
        out, err = proc.communicate(timeout=seconds)
        assert proc.returncode == 0, err
        assert f"ok {tag}" in out


@pytest.fixture
def no_leftover_workers():
    """Fail the test if it leaves any worker process running."""
    import multiprocessing
    yield
    children = multiprocessing.active_children()
    stuck = [c for c in children if c.name.startswith("tutorial_lib-rank")]
    assert not stuck, f"worker processes left behind: {stuck}"
