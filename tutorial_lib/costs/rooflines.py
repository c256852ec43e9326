"""Rooflines per technique: where each turns communication-bound, on NVLink and on the network.

A technique pays while the compute it splits hides the bytes it moves.  Its **arithmetic
intensity** is the FLOPs a rank computes per byte it sends for that technique (one
chunk-microbatch for TP, CP, EP and PP; one step for DP's gradients); a link's **ridge** is
the achieved FLOP/s (peak x the matmul efficiency) over the link's bytes per second.  Below
the ridge the technique's transfers take longer than the compute they accompany: it is
communication-bound on that link, however well it overlaps.  Every number comes from
:mod:`~tutorial_lib.costs.step_time` (the compute) and
:func:`~tutorial_lib.costs.alpha_beta.ring_bytes_sent` (the bytes), for NVLink and for
the network alike, so the chapter can show where TP stops paying as it leaves the node.
Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .alpha_beta import ring_bytes_sent
from .hardware import Cluster
from .memory_model import attention_widths
from .step_time import (BYTES, GRADIENT_BYTES, Layout, chunk_costs, check_layout,
                        rank_parameters)

__all__ = ["Roofline", "rooflines"]


@dataclass(frozen=True)
class Roofline:
    """One technique's intensity against the two links' ridges."""

    technique: str
    flops: float
    """FLOPs one rank computes alongside the bytes below."""
    bytes: float
    """Bytes one rank sends for the technique (the ring algorithms' counts)."""
    ridge_nvlink: float
    ridge_network: float
    """FLOP per byte at which compute and transfer take equally long on each link."""

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def bound_on_nvlink(self) -> bool:
        return self.intensity < self.ridge_nvlink

    @property
    def bound_on_network(self) -> bool:
        return self.intensity < self.ridge_network


def rooflines(model: ModelConfig, cluster: Cluster, layout: Layout, global_batch_size: int,
              efficiency: float, precision: str = "bf16") -> list[Roofline]:
    """The roofline of each technique the layout uses (size > 1), in the order TP, CP,
    EP, PP, DP."""
    check_layout(model, layout, global_batch_size)
    l = layout
    costs = chunk_costs(model, cluster, l, efficiency, precision)
    rate = cluster.gpu.peak_flops(precision) * efficiency
    ridges = (rate / cluster.intra_node.bandwidth, rate / cluster.inter_node.bandwidth)
    chunks = 2 if l.schedule == "dualpipev" else l.virtual_pipeline_size
    per_chunk = costs.layers          # the heaviest rank's layers per chunk
    chunk_flops = (costs.forward_compute + costs.backward_compute) * rate
    tokens = l.micro_batch_size * model.seq_length // l.cp
    h = model.hidden_size
    out = []
    if l.tp > 1:
        per_layer = 6 if l.recompute_granularity == "full" else 4
        sent = per_chunk * per_layer * ring_bytes_sent("all_reduce", tokens * h * BYTES, l.tp)
        out.append(Roofline("TP", chunk_flops, sent, *ridges))
    if l.cp > 1:
        _, k, v = attention_widths(model)
        sent = per_chunk * 3 * (l.cp - 1) * tokens * (k + v) * BYTES / l.tp
        out.append(Roofline("CP", chunk_flops, sent, *ridges))
    if model.num_experts and l.ep > 1:
        moe_layers = costs.moe_layers
        rows = tokens // l.tp * model.moe_router_topk
        sent = moe_layers * 4 * ring_bytes_sent("all_to_all", rows * h * BYTES, l.ep)
        out.append(Roofline("EP", chunk_flops, sent, *ridges))
    if l.pp > 1:
        boundary = tokens * h * BYTES / (l.tp if l.tp > 1 else 1)
        out.append(Roofline("PP", chunk_flops, 2 * boundary, *ridges))
    if l.dp * l.cp > 1:
        dense, experts = rank_parameters(model, l)
        step_flops = chunk_flops * chunks * l.num_microbatches(global_batch_size)
        sent = ring_bytes_sent("all_reduce", dense * GRADIENT_BYTES, l.dp * l.cp)
        if experts:  # routed experts' gradients over the expert-data-parallel group
            sent += ring_bytes_sent("all_reduce", experts * GRADIENT_BYTES,
                                    l.expert_data_parallel_size)
        out.append(Roofline("DP", step_flops, sent, *ridges))
    return out
