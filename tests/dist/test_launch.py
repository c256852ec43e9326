"""The launcher, with real gloo workers: results, failures, deadlocks, interrupts, leftovers."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.launch import (MISMATCH_HINT, RETURNED, LaunchTimeout, WorkerError,
                                 collective_mismatch_suspected, descendants, launch,
                                 process_running)

from .conftest import (run_two_notebooks, start_reporting_script,
                       wait_until_gone)
from tests.asserts import every
from .faults import fault_bench  # noqa: F401 - a fixture

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


def _test_modules_on_the_rank(ctx):
    return sorted(m for m in sys.modules if m.split(".")[0] in ("tests", "pytest", "nbformat"))


def test_a_worker_from_a_test_module_travels_by_value():
    """tests/dist/conftest.py ships the test modules' functions by value: a rank running one
    imports neither its test module nor pytest and nbformat (about 0.5 s of CPU a rank and
    launch when it did), and a test module's worker with arguments still returns its
    result."""
    assert launch(_test_modules_on_the_rank, 2).results == [[], []]
    assert [r["value"] for r in launch(_identity, 2, args=(7,)).results] == [7, 8]


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
    assert report[2].startswith("finished its function (returned from fn); waits in the "
                                "launcher's end-of-call barrier")
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
        with open(os.path.join(pid_dir, f"{ctx.rank}.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, f"{ctx.rank}.tmp"), os.path.join(pid_dir, str(ctx.rank)))
        time.sleep(120)  # the job the test interrupts or orphans: it must still be running

    # No __main__ guard on purpose: the launcher must not re-run this file in workers.
    print("launching", flush=True)
    launch(work, 3, args=(sys.argv[1],), timeout=300)
""")


def _start_script(tmp_path, env=None):
    proc, files = start_reporting_script(tmp_path, SCRIPT, 3, env=env)  # each rank's pid
    pids = [int(path.read_text()) for path in files]
    assert every(process_running(p) for p in pids)
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
    run_two_notebooks(tmp_path, CONCURRENT, seconds=120)


# --- hardening: clocks, causes, cleanup, odd results, children, restarts ----------


