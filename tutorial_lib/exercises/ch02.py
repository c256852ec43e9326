"""Checkers for chapter 2, collectives.

* :func:`check_ring_all_gather`: the student's ``fn(ctx, chunk)`` is launched on 2, 3
  and 4 real gloo ranks, each rank holding a chunk of distinct values, and every rank's
  answer is compared with what :func:`tutorial_lib.comm.all_gather` returned in the same
  worker.  A deadlock becomes a hint about the order of sends and receives; chunks in
  the order they arrived (the classic mistake) get a hint of their own.
* :func:`check_ring_all_reduce_bytes`: the student's ``fn(nbytes, n)`` predicts the
  bytes each rank sends in a ring all-reduce.  The checker launches the library's
  :func:`tutorial_lib.ring_collectives.ring_all_reduce` on 2 to 5 ranks, counts the bytes of
  every rank's sends in the trace, and compares.  ``2 B`` and ``(N-1) B`` and the other
  usual wrong formulas each get a specific hint.
* :func:`check_choose_collectives`: which collective each of seven training
  situations calls for, with a reason for every wrong choice.

Student code never makes a checker raise: exceptions, deadlocks and stubs become failed
cases with a hint.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable

from ..launch import LaunchTimeout
from .kit import (HINT_RUN_FAILED, Case, Checking, CheckResult, Mistakes, as_number,
                  check_answers, deadlock_kind, is_close, launch_retrying, recover_answer)

# --- hints (tests look for these exact strings) ---------------------------------------

HINT_ALL_RECV_FIRST = (
    "deadlock: every rank receives first, so nobody sends. Each rank waits in recv for "
    "its left neighbour, which is itself waiting in recv. Post the send and the receive "
    "together (comm.isend and comm.irecv, then wait for both), or let even ranks send "
    "first while odd ranks receive first."
)
HINT_ALL_SEND_FIRST = (
    "deadlock: every rank sends first with a send that blocks. With gloo a send does not "
    "finish until the peer has posted the matching receive, and every peer is itself "
    "stuck in its own send. Post the send and the receive together (comm.isend and "
    "comm.irecv, then wait for both), or alternate the order between even and odd ranks."
)
HINT_UNMATCHED = (
    'deadlock: some rank waits for a message that is never sent. In a ring all-gather '
    'every rank sends to its right neighbour and receives from its left one (the ring '
    'wraps around), as many times as it has steps; check that the peers and the '
    'number of steps match.'
)
HINT_DEADLOCK_GENERIC = (
    "the launch timed out: the ranks were waiting for each other. Print what each rank "
    "sends and receives at every step and check that every send meets a receive on its "
    "peer, in the same order."
)
HINT_ARRIVAL_ORDER = (
    'the right chunks, in the order they arrived: rank i ends with its own chunk '
    'first, then the chunk of rank i-1, then i-2... The result must be in rank order: '
    "slot j holds rank j's chunk on every rank. Reconsider, for the chunk that "
    'arrives at step s, which rank it started on.'
)
HINT_WRONG_PLACE = (
    'every chunk arrived, but some sit in the wrong slot. Slot j of the result must '
    "hold rank j's chunk: follow one chunk around the ring and reconsider which "
    "rank's chunk reaches rank i at step s (counting from 0)."
)
HINT_DUPLICATES = (
    "some chunks appear twice and others never: at each step forward the chunk you "
    "received at the previous step (at step 0, your own), not the same chunk again."
)
HINT_MISSING = (
    "some slots of the result hold values that no rank sent (zeros, or whatever an empty "
    "buffer contained). Every slot must end up with a received chunk, or your own in "
    "slot i; receive into a fresh buffer at every step."
)
HINT_NOT_A_TENSOR = (
    'return one tensor, the N chunks placed along dim 0 in rank order, not a list of '
    'chunks.'
)
HINT_SHAPE = (
    "the result has the wrong shape: with N ranks and a chunk of shape (k, ...), the "
    "all-gather returns shape (N*k, ...), every chunk exactly once."
)
HINT_USED_LIBRARY = (
    "your function called a library collective (all_gather, all_reduce...): the point is "
    "to build the all-gather yourself from comm.isend/comm.irecv (or comm.send/comm.recv)."
)
HINT_NO_P2P = (
    "the trace recorded no sends from your function. Use the traced point-to-point ops of "
    "tutorial_lib.comm (isend/irecv or send/recv), not torch.distributed directly, so "
    "that the course can see what your ring moves."
)
HINT_ALL_GATHER_NUDGE = (
    "follow one chunk around the ring: at every step each rank passes one chunk to its "
    "right neighbour and receives one from its left. Which rank's chunk arrives at rank i "
    "at step s, and in which slot of the result does it belong?"
)
HINT_ALL_GATHER_GENERIC = (
    "re-read 'All-gather' and 'Ring all-reduce: a reduce-scatter, then an "
    "all-gather': reconsider how many steps the ring takes, which chunk a rank passes "
    "on at each step, and which rank's chunk reaches rank i at step s: that rank's "
    "number is the chunk's slot."
)

HINT_TWO_B = (
    '2*B is the limit for many ranks, not the exact count: the ring cuts the tensor '
    'into N chunks and each rank sends one chunk per step. Reconsider the size of one '
    'chunk and how many steps the two phases take together: the count comes out below '
    '2B.'
)
HINT_N_MINUS_ONE_B = (
    '(N-1)*B would send the whole tensor at each of N-1 steps. The ring sends one '
    'chunk per step, and it has two phases (reduce-scatter, then all-gather): '
    'reconsider the size of one chunk and the steps of both phases.'
)
HINT_ONE_PHASE = (
    "(N-1)/N * B is one phase only: that is what a reduce-scatter (or an all-gather) "
    "sends. A ring all-reduce runs both, one after the other."
)
HINT_WHOLE_TENSOR_PER_STEP = (
    'the number of steps is right, but a step does not send the whole tensor: '
    'reconsider what one rank sends in one step.'
)
HINT_SENT_AND_RECEIVED = (
    "you counted what a rank receives as well: every rank receives exactly as much as it "
    "sends. Count only the sends."
)
HINT_INTEGER_DIVISION = (
    'the count is right but `//` rounds too early: 2*(n-1)//n is 1 for every n >= 2. '
    'Multiply before you divide (the division is exact here, since B is a multiple of '
    'N), or use `/`.'
)
HINT_NOT_A_NUMBER = "return a number: the bytes one rank sends, e.g. 1536 or 1536.0."
HINT_BYTES_NUDGE = (
    "count, do not guess: how many steps does each phase of the ring take, how many phases "
    "are there, and how many bytes does one rank send in one step?"
)
HINT_BYTES_GENERIC = (
    "re-read 'Ring all-reduce: a reduce-scatter, then an all-gather': reconsider how "
    'many phases the ring runs, how many steps each phase takes, and the size of what '
    'one rank sends in one step.'
)

#: The mistakes of exercise 2.1, in order of preference: deadlocks first (by what the
#: ranks were stuck in), then the shape of the answer, then the slots, then the trace.
ALL_GATHER_MISTAKES = Mistakes(
    (HINT_ALL_GATHER_NUDGE, HINT_ALL_GATHER_GENERIC), all_recv=HINT_ALL_RECV_FIRST, all_send=HINT_ALL_SEND_FIRST,
    unmatched=HINT_UNMATCHED, deadlock=HINT_DEADLOCK_GENERIC, not_a_tensor=HINT_NOT_A_TENSOR,
    shape=HINT_SHAPE, arrival_order=HINT_ARRIVAL_ORDER, wrong_place=HINT_WRONG_PLACE,
    duplicates=HINT_DUPLICATES, missing=HINT_MISSING, used_library=HINT_USED_LIBRARY,
    no_p2p=HINT_NO_P2P)
#: The mistakes of exercise 2.2 (their formulas: :data:`RING_BYTES_MISTAKES`).
RING_BYTES_HINTS = Mistakes(
    (HINT_BYTES_NUDGE, HINT_BYTES_GENERIC), not_a_number=HINT_NOT_A_NUMBER, two_b=HINT_TWO_B,
    n_minus_one_b=HINT_N_MINUS_ONE_B, one_phase=HINT_ONE_PHASE,
    whole_tensor_per_step=HINT_WHOLE_TENSOR_PER_STEP, sent_and_received=HINT_SENT_AND_RECEIVED,
    integer_division=HINT_INTEGER_DIVISION)



# --- exercise 2.1: a ring all-gather ------------------------------------------------------

#: (world size, rows per chunk): small worlds, odd sizes, chunks of several rows.
ALL_GATHER_CASES = [(2, 1), (3, 2), (4, 3)]


def chunk_of(rank: int, rows: int):
    """Rank ``rank``'s chunk: ``rows`` rows of 2 values, distinct across ranks and rows.

    Rank r's values are ``100 (r+1) + 0, 1, 2, ...``, so a value names its rank.
    """
    import torch
    start = 100 * (rank + 1)
    return torch.arange(start, start + 2 * rows, dtype=torch.float32).reshape(rows, 2)


def _all_gather_worker(ctx, fn, rows):
    import torch

    from .. import comm
    chunk = chunk_of(ctx.rank, rows)
    reference = comm.all_gather(torch.empty(rows * ctx.world_size, 2), chunk.clone())
    with ctx.tracer.tags(student=True):
        got = fn(ctx, chunk.clone())
    return {"reference": reference, "got": got}


def _slot_owners(got, n: int, rows: int) -> list | None:
    """For each of the n slots of ``got``: the rank whose chunk it holds, or None."""
    import torch
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n * rows, 2):
        return None
    owners = []
    for j in range(n):
        slot = got[j * rows:(j + 1) * rows].detach().float().cpu()
        owners.append(next((r for r in range(n) if torch.equal(slot, chunk_of(r, rows))), None))
    return owners


def _classify_all_gather(gots: list, n: int, rows: int) -> set:
    """Names of the mistakes that explain every rank's answer."""
    import torch
    if any(isinstance(g, (list, tuple)) or not isinstance(g, torch.Tensor) for g in gots):
        return {"not_a_tensor"}
    if any(tuple(g.shape) != (n * rows, 2) for g in gots):
        return {"shape"}
    owners = [_slot_owners(g, n, rows) for g in gots]
    expected = list(range(n))
    wrong = [(i, o) for i, o in enumerate(owners) if o != expected]
    if not wrong:
        return set()
    if any(None in o for _, o in wrong):
        return {"missing"}
    if all(o == [(i - s) % n for s in range(n)] for i, o in wrong):
        return {"arrival_order", "wrong_place"}
    if all(sorted(o) == expected for _, o in wrong):
        return {"wrong_place"}
    return {"duplicates"}


