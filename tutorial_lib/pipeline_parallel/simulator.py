"""The lockstep simulator: every rank's list played at once, on paper.

:func:`simulate` executes every rank's list at once.  Sends are *buffered*: a send
never waits for its receiver (an ``isend`` into a buffer, the way a batched or
overlapped op lets the partner's send and receive proceed together); a receive
blocks until the matching send has happened.  Messages are matched in order per
``(sender, receiver, payload)``.  If no rank can move, that is a deadlock and
:class:`DeadlockError` says what each rank is waiting for; :class:`MismatchError` is
a message that arrives where it does not belong, :class:`OrderError` a rank that runs
a compute before one it needs.  :func:`makespan`, :func:`bubble_fraction` and
:func:`idle_time` read the timelines it returns; the formulas they are checked against
are in :mod:`~tutorial_lib.pipeline_parallel.formulas`.  No torch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from .actions import (PAYLOAD, SEND_KINDS, Action, num_model_stages, split_backwards,
                      stage_holder)

# --- the simulator -------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedAction:
    """An action with the time it started and ended in a simulated step."""

    rank: int
    """The pipeline rank that ran it."""

    action: Action
    """What it ran."""

    start: float
    """When the rank reached it (its previous action ended)."""

    end: float
    """When it finished; for a receive, when the message was there (``end - start`` is time blocked)."""


class SimulationError(RuntimeError):
    """The schedules cannot run as written."""


class MismatchError(SimulationError):
    """A receive matched a send carrying something else, or a send was never received."""


class DeadlockError(SimulationError):
    """No rank can move: ``waiting`` maps each stuck rank to the receive it blocks on."""

    def __init__(self, message: str, waiting: dict[int, Action], partial: dict[int, list[TimedAction]]):
        super().__init__(message)
        self.waiting = waiting
        """Rank -> the receive it is blocked on."""
        self.partial = partial
        """What each rank completed before the deadlock (drawable like a full timeline)."""


class OrderError(SimulationError):
    """A rank's own list runs a compute before one it depends on: a backward before its
    forward, a W before its B, or a stage before the stage on the same rank that feeds it."""


def _check_match(src: int, dst: int, sent: Action, recv: Action, pp: int, last_stage: int) -> None:
    placement = sent.placement
    src_stage = sent.model_stage(src, pp)
    copy = sent.chunk if placement == "dual" else 0
    expected = {"activation": src_stage + 1, "grad": src_stage - 1, "labels": last_stage}[PAYLOAD[sent.kind]]
    want = stage_holder(placement, expected, pp, copy) if 0 <= expected <= last_stage else None
    if sent.microbatch != recv.microbatch or (dst, recv.chunk) != want:
        raise MismatchError(
            f"rank {dst}'s {recv.kind} (microbatch {recv.microbatch}, model stage "
            f"{recv.model_stage(dst, pp)}) received rank {src}'s {sent.kind} (microbatch "
            f"{sent.microbatch}, model stage {src_stage}): the message belongs to microbatch "
            f"{sent.microbatch} at model stage {expected}; messages are matched in order per "
            f"(sender, receiver, payload)")


def _placement_of(schedules: dict[int, list[Action]]) -> tuple[str, int]:
    """The one placement the lists share, and the model stages of a copy."""
    placements = {a.placement for acts in schedules.values() for a in acts}
    if len(placements) > 1:
        raise ValueError(f"the ranks' actions mix placements {sorted(placements)}: one schedule "
                         f"places its stages one way")
    placement = placements.pop() if placements else "loop"
    chunks = 1 + max((a.chunk for acts in schedules.values() for a in acts), default=0)
    return placement, num_model_stages(placement, len(schedules), chunks)


def _local_prerequisites(a: Action, rank: int, pp: int, placement: str,
                         num_stages: int) -> list[tuple[str, int, int]]:
    """The computes on ``rank`` that must come before compute ``a``, as ``(kind,
    microbatch, chunk)``.

    A backward needs its forward, a W its B; where the neighbouring stage lives on the
    same rank (the V's turn) a forward needs that stage's forward and a backward that
    stage's backward, handed over without a message."""
    if a.kind == "weight":
        return [("backward", a.microbatch, a.chunk)]
    needs = [("forward", a.microbatch, a.chunk)] if a.kind == "backward" else []
    stage = a.model_stage(rank, pp)
    neighbour = stage - 1 if a.kind == "forward" else stage + 1
    if 0 <= neighbour < num_stages:
        holder, chunk = stage_holder(placement, neighbour, pp, a.chunk if placement == "dual" else 0)
        if holder == rank:
            needs.append((a.kind, a.microbatch, chunk))
    return needs


def _check_pairs(rank: int, actions: list[Action]) -> None:
    """An overlapped forward is directly followed by an overlapped backward, and vice versa."""
    for i, a in enumerate(actions):
        if a.overlapped and a.kind == "forward":
            after = actions[i + 1] if i + 1 < len(actions) else None
            if after is None or after.kind != "backward" or not after.overlapped:
                raise OrderError(f"rank {rank}'s overlapped {a.label} must be directly followed "
                                 f"by the overlapped backward it runs with")
        if a.overlapped and a.kind == "backward":
            before = actions[i - 1] if i else None
            if before is None or before.kind != "forward" or not before.overlapped:
                raise OrderError(f"rank {rank}'s overlapped {a.label} must directly follow "
                                 f"the overlapped forward it runs with")


def compute_costs(actions: list[Action], forward_cost: float = 1.0, backward_cost: float = 2.0,
                  weight_cost: float | None = None) -> list[float]:
    """Each compute's cost in one rank's list (0 for a message): F ``forward_cost``; a
    whole backward ``backward_cost``; a split one B ``backward_cost - weight_cost`` and
    W ``weight_cost`` (default: half the backward, see :data:`COSTS`)."""
    w = backward_cost / 2 if weight_cost is None else weight_cost
    split = split_backwards(actions)
    out = []
    for a in actions:
        if a.kind == "forward":
            out.append(forward_cost)
        elif a.kind == "backward":
            out.append(backward_cost - w if (a.microbatch, a.chunk) in split else backward_cost)
        elif a.kind == "weight":
            out.append(w)
        else:
            out.append(0)
    return out


COSTS = {"F": 1, "B": 2, "W": 1}
"""The course's costs of one chunk's compute: forward 1, whole backward 2, of which W
(the weight gradient) 1, so a split backward's B (input gradient) costs 1 too.  A
linear layer's backward is two matmuls of the forward's size: ``dX = dY W^T`` (B) and
``dW = X^T dY`` (W); attention's score matmuls have no weights, so real W's are a bit
cheaper."""


def simulate(schedules: dict[int, list[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0,
             p2p_cost: float = 0.0, weight_cost: float | None = None,
             overlapped_cost: float | None = None) -> dict[int, list[TimedAction]]:
    """Run every rank's list at once; return each action's start and end, per rank.

    Every rank starts at time 0 and runs its actions in order.  A forward takes
    ``forward_cost``, a backward ``backward_cost`` (per chunk: divide by ``V`` to
    model the same model cut finer); a backward split into B and W takes
    ``backward_cost - weight_cost`` and its W ``weight_cost`` (:func:`compute_costs`;
    default half the backward).  An overlapped pair (:attr:`Action.overlapped`,
    DualPipe's ``F&B``) takes ``overlapped_cost`` in all (default: the sum of its two
    halves), shared between the halves in proportion to their costs.  A send occupies
    its rank for ``p2p_cost`` and never waits for the receiver (buffered, see the module
    docstring); a receive ends when the matching send has ended, or at once if it
    already has.  Sends and receives are matched in order per ``(sender, receiver,
    payload)``; a match must agree on the microbatch and on adjacent model stages (in
    the lists' placement, :data:`~.actions.PLACEMENTS`), or :class:`MismatchError`.  A compute
    that comes before one it depends on in its own rank's list (a B before its F, a W
    before its B, the V's turn taken out of order): :class:`OrderError`.  When no rank
    can move, :class:`DeadlockError`.  The result depends only on the dependencies, not
    on the order ranks are visited.
    """
    pp = len(schedules)
    if sorted(schedules) != list(range(pp)):
        raise ValueError(f"schedules must be keyed by the pipeline ranks 0..{pp - 1}, "
                         f"got {sorted(schedules)}")
    for r, actions in schedules.items():
        for a in actions:
            if not a.is_compute and (a.peer == r or not 0 <= a.peer < pp):
                raise ValueError(f"rank {r}'s {a.label}: the peer must be another rank in 0..{pp - 1}")
        _check_pairs(r, actions)
    placement, num_stages = _placement_of(schedules)
    last_stage = num_stages - 1
    costs = {r: compute_costs(actions, forward_cost, backward_cost, weight_cost)
             for r, actions in schedules.items()}
    sent: dict[tuple, list[tuple[Action, float]]] = defaultdict(list)  # (src, dst, payload) -> sends
    received: dict[tuple, int] = defaultdict(int)  # (src, dst, payload) -> receives matched so far
    clock = {r: 0 for r in schedules}  # exact with int/Fraction costs
    done: dict[int, list[TimedAction]] = {r: [] for r in schedules}
    computed: dict[int, set] = {r: set() for r in schedules}  # (kind, microbatch, chunk) run so far

    moved = True
    while moved:  # sweep over the ranks, each running until it blocks, until nobody moves
        moved = False
        for r, actions in schedules.items():
            while len(done[r]) < len(actions):
                i = len(done[r])
                a = actions[i]
                start = clock[r]
                if a.is_compute:
                    for need in _local_prerequisites(a, r, pp, placement, num_stages):
                        if need not in computed[r]:
                            raise OrderError(
                                f"rank {r} runs {a.label} (action {i}) before "
                                f"{Action(need[0], need[1], need[2], placement=placement).label}, "
                                f"which it needs and which this rank runs")
                    cost = costs[r][i]
                    if a.overlapped and overlapped_cost is not None:
                        pair = (costs[r][i] + costs[r][i + 1] if a.kind == "forward"
                                else costs[r][i - 1] + costs[r][i])
                        exact = all(isinstance(x, (int, Fraction)) for x in (overlapped_cost, pair))
                        ratio = (Fraction(overlapped_cost) / pair if exact else overlapped_cost / pair) \
                            if pair else 0
                        cost = cost * ratio
                    end = start + cost
                    computed[r].add((a.kind, a.microbatch, a.chunk))
                elif a.kind in SEND_KINDS:
                    end = start + p2p_cost
                    sent[(r, a.peer, PAYLOAD[a.kind])].append((a, end))
                else:
                    key = (a.peer, r, PAYLOAD[a.kind])
                    if received[key] == len(sent[key]):
                        break  # blocked: the matching send has not happened yet
                    message, sent_at = sent[key][received[key]]
                    _check_match(a.peer, r, message, a, pp, last_stage)
                    received[key] += 1
                    end = max(start, sent_at)
                done[r].append(TimedAction(r, a, start, end))
                clock[r] = end
                moved = True

    waiting = {r: acts[len(done[r])] for r, acts in schedules.items() if len(done[r]) < len(acts)}
    if waiting:
        raise DeadlockError(_deadlock_report(schedules, done, waiting, sent, received), waiting, done)
    for (src, dst, payload), messages in sent.items():
        if received[(src, dst, payload)] < len(messages):
            left = messages[received[(src, dst, payload)]][0]
            raise MismatchError(f"rank {src} sent {len(messages) - received[(src, dst, payload)]} "
                                f"{payload} message(s) to rank {dst} that were never received, "
                                f"the first for microbatch {left.microbatch}")
    return done


def _deadlock_report(schedules, done, waiting, sent, received) -> str:
    lines = ["deadlock: every unfinished rank is blocked in a receive whose send never comes"]
    for r in schedules:
        if r not in waiting:
            lines.append(f"  rank {r}: finished all {len(schedules[r])} actions")
            continue
        a = waiting[r]
        key = (a.peer, r, PAYLOAD[a.kind])
        peer_state = (f"rank {a.peer} is itself blocked at {waiting[a.peer].label}" if a.peer in waiting
                      else f"rank {a.peer} has finished")
        lines.append(f"  rank {r}: blocked at action {len(done[r])} ({a.label}): waits for "
                     f"{PAYLOAD[a.kind]} message #{received[key]} from rank {a.peer}, which has sent "
                     f"{len(sent[key])} to rank {r}; {peer_state}")
    return "\n".join(lines)


# --- what the timelines say ------------------------------------------------------------------


def makespan(timelines: dict[int, list[TimedAction]]) -> float:
    """The step's length: the last end over all ranks (every rank starts at 0)."""
    return max((t.end for ts in timelines.values() for t in ts), default=0)


def bubble_fraction(timelines: dict[int, list[TimedAction]], rank: int | None = None) -> float:
    """The idle fraction of the step: ``1 - compute time / (ranks * makespan)``.

    Idle is everything that is not a forward or backward: blocked receives and
    sends count as idle.  ``rank`` restricts it to one rank.
    """
    total = makespan(timelines)
    ranks = list(timelines) if rank is None else [rank]
    busy = sum(t.end - t.start for r in ranks for t in timelines[r] if t.action.is_compute)
    return 1 - busy / (len(ranks) * total) if total > 0 else 0.0


def idle_time(timelines: dict[int, list[TimedAction]], rank: int | None = None) -> float:
    """A rank's idle time in the step: the makespan minus its compute (forwards, B's and
    W's).  ``rank=None``: the largest over the ranks, the idle time of the rank that
    computes least, the step's *bubble* in the sense of the DualPipe table
    (:func:`~.formulas.expected_bubble_time`).  In every schedule here each rank computes
    as much, so every rank idles that long."""
    total = makespan(timelines)
    ranks = list(timelines) if rank is None else [rank]
    return max(total - sum(t.end - t.start for t in timelines[r] if t.action.is_compute)
               for r in ranks)


def planned_spans(timelines: dict[int, list[TimedAction]], lane: str = "planned",
                  p2p: bool = False) -> list[tuple]:
    """Bars for :func:`tutorial_lib.viz.timeline.timeline_from_spans`: compute, and sends/receives if ``p2p``.

    Each is ``(rank, start, end, label, kind, lane)``; kind ``compute`` or ``pp``.  For the
    schedule's own colours (forwards and backwards apart, a shade per chunk, the bubble
    marked) use :func:`tutorial_lib.viz.timeline.plan_spans`, as chapter 6 does.
    """
    return [(t.rank, t.start, t.end, t.action.label, "compute" if t.action.is_compute else "pp", lane)
            for ts in timelines.values() for t in ts if p2p or t.action.is_compute]
