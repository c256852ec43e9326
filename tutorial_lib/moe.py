"""Mixture of experts with expert parallelism: router, experts, all-to-all dispatch and combine.

Read it top to bottom, like the chapter:

1. **The router** (:class:`Router`, fp32).  Each token's affinity to each of the ``N``
   routed experts: ``softmax`` (DeepSeekMoE, DeepSeek-V2: the gates are the top-k
   softmax probabilities) or ``sigmoid`` (DeepSeek-V3: the chosen affinities are
   normalised to sum to 1, then multiplied by ``routed_scaling_factor``).  Two options
   change *which* experts are chosen, never the gate values: a per-expert bias
   (V3's auxiliary-loss-free balancing) and limited routing: a token's experts live on
   at most ``M`` of ``D`` groups, V2's devices ranked by their best affinity, V3's nodes
   by the sum of their ``K/M`` best (:func:`group_scores`).
2. **The experts** (:class:`RoutedExperts`, :class:`SharedExperts`).  Fine-grained
   routed experts are small SwiGLU MLPs; shared experts are one dense SwiGLU every
   token goes through, split over TP like a dense MLP.  All ``N`` routed experts are drawn from one seed and each EP
   rank keeps its ``N/EP`` of them, so the EP layer *is* the serial layer, cut up.
3. **The dispatcher** (:class:`AllToAllDispatcher`, on the ``"ep"`` group).  Count tokens
   per expert, exchange the counts (an all-to-all of int64 metadata), permute the token
   copies by destination rank, one uneven all-to-all, (with ETP > 1: gather the counts and
   rows over the ``"expert_tp"`` group, as Megatron's ``dispatch_postprocess``), sort what
   arrived by local expert; after the experts, the exact mirror: un-sort, (reduce-scatter
   the partial outputs over ``"expert_tp"``), all-to-all with the splits swapped,
   un-permute.  The all-to-all is an autograd function whose backward is the reverse
   all-to-all.  Optional capacity: drop the lowest-gate copies over
   ``ceil(capacity_factor * T * K / N)`` per expert (or V2's budget per device,
   :func:`device_capacity_keep_mask`).  That dispatcher moves one row per (token, k)
   copy, so limited routing changes no byte; ``deduplicate=True`` sends a token once per
   destination node and rank and fans it out on arrival, as DeepEP does
   (:meth:`AllToAllDispatcher.dispatch_deduplicated`).
4. **The layer** (:class:`MoELayer`): router -> (capacity) -> dispatch -> experts ->
   combine -> weighted sum in fp32 (+ shared experts), with sequence parallelism around
   it when TP > 1, plus the DeepSeek balance losses of :mod:`tutorial_lib.moe_balance`
   (on sigmoid affinities normalised per token; under sequence parallelism counted over
   the TP group, so the router gradient is the serial one).
5. **Gradients**: synced by :class:`tutorial_lib.data_parallel.DataParallel`, experts over
   the expert-data-parallel group but divided by the *dense* data-parallel size times CP
   (why: see the end of this module and :data:`tutorial_lib.data_parallel.DOMAINS`).

Layout: the layer takes and returns ``[s, b, h]`` like :mod:`tutorial_lib.transformer`;
inside, tokens are the rows of ``[T, h]`` with ``T = s * b`` in ``s``-major order
(``x.reshape(-1, h)``).  Expert ``e`` lives on EP rank ``e // (N / EP)``: each rank holds a
contiguous block of experts, so sorting copies by expert id also sorts them by rank.

``ep_group`` and ``tp_group`` are group kinds, or ``None`` for *serial*; outside a launch
(no groups built) every layer is its own serial self, so the reference is this same code.
With a group of one rank nothing is communicated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import comm, fp8, moe_balance, parallel_state
from .config import ConfigError
from .data_parallel import mark_tensor_parallel, set_grad_domain
from .devices import cpu_generator, resolve_device
from .tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    derive_seed,
    divide,
    gather_from_sequence_parallel_region,
    init_linear_master,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .trace import get_tracer

__all__ = [
    "RouterOutput", "compute_scores", "limit_to_devices", "select_experts", "gates_from_scores",
    "Router", "swiglu", "init_experts_master", "RoutedExperts", "SharedExperts",
    "capacity_per_expert", "capacity_keep_mask", "device_capacity_keep_mask",
    "all_to_all", "DispatchState", "DedupDispatchState", "group_scores", "LIMIT_RULES",
    "AllToAllDispatcher", "weighted_sum_of_copies", "MoELayer",
    "AllToAll",
]


# Which part of an MoE layer a derived seed belongs to (after a block's sublayers 0-3).
ROUTER, ROUTED_EXPERTS, SHARED_EXPERTS = 10, 11, 12


# --- 1. the router -------------------------------------------------------------------------


class RouterOutput(NamedTuple):
    """What the router hands to the dispatcher (and to the balance losses)."""

    gates: torch.Tensor
    """``[T, K]`` fp32: the weight of each chosen expert's output in the token's sum."""
    topk_idx: torch.Tensor
    """``[T, K]`` int64: the chosen experts, best first."""
    scores: torch.Tensor
    """``[T, N]`` fp32: softmax probabilities or sigmoid affinities over all experts (no bias)."""
    logits: torch.Tensor
    """``[T, N]`` fp32: the raw router outputs (for the z-loss)."""


def compute_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Affinities from logits: ``softmax`` over experts (V2) or an independent ``sigmoid`` (V3)."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")


#: How device- or node-limited routing ranks a token's groups of experts, by paper.
LIMIT_RULES = ("v2", "v3")


def group_scores(selection_scores: torch.Tensor, num_groups: int, topk: int,
                 group_limit: int, rule: str) -> torch.Tensor:
    """``[T, D]``: how much each token wants each of the ``D`` groups of ``N/D``
    experts.

    * ``"v2"``: DeepSeek-V2's device-limited routing (arXiv:2405.04434, section 2.2.2)
      ranks a device by the single highest affinity among its experts.
    * ``"v3"``: DeepSeek-V3's node-limited routing (arXiv:2412.19437, section 2.1.2)
      ranks a node by the *sum* of its ``K/M`` highest affinities (``K`` experts per
      token, ``M`` groups kept), so a node with two good experts can beat a node with
      one excellent one.  Megatron-Core 0.20.0 (``group_limited_topk`` in
      ``moe_utils.py``) uses this sum, ``topk // group_topk`` of them, for both uses.

    While ``K < 2M`` the two rules agree (one affinity per group is summed).
    """
    tokens, num_experts = selection_scores.shape
    per_group = divide(num_experts, num_groups, "num_experts", by="num_devices")
    grouped = selection_scores.view(tokens, num_groups, per_group)
    if rule == "v2":
        return grouped.amax(dim=-1)
    if rule == "v3":
        per_node = topk // group_limit
        if per_node < 1:
            raise ValueError(f"the V3 rule sums each node's K/M best affinities, but "
                             f"topk (K = {topk}) < device_limit (M = {group_limit}); "
                             f"use rule='v2' or M <= K")
        return grouped.topk(min(per_node, per_group), dim=-1).values.sum(dim=-1)
    raise ValueError(f"rule must be one of {LIMIT_RULES} (V2: best single affinity, "
                     f"V3: sum of the K/M best), got {rule!r}")


def limit_to_devices(selection_scores: torch.Tensor, num_devices: int,
                     device_limit: int, topk: int = 1,
                     rule: str = "v2") -> torch.Tensor:
    """Keep only each token's best ``M`` devices (V2) or nodes (V3), ranked by ``rule``.

    The ``M`` groups with the highest :func:`group_scores` stay; every expert elsewhere
    gets ``-inf`` so top-k cannot pick it.
    """
    tokens = selection_scores.shape[0]
    if not 1 <= device_limit <= num_devices:
        raise ValueError(f"device_limit (M = {device_limit}) must be between 1 and the "
                         f"number of devices (D = {num_devices})")
    scores = group_scores(selection_scores, num_devices, topk, device_limit, rule)
    best = torch.topk(scores, device_limit, dim=-1).indices  # [T, M]
    allowed = torch.zeros(tokens, num_devices, dtype=torch.bool,
                          device=selection_scores.device)
    allowed.scatter_(1, best, True)
    per_device = selection_scores.shape[1] // num_devices
    allowed = allowed.repeat_interleave(per_device, dim=1)  # [T, N]
    return selection_scores.masked_fill(~allowed, float("-inf"))


def select_experts(scores: torch.Tensor, topk: int, bias: torch.Tensor | None = None,
                   device_limit: int | None = None, num_devices: int = 1,
                   rule: str = "v2") -> torch.Tensor:
    """The ``[T, K]`` experts each token goes to: top-k of ``scores + bias`` (within M
    groups).

    The bias steers the *choice* only (DeepSeek-V3, section 2.1.2): the gates come from
    the unbiased scores (:func:`gates_from_scores`), so the bias never enters the output
    except through the choice.  ``device_limit`` keeps each token within ``M`` of the
    ``num_devices`` groups, ranked by ``rule`` (:func:`group_scores`: ``"v2"`` devices,
    ``"v3"`` nodes).  With no bias and no limit this is ``torch.topk(scores, K)``.
    """
    selection = scores if bias is None else scores + bias
    if device_limit is not None:
        per_device = scores.shape[-1] // num_devices
        if topk > device_limit * per_device:
            raise ValueError(f"topk ({topk}) exceeds the experts on device_limit "
                             f"({device_limit}) devices of {per_device} experts each")
        selection = limit_to_devices(selection, num_devices, device_limit, topk, rule)
    return torch.topk(selection, topk, dim=-1).indices


def gates_from_scores(scores: torch.Tensor, topk_idx: torch.Tensor, normalize: bool,
                      routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The gate of each chosen expert: its (unbiased) score, optionally normalised over
    the ``K`` chosen ones (V3), times ``routed_scaling_factor``."""
    gates = scores.gather(-1, topk_idx)
    if normalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return gates * routed_scaling_factor


