"""Chapter 2's ring all-gather and byte-count checkers name the classic mistakes: they
launch real gloo workers (2 to 5 ranks); the deadlock cases use a short launcher timeout so
that they cost seconds, not minutes.  The pure checks: tests/unit/test_exercises_ch02.py."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.exercises import ch02, kit
from tutorial_lib.exercises.ch02 import check_ring_all_gather, check_ring_all_reduce_bytes

from ..notebook_cells import assert_hint, assert_staged_hint, hint_cases
from tests.asserts import every

pytestmark = pytest.mark.dist  # the checkers launch real gloo workers

DEADLOCK_TIMEOUT = 1.0  # seconds, then 4 on the retry: a right 2-rank ring takes ms, a hang 5 s


# --- exercise 2.1: the ring all-gather ---------------------------------------------------------


def _ring(ctx, chunk, exchange):
    """A right ring all-gather; ``exchange(outgoing, incoming, next, prev)`` moves one step."""
    n, i = ctx.world_size, ctx.rank
    chunks = [None] * n
    chunks[i] = chunk
    for step in range(n - 1):
        incoming = torch.empty_like(chunk)
        exchange(chunks[(i - step) % n], incoming, (i + 1) % n, (i - 1) % n)
        chunks[(i - step - 1) % n] = incoming
    return torch.cat(chunks)


def ring_all_gather(ctx, chunk):
    def together(outgoing, incoming, to, src):
        comm.wait_all([comm.isend(outgoing, to), comm.irecv(incoming, src)])

    return _ring(ctx, chunk, together)


def ring_all_gather_even_odd(ctx, chunk):
    """Blocking send/recv, even ranks sending first: correct, and no deadlock."""
    def by_parity(outgoing, incoming, to, src):
        if ctx.rank % 2 == 0:
            comm.send(outgoing, to)
            comm.recv(incoming, src)
        else:
            comm.recv(incoming, src)
            comm.send(outgoing, to)

    return _ring(ctx, chunk, by_parity)


def in_arrival_order(ctx, chunk):
    """The classic mistake: the chunks concatenated in the order they arrived."""
    n, i = ctx.world_size, ctx.rank
    arrived = [chunk]
    for _ in range(n - 1):
        incoming = torch.empty_like(chunk)
        comm.wait_all([comm.isend(arrived[-1], (i + 1) % n), comm.irecv(incoming, (i - 1) % n)])
        arrived.append(incoming)
    return torch.cat(arrived)


def off_by_one_slot(ctx, chunk):
    """Every chunk arrives, but lands one slot too far: (i - s - 2) instead of (i - s - 1)."""
    n, i = ctx.world_size, ctx.rank
    chunks, slots = [None] * n, [None] * n
    chunks[i] = slots[(i - 1) % n] = chunk
    last = chunk
    for step in range(n - 1):
        incoming = torch.empty_like(chunk)
        comm.wait_all([comm.isend(last, (i + 1) % n), comm.irecv(incoming, (i - 1) % n)])
        slots[(i - step - 2) % n] = last = incoming
    return torch.cat(slots)


def forwards_own_chunk(ctx, chunk):
    """Sends its own chunk at every step, so only its left neighbour's chunk ever arrives."""
    n, i = ctx.world_size, ctx.rank
    chunks = [chunk] * n
    for step in range(n - 1):
        incoming = torch.empty_like(chunk)
        comm.wait_all([comm.isend(chunk, (i + 1) % n), comm.irecv(incoming, (i - 1) % n)])
        chunks[(i - step - 1) % n] = incoming
    return torch.cat(chunks)


def leaves_zeros(ctx, chunk):
    n, i = ctx.world_size, ctx.rank
    out = torch.zeros(n * chunk.shape[0], *chunk.shape[1:])
    k = chunk.shape[0]
    out[i * k:(i + 1) * k] = chunk
    if n > 1:  # one exchange only, then gives up
        incoming = torch.empty_like(chunk)
        comm.wait_all([comm.isend(chunk, (i + 1) % n), comm.irecv(incoming, (i - 1) % n)])
    return out


