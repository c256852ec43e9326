"""The hand-written ring algorithms against the library collectives, on real gloo ranks."""
import pytest
import torch

from tutorial_lib import comm, ring_collectives
from tutorial_lib.launch import WorkerError, launch
from tests.asserts import every

pytestmark = pytest.mark.dist

SIZES = [1, 2, 3, 4, 5]


# --- worker functions (module level: the launcher ships them to every rank) ----------


def _all_reduce_random(ctx, rows, cols, seed):
    torch.manual_seed(seed + ctx.rank)  # a different tensor on every rank
    x = torch.randn(rows, cols)
    ring = ring_collectives.ring_all_reduce(x)
    reference = comm.all_reduce(x.clone())
    return {"ring": ring, "reference": reference, "input_untouched": x}


def _all_reduce_rank_filled(ctx, rows):
    x = torch.full((rows,), float(ctx.rank))
    return ring_collectives.ring_all_reduce(x)


def _reduce_scatter_and_gather(ctx, rows):
    n = ctx.world_size
    torch.manual_seed(100 + ctx.rank)
    x = torch.randn(rows, 3)
    mine = ring_collectives.ring_reduce_scatter(x)
    reference = comm.reduce_scatter(torch.empty(rows // n, 3), x.clone())
    shard = torch.randn(2, 3)
    gathered = ring_collectives.ring_all_gather(shard)
    gathered_ref = comm.all_gather(torch.empty(2 * n, 3), shard)
    return {"rs": mine, "rs_ref": reference, "ag": gathered, "ag_ref": gathered_ref}


def _ring_int_exact(ctx, rows):
    # Integers: the sum is exact whatever order the ring adds in.
    x = torch.arange(rows, dtype=torch.int64) * (ctx.rank + 1)
    return ring_collectives.ring_all_reduce(x), comm.all_reduce(x.clone())


def _on_data_parallel_groups(ctx):
    # 4 ranks, TP=2: the dp groups are [0, 2] and [1, 3]; each is its own ring.
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    parallel_state.initialize_model_parallel(ParallelConfig(world_size=4,
                                                            tensor_model_parallel_size=2))
    x = torch.arange(4.0) + 10 * ctx.rank
    ring = ring_collectives.ring_all_reduce(x, group="dp")
    shard = ring_collectives.ring_reduce_scatter(x, group="dp")
    return {"ring": ring, "reference": comm.all_reduce(x.clone(), group="dp"), "shard": shard,
            "dp_ranks": parallel_state.get_group_ranks("dp")}


def _bad_shape(ctx, rows):
    ring_collectives.ring_all_reduce(torch.ones(rows))


def _scalar(ctx):
    ring_collectives.ring_all_reduce(torch.tensor(1.0))


def _two_calls(ctx):
    a = ring_collectives.ring_all_reduce(torch.ones(ctx.world_size))
    b = ring_collectives.ring_all_reduce(torch.ones(ctx.world_size * 2))
    return a, b


# --- correctness ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_reduce_equals_all_reduce_on_random_floats(n):
    out = launch(_all_reduce_random, n, args=(n * 4, 3, 7), timeout=60)
    for r in out.results:
        torch.testing.assert_close(r["ring"], r["reference"], rtol=1e-5, atol=1e-5)
    # Every rank ends with the same tensor, and the caller's tensor is untouched.
    for r in out.results[1:]:
        torch.testing.assert_close(r["ring"], out.results[0]["ring"], rtol=1e-5, atol=1e-5)
    for rank, r in enumerate(out.results):
        torch.manual_seed(7 + rank)
        assert torch.equal(r["input_untouched"], torch.randn(n * 4, 3))


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_reduce_of_rank_filled_tensors_is_the_closed_form_sum(n):
    out = launch(_all_reduce_rank_filled, n, args=(2 * n,), timeout=60)
    expected = torch.full((2 * n,), n * (n - 1) / 2)
    for result in out.results:
        assert torch.equal(result, expected)


@pytest.mark.parametrize("n", [3, 4])
def test_ring_all_reduce_is_exact_on_integers(n):
    for ring, reference in launch(_ring_int_exact, n, args=(n * 3,), timeout=60).results:
        assert ring.dtype == torch.int64 and torch.equal(ring, reference)


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_and_all_gather_equal_the_library_collectives(n):
    out = launch(_reduce_scatter_and_gather, n, args=(n * 2,), timeout=60)
    for r in out.results:
        # Rank i owns chunk i, like torch.distributed.reduce_scatter.
        torch.testing.assert_close(r["rs"], r["rs_ref"], rtol=1e-5, atol=1e-5)
        assert torch.equal(r["ag"], r["ag_ref"])  # gathering copies: bit-exact


def test_the_ring_runs_on_a_sub_group_with_global_peers():
    out = launch(_on_data_parallel_groups, 4, timeout=60)
    for rank, r in enumerate(out.results):
        assert torch.equal(r["ring"], r["reference"])
        position = r["dp_ranks"].index(rank)
        assert torch.equal(r["shard"], r["reference"][2 * position:2 * position + 2])
        sends = out.trace.filter(op="send", rank=rank)
        partner = [p for p in r["dp_ranks"] if p != rank][0]
        assert {e.peer for e in sends} == {partner} and {e.group_kind for e in sends} == {"dp"}


# --- the trace: the classic cost, and the tags ------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_trace_shows_two_n_minus_one_sends_of_one_chunk_each(n):
    rows = 4 * n
    out = launch(_all_reduce_rank_filled, n, args=(rows,), timeout=60)
    tensor_bytes = rows * 4  # float32
    for rank in range(n):
        sends = out.trace.filter(op="send", rank=rank, algorithm="ring_all_reduce")
        recvs = out.trace.filter(op="recv", rank=rank, algorithm="ring_all_reduce")
        assert len(sends) == len(recvs) == 2 * (n - 1)
        assert {e.bytes for e in sends} <= {tensor_bytes // n}
        assert sends.total_bytes() == 2 * (n - 1) * tensor_bytes // n  # 2(N-1)/N x the tensor
        # to the next rank, from the previous one (none at all on one rank)
        assert [e.peer for e in sends] == [(rank + 1) % n] * len(sends)
        assert [e.peer for e in recvs] == [(rank - 1) % n] * len(recvs)
    assert ring_collectives.ring_cost(tensor_bytes, n)["bytes_sent"] == 2 * (n - 1) * tensor_bytes // n


@pytest.mark.parametrize("n", [3, 4])
def test_every_send_and_recv_is_tagged_with_phase_step_and_chunk(n):
    out = launch(_all_reduce_rank_filled, n, args=(n,), timeout=60)
    for rank in range(n):
        for phase, first_sent in (("reduce_scatter", (rank - 1) % n), ("all_gather", rank)):
            sends = out.trace.filter(op="send", rank=rank, phase=phase)
            recvs = out.trace.filter(op="recv", rank=rank, phase=phase)
            assert sorted(e.tags["step"] for e in sends) == list(range(n - 1))
            by_step = {e.tags["step"]: e.tags["chunk"] for e in sends}
            # The schedule of the module docstring: chunk (i - s - 1) in the reduce-scatter,
            # (i - s) in the all-gather; the chunk received is always the one before it.
            assert by_step == {s: (first_sent - s) % n for s in range(n - 1)}
            assert {e.tags["step"]: e.tags["chunk"] for e in recvs} == {
                s: (first_sent - s - 1) % n for s in range(n - 1)}
            assert every(e.tags["algorithm"] == "ring_all_reduce" for e in list(sends) + list(recvs))


def test_calls_are_numbered_so_one_trace_can_hold_several():
    out = launch(_two_calls, 3, timeout=60)
    calls = {e.tags["call"] for e in out.trace.filter(op="send")}
    assert calls == {0, 1}
    assert {e.bytes for e in out.trace.filter(op="send", call=1)} == {8}  # 6 floats / 3 ranks


# --- errors ---------------------------------------------------------------------------------


def test_a_tensor_that_does_not_split_evenly_names_the_numbers():
    with pytest.raises(WorkerError) as info:
        launch(_bad_shape, 3, args=(7,), timeout=60)
    message = str(info.value)
    assert "dim 0 of the tensor (7)" in message and "ring size (3)" in message


def test_a_scalar_is_refused():
    with pytest.raises(WorkerError, match="scalar"):
        launch(_scalar, 2, timeout=60)