def _same_all_gather(got, expected) -> bool:
    import torch
    gots, _ = got
    return all(isinstance(g, torch.Tensor) and g.shape == e.shape and torch.equal(g.float(), e)
               for g, e in zip(gots, expected))


def check_ring_all_gather(fn: Callable, timeout: float = 10.0) -> CheckResult:
    """Launch ``fn(ctx, chunk) -> tensor`` on 2, 3 and 4 ranks; compare with ``comm.all_gather``.

    Rank r passes :func:`chunk_of` ``(r, rows)``; every rank must return all chunks
    concatenated along dim 0 in rank order.  ``timeout`` (seconds) turns a hang into a
    deadlock report; after a deadlock or an unfilled stub the larger worlds are skipped.
    """
    import torch
    check = Checking("Exercise 2.1: my_ring_all_gather", ALL_GATHER_MISTAKES)
    for n, rows in ALL_GATHER_CASES:
        expected = [torch.cat([chunk_of(r, rows) for r in range(n)]) for _ in range(n)]

        def unpack(out, expected=expected):
            for r, res in enumerate(out.results):  # the library agrees with the closed form
                assert torch.equal(res["reference"], expected[r]), "comm.all_gather disagrees"
            return [res["got"] for res in out.results], out.trace.filter(student=True)

        case, got = check.run_on_ranks(
            f"world_size={n}, chunks of shape ({rows}, 2)", _all_gather_worker, n, args=(fn, rows),
            timeout=timeout, expected=expected, compare=_same_all_gather, unpack=unpack)
        if isinstance(got, LaunchTimeout):
            check.shows({deadlock_kind(got.report)})
            break
        if check.stub:
            break
        if isinstance(got, BaseException):  # a rank raised, or the launcher itself failed
            check.shows()
            continue
        gots, trace = got
        library_ops = ({e.op for e in trace} - {"send", "recv", "compute", "barrier"}) | {
            e.tags["algorithm"] for e in trace if "algorithm" in e.tags}  # the library's rings
        if case.passed and library_ops:
            case.passed, case.detail = False, f"the result is right, but your code called {sorted(library_ops)}"
            check.shows({"used_library"})
        elif case.passed and not trace.filter(op="send").events:
            case.passed, case.detail = False, "the result is right, but no traced send was recorded"
            check.shows({"no_p2p"})
        elif not case.passed:
            mistakes = _classify_all_gather(gots, n, rows)
            bad = next((r for r, (g, e) in enumerate(zip(gots, expected))
                        if not (isinstance(g, torch.Tensor) and g.shape == e.shape
                                and torch.equal(g.float(), e))), 0)
            owners = _slot_owners(gots[bad], n, rows)
            shown = (f"slots hold the chunks of ranks {owners}" if owners is not None
                     else f"returned {type(gots[bad]).__name__}"
                     + (f" of shape {tuple(gots[bad].shape)}" if isinstance(gots[bad], torch.Tensor) else ""))
            if owners is not None:
                shown += " (slot j must hold rank j's chunk)"
            case.detail = f"rank {bad}: {shown}"
            check.shows(mistakes)
    return check.verdict()


