"""Pipeline P2P helpers on real gloo workers, in each mode, with PP = 3 and 4.

Stage ``s`` computes ``y = (s + 2) * x + (s + 1)``; microbatch ``m`` enters as
``x = m + 1`` and its loss is ``(m + 1) * sum(y)``, so every activation and gradient
has one closed-form value per (stage, microbatch) and a message from the wrong
rank or for the wrong microbatch carries a value the right one cannot.
"""
import pytest
import torch

from tutorial_lib import p2p, parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import LaunchTimeout, launch
from tests.asserts import every

pytestmark = pytest.mark.dist

SHAPE = (2, 3)
MICROBATCHES = 5
HELPERS = ("send_forward", "recv_forward", "send_backward", "recv_backward",
           "send_forward_recv_backward", "send_backward_recv_forward")


def _init(ctx):
    config = ParallelConfig(ctx.world_size, pipeline_model_parallel_size=ctx.world_size)
    parallel_state.initialize_model_parallel(config)
    return parallel_state.get_rank_in("pp"), ctx.world_size


# --- closed forms -------------------------------------------------------------


def expected_activation(stage: int, m: int) -> float:
    """The activation stage ``stage`` receives for microbatch ``m``."""
    x = m + 1.0
    for s in range(stage):
        x = (s + 2) * x + (s + 1)
    return x


def expected_gradient(stage: int, m: int, pp: int) -> float:
    """The gradient of stage ``stage``'s output that it receives for microbatch ``m``."""
    g = m + 1.0
    for s in range(stage + 1, pp):
        g *= s + 2
    return g


# --- the workers ------------------------------------------------------------------


def _one_f_one_b(ctx, mode):
    """Megatron's non-interleaved 1F1B, forward_backward_pipelining_without_interleaving."""
    stage, pp = _init(ctx)
    first, last = stage == 0, stage == pp - 1
    got = {"act": {}, "grad": {}}

    def forward(x, m):
        if first:
            x = torch.full(SHAPE, m + 1.0)
        else:
            got["act"][m] = x[0, 0].item()
        return (stage + 2) * x + (stage + 1)

    def backward(g, m):
        if last:
            g = torch.full(SHAPE, m + 1.0)  # d loss / d y
        else:
            got["grad"][m] = g[0, 0].item()
        return (stage + 2) * g

    warmup = min(pp - stage - 1, MICROBATCHES)
    remaining = MICROBATCHES - warmup
    fwd_m = bwd_m = 0
    for _ in range(warmup):
        x = p2p.recv_forward(SHAPE, mode=mode)
        p2p.send_forward(forward(x, fwd_m), mode=mode)
        fwd_m += 1
    x = p2p.recv_forward(SHAPE, mode=mode) if remaining else None
    for i in range(remaining):
        y = forward(x, fwd_m)
        fwd_m += 1
        g = p2p.send_forward_recv_backward(y, SHAPE, mode=mode)
        gx = backward(g, bwd_m)
        bwd_m += 1
        if i == remaining - 1:
            p2p.send_backward(gx, mode=mode)
        else:
            x = p2p.send_backward_recv_forward(gx, SHAPE, mode=mode)
    for _ in range(warmup):
        g = p2p.recv_backward(SHAPE, mode=mode)
        p2p.send_backward(backward(g, bwd_m), mode=mode)
        bwd_m += 1
    return got


def _steady_exchange(ctx, mode, wrong_recv_backward_peer=False):
    """One steady-state step: stage s sends 100 + s forward and 200 + s backward."""
    stage, _ = _init(ctx)
    grad = p2p.send_forward_recv_backward(torch.full(SHAPE, 100.0 + stage), SHAPE, mode=mode,
                                          wrong_recv_backward_peer=wrong_recv_backward_peer)
    act = p2p.send_backward_recv_forward(torch.full(SHAPE, 200.0 + stage), SHAPE, mode=mode)
    return {"grad": None if grad is None else grad[0, 0].item(),
            "act": None if act is None else act[0, 0].item()}


def _both(ctx, mode):
    return {"1f1b": _one_f_one_b(ctx, mode), "steady": _steady_exchange(ctx, mode)}


# --- tests ---------------------------------------------------------------------------


def _check_peers_and_tags(trace, mode, pp):
    """Every P2P event talks to the neighbour its helper names, with the right tags."""
    next_helpers = {"send_forward", "recv_backward", "send_forward_recv_backward"}
    events = [e for e in trace if e.op in ("send", "recv")]
    assert events and all(e.tags.get("p2p_mode") == mode and e.tags.get("p2p_op") in HELPERS
                          for e in events)
    for e in events:
        expected_peer = e.rank + 1 if e.tags["p2p_op"] in next_helpers else e.rank - 1
        assert e.peer == expected_peer, (e.rank, e.op, e.tags, e.peer)
        assert e.group_kind == "pp" and e.group_ranks == tuple(range(pp))
        assert e.tags.get("batched", False) == (mode == "batched")
        assert e.op == "send" or e.tags["p2p_op"] not in ("send_forward", "send_backward")
    # Every message sent from a to b is received by b from a, as often.
    sent = sorted((e.rank, e.peer) for e in events if e.op == "send")
    received = sorted((e.peer, e.rank) for e in events if e.op == "recv")
    assert sent == received
    # The last stage never sends forward; the first never sends backward.
    assert not [e for e in events if e.op == "send" and e.peer in (-1, pp)]


