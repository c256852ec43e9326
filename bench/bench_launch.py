"""How long it takes to start N ranks and run one tiny all-reduce, three ways.

    python bench/bench_launch.py                 # 4 and 8 ranks, ~2 minutes on 2 cores
    python bench/bench_launch.py --ranks 4 --repeats 3

Every method runs the same job: ``init_process_group`` (gloo), all-reduce a
4-element tensor, return.  What is timed:

``tutorial_lib.launch``
    The ``launch(...)`` call, in a fresh Python process that has already
    imported torch (as a notebook kernel that builds tensors has).  *Cold* is
    the first launch: it starts the forkserver, which imports torch once.
    *Warm* is the median of the following launches, which only fork.
``mp.spawn``
    ``torch.multiprocessing.spawn`` with a ``file://`` rendezvous, timed in
    this process.  Every launch starts N fresh interpreters that each import
    torch: it is cold by design, and "warm" only means the OS file cache is.
``torchrun``
    ``python -m torch.distributed.run --standalone --nproc-per-node N script``
    as a subprocess, wall time to exit: its own interpreter, the elastic agent,
    the c10d rendezvous, and N workers that each import torch.  (Through the
    same ``python`` as this script, so no shell shim is timed.)

The ratio columns divide by the tutorial_lib warm time for the same N.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

# --- the job, once per method ------------------------------------------------------------------


def _tiny_all_reduce(ctx):
    """tutorial_lib version: the launcher already joined the process group."""
    import torch
    from tutorial_lib import comm
    return comm.all_reduce(torch.ones(4)).tolist()


def _spawn_worker(rank: int, world_size: int, init_file: str) -> None:
    """mp.spawn version: join the group through a file, all-reduce, leave."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == world_size
    dist.destroy_process_group()


TORCHRUN_SCRIPT = textwrap.dedent("""\
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")  # env:// rendezvous, set up by torchrun
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size()
    dist.destroy_process_group()
""")

# --- timing each method -------------------------------------------------------------------------


def time_tutorial_lib(world_size: int, repeats: int) -> tuple[float, list[float]]:
    """Run ``--child`` in a fresh interpreter, so its first launch is really the first."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                          str(world_size), str(repeats)],
                         capture_output=True, text=True, check=True)
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return times[0], times[1:]


def _child(world_size: int, repeats: int) -> None:
    """In the fresh interpreter: one cold launch, then ``repeats`` warm ones."""
    import torch  # noqa: F401 - the notebook has torch already; do not time its import here
    from tutorial_lib.launch import launch
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        result = launch(_tiny_all_reduce, world_size, print_output=False)
        times.append(time.perf_counter() - t0)
        assert result.results[0] == [float(world_size)] * 4
    print(json.dumps(times))


def time_spawn(world_size: int) -> float:
    import torch.multiprocessing as mp
    run_dir = tempfile.mkdtemp(prefix="bench_spawn_")
    init_file = os.path.join(run_dir, "rendezvous")  # a fresh file: the file store must start empty
    t0 = time.perf_counter()
    mp.spawn(_spawn_worker, args=(world_size, init_file), nprocs=world_size, join=True)
    elapsed = time.perf_counter() - t0
    if os.path.exists(init_file):
        os.remove(init_file)
    os.rmdir(run_dir)
    return elapsed


def time_torchrun(world_size: int, script: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={world_size}", script],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5,
                        help="warm tutorial_lib launches per N (median reported)")
    parser.add_argument("--slow-repeats", type=int, default=2,
                        help="launches after the first for mp.spawn and torchrun (each costs seconds)")
    args = parser.parse_args()

    script = os.path.join(tempfile.mkdtemp(prefix="bench_torchrun_"), "tiny_all_reduce.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_SCRIPT)

    rows = []
    started = time.perf_counter()
    for n in args.ranks:
        print(f"[{n} ranks] tutorial_lib.launch ...", file=sys.stderr, flush=True)
        tl_cold, tl_warm_all = time_tutorial_lib(n, args.repeats)
        tl_warm = statistics.median(tl_warm_all)
        measured = {"tutorial_lib.launch": (tl_cold, tl_warm)}
        for name, fn in (("mp.spawn (file://)", lambda: time_spawn(n)),
                         ("torchrun --standalone", lambda: time_torchrun(n, script))):
            print(f"[{n} ranks] {name} ...", file=sys.stderr, flush=True)
            times = [fn() for _ in range(1 + args.slow_repeats)]
            measured[name] = (times[0], statistics.median(times[1:]) if times[1:] else None)
        for name, (cold, warm) in measured.items():
            rows.append([name, n, cold, warm, cold / tl_warm,
                         None if warm is None else warm / tl_warm])

    print_table(["method", "ranks", "cold s", "warm s", "cold / tl warm", "warm / tl warm"],
                rows, title=f"Launch + one tiny all-reduce (gloo, {os.cpu_count()} cores, load average "
                            f"{os.getloadavg()[0]:.1f} at the end; "
                            f"tutorial_lib warm = median of {args.repeats}, others median of "
                            f"{args.slow_repeats})")
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")
    os.remove(script)
    os.rmdir(os.path.dirname(script))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
