"""Checkers for chapter 7, pipeline P2P modes.

* :func:`check_send_forward_recv_backward`: the student's
  ``fn(tensor, shape, dtype) -> gradient or None`` plays
  :func:`tutorial_lib.p2p.send_forward_recv_backward` in one steady-state round on
  ``PP = 2, 3, 4`` real gloo ranks, against the library's ``send_backward_recv_forward``
  on the neighbour.  ``PP = 2`` alone cannot tell the next stage from Megatron's
  (wrapping) previous one, so receiving the gradient from the previous stage only
  fails from ``PP = 3`` on, as a deadlock whose report names the wrong peer; with the
  non-wrapping ``p2p.prev_rank()`` stage 0 raises at ``PP = 2`` already, and the hint
  says which of the two happened.
* :func:`check_send_first`: the student's rule ``fn(stage, pp, helper) -> bool`` says
  which end of each exchange sends first with *blocking* send/recv.  The checker runs
  the 1F1B steady state (every stage: ``send_forward_recv_backward``, then
  ``send_backward_recv_forward``) on ``PP = 2 .. 5`` ranks with that rule, and reads the
  deadlock report when it hangs: which two neighbours chose the same order.
* :func:`check_megatron_p2p_mode`: which mode Megatron's training script ends up with,
  for each schedule and flag; choosing by the hardware (NVLink -> overlapped, otherwise
  batched) is named as a mistake.

Student code never makes a checker raise: exceptions, deadlocks and stubs become failed
cases with a hint.
"""
from __future__ import annotations

import itertools
from typing import Callable

from .. import p2p
from ..launch import LaunchTimeout, WorkerError
from .kit import WAITING_IN, Checking, CheckResult, Mistakes, deadlock_kind

NUMEL = 6  # elements of every message: small, so a round costs milliseconds

# --- hints (tests look for these exact strings) ---------------------------------------

HINT_RECV_FROM_PREVIOUS = (
    "you receive the gradient from the previous stage, the classic wrong peer: it passed at "
    "PP = 2 and deadlocked at PP = 3. The gradient of the activation you send is computed by "
    "the stage that consumes it, the NEXT stage, so in send_forward_recv_backward both "
    "messages go to and come from one neighbour. At PP = 2 the previous rank on "
    "Megatron's ring (it wraps: stage 0's previous is the last stage) is the next rank, "
    "which is why only PP >= 3 shows the mistake."
)
HINT_RECV_FROM_NONE = (
    "you receive the gradient from p2p.prev_rank(), which is None on stage 0, so it failed "
    "at PP = 2 already (recv: peer rank None). The guide's code takes Megatron's previous "
    "rank, which wraps around (p2p.prev_rank(wrap=True)): with it the same mistake passes "
    "at PP = 2 and deadlocks from PP = 3 on. Either way the gradient comes from the NEXT "
    "stage, the rank you send the activation to."
)
HINT_SEND_TO_PREVIOUS = (
    "the activation goes to the wrong stage: the forward pass runs from stage s to stage "
    "s + 1: re-read 'The six helpers' and reconsider which neighbour send_forward_recv_backward "
    "talks to, in both directions."
)
HINT_LAST_STAGE = (
    "the last stage has no next stage: there, return None without communicating, as the "
    "library's helpers do."
)
HINT_RETURNED_SENT = (
    'you returned the activation you sent, not the gradient you received: receive '
    'into a buffer of your own (of the shape and dtype you are given), wait for the '
    'receive, and return what arrived.'
)
HINT_RETURNED_NONE = (
    "a stage that has a next stage returned None: it must return the gradient received from "
    "the next stage (only the last stage returns None)."
)
HINT_EMPTY_BUFFER = (
    "the returned buffer does not hold the gradient: receive into the tensor you return and "
    "wait for the receive (comm.wait_all) before returning it."
)
HINT_USED_LIBRARY = (
    "your function called the library's p2p helper: the point is to write it from the "
    "traced ops of tutorial_lib.comm (isend/irecv, batch_isend_irecv, or send/recv)."
)
HINT_NO_P2P = (
    "no traced send and receive were recorded by your function: use the ops of "
    "tutorial_lib.comm (not torch.distributed directly) with group='pp', and wait for the "
    "handles they return (comm.wait_all), which is when the trace records them."
)
HINT_FIX_DEADLOCK = (
    'the ranks deadlocked: some rank waits for a message its neighbour never sends. In '
    'one steady-state round stage s sends its activation to s + 1 and receives the '
    'gradient from s + 1, while stage s + 1 does the opposite; check that your function '
    'sends and receives exactly once, both with the same neighbour.'
)
HINT_FIX_GENERIC = (
    "re-read 'The six helpers' and 'The guide's wrong peer, caught at PP = 3': reconsider "
    'which stage this one exchanges with in send_forward_recv_backward, what the last '
    'stage does, and when to wait.'
)

