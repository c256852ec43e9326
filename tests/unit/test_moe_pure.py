"""The MoE layer's pure parts, in one process: router math, capacity, serial dispatch.

Hand-made affinities check the rules of each paper (DeepSeek-V2's softmax gates and
device-limited routing, V3's sigmoid gates normalised then scaled, the bias that steers
the choice only); the serial layer is checked against a per-token loop.  Exact
comparisons where the math is a selection or a permutation; fp32 ``atol=rtol=1e-6``
where it sums.
"""
import math

import pytest
import torch

from tutorial_lib import moe, moe_balance

N, K, H = 8, 2, 8


def _identity_router(num_experts, topk, **kwargs):
    """A router whose logits are its input (weight = identity): hand-made logits in, routing out."""
    router = moe.Router(num_experts, num_experts, topk, **kwargs)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    return router


def test_softmax_gates_are_the_topk_probabilities_unnormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    out = _identity_router(4, 2, score_function="softmax", routed_scaling_factor=1.0)(logits)
    probs = torch.softmax(logits, dim=-1)
    assert out.topk_idx.tolist() == [[0, 1], [1, 3]]
    assert torch.equal(out.gates, probs.gather(1, out.topk_idx))  # V2: no renormalisation
    assert torch.equal(out.scores, probs) and torch.equal(out.logits, logits)
    assert out.gates.dtype == torch.float32 and out.topk_idx.dtype == torch.int64


def test_sigmoid_gates_are_normalised_over_the_chosen_then_scaled():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    out = _identity_router(4, 2, score_function="sigmoid", routed_scaling_factor=2.5)(logits)
    s = torch.sigmoid(logits)
    chosen = s.gather(1, out.topk_idx)
    assert out.topk_idx.tolist() == [[0, 1], [1, 3]]
    assert torch.allclose(out.gates, 2.5 * chosen / chosen.sum(1, keepdim=True), atol=1e-6, rtol=1e-6)
    assert torch.allclose(out.gates.sum(1), torch.full((2,), 2.5), atol=1e-6, rtol=1e-6)
    assert torch.equal(out.scores, s)


def test_normalize_topk_overrides_each_papers_default():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    soft = _identity_router(4, 2, normalize_topk=True)(logits)
    assert torch.allclose(soft.gates.sum(), torch.tensor(1.0), atol=1e-6)
    sig = _identity_router(4, 2, score_function="sigmoid", normalize_topk=False)(logits)
    assert torch.equal(sig.gates, torch.sigmoid(logits)[:, :2])


def test_device_limited_routing_picks_the_devices_with_the_best_single_affinity():
    # 8 experts on D = 4 devices (2 each).  Unlimited top-4 = experts 0, 4, 6, 7: 3 devices.
    # Device scores (max of its experts): d0 .90, d1 .20, d2 .88, d3 .87 -> M = 2 keeps d0, d2
    # (not d3, although d3's two experts sum higher than d2's: V2 ranks devices by the max).
    scores = torch.tensor([[0.90, 0.85, 0.10, 0.20, 0.88, 0.10, 0.87, 0.86]])
    assert torch.topk(scores, 4).indices.tolist() == [[0, 4, 6, 7]]
    limited = moe.select_experts(scores, 4, device_limit=2, num_devices=4)
    assert limited.tolist() == [[0, 4, 1, 5]]
    assert moe.select_experts(scores, 2, device_limit=1, num_devices=4).tolist() == [[0, 1]]


