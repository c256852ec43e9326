"""Chapter 7's P2P checkers name the classic mistakes: they launch real gloo workers (2 to 5
ranks); the deadlock cases use a short launcher timeout so that they cost seconds, not
minutes.  The pure checks: tests/unit/test_exercises_ch07.py."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib import comm, p2p, parallel_state
from tutorial_lib.exercises import ch07, kit
from tutorial_lib.exercises.ch07 import check_send_first, check_send_forward_recv_backward

from ..notebook_cells import NOTEBOOKS, assert_hint, hint_cases, tagged_cells

pytestmark = pytest.mark.dist  # the checkers launch real gloo workers

DEADLOCK_TIMEOUT = 1.0  # seconds, then 4 on the retry: a right exchange takes ms, a hang 5 s


# --- exercise 7.1: send_forward_recv_backward ------------------------------------------------


def _exchange(tensor, shape, dtype, send_peer, recv_peer, blocking=False):
    buffer = torch.empty(shape, dtype=dtype)
    if blocking:
        comm.send(tensor, send_peer, group="pp")
        comm.recv(buffer, recv_peer, group="pp")
    else:
        comm.wait_all(comm.batch_isend_irecv([("send", tensor, send_peer), ("recv", buffer, recv_peer)],
                                             group="pp"))
    return buffer


def _wrapped_prev():
    stage, pp = parallel_state.get_rank_in("pp"), parallel_state.get_size("pp")
    return parallel_state.get_group_ranks("pp")[(stage - 1) % pp]


def overlapped(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype=dtype)
    comm.wait_all([comm.isend(tensor, peer, group="pp"), comm.irecv(buffer, peer, group="pp")])
    return buffer


def blocking(tensor, shape, dtype=torch.float32):
    """Blocking send then receive: fine here, the neighbour posts both of its ops at once."""
    peer = p2p.next_rank()
    return None if peer is None else _exchange(tensor, shape, dtype, peer, peer, blocking=True)


def grad_from_wrapping_prev(tensor, shape, dtype=torch.float32):
    """Receives the gradient from the previous stage, wrapping around as Megatron's prev rank does."""
    peer = p2p.next_rank()
    return None if peer is None else _exchange(tensor, shape, dtype, peer, _wrapped_prev())


def grad_from_prev_rank(tensor, shape, dtype=torch.float32):
    """Receives the gradient from the library's prev_rank(), None on stage 0."""
    peer = p2p.next_rank()
    return None if peer is None else _exchange(tensor, shape, dtype, peer, p2p.prev_rank())


def sends_to_previous(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    return None if peer is None else _exchange(tensor, shape, dtype, _wrapped_prev(), peer)


def forgets_the_last_stage(tensor, shape, dtype=torch.float32):
    return _exchange(tensor, shape, dtype, p2p.next_rank(), p2p.next_rank())


def returns_what_it_sent(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is None:
        return None
    _exchange(tensor, shape, dtype, peer, peer)
    return tensor


def returns_none(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is not None:
        _exchange(tensor, shape, dtype, peer, peer)
    return None


def returns_a_fresh_buffer(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is None:
        return None
    _exchange(tensor, shape, dtype, peer, peer)
    return torch.zeros(shape, dtype=dtype) + torch.arange(shape[0], dtype=dtype)


def calls_the_library(tensor, shape, dtype=torch.float32):
    return p2p.send_forward_recv_backward(tensor, shape, dtype)


def uses_torch_distributed(tensor, shape, dtype=torch.float32):
    import torch.distributed as dist
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype=dtype)
    group = parallel_state.get_group("pp")
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, group=group),
                                        dist.P2POp(dist.irecv, buffer, peer, group=group)]):
        work.wait()
    return buffer


def only_receives(tensor, shape, dtype=torch.float32):
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype=dtype)
    comm.recv(buffer, peer, group="pp")
    return buffer


@pytest.mark.parametrize("correct", [overlapped, blocking], ids=lambda f: f.__name__)
def test_correct_helpers_pass(correct):
    result = check_send_forward_recv_backward(correct)
    assert result.passed, str(result)
    assert [c.name for c in result.cases] == ["PP=2", "PP=3", "PP=4"]


def guides_code_from_the_stub() -> str:
    """The guide's version, as exercise 7.1's stub shows it in a comment."""
    stub = next(c for c in tagged_cells(NOTEBOOKS / "07_p2p_modes.ipynb", "exercise-stub")
                if "def my_send_forward_recv_backward(" in c)
    lines = stub.splitlines()
    body = [line.split("#   ", 1)[1] for line in lines if line.lstrip().startswith("#   ")]
    assert body, "the stub shows the guide's code in an indented comment"
    return "\n".join([lines[0]] + ["    " + line for line in body])


def test_the_guides_code_in_the_stub_passes_at_pp2_and_deadlocks_at_pp3():
    """Found reading the book: the stub's comment used the library's non-wrapping ``p2p.prev_rank()``, so
    "the guide's code" raised "peer rank None" at every PP instead of showing its real
    failure.  The guide's snippet takes Megatron's previous rank, which wraps around the
    ring (Megatron-Core 0.20.0, d98e8a64: ``P2PCommunicator.__init__`` in
    megatron/core/pipeline_parallel/p2p_communication.py stores ``prev_rank`` as
    ``(rank - 1) % world_size`` of the pipeline group): right at PP = 2, where the wrapped
    previous stage is the next one, a deadlock from PP = 3 on.  The hint names both PPs."""
    namespace = {"torch": torch, "comm": comm, "p2p": p2p}
    exec(guides_code_from_the_stub(), namespace)
    result = check_send_forward_recv_backward(namespace["my_send_forward_recv_backward"],
                                              timeout=DEADLOCK_TIMEOUT)
    assert [c.name for c in result.cases] == ["PP=2", "PP=3"], str(result)
    assert [c.passed for c in result.cases] == [True, False], str(result)
    assert result.cases[1].detail.startswith(f"deadlocked after {DEADLOCK_TIMEOUT:g} s")
    assert_hint(result, ch07.HINT_RECV_FROM_PREVIOUS)
    assert "passed at PP = 2 and deadlocked at PP = 3" in result.hint


