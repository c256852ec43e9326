"""Mixture of experts with expert parallelism: router, experts, all-to-all dispatch and combine.

Read it top to bottom, like the chapter:

1. **The router** (:class:`Router`, fp32).  Each token's affinity to each of the ``N``
   routed experts: ``softmax`` (DeepSeekMoE, DeepSeek-V2: the gates are the top-k
   softmax probabilities) or ``sigmoid`` (DeepSeek-V3: the chosen affinities are
   normalised to sum to 1, then multiplied by ``routed_scaling_factor``).  Two options
   change *which* experts are chosen, never the gate values: a per-expert bias
   (V3's auxiliary-loss-free balancing) and device-limited routing (V2: a token's
   experts live on at most ``M`` of the ``D`` expert-parallel ranks).
2. **The experts** (:class:`RoutedExperts`, :class:`SharedExperts`).  Fine-grained
   routed experts are small SwiGLU MLPs; shared experts are one dense SwiGLU every
   token goes through.  All ``N`` routed experts are drawn from one seed and each EP
   rank keeps its ``N/EP`` of them, so the EP layer *is* the serial layer, cut up.
3. **The dispatcher** (:class:`AllToAllDispatcher`, on the ``"ep"`` group).  Count tokens
   per expert, exchange the counts (an all-to-all of int64 metadata), permute the token
   copies by destination rank, one uneven all-to-all, sort what arrived by local expert;
   after the experts, the exact mirror: un-sort, all-to-all with the splits swapped,
   un-permute.  The all-to-all is an autograd function whose backward is the reverse
   all-to-all.  Optional capacity: drop the lowest-gate copies over
   ``ceil(capacity_factor * T * K / N)`` per expert.
4. **The layer** (:class:`MoELayer`): router -> (capacity) -> dispatch -> experts ->
   combine -> weighted sum in fp32 (+ shared experts), with sequence parallelism around
   it when TP > 1, plus the DeepSeek balance losses of :mod:`tutorial_lib.moe_balance`
   (on sigmoid affinities normalised per token; under sequence parallelism counted over
   the TP group, so the router gradient is the serial one).
5. **Gradients**: synced by :class:`tutorial_lib.data_parallel.DataParallel`, experts over
   the expert-data-parallel group but divided by the *dense* data-parallel size (why: see
   the end of this module and :data:`tutorial_lib.data_parallel.DOMAINS`).

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
from .data_parallel import set_grad_domain
from .tensor_parallel import (
    derive_seed,
    divide,
    gather_from_sequence_parallel_region,
    init_linear_master,
    scatter_to_sequence_parallel_region,
)
from .trace import get_tracer

__all__ = [
    "RouterOutput", "compute_scores", "limit_to_devices", "select_experts", "gates_from_scores",
    "Router", "swiglu", "init_experts_master", "RoutedExperts", "SharedExperts",
    "capacity_per_expert", "capacity_keep_mask", "all_to_all", "DispatchState",
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


def limit_to_devices(selection_scores: torch.Tensor, num_devices: int,
                     device_limit: int) -> torch.Tensor:
    """DeepSeek-V2's device-limited routing: keep only each token's best ``M`` devices.

    A device's score for a token is the highest affinity among its ``N/D`` experts; the
    ``M`` best devices stay, every expert elsewhere gets ``-inf`` so top-k cannot pick it.
    """
    tokens, num_experts = selection_scores.shape
    per_device = divide(num_experts, num_devices, "num_experts", by="num_devices")
    if not 1 <= device_limit <= num_devices:
        raise ValueError(f"device_limit (M = {device_limit}) must be between 1 and the number "
                         f"of devices (D = {num_devices})")
    device_scores = selection_scores.view(tokens, num_devices, per_device).amax(dim=-1)
    best_devices = torch.topk(device_scores, device_limit, dim=-1).indices  # [T, M]
    allowed = torch.zeros(tokens, num_devices, dtype=torch.bool, device=selection_scores.device)
    allowed.scatter_(1, best_devices, True)
    allowed = allowed.repeat_interleave(per_device, dim=1)  # [T, N]
    return selection_scores.masked_fill(~allowed, float("-inf"))


def select_experts(scores: torch.Tensor, topk: int, bias: torch.Tensor | None = None,
                   device_limit: int | None = None, num_devices: int = 1) -> torch.Tensor:
    """The ``[T, K]`` experts each token goes to: top-k of ``scores + bias`` (within M devices).

    The bias steers the *choice* only (DeepSeek-V3, section 2.1.2): the gates come from
    the unbiased scores (:func:`gates_from_scores`), so the bias never enters the output
    except through the choice.  With no bias and no device limit this is
    ``torch.topk(scores, K)``.
    """
    selection = scores if bias is None else scores + bias
    if device_limit is not None:
        if topk > device_limit * (scores.shape[-1] // num_devices):
            raise ValueError(f"topk ({topk}) exceeds the experts on device_limit ({device_limit}) "
                             f"devices of {scores.shape[-1] // num_devices} experts each")
        selection = limit_to_devices(selection, num_devices, device_limit)
    return torch.topk(selection, topk, dim=-1).indices


def gates_from_scores(scores: torch.Tensor, topk_idx: torch.Tensor, normalize: bool,
                      routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The gate of each chosen expert: its (unbiased) score, optionally normalised over the
    ``K`` chosen ones (V3), times ``routed_scaling_factor``."""
    gates = scores.gather(-1, topk_idx)
    if normalize:
        gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    return gates * routed_scaling_factor


