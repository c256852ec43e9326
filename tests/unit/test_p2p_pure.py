"""The pure parts of tutorial_lib.p2p: Megatron's flags as a mode, the order its unbatched path
posts operations in, and a model of NCCL's streams that shows why that order matters.

Upstream: Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64), read from
megatron/core/pipeline_parallel/p2p_communication.py (``_batched_p2p_ops``, ``_p2p_ops``,
``P2PCommunicator._communicate``), megatron/core/pipeline_parallel/schedules.py and
megatron/training/arguments.py / argument_utils.py.
"""
import pytest

from tutorial_lib import p2p

STEADY = ["send_forward_recv_backward", "send_backward_recv_forward"]


def test_megatrons_flags_give_batched_or_unbatched_never_sequential():
    """``_communicate`` calls ``_batched_p2p_ops`` when ``batch_p2p_comm`` is set and
    ``_p2p_ops`` otherwise; ``_p2p_ops`` posts ``isend`` / ``irecv`` (non-blocking) and
    ``_communicate`` waits on them afterwards unless ``wait_on_reqs=False`` (what the
    interleaved schedule passes with ``overlap_p2p_comm``).  So ``batch_p2p_comm=False`` is the
    overlapped mode whatever ``overlap_p2p_comm`` says; Megatron has no blocking
    send-then-receive.  Both flags on is refused (schedules.py,
    ``forward_backward_pipelining_with_interleaving``).  An earlier version took ``(False, False)``
    was called "sequential"."""
    assert p2p.mode_from_megatron_flags(overlap_p2p_comm=False) == "batched"
    assert p2p.mode_from_megatron_flags(overlap_p2p_comm=True) == "overlapped"
    assert p2p.mode_from_megatron_flags(False, batch_p2p_comm=False) == "overlapped"
    assert p2p.mode_from_megatron_flags(False, batch_p2p_comm=True) == "batched"
    with pytest.raises(ValueError, match="cannot both be True"):
        p2p.mode_from_megatron_flags(True, batch_p2p_comm=True)
    modes = {p2p.mode_from_megatron_flags(o, b) for o in (False, True) for b in (False, True)
             if not (o and b)}
    assert "sequential" not in modes


def test_unbatched_order_is_megatrons_p2p_ops_order():
    """``_p2p_ops`` on an even pipeline rank posts send-next, recv-prev, send-prev, recv-next;
    on an odd one recv-prev, send-next, recv-next, send-prev (each only if the call has it)."""
    assert p2p.unbatched_order("send_forward_recv_backward", 0) == (("send", "next"), ("recv", "next"))
    assert p2p.unbatched_order("send_forward_recv_backward", 1) == (("send", "next"), ("recv", "next"))
    assert p2p.unbatched_order("send_backward_recv_forward", 2) == (("recv", "prev"), ("send", "prev"))
    assert p2p.unbatched_order("send_backward_recv_forward", 3) == (("recv", "prev"), ("send", "prev"))
    # interleaving's forward-forward exchange: here parity decides
    assert p2p.unbatched_order("send_forward_recv_forward", 0) == (("send", "next"), ("recv", "prev"))
    assert p2p.unbatched_order("send_forward_recv_forward", 1) == (("recv", "prev"), ("send", "next"))
    assert p2p.unbatched_order("recv_backward", 5) == (("recv", "next"),)
    with pytest.raises(ValueError, match="not a P2P helper"):
        p2p.unbatched_order("send_sideways", 0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_two_ends_of_a_steady_state_link_post_in_opposite_orders(stage):
    """What makes the order safe: stage s's send_forward_recv_backward and stage s + 1's
    send_backward_recv_forward share one link, and one of the two posts its receive first."""
    mine = [op for op, _ in p2p.unbatched_order(STEADY[0], stage)]
    theirs = [op for op, _ in p2p.unbatched_order(STEADY[1], stage + 1)]
    assert mine == ["send", "recv"] and theirs == ["recv", "send"]


def _steady_round(pp, order, world_at_pp2):
    """The 1F1B steady state as Megatron calls it: every stage, forward exchange first."""
    return p2p.simulate_streams({s: p2p.posted_ops(s, pp, STEADY, order, world_at_pp2)
                                 for s in range(pp)})


@pytest.mark.parametrize("pp", [3, 4, 5])
def test_posting_every_send_first_deadlocks_the_streams_megatrons_order_does_not(pp):
    """With one stream per pair of ranks (PyTorch's unbatched NCCL sends and receives), a send
    waits for its receive to reach the head of the peer's stream: if both ends post the send
    first, neither receive ever does, although no host ever blocked."""
    naive = _steady_round(pp, "send_first", world_at_pp2=True)
    assert naive.deadlocked and not naive.steps
    assert naive.stuck[0] == ["send to 1 (pp)"] and naive.stuck[1][0] == "send to 0 (pp)"
    megatron = _steady_round(pp, "megatron", world_at_pp2=True)
    assert not megatron.deadlocked
    sent = sorted((a, b) for step in megatron.steps for a, b, _ in step)
    assert sent == sorted([(s, s + 1) for s in range(pp - 1)] + [(s + 1, s) for s in range(pp - 1)])


def test_at_pp2_the_world_group_lets_both_directions_move_at_once():
    """``_p2p_ops`` at PP = 2 sends one direction over the world group, "to allow the overlap":
    on one communicator the two messages of a round take two steps, on two they take one."""
    one_group = _steady_round(2, "megatron", world_at_pp2=False)
    two_groups = _steady_round(2, "megatron", world_at_pp2=True)
    assert [len(step) for step in one_group.steps] == [1, 1]
    assert two_groups.steps == [[(0, 1, "pp"), (1, 0, "world")]]
    # the second stream even rescues the naive order at PP = 2 (one op per stream)
    assert _steady_round(2, "send_first", world_at_pp2=False).deadlocked
    assert not _steady_round(2, "send_first", world_at_pp2=True).deadlocked


def test_posted_ops_skips_the_neighbours_a_stage_does_not_have():
    assert p2p.posted_ops(0, 3, STEADY) == [("send", 1, "pp"), ("recv", 1, "pp")]
    assert p2p.posted_ops(2, 3, STEADY) == [("recv", 1, "pp"), ("send", 1, "pp")]
    assert p2p.posted_ops(1, 2, STEADY) == [("recv", 0, "pp"), ("send", 0, "world")]
    with pytest.raises(ValueError, match="order"):
        p2p.posted_ops(0, 3, STEADY, order="random")


def test_simulate_streams_runs_a_pair_only_when_both_heads_meet():
    run = p2p.simulate_streams({0: [("recv", 1, "pp"), ("send", 1, "pp")],
                                1: [("send", 0, "pp"), ("recv", 0, "pp")]})
    assert run.steps == [[(1, 0, "pp")], [(0, 1, "pp")]] and not run.deadlocked
    stuck = p2p.simulate_streams({0: [("recv", 1, "pp")], 1: [("recv", 0, "pp")]})
    assert stuck.stuck == {0: ["recv from 1 (pp)"], 1: ["recv from 0 (pp)"]}