class Router(torch.nn.Module):
    """A linear gate ``[N, h]`` (no bias) and the selection rules above, all in fp32.

    ``normalize_topk``: ``None`` picks each paper's choice (sigmoid: normalise, as V3;
    softmax: do not, as V2).  ``device_limit`` (``M``) with ``num_devices`` (``D``, the
    groups the experts are spread over: EP ranks for V2, nodes for V3) turns on limited
    routing; it is a property of the model, so the serial reference passes the same
    ``num_devices``.  ``device_limit_rule``: how groups are ranked (:func:`group_scores`);
    ``None`` picks each paper's rule like ``normalize_topk`` does (sigmoid: ``"v3"``,
    softmax: ``"v2"``).  ``use_expert_bias`` adds the ``expert_bias`` buffer (updated
    outside backward by :func:`moe_balance.update_expert_bias`; zero at start).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int,
                 score_function: str = "softmax", routed_scaling_factor: float = 1.0,
                 normalize_topk: bool | None = None, device_limit: int | None = None,
                 num_devices: int = 1, use_expert_bias: bool = False, seed: int = 0,
                 device_limit_rule: str | None = None, device=None):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk ({topk}) must be between 1 and num_experts ({num_experts})")
        compute_scores(torch.zeros(1, 1, device="cpu"), score_function)  # reject an unknown name now
        divide(num_experts, num_devices, "num_experts", by="num_devices")
        self.num_experts, self.topk, self.score_function = num_experts, topk, score_function
        self.routed_scaling_factor = routed_scaling_factor
        sigmoid = score_function == "sigmoid"
        self.normalize_topk = sigmoid if normalize_topk is None else normalize_topk
        self.device_limit, self.num_devices = device_limit, num_devices
        if device_limit_rule is None:
            device_limit_rule = "v3" if sigmoid else "v2"
        if device_limit_rule not in LIMIT_RULES:
            raise ValueError(f"device_limit_rule must be one of {LIMIT_RULES}, got "
                             f"{device_limit_rule!r}")
        self.device_limit_rule = device_limit_rule
        device = resolve_device(device)
        weight, _ = init_linear_master(hidden_size, num_experts, bias=False, seed=seed)
        self.weight = torch.nn.Parameter(weight.to(device))
        bias = (torch.zeros(num_experts, dtype=torch.float32, device=device) if use_expert_bias
                else None)
        self.register_buffer("expert_bias", bias)  # None: no bias, plain top-k

    def forward(self, tokens: torch.Tensor) -> RouterOutput:
        logits = F.linear(tokens.float(), self.weight.float())  # routing in fp32
        scores = compute_scores(logits, self.score_function)
        topk_idx = select_experts(scores.detach(), self.topk, self.expert_bias,
                                  self.device_limit, self.num_devices,
                                  self.device_limit_rule)
        gates = gates_from_scores(scores, topk_idx, self.normalize_topk,
                                  self.routed_scaling_factor)
        return RouterOutput(gates, topk_idx, scores, logits)


# --- 2. the experts ------------------------------------------------------------------------


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, the feed-forward of every DeepSeek expert."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def init_experts_master(num_experts: int, hidden_size: int, ffn_hidden_size: int, seed: int = 0):
    """All ``N`` experts' ``(gate [N, f, h], up [N, f, h], down [N, h, f])`` from one seed.

    ``nn.Linear``'s U(-1/sqrt(in), 1/sqrt(in)), drawn gate, up, down from one CPU generator,
    on the CPU: every EP size and every device slices the same numbers.
    """
    generator = cpu_generator(seed)
    bound_in, bound_ffn = 1.0 / math.sqrt(hidden_size), 1.0 / math.sqrt(ffn_hidden_size)
    shapes = [((num_experts, ffn_hidden_size, hidden_size), bound_in)] * 2
    shapes.append(((num_experts, hidden_size, ffn_hidden_size), bound_ffn))
    return tuple(torch.empty(shape, device="cpu").uniform_(-b, b, generator=generator)
                 for shape, b in shapes)


class RoutedExperts(torch.nn.Module):
    """This EP rank's ``N/EP`` experts, ``[first_expert, first_expert + N/EP)``.

    Weights are stacked ``[N/EP, ...]`` and marked ``allreduce_group="expert_dp"``: each
    expert exists on the ``EDP`` ranks that share this EP coordinate, not on all DP
    ranks.

    Expert tensor parallelism (``etp_size > 1``, the ``expert_tp`` group): each expert's
    SwiGLU is split like a dense MLP, the gate and up projections by output rows (column
    parallel: ``[N/EP, f/ETP, h]``, my ``etp_rank``-th block of the ``f`` channels), the down
    projection by input columns (row parallel: ``[N/EP, h, f/ETP]``), so :meth:`forward`
    returns a *partial* sum over the ETP ranks that the dispatcher reduce-scatters.  The
    shards are marked tensor-parallel over ``expert_tp`` (the gradient norm adds each
    rank's shard).  Megatron-Core 0.20.0 splits its grouped experts the same way
    (``experts.py``, ``TEGroupedMLP``: ``linear_fc1`` column-parallel, ``linear_fc2``
    row-parallel over the expert-TP group).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 ep_size: int = 1, ep_rank: int = 0, seed: int = 0, device=None,
                 etp_size: int = 1, etp_rank: int = 0):
        super().__init__()
        self.num_local_experts = divide(num_experts, ep_size, "num_experts",
                                        by="expert_model_parallel_size")
        self.first_expert = ep_rank * self.num_local_experts
        mine = slice(self.first_expert, self.first_expert + self.num_local_experts)
        width = divide(ffn_hidden_size, etp_size, "moe_ffn_hidden_size",
                       by="expert_tensor_parallel_size")
        channels = slice(etp_rank * width, (etp_rank + 1) * width)  # my f/ETP channels
        masters = init_experts_master(num_experts, hidden_size, ffn_hidden_size, seed)
        for name, full, dim in zip(("weight_gate", "weight_up", "weight_down"), masters, (1, 1, 2)):
            shard = full[mine].narrow(dim, channels.start, width)
            param = torch.nn.Parameter(shard.to(resolve_device(device), copy=True))
            if etp_size > 1:
                mark_tensor_parallel(param, partition_dim=dim)
            setattr(self, name, set_grad_domain(param, "expert_dp"))

    def forward(self, rows: torch.Tensor,
                tokens_per_local_expert: list[int]) -> torch.Tensor:
        """``rows`` sorted by local expert, ``tokens_per_local_expert[i]`` of them for
        expert i (with ETP > 1: this rank's partial sums)."""
        blocks = rows.split(tokens_per_local_expert)
        weights = zip(self.weight_gate, self.weight_up, self.weight_down)
        outputs = [swiglu(block, *expert) for block, expert in zip(blocks, weights)]
        return torch.cat(outputs)  # an expert with no rows returns [0, h]; zero grads


