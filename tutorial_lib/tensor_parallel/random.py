"""One seed, one master weight, many shards (the seeds of Megatron's ``random.py``).

Every model derives its parts' seeds with :func:`derive_seed`, and every parallel layer
draws the *full* master weight from ``torch.Generator().manual_seed(seed)`` exactly as its
serial counterpart would (:func:`init_linear_master`, :func:`init_embedding_master`), on the
CPU, then keeps its slice (Megatron's ``_initialize_affine_weight_cpu``): every shard *is*
the matching slice of the serial layer, on every device (:mod:`tutorial_lib.devices`).
"""
from __future__ import annotations

import math

import torch

from ..devices import cpu_generator

__all__ = ["derive_seed", "init_linear_master", "init_embedding_master"]


# --- seeds and master weights --------------------------------------------------------------


def derive_seed(seed: int, component: int) -> int:
    """The seed of one part of a module seeded ``seed``: ``1000 * seed + component``.

    Every model derives its weights' seeds this way, and only this way (the GPT's
    embeddings and blocks, a block's sublayers, an MoE layer's router and experts), so
    distinct parts never share random numbers and every rank derives the same seeds:
    every TP / EP rank draws the same master weight and keeps its own slice.
    """
    return 1000 * seed + component


def init_linear_master(input_size: int, output_size: int, bias: bool = True, seed: int = 0):
    """The full ``[output_size, input_size]`` weight (and bias) a serial layer would get.

    ``torch.nn.Linear``'s distribution, U(-1/sqrt(in), 1/sqrt(in)), drawn from one seeded
    CPU generator (weight first, then bias), on the CPU, so every TP size and every
    device slices the same numbers.
    """
    generator = cpu_generator(seed)
    bound = 1.0 / math.sqrt(input_size)
    weight = torch.empty(output_size, input_size, device="cpu").uniform_(
        -bound, bound, generator=generator)
    bias_ = (torch.empty(output_size, device="cpu").uniform_(-bound, bound, generator=generator)
             if bias else None)
    return weight, bias_


def init_embedding_master(num_embeddings: int, embedding_dim: int, seed: int = 0) -> torch.Tensor:
    """The full ``[num_embeddings, embedding_dim]`` table, N(0, 1) like ``torch.nn.Embedding``
    (on the CPU, from a seeded CPU generator)."""
    generator = cpu_generator(seed)
    return torch.empty(num_embeddings, embedding_dim, device="cpu").normal_(
        0.0, 1.0, generator=generator)
