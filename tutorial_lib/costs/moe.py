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
(:mod:`tutorial_lib.moe`).  With expert tensor parallelism (ETP > 1) each rank also
gathers the rows over its expert-TP group and reduce-scatters the outputs:
:func:`moe_expert_tp_bytes`.

The deduplicating dispatcher (``AllToAllDispatcher(deduplicate=True)``, DeepEP's scheme)
moves one row per (token, destination node), then per (token, destination rank):
:func:`moe_dedup_rows` counts those rows from every rank's routing and
:func:`moe_dedup_rank_all_to_alls` turns them into each rank's all-to-alls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def moe_all_to_all_bytes(tokens: int, topk: int, hidden: int, bytes_per_element: int = 2) -> int:
    """Bytes one rank hands to one dropless dispatch all-to-all: ``T * K * h * d``.

    The combine hands back what the rank *received*; summed over the EP group the two
    are equal.  Chapter 1's bandwidth table writes the same product ``b*s*h*k*d``
    (:func:`~tutorial_lib.costs.bandwidth.bandwidth_table`), with ``T = b * s``.
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
    leg: str = ""
    """The deduplicating dispatcher's hop (``"node"`` or ``"rank"``); empty for copies."""


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


def moe_expert_tp_bytes(rows_received: Sequence[int], etp_rank: int, hidden: int,
                        bytes_per_element: int = 4) -> dict[str, int]:
    """The bytes one rank hands to the expert-TP collectives of one MoE forward (ETP > 1).

    ``rows_received[j]``: the rows expert-TP rank ``j`` received from its dispatch
    all-to-all (the column sums of :func:`moe_send_counts` over its EP group).  After the
    all-to-all each rank all-gathers its rows over the group (:mod:`tutorial_lib.comm`'s
    convention: its own shard, ``rows_received[etp_rank]`` rows); before the combine it
    reduce-scatters the experts' partial outputs for every gathered row (the whole input,
    ``sum(rows_received)`` rows).  The backward pass repeats both, reversed.  The int64
    counts gathered alongside are not included.
    """
    if not 0 <= etp_rank < len(rows_received):
        raise ValueError(f"etp_rank ({etp_rank}) must be in [0, {len(rows_received)})")
    row_bytes = hidden * bytes_per_element
    return {"all_gather": int(rows_received[etp_rank]) * row_bytes,
            "reduce_scatter": int(sum(rows_received)) * row_bytes}


def _dedup_legs(ep: int, ranks_per_node: int) -> list[str]:
    if ep == 1:
        return []
    return ["node", "rank"] if 1 < ranks_per_node < ep else ["rank"]


def moe_dedup_rows(topk_idx_by_rank: Sequence[Sequence[Sequence[int]]], num_experts: int,
                   ranks_per_node: int | None = None) -> dict[str, list[list[int]]]:
    """``rows[leg][i][j]``: rows EP rank ``i`` sends to EP rank ``j`` in each hop of the
    deduplicating dispatcher (``tutorial_lib.moe.AllToAllDispatcher.dispatch_deduplicated``).

    ``topk_idx_by_rank[i]``: rank ``i``'s routing, one list of ``K`` expert ids per token
    (``-1``: a copy dropped by capacity).  ``ranks_per_node`` consecutive EP ranks form a
    node (``None``: one node).  Hop ``"node"`` (only when there are several nodes of
    several ranks): a token goes once to each node holding one of its experts, to the rank
    there with the sender's local index.  Hop ``"rank"``: each row goes once to each rank
    holding one of its experts (after a node hop, only ranks of the node it reached).
    The copy dispatcher would send ``K`` rows per token instead.
    """
    ep = len(topk_idx_by_rank)
    g = ep if ranks_per_node is None else ranks_per_node
    if ep < 1 or num_experts % ep or g < 1 or ep % g:
        raise ValueError(f"need N divisible by EP and EP by ranks_per_node; got N = "
                         f"{num_experts}, EP = {ep}, ranks_per_node = {ranks_per_node}")
    local = num_experts // ep
    legs = _dedup_legs(ep, g)
    rows = {leg: [[0] * ep for _ in range(ep)] for leg in legs}
    # the rows each rank holds before the rank hop: (holder, expert ids)
    held = [(i, [e for e in token if e >= 0]) for i in range(ep) for token in topk_idx_by_rank[i]]
    if "node" in legs:
        forwarded = []
        for i, experts in held:
            for node in sorted({e // local // g for e in experts}):
                to = node * g + i % g
                rows["node"][i][to] += 1
                forwarded.append((to, [e for e in experts if e // local // g == node]))
        held = forwarded
    if "rank" in legs:
        for i, experts in held:
            for j in sorted({e // local for e in experts}):
                rows["rank"][i][j] += 1
    return rows


def moe_dedup_rank_all_to_alls(rows: dict[str, list[list[int]]], rank: int, hidden: int,
                               topk: int, bytes_per_element: int = 4) -> list[MoEAllToAll]:
    """Every all-to-all EP rank ``rank`` issues in one forward + backward of a layer with
    the deduplicating dispatcher, from :func:`moe_dedup_rows`.

    Forward, for each hop in order: the row counts (``EP`` int64), the token rows
    (``h`` elements of ``bytes_per_element``), their expert ids (``K`` int64) and gates
    (``K`` fp32); then the combine, hops reversed, sends back one partial sum per row
    it received.  Backward: the combine's reverses (rows as the dispatch sent them), then
    the token rows' and the gates' reverses; autograd decides the order of the backward
    messages, so compare them as a collection.
    """
    legs = list(rows)
    if not legs:
        return []
    ep = len(rows[legs[0]])
    if not 0 <= rank < ep:
        raise ValueError(f"rank ({rank}) must be an EP rank in [0, {ep})")
    row_bytes, idx_bytes, gate_bytes = hidden * bytes_per_element, topk * 8, topk * 4
    forward, combine, backward = [], [], []
    for leg in legs:
        sent = tuple(int(c) for c in rows[leg][rank])
        got = tuple(int(rows[leg][i][rank]) for i in range(ep))
        n_sent, n_got = sum(sent), sum(got)
        forward += [
            MoEAllToAll("forward", "dispatch", "counts", ep * 8, (1,) * ep, (1,) * ep, leg),
            MoEAllToAll("forward", "dispatch", "tokens", n_sent * row_bytes, sent, got, leg),
            MoEAllToAll("forward", "dispatch", "topk_idx", n_sent * idx_bytes, sent, got, leg),
            MoEAllToAll("forward", "dispatch", "gates", n_sent * gate_bytes, sent, got, leg)]
        combine.insert(0, MoEAllToAll("forward", "combine", "tokens", n_got * row_bytes,
                                      got, sent, leg))
        backward += [
            MoEAllToAll("backward", "combine", "tokens", n_sent * row_bytes, sent, got, leg),
            MoEAllToAll("backward", "dispatch", "tokens", n_got * row_bytes, got, sent, leg),
            MoEAllToAll("backward", "dispatch", "gates", n_got * gate_bytes, got, sent, leg)]
    return forward + combine + backward