# --- exercise 2.2: bytes a ring all-reduce sends ------------------------------------------

#: World sizes the library's ring runs on, and tensor lengths (float32 elements) per rank
#: count: every length is a multiple of N, as the ring requires.
RING_BYTES_WORLDS = (2, 3, 4, 5)
RING_BYTES_ELEMENTS_PER_RANK = (3, 1000)


def _ring_bytes_worker(ctx, lengths):
    import torch

    from .. import ring_collectives
    for length in lengths:
        ring_collectives.ring_all_reduce(torch.zeros(length))


@lru_cache(maxsize=None)
def measured_ring_bytes(n: int) -> dict[int, int]:
    """Launch the library's ring all-reduce on ``n`` ranks; ``{B: bytes each rank sent}``.

    ``B`` is the tensor's size in bytes; the bytes sent are summed over each rank's
    ``send`` events in the trace, and must be the same on every rank.  Cached: the
    library's ring sends the same bytes every time.
    """
    lengths = [n * k for k in RING_BYTES_ELEMENTS_PER_RANK]
    out = launch_retrying(_ring_bytes_worker, n, args=(lengths,), timeout=60)
    sends = out.trace.filter(op="send", algorithm="ring_all_reduce")
    measured = {}
    for call, length in enumerate(lengths):
        per_rank = {r: sum(e.bytes for e in sends.filter(rank=r, call=call)) for r in range(n)}
        if len(set(per_rank.values())) != 1:
            raise RuntimeError(f"ranks sent different byte counts in one ring all-reduce: {per_rank}")
        measured[4 * length] = per_rank[0]
    return measured


