"""Closed forms of the schedules: the bubble, the activations in flight, the parameter copies.

:func:`expected_bubble` is chapter 6's ``(PP - 1) / (V M + PP - 1)``;
:func:`expected_bubble_time` holds the rows of the DualPipe README's table (chapter 11);
:func:`peak_activations_in_flight` walks one rank's list and
:func:`expected_peak_activations` gives the same count as a formula per schedule
(chapter 10's memory model reads both).  Each is checked against the simulator
(:mod:`~tutorial_lib.pipeline_parallel.simulator`).  No torch.
"""
from __future__ import annotations

from ..config import ConfigError
from .actions import (ALL_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, Action, check_pipeline,
                      check_positive, split_backwards)
from .schedules import num_warmup_microbatches

def expected_bubble(pp: int, m: int, v: int = 1) -> float:
    """The closed form: ``(PP - 1) / (V * M + PP - 1)``; for ``V = 1``: ``(PP - 1) / (M + PP - 1)``.

    Each rank computes ``M (f + b)`` and waits ``(PP - 1)(f + b)``: the fill at the
    start and the drain at the end.  Interleaving cuts each wait to one chunk's worth,
    ``(PP - 1)(f + b) / V`` (Narayanan et al., 2021).  :func:`~.simulator.simulate` reproduces it
    exactly, on every rank, for all three schedules whenever ``p2p_cost = 0`` and
    every stage costs the same: the ratio ``backward_cost / forward_cost`` does not
    matter (``b = 2f`` is only the usual estimate), because the fill and the drain
    each cost ``(PP - 1)`` forwards plus ``(PP - 1)`` backwards.  A positive
    ``p2p_cost`` adds to the bubble; the formula then is a lower bound.
    """
    for name, value in (("pp", pp), ("m", m), ("v", v)):
        check_positive(name, value, "pipeline stages, microbatches and chunks are counted from 1")
    return (pp - 1) / (v * m + pp - 1)