class SlowToUnpickle:
    """An argument whose unpickling in the worker takes ``seconds``: a stand-in for the slow
    imports of a cold worker on a busy machine (unpickling the function imports its modules)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        return (_sleep_then_build, (self.seconds,))


def _sleep_then_build(seconds):
    time.sleep(seconds)  # the behaviour under test: a worker slow to start
    return seconds


def _sum_ranks(ctx, slow):
    t = torch.tensor([float(ctx.rank)])
    comm.all_reduce(t)
    return t.item()


def test_the_timeout_clock_starts_when_every_rank_has_joined(no_leftover_workers):
    """Start-up that takes 3 s does not count against a 1 s timeout (it used to: a cold
    worker still importing was reported as a deadlock)."""
    out = launch(_sum_ranks, 3, args=(SlowToUnpickle(3.0),), timeout=1)
    assert out.results == [3.0] * 3


def test_a_deadlock_after_a_slow_start_is_still_reported_as_one(no_leftover_workers):
    with pytest.raises(LaunchTimeout) as info:
        launch(_mismatched_receives_slow, 3, args=(SlowToUnpickle(2.0),), timeout=2)
    assert info.value.report[0].startswith("waiting in recv from rank 1")
    assert info.value.report[2].startswith("finished its function")


def _mismatched_receives_slow(ctx, slow):
    return _mismatched_receives(ctx)


def test_start_up_has_its_own_bound_and_message(no_leftover_workers):
    from tutorial_lib.launch import StartupTimeout
    with pytest.raises(StartupTimeout) as info:
        launch(_sum_ranks, 2, args=(SlowToUnpickle(30.0),), start_timeout=1, timeout=60)
    message = str(info.value)
    assert "did not all start within start_timeout=1 s" in message
    assert "pass a larger start_timeout" in message and set(info.value.report) == {0, 1}


def _mismatched_shapes(ctx):
    t = torch.zeros(4 if ctx.rank == 0 else 3)
    torch.distributed.all_reduce(t)  # untraced on purpose: the check is torch's, on the group


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_collective_check_names_the_ranks_and_shapes_that_disagree(world_size):
    t0 = time.time()
    with pytest.raises(WorkerError) as info:
        launch(_mismatched_shapes, world_size, timeout=120, check_collectives=True)
    message = str(info.value)
    assert "collective mismatch" in message and "of shape [4] float" in message
    assert "of shape [3] float" in message and "rank 0 runs allreduce" in message
    assert time.time() - t0 < 60  # at once, not after the 120 s timeout


def test_an_untraced_barrier_is_named_in_the_deadlock_report():
    def work(ctx):
        if ctx.rank == 0:
            torch.distributed.barrier()          # rank 1 never joins it
        else:
            comm.recv(torch.zeros(1), src=0)    # and waits for a message rank 0 never sends
    with pytest.raises(LaunchTimeout) as info:
        launch(work, 2, timeout=2, check_collectives=False)
    assert info.value.report[0].startswith("waiting in torch.distributed.barrier (not traced")
    assert info.value.report[1].startswith("waiting in recv from rank 0")


def _abort_with_last_words(ctx):
    if ctx.rank == 1:
        os.write(2, b"[enforce fail] Received data size doesn't match expected size\n")
        os.abort()  # a C++ abort: no Python traceback, only what reached stderr
    torch.distributed.barrier()


def test_a_rank_killed_by_a_signal_brings_its_last_stderr_lines():
    for _ in range(3):  # the lines must arrive every time, not now and then
        with pytest.raises(WorkerError) as info:
            launch(_abort_with_last_words, 3, timeout=60, print_output=False)
        assert info.value.rank == 1 and "killed by signal SIGABRT (exit code -6)" in str(info.value)
        assert "Received data size doesn't match expected size" in str(info.value)


class _UnpicklableHere:
    def __reduce__(self):
        return (_refuse_to_build, ())


def _refuse_to_build():
    if os.environ.get("TUTORIAL_LIB_IN_WORKER") != "1":
        raise ImportError("this result can only be rebuilt in the worker")
    return "built"


def _odd_result_on_rank_one(ctx):
    os.environ["TUTORIAL_LIB_IN_WORKER"] = "1"
    return _UnpicklableHere() if ctx.rank == 1 else ctx.rank * 10


def test_a_result_the_launcher_cannot_unpickle_names_its_rank_and_keeps_the_others():
    with pytest.raises(WorkerError) as info:
        launch(_odd_result_on_rank_one, 3)
    assert info.value.rank == 1
    assert "could not be unpickled in the launcher" in str(info.value)
    assert "ImportError: this result can only be rebuilt in the worker" in str(info.value)
    assert info.value.results == [0, None, 20]


class _BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str is broken too")


def test_an_exception_whose_str_raises_is_still_reported():
    def work(ctx):
        if ctx.rank == 0:
            raise _BadStr()
        return ctx.rank
    with pytest.raises(WorkerError) as info:
        launch(work, 2)
    assert info.value.rank == 0 and "_BadStr: <its __str__ raised RuntimeError" in str(info.value)


def test_a_worker_that_closes_its_stdout_and_stderr_keeps_its_result():
    def work(ctx):
        print("before closing")
        os.close(1)
        os.close(2)
        return ctx.rank + 100
    out = launch(work, 2)
    assert out.results == [100, 101]
    assert ("stdout", "before closing") in out.output[0]


def _starts_children(ctx, pid_dir):
    child = subprocess.Popen(["sleep", "300"])  # children that would outlive the launch:
    pid = os.fork()                             # the behaviour under test
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    for p in (child.pid, pid):
        open(os.path.join(pid_dir, f"{ctx.rank}.{p}"), "w").close()
    return ctx.rank


def test_processes_a_worker_starts_end_with_the_launch(tmp_path):
    out = launch(_starts_children, 2, args=(str(tmp_path),))
    assert out.results == [0, 1]
    pids = [int(name.split(".")[1]) for name in os.listdir(tmp_path)]
    assert len(pids) == 4
    assert wait_until_gone(pids, seconds=5) == [], "a worker's children outlived the launch"


def _load_with_workers(ctx):
    from torch.utils.data import DataLoader
    import multiprocessing
    data = list(range(8))
    loaded = [int(x) for batch in DataLoader(data, batch_size=2, num_workers=2) for x in batch]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        squares = pool.map(abs, [-ctx.rank, -2])
    return loaded, squares


def test_a_dataloader_with_workers_and_a_pool_run_inside_a_launched_function():
    out = launch(_load_with_workers, 2, timeout=120)
    assert out.results == [(list(range(8)), [0, 2]), (list(range(8)), [1, 2])]


def test_a_launch_right_after_the_forkserver_died_starts_a_new_one():
    from multiprocessing import forkserver
    launch(_identity, 1, args=(0,))  # make sure a server runs
    server_pid = forkserver._forkserver._forkserver_pid
    os.kill(server_pid, signal.SIGKILL)
    out = launch(_identity, 2, args=(5,))  # at once: the old server may not even be reaped
    assert [r["value"] for r in out.results] == [5, 6]
    assert forkserver._forkserver._forkserver_pid != server_pid


def test_workers_exit_when_the_launcher_is_killed_and_never_reaped(tmp_path, fault_bench,
                                                                   monkeypatch):
    """A launcher killed by SIGKILL whose parent never waits for it stays a zombie; polling
    its pid would say it lives.  The liveness pipe reports end-of-file all the same.  Its
    run folder, which it could not remove, is removed by the next launch."""
    proc, pids = _start_script(tmp_path, env=fault_bench.env)
    os.kill(proc.pid, signal.SIGKILL)  # and no proc.wait(): the launcher stays a zombie
    try:
        assert wait_until_gone(pids, seconds=15) == [], "workers outlived an unreaped launcher"
    finally:
        proc.wait(timeout=10)
    assert [name.split("_")[3] for name in fault_bench.run_dirs()] == [str(proc.pid)]
    monkeypatch.setattr(tempfile, "tempdir", str(fault_bench.tmpdir))  # where it made it
    assert [r["value"] for r in launch(_identity, 1, args=(1,)).results] == [1]
    assert fault_bench.run_dirs() == []


def _crash(ctx):
    import ctypes
    if ctx.rank == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    torch.distributed.barrier()


def test_a_crash_is_reported_with_its_signal_and_the_python_stack(fault_bench):
    """faulthandler in every worker: a segfault said "code -11" and nothing more."""
    with pytest.raises(WorkerError) as info:
        launch(_crash, 2, timeout=120)
    message = str(info.value)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGSEGV
    assert "process was killed by signal SIGSEGV (exit code -11)" in message
    assert "Fatal Python error: Segmentation fault" in message
    assert 'test_launch.py", line' in message and "in _crash" in message


def _one_rank_returns_early(ctx, shape_of):
    if ctx.rank == 1:
        return "left"
    comm.all_reduce(torch.zeros(3))


def test_a_rank_that_returned_while_its_peers_wait_in_a_collective(fault_bench):
    """Without torch's check the launch ends at the timeout (2 s, counted once every rank
    joined: a busy machine does not shorten it); the report says the rank returned from fn
    and suggests the check.  With the check, the rank's end-of-call barrier, which the check
    sees as an op of its own, is named as what it is."""
    with pytest.raises(LaunchTimeout) as info:
        launch(_one_rank_returns_early, 2, args=(None,), timeout=2, check_collectives=False)
    assert info.value.report[1].startswith("finished its function (returned from fn); waits in "
                                           "the launcher's end-of-call barrier")
    assert str(info.value).endswith(MISMATCH_HINT)
    with pytest.raises(WorkerError) as info:
        launch(_one_rank_returns_early, 2, args=(None,), timeout=120, check_collectives=True)
    message = str(info.value)
    assert message.startswith("rank 1 failed: RuntimeError: returned from fn while other ranks "
                              "were still inside a collective"), message
    assert "rank 0 runs allreduce of shape [3] float as its op #0 on the group, but rank 1 " \
           "returned from fn" in message


def test_the_mismatch_hint_reads_the_report():
    """Which timeout reports suggest ``check_collectives=True`` (pure: reports as written)."""
    wait = "waiting in {} on world group [0, 1, 2, 3] shape {} torch.float32 (for 2.0 s)"
    returned = f"{RETURNED} (for 1.0 s)"
    assert collective_mismatch_suspected({0: wait.format("all_reduce", "(4,)"), 1: returned})
    assert collective_mismatch_suspected({0: wait.format("all_reduce", "(4,)"),
                                          1: wait.format("all_reduce", "(3,)")})
    assert not collective_mismatch_suspected({0: wait.format("all_reduce", "(4,)"),
                                              1: wait.format("all_reduce", "(4,)")})
    assert not collective_mismatch_suspected({0: wait.format("recv", "(4,)"), 1: returned})


def _uneven_p2p_then_collectives(ctx):
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    parallel_state.initialize_model_parallel(ParallelConfig(3, pipeline_model_parallel_size=3))
    x = torch.ones(2)
    if ctx.rank < 2:                       # a pipeline: 0 -> 1 -> 2, ranks send unevenly
        comm.send(x, ctx.rank + 1, group="pp")
    if ctx.rank > 0:
        comm.recv(x, ctx.rank - 1, group="pp")
    comm.send(x, (ctx.rank + 1) % 3) if ctx.rank == 0 else None
    if ctx.rank == 1:
        comm.recv(x, 0)
    t = torch.ones(1)
    comm.all_reduce(t, group="pp")
    comm.all_reduce(t)
    return t.item()


def test_the_collective_check_is_not_fooled_by_uneven_point_to_point_traffic():
    """torch's check counts sends and receives in its sequence numbers; comm's P2P travels on
    unchecked twin groups, so a pipeline's uneven P2P does not look like a mismatch."""
    out = launch(_uneven_p2p_then_collectives, 3, check_collectives=True)
    assert out.results == [9.0] * 3


_TREE = ("import subprocess, sys\n"
         "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],\n"
         "                         stdin=subprocess.PIPE)\n"
         "print(child.pid, flush=True)\n"
         "sys.stdin.read()\n")


def test_descendants_walks_the_tree_from_proc_and_from_ps_where_there_is_no_proc(monkeypatch):
    """The one process-tree walk (the grader's cleanup, the fault tests): a child that started
    a grandchild; read from /proc, then from ``ps`` as on a system without /proc."""
    child = subprocess.Popen([sys.executable, "-c", _TREE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    grandchild = []
    try:
        grandchild.append(int(child.stdout.readline()))  # printed once it runs
        assert descendants(child.pid) == grandchild
        monkeypatch.setattr("tutorial_lib.launch.os.path.isdir", lambda path: False)
        assert descendants(child.pid) == grandchild
    finally:
        child.stdin.close()  # the child returns, and the grandchild reads the end of its pipe
        child.wait(timeout=60)
        child.stdout.close()
        assert wait_until_gone(grandchild, 60) == []
