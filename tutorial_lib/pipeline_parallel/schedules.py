"""Chapter 6's schedules: GPipe, 1F1B and interleaved 1F1B, one rank's list each.

A pipeline cuts the model into ``pp_size`` stages, one per rank of a pipeline group
(``pp_size * V`` model stages, ``V`` chunks per rank, with interleaving), and cuts the
batch into ``num_microbatches`` microbatches.  Each builder returns the ordered list of
:class:`~.actions.Action` one ``rank`` performs in one
training step; :func:`tutorial_lib.pipeline_parallel.build_schedules` builds every
rank's.  Nothing here imports torch.

:func:`gpipe`
    every forward, then every backward.  Simple, but a rank holds the
    activations of all ``M`` microbatches at once.
:func:`one_f_one_b`
    non-interleaved 1F1B (Megatron's ``forward_backward_pipelining_without_interleaving``):
    ``min(PP - rank - 1, M)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards.  Same bubble as GPipe, but at most
    ``min(PP - rank, M)`` microbatches in flight.
:func:`interleaved_one_f_one_b`
    Megatron's interleaved 1F1B: each rank holds ``V`` model chunks; chunk ``c`` of
    rank ``r`` is model stage ``c * PP + r``.  The bubble shrinks by ``V``.  The
    order is Megatron-Core 0.20.0's (the schedule table of 0.10 and later, for every
    ``M`` it accepts, ``M == PP`` included).

A batched-mode bug that is easy to write, ``send_forward_recv_backward`` receiving the
gradient from the *previous* rank (``get_pipeline_model_parallel_prev_rank``) instead
of the next, is available as ``one_f_one_b(..., wrong_recv_backward_peer=True)`` so a
chapter can show it deadlock with ``PP >= 3`` and look fine with ``PP = 2``
(:func:`~.simulator.simulate`).
"""
from __future__ import annotations

from .actions import (Action, backward_actions, check_microbatch_groups, check_pipeline,
                      check_positive, forward_actions)

# --- the schedules ------------------------------------------------------------------------


