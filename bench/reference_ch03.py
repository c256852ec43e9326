"""Chapter 3's stored reference: the DP buckets' overlap.

    python bench/reference_ch03.py                 # ~30 s on 2 quiet cores
    python bench/reference_ch03.py --repeats 9

Run it on a machine doing nothing else: it writes what the chapter shows beside the
reader's own numbers (``tutorial_lib/reference/ch03_*.json``, through
:func:`tutorial_lib.reference.save`, which records the machine, the date and the load).

* ``ch03_overlap``: the chapter's measured step (``GPTModel`` of 4 blocks, h = 64,
  TP = 2 x DP = 2, 2 microbatches, ``DataParallel`` buckets of 100,000 bytes, the same
  warm-up and barrier), launched ``--repeats`` times; per rank, the median over the
  launches of each part of :func:`tutorial_lib.viz.timeline.overlap_breakdown` (the
  buckets' time in flight split into waiting for the other replica, overlapped with the
  rank's own backward, and exposed), of :func:`overlap_fraction` (which counts the
  waiting as overlap) and of the last backward's duration.  The configuration is stored
  with the rows, and the chapter checks it ran the same step.

The chapter's running time is not measured here: ``scripts/time_chapters.py`` stores every
chapter's (the reference ``chapter_times``), and the chapter reads it from there.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The chapter's step, as notebooks/03_tp_dp.ipynb runs it (the chapter checks this dict).
CONFIG = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
          "vocab_size": 128, "tp": 2, "dp": 2, "global_batch": 8, "microbatches": 2,
          "bucket_bytes": 100_000, "lr": 1e-3, "eps": 1e-5, "max_norm": 0.5}
COMMAND = "python bench/reference_ch03.py"


def _measured_step(ctx, config):
    """The chapter's ``step_demo`` up to its measured step (nothing after it)."""
    import torch

    from tutorial_lib import comm, parallel_state
    from tutorial_lib.config import ModelConfig, ParallelConfig
    from tutorial_lib.data import split_global_batch, synthetic_batch
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.gpt import GPTModel
    from tutorial_lib.tp_dp_step import train_step

    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=config["tp"]))
    model_config = ModelConfig(**{k: config[k] for k in (
        "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")})
    batch = synthetic_batch(0, 0, config["global_batch"], config["seq_length"],
                            config["vocab_size"])
    batch = split_global_batch(batch, parallel_state.get_rank_in("dp"),
                               parallel_state.get_size("dp"))
    model = GPTModel(model_config, seed=1)
    ddp = DataParallel(model, bucket_size_bytes=config["bucket_bytes"])
    adam = torch.optim.Adam(model.parameters(), lr=config["lr"], eps=config["eps"])
    with ctx.tracer.tags(step="warm-up"):
        model(*batch).backward()
        ddp.finish_grad_sync()
    comm.barrier()
    with ctx.tracer.tags(step="measured"):
        train_step(ddp, adam, batch, config["microbatches"], max_grad_norm=config["max_norm"])


def overlap_rows(trace, world: int, last_microbatch: int) -> list[dict]:
    """Per rank, the numbers of the chapter's overlap table (milliseconds, and shares)."""
    from tutorial_lib.trace import Trace
    from tutorial_lib.viz.timeline import overlap_breakdown, overlap_fraction

    bucket_trace = Trace([e for e in trace if e.tags.get("phase") != "logging"])
    rows = []
    for rank in range(world):
        backward = trace.filter(rank=rank, op="compute", name="backward",
                                microbatch=last_microbatch)[0]
        buckets = trace.filter(rank=rank, op="all_reduce", group_kind="dp", phase="backward")
        parts = overlap_breakdown(trace, rank, "backward", op="all_reduce", group_kind="dp",
                                  phase="backward")
        running = parts["overlapped"] + parts["exposed"]
        rows.append({
            "rank": rank, "buckets": len(buckets),
            "last_backward_ms": 1e3 * backward.duration,
            "in_flight_ms": 1e3 * parts["in_flight"],
            "waiting_ms": 1e3 * parts["waiting_for_peers"],
            "overlapped_ms": 1e3 * parts["overlapped"],
            "exposed_ms": 1e3 * parts["exposed"],
            "hidden_share": parts["overlapped"] / running if running > 0 else 0.0,
            "overlap_fraction": overlap_fraction(bucket_trace, rank, "backward",
                                                 op="all_reduce", group_kind="dp"),
        })
    return rows


def measure_overlap(repeats: int) -> list[dict]:
    from tutorial_lib.launch import launch, warm_up

    warm_up()
    world = CONFIG["tp"] * CONFIG["dp"]
    runs = []
    for _ in range(repeats):
        result = launch(_measured_step, world, args=(CONFIG,), print_output=False,
                        timeout=300)
        runs.append(overlap_rows(result.trace.filter(step="measured"), world,
                                 CONFIG["microbatches"] - 1))
    # One real step, not a mix: the launch whose buckets spent the median total time in
    # flight (over all ranks), so that each row's parts still add up to its total.
    totals = [sum(row["in_flight_ms"] for row in run) for run in runs]
    median_run = runs[sorted(range(repeats), key=totals.__getitem__)[repeats // 2]]
    return [{key: round(value, 4) if isinstance(value, float) else value
             for key, value in row.items()} for row in median_run]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="launches of the step")
    args = parser.parse_args(argv)
    from tutorial_lib import reference

    load_before = reference.load_average()
    rows = measure_overlap(args.repeats)
    ref = reference.save(
        "ch03_overlap", rows, command=COMMAND,
        notes=f"the median of {args.repeats} launches of the chapter's measured step "
              f"(by the buckets' total time in flight); load {load_before} before",
        config=CONFIG, repeats=args.repeats, load=load_before)
    print(ref.caption())
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