class SharedExperts(torch.nn.Module):
    """``num_shared_experts`` always-on experts, merged into one SwiGLU of their total width,
    split over TP like a dense MLP, as Megatron-Core's ``SharedExpertMLP`` (an ``MLP``).

    Each TP rank keeps ``f/TP`` of the channels: rows of the gate and up projections
    (column-parallel), columns of the down projection (row-parallel), drawn from the same
    seeded master weights at every TP size.  With ``sequence_parallel`` (what
    :class:`MoELayer` uses when TP > 1) the input is this rank's ``[s/TP, ...]`` tokens:
    all-gathered over TP (backward: reduce-scatter), run through the shard, and the
    partial sums reduce-scattered back to ``[s/TP, ...]`` (backward: all-gather), the two
    collectives of Megatron's ``SharedExpertMLP.pre_forward_comm`` and
    ``post_forward_comm``.  Without it the input is whole on every TP rank and the
    output all-reduced.  Each shard sees every token of the sequence, so its gradient is
    complete on its rank: no TP sum (the parameters are TP shards, not
    ``sequence_parallel`` replicas).  ``tp_group=None``: the whole expert, serial.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, seed: int = 0, device=None,
                 tp_group: str | None = None, sequence_parallel: bool = False):
        super().__init__()
        device = resolve_device(device)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        tp_size, tp_rank = parallel_state.group_size(tp_group), parallel_state.group_rank(tp_group)
        divide(ffn_hidden_size, tp_size, "moe_ffn_hidden_size * num_shared_experts",
               by="tensor_model_parallel_size")
        gate, _ = init_linear_master(hidden_size, ffn_hidden_size, bias=False, seed=3 * seed)
        up, _ = init_linear_master(hidden_size, ffn_hidden_size, bias=False, seed=3 * seed + 1)
        down, _ = init_linear_master(ffn_hidden_size, hidden_size, bias=False, seed=3 * seed + 2)
        for name, full, dim in (("weight_gate", gate, 0), ("weight_up", up, 0),
                                ("weight_down", down, 1)):
            shard = full.chunk(tp_size, dim=dim)[tp_rank]  # my f/TP channels
            param = torch.nn.Parameter(shard.to(device, copy=True))
            # flagged at every TP size, as the tensor-parallel linears flag theirs
            setattr(self, name, mark_tensor_parallel(param, partition_dim=dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if parallel_state.group_size(self.tp_group) == 1:
            return swiglu(tokens, self.weight_gate, self.weight_up, self.weight_down)
        if self.sequence_parallel:  # my s/TP tokens -> every token
            total = gather_from_sequence_parallel_region(tokens, self.tp_group)
        else:
            total = copy_to_tensor_model_parallel_region(tokens, self.tp_group)
        partial = swiglu(total, self.weight_gate, self.weight_up, self.weight_down)
        if self.sequence_parallel:  # summed over the shards, my tokens kept
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)


# --- 3. the dispatcher ---------------------------------------------------------------------


def capacity_per_expert(num_tokens: int, topk: int, num_experts: int,
                        capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * K / N)``: copies each expert accepts from this
    rank's tokens (with ``num_experts`` the number of devices: each device's budget)."""
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


def _keep_best(bucket: torch.Tensor, priority: torch.Tensor, num_buckets: int,
               capacity: int) -> torch.Tensor:
    """Flat bool: in each bucket, the ``capacity`` copies of highest priority (ties: the
    lower flat index)."""
    by_priority = torch.argsort(priority, descending=True, stable=True)
    order = by_priority[torch.argsort(bucket[by_priority], stable=True)]
    counts = torch.bincount(bucket, minlength=num_buckets)
    first_of_bucket = torch.cumsum(counts, 0) - counts
    place = torch.arange(bucket.numel(), device=bucket.device) - first_of_bucket[bucket[order]]
    keep = torch.zeros(bucket.numel(), dtype=torch.bool, device=bucket.device)
    keep[order] = place < capacity
    return keep


def capacity_keep_mask(topk_idx: torch.Tensor, gates: torch.Tensor, num_experts: int,
                       capacity_factor: float) -> torch.Tensor:
    """``[T, K]`` bool: True for the copies kept; each expert keeps its highest-gate copies.

    Per rank, before dispatch (Megatron's drop policy ``probs``): the capacity is computed
    from this rank's ``T`` tokens.  Equal gates keep the lower flat index ``t * K + k``.
    """
    tokens, topk = topk_idx.shape
    capacity = capacity_per_expert(tokens, topk, num_experts, capacity_factor)
    keep = _keep_best(topk_idx.reshape(-1), gates.detach().reshape(-1), num_experts, capacity)
    return keep.view_as(topk_idx)


