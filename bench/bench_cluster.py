"""A trivial cell on N ranks, through a real Jupyter kernel: ``%%ranks`` beside the others.

    pip install -r bench/requirements.txt     # nbdistributed, for its %%distributed magic
    python bench/bench_cluster.py              # 4 and 8 ranks, a few minutes on 2 cores
    python bench/bench_cluster.py --ranks 4 --repeats 20

Every row times what a reader waits for after pressing Shift-Enter on a cell whose work is
nothing, measured in this process around ``execute`` on a kernel client (so the kernel's
own messaging is in every row; the first row is that alone):

``empty cell``
    ``pass`` in the kernel itself: the floor every cell pays.
``%%ranks`` (tutorial_lib.cluster)
    a ``pass`` cell on the notebook's persistent cluster (started once with ``%ranks_start``,
    timed separately as "start").
``%%distributed`` (nbdistributed)
    the same cell with nbdistributed's magic on its own persistent workers (``%dist_init``),
    when the package is installed; skipped otherwise.
``launch`` (tutorial_lib.launch)
    a cell calling ``launch(noop, N)``: workers started for the cell and gone after it.
``mp.spawn``, ``torchrun``
    from ``bench_launch.py``: start N ranks, one tiny all-reduce, exit (outside the kernel).

The ratio column divides by the ``%%ranks`` time at the same N.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402
from bench_launch import TORCHRUN_SCRIPT, time_spawn, time_torchrun  # noqa: E402


def _cell_times(kc, code: str, repeats: int, timeout: float = 300) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        times.append(time.perf_counter() - t0)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {code!r}: {reply['content']}")
    return times


def _kernel():
    from jupyter_client.manager import start_new_kernel
    # nbdistributed starts its workers as `python worker.py`: the python on PATH must be the
    # one it is installed in (a venv's, say), so this interpreter's folder goes first.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return start_new_kernel(kernel_name="python3")


def time_in_kernel(n: int, repeats: int) -> dict[str, tuple[float | None, float]]:
    """(start seconds, median cell seconds) per method, in fresh kernels."""
    out = {}
    km, kc = _kernel()
    try:
        _cell_times(kc, "import torch", 1)
        out["empty cell"] = (None, statistics.median(_cell_times(kc, "pass", repeats)))
        start = _cell_times(kc, f"%load_ext tutorial_lib.cluster\n%ranks_start {n}", 1)[0]
        _cell_times(kc, "%%ranks\npass", 3)  # first calls warm the pipes and caches
        out["%%ranks (tutorial_lib.cluster)"] = (
            start, statistics.median(_cell_times(kc, "%%ranks\npass", repeats)))
        _cell_times(kc, "%ranks_stop", 1)
        code = ("from tutorial_lib.launch import launch\n"
                f"launch(lambda ctx: None, {n}, print_output=False, check_collectives=False)")
        _cell_times(kc, code, 1)  # the forkserver's start is not a cell's cost
        out["launch (tutorial_lib.launch)"] = (None, statistics.median(_cell_times(kc, code, 5)))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    try:
        import nbdistributed  # noqa: F401
    except ImportError:
        print("nbdistributed is not installed (pip install -r bench/requirements.txt): "
              "its row is skipped", file=sys.stderr)
        return out
    km, kc = _kernel()
    try:
        start = _cell_times(kc, f"%load_ext nbdistributed\n%dist_init -n {n}", 1)[0]
        _cell_times(kc, "%%distributed\npass", 3)
        out["%%distributed (nbdistributed)"] = (
            start, statistics.median(_cell_times(kc, "%%distributed\npass", repeats)))
        _cell_times(kc, "%dist_shutdown", 1)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=30, help="cells per method (median)")
    parser.add_argument("--no-spawn", action="store_true", help="skip mp.spawn and torchrun")
    args = parser.parse_args()
    script = os.path.join(tempfile.mkdtemp(prefix="bench_cluster_"), "tiny_all_reduce.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_SCRIPT)
    rows = []
    for n in args.ranks:
        print(f"[{n} ranks] in a kernel ...", file=sys.stderr, flush=True)
        measured = time_in_kernel(n, args.repeats)
        if not args.no_spawn:
            measured["mp.spawn (outside a kernel)"] = (None, statistics.median(
                [time_spawn(n) for _ in range(2)]))
            measured["torchrun (outside a kernel)"] = (None, statistics.median(
                [time_torchrun(n, script) for _ in range(2)]))
        ranks_cell = measured["%%ranks (tutorial_lib.cluster)"][1]
        for name, (start, cell) in measured.items():
            rows.append([name, n, start, 1e3 * cell, cell / ranks_cell])
    print_table(["method", "ranks", "start s", "trivial cell ms", "/ %%ranks"], rows,
                title=f"A trivial cell on N ranks through a Jupyter kernel ({os.cpu_count()} "
                      f"cores, load average {os.getloadavg()[0]:.1f} at the end; median of "
                      f"{args.repeats} cells, 2 runs for spawn/torchrun)")
    os.remove(script)
    os.rmdir(os.path.dirname(script))


if __name__ == "__main__":
    main()