def every_rank_receives_first(ctx, chunk):
    n, i = ctx.world_size, ctx.rank
    incoming = torch.empty_like(chunk)
    comm.recv(incoming, (i - 1) % n)
    comm.send(chunk, (i + 1) % n)
    return incoming


def every_rank_sends_first(ctx, chunk):
    n, i = ctx.world_size, ctx.rank
    comm.send(chunk, (i + 1) % n)  # gloo's send waits for the peer's receive
    incoming = torch.empty_like(chunk)
    comm.recv(incoming, (i - 1) % n)
    return incoming


def calls_the_library(ctx, chunk):
    out = torch.empty(ctx.world_size * chunk.shape[0], *chunk.shape[1:])
    return comm.all_gather(out, chunk)


def calls_the_library_ring(ctx, chunk):
    from tutorial_lib import ring_collectives
    return ring_collectives.ring_all_gather(chunk)


def uses_torch_distributed_directly(ctx, chunk):
    import torch.distributed as dist
    out = torch.empty(ctx.world_size * chunk.shape[0], *chunk.shape[1:])
    dist.all_gather_into_tensor(out, chunk)
    return out


def returns_a_list(ctx, chunk):
    return list(ring_all_gather(ctx, chunk).split(chunk.shape[0]))


def returns_only_its_chunk(ctx, chunk):
    return chunk


def raises_key_error(ctx, chunk):
    return {}["no such key"]


@pytest.mark.parametrize("correct", [ring_all_gather, ring_all_gather_even_odd],
                         ids=lambda fn: fn.__name__)
def test_correct_ring_all_gathers_pass(correct):
    result = check_ring_all_gather(correct)
    assert result.passed, str(result)
    assert [c.name.split(",")[0] for c in result.cases] == [
        "world_size=2", "world_size=3", "world_size=4"]


@hint_cases([
    (in_arrival_order, ch02.HINT_ARRIVAL_ORDER),
    (off_by_one_slot, ch02.HINT_WRONG_PLACE),
    (forwards_own_chunk, ch02.HINT_DUPLICATES),
    (leaves_zeros, ch02.HINT_MISSING),
    (calls_the_library, ch02.HINT_USED_LIBRARY),
    (calls_the_library_ring, ch02.HINT_USED_LIBRARY),
    (uses_torch_distributed_directly, ch02.HINT_NO_P2P),
    (returns_a_list, ch02.HINT_NOT_A_TENSOR),
    (returns_only_its_chunk, ch02.HINT_SHAPE),
    (raises_key_error, ch02.HINT_ALL_GATHER_NUDGE),
])
def test_all_gather_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_ring_all_gather(wrong, timeout=10), hint)


def test_arrival_order_names_the_slots():
    result = check_ring_all_gather(in_arrival_order)
    # with 2 ranks, rank 0's arrival order happens to be right; rank 1's is not
    assert result.cases[0].detail == ("rank 1: slots hold the chunks of ranks [1, 0] (slot j must "
                                      "hold rank j's chunk)")
    assert "ranks [0, 3, 2, 1]" in result.cases[2].detail


def test_an_exception_becomes_a_case_with_the_rank():
    result = check_ring_all_gather(raises_key_error)
    assert every("raised KeyError" in c.detail for c in result.cases)


@pytest.mark.parametrize("deadlocks,hint,waiting_in", [
    (every_rank_receives_first, ch02.HINT_ALL_RECV_FIRST, "waiting in recv"),
    (every_rank_sends_first, ch02.HINT_ALL_SEND_FIRST, "waiting in send"),
], ids=["receives_first", "sends_first"])
def test_deadlock_is_caught_and_explained(deadlocks, hint, waiting_in):
    result = check_ring_all_gather(deadlocks, timeout=DEADLOCK_TIMEOUT)
    assert not result.passed
    assert result.hint == hint
    assert len(result.cases) == 1  # the larger worlds are not tried after a deadlock
    # a verdict that depends on a timeout: run once more, at four times the limit
    assert result.cases[0].detail.startswith(
        f"deadlocked after {DEADLOCK_TIMEOUT:g} s, and again after "
        f"{DEADLOCK_TIMEOUT * kit.RETRY_TIMEOUT_FACTOR:g} s ("), result.cases[0].detail
    assert result.cases[0].detail.count(waiting_in) == 2  # both ranks of the 2-rank world


