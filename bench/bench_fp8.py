"""FP8 vs BF16 all-to-all on gloo: bytes on the wire, wall time, and what quantizing costs.

    python bench/bench_fp8.py                  # ~1-2 min on 2 cores (9 configurations)
    python bench/bench_fp8.py --quick          # ~15 s: 2 configurations
    python bench/bench_fp8.py --tokens 1024 --hidden 7168 --rounds 5
    python bench/bench_fp8.py --save-reference # chapter 8's measurement, 3 times: its reference

``--save-reference`` runs chapter 8's own measurement, ``timing.time_all_to_all()`` (2,048
bf16 rows per rank, H 1024 and 4096, BF16 against FP8 end to end), three times, and
stores the median of each number as the stored reference ``ch08_fp8_all_to_all``
(``tutorial_lib/reference/``, with this machine, the date and its load) that the chapter
shows beside the reader's run.  Run it on a machine as quiet as you can make it.

4 EP ranks (``ParallelConfig(4, expert_model_parallel_size=4)``), one launch, one torch
thread per rank.  Each rank holds ``T`` bf16 token rows ``[T, H]`` and sends ``T/4`` of them
to every rank (even splits: this measures the transport, not a routing).  Per configuration
(T x H) and per round, in turns (order rotated each round), after a barrier each:

* **BF16**: one ``comm.all_to_all`` of the bf16 rows (``2H`` bytes per row);
* **FP8**: ``fp8.encode`` (1x128 quantization with fp32 scales + packing into uint8 rows),
  a barrier (so the all-to-all's clock does not include waiting for a slower rank's
  quantization), one ``comm.all_to_all`` of the packed rows (``H + 4H/128`` bytes per row),
  ``fp8.decode``
  (unpacking + dequantization back to bf16): the library's ``fp8.all_to_all`` step by step,
  so each part has its own clock.

Bytes are **from the trace** (``TraceEvent.bytes``, the rows a rank hands to the op, its own
share included) and asserted equal to ``T x fp8.wire_bytes_per_row``; the received rows are
checked against a local encode/decode of the senders' rows.  Times: the slowest rank per
trip, median over trips.  Columns: *a2a ms* the all-to-all alone; *quant ms* encode,
*dequant ms* decode; *FP8 total / BF16*: (quant + a2a + dequant) over the BF16 all-to-all;
*cost / saving*: (quant + dequant) over (BF16 a2a - FP8 a2a), the quantization's cost per
millisecond of all-to-all it saves (below 1 pays off; on CPU gloo it does not).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _table import print_table  # noqa: E402

EP = 4


def _bench(ctx, configs, rounds: int, iters: int, seed: int) -> dict:
    import torch
    import torch.distributed as dist
    from tutorial_lib import comm, fp8, parallel_state
    from tutorial_lib.config import ParallelConfig

    parallel_state.initialize_model_parallel(ParallelConfig(ctx.world_size, expert_model_parallel_size=EP))
    inputs = {c: torch.randn(c[0], c[1], generator=torch.Generator().manual_seed(seed + ctx.rank)).bfloat16()
              for c in configs}
    events = ctx.tracer.events

    def trip(config, kind):
        tokens, hidden = config
        x, splits = inputs[config], [tokens // EP] * EP
        first = len(events)
        dist.barrier()
        t0 = time.perf_counter()
        wire = x if kind == "bf16" else fp8.encode(x, "fp8")
        t1 = time.perf_counter()
        dist.barrier()  # the all-to-all's clock must not include waiting for a slower quantizer
        t1b = time.perf_counter()
        out = comm.all_to_all(wire.new_empty(wire.shape), wire, "ep", splits, splits)
        t2 = time.perf_counter()
        y = out if kind == "bf16" else fp8.decode(out, "fp8", hidden, torch.bfloat16)
        t3 = time.perf_counter()
        sent = [e.bytes for e in events[first:] if e.op == "all_to_all"]
        return {"quant": t1 - t0, "a2a": t2 - t1b, "dequant": t3 - t2, "bytes": sent}, y

    # warm-up, and a correctness check: what arrives is the senders' rows, encoded and decoded
    for config in configs:
        for kind in ("bf16", "fp8"):
            _, y = trip(config, kind)
            tokens, hidden = config
            part = tokens // EP
            expected = torch.cat([torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + src))
                                  .bfloat16()[ctx.rank * part:(ctx.rank + 1) * part] for src in range(EP)])
            if kind == "fp8":
                expected = fp8.decode(fp8.encode(expected, "fp8"), "fp8", hidden, torch.bfloat16)
            if not torch.equal(y, expected):
                raise AssertionError(f"{config} {kind}: the received rows are not the senders' rows")
    out = {(c, k): [] for c in configs for k in ("bf16", "fp8")}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            for _ in range(iters):
                for kind in ("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16"):
                    out[(config, kind)].append(trip(config, kind)[0])
    return out


def save_reference(runs: int = 3) -> None:
    """Chapter 8's timing, ``runs`` times; the median of each number becomes the reference."""
    from tutorial_lib import reference, timing
    from tutorial_lib.launch import warm_up
    warm_up()
    load_start = os.getloadavg()[0]
    measured = [timing.time_all_to_all() for _ in range(runs)]
    rows = []
    for i, first in enumerate(measured[0]):
        row = dict(first)
        for key in ("bf16_ms", "fp8_ms"):
            row[key] = round(statistics.median(m[i][key] for m in measured), 3)
        rows.append(row)
    notes = (f"timing.time_all_to_all(): 4 EP ranks (gloo, 1 torch thread each), 2048 bf16 rows "
             f"per rank; median of {runs} runs, each the slowest rank's median of 5 trips; "
             f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
             f"Python {platform.python_version()}, torch {__import__('torch').__version__}")
    ref = reference.save("ch08_fp8_all_to_all", rows, load=load_start,
                         command="python bench/bench_fp8.py --save-reference", notes=notes)
    print_table(["H", "BF16 bytes", "FP8 bytes", "BF16 ms", "FP8 ms", "FP8 / BF16 time"],
                [[r["hidden"], r["bf16_bytes"], r["fp8_bytes"], r["bf16_ms"], r["fp8_ms"],
                  r["fp8_ms"] / r["bf16_ms"]] for r in rows], digits=3, title=ref.caption())
    print(f"\nsaved {reference.REFERENCE_DIR / 'ch08_fp8_all_to_all.json'}: {notes}")