HINT_ALL_SEND_FIRST = (
    "deadlock: every stage sends first. On gloo a blocking send returns only once the peer "
    "has posted the matching receive, so both ends of the first exchange are stuck in their "
    "sends. (On NCCL the host would not block, but the two GPU streams would: each runs its "
    "send before its receive, and a send waits for its partner.) The two ends of every "
    "exchange must choose opposite orders."
)
HINT_ALL_RECV_FIRST = (
    "deadlock: every stage receives first, so nobody ever sends. The two ends of every "
    "exchange must choose opposite orders."
)
HINT_NOT_BOOL = "return True (this end sends first) or False (it receives first), nothing else."
HINT_ORDER_GENERIC = (
    'each exchange has two ends, stage s in send_forward_recv_backward and stage s + 1 in '
    'send_backward_recv_forward, and exactly one of them must send first. Re-read '
    "'Deadlocks: why sequential mode needs the parity rule' and reconsider what the two "
    'ends of one link know about themselves.'
)

MODE_ANSWERS = {"sequential": "sequential", "serial": "sequential", "overlapped": "overlapped",
                "overlap": "overlapped", "batched": "batched", "batch": "batched"}
HINT_MODE_FORMAT = "return one of 'sequential', 'overlapped' or 'batched'."
HINT_NVLINK_RULE = (
    'choosing by the hardware (NVLink -> overlapped, otherwise batched) is a common rule '
    'of thumb, and it is not what Megatron does: the hardware is never inspected. Re-read '
    "'What Megatron really does': reconsider which flags the training script derives from "
    'the schedule.'
)
HINT_OVERLAP_WITHOUT_INTERLEAVING = (
    "without the interleaved schedule Megatron's training script turns overlap off "
    'whatever the flags say (the non-interleaved schedule cannot overlap its P2P): '
    'reconsider what that leaves for the batching flag.'
)
HINT_OVERLAP_IS_DEFAULT = (
    "with the interleaved schedule overlap is on by default: the flag is "
    "--no-overlap-p2p-communication (store_false into overlap_p2p_comm), so unless it is given "
    "the mode is overlapped."
)
HINT_FLAG_TURNS_OVERLAP_OFF = (
    '--no-overlap-p2p-communication turns overlap off; reconsider what the training '
    'script then does with the batching flag, which it derives from the overlap flag.'
)
HINT_NEVER_SEQUENTIAL = (
    'Megatron never runs a sequential mode: with batching on it batches, without it '
    '(_p2p_ops) it posts non-blocking isend / irecv and then waits, which is the '
    "overlapped mode. Re-read 'What Megatron really does' for how the batching flag is "
    'set.'
)
HINT_MODE_GENERIC = (
    "re-read 'What Megatron really does': reconsider, in order, what the schedule and the "
    '--no-overlap-p2p-communication flag do to overlap, then what overlap does to '
    'batching.'
)

#: The mistakes of exercise 7.1, in order of preference.
FIX_HINTS = Mistakes(
    HINT_FIX_GENERIC, recv_from_previous=HINT_RECV_FROM_PREVIOUS,
    recv_from_none=HINT_RECV_FROM_NONE, send_to_previous=HINT_SEND_TO_PREVIOUS, last_stage=HINT_LAST_STAGE,
    returned_sent=HINT_RETURNED_SENT, returned_none=HINT_RETURNED_NONE,
    empty_buffer=HINT_EMPTY_BUFFER, used_library=HINT_USED_LIBRARY, no_p2p=HINT_NO_P2P,
    deadlock=HINT_FIX_DEADLOCK)
#: The mistakes of exercise 7.2: a rule that is not a bool, or a deadlock by what it blocked in.
ORDER_HINTS = Mistakes(
    HINT_ORDER_GENERIC, not_bool=HINT_NOT_BOOL, all_send=HINT_ALL_SEND_FIRST,
    all_recv=HINT_ALL_RECV_FIRST, pair=HINT_ORDER_GENERIC)