#: Wrong formulas students write, by name: each maps (B, N) to a byte count.
RING_BYTES_MISTAKES = {
    "two_b": lambda b, n: 2 * b,
    "n_minus_one_b": lambda b, n: (n - 1) * b,
    "one_phase": lambda b, n: (n - 1) * b / n,
    "whole_tensor_per_step": lambda b, n: 2 * (n - 1) * b,
    "sent_and_received": lambda b, n: 4 * (n - 1) * b / n,
    "integer_division": lambda b, n: 2 * (n - 1) // n * b,
}


def _close(got, want) -> bool:
    return is_close(got, want, rel_tol=1e-9, abs_tol=1e-9)


def check_ring_all_reduce_bytes(fn: Callable) -> CheckResult:
    """Check ``fn(nbytes, n) -> bytes one rank sends`` against the traced ring all-reduce.

    For N = 2..5 ranks and two tensor sizes each, the library's
    :func:`~tutorial_lib.ring_collectives.ring_all_reduce` is launched and every rank's
    sends are counted in the trace (see :func:`measured_ring_bytes`).
    """
    check = Checking("Exercise 2.2: ring_all_reduce_bytes", RING_BYTES_HINTS)
    for n in RING_BYTES_WORLDS:
        if check.stub:
            break  # an unfilled stub: one case says so
        try:
            measured = measured_ring_bytes(n)
        except Exception as err:  # noqa: BLE001 - a broken machine is not the student's fault
            check.add(Case(f"N={n}", False, f"could not measure the ring: {err}"))
            check.shows()
            continue
        for nbytes, sent in measured.items():
            case, got = check.run(f"B={nbytes} bytes, N={n} ranks",
                                  lambda nbytes=nbytes, n=n: fn(nbytes, n), sent, compare=_close)
            if check.stub:
                break
            if not case.passed and as_number(got) is not None:
                case.detail = (f"predicted {as_number(got):g} bytes; the traced ring sends "
                               "another count")
            check.judge(case, got, as_number, lambda number: {
                name for name, wrong in RING_BYTES_MISTAKES.items() if _close(number, wrong(nbytes, n))},
                unreadable="not_a_number")
    return check.verdict()


