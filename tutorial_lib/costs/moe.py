"""MoE dispatch and combine: the bytes and send splits of the expert-parallel all-to-alls.

Chapter 4 (MoE with expert parallelism) checks its traced all-to-alls against
:func:`moe_all_to_all_bytes` (bytes) and :func:`moe_rank_all_to_alls` (bytes and splits
of each one); ``bench/bench_moe.py`` does the same at larger sizes.  Importing this module loads
numpy, no torch.

Expert parallelism moves token *copies*: each of a rank's T tokens goes to its K experts,
so a dropless dispatch hands T*K rows of h elements to the all-to-all (the rows that stay
on this rank included: :mod:`tutorial_lib.comm`'s byte convention).  Which rank receives
how many depends on the routing, so the per-rank predictions start from the routing's
counts.  Experts lie in contiguous blocks: expert e lives on EP rank e // (N / EP)
(:mod:`tutorial_lib.moe`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def moe_all_to_all_bytes(tokens: int, topk: int, hidden: int, bytes_per_element: int = 2) -> int:
    """Bytes one rank hands to one dropless dispatch all-to-all: ``T * K * h * d``.

    The combine hands back what the rank *received*; summed over the EP group the two
    are equal.  The same product as chapter 1's
    :func:`tutorial_lib.costs.bandwidth.ep_all_to_all_bytes` with ``T = b * s``.
    """
    for name, value in (("tokens", tokens), ("topk", topk), ("hidden", hidden),
                        ("bytes_per_element", bytes_per_element)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return tokens * topk * hidden * bytes_per_element


def moe_rank_send_splits(tokens_per_expert: Sequence[int], ep_size: int) -> list[int]:
    """Token copies one EP rank sends to each EP rank: its ``input_split_sizes``.

    ``tokens_per_expert`` is the rank's routing load over all ``N`` experts (after any
    capacity dropping); rank ``j`` owns experts ``[j N/EP, (j+1) N/EP)``.
    """
    num_experts = len(tokens_per_expert)
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"need N experts divisible by EP; got N = {num_experts}, EP = {ep_size}")
    local = num_experts // ep_size
    return [int(sum(tokens_per_expert[j * local:(j + 1) * local])) for j in range(ep_size)]


def moe_send_counts(tokens_per_expert_by_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """``counts[i][j]``: token copies EP rank ``i`` sends to EP rank ``j``.

    ``tokens_per_expert_by_rank[i]`` is rank ``i``'s routing load over all ``N`` experts;
    each row is :func:`moe_rank_send_splits` of that rank.
    """
    ep = len(tokens_per_expert_by_rank)
    num_experts = len(tokens_per_expert_by_rank[0]) if ep else 0
    if ep == 0 or num_experts % ep or any(len(row) != num_experts for row in tokens_per_expert_by_rank):
        raise ValueError(f"need one load row of N experts per EP rank, N divisible by EP; got "
                         f"{ep} rows of lengths {[len(r) for r in tokens_per_expert_by_rank]}")
    return [moe_rank_send_splits(row, ep) for row in tokens_per_expert_by_rank]


@dataclass(frozen=True)
class MoEAllToAll:
    """One all-to-all of a MoE layer on one rank, as its trace event will record it."""

    phase: str
    """``forward`` or ``backward``."""
    op_name: str
    """``dispatch`` or ``combine`` (the counts exchange belongs to the dispatch)."""
    payload: str
    """``counts`` (int64 metadata, ``[EP, N/EP]``) or ``tokens`` (rows of ``h`` elements)."""
    bytes: int
    """Bytes this rank hands to the op (its own share included)."""
    input_splits: tuple[int, ...]
    """Rows sent to each EP rank."""
    output_splits: tuple[int, ...]
    """Rows received from each EP rank."""


def moe_rank_all_to_alls(send_counts: Sequence[Sequence[int]], rank: int, hidden: int,
                         num_experts: int, bytes_per_element: int = 4) -> list[MoEAllToAll]:
    """Every all-to-all EP rank ``rank`` issues in one MoE forward + backward, in issue order.

    Forward: the counts exchange (``N`` int64 numbers, one row of ``N/EP`` per peer), the
    dispatch (row ``rank`` of ``send_counts``), the combine (column ``rank``: what it
    received goes back).  Backward: the combine's reverse, then the dispatch's; autograd
    skips the dispatch's reverse when the layer's input does not require a gradient, so
    the prediction assumes it does.  With one EP rank nothing is communicated.
    ``send_counts`` comes from :func:`moe_send_counts`.
    """
    ep = len(send_counts)
    if not 0 <= rank < ep:
        raise ValueError(f"rank ({rank}) must be an EP rank in [0, {ep})")
    if ep == 1:
        return []
    row = tuple(int(c) for c in send_counts[rank])
    column = tuple(int(send_counts[i][rank]) for i in range(ep))
    row_bytes = hidden * bytes_per_element
    sent, received = sum(row) * row_bytes, sum(column) * row_bytes
    return [
        MoEAllToAll("forward", "dispatch", "counts", num_experts * 8, (1,) * ep, (1,) * ep),
        MoEAllToAll("forward", "dispatch", "tokens", sent, row, column),
        MoEAllToAll("forward", "combine", "tokens", received, column, row),
        MoEAllToAll("backward", "combine", "tokens", sent, row, column),
        MoEAllToAll("backward", "dispatch", "tokens", received, column, row),
    ]