#: The mistakes of exercise 7.3, in order of preference.
MODE_HINTS = Mistakes(
    HINT_MODE_GENERIC, format=HINT_MODE_FORMAT, nvlink=HINT_NVLINK_RULE,
    sequential=HINT_NEVER_SEQUENTIAL, overlap_without_interleaving=HINT_OVERLAP_WITHOUT_INTERLEAVING,
    overlap_is_default=HINT_OVERLAP_IS_DEFAULT, flag=HINT_FLAG_TURNS_OVERLAP_OFF)


# --- the pipeline in a worker ------------------------------------------------------------------


def _init(ctx) -> int:
    from ..timing import init_pipeline
    return init_pipeline(ctx)


def _summary(value, sent):
    """What a stage's answer was, in a form that crosses process boundaries cheaply."""
    import torch
    if value is None:
        return None
    if value is sent:
        return "the sent tensor"
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    flat = value.detach().float().flatten()
    if flat.numel() == NUMEL and bool((flat == flat[0]).all()):
        return float(flat[0])
    return f"a tensor of shape {tuple(value.shape)} with values {flat[:3].tolist()}..."


def _fix_peer_worker(ctx, fn):
    import torch
    stage = _init(ctx)
    activation = torch.full((NUMEL,), 100.0 + stage)
    gradient = torch.full((NUMEL,), 200.0 + stage)

    def student():
        with ctx.tracer.tags(student=True):
            return _summary(fn(activation, (NUMEL,), torch.float32), activation)

    def library():
        got = p2p.send_backward_recv_forward(gradient, (NUMEL,), mode="batched")
        return None if got is None else float(got[0])

    if stage % 2 == 0:  # the steady-state round of tutorial_lib.timing.p2p_modes, by parity
        grad = student()
        act = library()
    else:
        act = library()
        grad = student()
    return {"grad": grad, "act": act}


def _expected_fix(pp: int) -> list[dict]:
    return [{"grad": None if s == pp - 1 else 200.0 + s + 1, "act": None if s == 0 else 100.0 + s - 1}
            for s in range(pp)]


def _peer_mistakes_in_trace(trace) -> set:
    found = set()
    for e in trace:
        if e.op in ("send", "recv") and e.peer != e.rank + 1:
            found.add("recv_from_previous" if e.op == "recv" else "send_to_previous")
    return found


def _peer_mistakes_in_report(report: dict[int, str]) -> set:
    """Student ops a rank is stuck in whose peer is not the next stage."""
    found = set()
    for rank, text in report.items():
        match = WAITING_IN.search(text)
        if match and "'student': True" in text and int(match.group(2)) != rank + 1:
            found.add("recv_from_previous" if match.group(1) == "recv from" else "send_to_previous")
    return found


def _what_stage_returned(stage: int, pp: int, grad) -> str:
    """What is wrong with stage ``stage``'s answer, said from the answer itself (the
    gradient stage s sends is filled with 200 + s, the activation with 100 + s), never the
    value the stage should have returned."""
    said = f"stage {stage} of {pp} returned {grad!r}"
    if stage == pp - 1:
        return f"{said}, but the last stage has no next stage to hear from"
    if grad is None:
        return f"{said}, but it is not the last stage: a gradient comes back to it"
    if grad == "the sent tensor" or grad == 100.0 + stage:
        return f"{said}: that is the activation it sent, not what it received"
    if isinstance(grad, float) and float(grad).is_integer() and 200 <= grad < 200 + pp:
        return f"{said}: the gradient stage {int(grad) - 200} sent, not the one meant for it"
    if isinstance(grad, float) and float(grad).is_integer() and 100 <= grad < 100 + pp:
        return f"{said}: the activation stage {int(grad) - 100} sent, not a gradient"
    return f"{said}, which no stage sent it"


FIX_PIPELINES = (2, 3, 4)
"""The pipeline sizes exercise 7.1 runs, in order: PP = 3 is the first to tell the next stage
from Megatron's wrapping previous one."""