@pytest.mark.parametrize("pp", [3, 4])
@pytest.mark.parametrize("mode", p2p.MODES)
def test_pipeline_moves_activations_and_gradients_in_every_mode(mode, pp):
    res = launch(_both, pp, args=(mode,), timeout=30)
    for stage, out in enumerate(res.results):
        got = out["1f1b"]
        assert got["act"] == ({} if stage == 0 else
                              {m: expected_activation(stage, m) for m in range(MICROBATCHES)})
        assert got["grad"] == ({} if stage == pp - 1 else
                               {m: expected_gradient(stage, m, pp) for m in range(MICROBATCHES)})
        steady = out["steady"]
        assert steady["grad"] == (None if stage == pp - 1 else 200.0 + stage + 1)
        assert steady["act"] == (None if stage == 0 else 100.0 + stage - 1)
    _check_peers_and_tags(res.trace, mode, pp)
    if mode == "sequential":  # by parity: even stages send first, odd stages receive first
        for stage in range(pp):
            ops = [e.op for e in res.trace.filter(rank=stage, p2p_op="send_forward_recv_backward")]
            assert ops[:2] == (["send", "recv"] if stage % 2 == 0 else ["recv", "send"]) or not ops
    if mode == "overlapped":  # posted in the order of Megatron-Core 0.20.0's _p2p_ops
        for stage in range(pp):
            for helper in ("send_forward_recv_backward", "send_backward_recv_forward"):
                events = res.trace.filter(rank=stage, p2p_op=helper).events
                posted = [e.op for e in sorted(events, key=lambda e: e.t_start)][:2]
                expected = [op for op, _ in p2p.unbatched_order(helper, stage)]
                assert posted == expected or not events, (stage, helper, posted)


def test_seeds_wrong_recv_backward_peer_deadlocks_with_pp3():
    with pytest.raises(LaunchTimeout) as caught:
        launch(_steady_exchange, 3, args=("batched", True), timeout=3)
    report = caught.value.report
    # Stage 0 waits, in the misdirected receive itself, for a gradient from the last
    # stage (Megatron's previous rank wraps around), which never sends it one.
    assert "recv from rank 0" not in report[0]
    assert "recv from rank 2" in report[0] and "'send_forward_recv_backward'" in report[0]
    # Stage 1's misdirected receive from stage 0 did complete: P2P matches messages by
    # peer, not by meaning, so it took stage 0's *activation* as its gradient.  Its
    # next receive of the activation from stage 0 then waits forever.
    assert "recv from rank 0" in report[1] and "'send_backward_recv_forward'" in report[1]


def test_seeds_wrong_recv_backward_peer_goes_unnoticed_with_pp2():
    right = launch(_steady_exchange, 2, args=("batched", False), timeout=30)
    wrong = launch(_steady_exchange, 2, args=("batched", True), timeout=30)
    assert wrong.results == right.results == [{"grad": 201.0, "act": None},
                                             {"grad": None, "act": 100.0}]
    # With two stages "previous" (wrapping) and "next" of stage 0 are both rank 1.
    recv = wrong.trace.filter(op="recv", rank=0, p2p_op="send_forward_recv_backward")
    assert [e.peer for e in recv] == [1]


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="sequential, overlapped, batched"):
        p2p._check_mode("eager")


SAMPLE_TOPOLOGY = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV12\tSYS\tSYS\tPXB\t0-31\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tSYS\tSYS\tPXB\t0-31\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tNV12\tSYS\t32-63\t1\t\tN/A\n"
    "GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t\n"
    "\nLegend:\n\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)


def test_parse_topology_reads_the_matrix():
    topology = p2p.parse_topology(SAMPLE_TOPOLOGY)
    assert topology["devices"] == ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"]
    links = topology["links"]
    assert len(links) == 5 * 4
    assert links[("GPU0", "GPU1")] == links[("GPU3", "GPU2")] == "NV12"
    assert links[("GPU1", "GPU2")] == "SYS" and links[("NIC0", "GPU1")] == "PXB"
    assert every(a != b for a, b in links)
    with pytest.raises(ValueError, match="GPU0"):
        p2p.parse_topology("No devices were found")


def test_suggest_p2p_mode_follows_megatron_not_nvlink():
    mode, reason = p2p.suggest_p2p_mode(SAMPLE_TOPOLOGY)
    assert mode == "batched" and "4 of 12 GPU pairs on NVLink" in reason
    mode, _ = p2p.suggest_p2p_mode(SAMPLE_TOPOLOGY, interleaved=True, overlap_p2p_comm=True)
    assert mode == "overlapped"
    mode, reason = p2p.suggest_p2p_mode()  # this machine: whatever it has, a safe answer
    assert mode == "batched" and reason
