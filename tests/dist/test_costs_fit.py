"""Cost formulas against real gloo ranks: traced bytes follow the convention; a real fit is sane."""
import math

import pytest
import torch

from tutorial_lib import comm, costs, timing
from tutorial_lib.launch import launch
from tests.asserts import every

pytestmark = pytest.mark.dist

WORLD = 4
ROWS = 8  # rows per rank-slice; every tensor below is (rows, 5) float32 = 20 bytes a row


def _each_collective(ctx):
    n = ctx.world_size
    x = torch.ones(ROWS * n, 5)
    comm.all_reduce(x.clone())  # the tensor: 32 rows
    comm.reduce_scatter(torch.empty(ROWS, 5), x.clone())  # the full input: 32 rows
    comm.all_gather(torch.empty(ROWS * n, 5), torch.ones(ROWS, 5))  # the shard: 8 rows
    comm.all_to_all(torch.empty(ROWS * n, 5), x.clone())  # the rows sent: 32 rows
    comm.all_reduce(torch.ones(ROWS * n, 5, dtype=torch.bfloat16))  # 2 bytes an element
    # Uneven splits, as MoE dispatch makes them: rank r sends r+1 rows to every peer.
    sends = [ctx.rank + 1] * n
    receives = [peer + 1 for peer in range(n)]
    comm.all_to_all(torch.empty(sum(receives), 5), torch.ones(sum(sends), 5),
                    output_split_sizes=receives, input_split_sizes=sends)


def test_traced_bytes_follow_the_library_convention_and_feed_the_formulas():
    trace = launch(_each_collective, WORLD, print_output=False).trace
    full, shard = ROWS * WORLD * 5 * 4, ROWS * 5 * 4  # 640 and 160 bytes
    for rank in range(WORLD):
        events = trace.filter(rank=rank).events
        ops = [(e.op, e.dtype, e.bytes) for e in events]
        assert ops == [("all_reduce", "float32", full), ("reduce_scatter", "float32", full),
                       ("all_gather", "float32", shard), ("all_to_all", "float32", full),
                       ("all_reduce", "bfloat16", full // 2),
                       ("all_to_all", "float32", (rank + 1) * WORLD * 20)]
        sent = [costs.ring_bytes_sent(e.op, e.bytes, len(e.group_ranks)) for e in events]
        # 2(N-1)/N B, (N-1)/N B, (N-1) b, (N-1)/N B, then bf16 halves the all-reduce
        assert sent[:5] == [960, 480, 480, 480, 480]
    # all-gather's (N-1) b is exactly the bytes of the output that came from the other ranks
    assert costs.all_gather_bytes(shard, WORLD) == full - shard


def test_measured_samples_fit_to_a_sane_model():
    sizes = [1024, 16 * 1024, 256 * 1024, 1024 * 1024]
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    samples = timing.measure_collective(ops, sizes=sizes, world_size=WORLD, repeats=3)
    # One sample per (op, size); sizes divisible by 4 ranks x 4 bytes are kept exactly.
    assert sorted((s.op, s.nbytes) for s in samples) == sorted((o, b) for o in ops for b in sizes)
    assert every(s.n == WORLD and s.seconds > 0 for s in samples)
    fit = costs.fit_alpha_beta(samples)
    assert fit.model.alpha >= 0 and fit.model.beta >= 0
    assert fit.model.alpha > 0 or fit.model.beta > 0
    assert math.isfinite(fit.r_squared) and fit.r_squared <= 1
    for s in samples:
        assert fit.predict(s.op, s.nbytes, s.n) > 0
    # No timing thresholds: machines (and their load) vary too much for that.
