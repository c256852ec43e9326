"""The launcher's reading of results: a rank that exits right after sending its
result is not a failure.

Every rank sends its result and exits at once, and all ranks leave together (a barrier), so
a rank can exit between the launcher's read of the pipes and its look at the exit codes.
The launcher blamed it, found no error to report, and failed with an ``IndexError`` (seen
in ``tests/dist/test_checkpoint.py``'s 8-rank runs on a loaded machine).  Pure: fake
processes and a fake collector stand for the pipes; no process starts.
"""
import os
from types import SimpleNamespace

from tutorial_lib.launch import RankProcesses


class Pipes:
    """A collector whose next read delivers the results in ``pending`` (or nothing)."""

    def __init__(self, finished, pending=(), failures=()):
        self.finished, self.pending, self.failures = set(finished), set(pending), list(failures)
        self.reads = 0

    def poll(self, wait):
        self.reads += 1
        self.finished |= self.pending


def _dead_ranks(processes, pipes, grace=0.5):
    ranks = object.__new__(RankProcesses)  # no pipes, no run folder: only what dead_ranks reads
    ranks.processes, ranks.collector = processes, pipes
    return ranks.dead_ranks(pipes.finished, grace=grace)


def test_a_rank_that_exited_after_sending_its_result_is_not_blamed():
    processes = [SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=0)]
    pipes = Pipes(finished={0}, pending={1})  # rank 1's result waits in its pipe
    assert _dead_ranks(processes, pipes) == []
    assert pipes.finished == {0, 1} and pipes.reads == 1


def test_a_rank_that_exited_without_a_result_is_blamed_after_the_grace():
    processes = [SimpleNamespace(exitcode=0), SimpleNamespace(exitcode=-9)]
    pipes = Pipes(finished={0})
    assert _dead_ranks(processes, pipes, grace=0.1) == [1]
    assert pipes.reads >= 1


def test_with_an_error_reported_an_exited_rank_is_named_at_once_and_running_ranks_never():
    running = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=None)]
    assert _dead_ranks(running, Pipes(finished=set())) == []
    failed = Pipes(finished=set(), failures=["rank 1 raised"])
    assert _dead_ranks([SimpleNamespace(exitcode=1), running[1]], failed) == [0]
    assert failed.reads == 0


def test_a_process_reaped_between_opening_and_reading_its_stat_counts_as_gone(monkeypatch):
    """Linux lets ``/proc/PID/stat`` open and then fails the read with ESRCH when the process
    is reaped in between (CI, 2026-11-29): that process is gone, not an error."""
    from tutorial_lib import launch

    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read()) + 1  # above the largest pid Linux hands out: no such process

    class ReapedWhileReading:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(launch, "open", lambda *a, **k: ReapedWhileReading(), raising=False)
    assert launch.process_running(gone) is False
    assert launch.process_running(os.getpid()) is True  # a live pid still runs (os.kill)
