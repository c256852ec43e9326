"""DeepSeekMoE load balancing: the auxiliary losses and the auxiliary-loss-free bias.

Pure torch functions on router outputs, written as the papers publish them:

* DeepSeekMoE (Dai et al., 2024, arXiv:2401.06066), section 3.3: expert- and device-level
  losses (two levels);
* DeepSeek-V2 (arXiv:2405.04434), section 2.2.3: adds the communication loss (with
  device-limited routing): three levels;
* DeepSeek-V3 (arXiv:2412.19437), section 2.1.2: bias-based balancing without an auxiliary
  loss (Wang et al., 2024, arXiv:2408.15664, which also defines MaxVio) plus a small
  sequence-wise loss;
* the router z-loss, from ST-MoE (Zoph et al., 2022, arXiv:2202.08906), not a DeepSeek loss.

Notation (the papers'): ``T`` tokens, ``N'`` routed experts, ``K'`` experts per token,
``D`` devices (expert-parallel ranks), each holding ``N'/D`` experts, device ``d`` the
contiguous block ``E_d = [d N'/D, (d+1) N'/D)``, and ``M`` the most devices one token
may reach.  ``probs`` is ``[T, N']``: each token's router probabilities over *all* routed
experts (softmax in DeepSeekMoE and V2), not only the top-k gates.  ``topk_idx`` is
``[T, K']`` (int64): the experts counted, for the V2 losses those each token was sent to
(V2's ``f_i`` counts the choice made under device-limited routing; Megatron-Core 0.20.0
counts the plain top-k of the scores for every aux loss, which differs only under a group
limit or a bias).  The sequence-wise loss counts the unbiased top-k (V3's formula).  Counts
carry no gradient; the gradient flows through ``probs`` alone.

With perfectly even routing and uniform probabilities every balance loss equals its
coefficient, so ``loss / coeff == 1`` is "balanced".  It is not a lower bound: some
unbalanced routings score below 1 (see :func:`expert_balance_loss`), so the value is no
score of balance; what balances the router is the gradient.  Those values assume each
token's ``probs`` sum to 1: a sigmoid router's affinities must first be divided
by their sum (:func:`normalize_per_token`; :class:`tutorial_lib.moe.MoELayer` does it).

**Tokens split over ranks** (``group``).  Under sequence parallelism (or context
parallelism) the ranks of a group each route part of the same batch.  Every loss and the
z-loss take ``group``, the group kind that splits the tokens: the counts and ``T`` are
summed over it (one all-reduce; several orthogonal kinds, such as ``("tp", "cp")``, one
each), so ``f`` is the whole batch's, while ``P`` keeps only this
rank's tokens, divided by the whole ``T``.  Each rank then backpropagates the exact gradient
of the whole loss with respect to its own tokens, and summing the router gradients over the
group (what sequence parallelism does) gives the serial gradient.  The value returned is the
whole loss on every rank (a second all-reduce).  Megatron-Core 0.20.0 (d98e8a64,
``router.py`` ``TopKRouter._apply_aux_loss`` and ``_apply_seq_aux_loss`` via
``moe_utils.get_tokens_per_expert_and_token_count``) sums its tokens-per-expert over the
TP x CP group and divides by the group's token count in the same way, each rank keeping its
own probabilities (its z-loss divides the coefficient by the TP x CP size instead).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm

# --- routing counts --------------------------------------------------------


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens sent to each expert: int64 ``[N']``,
    ``load[i] = #{(t, k): topk_idx[t, k] = i}``."""
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts)


def max_violation(load: torch.Tensor) -> float:
    """MaxVio = (max_i load_i - mean load) / mean load  (Wang et al., 2024).

    0 is perfect balance; 1 means the busiest expert has twice its fair share.
    """
    mean = load.double().mean()
    if mean == 0:
        raise ValueError("max_violation: the load is all zeros (no tokens were routed)")
    return float((load.double().max() - mean) / mean)