def test_a_previous_stage_grad_passes_at_pp2_and_is_named_at_pp3():
    result = check_send_forward_recv_backward(grad_from_wrapping_prev, timeout=DEADLOCK_TIMEOUT)
    assert not result.passed
    assert [c.passed for c in result.cases] == [True, False]  # PP=2 cannot tell; PP=4 skipped
    # a verdict that depends on a timeout: run once more, at four times the limit
    assert result.cases[1].detail.startswith(
        f"deadlocked after {DEADLOCK_TIMEOUT:g} s, and again after "
        f"{DEADLOCK_TIMEOUT * kit.RETRY_TIMEOUT_FACTOR:g} s ("), result.cases[1].detail
    assert "rank 0: waiting in recv from rank 2" in result.cases[1].detail
    assert result.hint == ch07.HINT_RECV_FROM_PREVIOUS


@hint_cases([
    (grad_from_prev_rank, ch07.HINT_RECV_FROM_NONE),
    (sends_to_previous, ch07.HINT_SEND_TO_PREVIOUS),
    (forgets_the_last_stage, ch07.HINT_LAST_STAGE),
    (returns_what_it_sent, ch07.HINT_RETURNED_SENT),
    (returns_none, ch07.HINT_RETURNED_NONE),
    (returns_a_fresh_buffer, ch07.HINT_EMPTY_BUFFER),
    (calls_the_library, ch07.HINT_USED_LIBRARY),
    (uses_torch_distributed, ch07.HINT_NO_P2P),
    (only_receives, ch07.HINT_FIX_DEADLOCK),
])
def test_peer_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_send_forward_recv_backward(wrong, timeout=DEADLOCK_TIMEOUT), hint)


def test_an_exception_names_the_rank_and_the_hint_the_pp_where_it_failed():
    result = check_send_forward_recv_backward(grad_from_prev_rank)
    assert result.cases[0].detail == ("rank 0 raised ValueError: recv: peer rank None is not in "
                                      "this rank's pp group [0, 1]")
    assert "failed at PP = 2 already" in result.hint


# --- exercise 7.2: who sends first --------------------------------------------------------------


@pytest.mark.parametrize("rule", [
    lambda stage, pp, helper: stage % 2 == 0,
    lambda stage, pp, helper: stage % 2 == 1,
    lambda stage, pp, helper: helper == "send_forward_recv_backward",
    lambda stage, pp, helper: helper == "send_backward_recv_forward",
], ids=["even_first", "odd_first", "forward_sender_first", "backward_sender_first"])
def test_every_rule_giving_neighbours_opposite_orders_passes(rule):
    result = check_send_first(rule)
    assert result.passed, str(result)
    assert [c.name for c in result.cases] == [f"PP={pp}" for pp in ch07.ORDER_PIPELINES]


@pytest.mark.parametrize("rule,hint,passed_before,pair", [
    (lambda s, pp, h: True, ch07.HINT_ALL_SEND_FIRST, 0, "Stages 0 and 1 both send first"),
    (lambda s, pp, h: False, ch07.HINT_ALL_RECV_FIRST, 0, "Stages 0 and 1 both receive first"),
    (lambda s, pp, h: s == 0, ch07.HINT_ORDER_GENERIC, 1, "Stages 1 and 2 both receive first"),
    (lambda s, pp, h: s < pp - 1, ch07.HINT_ORDER_GENERIC, 1, "Stages 0 and 1 both send first"),
], ids=["always_send", "always_receive", "only_stage_0_sends", "all_but_last_send"])
def test_deadlocking_rule_is_caught_and_the_pair_named(rule, hint, passed_before, pair):
    result = check_send_first(rule, timeout=DEADLOCK_TIMEOUT)
    assert not result.passed
    assert result.hint.startswith(hint), str(result)
    assert [c.passed for c in result.cases] == [True] * passed_before + [False]
    assert pair in result.cases[-1].detail
    # a verdict that depends on a timeout: run once more, at four times the limit
    assert result.cases[-1].detail.startswith(
        f"deadlocked after {DEADLOCK_TIMEOUT:g} s, and again after "
        f"{DEADLOCK_TIMEOUT * kit.RETRY_TIMEOUT_FACTOR:g} s ("), result.cases[-1].detail
    # A rule that passed with fewer stages is told why that proved nothing.
    assert ("passed: with fewer stages" in result.hint) == bool(passed_before)


@pytest.mark.parametrize("garbage", [lambda s, pp, h: 1, lambda s, pp, h: "send",
                                     lambda s, pp, h: None])
def test_a_rule_that_is_not_a_bool_gets_the_format_hint(garbage):
    result = check_send_first(garbage)
    assert not result.passed and result.hint == ch07.HINT_NOT_BOOL


# --- a verdict that depends on a timeout --------------------------------------------------------


def test_a_right_answer_passes_with_a_cpu_hog_beside_it():
    """A busy hub: one busy-looping process per core runs beside the checker, and the
    overlapped exchange still passes at its default 6 s limit (a case that runs past it is
    run once more at four times the limit; a real deadlock is reported after both runs:
    test_a_previous_stage_grad_passes_at_pp2_and_is_named_at_pp3)."""
    import os
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        assert check_send_forward_recv_backward(overlapped)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert kit.RETRY_TIMEOUT_FACTOR == 4.0
