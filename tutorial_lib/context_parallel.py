"""Context parallelism (CP): attention over a sequence split between the ``cp`` ranks.

Every layer but attention works token by token, so with the sequence cut into pieces
each CP rank runs them on its own tokens and never talks.  Attention is the exception:
a query needs the keys and values of every earlier token.  This module computes exact
attention (the serial layer's outputs and gradients) with the sequence split over the
CP ranks, in the three ways Megatron-Core offers (``--cp-comm-type``, through
Transformer Engine's kernels).  Read it top to bottom, like chapter 9:

1. **Who holds which tokens** (pure).  The sequence is cut into ``2 x CP`` equal chunks
   and CP rank ``r`` keeps chunks ``r`` and ``2 CP - 1 - r`` (:func:`held_chunks`,
   :func:`split_for_cp_rank`: Megatron-Core's ``get_batch_on_this_cp_rank``).  Under a
   causal mask a late chunk attends to many keys and an early one to few; pairing them
   gives every rank the same work (:func:`causal_pairs` counts it).  The naive split,
   rank ``r`` holding chunk ``r`` of ``CP``, is kept for comparison
   (``load_balanced=False``).
2. **The merge** (pure torch).  Attention of a query over two sets of keys can be
   computed separately and merged exactly: each partial result carries the log-sum-exp
   ``lse`` of its scores, and ``lse = log(e^lse_a + e^lse_b)``, ``out = out_a
   e^(lse_a - lse) + out_b e^(lse_b - lse)`` (:func:`block_attention`,
   :func:`merge_partials`): FlashAttention's online softmax, across ranks.
3. **p2p** (:class:`RingAttention`): K/V blocks travel around the ring of CP ranks; at
   each of the ``CP`` steps a rank sends the block it holds to the next rank and
   receives the previous rank's while it attends its queries to the block it holds,
   then merges.  Backward recomputes each block's probabilities from the saved final
   ``lse`` (nothing per step is kept) and walks the ring the other way, as
   TransformerEngine's ``AttnFuncWithCPAndKVP2P`` does: it starts from the last block
   the forward brought (saved for it, so the rank's own block comes last), passes the
   K/V blocks to the previous rank ``CP - 1`` times, and each block's dK/dV accumulator
   follows one step behind its K/V, ``CP - 1`` messages, so that it ends at the block's
   owner, which adds its own share last: ``3 (CP - 1)`` K/V-sized messages per rank and
   call.  Every send and receive goes through
   :mod:`tutorial_lib.comm` (``isend`` / ``irecv``), so the trace shows the ring.
4. **all_gather** (:func:`all_gather_attention`): every rank gathers all keys and values
   (as Llama 3 trained) and attends each of its query chunks to its causal prefix only
   (the keys up to the chunk's end, as TransformerEngine does); backward reduce-scatters
   dK/dV.
5. **a2a** (:func:`ulysses_attention`, DeepSpeed-Ulysses): an all-to-all turns "my
   tokens, all heads" into "all tokens, my heads" (the heads must divide by CP: rule
   13), each rank runs ordinary attention on whole sequences of its heads, and a second
   all-to-all turns the output back.

:func:`context_parallel_attention` picks one by name.  Timing the three side by side on
this machine, and the ring's work per rank under either split, is
:mod:`tutorial_lib.timing.cp_attention`'s.  Tensors are ``[b, heads, s_local, head_dim]`` (what
:class:`tutorial_lib.transformer.SelfAttention` hands to attention); ``s_local`` holds
this rank's chunks, in chunk order.  The bytes of each mode, in closed form:
:mod:`tutorial_lib.costs.cp_messages`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import comm, parallel_state
from .config import CP_COMM_TYPES, ConfigError
from .trace import get_tracer

__all__ = ["CP_COMM_TYPES", "num_chunks", "held_chunks", "chunk_positions",
           "split_for_cp_rank", "gather_from_cp_ranks", "causal_pairs", "ring_schedule",
           "pair_kind", "block_attention", "merge_partials", "RingAttention",
           "ring_attention", "all_gather_attention", "ulysses_attention",
           "context_parallel_attention"]

#: Message tags of the ring: messages between two ranks match in order per tag, so the
#: K/V blocks of the forward ring, those of the backward ring and the dK/dV accumulators
#: can never take each other's place.
TAGS = {"kv_forward": 21, "kv_backward": 22, "dkv": 23}


# --- 1. who holds which tokens (pure) ------------------------------------------------


def num_chunks(cp_size: int, load_balanced: bool = True) -> int:
    """Equal chunks of the sequence: ``2 x CP`` (balanced) or ``CP`` (naive)."""
    return 2 * cp_size if load_balanced else cp_size


def held_chunks(cp_rank: int, cp_size: int, load_balanced: bool = True) -> tuple:
    """The chunks CP rank ``cp_rank`` holds, in the order it stores them.

    Balanced: ``(r, 2 CP - 1 - r)`` of ``2 CP`` chunks, an early chunk and its mirror
    image, so that causal work is equal on every rank.  Naive: ``(r,)`` of ``CP``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must be in 0..{cp_size - 1}")
    if not load_balanced:
        return (cp_rank,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def _chunk_length(seq_length: int, cp_size: int, load_balanced: bool) -> int:
    n = num_chunks(cp_size, load_balanced)
    if seq_length % n:
        cut = "2 x CP" if load_balanced else "CP"
        raise ConfigError("rule 12", f"seq_length ({seq_length}) must be divisible "
                                     f"by the {n} chunks ({cut}, CP = {cp_size}) it "
                                     f"is cut into; choose a multiple of {n}")
    return seq_length // n


def chunk_positions(seq_length: int, cp_size: int, cp_rank: int,
                    load_balanced: bool = True) -> list[int]:
    """The positions (token indices) CP rank ``cp_rank`` holds, in its storage order."""
    c = _chunk_length(seq_length, cp_size, load_balanced)
    return [chunk * c + i for chunk in held_chunks(cp_rank, cp_size, load_balanced)
            for i in range(c)]


def split_for_cp_rank(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int,
                      load_balanced: bool = True) -> torch.Tensor:
    """CP rank ``cp_rank``'s tokens of ``tensor``, whose dimension ``dim`` is the
    sequence.

    Megatron-Core's ``get_batch_on_this_cp_rank`` does this to every tensor of the batch
    (tokens, labels, positions) before the model sees it.
    """
    positions = chunk_positions(tensor.shape[dim], cp_size, cp_rank, load_balanced)
    return tensor.index_select(dim, torch.tensor(positions, device=tensor.device))


def gather_from_cp_ranks(pieces: list[torch.Tensor], dim: int,
                         load_balanced: bool = True) -> torch.Tensor:
    """The whole sequence again from every CP rank's piece (the inverse of
    :func:`split_for_cp_rank`): ``pieces[r]`` is rank ``r``'s."""
    cp_size = len(pieces)
    seq_length = sum(p.shape[dim] for p in pieces)
    out = torch.empty_like(torch.cat(pieces, dim=dim))
    for rank, piece in enumerate(pieces):
        index = torch.tensor(chunk_positions(seq_length, cp_size, rank, load_balanced),
                             device=piece.device)
        out.index_copy_(dim, index, piece)
    return out


def causal_pairs(seq_length: int, cp_size: int,
                 load_balanced: bool = True) -> list[int]:
    """Per CP rank: the (query, key) pairs its queries attend to under a causal mask.

    The query at position ``p`` attends to ``p + 1`` keys, so a rank's work is the sum
    of ``p + 1`` over its positions: the same on every rank under the balanced split,
    growing with the rank under the naive one.
    """
    return [sum(p + 1 for p in chunk_positions(seq_length, cp_size, r, load_balanced))
            for r in range(cp_size)]


def ring_schedule(cp_size: int) -> list[list[int]]:
    """``[step][cp_rank]`` -> the CP rank whose K/V block that rank attends to.

    At step ``t`` rank ``r`` holds rank ``(r - t) mod CP``'s block: its own at step 0,
    then each block moves one rank on per step, so after ``CP`` steps every query has
    seen every key.
    """
    return [[(r - t) % cp_size for r in range(cp_size)] for t in range(cp_size)]


def pair_kind(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """What a query chunk does with a key chunk: ``"full"``, ``"diagonal"``, ``"skip"``.

    Chunks are contiguous and equal, numbered by position, so under a causal mask a key
    chunk before the query chunk is seen whole, the same chunk through the triangle of
    the mask, and a later one not at all.
    """
    if not causal or key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else "skip"


def _pairs_in(kind: str, c: int) -> int:
    """(query, key) pairs a ``c x c`` block of that kind attends."""
    return {"full": c * c, "diagonal": c * (c + 1) // 2, "skip": 0}[kind]


# --- 2. the merge: attention in blocks, combined by the log-sum-exp rule -------------


def _scores(q, k, scale, diagonal):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # key j is hidden from query i < j
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys: ``(out, lse)``.

    ``out = softmax(q k^T * scale) v`` over this block's keys only, and ``lse`` the
    log-sum-exp of each query's scores, ``[..., s_q]``: what :func:`merge_partials`
    needs to combine it with other blocks.  ``diagonal``: the block is the query chunk
    itself, so key ``j`` is hidden from query ``i < j`` (the causal triangle).
    """
    scores = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged exactly.

    Each ``out`` is normalised by its own keys' softmax sum ``e^lse``; the merged sum
    is ``e^lse_a + e^lse_b``, so each part is re-weighted by its share of it.  A part
    with ``lse = -inf`` (no keys yet) weighs nothing.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # at most 1: nothing overflows
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def _block_backward(q, k, v, dout, lse, delta, scale, diagonal):
    """dQ, dK, dV of one block, its probabilities recomputed from the final ``lse`` (so
    they are the true softmax, not the block's own): ``dV = P^T dO``, ``dS = P * (dO
    V^T - delta)`` with ``delta = rowsum(dO * O)``, ``dQ = dS K scale``, ``dK = dS^T Q
    scale``."""
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    return dq, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


# --- 3. p2p: the ring ----------------------------------------------------------------


def _ring(group: str) -> tuple[int, int, int, int]:
    """``(cp_size, cp_rank, next global rank, previous global rank)`` of the ring."""
    ranks = parallel_state.get_group_ranks(group)
    size, rank = len(ranks), parallel_state.get_rank_in(group)
    return size, rank, ranks[(rank + 1) % size], ranks[(rank - 1) % size]


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The ``n`` chunks (views) of ``[b, h, s, d]`` along the sequence."""
    return list(t.chunk(n, dim=2))


def _pass_on(kv, step, source, size, nxt, prev, group, tag):
    """Post this step's exchange: send the block I hold to the next rank, receive the
    previous rank's.  Returns ``(works, the receive buffer)``; nothing at the last
    step."""
    if step == size - 1:
        return [], None
    incoming = torch.empty_like(kv)
    tracer = get_tracer()
    with tracer.tags(cp_step=step, kv_block=(source - 1) % size, payload="kv"):
        works = [comm.irecv(incoming, prev, group, tag=tag)]
    with tracer.tags(cp_step=step, kv_block=source, payload="kv"):
        works.append(comm.isend(kv, nxt, group, tag=tag))
    return works, incoming


def _chunk_pairs(mine, theirs, causal):
    """``(a, b, kind)`` for my query chunk ``a`` and the block's key chunk ``b``, unless
    the pair is skipped."""
    for a, query_chunk in enumerate(mine):
        for b, key_chunk in enumerate(theirs):
            kind = pair_kind(query_chunk, key_chunk, causal)
            if kind != "skip":
                yield a, b, kind


class RingAttention(torch.autograd.Function):
    """Exact attention with K/V blocks passed around the ring of CP ranks (``p2p``).

    ``forward(q, k, v, causal, group, load_balanced)`` on ``[b, h, s_local, d]``; the
    ring, the merge and the backward ring are described in the module docstring.  Each
    step's work is a ``compute`` span named ``ring_attention`` with tags ``cp_step``,
    ``kv_block`` (the CP rank whose K/V it attends to), ``pairs`` (the (query, key)
    pairs it attended, per sequence and head; forward only), ``causal`` and
    ``load_balanced``; each message carries ``cp_step``, ``kv_block`` (whose block
    travels) and ``payload`` (``kv`` or ``dkv``).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, group, load_balanced):
        size, rank, nxt, prev = _ring(group)
        tracer = get_tracer()
        mine = held_chunks(rank, size, load_balanced)
        n, scale = len(mine), 1.0 / math.sqrt(q.shape[-1])
        q_chunks = _chunks(q, n)
        outs = [torch.zeros_like(chunk) for chunk in q_chunks]
        lses = [torch.full(chunk.shape[:-1], float("-inf"), device=chunk.device)
                for chunk in q_chunks]
        kv = torch.stack([k, v]).contiguous()  # one message a step: [2, b, h, s_l, d]
        with tracer.tags(cp_comm_type="p2p", phase="forward"):
            for step in range(size):
                source = (rank - step) % size  # whose K/V I hold now
                # post the exchange of the next block first, then compute under it
                works, incoming = _pass_on(kv, step, source, size, nxt, prev, group,
                                           TAGS["kv_forward"])
                k_chunks, v_chunks = _chunks(kv[0], n), _chunks(kv[1], n)
                with tracer.span("ring_attention", cp_step=step, kv_block=source,
                                 causal=causal, load_balanced=load_balanced) as span:
                    pairs = 0
                    theirs = held_chunks(source, size, load_balanced)
                    for a, b, kind in _chunk_pairs(mine, theirs, causal):
                        diagonal = kind == "diagonal"
                        out, lse = block_attention(q_chunks[a], k_chunks[b],
                                                   v_chunks[b], scale, diagonal)
                        outs[a], lses[a] = merge_partials(outs[a], lses[a], out, lse)
                        pairs += _pairs_in(kind, q_chunks[a].shape[2])
                    span.tags["pairs"] = pairs
                comm.wait_all(works)
                kv = kv if incoming is None else incoming
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        # kv is now the last block the ring brought, rank + 1's: backward starts from it
        ctx.save_for_backward(q, kv, out, lse)
        ctx.causal, ctx.group, ctx.load_balanced = causal, group, load_balanced
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        causal, group, load_balanced = ctx.causal, ctx.group, ctx.load_balanced
        size, rank, nxt, prev = _ring(group)
        tracer = get_tracer()
        mine = held_chunks(rank, size, load_balanced)
        n, scale = len(mine), 1.0 / math.sqrt(q.shape[-1])
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1)  # rowsum(dO * O), for the softmax's backward
        q_chunks, dout_chunks = _chunks(q, n), _chunks(dout, n)
        lse_chunks, delta_chunks = _chunks(lse, n), _chunks(delta, n)
        dq = torch.zeros_like(q)
        dq_chunks = _chunks(dq, n)  # views: adding into them adds into dq
        finished = None  # the last step's dK/dV accumulator, passed on at this step
        with tracer.tags(cp_comm_type="p2p", phase="backward"):
            for step in range(size):
                # the reverse ring: I hold rank + 1 + step's block, pass it to rank - 1
                source = (rank + 1 + step) % size
                works, incoming, arriving = [], None, None
                if step < size - 1:
                    incoming = torch.empty_like(kv)
                    with tracer.tags(cp_step=step, kv_block=(source + 1) % size, payload="kv"):
                        works.append(comm.irecv(incoming, nxt, group, tag=TAGS["kv_backward"]))
                    with tracer.tags(cp_step=step, kv_block=source, payload="kv"):
                        works.append(comm.isend(kv, prev, group, tag=TAGS["kv_backward"]))
                if step > 0:  # block `source`'s dK/dV summed by the ranks after me, and
                    arriving = torch.empty_like(kv)  # the last step's block's, passed on
                    with tracer.tags(cp_step=step, kv_block=source, payload="dkv"):
                        works.append(comm.irecv(arriving, nxt, group, tag=TAGS["dkv"]))
                    with tracer.tags(cp_step=step, kv_block=(source - 1) % size, payload="dkv"):
                        works.append(comm.isend(finished, prev, group, tag=TAGS["dkv"]))
                dkv = torch.zeros_like(kv)  # my queries' share of its dK, dV
                k_chunks, v_chunks = _chunks(kv[0], n), _chunks(kv[1], n)
                dk_chunks, dv_chunks = _chunks(dkv[0], n), _chunks(dkv[1], n)
                with tracer.span("ring_attention", cp_step=step, kv_block=source):
                    theirs = held_chunks(source, size, load_balanced)
                    for a, b, kind in _chunk_pairs(mine, theirs, causal):
                        dq_part, dk_part, dv_part = _block_backward(
                            q_chunks[a], k_chunks[b], v_chunks[b], dout_chunks[a],
                            lse_chunks[a], delta_chunks[a], scale, kind == "diagonal")
                        dq_chunks[a] += dq_part
                        dk_chunks[b] += dk_part
                        dv_chunks[b] += dv_part
                comm.wait_all(works)
                if arriving is not None:
                    dkv += arriving
                finished, kv = dkv, (kv if incoming is None else incoming)
        # the last block was my own, and every other rank had added to it: it is complete
        return dq, finished[0], finished[1], None, None, None


def ring_attention(q, k, v, causal: bool = True, group: str = "cp",
                   load_balanced: bool = True) -> torch.Tensor:
    """``p2p`` context-parallel attention (:class:`RingAttention`)."""
    return RingAttention.apply(q, k, v, causal, group, load_balanced)


# --- 4. all_gather -------------------------------------------------------------------


def _all_positions(seq_length: int, cp_size: int, load_balanced: bool,
                   device) -> torch.Tensor:
    """Every CP rank's positions, rank after rank: where each gathered row sits."""
    return torch.tensor([p for r in range(cp_size) for p in
                         chunk_positions(seq_length, cp_size, r, load_balanced)],
                        device=device)


def all_gather_attention(q, k, v, causal: bool = True, group: str = "cp",
                         load_balanced: bool = True) -> torch.Tensor:
    """``all_gather`` context-parallel attention: gather all K and V, attend locally.

    One all-gather of this rank's K/V over the CP group (backward: the reduce-scatter of
    dK/dV, since every rank's queries contributed to every block); the gathered rows are
    put in position order, and each of this rank's query chunks attends to its causal
    prefix only: chunk ``c`` (of length ``L``) to the keys of chunks ``0..c``, the last
    of them through the triangle of the mask.  The keys after the chunk are never
    multiplied, so the work is the causal pairs of :func:`causal_pairs`, not every
    (query, key) pair.  TransformerEngine's ``AttnFuncWithCPAndKVAllGather``
    (``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``,
    commit d0067d0d, ``get_kv_seq_info_after_all_gather``) cuts the gathered K/V the same
    way, one attention call per local chunk.  Without
    the causal mask every chunk attends to all ``s`` keys.
    """
    from .tensor_parallel import gather_from_sequence_parallel_region
    size, rank = parallel_state.get_size(group), parallel_state.get_rank_in(group)
    s = q.shape[2] * size
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # [s_l, 2, b, h, d]
    with get_tracer().tags(cp_comm_type="all_gather", payload="kv"):
        gathered = gather_from_sequence_parallel_region(kv, group)  # [s, 2, b, h, d]
    if not causal:
        k_all, v_all = gathered.permute(1, 2, 3, 0, 4).unbind(0)  # [b, h, s, d], rank order
        return F.scaled_dot_product_attention(q, k_all, v_all)
    order = torch.argsort(_all_positions(s, size, load_balanced, q.device))
    in_order = gathered.index_select(0, order)  # row p: position p
    mine = held_chunks(rank, size, load_balanced)
    length = s // num_chunks(size, load_balanced)
    outs, tracer = [], get_tracer()
    for query_chunk, q_chunk in zip(mine, _chunks(q, len(mine))):
        end = (query_chunk + 1) * length  # the chunk's causal prefix: keys [0, end)
        k_seen, v_seen = in_order[:end].permute(1, 2, 3, 0, 4).unbind(0)  # [b, h, end, d]
        # query i of the chunk sits at position end - length + i: it sees keys j <= that
        mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(end - length)
        with tracer.span("all_gather_attention", cp_comm_type="all_gather",
                         query_chunk=query_chunk, products=length * end,
                         pairs=int(mask.sum())):
            outs.append(F.scaled_dot_product_attention(q_chunk, k_seen, v_seen,
                                                       attn_mask=mask))
    return torch.cat(outs, dim=2)


# --- 5. a2a: DeepSpeed-Ulysses -------------------------------------------------------


def _check_ulysses_heads(heads: int, size: int) -> None:
    if heads % size:
        raise ConfigError("rule 13", f"cp_comm_type 'a2a' (Ulysses) gives each CP rank "
                                     f"whole heads: the {heads} heads here must be "
                                     f"divisible by the CP size ({size}); use p2p or "
                                     f"all_gather, or a CP size dividing {heads}")


def ulysses_attention(q, k, v, causal: bool = True, group: str = "cp",
                      load_balanced: bool = True) -> torch.Tensor:
    """``a2a`` context-parallel attention (DeepSpeed-Ulysses).

    All-to-all #1 sends head group ``j`` (heads ``j h/CP .. (j+1) h/CP - 1``) of this
    rank's Q, K, V to CP rank ``j`` and receives every rank's tokens of its own head
    group: ``[b, h, s_local, d]`` -> ``[b, h/CP, s, d]``.  Ordinary attention on whole
    sequences (rows put in position order first), then all-to-all #2 returns each rank
    its tokens of every head.  Autograd reverses both all-to-alls in backward.
    """
    from .moe import all_to_all
    size = parallel_state.get_size(group)
    b, h, s_local, d = q.shape
    _check_ulysses_heads(h, size)
    splits = [s_local] * size
    qkv = torch.stack([q, k, v]).view(3, b, size, h // size, s_local, d)
    # rows [j s_local, (j+1) s_local) go to rank j: head group j of my tokens
    rows = qkv.permute(2, 4, 0, 1, 3, 5).reshape(size * s_local, 3, b, h // size, d)
    positions = _all_positions(s_local * size, size, load_balanced, q.device)
    with get_tracer().tags(cp_comm_type="a2a"):
        rows = all_to_all(rows, group, splits, splits, op_name="ulysses_qkv")
        in_order = rows.index_select(0, torch.argsort(positions))  # row p: position p
        q_, k_, v_ = in_order.permute(1, 2, 3, 0, 4).unbind(0)  # [b, h/CP, s, d]
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
        out = out.permute(2, 0, 1, 3).index_select(0, positions).contiguous()  # by rank
        out = all_to_all(out, group, splits, splits, op_name="ulysses_out")
    out = out.view(size, s_local, b, h // size, d)  # [head group, my tokens, b, h, d]
    return out.permute(2, 0, 3, 1, 4).reshape(b, h, s_local, d)


# --- 6. by name ----------------------------------------------------------------------

_FUNCTIONS = {"p2p": ring_attention, "all_gather": all_gather_attention,
              "a2a": ulysses_attention}


def context_parallel_attention(q, k, v, cp_comm_type: str = "p2p", causal: bool = True,
                               group: str | None = "cp",
                               load_balanced: bool = True) -> torch.Tensor:
    """Attention of this CP rank's queries over the whole sequence, ``[b, h, s_l, d]``.

    ``cp_comm_type``: ``p2p``, ``all_gather`` or ``a2a`` (Megatron's
    ``--cp-comm-type``).
    With one CP rank (or ``group=None``, or no groups built) it is plain
    ``scaled_dot_product_attention``: the serial layer.
    """
    if cp_comm_type not in _FUNCTIONS:
        choices = ", ".join(CP_COMM_TYPES)
        raise ConfigError("malformed", f"cp_comm_type must be one of {choices}, got "
                                       f"{cp_comm_type!r}")
    if parallel_state.group_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _FUNCTIONS[cp_comm_type](q, k, v, causal, group, load_balanced)