def test_device_limited_routing_on_random_scores_reaches_at_most_m_devices():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(64, 16, generator=g)
    D, M, topk = 8, 3, 4
    idx = moe.select_experts(scores, topk, device_limit=M, num_devices=D)
    best_devices = torch.topk(scores.view(64, D, 2).amax(-1), M).indices
    for t in range(64):
        devices = set((idx[t] // 2).tolist())
        assert len(devices) <= M and devices <= set(best_devices[t].tolist())
        allowed = [e for e in range(16) if e // 2 in best_devices[t].tolist()]
        expected = sorted(allowed, key=lambda e: -scores[t, e].item())[:topk]
        assert idx[t].tolist() == expected


def test_node_limited_routing_ranks_nodes_by_the_sum_of_their_k_over_m_best_affinities():
    """DeepSeek-V3 (arXiv:2412.19437) section 2.1.2: each token reaches at most M nodes,
    chosen by the sum of the K_r/M highest affinities of the experts on each node.
    Megatron-Core 0.20.0 (d98e8a64), megatron/core/transformer/moe/moe_utils.py
    ``group_limited_topk``: group score = sum of the top ``topk // group_topk`` scores of
    the group.  DeepSeek-V2 (arXiv:2405.04434) section 2.2.2 keeps the single best
    affinity per device, so the two rules pick different groups below.  The router used
    V2's rule for every score function before, so a V3 (sigmoid) router ranked nodes by
    their best expert."""
    # 8 experts on 4 nodes (2 each); K = 4, M = 2: V3 sums each node's top K/M = 2.
    # node sums: n0 .90+.10 = 1.00, n1 .60+.55 = 1.15, n2 .88+.05 = .93, n3 .58+.57 = 1.15
    # node maxima: n0 .90, n1 .60, n2 .88, n3 .58
    scores = torch.tensor([[0.90, 0.10, 0.60, 0.55, 0.88, 0.05, 0.58, 0.57]])
    v2 = moe.select_experts(scores, 4, device_limit=2, num_devices=4, rule="v2")
    v3 = moe.select_experts(scores, 4, device_limit=2, num_devices=4, rule="v3")
    assert sorted((v2[0] // 2).unique().tolist()) == [0, 2]      # the best single experts
    assert sorted((v3[0] // 2).unique().tolist()) == [1, 3]      # the best pairs
    assert v3.tolist() == [[2, 6, 7, 3]]
    assert torch.allclose(moe.group_scores(scores, 4, 4, 2, "v3"),
                          torch.tensor([[1.00, 1.15, 0.93, 1.15]]))
    # each paper's router picks its own rule: sigmoid (V3) sums, softmax (V2) takes the max
    logits = torch.logit(scores)
    v3_router = _identity_router(8, 4, score_function="sigmoid", device_limit=2, num_devices=4)
    assert v3_router.device_limit_rule == "v3"
    assert v3_router(logits).topk_idx.tolist() == v3.tolist()
    v2_router = _identity_router(8, 4, device_limit=2, num_devices=4)
    assert v2_router.device_limit_rule == "v2"
    with pytest.raises(ValueError, match="device_limit_rule"):
        _identity_router(8, 4, device_limit=2, num_devices=4, device_limit_rule="v4")
    # with K < 2M each node contributes one affinity: the rules agree
    assert torch.equal(moe.select_experts(scores, 2, device_limit=2, num_devices=4, rule="v3"),
                       moe.select_experts(scores, 2, device_limit=2, num_devices=4, rule="v2"))


def test_device_limit_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"device_limit \(M = 5\)"):
        moe.select_experts(torch.rand(2, 8), 2, device_limit=5, num_devices=4)
    with pytest.raises(ValueError, match=r"topk \(5\) exceeds"):
        moe.select_experts(torch.rand(2, 8), 5, device_limit=2, num_devices=4)


def test_expert_bias_changes_the_choice_but_never_the_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 2.5]])
    router = _identity_router(4, 2, score_function="sigmoid", use_expert_bias=True)
    plain = router(logits)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    biased = router(logits)
    assert plain.topk_idx.tolist() == [[0, 1], [1, 3]]
    assert biased.topk_idx.tolist() == [[3, 0], [3, 1]]  # expert 3 pulled in by its bias
    s = torch.sigmoid(logits)
    chosen = s.gather(1, biased.topk_idx)  # the unbiased affinities
    assert torch.allclose(biased.gates, chosen / chosen.sum(1, keepdim=True), atol=1e-6, rtol=1e-6)
    assert torch.equal(biased.scores, plain.scores)  # scores never see the bias
    # the same choice and gates as select_experts + gates_from_scores, which chapter 5 shows
    idx = moe.select_experts(s, 2, router.expert_bias)
    gates = moe.gates_from_scores(s, idx, normalize=False)
    assert torch.equal(idx, biased.topk_idx) and torch.equal(gates, chosen)
    assert [n for n, _ in router.named_buffers()] == ["expert_bias"]
    assert "expert_bias" not in dict(router.named_parameters())


def test_router_rejects_bad_arguments():
    with pytest.raises(ValueError, match="score_function"):
        moe.Router(4, 4, 2, score_function="relu")
    with pytest.raises(ValueError, match=r"topk \(5\)"):
        moe.Router(4, 4, 5)


# --- capacity -------------------------------------------------------------------------------


def _brute_force_keep(topk_idx, gates, num_experts, capacity):
    keep = torch.zeros_like(topk_idx, dtype=torch.bool)
    for e in range(num_experts):
        slots = [(t, k) for t in range(topk_idx.shape[0]) for k in range(topk_idx.shape[1])
                 if topk_idx[t, k] == e]
        slots.sort(key=lambda tk: (-gates[tk].item(), tk[0] * topk_idx.shape[1] + tk[1]))
        for t, k in slots[:capacity]:
            keep[t, k] = True
    return keep


def test_capacity_drops_the_lowest_gate_copies_of_each_overloaded_expert():
    # 4 tokens, K = 2, N = 4, factor 1 -> capacity ceil(4 * 2 / 4) = 2 per expert.
    topk_idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    gates = torch.tensor([[0.5, 0.4], [0.7, 0.2], [0.6, 0.3], [0.8, 0.1]])
    assert moe.capacity_per_expert(4, 2, 4, 1.0) == 2
    keep = moe.capacity_keep_mask(topk_idx, gates, 4, 1.0)
    # expert 0 got 4 copies (gates .5 .7 .6 .1): the .5 and .1 ones are dropped
    assert keep.tolist() == [[False, True], [True, True], [True, True], [True, False]]
    assert int((~keep).sum()) == 2


def test_capacity_matches_a_brute_force_on_random_routings():
    g = torch.Generator().manual_seed(1)
    for factor in (0.5, 1.0, 1.25, 4.0):
        scores = torch.rand(24, N, generator=g)
        topk_idx = torch.topk(scores ** 3, K).indices  # skewed: some experts overloaded
        gates = scores.gather(1, topk_idx)
        capacity = math.ceil(factor * 24 * K / N)
        keep = moe.capacity_keep_mask(topk_idx, gates, N, factor)
        assert torch.equal(keep, _brute_force_keep(topk_idx, gates, N, capacity))
        load = torch.bincount(topk_idx.reshape(-1), minlength=N)
        assert int((~keep).sum()) == int((load - capacity).clamp(min=0).sum())


def test_device_level_dropping_keeps_each_devices_best_copies_and_protected_tokens():
    """DeepSeek-V2 (arXiv:2405.04434) section 2.2.4: device-level token dropping with a
    capacity factor of 1.0 per device, the lowest-affinity tokens of each device dropped
    first, and the tokens of about 10% of the sequences never dropped."""
    # 4 tokens, K = 2, 8 experts on D = 2 devices -> budget ceil(4 * 2 / 2) = 4 per device
    topk_idx = torch.tensor([[0, 1], [0, 3], [1, 5], [3, 2]])   # device 0 gets 7 copies
    gates = torch.tensor([[0.5, 0.4], [0.7, 0.2], [0.6, 0.3], [0.8, 0.1]])
    keep = moe.device_capacity_keep_mask(topk_idx, gates, 8, 2)
    # device 0's copies by gate: .8 .7 .6 .5 | .4 .2 .1 dropped; device 1's one copy stays
    assert keep.tolist() == [[True, False], [True, False], [True, True], [True, False]]
    # per expert (capacity ceil(8/8) = 1 each) expert 0 would keep .7 and drop .5
    per_expert = moe.capacity_keep_mask(topk_idx, gates, 8, 1.0)
    assert per_expert[0, 0].item() is False and keep[0, 0].item() is True
    # token 1 protected: both its copies stay, the budget still drops the lowest others
    protected = moe.device_capacity_keep_mask(topk_idx, gates, 8, 2,
                                              never_drop=torch.tensor([False, True, False,
                                                                       False]))
    assert protected.tolist() == [[False, False], [True, True], [True, True], [True, False]]
    # a protected token beyond the budget is kept anyway
    everyone = moe.device_capacity_keep_mask(topk_idx, gates, 8, 2,
                                             never_drop=torch.ones(4, dtype=torch.bool))
    assert everyone.all()


def test_deduplicated_dispatch_on_one_rank_is_the_weighted_sum_of_copies():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 2, H, generator=g)
    outs = []
    for dedup in (False, True):
        layer = moe.MoELayer(H, N, K, 4, num_shared_experts=1, capacity_factor=1.0, seed=2,
                             ep_group=None, tp_group=None, deduplicate=dedup)
        xs = x.clone().requires_grad_()
        y, info = layer(xs)
        (y * x).sum().backward()
        outs.append((y, xs.grad, layer.router.weight.grad, info))
    (y0, dx0, gr0, info0), (y1, dx1, gr1, info1) = outs
    assert info0["num_dropped"] > 0 and info1["rows_per_leg"] == []
    for a, b in ((y0, y1), (dx0, dx1), (gr0, gr1)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(info0["tokens_per_expert"], info1["tokens_per_expert"])


# --- serial dispatch and the serial layer -----------------------------------------------------


def test_serial_dispatch_then_combine_is_exact_and_sorts_by_expert():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, H, generator=g, requires_grad=True)
    topk_idx = torch.topk(torch.rand(10, N, generator=g), K).indices
    dispatcher = moe.AllToAllDispatcher(N, ep_group=None)
    rows, per_expert, state = dispatcher.dispatch(x, topk_idx)
    assert per_expert == torch.bincount(topk_idx.reshape(-1), minlength=N).tolist()
    owners = torch.repeat_interleave(torch.arange(N), torch.tensor(per_expert))
    # every row sent to expert e is a token that chose e
    for row, e in zip(rows, owners):
        t = int(torch.nonzero((x == row).all(1))[0])
        assert e in topk_idx[t]
    copies = dispatcher.combine(rows, state)
    assert torch.equal(copies, x.unsqueeze(1).expand(10, K, H))
    (copies * torch.arange(1.0, K + 1)[None, :, None]).sum().backward()
    assert torch.equal(x.grad, torch.full((10, H), float(sum(range(1, K + 1)))))


def test_serial_layer_equals_a_per_token_loop():
    layer = moe.MoELayer(H, N, K, ffn_hidden_size=4, num_shared_experts=2, score_function="sigmoid",
                         routed_scaling_factor=2.0, seed=3, ep_group=None, tp_group=None)
    x = torch.randn(3, 2, H, generator=torch.Generator().manual_seed(3))
    y, info = layer(x)
    tokens = x.reshape(-1, H)
    ex, sh = layer.experts, layer.shared_experts
    for t in range(tokens.shape[0]):
        s = torch.sigmoid(layer.router.weight @ tokens[t])
        idx = torch.topk(s, K).indices
        gates = 2.0 * s[idx] / s[idx].sum()
        expected = sum(g * moe.swiglu(tokens[t], ex.weight_gate[e], ex.weight_up[e], ex.weight_down[e])
                       for g, e in zip(gates, idx))
        expected = expected + moe.swiglu(tokens[t], sh.weight_gate, sh.weight_up, sh.weight_down)
        assert torch.allclose(y.reshape(-1, H)[t], expected, atol=1e-6, rtol=1e-6)
    assert info["tokens_per_expert"].sum() == tokens.shape[0] * K and info["num_dropped"] == 0
    assert sh.weight_gate.shape == (8, H)  # 2 shared experts of ffn 4 merged into one of 8


def test_expert_shards_are_slices_of_one_master_and_marked_expert_dp():
    full = moe.RoutedExperts(N, H, 4, ep_size=1, ep_rank=0, seed=5)
    for ep_rank in range(4):
        shard = moe.RoutedExperts(N, H, 4, ep_size=4, ep_rank=ep_rank, seed=5)
        assert shard.first_expert == 2 * ep_rank
        for name in ("weight_gate", "weight_up", "weight_down"):
            assert torch.equal(getattr(shard, name), getattr(full, name)[2 * ep_rank:2 * ep_rank + 2])
            assert getattr(shard, name).allreduce_group == "expert_dp"
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by "
                                         r"expert_model_parallel_size \(4\)"):
        moe.RoutedExperts(6, H, 4, ep_size=4)


def test_a_rank_with_no_tokens_runs_forward_and_backward():
    layer = moe.MoELayer(H, N, K, 4, num_shared_experts=1, capacity_factor=1.0,
                         balance=moe_balance.BalanceConfig(), ep_group=None, tp_group=None)
    x = torch.zeros(0, 2, H, requires_grad=True)
    y, info = layer(x)
    y.sum().backward()
    assert y.shape == (0, 2, H) and info["aux_losses"] == {} and info["num_dropped"] == 0
    assert torch.equal(layer.experts.weight_gate.grad, torch.zeros_like(layer.experts.weight_gate))


def test_an_input_split_over_tp_needs_the_layer_to_route_its_own_tokens():
    """``input_is_sequence_parallel`` says the hidden states arrive as this TP rank's
    ``s/TP`` tokens (a model with sequence parallelism throughout); without
    ``sequence_parallel`` the layer would not count its tokens as split (balance losses,
    expert load, the router's partial gradient), so the pair is refused when built."""
    with pytest.raises(moe.ConfigError, match="input_is_sequence_parallel=True") as error:
        moe.MoELayer(H, N, K, 4, ep_group=None, tp_group=None, input_is_sequence_parallel=True)
    assert "sequence_parallel=True" in str(error.value)
    layer = moe.MoELayer(H, N, K, 4, ep_group=None, tp_group=None, sequence_parallel=True,
                         input_is_sequence_parallel=True)
    y, _ = layer(torch.randn(3, 2, H))  # serial: no group to split over, shapes kept
    assert y.shape == (3, 2, H)
