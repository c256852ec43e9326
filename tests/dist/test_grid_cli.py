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
    """Megatron's folded grids (three defects once), as a user types them (Megatron-Core 0.20.0, d98e8a64,
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


def test_cli_answers_huge_worlds_and_empty_orders_at_once():
    """Huge worlds, as a user types them: ``--world-size 2**20`` took a minute and printed 62 MB,
    10**12 + 1 never answered, 10**18 and 10**30 ended in MemoryError / OverflowError
    tracebacks, ``--order ""`` printed an order the user never typed (megatron layout) or a
    KeyError traceback.  Now: a summary of a few kB, or exit 2 with a message; each run is
    given 60 s, far beyond the fraction of a second it takes (the old runs hit the limit)."""
    cases = [
        (["--world-size", str(2**20), "--tp", "2"], 0, "(a summary: the first 4 groups"),
        (["--world-size", str(10**12 + 1)], 2, "world_size (1,000,000,000,001) is more ranks"),
        (["--world-size", str(10**18)], 2, "--world-size 4 shows the same pattern"),
        (["--world-size", str(10**30), "--tp", "8"], 2, "--world-size 32 --tp 8 shows the same pattern"),
        (["--world-size", "8", "--order", ""], 2, "order '' is empty"),
        (["--world-size", "8", "--order", "", "--layout", "megatron"], 2, "order '' is empty"),
    ]
    runs = [subprocess.Popen([sys.executable, "-m", "tutorial_lib.grid", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for argv, _, _ in cases]
    for (argv, code, fragment), run in zip(cases, runs):
        try:
            out, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            raise AssertionError(f"{argv} did not answer within 60 s") from None
        assert run.returncode == code, (argv, err[-2000:])
        assert fragment in (out if code == 0 else err), (argv, out[:2000], err[-2000:])
        assert "Traceback" not in err and len(out) < 10_000, argv