def device_capacity_keep_mask(topk_idx: torch.Tensor, gates: torch.Tensor,
                              num_experts: int, num_devices: int,
                              capacity_factor: float = 1.0,
                              never_drop: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V2's device-level token dropping (arXiv:2405.04434, section 2.2.4).

    Each device accepts ``ceil(capacity_factor * T * K / D)`` of this rank's copies (V2:
    capacity factor 1.0, the average budget); beyond that, the copies with the lowest
    affinity (gate) on that device are dropped, whichever of its experts they chose.
    ``never_drop`` (``[T]`` bool) marks tokens that keep every copy whatever the budget:
    V2 exempts the tokens of about 10% of its training sequences, so that the model also
    learns to run without dropping.  Returns ``[T, K]`` bool, True for the copies kept.
    """
    tokens, topk = topk_idx.shape
    per_device = divide(num_experts, num_devices, "num_experts", by="num_devices")
    capacity = capacity_per_expert(tokens, topk, num_devices, capacity_factor)
    device = topk_idx.reshape(-1) // per_device
    priority = gates.detach().reshape(-1).double()
    protected = torch.zeros(tokens * topk, dtype=torch.bool, device=topk_idx.device)
    if never_drop is not None:
        protected = never_drop.reshape(-1, 1).expand(tokens, topk).reshape(-1)
        priority = priority + protected.double() * (1 + priority.abs().sum())  # first
    keep = _keep_best(device, priority, num_devices, capacity) | protected
    return keep.view_as(topk_idx)


class AllToAll(torch.autograd.Function):
    """Forward: rows ``input_splits[j]`` go to EP rank j.  Backward: the reverse
    all-to-all.

    ``tags``: trace tags both directions carry (``payload``, default ``"tokens"``, and
    any others, such as the deduplicating dispatcher's ``leg``)."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, op_name, tags=None):
        ctx.group, ctx.op_name = group, op_name
        ctx.splits = (output_splits, input_splits)
        ctx.tags = {"payload": "tokens", **(tags or {})}
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        with get_tracer().tags(op_name=op_name, phase="forward", **ctx.tags):
            return comm.all_to_all(out, x.contiguous(), group, output_splits,
                                   input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        with get_tracer().tags(op_name=ctx.op_name, phase="backward", **ctx.tags):
            comm.all_to_all(out, grad.contiguous(), ctx.group, input_splits,
                            output_splits)
        return out, None, None, None, None, None


def all_to_all(x: torch.Tensor, group: str | None, output_splits: list[int],
               input_splits: list[int], op_name: str, tags: dict | None = None) -> torch.Tensor:
    """Autograd-correct uneven all-to-all over ``group`` (identity on one rank)."""
    if parallel_state.group_size(group) == 1:
        return x
    return AllToAll.apply(x, group, list(output_splits), list(input_splits), op_name, tags)


@dataclass
class DispatchState:
    """What :meth:`AllToAllDispatcher.combine` needs to undo a dispatch exactly."""

    num_tokens: int
    topk: int
    send_positions: torch.Tensor
    """``[A]``: the flat index ``t * K + k`` of each copy sent, in send order."""
    input_splits: list[int]
    """Copies sent to each EP rank (rows of the dispatch all-to-all)."""
    output_splits: list[int]
    """Copies received from each EP rank."""
    local_order: torch.Tensor
    """The permutation that sorted the received rows by local expert."""
    tokens_per_expert: torch.Tensor
    """``[N]`` int64: copies this rank sent to each expert (after capacity)."""
    received_counts: torch.Tensor
    """``[EP, N/EP]`` int64: copies received from each rank for each local expert (with
    ETP > 1: ``[ETP * EP, N/EP]``, those of every rank of my expert-TP group, in its order)."""
    etp_splits: list[int] | None = None
    """With ETP > 1: the rows each expert-TP rank received from its all-to-all, the splits
    of the gather over ``expert_tp`` and of the reduce-scatter that undoes it."""

    @property
    def tokens_per_local_expert(self) -> list[int]:
        return self.received_counts.sum(dim=0).tolist()


@dataclass
class DispatchLeg:
    """One hop of the deduplicating dispatcher (:meth:`AllToAllDispatcher.dispatch_deduplicated`)."""

    name: str
    """``"node"``: one row per (token, destination node), to the rank of that node with the
    sender's local index; ``"rank"``: one row per (token, destination rank) in reach."""
    send_rows: torch.Tensor
    """``[R]``: which row (of the rows before this hop) each sent row is, in send order."""
    num_rows_before: int
    """Rows this rank held before the hop (its tokens, for the first hop)."""
    input_splits: list[int]
    """Rows sent to each EP rank."""
    output_splits: list[int]
    """Rows received from each EP rank."""


@dataclass
class DedupDispatchState:
    """What :meth:`AllToAllDispatcher.combine_deduplicated` needs to undo a dispatch."""

    num_tokens: int
    legs: list[DispatchLeg]
    num_rows: int
    """Rows that arrived on this rank (after the last hop)."""
    copy_rows: torch.Tensor
    """``[C]``: the arrived row each local copy was fanned out from, sorted by local expert."""
    copy_gates: torch.Tensor
    """``[C]`` fp32: each local copy's gate, travelled with its row (carries the gradient)."""
    tokens_per_expert: torch.Tensor
    """``[N]`` int64: copies this rank routed to each expert (after capacity)."""
    tokens_per_local_expert: list[int]


class AllToAllDispatcher:
    """Token-choice dispatch over the EP group (Megatron's ``MoEAlltoAllTokenDispatcher``).

    ``dispatch_precision`` and ``combine_precision``: how the token rows travel, each a
    ``(forward, backward)`` pair of :data:`tutorial_lib.fp8.PRECISIONS` (the dispatch's
    backward carries gradients the way a combine does, and vice versa), e.g. DeepSeek-V3's
    :data:`~tutorial_lib.fp8.DEEPSEEK_V3_DISPATCH` and ``DEEPSEEK_V3_COMBINE``.  ``None`` (the
    default): rows travel in their own dtype through :func:`all_to_all`, unchanged.  Either
    way each direction is one all-to-all with the same splits; the int64 counts exchange is
    never quantized.  Both are plain attributes: a precision recipe sets them after
    construction (:func:`tutorial_lib.precision.apply_recipe`).

    ``deduplicate`` (default ``False``): :meth:`dispatch` and :meth:`combine` move one row
    per (token, chosen expert) *copy*, as Megatron's all-to-all dispatcher does, so a token
    whose two experts share a rank crosses the network twice, and device- or node-limited
    routing changes no byte.  With ``True`` the layer calls :meth:`dispatch_deduplicated`
    and :meth:`combine_deduplicated` instead, DeepEP's scheme: a token travels once to each
    destination node (``ranks_per_node`` EP ranks, consecutive; ``None``: all of them, one
    node) and is forwarded once to each rank there, which fans it out to its experts; the
    combine returns one partial sum per rank, then per node.
    """

    def __init__(self, num_experts: int, ep_group: str | None = "ep",
                 dispatch_precision: tuple[str, str] | None = None,
                 combine_precision: tuple[str, str] | None = None,
                 deduplicate: bool = False, ranks_per_node: int | None = None,
                 etp_group: str | None = None):
        self.num_experts, self.ep_group, self.etp_group = num_experts, ep_group, etp_group
        self.ep_size = parallel_state.group_size(ep_group)
        self.ep_rank = parallel_state.group_rank(ep_group)
        self.etp_size = parallel_state.group_size(etp_group)
        if deduplicate and self.etp_size > 1:
            raise ConfigError("rule 5", f"the deduplicating dispatcher (DeepEP's scheme) runs "
                              f"whole experts only, but expert_tensor_parallel_size is "
                              f"{self.etp_size}; set expert_tensor_parallel_size=1 or "
                              f"deduplicate=False")
        self.num_local_experts = divide(num_experts, self.ep_size, "num_experts",
                                        by="expert_model_parallel_size")
        self.dispatch_precision = fp8.check_precision_pair(dispatch_precision)
        self.combine_precision = fp8.check_precision_pair(combine_precision)
        self.deduplicate = deduplicate
        self.ranks_per_node = self.ep_size if ranks_per_node is None else ranks_per_node
        if self.ranks_per_node < 1 or self.ep_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the EP size "
                             f"({self.ep_size}): each node holds a whole block of EP ranks; "
                             f"try a divisor of {self.ep_size}")

    def move_rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   op_name: str, precision, tags: dict | None = None) -> torch.Tensor:
        """The token all-to-all: as is (``precision=None``) or encoded by :func:`fp8.all_to_all`
        (whose backward event carries no ``tags``)."""
        if precision is None:
            return all_to_all(rows, self.ep_group, output_splits, input_splits, op_name, tags)
        with get_tracer().tags(**(tags or {})):
            return fp8.all_to_all(rows, self.ep_group, output_splits, input_splits, op_name,
                                  fp8.check_precision_pair(precision))

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``[EP, N/EP]`` sent counts -> ``[EP, N/EP]`` received: row j is what rank j sends me."""
        if self.ep_size == 1:
            return counts.clone()
        received = torch.empty_like(counts)
        with get_tracer().tags(op_name="dispatch", phase="forward", payload="counts"):
            return comm.all_to_all(received, counts.contiguous(), self.ep_group)

    def dispatch(self, tokens: torch.Tensor, topk_idx: torch.Tensor,
                 keep: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[int], DispatchState]:
        """``tokens [T, h]``, ``topk_idx [T, K]`` -> rows for my local experts, sorted by
        expert.

        Returns ``(expert_input [R, h], tokens_per_local_expert, state)``.
        """
        num_tokens, topk = topk_idx.shape
        ep, local = self.ep_size, self.num_local_experts
        positions = torch.arange(num_tokens * topk, device=topk_idx.device)
        if keep is not None:
            positions = positions[keep.reshape(-1)]
        experts = topk_idx.reshape(-1)[positions]
        # 1. count copies per expert; 2. tell every rank how many rows to expect
        tokens_per_expert = torch.bincount(experts, minlength=self.num_experts)
        received_counts = self._exchange_counts(tokens_per_expert.view(ep, local))
        input_splits = tokens_per_expert.view(ep, local).sum(dim=1).tolist()
        output_splits = received_counts.sum(dim=1).tolist()
        # 3. permute: sorting by expert id groups the copies by destination rank too
        send_positions = positions[torch.argsort(experts, stable=True)]
        rows = tokens[send_positions // topk]
        # 4. the uneven all-to-all
        received = self.move_rows(rows, output_splits, input_splits, "dispatch",
                                   self.dispatch_precision)
        # 4b. expert tensor parallelism: my ETP peers hold other shards of the same experts,
        # so every ETP rank gathers the rows all of them received (uneven splits)
        etp_splits = None
        if self.etp_size > 1:
            received_counts = self._gather_counts_over_etp(received_counts)
            etp_splits = received_counts.view(self.etp_size, -1).sum(dim=1).tolist()
            received = gather_from_sequence_parallel_region(
                received, self.etp_group, tensor_parallel_output_grad=True,
                output_split_sizes=etp_splits)
        # 5. rows arrive grouped by source rank, then local expert: regroup by local expert
        sources = received_counts.shape[0]  # EP, or ETP x EP
        local_expert_of_row = torch.arange(local, device=received_counts.device).repeat(
            sources).repeat_interleave(received_counts.reshape(-1))
        local_order = torch.argsort(local_expert_of_row, stable=True)
        state = DispatchState(num_tokens, topk, send_positions, input_splits, output_splits,
                              local_order, tokens_per_expert, received_counts, etp_splits)
        return received[local_order], state.tokens_per_local_expert, state

    def _gather_counts_over_etp(self, received_counts: torch.Tensor) -> torch.Tensor:
        """``[EP, N/EP]`` -> ``[ETP * EP, N/EP]``: what every rank of my expert-TP group
        received, so each knows the rows the gather brings and their experts (Megatron
        gathers the counts over its TP x EP group for the same purpose)."""
        out = received_counts.new_empty((self.etp_size * received_counts.shape[0],
                                         received_counts.shape[1]))
        with get_tracer().tags(op_name="dispatch", phase="forward", payload="counts"):
            return comm.all_gather(out, received_counts.contiguous(), self.etp_group)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """The mirror of :meth:`dispatch`: ``[R, h]`` -> ``[T, K, h]`` copies (dropped
        ones zero)."""
        # 5'. un-sort: row local_order[i] of the received block was expert input i
        inverse = torch.empty_like(state.local_order)
        inverse[state.local_order] = torch.arange(state.local_order.numel(),
                                                  device=inverse.device)
        by_source = expert_output[inverse]
        # 4b'. expert tensor parallelism: sum the partial outputs of the ETP ranks, each
        # keeping the rows it gathered from its own all-to-all
        if state.etp_splits is not None:
            by_source = reduce_scatter_to_sequence_parallel_region(
                by_source, self.etp_group, input_split_sizes=state.etp_splits)
        # 4'. the all-to-all back, splits swapped
        returned = self.move_rows(by_source, state.input_splits, state.output_splits,
                                  "combine", self.combine_precision)
        # 3'. un-permute each copy to its (token, k) slot
        copies = returned.new_zeros((state.num_tokens * state.topk, returned.shape[-1]))
        copies = copies.index_copy(0, state.send_positions, returned)
        return copies.view(state.num_tokens, state.topk, returned.shape[-1])


    # --- deduplicated: one row per (token, node), then per (token, rank) -------------------

    @property
    def leg_names(self) -> list[str]:
        """The hops of :meth:`dispatch_deduplicated`: ``["node", "rank"]`` when the EP group
        spans several nodes of several ranks, ``["rank"]`` otherwise (``[]`` on one rank)."""
        if self.ep_size == 1:
            return []
        several_nodes = 1 < self.ranks_per_node < self.ep_size
        return ["node", "rank"] if several_nodes else ["rank"]

    def _targets(self, experts: torch.Tensor, leg: str) -> torch.Tensor:
        """``[R, EP]`` bool: the EP ranks each row goes to in hop ``leg`` (``-1``: no copy)."""
        valid = experts >= 0
        rank = experts // self.num_local_experts
        per_node, me = self.ranks_per_node, self.ep_rank
        if leg == "node":  # node n's rank with my local index forwards it inside the node
            to = (rank // per_node) * per_node + me % per_node
        else:  # the rank holding the expert; after a node hop, only ranks of my node
            to = rank
            if "node" in self.leg_names:
                valid = valid & (rank // per_node == me // per_node)
        target = torch.zeros(experts.shape[0], self.ep_size + 1, dtype=torch.bool,
                             device=experts.device)
        target.scatter_(1, torch.where(valid, to, self.ep_size), True)  # last: nowhere
        return target[:, :-1]

    def _exchange_splits(self, input_splits: torch.Tensor, leg: str) -> list[int]:
        received = torch.empty_like(input_splits)
        with get_tracer().tags(op_name="dispatch", phase="forward", payload="counts", leg=leg):
            return comm.all_to_all(received, input_splits, self.ep_group).tolist()

    def _move_indices(self, idx: torch.Tensor, output_splits, input_splits, leg: str):
        out = idx.new_empty((sum(output_splits), idx.shape[1]))
        with get_tracer().tags(op_name="dispatch", phase="forward", payload="topk_idx",
                               leg=leg):
            return comm.all_to_all(out, idx.contiguous(), self.ep_group, output_splits,
                                   input_splits)

    def dispatch_deduplicated(self, tokens: torch.Tensor, topk_idx: torch.Tensor,
                              gates: torch.Tensor, keep: torch.Tensor | None = None):
        """DeepEP's dispatch: each token travels once per destination node, then once per
        destination rank, and is fanned out to its experts where it lands.

        A row carries the token, its ``K`` expert ids (``-1`` for a dropped copy) and its
        ``K`` gates (fp32): the receiving rank needs them to pick its experts and to weigh
        their outputs.  Returns ``(expert_input [C, h], tokens_per_local_expert, state)``
        like :meth:`dispatch`.
        """
        experts = topk_idx if keep is None else topk_idx.masked_fill(~keep, -1)
        rows, idx, row_gates = tokens, experts, gates.float()
        legs = []
        for leg in self.leg_names:
            destination, send_rows = self._targets(idx, leg).t().nonzero(as_tuple=True)
            splits = torch.bincount(destination, minlength=self.ep_size)
            inputs, outputs = splits.tolist(), self._exchange_splits(splits, leg)
            legs.append(DispatchLeg(leg, send_rows, rows.shape[0], inputs, outputs))
            rows = self.move_rows(rows[send_rows], outputs, inputs, "dispatch",
                                  self.dispatch_precision, {"leg": leg})
            idx = self._move_indices(idx[send_rows], outputs, inputs, leg)
            row_gates = all_to_all(row_gates[send_rows], self.ep_group, outputs, inputs,
                                   "dispatch", {"payload": "gates", "leg": leg})
        # fan out: one copy per (arrived row, expert of mine), sorted by local expert
        first = self.ep_rank * self.num_local_experts
        mine = (idx >= first) & (idx < first + self.num_local_experts)
        row, k = mine.nonzero(as_tuple=True)
        local_expert = idx[row, k] - first
        order = torch.argsort(local_expert, stable=True)
        row, k = row[order], k[order]
        per_local_expert = torch.bincount(local_expert, minlength=self.num_local_experts)
        load = torch.bincount(experts[experts >= 0], minlength=self.num_experts)
        state = DedupDispatchState(topk_idx.shape[0], legs, rows.shape[0], row,
                                   row_gates[row, k], load, per_local_expert.tolist())
        return rows[row], state.tokens_per_local_expert, state

    def combine_deduplicated(self, expert_output: torch.Tensor,
                             state: DedupDispatchState) -> torch.Tensor:
        """The mirror: each rank weighs its experts' outputs by their gates and sums them
        per arrived row; every hop back sums the partial rows of one token (per node, then
        at the token's rank).  Returns ``[T, h]`` fp32, ``sum_k gate_k * expert_k(x)``.
        """
        h = expert_output.shape[-1]
        weighted = expert_output.float() * state.copy_gates.unsqueeze(-1)
        partial = weighted.new_zeros(state.num_rows, h).index_add(0, state.copy_rows,
                                                                  weighted)
        for leg in reversed(state.legs):
            back = self.move_rows(partial.to(expert_output.dtype), leg.input_splits,
                                  leg.output_splits, "combine", self.combine_precision,
                                  {"leg": leg.name})
            partial = partial.new_zeros(leg.num_rows_before, h).index_add(
                0, leg.send_rows, back.float())
        return partial


def weighted_sum_of_copies(copies: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``y_t = sum_k gate[t, k] * copy[t, k]`` in fp32 (``[T, K, h]``, ``[T, K]`` -> ``[T, h]``)."""
    return (copies.float() * gates.float().unsqueeze(-1)).sum(dim=1)


# --- 4. the layer --------------------------------------------------------------------------


class MoELayer(torch.nn.Module):
    """A DeepSeekMoE layer: ``y = shared(x) + sum_k gate_k * expert_{idx_k}(x)`` on ``[s, b, h]``.

    ``forward`` returns ``(y, info)``: ``info["aux_losses"]`` holds the enabled balance
    losses of ``balance`` (a :class:`moe_balance.BalanceConfig`; add their sum to the LM
    loss), the rest are routing statistics for the chapter (see :meth:`forward`).  The
    losses weigh each token's affinities as a distribution: softmax probabilities as they
    are, sigmoid affinities divided by their sum (:func:`moe_balance.normalize_per_token`).

    With TP > 1, ``sequence_parallel=True`` is required, so that each TP rank routes its
    own ``s/TP`` tokens and no routed-expert work is duplicated.  Megatron-Core's
    ``MoELayer.forward`` (``megatron/core/transformer/moe/moe_layer.py`` at d98e8a64)
    raises a ``ValueError`` while training with TP > 1 and no sequence parallelism, its
    message speaking of performance; this layer refuses it when built.  Where the tokens
    come from is ``input_is_sequence_parallel``:

    * ``True`` (Megatron's case: the model runs sequence parallelism throughout, as
      :class:`~tutorial_lib.deepseek.DeepSeekModel` does with ``sequence_parallel``): the
      input is this TP rank's ``[s/TP, b, h]`` (the attention's row-parallel layer ended in
      a reduce-scatter) and so is the output (the next column-parallel layer gathers it);
      the layer itself issues no sequence collective.
    * ``False`` (the default; a model that keeps the whole sequence between layers): every
      TP rank holds the whole ``[s, b, h]`` (after the attention's all-reduce); the layer
      scatters the sequence (a slice), routes its ``s/TP`` tokens and all-gathers the
      result, so the MoE layer costs an all-reduce plus an all-gather where Megatron's
      costs a reduce-scatter plus an all-gather (the same bytes on the wire; between the
      layers every TP rank holds all ``s`` tokens instead of ``s/TP``).

    The router sees different tokens on each TP rank: its gradient is a
    partial sum, so it is flagged ``sequence_parallel=True`` for
    :func:`allreduce_sequence_parallel_grads` (like the LayerNorms of a TP block).  The
    shared experts are split over TP (:class:`SharedExperts`, Megatron's
    ``SharedExpertMLP``): they gather the TP ranks' tokens, and reduce-scatter their
    output back to this rank's ``s/TP`` before it joins the routed experts'.  The
    balance losses count the whole replica's tokens (summed over the TP group) and return
    the replica's value on every TP rank; each rank's gradient covers its own tokens.

    Context parallelism (``cp_group``, a group of more than one rank): the layer gets this
    CP rank's tokens of every sequence and routes them like any others (the EP all-to-all
    carries whatever tokens each rank holds); the balance losses then sum their counts
    over the CP group as well (over TP and CP when both split the tokens).

    TP and EP together (Megatron's folded grids): after the sequence scatter every TP rank
    holds different tokens, so the all-to-all over the expert grid's EP group needs nothing
    more (that group may span dense TP and DP ranks).  With ETP > 1 (``etp_group``, default
    ``"expert_tp"``; ``None`` whenever ``ep_group`` is ``None``: serial) each expert is split
    over the expert-TP group (:class:`RoutedExperts`) and the dispatcher gathers the received
    rows over that group and reduce-scatters the partial outputs (:meth:`AllToAllDispatcher.dispatch`,
    :meth:`~AllToAllDispatcher.combine`).  The dist tests run ``train_4d`` on every TP x EP
    layout of at most 8 ranks, ETP 1 and ETP = TP, against the serial model.

    Arguments beyond the sizes: ``num_shared_experts`` (merged into one SwiGLU of
    ``num_shared_experts * ffn_hidden_size``); ``score_function``, ``routed_scaling_factor``,
    ``normalize_topk``, ``device_limit`` (M), ``num_devices`` (D, default the EP size) and
    ``device_limit_rule`` go to the :class:`Router`; ``capacity_factor`` (``None``:
    dropless); ``balance`` (``None``: no aux losses; ``use_bias_balancing`` gives the
    router its bias).  ``deduplicate`` and ``ranks_per_node`` go to the
    :class:`AllToAllDispatcher` (DeepEP's one row per token and node; the output is the
    same up to the order of the sums).

    ``dispatch_precision`` / ``combine_precision``: how the token rows travel, each a
    ``(forward, backward)`` pair (see :class:`AllToAllDispatcher`; ``None``, the default, moves
    them in their own dtype).  Gates and the weighted sum stay fp32 whatever they are.
    ``device``: where the weights live (``None``: torch's default device).

    Parameter seeds: :func:`~tutorial_lib.tensor_parallel.derive_seed` of ``seed`` and
    ``ROUTER``, ``ROUTED_EXPERTS``, ``SHARED_EXPERTS`` (10, 11, 12: after a block's sublayers).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int, ffn_hidden_size: int,
                 num_shared_experts: int = 0, score_function: str = "softmax",
                 routed_scaling_factor: float = 1.0, normalize_topk: bool | None = None,
                 device_limit: int | None = None, num_devices: int | None = None,
                 capacity_factor: float | None = None,
                 balance: moe_balance.BalanceConfig | None = None,
                 sequence_parallel: bool = False, seed: int = 0,
                 ep_group: str | None = "ep", tp_group: str | None = "tp",
                 dispatch_precision: tuple[str, str] | None = None,
                 combine_precision: tuple[str, str] | None = None,
                 device_limit_rule: str | None = None, deduplicate: bool = False,
                 ranks_per_node: int | None = None, cp_group: str | None = None,
                 device=None, etp_group: str | None = "expert_tp",
                 input_is_sequence_parallel: bool = False):
        super().__init__()
        self.cp_group = cp_group  # context parallelism: my CP rank's tokens of each sequence
        ep_size, tp_size = parallel_state.group_size(ep_group), parallel_state.group_size(tp_group)
        etp_group = None if ep_group is None else etp_group  # serial: whole experts
        self.etp_group = etp_group
        if tp_size > 1 and not sequence_parallel:
            raise ConfigError(
                "rule 6", f"an MoE layer with tensor_model_parallel_size ({tp_size}) > 1 needs "
                f"sequence_parallel=True, else every TP rank would route and compute the same "
                f"tokens (Megatron-Core's MoELayer refuses to train so too); pass "
                f"sequence_parallel=True")
        if input_is_sequence_parallel and not sequence_parallel:
            raise ConfigError(
                "malformed", "input_is_sequence_parallel=True says the input is already split "
                "over TP, which needs sequence_parallel=True (each TP rank routes its own "
                "tokens); pass both, or input_is_sequence_parallel=False")
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.ep_group, self.tp_group = ep_group, tp_group
        self.sequence_parallel = sequence_parallel
        # the model splits the sequence over TP (Megatron's): no scatter or gather here
        self.input_is_sequence_parallel = input_is_sequence_parallel
        self.capacity_factor, self.balance = capacity_factor, balance
        # D: the groups limited routing and the device losses count (the EP size by default)
        self.num_devices = ep_size if num_devices is None else num_devices
        self.device_limit = device_limit
        use_bias = balance is not None and balance.use_bias_balancing
        self.router = Router(hidden_size, num_experts, topk, score_function, routed_scaling_factor,
                             normalize_topk, device_limit, self.num_devices, use_bias,
                             seed=derive_seed(seed, ROUTER), device_limit_rule=device_limit_rule,
                             device=device)
        self.dispatcher = AllToAllDispatcher(num_experts, ep_group, dispatch_precision,
                                             combine_precision, deduplicate, ranks_per_node,
                                             etp_group)
        self.experts = RoutedExperts(num_experts, hidden_size, ffn_hidden_size, ep_size,
                                     parallel_state.group_rank(ep_group),
                                     seed=derive_seed(seed, ROUTED_EXPERTS), device=device,
                                     etp_size=parallel_state.group_size(etp_group),
                                     etp_rank=parallel_state.group_rank(etp_group))
        self.shared_experts = None
        if num_shared_experts:
            self.shared_experts = SharedExperts(hidden_size, num_shared_experts * ffn_hidden_size,
                                                seed=derive_seed(seed, SHARED_EXPERTS),
                                                device=device, tp_group=tp_group,
                                                sequence_parallel=sequence_parallel)
        # the router sees my s/TP tokens: a partial gradient under SP (see the class doc)
        self.router.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor):
        """``[s, b, h]`` -> ``([s, b, h], info)`` (``input_is_sequence_parallel``: this TP
        rank's ``[s/TP, b, h]`` -> ``[s/TP, b, h]``).

        ``info``: ``aux_losses`` (dict of scalars), ``tokens_per_expert`` (``[N]``, copies this
        rank routed), ``tokens_sent_per_rank`` (copies for each EP rank's experts),
        ``tokens_received_per_rank`` (copies received from each EP rank; ``None`` when
        deduplicating: rows arrive through other ranks), ``rows_per_leg`` (each all-to-all
        hop's ``(name, input_splits, output_splits)``: ``"copies"``, or ``"node"`` and
        ``"rank"``), ``tokens_per_local_expert``, ``num_dropped``, ``capacity``,
        ``topk_idx``, ``gates``.
        """
        x = hidden_states
        scatter = self.sequence_parallel and not self.input_is_sequence_parallel
        if scatter:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # my s/TP tokens
        s_local, batch, h = x.shape
        tokens = x.reshape(-1, h)
        route = self.router(tokens)
        keep, capacity = None, None
        if self.capacity_factor is not None:
            keep = capacity_keep_mask(route.topk_idx, route.gates, self.num_experts,
                                      self.capacity_factor)
            capacity = capacity_per_expert(tokens.shape[0], self.topk, self.num_experts,
                                           self.capacity_factor)
        dispatcher = self.dispatcher
        if dispatcher.deduplicate:  # one row per (token, node) and (token, rank): DeepEP
            expert_input, tokens_per_local_expert, state = dispatcher.dispatch_deduplicated(
                tokens, route.topk_idx, route.gates, keep)
            expert_output = self.experts(expert_input, tokens_per_local_expert)
            routed = dispatcher.combine_deduplicated(expert_output, state)  # gates applied
        else:  # one row per (token, k) copy, weighed here
            expert_input, tokens_per_local_expert, state = dispatcher.dispatch(
                tokens, route.topk_idx, keep)
            expert_output = self.experts(expert_input, tokens_per_local_expert)
            copies = dispatcher.combine(expert_output, state)  # dropped copies are zero
            routed = weighted_sum_of_copies(copies, route.gates)
        y = routed.to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)  # TP-split: my tokens' sums come back
        y = y.view(s_local, batch, h)
        if scatter:
            # Downstream of the MoE every TP rank computes the same thing, so dY is already
            # whole on each rank: the backward only keeps my slice (no reduce-scatter).
            y = gather_from_sequence_parallel_region(y, self.tp_group,
                                                     tensor_parallel_output_grad=False)
        info = {
            "aux_losses": self._aux_losses(route, s_local, batch),
            "tokens_per_expert": state.tokens_per_expert,
            "tokens_per_local_expert": tokens_per_local_expert,
            "num_dropped": 0 if keep is None else int((~keep).sum()),
            "capacity": capacity,
            "topk_idx": route.topk_idx,
            "gates": route.gates.detach(),
            **self._rows_moved(state),
        }
        return y, info

    def _rows_moved(self, state) -> dict:
        """The all-to-all splits of one dispatch, for ``info``."""
        if isinstance(state, DispatchState):
            return {"tokens_sent_per_rank": state.input_splits,
                    "tokens_received_per_rank": state.output_splits,
                    "rows_per_leg": [("copies", state.input_splits, state.output_splits)]}
        per_rank = state.tokens_per_expert.view(self.dispatcher.ep_size, -1).sum(dim=1)
        return {"tokens_sent_per_rank": per_rank.tolist(), "tokens_received_per_rank": None,
                "rows_per_leg": [(leg.name, leg.input_splits, leg.output_splits)
                                 for leg in state.legs]}

    def _aux_losses(self, route: RouterOutput, s_local: int, batch: int) -> dict:
        """The balance losses of the replica's tokens, from this rank's share of them.

        A sigmoid router's affinities are normalised per token first (every loss assumes
        each token's probabilities sum to 1).  Under sequence parallelism the TP ranks
        split the tokens: the losses sum their counts and token numbers over the TP group,
        so each rank's gradient is its tokens' share of the serial one.
        """
        if self.balance is None or route.scores.shape[0] == 0:
            return {}  # no tokens here: every fraction of the losses would be 0 / 0
        n, k = self.num_experts, self.topk
        probs = route.scores
        if self.router.score_function == "sigmoid":
            probs = moe_balance.normalize_per_token(probs)
        # [s, b] token order -> [b, s] sequences, as the sequence-wise loss expects
        probs = probs.view(s_local, batch, n).transpose(0, 1)
        topk_idx = route.topk_idx.view(s_local, batch, k).transpose(0, 1)
        return moe_balance.total_aux_loss(
            self.balance, probs, topk_idx, n, k, num_devices=self.num_devices,
            max_devices=self.device_limit, logits=route.logits, group=self._token_groups())

    def _token_groups(self):
        """The group kinds that split each sequence's tokens: TP under sequence parallelism,
        CP under context parallelism (both: Megatron's TP x CP group), or ``None``."""
        kinds = []
        if self.sequence_parallel and parallel_state.group_size(self.tp_group) > 1:
            kinds.append(self.tp_group)
        if parallel_state.group_size(self.cp_group) > 1:
            kinds.append(self.cp_group)
        return None if not kinds else kinds[0] if len(kinds) == 1 else tuple(kinds)

    @torch.no_grad()
    def global_load(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """This step's expert load summed over every rank that routed different tokens.

        That is the data-parallel ranks (EP ranks included) and, under sequence
        parallelism, the TP ranks too: each of them routed its own slice of the tokens.
        """
        serial = self.ep_group is None and self.tp_group is None
        if serial or not parallel_state.is_initialized():
            return moe_balance.expert_load(topk_idx, self.num_experts)
        split_over_tp = self.sequence_parallel and parallel_state.group_size(self.tp_group) > 1
        groups = ("tp", "dp_cp") if split_over_tp else ("dp_cp",)
        return moe_balance.global_expert_load(topk_idx, self.num_experts, groups)

    def update_expert_bias(self, load: torch.Tensor) -> None:
        """V3's bias step with ``balance.gamma``; pass the step's *global* load
        (:meth:`global_load`) so every rank moves alike."""
        if self.router.expert_bias is None:
            raise RuntimeError("this layer has no expert bias: build it with a "
                               "BalanceConfig whose use_bias_balancing=True")
        moe_balance.update_expert_bias(self.router.expert_bias, load, self.balance.gamma)


# --- 5. gradients: who sums what -----------------------------------------------------------
#
# Nothing here: tutorial_lib.data_parallel.DataParallel syncs every gradient by its domain.
# Routed experts are marked "expert_dp": their gradients are summed over the expert-data-
# parallel group but divided by the *dense* data-parallel size, because the backward of the
# all-to-all has already added, on the expert's owner, the gradients of every EP rank's
# tokens (Megatron-Core 0.20.0: expert_gradient_scaling_factor = 1 / (DP * CP), the
# dp_cp group's size).  Averaging over EDP instead scales them by DP * CP / EDP
# = EP * ETP / TP.  Router and shared experts are dense (averaged over dp_cp); the shared
# experts are TP shards, each fed every token, so their gradients are whole.  The router
# sees my s/TP tokens under sequence parallelism and is flagged sequence_parallel, so
# tensor_parallel.allreduce_sequence_parallel_grads sums its per-TP-rank partial
# gradients after DataParallel.finish_grad_sync().
