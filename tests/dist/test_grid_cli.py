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