def gpipe(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """GPipe: all ``M`` forwards, then all ``M`` backwards (in microbatch order)."""
    check_pipeline(pp_size, num_microbatches, rank)
    actions = []
    for i in range(num_microbatches):
        actions += forward_actions(rank, pp_size, 1, i, 0)
    for i in range(num_microbatches):
        actions += backward_actions(rank, pp_size, 1, i, 0)
    return actions


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> list[tuple[int, int]]:
    """The interleaved schedule's forwards in order, as ``(microbatch, chunk)`` pairs.

    The microbatches are cut into groups of ``N = microbatch_group_size_per_vp_stage``
    consecutive ones (the last group holds what is left, at most ``N``).  Group by
    group, the whole group goes through chunk 0, then through chunk 1, ..., then
    chunk ``V - 1``.  Megatron-Core >= 0.10 builds this table (same name) and drives
    the interleaved schedule with it for every ``M``; the backwards run the same
    table with the chunks reversed (chunk ``c`` -> ``V - 1 - c``).

    >>> get_schedule_table(5, 2, 3)   # PP = 2, N = 3: microbatches 0-2, then 3-4
    [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    """
    for name, value in (("num_microbatches", num_microbatches), ("num_model_chunks", num_model_chunks),
                        ("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)):
        check_positive(name, value, "the schedule table counts from 1")
    n = microbatch_group_size_per_vp_stage
    table = []
    for first in range(0, num_microbatches, n):
        group = range(first, min(first + n, num_microbatches))
        table += [(i, c) for c in range(num_model_chunks) for i in group]
    return table


def num_warmup_microbatches(pp_size: int, num_microbatches: int, rank: int,
                            virtual_pipeline_size: int = 1,
                            microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """Forwards a rank runs before its first 1F1B pair (Megatron's count).

    Non-interleaved: ``min(PP - rank - 1, M)``: rank ``r`` must fill the
    ``PP - r - 1`` stages after it before the first gradient can come back.
    Interleaved (``V > 1``, counted in chunk-microbatches out of ``V * M``):
    ``min(2 * (PP - rank - 1) + (V - 1) * N, V * M)`` with ``N`` the group size of
    :func:`check_microbatch_groups` (``PP`` by default), the rule of Megatron-Core
    >= 0.10 (``get_pp_rank_microbatches``, 0.20.0).  When it reaches ``V * M`` every
    forward runs before any backward.  (Up to Megatron-Core 0.9 that was also
    forced whenever ``M == PP``; since 0.10 ``M == PP`` follows the same count.)
    """
    check_pipeline(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    pp, m, v = pp_size, num_microbatches, virtual_pipeline_size
    if v == 1:
        return min(pp - rank - 1, m)
    n = check_microbatch_groups(pp, m, microbatch_group_size_per_vp_stage)
    return min(2 * (pp - rank - 1) + (v - 1) * n, v * m)


def one_f_one_b(pp_size: int, num_microbatches: int, rank: int, *,
                wrong_recv_backward_peer: bool = False) -> list[Action]:
    """Non-interleaved 1F1B: warm-up forwards, steady 1F1B pairs, cool-down backwards.

    ``wrong_recv_backward_peer=True`` reproduces a batched-mode bug for teaching: in
    the steady state, ``send_forward_recv_backward`` receives the gradient from the
    *previous* rank instead of the next one.  With ``PP = 2`` the two are the same
    rank and nothing shows; with ``PP >= 3`` (and ``M >= 2``, so that a steady state
    exists before the last stage) :func:`~.simulator.simulate` deadlocks.
    """
    check_pipeline(pp_size, num_microbatches, rank)
    pp, m = pp_size, num_microbatches
    warmup = num_warmup_microbatches(pp, m, rank)
    steady = m - warmup
    wrong_peer = (rank - 1) % pp if wrong_recv_backward_peer else None
    actions = []
    for i in range(warmup):
        actions += forward_actions(rank, pp, 1, i, 0)
    for i in range(steady):  # F's send, B's receive: one send_forward_recv_backward
        actions += forward_actions(rank, pp, 1, warmup + i, 0)
        actions += backward_actions(rank, pp, 1, i, 0, grad_from=wrong_peer)
    for i in range(steady, m):
        actions += backward_actions(rank, pp, 1, i, 0)
    return actions


def interleaved_one_f_one_b(pp_size: int, num_microbatches: int, rank: int,
                            virtual_pipeline_size: int,
                            microbatch_group_size_per_vp_stage: int | None = None) -> list[Action]:
    """Megatron's interleaved 1F1B with ``V = virtual_pipeline_size`` chunks per rank.

    Follows Megatron-Core 0.20.0 (``forward_backward_pipelining_with_interleaving``,
    the same order since 0.10).  The ``V * M`` chunk-microbatches are numbered
    ``k = 0, 1, ...`` by :func:`get_schedule_table`: with the default group size
    ``N = PP``, ``PP`` microbatches go through chunk 0, then the same ``PP`` through
    chunk 1, and so on; backward ``k`` is the same entry with the chunk reversed.
    A rank runs ``w`` = :func:`num_warmup_microbatches` forwards, then forward
    ``k + w`` and backward ``k`` in turn, then the remaining backwards.  This holds
    for every accepted ``M``, ``M == PP`` included (Megatron up to 0.9 ran every
    forward first there).  ``V = 1`` is plain :func:`one_f_one_b`.
    """
    check_pipeline(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    pp, m, v = pp_size, num_microbatches, virtual_pipeline_size
    if v == 1:
        return one_f_one_b(pp, m, rank)
    n = check_microbatch_groups(pp, m, microbatch_group_size_per_vp_stage)
    table = get_schedule_table(m, v, n)
    warmup = num_warmup_microbatches(pp, m, rank, v, n)

    def forward(k: int) -> list[Action]:
        microbatch, chunk = table[k]
        return forward_actions(rank, pp, v, microbatch, chunk)

    def backward(k: int) -> list[Action]:
        microbatch, chunk = table[k]
        return backward_actions(rank, pp, v, microbatch, v - 1 - chunk)

    actions = []
    for k in range(warmup):
        actions += forward(k)
    for k in range(len(table) - warmup):
        actions += forward(k + warmup) + backward(k)
    for k in range(len(table) - warmup, len(table)):
        actions += backward(k)
    return actions