class Router(torch.nn.Module):
    """A linear gate ``[N, h]`` (no bias) and the selection rules above, all in fp32.

    ``normalize_topk``: ``None`` picks each paper's choice (sigmoid: normalise, as V3;
    softmax: do not, as V2).  ``device_limit`` (``M``) with ``num_devices`` (``D``, the EP
    size the experts are spread over) turns on device-limited routing; it is a property
    of the model, so the serial reference passes the same ``num_devices``.
    ``use_expert_bias`` adds the ``expert_bias`` buffer (updated outside backward by
    :func:`moe_balance.update_expert_bias`; zero at start).
    """

    def __init__(self, hidden_size: int, num_experts: int, topk: int,
                 score_function: str = "softmax", routed_scaling_factor: float = 1.0,
                 normalize_topk: bool | None = None, device_limit: int | None = None,
                 num_devices: int = 1, use_expert_bias: bool = False, seed: int = 0):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk ({topk}) must be between 1 and num_experts ({num_experts})")
        compute_scores(torch.zeros(1, 1), score_function)  # reject an unknown name now
        divide(num_experts, num_devices, "num_experts", by="num_devices")
        self.num_experts, self.topk, self.score_function = num_experts, topk, score_function
        self.routed_scaling_factor = routed_scaling_factor
        self.normalize_topk = (score_function == "sigmoid") if normalize_topk is None else normalize_topk
        self.device_limit, self.num_devices = device_limit, num_devices
        weight, _ = init_linear_master(hidden_size, num_experts, bias=False, seed=seed)
        self.weight = torch.nn.Parameter(weight)
        bias = torch.zeros(num_experts, dtype=torch.float32) if use_expert_bias else None
        self.register_buffer("expert_bias", bias)  # None: no bias, plain top-k

    def forward(self, tokens: torch.Tensor) -> RouterOutput:
        logits = F.linear(tokens.float(), self.weight.float())  # routing decisions in fp32
        scores = compute_scores(logits, self.score_function)
        topk_idx = select_experts(scores.detach(), self.topk, self.expert_bias,
                                  self.device_limit, self.num_devices)
        gates = gates_from_scores(scores, topk_idx, self.normalize_topk, self.routed_scaling_factor)
        return RouterOutput(gates, topk_idx, scores, logits)


# --- 2. the experts ------------------------------------------------------------------------


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    """``down(silu(gate(x)) * up(x))``, the feed-forward of every DeepSeek expert."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def init_experts_master(num_experts: int, hidden_size: int, ffn_hidden_size: int, seed: int = 0):
    """All ``N`` experts' ``(gate [N, f, h], up [N, f, h], down [N, h, f])`` from one seed.

    ``nn.Linear``'s U(-1/sqrt(in), 1/sqrt(in)), drawn gate, up, down from one generator:
    every EP size slices the same numbers.
    """
    generator = torch.Generator().manual_seed(seed)
    bound_in, bound_ffn = 1.0 / math.sqrt(hidden_size), 1.0 / math.sqrt(ffn_hidden_size)
    shapes = [((num_experts, ffn_hidden_size, hidden_size), bound_in)] * 2
    shapes.append(((num_experts, hidden_size, ffn_hidden_size), bound_ffn))
    return tuple(torch.empty(shape).uniform_(-b, b, generator=generator) for shape, b in shapes)


class RoutedExperts(torch.nn.Module):
    """This EP rank's ``N/EP`` experts, ``[first_expert, first_expert + N/EP)``.

    Weights are stacked ``[N/EP, ...]`` and marked ``allreduce_group="expert_dp"``: each
    expert exists on the ``EDP`` ranks that share this EP coordinate, not on all DP ranks.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 ep_size: int = 1, ep_rank: int = 0, seed: int = 0):
        super().__init__()
        self.num_local_experts = divide(num_experts, ep_size, "num_experts",
                                        by="expert_model_parallel_size")
        self.first_expert = ep_rank * self.num_local_experts
        mine = slice(self.first_expert, self.first_expert + self.num_local_experts)
        for name, full in zip(("weight_gate", "weight_up", "weight_down"),
                              init_experts_master(num_experts, hidden_size, ffn_hidden_size, seed)):
            param = torch.nn.Parameter(full[mine].clone())
            setattr(self, name, set_grad_domain(param, "expert_dp"))

    def forward(self, rows: torch.Tensor, tokens_per_local_expert: list[int]) -> torch.Tensor:
        """``rows`` sorted by local expert, ``tokens_per_local_expert[i]`` of them for expert i."""
        outputs = [swiglu(chunk, self.weight_gate[i], self.weight_up[i], self.weight_down[i])
                   for i, chunk in enumerate(rows.split(tokens_per_local_expert))]
        return torch.cat(outputs)  # an expert with no rows returns [0, h]; its grads are zero


