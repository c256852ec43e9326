"""The synthetic data every chapter trains on, and how a global batch is cut.

A global batch depends only on ``(seed, step)``, never on the layout, so every TP, PP,
EP and DP size trains on the very same numbers.  It is cut twice: into each
data-parallel replica's rows (:func:`split_global_batch`), then into that replica's
microbatches (:func:`split_microbatches`).  Chapter 3's step and the 4D run both use it.
"""
from __future__ import annotations

import torch

from .devices import cpu_generator, resolve_device

__all__ = ["synthetic_batch", "split_global_batch", "split_microbatches"]


def synthetic_batch(seed: int, step: int, global_batch_size: int, seq_length: int,
                    vocab_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable global batch: ``(input_ids, labels)``, each ``[global_batch_size, seq_length]``.

    Each sequence counts through the vocabulary from a random start with a random
    stride of 1, 2 or 3: ``x_t = (start + stride * t) mod vocab_size``.  The label of
    each token is the next one, so a model that reads the previous token (to learn the
    stride) can predict every label but the first.  It depends only on ``(seed, step)``,
    never on the layout: every TP and DP size trains on the very same numbers.  Drawn on
    the CPU (every device gets the same numbers), returned on ``device`` (``None``:
    torch's default device).
    """
    generator = cpu_generator(1_000_003 * seed + step)
    start = torch.randint(0, vocab_size, (global_batch_size, 1), generator=generator, device="cpu")
    stride = torch.randint(1, 4, (global_batch_size, 1), generator=generator, device="cpu")
    tokens = (start + stride * torch.arange(seq_length + 1, device="cpu")) % vocab_size
    tokens = tokens.to(resolve_device(device))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def split_global_batch(global_batch, dp_rank: int, dp_size: int):
    """Data-parallel replica ``dp_rank``'s rows of every tensor in ``global_batch``.

    Replica ``r`` of ``D`` gets rows ``[r * B/D, (r + 1) * B/D)``: contiguous, so
    replica 0's first microbatch is the first rows of the global batch.
    """
    rows = global_batch[0].shape[0]
    if rows % dp_size:
        raise ValueError(f"global_batch_size ({rows}) must be divisible by the data-parallel "
                         f"size ({dp_size}) so every replica gets the same number of sequences (rule 3)")
    share = rows // dp_size
    return tuple(t[dp_rank * share:(dp_rank + 1) * share] for t in global_batch)


def split_microbatches(batch, num_microbatches: int) -> list[tuple]:
    """Cut a replica's batch into ``num_microbatches`` equal microbatches (along rows)."""
    rows = batch[0].shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(f"this replica's batch ({rows} sequences) must be divisible by "
                         f"num_microbatches ({num_microbatches}) (rule 3); choose one of "
                         f"{[m for m in range(1, rows + 1) if rows % m == 0]}")
    return list(zip(*(t.chunk(num_microbatches) for t in batch)))
