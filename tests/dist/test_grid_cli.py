"""The grid's command line as a user runs it: ``python -m tutorial_lib.grid`` in a new process."""
import subprocess
import sys


def test_cli_as_a_module_exits_nonzero():
    bad = subprocess.run([sys.executable, "-m", "tutorial_lib.grid", "--world-size", "8", "--tp", "3"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "rule 1" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "tutorial_lib.grid", "--world-size", "8", "--tp", "2",
                         "--layout", "visualizer", "--all-kinds"], capture_output=True, text=True)
    assert ok.returncode == 0 and "embedding" in ok.stdout and "visualizer layout" in ok.stdout


def _grid(*args):
    return subprocess.run([sys.executable, "-m", "tutorial_lib.grid", *args], capture_output=True, text=True)


def test_cli_orders_as_a_module():
    """Issue 11, defects 7, 8, 11, as a user types them (Megatron-Core 0.20.0, d98e8a64,
    parallel_state.py: ``initialize_model_parallel`` reads both grids from one order and
    defaults ETP to TP; ``RankGenerator`` lets an order leave out a size-1 dimension only)."""
    folded = _grid("--world-size", "16", "--tp", "2", "--pp", "2", "--ep", "2", "--layout", "megatron",
                   "--order", "tp-cp-ep-dp-pp")
    assert folded.returncode == 0, folded.stderr
    assert "ETP=2" in folded.stdout and "megatron layout: order tp-cp-ep-dp-pp" in folded.stdout
    short = _grid("--world-size", "8", "--tp", "2", "--pp", "2", "--order", "tp-cp-dp-pp")
    assert short.returncode == 0 and "custom layout: order tp-cp-dp-pp-ep" in short.stdout
    refused = _grid("--world-size", "8", "--cp", "2", "--order", "tp-dp-pp")
    assert refused.returncode == 2 and "leaves out cp, whose size is 2" in refused.stderr
    help_text = " ".join(_grid("--help").stdout.split())
    assert "A bare --order (no --layout) builds ONE grid" in help_text