def main() -> None:
    from tutorial_lib import fp8
    from tutorial_lib.launch import launch, warm_up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096],
                        help="token rows per rank (a multiple of 4)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096, 7168],
                        help="hidden sizes (multiples of 128)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3, help="timed trips per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="T 1024, H 1024 and 7168, 2 rounds of 2")
    parser.add_argument("--save-reference", action="store_true",
                        help="run chapter 8's measurement 3 times and store its reference")
    args = parser.parse_args()
    if args.save_reference:
        save_reference()
        return
    if args.quick:
        args.tokens, args.hidden, args.rounds, args.iters = [1024], [1024, 7168], 2, 2
    for h in args.hidden:
        fp8.num_tiles(h)  # refuses a hidden size that is not a multiple of 128, with the fix
    if any(t % EP for t in args.tokens):
        parser.error(f"--tokens must be multiples of {EP}")
    configs = [(t, h) for h in sorted(set(args.hidden)) for t in sorted(set(args.tokens))]
    load_start = os.getloadavg()[0]
    warm_up()
    started = time.perf_counter()
    result = launch(_bench, EP, args=(configs, args.rounds, args.iters, args.seed),
                    threads=1, print_output=False, timeout=1800)
    bench_s = time.perf_counter() - started
    rows = []
    for config in configs:
        tokens, hidden = config
        med = {}
        for kind in ("bf16", "fp8"):
            trips = [result.results[rank][(config, kind)] for rank in range(EP)]
            for rank_trips, want in ((t, tokens * fp8.wire_bytes_per_row(hidden, kind)) for t in trips):
                for record in rank_trips:
                    if record["bytes"] != [want]:
                        raise AssertionError(f"{config} {kind}: traced {record['bytes']} bytes, "
                                             f"formula T x wire_bytes_per_row = {want}")
            n = len(trips[0])
            med[kind] = {part: statistics.median(max(t[i][part] for t in trips) for i in range(n)) * 1e3
                         for part in ("quant", "a2a", "dequant")}
        bf16_bytes = tokens * fp8.wire_bytes_per_row(hidden, "bf16")
        fp8_bytes = tokens * fp8.wire_bytes_per_row(hidden, "fp8")
        fp8_total = sum(med["fp8"].values())
        saved = med["bf16"]["a2a"] - med["fp8"]["a2a"]
        cost = med["fp8"]["quant"] + med["fp8"]["dequant"]
        rows.append([tokens, hidden, bf16_bytes / 1024, fp8_bytes / 1024, fp8_bytes / bf16_bytes,
                     med["bf16"]["a2a"], med["fp8"]["a2a"], med["fp8"]["a2a"] / med["bf16"]["a2a"],
                     med["fp8"]["quant"], med["fp8"]["dequant"], fp8_total / med["bf16"]["a2a"],
                     cost / saved if saved > 0 else None])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print_table(["T / rank", "H", "BF16 KiB (trace)", "FP8 KiB (trace)", "FP8 / BF16 bytes",
                 "BF16 a2a ms", "FP8 a2a ms", "a2a FP8 / BF16", "quant ms", "dequant ms",
                 "FP8 total / BF16", "cost / saving"], rows, digits=3,
                title=f"FP8 (E4M3, 1x128 tiles, fp32 scales) vs BF16 all-to-all: {EP} EP ranks (gloo, "
                      f"1 torch thread each), even splits; median of {args.rounds} rounds x "
                      f"{args.iters} trips, slowest rank; {now}, {os.cpu_count()} cores, load "
                      f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("\nchecked: every traced all-to-all sent T x wire_bytes_per_row bytes (2H per BF16 row, "
          "H + 4H/128 per FP8 row); received rows == the senders' rows (encoded and decoded for FP8). "
          "'-' in cost / saving: FP8 saved no all-to-all time.")
    print(f"\nbench time {bench_s:.0f} s (Python {platform.python_version()}, "
          f"torch {__import__('torch').__version__})")


if __name__ == "__main__":
    main()