def expected_bubble_time(name: str, pp_size: int, forward_cost: float = 1.0,
                         backward_cost: float = 2.0, weight_cost: float | None = None,
                         overlapped_cost: float | None = None) -> float:
    """The bubble (:func:`~.simulator.idle_time`) as a formula of the chunk costs ``F``, ``B`` (the
    whole backward), ``W`` (its weight part; default ``B / 2``) and ``F&B``
    (``overlapped_cost``, default ``F + B``).

    The rows of deepseek-ai/DualPipe's README table, with its ``PP`` the number of
    pipeline *stages* (``pp_size`` ranks hold ``pp_size`` stages, ``2 pp_size`` for
    the V's; DualPipe holds two copies of ``pp_size`` stages):

    ==================  ====================================  ==========================
    ``gpipe``, ``1f1b``  ``(PP - 1)(F + B)``                  any costs
    ``interleaved``      ``(PP - 1)(F + B)``, F, B per chunk  any costs
    ``zb-h1``            ``(PP - 1)(F + B - 2W)``             ``M >= PP``, ``W <= F``,
                                                               ``W <= B - W``
    ``zbv``              ``(PP - 1)(F + B - 2W)``, ``PP``     ``M >= 2 PP - 1``,
                         ranks                                 ``F = B - W = W``
    ``dualpipev``        ``(PP/2 - 1)(F&B + B - 3W)``,        ``M >= 2 PP``,
                         ``PP = 2 pp_size`` stages             ``F = B - W``, ``W <= F``
    ``dualpipe``         ``(PP/2 - 1)(F&B + B - 3W)``         the same
    ==================  ====================================  ==========================

    Each holds exactly under :func:`~.simulator.simulate` (free messages) where its last column
    says; outside, the schedule's fixed order no longer fits the costs and the
    simulated bubble differs (the DualPipe figure draws ``F`` and ``B - W`` equal).
    The ZBV row is not in the DualPipe table: it is ZB-H1's expression over ``PP``
    ranks of two chunks each, checked by simulation where ZBV's paper draws it (all
    three costs equal: ``(PP - 1) F``, a rate of ``(PP - 1) / 6M`` of the step, where
    sail-sg's README rounds ZBV's rate to 0).  The ZB paper's ``(p - 1)(T_F + T_B - T_W)``
    is the ZB-H1 row with its ``T_B`` the backward's input part, ``B - W`` here.
    ``F&B`` below ``F + B`` models communication hidden behind the other half's compute;
    with overlapped pairs the ranks compute unequally, and the formula is the largest
    idle time (:func:`~.simulator.idle_time`), the turning rank's, which runs the most
    pairs.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    check_positive("pp_size", pp_size, "a pipeline has at least one stage")
    f, b = forward_cost, backward_cost
    w = b / 2 if weight_cost is None else weight_cost
    fb = f + b if overlapped_cost is None else overlapped_cost
    if name in ("gpipe", "1f1b", "interleaved"):
        return (pp_size - 1) * (f + b)
    if name in ("zb-h1", "zbv"):
        return (pp_size - 1) * (f + b - 2 * w)
    if name == "dualpipe" and pp_size % 2:
        raise ConfigError("dualpipe", f"pp_size ({pp_size}) must be even for dualpipe")
    stages = 2 * pp_size if name == "dualpipev" else pp_size
    return (stages // 2 - 1) * (fb + b - 3 * w)


PARAMETER_COPIES = {name: 1 for name in ALL_SCHEDULES} | {"dualpipe": 2}
"""How many copies of its stages' parameters a rank holds (DualPipe: both directions'),
counted on the same ``pp_size`` ranks.  The DualPipe table's "2x" for DualPipeV compares
it with 1F1B at the same number of *stages* (DualPipeV puts them on half as many ranks);
on the same ranks, each of DualPipeV's ranks holds ``1 / pp_size`` of the model, as 1F1B's."""


def peak_activations_in_flight(actions: list[Action], chunk_weights=None) -> int:
    """The most (microbatch, chunk) pairs whose forward ran and whose backward has not
    yet, counting a split backward as done only at its W.

    Each holds one chunk's stashed activations: with ``V`` chunks, a pair is ``1/V``
    of a full stage's activations for one microbatch.  B frees what only the input's
    gradient needed, but W still needs each layer's input (``dW = X^T dY``): the
    count keeps the pair until its W, the way the DualPipe table counts.  An
    overlapped pair counts in the list's order: its forward's activations join
    before its backward's leave.

    ``chunk_weights``: what one microbatch of each chunk holds (``chunk_weights[c]``,
    e.g. its bytes: :func:`tutorial_lib.costs.memory_per_rank`); the peak of their sum
    instead of the count.  The executor counts its saved bytes in the same order
    (:class:`tutorial_lib.pipeline_parallel.executor.PipelineExecutor`).
    """
    split = split_backwards(actions)
    live = peak = 0
    for a in actions:
        weight = 1 if chunk_weights is None else chunk_weights[a.chunk]
        if a.kind == "forward":
            live += weight
        elif a.kind == ("weight" if (a.microbatch, a.chunk) in split else "backward"):
            live -= weight
        peak = max(peak, live)
    return peak


def expected_peak_activations(name: str, pp_size: int, num_microbatches: int, rank: int,
                              virtual_pipeline_size: int = 1,
                              microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """The formula for :func:`peak_activations_in_flight`, per schedule, in chunks.

    * GPipe: ``M``.
    * 1F1B: ``min(PP - rank, M)``: the warm-up forwards plus the steady state's one.
    * interleaved: ``min(warmup + 1, V * M)`` chunk-microbatches with Megatron's
      warm-up ``2 (PP - rank - 1) + (V - 1) N`` (:func:`num_warmup_microbatches`,
      group size ``N = PP`` by default).  With ``M >= 2 PP`` rank 0 holds
      ``V PP + PP - 1`` chunks, i.e. ``PP (1 + (PP - 1) / (V PP))`` full stages: the
      factor of Korthikanti et al. (2022) for interleaving.  With ``M == PP`` the
      cap ``V M`` binds on the first ranks only: at ``PP = 8, V = 2`` the ranks hold
      ``16, 16, 16, 16, 15, 13, 11, 9`` (Megatron-Core >= 0.10; up to 0.9, 16 each).
    * ZB-H1: ``min(PP, M)`` on every rank (held until the W: the deferred W's keep the
      last ranks' activations as long as rank 0's).
    * ZBV: ``min(M + rank + 1, 2 M, 2 PP)`` chunks of half a stage: ``2 PP`` on every
      rank once ``M >= 2 PP - 1``, 1F1B's ``PP`` stages.
    * DualPipeV: ``2 PP + 1`` chunks of half a stage; DualPipe: ``PP + 1`` chunks (of
      a whole stage, of either copy): the table's ``PP + 1``.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    if name in SPLIT_BACKWARD_SCHEDULES:
        check_pipeline(pp_size, num_microbatches, rank)
        pp, m = pp_size, num_microbatches
        return {"zb-h1": min(pp, m), "zbv": min(m + rank + 1, 2 * m, 2 * pp),
                "dualpipev": 2 * pp + 1, "dualpipe": pp + 1}[name]
    check_pipeline(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    if name == "gpipe":
        return num_microbatches
    warmup = num_warmup_microbatches(pp_size, num_microbatches, rank, virtual_pipeline_size,
                                     microbatch_group_size_per_vp_stage)
    return min(warmup + 1, virtual_pipeline_size * num_microbatches)