class SharedExperts(torch.nn.Module):
    """``num_shared_experts`` always-on experts, merged into one SwiGLU of their total width.

    Kept simple: replicated on every rank (not tensor-parallel) and run on the same tokens
    as the router, so under sequence parallelism each TP rank computes its own tokens only.
    Megatron splits them like a TP MLP instead; the output is the same.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, seed: int = 0):
        super().__init__()
        gate, _ = init_linear_master(hidden_size, ffn_hidden_size, bias=False, seed=3 * seed)
        up, _ = init_linear_master(hidden_size, ffn_hidden_size, bias=False, seed=3 * seed + 1)
        down, _ = init_linear_master(ffn_hidden_size, hidden_size, bias=False, seed=3 * seed + 2)
        self.weight_gate, self.weight_up = torch.nn.Parameter(gate), torch.nn.Parameter(up)
        self.weight_down = torch.nn.Parameter(down)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return swiglu(tokens, self.weight_gate, self.weight_up, self.weight_down)


# --- 3. the dispatcher ---------------------------------------------------------------------


def capacity_per_expert(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * T * K / N)``: copies each expert accepts from this rank's tokens."""
    return math.ceil(capacity_factor * num_tokens * topk / num_experts)


def capacity_keep_mask(topk_idx: torch.Tensor, gates: torch.Tensor, num_experts: int,
                       capacity_factor: float) -> torch.Tensor:
    """``[T, K]`` bool: True for the copies kept; each expert keeps its highest-gate copies.

    Per rank, before dispatch (Megatron's drop policy ``probs``): the capacity is computed
    from this rank's ``T`` tokens.  Equal gates keep the lower flat index ``t * K + k``.
    """
    capacity = capacity_per_expert(topk_idx.shape[0], topk_idx.shape[1], num_experts, capacity_factor)
    experts, flat_gates = topk_idx.reshape(-1), gates.detach().reshape(-1)
    by_gate = torch.argsort(flat_gates, descending=True, stable=True)
    by_expert = by_gate[torch.argsort(experts[by_gate], stable=True)]  # expert, then gate high->low
    counts = torch.bincount(experts, minlength=num_experts)
    first_of_expert = torch.cumsum(counts, 0) - counts
    place_in_expert = torch.arange(experts.numel()) - first_of_expert[experts[by_expert]]
    keep = torch.zeros(experts.numel(), dtype=torch.bool)
    keep[by_expert] = place_in_expert < capacity
    return keep.view_as(topk_idx)