# --- exercise 2.3: which collective? ------------------------------------------------------

#: Situation name -> what happens (the statement; the answers are kept as digests below).
SCENARIOS = {
    "tp_row_parallel_output":
        "Tensor parallelism: after a row-parallel linear layer each TP rank holds a partial "
        "sum of the layer's output, and every TP rank needs the full sum.",
    "tp_column_parallel_input_grad":
        "Tensor parallelism, backward pass: a column-parallel layer's input was the same on "
        "every TP rank, and each rank computed the gradient with respect to that input from "
        "its own output columns only, a partial sum; every TP rank needs the full gradient.",
    "dp_gradients":
        "Plain data parallelism: after the backward pass every replica needs the sum of all "
        "replicas' gradients.",
    "zero_gradients":
        "Data parallelism with a distributed optimizer (ZeRO): after the backward pass each "
        "rank needs the summed gradients of only the 1/N of the parameters it updates.",
    "zero_parameters":
        "The same distributed optimizer, after its step: each rank has updated its 1/N of "
        "the parameters, and every rank needs all of them for the next forward pass.",
    "moe_dispatch":
        "Expert parallelism: each rank's tokens were routed to experts that live on other "
        "ranks, a different number of tokens to each rank.",
    "pipeline_activations":
        "Pipeline parallelism: stage 2 finished a microbatch's forward pass; stage 3 needs "
        "its output activations.",
    "initial_weights":
        "Rank 0 loaded a checkpoint; every other rank must start from identical weights.",
}

#: Situation -> the digest of its collective (``kit.answer_digest``): the checker finds the
#: answer among the collectives while it runs; the library holds no key to read off.
SCENARIO_DIGESTS = {
    "tp_row_parallel_output": "41c415c9b0cd95c8024b423714607e71",
    "tp_column_parallel_input_grad": "9ad98b24cc6b433fab689f3bcbb2ba4e",
    "dp_gradients": "50305a66dbd9cc5edf2679c4ce6402d9",
    "zero_gradients": "c1700977b0f767d9dd50e680ea89616d",
    "zero_parameters": "8f42c6926538f532e8b71d4f5937d8ab",
    "moe_dispatch": "e5dffffe3143663c852629fc00f88d0a",
    "pipeline_activations": "6c4bfc8ff0361f4d22dfda121e64ddb1",
    "initial_weights": "3c68e978346362f91136e2ee366c9acc",
}

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
"""The answers 2.3 allows."""

_OP_NAMES = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter",
             "allgather": "all_gather", "alltoall": "all_to_all", "alltoallv": "all_to_all",
             "broadcast": "broadcast", "bcast": "broadcast", "send": "send",
             "sendrecv": "send", "p2p": "send", "isend": "send", "recv": "send",
             "pointtopoint": "send"}

