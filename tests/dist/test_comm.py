"""Traced collectives on real gloo workers: results, recorded events, float8 handling."""
import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.launch import WorkerError, launch
from tests.asserts import every

pytestmark = pytest.mark.dist


def _every_collective(ctx):
    n, r = ctx.world_size, ctx.rank
    out = {}
    with ctx.tracer.tags(layer=3, phase="demo"):
        t = torch.full((4,), float(r))
        out["all_reduce"] = comm.all_reduce(t).tolist()
        rs = torch.empty(2)
        out["reduce_scatter"] = comm.reduce_scatter(rs, torch.arange(2.0 * n) + r).tolist()
        ag = torch.empty(n * 2)
        out["all_gather"] = comm.all_gather(ag, torch.tensor([r, r + 0.5])).tolist()
        # Uneven all-to-all: rank r sends j + 1 rows to rank j.
        send_rows = [j + 1 for j in range(n)]
        recv_rows = [r + 1] * n
        src = torch.cat([torch.full((j + 1, 3), 10.0 * r + j) for j in range(n)])
        dst = torch.empty(sum(recv_rows), 3)
        comm.all_to_all(dst, src, output_split_sizes=recv_rows, input_split_sizes=send_rows)
        out["all_to_all"] = dst[:, 0].tolist()
        b = torch.full((3,), float(r))
        out["broadcast"] = comm.broadcast(b, src=n - 1).tolist()
        # A ring of isend/irecv: everyone passes its rank to the right.
        got = torch.empty(1)
        works = [comm.isend(torch.tensor([float(r)]), (r + 1) % n),
                 comm.irecv(got, (r - 1) % n)]
        comm.wait_all(works)
        out["ring"] = got.item()
    return out


def test_every_wrapper_computes_the_right_thing_and_records_it():
    n = 4
    res = launch(_every_collective, n, capture_values=64)
    for r, out in enumerate(res.results):
        assert out["all_reduce"] == [6.0] * 4  # 0 + 1 + 2 + 3
        # reduce-scatter: rank r owns elements 2r, 2r+1 of sum_k (arange(8) + k)
        assert out["reduce_scatter"] == [4 * (2 * r) + 6.0, 4 * (2 * r + 1) + 6.0]
        assert out["all_gather"] == [v for k in range(n) for v in (k, k + 0.5)]
        assert out["all_to_all"] == [10.0 * k + r for k in range(n) for _ in range(r + 1)]
        assert out["broadcast"] == [3.0] * 3
        assert out["ring"] == (r - 1) % n

    trace = res.trace
    assert {e.tags["layer"] for e in trace} == {3}
    by_op = {op: trace.filter(op=op) for op in
             ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv")}
    assert every(len(events) == n for events in by_op.values())
    e = by_op["all_reduce"].filter(rank=2)[0]
    assert (e.group_kind, e.group_ranks, e.shape, e.dtype, e.bytes) == ("world", (0, 1, 2, 3), (4,), "float32", 16)
    assert e.values_in == [2.0] * 4 and e.values_out == [6.0] * 4 and e.t_end >= e.t_start
    assert by_op["reduce_scatter"].filter(rank=0)[0].bytes == 8 * 4  # the full input
    assert by_op["all_gather"].filter(rank=0)[0].bytes == 2 * 4  # this rank's shard
    a2a = by_op["all_to_all"].filter(rank=1)[0]
    assert a2a.splits == {"input": [1, 2, 3, 4], "output": [2, 2, 2, 2]}
    assert a2a.bytes == 10 * 3 * 4  # ten rows of three floats sent
    sends = by_op["send"]
    assert sorted((s.rank, s.peer) for s in sends) == [(r, (r + 1) % n) for r in range(n)]


def _float8_moves_as_bytes(ctx):
    f8 = torch.float8_e4m3fn
    mine = torch.tensor([0.5, -2.0, 448.0, 0.015625]) * (ctx.rank + 1) / 4
    shard = mine.to(f8)
    gathered = torch.empty(4 * ctx.world_size, dtype=f8)
    comm.all_gather(gathered, shard)
    b = shard.clone()
    comm.broadcast(b, src=0)
    a2a = torch.empty(4 * ctx.world_size // ctx.world_size, dtype=f8)
    comm.all_to_all(a2a, shard)
    return gathered.view(torch.uint8).tolist(), b.view(torch.uint8).tolist(), shard.view(torch.uint8).tolist()


def test_float8_travels_bit_exactly_through_gloo():
    res = launch(_float8_moves_as_bytes, 2)
    shards = [r[2] for r in res.results]
    for gathered, broadcast, _ in res.results:
        assert gathered == shards[0] + shards[1]
        assert broadcast == shards[0]
    assert res.trace.filter(op="all_gather")[0].dtype == "float8_e4m3fn"


def _sum_float8(ctx):
    comm.all_reduce(torch.ones(4, dtype=torch.float8_e4m3fn))


def test_summing_float8_is_refused_with_an_explanation():
    with pytest.raises(WorkerError, match="all_reduce cannot reduce a float8_e4m3fn tensor"):
        launch(_sum_float8, 2)


def _bad_peer(ctx):
    comm.send(torch.ones(1), dst=5)


def test_a_peer_outside_the_group_is_named():
    with pytest.raises(WorkerError, match=r"send: peer rank 5 is not in this rank's world group \[0, 1\]"):
        launch(_bad_peer, 2)


def _gather_wrong_size(ctx):
    comm.all_gather(torch.empty(5), torch.ones(2))


def test_shape_mismatch_names_the_numbers():
    with pytest.raises(WorkerError, match=r"output dim 0 \(5\) must be input dim 0 \(2\) x group size \(2\)"):
        launch(_gather_wrong_size, 2)


def _untraced(ctx):
    comm.all_reduce(torch.ones(2))
    return len(ctx.tracer.events)


def test_tracing_can_be_switched_off():
    res = launch(_untraced, 2, trace=False)
    assert res.results == [0, 0] and len(res.trace) == 0