def _check_router_outputs(probs, topk_idx, num_experts, topk=None):
    if probs.shape[-1] != num_experts:
        raise ValueError(f"probs has {probs.shape[-1]} experts in its last dim but num_experts "
                         f"is {num_experts}; pass probabilities over all routed experts")
    if topk_idx.dtype != torch.int64 or topk_idx.shape[:-1] != probs.shape[:-1]:
        raise ValueError(f"topk_idx must be int64 of shape {tuple(probs.shape[:-1])} + (K',), "
                         f"got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if topk is not None and topk_idx.shape[-1] != topk:
        raise ValueError(f"topk_idx picks {topk_idx.shape[-1]} experts per token but topk is "
                         f"{topk}; they are the same K'")


def normalize_per_token(scores: torch.Tensor) -> torch.Tensor:
    """``s'_{i,t} = s_{i,t} / sum_j s_{j,t}``: each token's affinities over all ``N'``
    routed experts turned into a distribution (DeepSeek-V3, section 2.1.2).

    Softmax probabilities already are one.  Sigmoid affinities are not: at ``s = 0.5``
    everywhere the expert loss would be ``N'/2`` instead of 1.  Megatron-Core 0.20.0
    (d98e8a64, ``moe_utils.compute_routing_scores_for_aux_loss``) normalises a sigmoid
    router's scores this way before every auxiliary loss.
    """
    return scores / scores.sum(dim=-1, keepdim=True)


def _kinds(group) -> tuple:
    """``group`` as a tuple of group kinds: ``None`` -> (), ``"tp"`` -> ("tp",), a tuple as it is.

    Several kinds must be orthogonal (``("tp", "cp")`` under TP and CP together): an
    all-reduce over each in turn sums over their product, Megatron's TP x CP group."""
    return (group,) if isinstance(group, str) else tuple(group or ())


def _group_totals(group, num_tokens: int, counts: torch.Tensor):
    """``(num_tokens, counts)`` summed over the ranks of ``group`` (one all-reduce per kind;
    unchanged when ``group`` is None).  ``counts``: int64, any shape (empty for none)."""
    if not _kinds(group):
        return num_tokens, counts
    packed = torch.cat([counts.reshape(-1), counts.new_tensor([num_tokens])])
    for kind in _kinds(group):
        comm.all_reduce(packed, group=kind)
    return int(packed[-1]), packed[:-1].view(counts.shape)


def _whole_loss(part: torch.Tensor, group) -> torch.Tensor:
    """Value: the sum of every rank's ``part`` (the whole loss); gradient: this rank's ``part``."""
    if not _kinds(group):
        return part
    whole = part.detach().clone()
    for kind in _kinds(group):
        comm.all_reduce(whole, group=kind)
    return whole + (part - part.detach())


def _experts_per_device(num_experts: int, num_devices: int) -> int:
    if num_devices < 1 or num_experts % num_devices:
        lower = max(num_devices, num_experts // num_devices * num_devices)
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_devices "
                         f"({num_devices}): each device holds N'/D experts; try {lower} or "
                         f"{lower + num_devices} experts")
    return num_experts // num_devices


def expert_fractions(probs, topk_idx, num_experts, topk, group=None):
    """f_i = N'/(K' T) * #tokens choosing i (no grad) and P_i = (1/T) sum_t probs[t, i].

    With ``group``, ``T`` and the counts are the group's, and ``P`` sums this rank's
    tokens.
    """
    T, counts = _group_totals(group, probs.shape[0], expert_load(topk_idx, num_experts))
    f = counts.to(probs.dtype) * num_experts / (topk * T)
    P = probs.sum(dim=0) / T
    return f, P


# --- DeepSeekMoE / DeepSeek-V2 auxiliary losses ----------------------------


def expert_balance_loss(probs, topk_idx, num_experts, topk, coeff=1.0, group=None):
    """Expert-level balance loss (DeepSeekMoE 3.3; DeepSeek-V2 2.2.3)::

        L_ExpBal = alpha1 * sum_{i=1..N'} f_i P_i
        f_i = N' / (K' T) * sum_t 1(token t selects expert i)
        P_i = 1/T * sum_t s_{i,t}

    1 at perfect balance; at most ``N'/K'``, reached when every token picks the same K'
    experts and all probability lies on them.  Not a minimum at balance: an unbalanced
    routing can score below 1 (two tokens, probabilities ``(.4, .3, .3, 0)`` and
    ``(0, .3, .3, .4)``, top-1: 0.8 with two of four experts idle).  Only the
    gradient, ``coeff * f_i / T`` per token and expert, does the balancing.  ``group``:
    tokens split over ranks (see the module docstring).
    """
    _check_router_outputs(probs, topk_idx, num_experts, topk)
    f, P = expert_fractions(probs, topk_idx, num_experts, topk, group)
    return _whole_loss(coeff * (f * P).sum(), group)


def device_balance_loss(probs, topk_idx, num_experts, topk, num_devices, coeff=1.0,
                        group=None):
    """Device-level balance loss (DeepSeekMoE 3.3; DeepSeek-V2 2.2.3)::

        L_DevBal = alpha2 * sum_{d=1..D} f'_d P'_d
        f'_d = 1/|E_d| * sum_{j in E_d} f_j   (the MEAN of f over the device's experts)
        P'_d = sum_{j in E_d} P_j             (the SUM of P over the device's experts)

    1 at perfect balance; ``D`` when one device gets every pick and all the probability.
    """
    _check_router_outputs(probs, topk_idx, num_experts, topk)
    per_device = _experts_per_device(num_experts, num_devices)
    f, P = expert_fractions(probs, topk_idx, num_experts, topk, group)
    f_device = f.view(num_devices, per_device).mean(dim=1)
    P_device = P.view(num_devices, per_device).sum(dim=1)
    return _whole_loss(coeff * (f_device * P_device).sum(), group)


def communication_balance_loss(probs, topk_idx, num_experts, num_devices, max_devices,
                               coeff=1.0, group=None):
    """Communication balance loss (DeepSeek-V2 2.2.3)::

        L_CommBal = alpha3 * sum_{d=1..D} f''_d P''_d
        f''_d = D / (M T) * sum_t 1(token t is sent to device d)
        P''_d = sum_{j in E_d} P_j

    A token is counted once per device, however many of its experts live there.  With
    device-limited routing each token reaches at most M devices, so balanced traffic is
    ``M T / D`` tokens per device and the loss is 1; one device receiving every token
    (and all probability) gives ``D / M``.  Tokens reaching fewer than ``M`` devices
    (two experts on one device) lower it: with uniform probabilities it is the number
    of (token, device) sends over ``M T``.
    """
    _check_router_outputs(probs, topk_idx, num_experts)
    per_device = _experts_per_device(num_experts, num_devices)
    if not 1 <= max_devices <= num_devices:
        raise ValueError(f"max_devices (M = {max_devices}) must be between 1 and "
                         f"num_devices (D = {num_devices})")
    device_of_pick = topk_idx // per_device                        # [T, K']
    reaches = torch.zeros(probs.shape[0], num_devices, dtype=torch.bool,
                          device=probs.device)
    reaches.scatter_(1, device_of_pick, True)              # once per (token, device)
    T, received = _group_totals(group, probs.shape[0], reaches.sum(dim=0))
    f = received.to(probs.dtype) * num_devices / (max_devices * T)
    P = (probs.sum(dim=0) / T).view(num_devices, per_device).sum(dim=1)
    return _whole_loss(coeff * (f * P).sum(), group)


# --- DeepSeek-V3: complementary sequence-wise loss --------------------------


def sequence_balance_loss(scores, topk_idx, num_experts, topk, coeff=1.0, group=None):
    """Complementary sequence-wise balance loss (DeepSeek-V3 2.1.2), for each sequence::

        L_Bal = alpha * sum_{i=1..N'} f_i P_i
        f_i = N' / (K' S) * sum_t 1(token t selects expert i)      (t over the sequence)
        s'_{i,t} = s_{i,t} / sum_{j=1..N'} s_{j,t}                  (over ALL routed experts)
        P_i = 1/S * sum_t s'_{i,t}

    averaged over the ``B`` sequences.  ``scores`` is ``[B, S, N']`` (sigmoid affinities s,
    without the balancing bias, or probabilities already normalised: normalising twice
    changes nothing), ``topk_idx`` is ``[B, S, K']``.  The paper's indicator is
    ``s_{i,t} in Topk(s_t, K')``: the top-K' of the affinities alone, ``torch.topk(scores,
    K').indices``, not the experts the bias steered the tokens to (those are chosen by
    ``s + b``, :func:`tutorial_lib.moe.select_experts`).  Megatron-Core 0.20.0 (d98e8a64,
    ``moe_utils.compute_routing_scores_for_aux_loss``) counts the same unbiased top-k.
    The function counts whatever ``topk_idx`` it is given; :func:`total_aux_loss` picks it
    by ``BalanceConfig.sequence_loss_topk``.

    ``group``: ``None`` when each rank holds whole sequences.  When the tokens of each
    sequence are split over ranks (context or sequence parallelism), name the group kind
    that splits them (``"cp"``, ``"tp"``, ...): the per-sequence counts and the sequence
    length are summed over it, so ``f`` is the whole sequence's.  Every rank then returns
    the whole-sequence loss, and the gradient it backpropagates is the exact gradient of
    that loss with respect to its own tokens (the same gradient as Megatron-Core's
    per-rank partial loss), so summing router gradients over the group gives the serial one.
    All ranks of the group must hold the same ``B`` sequences.
    """
    _check_router_outputs(scores, topk_idx, num_experts, topk)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [B, S, N'] (one row of tokens per sequence), got "
                         f"{tuple(scores.shape)}")
    B, S_local, _ = scores.shape
    counts = torch.zeros(B, num_experts, dtype=torch.int64, device=scores.device)
    picks = topk_idx.reshape(B, -1)
    counts.scatter_add_(1, picks, torch.ones_like(picks))
    S, counts = _group_totals(group, S_local, counts)  # whole sequences: one all-reduce
    f = counts.to(scores.dtype) * num_experts / (topk * S)          # [B, N'], no grad
    P = normalize_per_token(scores).sum(dim=1) / S             # this rank's tokens only
    loss = coeff * (f * P).sum(dim=-1).mean()
    return _whole_loss(loss, group)  # value: the whole loss; gradient: this rank's part


# --- router z-loss (ST-MoE) ---------------------------------------------------


def router_z_loss(logits, coeff=1.0, group=None):
    """Router z-loss (ST-MoE): ``coeff * 1/T * sum_t (logsumexp_i logits[t, i])^2``.

    Keeps router logits small so the softmax stays well-conditioned in low precision.
    ``group``: tokens split over ranks; ``T`` is then the group's (see the module
    docstring).
    """
    T, _ = _group_totals(group, logits.shape[0], logits.new_zeros(0, dtype=torch.int64))
    z = torch.logsumexp(logits, dim=-1)
    return _whole_loss(coeff * z.square().sum() / T, group)


# --- DeepSeek-V3: auxiliary-loss-free balancing -------------------------------


def global_expert_load(topk_idx, num_experts, group=None):
    """:func:`expert_load` summed over ``group``: a group kind such as ``"dp"``, or
    several.

    ``None`` means this rank's tokens only (no communication; unlike ``comm``'s
    default).  For the bias update, sum over every rank routing different tokens
    through this layer, so that every rank applies the same update and the biases stay
    identical: ``"dp"`` (it includes the expert-parallel ranks) with CP = 1, else
    ``"dp_cp"``; under sequence parallelism the TP ranks route different tokens too, so
    pass ``("tp", "dp_cp")`` (two all-reduces over orthogonal groups sum over their
    product, Megatron's TP x CP x DP group).
    :meth:`tutorial_lib.moe.MoELayer.global_load` picks the groups for you.
    """
    load = expert_load(topk_idx, num_experts)
    for kind in ((group,) if isinstance(group, str) else (group or ())):
        comm.all_reduce(load, group=kind)
    return load


@torch.no_grad()
def update_expert_bias(bias, load, gamma):
    """DeepSeek-V3's bias step, in place, after each training step::

        b_i <- b_i + gamma * sign(mean_j load_j - load_i)

    An overloaded expert's bias falls by gamma, an underloaded one's rises; an expert at
    exactly the mean load keeps its bias.  ``load`` is the step's (global) expert load.
    """
    load = load.to(torch.float64)
    bias.add_(gamma * torch.sign(load.mean() - load).to(bias.dtype))
    return bias


# --- configuration and the convenience entry point ----------------------------


SEQUENCE_LOSS_TOPK = ("unbiased", "routed")


@dataclass
class BalanceConfig:
    """Which balancing terms a MoE layer uses, and how strongly.  Defaults: DeepSeek-V2."""

    alpha1: float = 0.003
    """Expert-level loss coefficient (DeepSeek-V2 and DeepSeekMoE 145B: 0.003)."""
    alpha2: float = 0.05
    """Device-level loss coefficient (DeepSeek-V2: 0.05)."""
    alpha3: float = 0.02
    """Communication loss coefficient (DeepSeek-V2: 0.02)."""
    sequence_alpha: float = 0.0001
    """Sequence-wise loss coefficient (DeepSeek-V3: 0.0001, "extremely small")."""
    z_loss_coeff: float = 0.001
    """Router z-loss coefficient (ST-MoE: 0.001)."""
    gamma: float = 0.001
    """Bias update speed (DeepSeek-V3: 0.001, then 0 for the last 500B tokens)."""
    use_expert_loss: bool = True
    """Add the expert-level loss (DeepSeekMoE, V2)."""
    use_device_loss: bool = True
    """Add the device-level loss (DeepSeekMoE, V2); needs ``num_devices``."""
    use_communication_loss: bool = True
    """Add the communication loss (V2); needs ``num_devices`` and ``max_devices``."""
    use_sequence_loss: bool = False
    """Add the sequence-wise loss (V3); needs ``probs`` shaped ``[B, S, N']``."""
    sequence_loss_topk: str = "unbiased"
    """Which experts the sequence-wise loss counts: ``"unbiased"``, each token's top-K' of
    its affinities alone (V3's formula, section 2.1.2, and Megatron-Core 0.20.0), or
    ``"routed"``, the experts it was really sent to (chosen with the bias and the device
    limit), which chapter 5 compares."""
    use_z_loss: bool = False
    """Add the router z-loss (ST-MoE); needs the router ``logits``."""
    use_bias_balancing: bool = False
    """Route by ``scores + bias`` (:func:`tutorial_lib.moe.select_experts`); call
    :func:`update_expert_bias` after each step (V3)."""

    def __post_init__(self):
        if self.sequence_loss_topk not in SEQUENCE_LOSS_TOPK:
            raise ValueError(f"sequence_loss_topk must be one of {SEQUENCE_LOSS_TOPK}, got "
                             f"{self.sequence_loss_topk!r}; V3's formula is 'unbiased'")

    @classmethod
    def deepseek_v3(cls, **changes) -> "BalanceConfig":
        """V3's recipe: bias balancing plus the small sequence-wise loss, nothing else
        (``changes``: other field values, e.g. ``gamma=0.01``)."""
        recipe = dict(use_expert_loss=False, use_device_loss=False, use_communication_loss=False,
                      use_sequence_loss=True, use_bias_balancing=True)
        return cls(**{**recipe, **changes})


def total_aux_loss(config, probs, topk_idx, num_experts, topk, num_devices=1, max_devices=None,
                   logits=None, group=None) -> dict:
    """Every enabled loss of ``config``, by name; add ``sum(losses.values())`` to the LM loss.

    ``probs``/``topk_idx``: ``[T, N']``/``[T, K']``, or ``[B, S, N']``/``[B, S, K']``
    (required by the sequence-wise loss; flattened for the others).  ``probs``: each token's
    distribution over all routed experts (softmax probabilities, or sigmoid affinities
    through :func:`normalize_per_token`).  ``topk_idx``: the experts the tokens were sent to,
    which the V2 losses count; the sequence-wise loss counts ``torch.topk(probs, K')``
    unless ``config.sequence_loss_topk == "routed"``.  ``max_devices`` defaults to
    ``num_devices`` (no device limit); with ``num_devices=1`` the device and communication
    losses are the constant 1.  ``group``: the group kind the tokens are split over (the
    TP group under sequence parallelism), or ``None``.  Keys: ``expert``, ``device``,
    ``communication``, ``sequence``, ``z``.
    """
    flat_probs, flat_idx = probs.reshape(-1, num_experts), topk_idx.reshape(-1, topk_idx.shape[-1])
    losses = {}
    if config.use_expert_loss:
        losses["expert"] = expert_balance_loss(flat_probs, flat_idx, num_experts, topk,
                                               config.alpha1, group)
    if config.use_device_loss:
        losses["device"] = device_balance_loss(flat_probs, flat_idx, num_experts, topk,
                                               num_devices, config.alpha2, group)
    if config.use_communication_loss:
        losses["communication"] = communication_balance_loss(
            flat_probs, flat_idx, num_experts, num_devices, max_devices or num_devices,
            config.alpha3, group)
    if config.use_sequence_loss:
        counted = topk_idx
        if config.sequence_loss_topk == "unbiased":  # V3: the top-K' of the affinities alone
            counted = torch.topk(probs.detach(), topk, dim=-1).indices
        losses["sequence"] = sequence_balance_loss(probs, counted, num_experts, topk,
                                                   config.sequence_alpha, group)
    if config.use_z_loss:
        if logits is None:
            raise ValueError("use_z_loss needs the router logits: pass logits=")
        losses["z"] = router_z_loss(logits, config.z_loss_coeff, group)
    return losses