def check_send_forward_recv_backward(fn: Callable, timeout: float = 6.0) -> CheckResult:
    """Launch ``fn(tensor, shape, dtype)`` as stage s's half of a steady-state round on PP = 2, 3, 4.

    Stage ``s`` sends activations filled with ``100 + s`` and gradients with
    ``200 + s``, so the gradient a stage receives names the stage it came from.
    After a deadlock or an unfilled stub the larger pipelines are skipped.
    """
    check = Checking("Exercise 7.1: send_forward_recv_backward", FIX_HINTS)
    for pp in FIX_PIPELINES:
        expected = _expected_fix(pp)
        case, got = check.run_on_ranks(
            f"PP={pp}", _fix_peer_worker, pp, args=(fn,), timeout=timeout, expected=expected,
            compare=lambda got, want: got[0] == want,
            unpack=lambda out: (out.results, out.trace.filter(student=True)))
        if check.stub:
            break
        if isinstance(got, LaunchTimeout):
            check.shows(_peer_mistakes_in_report(got.report) or {"deadlock"})
            break
        if isinstance(got, WorkerError):
            summary = got.summary
            if "peer rank None" in summary:
                if got.rank == pp - 1:
                    check.shows({"last_stage"})
                else:
                    check.shows({"recv_from_none"} if "recv:" in summary else {"send_to_previous"})
            else:
                check.shows()
            continue
        if isinstance(got, BaseException):  # the launcher itself failed
            check.shows()
            continue
        results, trace = got
        if case.passed:
            if any("p2p_op" in e.tags for e in trace):
                case.passed, case.detail = False, "the values are right, but your code called p2p's helper"
                check.shows({"used_library"})
            elif not trace.filter(op="send").events or not trace.filter(op="recv").events:
                case.passed, case.detail = False, "the values are right, but no traced send and receive were recorded"
                check.shows({"no_p2p"})
            continue
        bad = next(s for s in range(pp) if results[s] != expected[s])
        case.detail = (f"stage {bad} of {pp} returned the gradient meant for it"
                       if results[bad]["grad"] == expected[bad]["grad"]
                       else _what_stage_returned(bad, pp, results[bad]["grad"]))
        if results[bad]["act"] != expected[bad]["act"]:
            case.detail += "; its neighbour's send_backward_recv_forward did not get its activation"
        mistakes = _peer_mistakes_in_trace(trace)
        grads = [r["grad"] for r in results]
        if any(g == "the sent tensor" or (isinstance(g, float) and g == 100.0 + s)
               for s, g in enumerate(grads)):
            mistakes.add("returned_sent")
        if any(g is None for g in grads[:-1]):
            mistakes.add("returned_none")
        if grads[-1] is not None:
            mistakes.add("last_stage")
        if any(isinstance(g, str) and g.startswith("a tensor") for g in grads):
            mistakes.add("empty_buffer")
        check.shows(mistakes)
    return check.verdict()


# --- exercise 7.2: who sends first? ---------------------------------------------------------------

ORDER_PIPELINES = (2, 3, 4, 5)
HELPERS = ("send_forward_recv_backward", "send_backward_recv_forward")


def _blocking_exchange(ctx, rule, helper: str, tensor, peer: int):
    """One exchange with blocking send/recv, in the order ``rule`` says; the received tensor."""
    import torch

    from .. import comm
    stage, pp = _init_stage(), ctx.world_size
    received = torch.empty_like(tensor)
    with ctx.tracer.tags(p2p_op=helper):
        if rule(stage, pp, helper):
            comm.send(tensor, peer, group="pp")
            comm.recv(received, peer, group="pp")
        else:
            comm.recv(received, peer, group="pp")
            comm.send(tensor, peer, group="pp")
    return float(received[0])


def _init_stage() -> int:
    from .. import parallel_state
    return parallel_state.get_rank_in("pp")


def _order_worker(ctx, rule):
    """The 1F1B steady state as Megatron runs it: every stage, forward exchange first."""
    import torch
    stage = _init(ctx)
    pp = ctx.world_size
    answers = {h: rule(stage, pp, h) for h in HELPERS}
    bad = {h: a for h, a in answers.items() if not isinstance(a, bool)}
    if bad:
        raise TypeError(f"the rule returned {bad!r} at stage {stage}; return True or False")
    grad = act = None
    if stage < pp - 1:
        grad = _blocking_exchange(ctx, rule, HELPERS[0], torch.full((NUMEL,), 100.0 + stage), stage + 1)
    if stage > 0:
        act = _blocking_exchange(ctx, rule, HELPERS[1], torch.full((NUMEL,), 200.0 + stage), stage - 1)
    return {"grad": grad, "act": act}


