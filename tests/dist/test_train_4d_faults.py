"""``examples/train_4d.py`` against what a cluster does to a run, as a user meets it.

A worker killed from outside (``--max-restarts``, and torchrun's own ``--max-restarts``),
``SIGTERM`` before a preemption, a kill while an asynchronous save is written.  Each runs
with a CPU hog beside it and checks that no process and no run folder is left
(``tests/dist/faults.py``).  The restarted runs' losses equal an uninterrupted run's bit
for bit: a restart resumes on the same layout from a committed checkpoint.  The test hook
``TUTORIAL_LIB_DIE_AFTER`` (:data:`tutorial_lib.train_4d.DIE_AFTER_ENV`) makes rank 1 kill
itself with ``SIGKILL`` after iteration 3, once.  Damaged and crafted checkpoints are
refused before any worker starts: tests/unit/test_checkpointing.py.  About 3 minutes
under load 20 on 2 cores (one in-process reference, three command lines of 2 ranks).
"""
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tutorial_lib import checkpointing
from tutorial_lib.train_4d import DIE_AFTER_ENV, TrainingArgs, train

from .faults import fault_bench  # noqa: F401 - a fixture

pytestmark = pytest.mark.dist

TRAIN_4D = Path(__file__).resolve().parents[2] / "examples" / "train_4d.py"
CLI = ["--num-layers", "2", "--hidden-size", "16", "--vocab-size", "32", "--seq-length", "8",
       "--global-batch-size", "4", "--num-microbatches", "2"]
ARGS = TrainingArgs(num_layers=2, hidden_size=16, vocab_size=32, seq_length=8,
                    global_batch_size=4, num_microbatches=2, world_size=2, steps=4)


@pytest.fixture(scope="module")
def reference() -> dict[int, float]:
    """The uninterrupted run's loss per iteration."""
    return {r["iteration"]: r["loss"] for r in train(ARGS).results[0]}


def _records(stdout: str) -> dict[int, float]:
    """Iteration -> loss of the JSON lines; a later line of an iteration (a restarted world
    ran it again) wins."""
    return {r["iteration"]: r["loss"] for r in map(json.loads, stdout.splitlines())
            if isinstance(r, dict)}


def test_a_killed_worker_restarts_the_world_from_the_last_committed_checkpoint(
        fault_bench, tmp_path, reference):
    """Rank 1 is killed after iteration 3, while the asynchronous save of iteration 3 is
    written in the background (or written and not committed): the previous checkpoint,
    iteration 2, is what the world restarts from; iterations 3 and 4 are trained again and
    the losses are the uninterrupted run's.  ``--keep-last 2`` leaves the last two."""
    save, marker = tmp_path / "ckpt", tmp_path / "rank 1 died"
    done = subprocess.run(
        [sys.executable, str(TRAIN_4D), *CLI, "--world-size", "2", "--steps", "4", "--save",
         str(save), "--save-interval", "1", "--async-save", "--keep-last", "2",
         "--max-restarts", "1", "--json"],
        capture_output=True, text=True, timeout=600,
        env={**fault_bench.env, DIE_AFTER_ENV: f"1:3:{marker}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()  # rank 1 did die
    said = [line for line in done.stderr.splitlines() if line.startswith("train_4d.py:")]
    assert said == [f"train_4d.py: rank 1: process was killed by signal SIGKILL (exit code -9) "
                    f"before returning a result; restart 1 of 1, from {save}/iter_0000002 "
                    f"(iteration 2)"], done.stderr[-3000:]
    assert _records(done.stdout) == reference
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000004",
                                        checkpointing.TRACKER_FILENAME]


def test_torchruns_own_restarts_resume_from_the_last_checkpoint(fault_bench, tmp_path, reference):
    """``torchrun --max-restarts 1``: torchrun starts both workers again after rank 1 dies;
    train_4d sees ``TORCHELASTIC_RESTART_COUNT`` and resumes from ``--save``."""
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    save, marker = tmp_path / "ckpt", tmp_path / "rank 1 died"
    done = subprocess.run(
        [*command, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         str(TRAIN_4D), *CLI, "--steps", "4", "--save", str(save), "--save-interval", "2",
         "--json"],
        capture_output=True, text=True, timeout=600,
        env={**fault_bench.env, DIE_AFTER_ENV: f"1:3:{marker}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()
    assert (f"train_4d.py: torchrun restart 1: resuming from {save}/iter_0000002 (iteration 2)"
            in done.stderr), done.stderr[-3000:]
    assert _records(done.stdout) == reference


def _read_until(process, fragment: str, seconds: float = 300) -> list[str]:
    """Lines of ``process``'s stdout up to the first holding ``fragment``."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    lines, deadline = [], time.time() + seconds
    while not any(fragment in line for line in lines):
        if process.poll() is not None or time.time() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"no {fragment!r} (rc {process.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        if selector.select(0.05):
            lines.append(process.stdout.readline())
    return lines


def test_sigterm_finishes_the_step_saves_and_exits_0_with_the_resume_command(fault_bench,
                                                                             tmp_path):
    """What a scheduler sends before it preempts a job: the workers finish the step they
    are in, agree on stopping, save it, and the run exits 0 naming the command that resumes."""
    save = tmp_path / "ckpt"
    flags = [*CLI, "--world-size", "2", "--steps", "1000", "--save", str(save)]
    process = subprocess.Popen([sys.executable, str(TRAIN_4D), *flags], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, env=fault_bench.env)
    try:
        _read_until(process, "iteration 2/1000")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, err[-3000:]
    latest = checkpointing.latest_checkpoint(str(save))
    assert latest is not None and latest.iteration >= 2
    k = latest.iteration
    assert f"[rank 0] saved checkpoint of iteration {k} to {latest.path}" in out
    assert f"iteration {k + 1}/1000" not in out  # stopped after the step it was in
    assert err.strip().splitlines()[-1] == (
        f"train_4d.py: SIGTERM: stopped after iteration {k}/1000; last checkpoint: "
        f"{latest.path} (iteration {k}); resume: python {TRAIN_4D} {' '.join(flags)} --load {save}")
