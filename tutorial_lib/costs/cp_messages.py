"""The bytes of context-parallel attention, per rank and per attention call (chapter 9).

One attention call of :mod:`tutorial_lib.context_parallel` on one CP rank, forward and
backward, in each ``cp_comm_type``.  Symbols: ``C`` CP ranks, ``b`` sequences, ``h`` the
attention heads this rank computes (``num_attention_heads / TP``), ``s`` the whole
sequence, ``s / C`` this rank's tokens, ``d`` the head size, ``e`` bytes per element;
``kv = 2 b h (s/C) d e`` is one rank's K and V, the block the ring passes on, and
``u = b h (s/C) d e`` one of Q, K, V or the output::

    mode        forward                        backward
    ----------  -----------------------------  --------------------------------------
    p2p         C-1 sends (and receives) of    C-1 sends of kv (the ring again, the other
                kv                             way) and C-1 of a dK/dV accumulator (kv)
    all_gather  one all-gather of kv           one reduce-scatter of dK/dV (C kv in)
    a2a         all-to-all of Q, K, V (3u),    the same two, reversed
                and of the output back (u)

Bytes are counted as :mod:`tutorial_lib.comm` records them (all-gather: the shard given;
reduce-scatter: the whole input; all-to-all: every row given, this rank's own included;
send / recv: the tensor), so they equal the traced events; :func:`cp_bytes_sent` turns
them into what leaves the rank (:func:`~tutorial_lib.costs.alpha_beta.ring_bytes_sent`).
Per rank, p2p sends ``3 (C - 1) kv`` (TransformerEngine's ring: the backward starts
from the last block the forward brought, so each block's accumulator ends at its owner
without a message home), all_gather ``2 (C - 1) kv`` and a2a
``8 (C - 1) / C u = 4 (C - 1) / C kv``: the first two grow with ``C``, Ulysses' shrinks.
No torch.
"""
from __future__ import annotations

from .alpha_beta import ring_bytes_sent

__all__ = ["CP_MODES", "cp_kv_block_bytes", "cp_attention_messages", "cp_bytes_sent"]

#: The modes, as :data:`tutorial_lib.config.CP_COMM_TYPES` names them.
CP_MODES = ("p2p", "all_gather", "a2a")


def cp_kv_block_bytes(batch: int, heads: int, seq_length: int, head_dim: int,
                      cp_size: int, bytes_per_element: int = 4) -> int:
    """``2 b h (s/C) d e``: one rank's K and V, what the ring passes on at each step."""
    if seq_length % cp_size:
        raise ValueError(f"seq_length ({seq_length}) must be divisible by the CP size "
                         f"({cp_size})")
    return 2 * batch * heads * (seq_length // cp_size) * head_dim * bytes_per_element


def cp_attention_messages(cp_comm_type: str, cp_size: int, batch: int, heads: int,
                          seq_length: int, head_dim: int,
                          bytes_per_element: int = 4) -> list[dict]:
    """Every message of one attention call on one CP rank, forward then backward.

    Rows: ``phase``, ``op``, ``payload`` (``kv``, ``dkv``, ``qkv`` or ``out``), ``count``
    (how many such events) and ``bytes`` (each, in the trace's convention).  None at
    ``C = 1``.
    """
    if cp_comm_type not in CP_MODES:
        raise ValueError(f"cp_comm_type must be one of {', '.join(CP_MODES)}, "
                         f"got {cp_comm_type!r}")
    c = cp_size
    if c == 1:
        return []
    kv = cp_kv_block_bytes(batch, heads, seq_length, head_dim, c, bytes_per_element)
    u = kv // 2
    if cp_comm_type == "p2p":
        rows = [("forward", op, "kv", c - 1, kv) for op in ("send", "recv")]
        rows += [("backward", op, "kv", c - 1, kv) for op in ("send", "recv")]
        rows += [("backward", op, "dkv", c - 1, kv) for op in ("send", "recv")]
    elif cp_comm_type == "all_gather":
        rows = [("forward", "all_gather", "kv", 1, kv),
                ("backward", "reduce_scatter", "dkv", 1, c * kv)]
    else:
        rows = [("forward", "all_to_all", "qkv", 1, 3 * u),
                ("forward", "all_to_all", "out", 1, u),
                ("backward", "all_to_all", "out", 1, u),
                ("backward", "all_to_all", "qkv", 1, 3 * u)]
    keys = ("phase", "op", "payload", "count", "bytes")
    return [dict(zip(keys, row)) for row in rows]


def cp_bytes_sent(cp_comm_type: str, cp_size: int, batch: int, heads: int,
                  seq_length: int, head_dim: int, bytes_per_element: int = 4) -> int:
    """Bytes that leave one CP rank in one attention call, forward + backward.

    Sends count whole; collectives count what their ring (all-gather, reduce-scatter)
    or pairwise exchange (all-to-all) makes this rank send.
    """
    rows = cp_attention_messages(cp_comm_type, cp_size, batch, heads, seq_length,
                                 head_dim, bytes_per_element)
    return int(sum(row["count"] * ring_bytes_sent(row["op"], row["bytes"], cp_size)
                   for row in rows if row["op"] != "recv"))
