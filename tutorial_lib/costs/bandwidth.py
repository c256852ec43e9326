"""Which parallelism needs which bandwidth: chapter 1's table, byte formulas and links.

Chapter 1 (communicator groups) prints :func:`bandwidth_table` and compares the
per-op volumes below with the rated bandwidth of typical links
(:func:`link_bandwidths`, :func:`transfer_seconds`).  Pure Python: no numpy, no torch.

Symbols: b micro-batch size (sequences), s sequence length held by a rank
(already divided by CP when context parallelism is on), h hidden size, h_kv
the key/value width (h without grouped-query attention), k experts per token,
E experts, P parameters held by a rank, d bytes per element.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelismTraffic:
    """One row of the table: the communication one parallelism adds to a training step."""

    parallelism: str
    """``TP``, ``CP``, ``EP``, ``DP`` or ``PP``."""
    collective: str
    """The collective(s) it issues, and the variant Megatron uses."""
    frequency: str
    """How often: per layer, per MoE layer, per microbatch, per step."""
    volume_per_op: str
    """Bytes handed to one collective by one rank, as a formula in the symbols above."""
    bandwidth_need: str
    """How much it suffers from a slow link, and why."""
    typical_link: str
    """Where it is usually placed: inside a node (NVLink) or across nodes (InfiniBand)."""


def bandwidth_table() -> list[ParallelismTraffic]:
    """Which parallelism uses which collective, how often, on what volume, over which link.

    Ordered from the most to the least bandwidth-hungry, which is also the
    order Megatron lays the axes out in the rank grid: TP fastest-varying, so a
    TP group sits on neighbouring GPUs of one node.
    """
    return [
        ParallelismTraffic(
            "TP", "all-reduce of activations (reduce-scatter + all-gather with sequence parallelism)",
            "every layer: 2 in the forward pass (after attention, after the MLP), 2 in the backward",
            "b*s*h*d bytes per all-reduce: O(b s h), the layer's whole activation",
            "highest: on the critical path of every layer, with little compute to hide it behind",
            "inside a node (NVLink)"),
        ParallelismTraffic(
            "CP", "all-gather of K and V forward, reduce-scatter of dK, dV backward "
                  "(Megatron passes K/V chunks around a ring with send/recv)",
            "every attention layer, forward and backward",
            "2*b*s*h_kv*d bytes: this rank's K and V chunk, O(b s h_kv); each rank receives "
            "CP-1 such chunks per layer",
            "high: every layer, but overlapped with the attention computation",
            "inside a node, or across nodes for very long sequences"),
        ParallelismTraffic(
            "EP", "all-to-all: dispatch tokens to their experts, combine the results back",
            "every MoE layer: 2 in the forward pass, 2 in the backward",
            "b*s*h*k*d bytes per all-to-all: O(b s h k), each of the rank's b*s tokens goes to "
            "k experts; with E experts spread evenly over EP ranks, (EP-1)/EP of it leaves the rank",
            "high: every MoE layer, every pair of ranks at once, uneven when routing is unbalanced",
            "inside a node when it fits, otherwise InfiniBand"),
        ParallelismTraffic(
            "DP", "all-reduce of gradients (reduce-scatter of gradients + all-gather of "
                  "parameters with a distributed optimizer)",
            "once per optimizer step, in buckets overlapped with the backward pass",
            "P*d bytes: O(params), the gradients of every parameter this rank holds",
            "moderate: the largest volume, but only once per step and mostly hidden",
            "across nodes (InfiniBand)"),
        ParallelismTraffic(
            "PP", "send/recv of activations (forward) and their gradients (backward)",
            "every microbatch at every stage boundary, forward and backward",
            "b*s*h*d bytes: O(b s h), one microbatch's activation at the boundary "
            "(divided by TP when sequence parallelism scatters it)",
            "lowest: point-to-point between neighbouring stages, small and infrequent",
            "across nodes (InfiniBand)"),
    ]


def tp_all_reduce_bytes(b: int, s: int, h: int, d: int = 2) -> int:
    """Bytes of one TP all-reduce: the activation ``b * s * h`` elements of ``d`` bytes."""
    return b * s * h * d


def dp_gradient_bytes(params: int, d: int = 4) -> int:
    """Bytes of one DP gradient all-reduce: ``params * d`` (fp32 gradients by default)."""
    return params * d


def pp_activation_bytes(b: int, s: int, h: int, d: int = 2) -> int:
    """Bytes sent across one pipeline stage boundary per microbatch: ``b * s * h * d``."""
    return b * s * h * d


@dataclass(frozen=True)
class LinkSpec:
    """A typical interconnect and its rated (vendor spec, peak) bandwidth."""

    name: str
    """The link, e.g. ``NVLink 4 (H100 SXM)``."""
    gb_per_s_per_direction: float
    """GB/s (10^9 bytes) one way: what a one-directional transfer can reach at best."""
    gb_per_s_bidirectional: float
    """GB/s both ways together: the figure vendors usually quote."""
    connects: str
    """What it connects."""
    source: str
    """Where the figure comes from: vendor specifications, not measurements."""


def link_bandwidths() -> list[LinkSpec]:
    """Typical link bandwidths (vendor spec figures, peak; real transfers reach somewhat less)."""
    return [
        LinkSpec("NVLink 4 (H100 SXM, 18 links)", 450.0, 900.0,
                 "GPU to GPU inside a node, through NVSwitch",
                 "vendor spec (NVIDIA H100 datasheet: 900 GB/s total)"),
        LinkSpec("PCIe Gen5 x16", 64.0, 128.0,
                 "GPU to CPU or network card; GPU to GPU in PCIe-only servers",
                 "vendor spec (PCI-SIG: 32 GT/s per lane, ~64 GB/s per direction)"),
        LinkSpec("InfiniBand NDR, one 400 Gb/s port", 50.0, 100.0,
                 "node to node, usually one port per GPU",
                 "vendor spec (NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s per port)"),
    ]


def transfer_seconds(nbytes: float, link: LinkSpec) -> float:
    """Seconds to push ``nbytes`` one way at the link's rated bandwidth (a lower bound)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return nbytes / (link.gb_per_s_per_direction * 1e9)
