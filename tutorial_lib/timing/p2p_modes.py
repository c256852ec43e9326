"""Timing the three pipeline P2P modes on this machine: one steady-state round at a
time.

In the steady state of 1F1B every stage, once per microbatch, calls
``send_forward_recv_backward`` (activation out to the next stage, its gradient back
from it) and ``send_backward_recv_forward`` (gradient out to the previous stage, the
next activation back from it).  Stage ``s``'s first call meets stage ``s + 1``'s
second call: each link between neighbours carries one activation forward and one
gradient backward, at the same time.

:func:`steady_state_round` does exactly that once, with no compute in between.  The
calls are ordered by stage parity (even stages: forward exchange first; odd stages:
backward exchange first), so that in the first phase the links (0, 1), (2, 3), ...
exchange at once and in the second phase (1, 2), (3, 4), ...: no link waits for
another, and every link is used once per round in both directions.

:func:`measure_p2p_modes` launches ``pp`` gloo ranks and times that round for every
mode and message size, the sizes and the modes taking turns at every repetition so that
they are measured side by side under the same load.  Each round's time comes from the
trace: from the moment the last rank started its round to the moment the last rank
finished it (:func:`tutorial_lib.timing.runs.rounds_by_size`, which times chapter 2's
collectives too).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .. import p2p, parallel_state
from ..config import ParallelConfig
from ..devices import resolve_device
from .runs import check_timing_args, rounds_by_size, timed_launch

__all__ = ["P2P_SIZES", "ACTIVATION", "GRADIENT", "steady_state_round", "expected_round",
           "init_pipeline", "ModeTiming", "timings_from_trace", "measure_p2p_modes",
           "ratios_to"]

#: Message sizes (bytes of one activation, float32) from a few bytes to 16 MiB: from the
#: latency-bound end to far into the bandwidth-bound one on a CPU (crossover ~0.1-1
#: MiB).
P2P_SIZES = (4, 64, 1024, 16 * 1024, 256 * 1024, 1024 ** 2, 4 * 1024 ** 2,
                 16 * 1024 ** 2)

ACTIVATION, GRADIENT = 100.0, 200.0
"""Stage ``s`` sends activations filled with ``100 + s``, gradients with ``200 + s``."""


def steady_state_round(mode: str, numel: int,
                       wrong_recv_backward_peer: bool = False, device=None) -> dict:
    """One steady-state round on this stage in ``mode``: both exchanges, ordered by
    parity.

    Sends ``numel`` float32 values each way.  Returns ``{"grad": g, "act": a}``: the
    first value of the gradient received from the next stage and of the activation
    received from the previous one (``None`` where the stage has no such neighbour).
    ``device``: where the tensors live (``ctx.device``; ``None``: torch's default device).
    """
    stage = parallel_state.get_rank_in("pp")
    activation = torch.full((numel,), ACTIVATION + stage, device=resolve_device(device))
    gradient = torch.full((numel,), GRADIENT + stage, device=resolve_device(device))

    def forward_exchange():
        return p2p.send_forward_recv_backward(
            activation, (numel,), mode=mode,
            wrong_recv_backward_peer=wrong_recv_backward_peer)

    def backward_exchange():
        return p2p.send_backward_recv_forward(gradient, (numel,), mode=mode)

    if stage % 2 == 0:
        grad, act = forward_exchange(), backward_exchange()
    else:
        act = backward_exchange()
        grad = forward_exchange()
    return {"grad": None if grad is None else grad[0].item(),
            "act": None if act is None else act[0].item()}


def expected_round(stage: int, pp: int) -> dict:
    """What :func:`steady_state_round` returns on ``stage`` when every peer is right."""
    return {"grad": None if stage == pp - 1 else GRADIENT + stage + 1,
            "act": None if stage == 0 else ACTIVATION + stage - 1}


def init_pipeline(ctx) -> int:
    """Build the groups with every rank a pipeline stage (``PP = world size``); return
    the stage."""
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, pipeline_model_parallel_size=ctx.world_size))
    return parallel_state.get_rank_in("pp")


def _timing_worker(ctx, modes: Sequence[str], sizes: Sequence[int], repeats: int,
                   warmup: int) -> list[str]:
    """In every rank: ``warmup + repeats`` passes over every size, every mode in turn,
    a barrier before each round.

    The sizes and the modes take turns inside each pass, so that what disturbs the
    machine for a while (the other ranks still starting up, another program) hits every
    size and every mode alike instead of the first size measured."""
    stage = init_pipeline(ctx)
    expected = expected_round(stage, ctx.world_size)
    wrong = []
    for iteration in range(warmup + repeats):
        for size in sizes:
            numel = max(1, size // 4)
            # each pass starts with another mode: none is always first after a barrier
            for k in range(len(modes)):
                mode = modes[(iteration + k) % len(modes)]
                dist.barrier()  # untraced: every round starts at (nearly) one moment
                with ctx.tracer.tags(measured_mode=mode, size=size, iteration=iteration,
                                     warmup=iteration < warmup):
                    got = steady_state_round(mode, numel, device=ctx.device)
                if got != expected:
                    wrong.append(f"{mode}, {size} B, iteration {iteration}: got {got}, "
                                 f"expected {expected}")
    return wrong


@dataclass(frozen=True)
class ModeTiming:
    """One mode on one message size: the median time of one steady-state round."""

    mode: str
    """``sequential``, ``overlapped`` or ``batched``."""
    nbytes: int
    """Bytes of one message (one activation; each gradient is as large)."""
    pp: int
    """Pipeline stages (ranks)."""
    seconds: float
    """Median over the repetitions of one round's time (last start to last end)."""
    bytes_sent: int
    """Bytes all stages sent in one round, from the trace: ``2 (PP - 1) nbytes``."""
    messages: int
    """Sends in one round, all stages together: ``2 (PP - 1)``."""
    quartiles: tuple[float, float] = (0.0, 0.0)
    """25th and 75th percentiles of the round times: how much the repetitions
    scattered."""


def timings_from_trace(trace, pp: int) -> list[ModeTiming]:
    """One :class:`ModeTiming` per (mode, size) of a :func:`measure_p2p_modes` trace.

    The rounds come from :func:`tutorial_lib.timing.runs.rounds_by_size`.  A round's time is
    ``max(t_end) - max(first t_start per rank)``: from the moment the last rank began
    its round (before that, the others only wait for it) until the last rank is done.
    The median over the non-warm-up repetitions is kept.
    """
    out = []
    rounds = rounds_by_size(trace, "measured_mode")
    for mode, size in sorted(rounds, key=lambda key: (key[1], key[0])):
        timed = rounds[mode, size]
        sent = set()
        for events in timed.events:
            sends = [e for e in events if e.op == "send"]
            sent.add((sum(e.bytes for e in sends), len(sends)))
        if len(sent) != 1:
            raise RuntimeError(f"{mode} at {size} B sent different bytes in different "
                               f"rounds: {sorted(sent)}")
        (nbytes_sent, messages), = sent
        times = timed.seconds
        q1, _, q3 = (statistics.quantiles(times, n=4) if len(times) > 1
                     else (times[0],) * 3)
        out.append(ModeTiming(mode, max(4, size - size % 4), pp, timed.median_seconds,
                              nbytes_sent, messages, (q1, q3)))
    return out


def measure_p2p_modes(sizes: Sequence[int] = P2P_SIZES, pp: int = 4,
                      modes: Sequence[str] = p2p.MODES, repeats: int = 10,
                      warmup: int = 2,
                      timeout: float = 120.0):
    """Time one steady-state round in each mode for each message size, on ``pp`` gloo
    ranks.

    Returns ``(timings, run)``: a list of :class:`ModeTiming` (sorted by size, then
    mode) and the :class:`~tutorial_lib.launch.LaunchResult` whose trace they came
    from.  Raises ``AssertionError`` if any round received a wrong value.
    """
    for mode in modes:
        p2p._check_mode(mode)
    check_timing_args("pp", pp, 2, "a pipeline needs two stages to talk", repeats, warmup,
                      sizes)
    sizes = [int(s) for s in sizes]
    run = timed_launch(_timing_worker, pp, (tuple(modes), sizes, int(repeats), int(warmup)),
                       timeout, print_output=False)
    wrong = [line for rank_lines in run.results for line in rank_lines]
    assert not wrong, "rounds received wrong values:\n" + "\n".join(wrong[:5])
    return timings_from_trace(run.trace, pp), run


def ratios_to(timings: Sequence[ModeTiming],
              reference: str = "batched") -> dict[tuple, float]:
    """``{(mode, nbytes, pp): seconds / seconds of reference}`` for every timing."""
    ref = {(t.nbytes, t.pp): t.seconds for t in timings if t.mode == reference}
    return {(t.mode, t.nbytes, t.pp): t.seconds / ref[(t.nbytes, t.pp)]
            for t in timings if (t.nbytes, t.pp) in ref}
