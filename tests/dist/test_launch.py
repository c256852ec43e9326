"""The launcher, with real gloo workers: results, failures, deadlocks, interrupts, leftovers."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.launch import LaunchTimeout, WorkerError, launch

from .conftest import process_alive, wait_until_gone

pytestmark = pytest.mark.dist


def _identity(ctx, offset):
    return {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend,
            "pid": os.getpid(), "value": ctx.rank + offset}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_rank_returns_its_result(world_size, no_leftover_workers):
    out = launch(_identity, world_size, args=(100,))
    assert [r["rank"] for r in out.results] == list(range(world_size))
    assert [r["value"] for r in out.results] == [100 + r for r in range(world_size)]
    assert {r["world"] for r in out.results} == {world_size}
    assert out.backend == "gloo" and len({r["pid"] for r in out.results}) == world_size
    assert wait_until_gone([r["pid"] for r in out.results]) == []


def test_notebook_style_closure_is_shipped_by_value():
    scale = 3.0  # captured from the caller: only cloudpickle can ship this

    def work(ctx):
        t = torch.full((2,), float(ctx.rank)) * scale
        comm.all_reduce(t)
        return t.tolist()

    out = launch(work, 4)
    assert out.results == [[18.0, 18.0]] * 4  # 3 * (0 + 1 + 2 + 3)


def _raise_on_rank_two(ctx):
    if ctx.rank == 2:
        raise ValueError("bad value on purpose: 42")
    torch.distributed.barrier()  # the others block here, waiting for rank 2 forever
    return ctx.rank


def test_a_raising_worker_ends_the_launch_at_once_with_its_traceback(no_leftover_workers):
    t0 = time.time()
    with pytest.raises(WorkerError) as info:
        launch(_raise_on_rank_two, 4, timeout=60)
    elapsed = time.time() - t0
    assert info.value.rank == 2
    assert "ValueError: bad value on purpose: 42" in str(info.value)
    assert "_raise_on_rank_two" in info.value.worker_traceback  # the worker's own frames
    assert elapsed < 10, f"took {elapsed:.1f}s: the other ranks' barrier should not be awaited"


def _mismatched_receives(ctx):
    buf = torch.zeros(3)
    if ctx.rank == 0:
        comm.recv(buf, src=1)  # both wait to receive: nobody sends
    elif ctx.rank == 1:
        comm.recv(buf, src=0)
    return ctx.rank


def test_a_deadlock_ends_after_the_timeout_with_a_report(no_leftover_workers):
    t0 = time.time()
    with pytest.raises(LaunchTimeout) as info:
        launch(_mismatched_receives, 3, timeout=2)
    assert 2 <= time.time() - t0 < 15
    report = info.value.report
    assert report[2].startswith("finished its function; waiting for the other ranks")
    assert report[0].startswith("waiting in recv from rank 1 on world group [0, 1, 2] shape (3,) float32 (for ")
    assert "_mismatched_receives" in report[0]  # the stack names the user's function
    assert report[1].startswith("waiting in recv from rank 0")
    assert "deadlock" in str(info.value)


def _die_hard(ctx):
    if ctx.rank == 1:
        os._exit(7)  # no Python exception: the process just vanishes
    torch.distributed.barrier()


def test_a_worker_that_dies_without_an_exception_is_reported():
    with pytest.raises(WorkerError, match="rank 1 failed: process exited with code 7"):
        launch(_die_hard, 3, timeout=30)


def _chatty(ctx):
    for i in range(200):
        print(f"rank {ctx.rank} line {i} " + "x" * 200)
    print(f"rank {ctx.rank} to stderr", file=sys.stderr)
    os.write(1, f"rank {ctx.rank} raw fd write\n".encode())  # C-level output is captured too
    return ctx.rank


def test_prints_arrive_as_whole_lines_prefixed_by_rank(capsys):
    out = launch(_chatty, 4)
    printed = capsys.readouterr()
    pattern = re.compile(r"^\[rank (\d)\] rank \1 line (\d+) x{200}$")
    lines = [ln for ln in printed.out.splitlines() if " line " in ln]
    assert len(lines) == 800 and all(pattern.match(ln) for ln in lines)
    assert "[rank 3] rank 3 to stderr" in printed.err
    assert "[rank 2] rank 2 raw fd write" in printed.out
    for rank in range(4):
        mine = [text for stream, text in out.output[rank] if stream == "stdout" and " line " in text]
        assert [int(t.split()[3]) for t in mine] == list(range(200))  # in order, per rank


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="world_size must be a whole number >= 1, got 0"):
        launch(_identity, 0)
    with pytest.raises(ValueError, match="backend must be 'gloo', 'nccl' or 'auto'"):
        launch(_identity, 2, backend="mpi")


SCRIPT = textwrap.dedent("""
    import os, sys, time
    from tutorial_lib.launch import launch

    def work(ctx, pid_dir):
        with open(os.path.join(pid_dir, str(ctx.rank)), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)

    # No __main__ guard on purpose: the launcher must not re-run this file in workers.
    print("launching", flush=True)
    launch(work, 3, args=(sys.argv[1],), timeout=300)
""")


def _start_script(tmp_path):
    script = tmp_path / "long_job.py"
    script.write_text(SCRIPT)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(pid_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while len(os.listdir(pid_dir)) < 3:
        assert time.time() < deadline, "workers did not start"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.2)
    pids = [int((pid_dir / f).read_text()) for f in os.listdir(pid_dir)]
    assert all(process_alive(p) for p in pids)
    return proc, pids


def test_an_interrupted_launch_kills_its_workers(tmp_path):
    proc, pids = _start_script(tmp_path)
    proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" sends
    _, err = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert wait_until_gone(pids) == [], "workers survived the interrupt"


def test_workers_exit_when_the_launching_process_is_killed(tmp_path):
    proc, pids = _start_script(tmp_path)
    proc.kill()  # SIGKILL: no cleanup code runs in the launcher
    proc.wait(timeout=10)
    assert wait_until_gone(pids, seconds=10) == [], "orphaned workers kept running"


CONCURRENT = textwrap.dedent("""
    import sys, torch
    from tutorial_lib import comm
    from tutorial_lib.launch import launch

    def work(ctx, tag):
        total = 0.0
        for _ in range(20):
            t = torch.full((1000,), float(ctx.rank + tag))
            comm.all_reduce(t)
            total += t[0].item()
        return total

    tag = int(sys.argv[1])
    for _ in range(3):
        out = launch(work, 4, args=(tag,), print_output=False)
        assert out.results == [20 * (6 + 4 * tag)] * 4, out.results
    print("ok", tag)
""")


def test_two_notebooks_launching_at_once_do_not_collide(tmp_path):
    script = tmp_path / "two_launches.py"
    script.write_text(CONCURRENT)
    procs = [subprocess.Popen([sys.executable, str(script), str(tag)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in (1, 2)]
    for tag, proc in zip((1, 2), procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert f"ok {tag}" in out
