"""The same worker function under torchrun (env:// rendezvous) and under the launcher."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

DEMO = Path(__file__).resolve().parents[2] / "examples" / "collectives_demo.py"


def _run(cmd, tmp_path):
    # torchrun makes a log folder (torchelastic_*) in TMPDIR and leaves it: keep it in the
    # test's own folder, which pytest removes
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]


def test_demo_gives_the_same_answer_under_torchrun_and_the_launcher(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    under_torchrun = _run(cmd + ["--standalone", "--nproc-per-node", "3", str(DEMO)], tmp_path)
    under_launcher = _run([sys.executable, str(DEMO), "--world-size", "3"], tmp_path)
    assert under_torchrun == under_launcher
    assert under_launcher[0]["sum"] == 3.0 and under_launcher[0]["gathered"] == [0.0, 1.0, 2.0]
    assert under_launcher[0]["events_on_rank_0"] == 2