# --- exercise 2.2: bytes of a ring all-reduce --------------------------------------------------


def test_measured_bytes_are_the_closed_form():
    for n in ch02.RING_BYTES_WORLDS:
        for nbytes, sent in ch02.measured_ring_bytes(n).items():
            assert nbytes % n == 0
            assert sent == 2 * (n - 1) * nbytes // n


@pytest.mark.parametrize("correct", [
    lambda nbytes, n: 2 * (n - 1) * nbytes / n,
    lambda nbytes, n: 2 * (n - 1) * nbytes // n,
    lambda nbytes, n: torch.tensor(2 * (n - 1) / n * nbytes),  # any number-like value
])
def test_correct_byte_counts_pass(correct):
    result = check_ring_all_reduce_bytes(correct)
    assert result.passed, str(result)
    assert len(result.cases) == len(ch02.RING_BYTES_WORLDS) * len(ch02.RING_BYTES_ELEMENTS_PER_RANK)


@hint_cases([
    (lambda nbytes, n: 2 * nbytes, ch02.HINT_TWO_B),
    (lambda nbytes, n: (n - 1) * nbytes, ch02.HINT_N_MINUS_ONE_B),
    (lambda nbytes, n: (n - 1) * nbytes / n, ch02.HINT_ONE_PHASE),
    (lambda nbytes, n: 2 * (n - 1) * nbytes, ch02.HINT_WHOLE_TENSOR_PER_STEP),
    (lambda nbytes, n: 4 * (n - 1) * nbytes / n, ch02.HINT_SENT_AND_RECEIVED),
    (lambda nbytes, n: 2 * (n - 1) // n * nbytes, ch02.HINT_INTEGER_DIVISION),
    (lambda nbytes, n: "1536 bytes", ch02.HINT_NOT_A_NUMBER),
    (lambda nbytes, n: nbytes / n, ch02.HINT_BYTES_NUDGE),
    (lambda nbytes, n: 1 / 0, ch02.HINT_BYTES_NUDGE),
], ids=["2B", "(N-1)B", "one_phase", "whole_tensor", "sent_and_received", "integer_division",
          "string", "B_over_N", "raises"])
def test_byte_count_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_ring_all_reduce_bytes(wrong), hint)


def test_two_b_fails_on_every_world_and_keeps_the_trace_count_to_itself():
    """Exercises that teach: the case name carried the traced count, so any answer revealed the key."""
    result = check_ring_all_reduce_bytes(lambda nbytes, n: 2 * nbytes)
    assert not any(c.passed for c in result.cases)
    first = result.cases[0]
    assert first.name == "B=24 bytes, N=2 ranks"
    assert first.detail == "predicted 48 bytes; the traced ring sends another count"


def test_the_formula_comes_when_the_same_cases_fail_again():
    assert_staged_hint(check_ring_all_reduce_bytes, lambda nbytes, n: nbytes / n,
                       ch02.HINT_BYTES_NUDGE, ch02.HINT_BYTES_GENERIC)


def test_n_minus_one_b_passes_only_where_it_coincides():
    # (N-1)*B equals 2(N-1)/N*B only for N = 2: the hint must still name the mistake
    result = check_ring_all_reduce_bytes(lambda nbytes, n: (n - 1) * nbytes)
    assert [c.passed for c in result.cases][:2] == [True, True]
    assert every("N=2 " not in c.name for c in result.cases if not c.passed)


@pytest.mark.parametrize("garbage", [None, "0,2", object()])
def test_byte_checker_never_raises_on_garbage(garbage):
    result = check_ring_all_reduce_bytes(lambda *args: garbage)
    assert not result.passed and result.hint
