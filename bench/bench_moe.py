"""MoE dispatch + combine on gloo: what the expert-parallel all-to-alls cost, checked against costs.

    python bench/bench_moe.py                      # ~40-70 s on 2 cores (24 configurations)
    python bench/bench_moe.py --quick              # ~10 s: 4 configurations, fewer round trips
    python bench/bench_moe.py --hidden 256 --topk 2 8 --experts 16 32 --rounds 7

4 EP ranks (Megatron layout, ``ParallelConfig(4, expert_model_parallel_size=4)``:
one EP group ``[0, 1, 2, 3]``), one launch, one torch thread per rank.  Each rank
holds ``--tokens`` tokens ``[T, h]`` and routes every token to ``K`` distinct experts
drawn uniformly at random from a seeded generator (a fresh routing per round trip,
drawn before the clock starts).  A *round trip* is
``AllToAllDispatcher.dispatch`` then ``AllToAllDispatcher.combine`` with **identity
experts** in between (the dispatched rows are handed straight back), so the bench
measures the dispatcher's communication and permutation, not expert math:

* dispatch: bincount, the counts all-to-all (``[EP, N/EP]`` int64: the metadata),
  the permutation of the ``T*K`` copies, the token all-to-all, the sort by local expert;
* combine: the un-sort, the token all-to-all back, the scatter into ``[T, K, h]``.

Every configuration (hidden size x top-k x expert count) takes turns with the others
in every round (order rotated each round), ``--iters`` round trips per turn, each
started after a barrier; a round trip's time is the slowest rank's, and the table
shows the median over every timed round trip of every round.

Columns: *ms / trip* (slowest rank); *copies / s*: token copies through dispatch +
combine per second, summed over the 4 EP ranks (``4 T K`` per trip); *x K=1*: ms
against the same hidden size and expert count at K=1.  Bytes are **from the trace**
(``TraceEvent.bytes`` of the token all-to-alls, the library's convention: the rows a
rank hands to the op, its own share included), per rank per trip: dispatch beside
``costs.moe_all_to_all_bytes(T, K, h, d)`` (the ratio must be exactly 1 on every
rank: asserted), combine (what the rank *received*, which depends on the routing:
min-max over ranks and trips of combine / formula; summed over the group it equals
the dispatch, asserted).  Every traced all-to-all is also checked, bytes and splits,
against ``costs.moe_rank_all_to_alls`` built from the ranks' routing loads.  The time
split (mean of the ranks, median of the trips): *counts ms* in the metadata
all-to-all and *counts %*, its share of the rank's own round trip; *tokens ms* in the
two token all-to-alls; *local ms* the rest (counting, permutation, sorting, scatter).
Tracing stays on (the bytes come from it); it costs microseconds per op
(``bench_trace_overhead.py``), next to milliseconds per all-to-all here.
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


def _bench(ctx, configs, tokens: int, dtype_name: str, rounds: int, iters: int, warmup: int,
           seed: int) -> dict:
    """Every configuration's round trips on this rank: ``{config: [record per timed trip]}``.

    A record: this rank's seconds for the trip, its routing load over the ``N`` experts,
    and the trip's traced all-to-alls (tags, bytes, splits, seconds).
    """
    import torch
    import torch.distributed as dist
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    from tutorial_lib.moe import AllToAllDispatcher

    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, expert_model_parallel_size=ctx.world_size))
    assert parallel_state.get_size("ep") == ctx.world_size
    dtype = getattr(torch, dtype_name)
    events = ctx.tracer.events
    # A distinct, reproducible stream per rank (and per configuration, below).
    generators = {c: torch.Generator().manual_seed(seed + 1000 * i + ctx.rank)
                  for i, c in enumerate(configs)}
    inputs = {c: torch.randn(tokens, c[0], generator=generators[c]).to(dtype) for c in configs}
    dispatchers = {c: AllToAllDispatcher(c[2], "ep") for c in configs}

    def routing(config):
        hidden, topk, experts = config
        # K distinct experts per token, uniformly at random
        return torch.rand(tokens, experts, generator=generators[config]).topk(topk, dim=-1).indices

    def trip(config, topk_idx):
        dispatcher = dispatchers[config]
        rows, _, state = dispatcher.dispatch(inputs[config], topk_idx)
        copies = dispatcher.combine(rows, state)  # identity experts: the rows go straight back
        return copies, state

    # Warm-up (allocator, first all-to-alls), and a correctness check: with identity
    # experts every copy [t, k] must come back as token t, bit for bit.
    for config in configs:
        for _ in range(warmup):
            topk_idx = routing(config)
            dist.barrier()
            copies, _ = trip(config, topk_idx)
            expected = inputs[config].unsqueeze(1).expand(-1, config[1], -1)
            if not torch.equal(copies, expected):
                raise AssertionError(f"{config}: combine(dispatch(x)) with identity experts "
                                     f"did not return every copy of x unchanged")
    out: dict = {c: [] for c in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            for _ in range(iters):
                topk_idx = routing(config)
                first = len(events)
                dist.barrier()
                t0 = time.perf_counter()
                _, state = trip(config, topk_idx)
                seconds = time.perf_counter() - t0
                a2a = [{"op_name": e.tags.get("op_name"), "payload": e.tags.get("payload"),
                        "phase": e.tags.get("phase"), "bytes": e.bytes,
                        "input": list(e.splits["input"]), "output": list(e.splits["output"]),
                        "seconds": e.t_end - e.t_start}
                       for e in events[first:] if e.op == "all_to_all"]
                out[config].append({"seconds": seconds, "a2a": a2a,
                                    "load": state.tokens_per_expert.tolist()})
    dist.barrier()
    return out


def _check_bytes(config, records_by_rank, tokens: int, element_size: int) -> dict:
    """Assert the traced all-to-alls against ``costs``; return the per-trip byte counts."""
    from tutorial_lib import costs
    hidden, topk, experts = config
    formula = costs.moe_all_to_all_bytes(tokens, topk, hidden, element_size)
    combine_ratios, off_rank = [], []
    for i in range(len(records_by_rank[0])):
        trips = [records[i] for records in records_by_rank]
        send_counts = costs.moe_send_counts([t["load"] for t in trips])
        dispatch_sum = combine_sum = 0
        for rank, t in enumerate(trips):
            by_name = {(e["op_name"], e["payload"]): e for e in t["a2a"]}
            if len(t["a2a"]) != 3 or len(by_name) != 3:
                raise AssertionError(f"{config} rank {rank}: expected 3 all-to-alls per trip "
                                     f"(counts, dispatch, combine), traced {t['a2a']}")
            dispatch = by_name[("dispatch", "tokens")]
            combine = by_name[("combine", "tokens")]
            # The headline check: the traced dispatch is exactly T * K * h * d on every rank.
            if dispatch["bytes"] != formula:
                raise AssertionError(f"{config} rank {rank}: traced dispatch bytes "
                                     f"{dispatch['bytes']} != moe_all_to_all_bytes {formula}")
            # Every traced all-to-all of the forward, op for op, against the predicted list.
            predicted = [p for p in costs.moe_rank_all_to_alls(send_counts, rank, hidden, experts,
                                                               element_size)
                         if p.phase == "forward"]
            for p, e in zip(predicted, t["a2a"]):
                got = (e["op_name"], e["payload"], e["bytes"], tuple(e["input"]),
                       tuple(e["output"]))
                want = (p.op_name, p.payload, p.bytes, p.input_splits, p.output_splits)
                if got != want:
                    raise AssertionError(f"{config} rank {rank}: traced {got}, "
                                         f"costs.moe_rank_all_to_alls predicts {want}")
            dispatch_sum += dispatch["bytes"]
            combine_sum += combine["bytes"]
            combine_ratios.append(combine["bytes"] / formula)
            off_rank.append(1 - dispatch["input"][rank] / sum(dispatch["input"]))
        if combine_sum != dispatch_sum:
            raise AssertionError(f"{config}: the group's combine bytes {combine_sum} != its "
                                 f"dispatch bytes {dispatch_sum}")
    return {"formula": formula, "combine_ratios": combine_ratios, "off_rank": off_rank}


def main() -> None:
    from tutorial_lib.launch import launch, warm_up
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 32],
                        help="routed experts N (a multiple of 4; N/4 per EP rank)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (T)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every configuration")
    parser.add_argument("--iters", type=int, default=4, help="timed round trips per turn")
    parser.add_argument("--warmup", type=int, default=2, help="untimed round trips per config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="hidden 64 and 1024, top-k 1 and 8, 32 experts, "
                             "3 rounds of 2 trips (~10 s)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.topk, args.experts = [64, 1024], [1, 8], [32]
        args.rounds, args.iters, args.warmup = 3, 2, 1
    args.hidden, args.topk, args.experts = (sorted(set(v)) for v in
                                            (args.hidden, args.topk, args.experts))
    for n in args.experts:
        if n % EP or any(k > n for k in args.topk):
            parser.error(f"--experts {n}: must be a multiple of {EP} and >= every --topk")
    configs = [(h, k, n) for h in args.hidden for n in args.experts for k in args.topk]
    load_start = os.getloadavg()[0]
    warm_up()  # start the forkserver before anything is timed
    started = time.perf_counter()
    result = launch(_bench, EP, args=(configs, args.tokens, args.dtype, args.rounds, args.iters,
                                      args.warmup, args.seed),
                    threads=1, print_output=False, timeout=1800)
    bench_s = time.perf_counter() - started
    element_size = 4 if args.dtype == "float32" else 2
    rows, off_rank = [], []
    base_ms = {}
    for config in configs:
        hidden, topk, experts = config
        by_rank = [result.results[rank][config] for rank in range(EP)]
        checked = _check_bytes(config, by_rank, args.tokens, element_size)
        off_rank += checked["off_rank"]
        trips = len(by_rank[0])
        # ms per trip: the slowest rank's; the split: each rank's own, mean of the ranks.
        trip_ms = [max(r[i]["seconds"] for r in by_rank) * 1e3 for i in range(trips)]

        def split(i, what):
            per_rank = []
            for r in by_rank:
                a2a = r[i]["a2a"]
                if what == "counts":
                    value = sum(e["seconds"] for e in a2a if e["payload"] == "counts")
                elif what == "tokens":
                    value = sum(e["seconds"] for e in a2a if e["payload"] == "tokens")
                elif what == "local":
                    value = r[i]["seconds"] - sum(e["seconds"] for e in a2a)
                else:  # the counts all-to-all's share of this rank's round trip
                    counts = sum(e["seconds"] for e in a2a if e["payload"] == "counts")
                    value = counts / r[i]["seconds"]
                per_rank.append(value)
            return statistics.mean(per_rank)

        ms = statistics.median(trip_ms)
        if topk == min(args.topk):
            base_ms[(hidden, experts)] = ms
        ratios = checked["combine_ratios"]
        dispatch_bytes = by_rank[0][0]["a2a"][1]["bytes"]
        rows.append([
            hidden, topk, experts, args.tokens * topk, ms,
            round(EP * args.tokens * topk / (ms / 1e3)),
            ms / base_ms[(hidden, experts)],
            dispatch_bytes / 1024, checked["formula"] / 1024, dispatch_bytes / checked["formula"],
            f"{min(ratios):.2f}-{max(ratios):.2f}",
            statistics.median(split(i, "counts") for i in range(trips)) * 1e3,
            statistics.median(split(i, "share") for i in range(trips)) * 100,
            statistics.median(split(i, "tokens") for i in range(trips)) * 1e3,
            statistics.median(split(i, "local") for i in range(trips)) * 1e3,
        ])
    k1 = f"K={min(args.topk)}"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print_table(["h", "K", "N", "copies / rank", "ms / trip", "copies / s", f"x {k1}",
                 "dispatch KiB (trace)", "T*K*h*d KiB", "trace / formula",
                 "combine / formula", "counts ms", "counts %", "tokens ms", "local ms"],
                rows, digits=2,
                title=f"MoE dispatch + combine, identity experts: {EP} EP ranks (gloo, 1 torch "
                      f"thread each), T = {args.tokens} tokens per rank, {args.dtype} "
                      f"(d = {element_size}); median of {args.rounds} rounds x {args.iters} "
                      f"round trips; bytes per rank per trip from the trace; {now}, "
                      f"{os.cpu_count()} cores, load average {load_start:.1f} at the start, "
                      f"{os.getloadavg()[0]:.1f} at the end")
    print(f"\nchecked: traced dispatch bytes == costs.moe_all_to_all_bytes on every rank and "
          f"trip; every forward all-to-all (counts, dispatch, combine) == "
          f"costs.moe_rank_all_to_alls, bytes and splits; group combine bytes == group "
          f"dispatch bytes.  Share of dispatched rows addressed to other ranks: "
          f"{statistics.mean(off_rank):.3f} (uniform routing: {(EP - 1) / EP:.3f}).")
    print(f"\nbench time {bench_s:.0f} s (Python {platform.python_version()}, "
          f"torch {__import__('torch').__version__})")


if __name__ == "__main__":
    main()
