"""Run the same traced collectives from the notebook launcher or under torchrun.

    python examples/collectives_demo.py --world-size 4
    torchrun --standalone --nproc-per-node 4 examples/collectives_demo.py

Each rank all-reduces a tensor filled with its rank and all-gathers its rank id;
rank 0 prints the results and what the trace recorded.  The worker function is
identical in both worlds: only the way the processes start differs.
"""
import argparse
import json

import torch

from tutorial_lib import comm
from tutorial_lib.launch import is_torchrun, launch, run_under_torchrun


def work(ctx):
    total = comm.all_reduce(torch.full((4,), float(ctx.rank)))
    everyone = comm.all_gather(torch.empty(ctx.world_size), torch.tensor([float(ctx.rank)]))
    return {"rank": ctx.rank, "sum": total[0].item(), "gathered": everyone.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    if is_torchrun():
        result, events = run_under_torchrun(work)
        results = [result] if result["rank"] == 0 else []
        n_events = len(events)
    else:
        out = launch(work, args.world_size)
        results, n_events = out.results[:1], len(out.trace.filter(rank=0))
    for r in results:
        print(json.dumps({**r, "events_on_rank_0": n_events}))


if __name__ == "__main__":
    main()