#: (situation, wrong answer) -> why it is wrong.
WRONG_CHOICES = {
    ("tp_row_parallel_output", "all_gather"):
        "all-gather concatenates the partial outputs instead of adding them: the layer's "
        "output is their sum.",
    ("tp_row_parallel_output", "reduce_scatter"):
        "a reduce-scatter leaves each rank only a slice of the sum (that is what sequence "
        "parallelism does, and it then needs an all-gather later); here every rank needs "
        "the full sum.",
    ("tp_column_parallel_input_grad", "all_gather"):
        "each rank's partial gradient already has the input's full shape: the parts must be "
        "added, not placed side by side.",
    ("tp_column_parallel_input_grad", "reduce_scatter"):
        "the layer's input was whole on every TP rank, so every rank needs the whole "
        "gradient. (With sequence parallelism the input is split along the sequence, and "
        "then a reduce-scatter is exactly right.)",
    ("tp_column_parallel_input_grad", "send"):
        "every TP rank holds a part of the sum and every rank needs all of it: no message "
        "between two ranks can deliver that.",
    ("dp_gradients", "reduce_scatter"):
        "without a distributed optimizer every replica updates every parameter, so each "
        "needs the whole summed gradient, not a slice.",
    ("dp_gradients", "all_gather"):
        "all-gather collects the replicas' gradients side by side; they must be added.",
    ("zero_gradients", "all_reduce"):
        "an all-reduce works but moves twice the bytes: it hands every rank the whole sum, "
        "while each rank only needs the slice of it that it updates. A collective that "
        "leaves each rank only its slice of the sum costs half as much.",
    ("zero_gradients", "all_gather"):
        "nothing would be summed: gradients of the same parameter from different ranks "
        "must be added.",
    ("zero_parameters", "all_reduce"):
        "there is nothing to add: each parameter's new value lives on exactly one rank, so "
        "placing the slices side by side on every rank is enough, at half the bytes.",
    ("zero_parameters", "broadcast"):
        "every rank owns a slice, not one root: N broadcasts would do it, but a single "
        "collective can do it at once.",
    ("moe_dispatch", "all_gather"):
        "an all-gather sends every token to every rank, N times the traffic: each token "
        "only has to reach the ranks of its experts.",
    ("moe_dispatch", "broadcast"):
        "broadcast copies one rank's data to all; here every rank sends different rows to "
        "every other rank.",
    ("moe_dispatch", "all_reduce"):
        "nothing is added in a dispatch: tokens are moved, each to its expert's rank.",
    ("pipeline_activations", "broadcast"):
        "only the next stage needs the activations, and no other rank: a collective involves "
        "the whole group for one reader.",
    ("pipeline_activations", "all_gather"):
        "only the next stage needs the activations, and no other rank: a collective involves "
        "the whole group for one reader.",
    ("initial_weights", "all_reduce"):
        "an all-reduce of the weights would add the (random) weights of every rank; one "
        "rank holds the truth and the others copy it.",
    ("initial_weights", "all_gather"):
        "the weights are not split across ranks: one rank holds all of them.",
}

HINT_CHOOSE_FORMAT = (
    "return a dict from every situation name in SCENARIOS to one of 'all_reduce', "
    "'reduce_scatter', 'all_gather', 'all_to_all', 'broadcast' or 'send'."
)
HINT_CHOOSE_GENERIC = (
    "ask two questions: are values from several ranks added (all-reduce, reduce-scatter) "
    "or only moved (all-gather, all-to-all, broadcast, send)? And who needs the result: "
    "every rank all of it, every rank a slice, or one rank?"
)


def normalize_op(name) -> str | None:
    """'AllReduce', 'all-reduce', 'all_reduce' -> 'all_reduce'; None if not an op name."""
    if not isinstance(name, str):
        return None
    return _OP_NAMES.get(re.sub(r"[^a-z0-9]", "", name.lower()))


def check_choose_collectives(fn: Callable) -> CheckResult:
    """Check ``fn() -> {situation: collective}`` for every situation in :data:`SCENARIOS`."""
    return check_answers("Exercise 2.3: choose_collectives", fn, SCENARIOS, _judge_collective,
                         HINT_CHOOSE_FORMAT)


def _judge_collective(situation: str, given) -> tuple[str, str | None] | None:
    answer = recover_answer("2.3", situation, SCENARIO_DIGESTS[situation],
                            ((op, op) for op in COLLECTIVES))
    chosen = normalize_op(given)
    if chosen == answer:
        return None
    why = None if chosen is None else WRONG_CHOICES.get((situation, chosen), HINT_CHOOSE_GENERIC)
    return f"got {given!r}", why




# --- exercise 2.4: predict the dispatch, then run it ----------------------------------------

#: Exercise 2.4's router: for each of the 4 ranks, the destination rank of each of its 6
#: tokens (token t of rank r has the value 10 r + t).  No token goes to rank 1.
DISPATCH_ROUTES = ((2, 0, 3, 2, 0, 2),
                   (3, 3, 0, 2, 0, 3),
                   (0, 2, 2, 3, 3, 0),
                   (3, 2, 0, 0, 2, 3))