def _deadlocked_pairs(report: dict[int, str]) -> list[tuple[int, int, str]]:
    """Neighbours stuck on each other in the same op: ``(a, b, 'send' or 'recv')``."""
    waits = {}
    for rank, text in report.items():
        match = WAITING_IN.search(text)
        if match:
            waits[rank] = ("send" if match.group(1) == "send to" else "recv", int(match.group(2)))
    pairs = []
    for a, (op, b) in sorted(waits.items()):
        if a < b and waits.get(b) == (op, a):
            pairs.append((a, b, op))
    return pairs


def check_send_first(fn: Callable, timeout: float = 6.0) -> CheckResult:
    """Run the blocking 1F1B steady state with ``fn(stage, pp, helper) -> bool`` on PP = 2 .. 5."""
    check = Checking("Exercise 7.2: send_first", ORDER_HINTS)
    for pp in ORDER_PIPELINES:
        case, got = check.run_on_ranks(f"PP={pp}", _order_worker, pp, args=(fn,), timeout=timeout,
                                       expected=_expected_fix(pp), unpack=lambda out: out.results)
        if check.stub:
            break
        if isinstance(got, WorkerError) and got.summary.startswith("TypeError: the rule returned"):
            case.detail = f"raised {got.summary}"
            check.shows({"not_bool"})
            break
        if isinstance(got, LaunchTimeout):
            kind = deadlock_kind(got.report)
            pairs = _deadlocked_pairs(got.report)
            if pairs:
                a, b, op = pairs[0]
                verb = "send" if op == "send" else "receive"
                case.detail += (f". Stages {a} and {b} both {verb} first in their exchange: "
                                f"rule({a}, {pp}, '{HELPERS[0]}') == rule({b}, {pp}, '{HELPERS[1]}')")
            check.shows({kind if kind in ("all_send", "all_recv") else "pair"})
            break
        check.shows()
    result = check.verdict()
    if result is None:  # passed, under nbgrader (kit.finish)
        return None
    passed_small = [c.name for c in result.cases if c.passed]
    if not result.passed and passed_small and not check.stub:
        result.hint += (f" ({', '.join(passed_small)} passed: with fewer stages there are fewer links, "
                        "and a rule can get every one of them right by accident.)")
    return result


# --- exercise 7.3: which mode does Megatron run? ----------------------------------------------------


def megatron_training_mode(interleaved: bool, no_overlap_flag: bool) -> str:
    """The reference: what Megatron's training script ends up with (the NVLink input is ignored)."""
    overlap_p2p_comm = (not no_overlap_flag) and interleaved
    return p2p.mode_from_megatron_flags(overlap_p2p_comm)


def normalize_mode(answer) -> str | None:
    if not isinstance(answer, str):
        return None
    return MODE_ANSWERS.get(answer.strip().lower())


def check_megatron_p2p_mode(fn: Callable) -> CheckResult:
    """Check ``fn(interleaved, no_overlap_flag, nvlink) -> mode`` on all 8 combinations."""
    check = Checking("Exercise 7.3: megatron_p2p_mode", MODE_HINTS)
    for interleaved, no_overlap_flag, nvlink in itertools.product((False, True), repeat=3):
        want = megatron_training_mode(interleaved, no_overlap_flag)
        name = f"interleaved={interleaved}, no_overlap_flag={no_overlap_flag}, nvlink={nvlink}"
        case, got = check.run(name, lambda i=interleaved, f=no_overlap_flag, n=nvlink: fn(i, f, n),
                              want, compare=lambda got, want: normalize_mode(got) == want)
        if check.stub:
            break
        check.judge(case, got, normalize_mode,
                    lambda mode: _mode_mistakes(mode, interleaved, no_overlap_flag, nvlink))
    return check.verdict()


def _mode_mistakes(mode: str, interleaved: bool, no_overlap_flag: bool, nvlink: bool) -> set:
    """The mistakes a wrong mode shows for these inputs."""
    mistakes = set()
    if mode == ("overlapped" if nvlink else "batched"):
        mistakes.add("nvlink")
    if mode == "sequential":
        mistakes.add("sequential")
    if mode == "overlapped" and not interleaved:
        mistakes.add("overlap_without_interleaving")
    if mode == "batched" and interleaved and not no_overlap_flag:
        mistakes.add("overlap_is_default")
    if mode == "overlapped" and no_overlap_flag:
        mistakes.add("flag")
    return mistakes


__all__ = ["check_send_forward_recv_backward", "check_send_first", "check_megatron_p2p_mode",
           "megatron_training_mode", "normalize_mode"]