class AllToAll(torch.autograd.Function):
    """Forward: rows ``input_splits[j]`` go to EP rank j.  Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, op_name):
        ctx.group, ctx.splits, ctx.op_name = group, (output_splits, input_splits), op_name
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        with get_tracer().tags(op_name=op_name, phase="forward", payload="tokens"):
            return comm.all_to_all(out, x.contiguous(), group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        with get_tracer().tags(op_name=ctx.op_name, phase="backward", payload="tokens"):
            comm.all_to_all(out, grad.contiguous(), ctx.group, input_splits, output_splits)
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, group: str | None, output_splits: list[int],
               input_splits: list[int], op_name: str) -> torch.Tensor:
    """Autograd-correct uneven all-to-all over ``group`` (identity on one rank)."""
    if parallel_state.group_size(group) == 1:
        return x
    return AllToAll.apply(x, group, list(output_splits), list(input_splits), op_name)


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
    """``[EP, N/EP]`` int64: copies received from each rank for each local expert."""

    @property
    def tokens_per_local_expert(self) -> list[int]:
        return self.received_counts.sum(dim=0).tolist()


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
    """

    def __init__(self, num_experts: int, ep_group: str | None = "ep",
                 dispatch_precision: tuple[str, str] | None = None,
                 combine_precision: tuple[str, str] | None = None):
        self.num_experts, self.ep_group = num_experts, ep_group
        self.ep_size = parallel_state.group_size(ep_group)
        self.num_local_experts = divide(num_experts, self.ep_size, "num_experts",
                                        by="expert_model_parallel_size")
        self.dispatch_precision = fp8.check_precision_pair(dispatch_precision)
        self.combine_precision = fp8.check_precision_pair(combine_precision)

    def move_rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                   op_name: str, precision) -> torch.Tensor:
        """The token all-to-all: as is (``precision=None``) or encoded by :func:`fp8.all_to_all`."""
        if precision is None:
            return all_to_all(rows, self.ep_group, output_splits, input_splits, op_name)
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
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int], DispatchState]:
        """``tokens [T, h]``, ``topk_idx [T, K]`` -> rows for my local experts, sorted by expert.

        Returns ``(expert_input [R, h], tokens_per_local_expert, state)``.
        """
        num_tokens, topk = topk_idx.shape
        ep, local = self.ep_size, self.num_local_experts
        positions = torch.arange(num_tokens * topk)
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
        # 5. rows arrive grouped by source rank, then local expert: regroup by local expert
        local_expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(
            received_counts.reshape(-1))
        local_order = torch.argsort(local_expert_of_row, stable=True)
        state = DispatchState(num_tokens, topk, send_positions, input_splits, output_splits,
                              local_order, tokens_per_expert, received_counts)
        return received[local_order], state.tokens_per_local_expert, state

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """The mirror of :meth:`dispatch`: ``[R, h]`` -> ``[T, K, h]`` copies (dropped ones zero)."""
        # 5'. un-sort: row local_order[i] of the received block was expert input i
        inverse = torch.empty_like(state.local_order)
        inverse[state.local_order] = torch.arange(state.local_order.numel())
        by_source = expert_output[inverse]
        # 4'. the all-to-all back, splits swapped
        returned = self.move_rows(by_source, state.input_splits, state.output_splits, "combine",
                                   self.combine_precision)
        # 3'. un-permute each copy to its (token, k) slot
        copies = returned.new_zeros((state.num_tokens * state.topk, returned.shape[-1]))
        copies = copies.index_copy(0, state.send_positions, returned)
        return copies.view(state.num_tokens, state.topk, returned.shape[-1])


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

    With TP > 1, ``sequence_parallel=True`` is required (Megatron asserts the same):
    every TP rank holds the whole ``[s, b, h]``; the layer scatters the sequence so each
    TP rank routes ``s/TP`` of it (no routed-expert work is duplicated) and gathers the
    result.  The router and shared experts then see different tokens on each TP rank:
    their gradients are partial sums, so they are flagged ``sequence_parallel=True`` for
    :func:`allreduce_sequence_parallel_grads` (like the LayerNorms of a TP block).  The
    balance losses count the whole replica's tokens (summed over the TP group) and return
    the replica's value on every TP rank; each rank's gradient covers its own tokens.

    TP and EP together (the course's rule 2 forbids it; Megatron does not): after the
    sequence scatter every TP rank holds different tokens, so the EP all-to-all needs
    nothing more.  The dist tests run TP 2 x EP 2 against the serial layer.

    Arguments beyond the sizes: ``num_shared_experts`` (merged into one SwiGLU of
    ``num_shared_experts * ffn_hidden_size``); ``score_function``, ``routed_scaling_factor``,
    ``normalize_topk``, ``device_limit`` (M) and ``num_devices`` (D, default the EP size)
    go to the :class:`Router`; ``capacity_factor`` (``None``: dropless); ``balance``
    (``None``: no aux losses; ``use_bias_balancing`` gives the router its bias).

    ``dispatch_precision`` / ``combine_precision``: how the token rows travel, each a
    ``(forward, backward)`` pair (see :class:`AllToAllDispatcher`; ``None``, the default, moves
    them in their own dtype).  Gates and the weighted sum stay fp32 whatever they are.

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
                 combine_precision: tuple[str, str] | None = None):
        super().__init__()
        ep_size, tp_size = parallel_state.group_size(ep_group), parallel_state.group_size(tp_group)
        if tp_size > 1 and not sequence_parallel:
            raise ConfigError(
                "rule 6", f"an MoE layer with tensor_model_parallel_size ({tp_size}) > 1 needs "
                f"sequence_parallel=True, else every TP rank would route and compute the same "
                f"tokens (Megatron asserts the same); pass sequence_parallel=True")
        self.hidden_size, self.num_experts, self.topk = hidden_size, num_experts, topk
        self.ep_group, self.tp_group = ep_group, tp_group
        self.sequence_parallel = sequence_parallel
        self.capacity_factor, self.balance = capacity_factor, balance
        # D: the devices device-limited routing and the device losses count (the EP size by default)
        self.num_devices = ep_size if num_devices is None else num_devices
        self.device_limit = device_limit
        use_bias = balance is not None and balance.use_bias_balancing
        self.router = Router(hidden_size, num_experts, topk, score_function, routed_scaling_factor,
                             normalize_topk, device_limit, self.num_devices, use_bias,
                             seed=derive_seed(seed, ROUTER))
        self.dispatcher = AllToAllDispatcher(num_experts, ep_group, dispatch_precision,
                                             combine_precision)
        self.experts = RoutedExperts(num_experts, hidden_size, ffn_hidden_size, ep_size,
                                     parallel_state.group_rank(ep_group), seed=derive_seed(seed, ROUTED_EXPERTS))
        self.shared_experts = None
        if num_shared_experts:
            self.shared_experts = SharedExperts(hidden_size, num_shared_experts * ffn_hidden_size,
                                                seed=derive_seed(seed, SHARED_EXPERTS))
        replicated = [self.router.weight] + list(self.shared_experts.parameters() if
                                                  self.shared_experts else [])
        for param in replicated:
            param.sequence_parallel = sequence_parallel  # partial grads under SP: see class doc

    def forward(self, hidden_states: torch.Tensor):
        """``[s, b, h]`` -> ``([s, b, h], info)``.

        ``info``: ``aux_losses`` (dict of scalars), ``tokens_per_expert`` (``[N]``, copies this
        rank routed), ``tokens_sent_per_rank`` / ``tokens_received_per_rank`` (the
        all-to-all splits), ``tokens_per_local_expert``, ``num_dropped``, ``capacity``,
        ``topk_idx``, ``gates``.
        """
        x = hidden_states
        if self.sequence_parallel:
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
        expert_input, tokens_per_local_expert, state = self.dispatcher.dispatch(
            tokens, route.topk_idx, keep)
        expert_output = self.experts(expert_input, tokens_per_local_expert)
        copies = self.dispatcher.combine(expert_output, state)  # dropped copies are zero
        y = weighted_sum_of_copies(copies, route.gates).to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        y = y.view(s_local, batch, h)
        if self.sequence_parallel:
            # Downstream of the MoE every TP rank computes the same thing, so dY is already
            # whole on each rank: the backward only keeps my slice (no reduce-scatter).
            y = gather_from_sequence_parallel_region(y, self.tp_group, tensor_parallel_output_grad=False)
        info = {
            "aux_losses": self._aux_losses(route, s_local, batch),
            "tokens_per_expert": state.tokens_per_expert,
            "tokens_sent_per_rank": state.input_splits,
            "tokens_received_per_rank": state.output_splits,
            "tokens_per_local_expert": tokens_per_local_expert,
            "num_dropped": 0 if keep is None else int((~keep).sum()),
            "capacity": capacity,
            "topk_idx": route.topk_idx,
            "gates": route.gates.detach(),
        }
        return y, info

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
        split_over_tp = self.sequence_parallel and parallel_state.group_size(self.tp_group) > 1
        return moe_balance.total_aux_loss(
            self.balance, probs, topk_idx, n, k, num_devices=self.num_devices,
            max_devices=self.device_limit, logits=route.logits,
            group=self.tp_group if split_over_tp else None)

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
            raise RuntimeError("this layer has no expert bias: build it with a BalanceConfig "
                               "whose use_bias_balancing=True")
        moe_balance.update_expert_bias(self.router.expert_bias, load, self.balance.gamma)


# --- 5. gradients: who sums what -----------------------------------------------------------
#
# Nothing here: tutorial_lib.data_parallel.DataParallel syncs every gradient by its domain.
# Routed experts are marked "expert_dp": their gradients are summed over the expert-data-
# parallel group but divided by the *dense* data-parallel size, because the backward of the
# all-to-all has already added, on the expert's owner, the gradients of every EP rank's
# tokens (Megatron: expert_gradient_scaling_factor = 1 / DP).  Router and shared experts
# are dense; under sequence parallelism they are also flagged sequence_parallel, so
# tensor_parallel.allreduce_sequence_parallel_grads sums their per-TP-rank partial
# gradients after DataParallel.finish_grad_sync().