HINT_DISPATCH_FORMAT = (
    "return a dict from each rank, 0 to 3, to the list of token values that arrive on it, "
    "in the order they arrive (an empty list when none does)."
)
HINT_DISPATCH_SENT = (
    "you listed what each rank sends, not what it receives: the all-to-all transposes the "
    "table of pieces, so rank k ends up with piece k of every sender's input.",
)
HINT_DISPATCH_ORDER = (
    "the right values in the wrong order: the output is one block per sender, in the "
    "order of the senders' ranks, and inside a block the sender's order of its rows "
    "(grouped by destination with a stable sort, so by token index).",
)
HINT_DISPATCH_HOME = (
    "a rank's own piece stays home but is still part of its output: a token routed to its "
    "own rank arrives too, in the sender's block of that rank.",
)
HINT_DISPATCH_GENERIC = (
    "for each receiving rank k, go through the senders in order, rank 0 to 3, and take "
    "from each the values of its tokens routed to k, in token order.",
)

#: The mistakes of exercise 2.4, in order of preference.
DISPATCH_MISTAKES = Mistakes(HINT_DISPATCH_GENERIC, any_case={"format"},
                             format=HINT_DISPATCH_FORMAT, sent=HINT_DISPATCH_SENT,
                             order=HINT_DISPATCH_ORDER, home=HINT_DISPATCH_HOME)


def _dispatch_worker(ctx, routes):
    import torch

    from .. import comm
    experts = torch.tensor(routes[ctx.rank])
    tokens = 10.0 * ctx.rank + torch.arange(float(len(experts)))
    order = torch.argsort(experts, stable=True)  # grouped by destination rank
    send_counts = torch.bincount(experts, minlength=ctx.world_size)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all(recv_counts, send_counts)
    arrived = torch.empty(int(recv_counts.sum()))
    comm.all_to_all(arrived, tokens[order], output_split_sizes=recv_counts.tolist(),
                    input_split_sizes=send_counts.tolist())
    return [int(v) for v in arrived.tolist()]


def measured_dispatch(routes=DISPATCH_ROUTES) -> dict[int, list[int]]:
    """Run the dispatch of chapter 2 (counts, then the uneven all-to-all) on one gloo rank
    per row of ``routes``; ``{rank: the values that arrived, in order}``."""
    out = launch_retrying(_dispatch_worker, len(routes), args=(routes,), timeout=60)
    return dict(enumerate(out.results))


def _dispatch_variant(routes, rank: int, rule: str) -> list[int]:
    """What a rank would hold under a wrong rule: what it sent, sorted, without home."""
    if rule == "sent":
        return [10 * rank + t for t, _ in sorted(enumerate(routes[rank]), key=lambda p: p[1])]
    arrived = [10 * r + t for r, row in enumerate(routes) for t, k in enumerate(row)
               if k == rank and (rule != "home" or r != rank)]
    return arrived


def check_dispatch(fn: Callable, measured: Callable[[], dict] = measured_dispatch
                   ) -> CheckResult:
    """Check ``fn() -> {rank: values}``, the tokens each rank receives in the dispatch of
    :data:`DISPATCH_ROUTES`, against the real all-to-all, run on 4 gloo ranks once the
    student has committed a prediction.  A wrong list is shown as given."""
    check = Checking("Exercise 2.4: dispatch", DISPATCH_MISTAKES)
    opened = check.prediction(fn, "the prediction", measured)  # nothing committed: no run
    if opened is None:
        return check.verdict()
    got, ran = opened
    for rank in range(len(DISPATCH_ROUTES)):
        name = f"rank {rank}"
        given = got.get(rank)
        try:
            values = [int(v) for v in given] if not isinstance(given, (str, dict)) else None
        except (TypeError, ValueError):
            values = None
        if values is None:
            check.add(Case(name, False, "missing from the dict" if given is None else
                           f"got {given!r}, not a list of token values"))
            check.shows({"format"})
            continue
        if values == ran[rank]:
            check.add(Case(name, True))
            continue
        check.add(Case(name, False, f"got {values}: not what arrived"))
        shown = {rule for rule in ("sent", "home")
                 if values == _dispatch_variant(DISPATCH_ROUTES, rank, rule)}
        if sorted(values) == sorted(ran[rank]):
            shown.add("order")
        check.shows(shown)
    return check.verdict()


__all__ = ["check_ring_all_gather", "check_ring_all_reduce_bytes", "check_choose_collectives",
           "chunk_of", "measured_ring_bytes", "normalize_op", "SCENARIOS"]
__all__ += ["check_dispatch", "measured_dispatch", "DISPATCH_ROUTES"]
