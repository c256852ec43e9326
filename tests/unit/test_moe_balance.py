"""DeepSeekMoE balancing, checked against closed forms and literal loop references.

The loop references (``_reference_*``) transcribe the papers' formulas token by token in
plain Python; the library's vectorised versions must agree to float64 round-off.  Closed
forms: every balance loss is exactly its coefficient at perfect balance, the expert loss
peaks at N'/K', the device loss at D, the communication loss at D/M.
"""
import ast
import inspect
import math

import pytest
import torch

from tutorial_lib import moe, moe_balance

# --- builders ------------------------------------------------------------------


def _balanced_routing(num_tokens, num_experts, topk):
    """Token t picks experts (t + j N'/K') mod N', j < K': every expert is picked equally often.

    With K' dividing D (and D dividing N'), the picks of one token land on K' different
    devices and every device receives the same number of tokens.
    """
    t = torch.arange(num_tokens).unsqueeze(1)
    j = torch.arange(topk).unsqueeze(0)
    return (t + j * (num_experts // topk)) % num_experts


def _random_router(num_tokens, num_experts, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    return probs, torch.topk(probs, topk, dim=-1).indices


def _reference_f_and_P(probs, topk_idx, num_experts, topk):
    T = len(probs)
    f = [num_experts / (topk * T) * sum(i in topk_idx[t] for t in range(T))
         for i in range(num_experts)]
    P = [sum(probs[t][i] for t in range(T)) / T for i in range(num_experts)]
    return f, P


def _reference_expert(probs, topk_idx, num_experts, topk):
    f, P = _reference_f_and_P(probs.tolist(), topk_idx.tolist(), num_experts, topk)
    return sum(f[i] * P[i] for i in range(num_experts))


def _reference_device(probs, topk_idx, num_experts, topk, D):
    f, P = _reference_f_and_P(probs.tolist(), topk_idx.tolist(), num_experts, topk)
    E = [range(d * num_experts // D, (d + 1) * num_experts // D) for d in range(D)]
    return sum(sum(f[j] for j in E[d]) / len(E[d]) * sum(P[j] for j in E[d]) for d in range(D))


def _reference_comm(probs, topk_idx, num_experts, D, M):
    probs, topk_idx, T = probs.tolist(), topk_idx.tolist(), len(probs)
    E = [range(d * num_experts // D, (d + 1) * num_experts // D) for d in range(D)]
    total = 0.0
    for d in range(D):
        sent = sum(any(j in E[d] for j in topk_idx[t]) for t in range(T))
        total += D / (M * T) * sent * sum(probs[t][j] for t in range(T) for j in E[d]) / T
    return total


def _reference_sequence(scores, topk_idx, num_experts, topk):
    per_sequence = []
    for s, idx in zip(scores.tolist(), topk_idx.tolist()):
        normalised = [[v / sum(row) for v in row] for row in s]  # over ALL routed experts
        f, P = _reference_f_and_P(normalised, idx, num_experts, topk)
        per_sequence.append(sum(f[i] * P[i] for i in range(num_experts)))
    return sum(per_sequence) / len(per_sequence)


# --- closed forms -----------------------------------------------------------------


@pytest.mark.parametrize("num_experts,topk,devices",
                         [(8, 2, 4), (16, 4, 4), (16, 2, 2), (12, 3, 3)])
def test_every_balance_loss_is_its_coefficient_at_perfect_balance(num_experts, topk, devices):
    T, coeff = 2 * num_experts, 0.25
    topk_idx = _balanced_routing(T, num_experts, topk)
    probs = torch.full((T, num_experts), 1.0 / num_experts, dtype=torch.float64)
    assert (moe_balance.expert_load(topk_idx, num_experts) == T * topk // num_experts).all()
    assert moe_balance.expert_balance_loss(probs, topk_idx, num_experts, topk, coeff) / coeff == 1.0
    assert moe_balance.device_balance_loss(probs, topk_idx, num_experts, topk, devices, coeff) / coeff == 1.0
    # each token reaches exactly M = K' devices, each device MT/D tokens
    comm = moe_balance.communication_balance_loss(probs, topk_idx, num_experts, devices, topk, coeff)
    assert comm / coeff == pytest.approx(1.0, rel=1e-15)
    # sequence-wise: two sequences, each balanced on its own; any constant affinity
    scores = torch.full((2, T, num_experts), 0.5, dtype=torch.float64)
    seq = moe_balance.sequence_balance_loss(scores, topk_idx.expand(2, T, topk), num_experts, topk, coeff)
    assert seq / coeff == pytest.approx(1.0, rel=1e-15)


def test_expert_loss_peaks_at_n_over_k_when_every_token_picks_the_same_experts():
    # All T tokens pick experts {0..K'-1}: f_i = N'/K' for them, 0 elsewhere.  Whatever the
    # probabilities, if all their mass sits on those K' experts, sum_i f_i P_i = N'/K'.
    N, K, T = 16, 4, 10
    topk_idx = torch.arange(K).expand(T, K)
    uniform_on_chosen = torch.zeros(T, N, dtype=torch.float64)
    uniform_on_chosen[:, :K] = 1.0 / K        # P_i = 1/K' -> K' * (N'/K') * (1/K') = N'/K'
    assert moe_balance.expert_balance_loss(uniform_on_chosen, topk_idx, N, K) == N / K
    one_hot_on_chosen = torch.zeros(T, N, dtype=torch.float64)
    one_hot_on_chosen[:, 2] = 1.0
    assert moe_balance.expert_balance_loss(one_hot_on_chosen, topk_idx, N, K) == N / K
    # and it is the maximum: f_i <= N'/K' and sum_i P_i = 1
    for seed in range(5):
        probs, idx = _random_router(T, N, K, seed)
        assert moe_balance.expert_balance_loss(probs, idx, N, K) < N / K


def test_device_loss_is_d_when_one_device_gets_everything():
    N, K, D, T = 16, 2, 4, 12
    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(T, N, dtype=torch.float64)
    probs[:, :N // D] = torch.softmax(torch.randn(T, N // D, generator=g, dtype=torch.float64), -1)
    topk_idx = torch.topk(probs, K, dim=-1).indices           # all picks on device 0's experts
    assert moe_balance.device_balance_loss(probs, topk_idx, N, K, D) == pytest.approx(D, rel=1e-14)


def test_communication_loss_edge_cases():
    N, D, T = 8, 4, 6
    probs = torch.zeros(T, N, dtype=torch.float64)
    probs[:, 2:4] = 0.5                                        # all probability on device 1
    both_on_device_1 = torch.tensor([[2, 3]] * T)
    one_on_device_1 = torch.tensor([[2]] * T)
    for M in (1, 2, 4):  # one device receiving every token: D / M
        loss = moe_balance.communication_balance_loss(probs, both_on_device_1, N, D, M)
        assert loss == pytest.approx(D / M)
    # a token is counted once per device, however many of its experts live there
    assert (moe_balance.communication_balance_loss(probs, both_on_device_1, N, D, 2)
            == moe_balance.communication_balance_loss(probs, one_on_device_1, N, D, 2))
    # M = D and every token reaching every device: 1, whatever the probabilities
    random_probs, _ = _random_router(T, N, D, seed=3)
    every_device = torch.tensor([[0, 2, 4, 6]] * T)
    assert moe_balance.communication_balance_loss(random_probs, every_device, N, D, D) == pytest.approx(1.0)
    # no traffic to where the probability is: 0
    assert moe_balance.communication_balance_loss(probs, torch.tensor([[0, 7]] * T), N, D, 2) == 0.0
    with pytest.raises(ValueError, match=r"max_devices \(M = 5\) must be between 1 and"):
        moe_balance.communication_balance_loss(probs, both_on_device_1, N, D, 5)


def test_sequence_loss_sees_imbalance_inside_each_sequence():
    # Sequence 0 uses only experts {0, 1}, sequence 1 only {2, 3}: the batch as a whole is
    # perfectly balanced (token-level loss 1), each sequence is not (sequence loss N'/K' = 2).
    N, K, S = 4, 2, 4
    scores = torch.zeros(2, S, N, dtype=torch.float64)
    scores[0, :, :2] = 0.75
    scores[1, :, 2:] = 0.75
    topk_idx = torch.stack([torch.tensor([[0, 1]] * S), torch.tensor([[2, 3]] * S)])
    assert moe_balance.sequence_balance_loss(scores, topk_idx, N, K) == 2.0
    flat = (scores / scores.sum(-1, keepdim=True)).reshape(-1, N)
    assert moe_balance.expert_balance_loss(flat, topk_idx.reshape(-1, K), N, K) == 1.0


def test_sequence_loss_is_the_mean_of_independent_per_sequence_losses():
    B, S, N, K = 3, 7, 8, 2
    g = torch.Generator().manual_seed(1)
    scores = torch.sigmoid(torch.randn(B, S, N, generator=g, dtype=torch.float64))
    topk_idx = torch.topk(scores, K, dim=-1).indices
    one_by_one = [moe_balance.sequence_balance_loss(scores[b:b + 1], topk_idx[b:b + 1], N, K)
                  for b in range(B)]
    whole = moe_balance.sequence_balance_loss(scores, topk_idx, N, K)
    torch.testing.assert_close(whole, torch.stack(one_by_one).mean(), rtol=1e-14, atol=0)
    # changing sequence 2 leaves sequence 0's term alone
    scores2, idx2 = scores.clone(), topk_idx.clone()
    scores2[2], idx2[2] = scores[0], topk_idx[0]
    changed = moe_balance.sequence_balance_loss(scores2, idx2, N, K)
    torch.testing.assert_close(changed, (2 * one_by_one[0] + one_by_one[1]) / 3, rtol=1e-14, atol=0)


def test_losses_match_the_papers_formulas_written_as_loops():
    N, K, D, M, T = 8, 3, 4, 2, 9
    probs, topk_idx = _random_router(T, N, K, seed=7)
    torch.testing.assert_close(moe_balance.expert_balance_loss(probs, topk_idx, N, K, 0.003).item(),
                               0.003 * _reference_expert(probs, topk_idx, N, K))
    torch.testing.assert_close(moe_balance.device_balance_loss(probs, topk_idx, N, K, D, 0.05).item(),
                               0.05 * _reference_device(probs, topk_idx, N, K, D))
    torch.testing.assert_close(moe_balance.communication_balance_loss(probs, topk_idx, N, D, M, 0.02).item(),
                               0.02 * _reference_comm(probs, topk_idx, N, D, M))
    g = torch.Generator().manual_seed(8)
    scores = torch.sigmoid(torch.randn(2, 5, N, generator=g, dtype=torch.float64))
    idx = torch.topk(scores, K, dim=-1).indices
    torch.testing.assert_close(moe_balance.sequence_balance_loss(scores, idx, N, K, 1e-4).item(),
                               1e-4 * _reference_sequence(scores, idx, N, K))


def test_router_z_loss_closed_form():
    T, N = 5, 8
    zeros = torch.zeros(T, N, dtype=torch.float64)
    assert moe_balance.router_z_loss(zeros) == pytest.approx(math.log(N) ** 2)
    c = torch.arange(T, dtype=torch.float64).unsqueeze(1).expand(T, N)  # row t constant t
    expected = sum((t + math.log(N)) ** 2 for t in range(T)) / T
    assert moe_balance.router_z_loss(c, coeff=0.001) == pytest.approx(0.001 * expected)
    logits = torch.randn(T, N, dtype=torch.float64)
    by_hand = torch.log(torch.exp(logits).sum(-1)).pow(2).mean()
    torch.testing.assert_close(moe_balance.router_z_loss(logits), by_hand)


def test_expert_load_and_max_violation():
    load = moe_balance.expert_load(torch.tensor([[0, 2], [2, 3], [0, 2]]), num_experts=5)
    assert load.dtype == torch.int64 and load.tolist() == [2, 0, 3, 1, 0]
    assert moe_balance.max_violation(torch.tensor([4, 4, 4, 4])) == 0.0
    assert moe_balance.max_violation(torch.tensor([8, 0, 4, 4])) == 1.0       # (8 - 4) / 4
    assert moe_balance.max_violation(torch.tensor([12, 0, 0, 0])) == 3.0      # all on one: N - 1
    assert moe_balance.max_violation(load) == pytest.approx((3 - 1.2) / 1.2)
    with pytest.raises(ValueError, match="all zeros"):
        moe_balance.max_violation(torch.zeros(4, dtype=torch.int64))


# --- auxiliary-loss-free balancing --------------------------------------------------


def test_update_expert_bias_moves_by_gamma_toward_the_mean_in_place():
    bias = torch.zeros(4)
    out = moe_balance.update_expert_bias(bias, torch.tensor([3, 1, 2, 2]), gamma=0.01)  # mean 2
    assert out is bias
    torch.testing.assert_close(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    learnable = torch.zeros(4, requires_grad=True)  # even a leaf that wants grad: no graph
    moe_balance.update_expert_bias(learnable, torch.tensor([3, 1, 2, 2]), gamma=0.01)
    assert learnable.grad_fn is None


def test_biased_topk_selects_with_the_bias_and_gates_without_it():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.3, 0.7, 0.6, 0.5]])
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])                      # pushes expert 2 in
    idx = moe.select_experts(scores, 2, bias)
    gates = moe.gates_from_scores(scores, idx, normalize=False)
    assert idx.tolist() == [[2, 0], [2, 1]]
    assert torch.equal(gates, torch.tensor([[0.1, 0.9], [0.6, 0.7]]))  # raw affinities


def test_bias_update_balances_a_skewed_router_without_touching_the_gates():
    # The same 2,048 tokens every step: with no fresh batch there is no sampling noise in
    # the load, so MaxVio measures the router and its bias, not the dice, and a small batch
    # and a larger step (gamma) settle in about 60 steps (fresh batches of this size would
    # keep MaxVio near 0.1 by noise alone; the test once drew 16,384 tokens 400 times).
    N, K, T, gamma, steps = 16, 2, 2048, 5e-3, 120
    g = torch.Generator().manual_seed(0)
    preference = torch.linspace(2.0, -2.0, N)      # expert 0 strongly preferred, 15 shunned
    scores = torch.sigmoid(preference + torch.randn(T, N, generator=g))
    bias = torch.zeros(N)
    max_vio = []
    for step in range(steps):
        topk_idx = moe.select_experts(scores, K, bias)
        gates = moe.gates_from_scores(scores, topk_idx, normalize=False)
        assert torch.equal(gates, scores.gather(-1, topk_idx))    # the bias never gates
        load = moe_balance.expert_load(topk_idx, N)
        max_vio.append(moe_balance.max_violation(load))
        moe_balance.update_expert_bias(bias, load, gamma)
    assert max_vio[0] > 1.0                                         # about 3.3 here
    first_balanced = next(i for i, v in enumerate(max_vio) if v < 0.1)
    assert first_balanced <= 80, first_balanced                    # about 60 steps
    assert max(max_vio[-50:]) < 0.1, max(max_vio[-50:])            # and it stays there
    assert bias[0] < 0 < bias[-1] and (bias.max() - bias.min()) > 0.3   # it took real bias
    assert (torch.topk(scores, K).indices != topk_idx).any()           # ...and it changed picks


# --- gradients -------------------------------------------------------------------


def test_losses_are_differentiable_in_probs_and_the_counts_carry_no_gradient():
    N, K, D, T = 8, 2, 4, 6
    probs, topk_idx = _random_router(T, N, K, seed=2)
    probs.requires_grad_(True)
    for fn in (lambda p: moe_balance.expert_balance_loss(p, topk_idx, N, K, 0.5),
               lambda p: moe_balance.device_balance_loss(p, topk_idx, N, K, D),
               lambda p: moe_balance.communication_balance_loss(p, topk_idx, N, D, 2),
               lambda p: moe_balance.router_z_loss(p),
               lambda p: moe_balance.sequence_balance_loss(torch.sigmoid(p).view(2, 3, N),
                                                  topk_idx.view(2, 3, K), N, K)):
        assert torch.autograd.gradcheck(fn, (probs,))
    # the loss is linear in probs with slope coeff * f_i / T (f from the fixed counts)
    (grad,) = torch.autograd.grad(moe_balance.expert_balance_loss(probs, topk_idx, N, K, 0.5), probs)
    f = moe_balance.expert_load(topk_idx, N).double() * N / (K * T)
    torch.testing.assert_close(grad, (0.5 * f / T).expand(T, N))


# --- config, convenience and errors -----------------------------------------------


def test_total_aux_loss_returns_the_enabled_losses_by_name():
    N, K, D = 8, 2, 4
    probs, topk_idx = _random_router(12, N, K, seed=4)
    logits = torch.log(probs)
    v2 = moe_balance.total_aux_loss(moe_balance.BalanceConfig(), probs, topk_idx, N, K, num_devices=D, max_devices=2)
    assert set(v2) == {"expert", "device", "communication"}
    assert v2["expert"] == moe_balance.expert_balance_loss(probs, topk_idx, N, K, 0.003)
    assert v2["device"] == moe_balance.device_balance_loss(probs, topk_idx, N, K, D, 0.05)
    assert v2["communication"] == moe_balance.communication_balance_loss(probs, topk_idx, N, D, 2, 0.02)
    v3 = moe_balance.total_aux_loss(moe_balance.BalanceConfig.deepseek_v3(), probs.view(3, 4, N),
                           topk_idx.view(3, 4, K), N, K)
    assert set(v3) == {"sequence"} and moe_balance.BalanceConfig.deepseek_v3().use_bias_balancing
    assert v3["sequence"] == moe_balance.sequence_balance_loss(probs.view(3, 4, N), topk_idx.view(3, 4, K),
                                                      N, K, 1e-4)
    z = moe_balance.total_aux_loss(moe_balance.BalanceConfig(use_expert_loss=False, use_device_loss=False,
                                           use_communication_loss=False, use_z_loss=True),
                          probs, topk_idx, N, K, logits=logits)
    assert z == {"z": moe_balance.router_z_loss(logits, 0.001)}
    with pytest.raises(ValueError, match="needs the router logits"):
        moe_balance.total_aux_loss(moe_balance.BalanceConfig(use_z_loss=True), probs, topk_idx, N, K, num_devices=D)


def test_every_config_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(moe_balance.BalanceConfig))
    body = tree.body[0].body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), node.target.id


def test_errors_name_the_rule_and_the_numbers():
    probs, topk_idx = _random_router(4, 6, 2)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by "
                                         r"num_devices \(4\).*try 4 or 8 experts"):
        moe_balance.device_balance_loss(probs, topk_idx, 6, 2, 4)
    with pytest.raises(ValueError, match=r"picks 2 experts per token but topk is 3"):
        moe_balance.expert_balance_loss(probs, topk_idx, 6, 3)
    with pytest.raises(ValueError, match=r"probs has 6 experts .* num_experts is 8"):
        moe_balance.expert_balance_loss(probs, topk_idx, 8, 2)
    with pytest.raises(ValueError, match=r"scores must be \[B, S, N'\]"):
        moe_balance.sequence_balance_loss(probs, topk_idx, 6, 2)


def test_balance_config_rejects_an_unknown_sequence_loss_topk():
    with pytest.raises(ValueError, match=r"sequence_loss_topk must be one of .*'biased'"):
        moe_balance.BalanceConfig(sequence_loss_topk="biased")


# --- through the MoE layer ------------------------------------------------------------------

LN, LK, LD, LM = 8, 2, 4, 2   # the layer tests: N' experts, K' per token, D devices, M devices a token
LS, LB = 8, 2                 # sequences of LS tokens, LB of them


def _identity_layer(score_function, balance, **kwargs):
    """A serial layer whose router logits are its input (hidden size N', weight = identity)."""
    layer = moe.MoELayer(LN, LN, LK, 4, score_function=score_function, balance=balance,
                         num_devices=LD, ep_group=None, tp_group=None, seed=1, **kwargs)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(LN))
    return layer


def _per_coefficient(layer, info):
    c = layer.balance
    coeff = {"expert": c.alpha1, "device": c.alpha2, "communication": c.alpha3,
             "sequence": c.sequence_alpha}
    return {name: value.item() / coeff[name] for name, value in info["aux_losses"].items()}


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_layer_balance_losses_are_1_at_balance_and_peak_at_collapse_for_both_routers(score_function):
    """The closed forms through ``MoELayer``: a sigmoid router must give what a softmax gives.

    Every balance loss assumes each token's probabilities over the N' experts sum to 1, so
    a sigmoid router's affinities are divided by their sum before the V2 losses, as V3
    (arXiv:2412.19437, section 2.1.2) writes s' for its sequence-wise loss and as
    Megatron-Core 0.20.0 (d98e8a64) does for every aux loss in
    megatron/core/transformer/moe/moe_utils.py, ``compute_routing_scores_for_aux_loss``
    (``score_function == "sigmoid"``: scores / scores.sum(-1)).  Fed the raw sigmoids, the
    balanced expert loss was 3.08 here (N'/2 = 4 at zero logits, 8 with 16 experts).

    Balance: token (s, b) has logits +1 on experts s and s + 4 (mod 8), -1 elsewhere:
    every sequence and the batch use every expert equally, each token reaches M = 2
    devices, every device receives MT/D tokens, and the mean probability is 1/N' per
    expert (DeepSeek-V2 arXiv:2405.04434, 2.2.3: each loss is 1).  Collapse: every token
    has +30 on experts 0 and 1 (device 0), -30 elsewhere: N'/K' = 4, D = 4, D/M = 2.
    """
    balance = moe_balance.BalanceConfig(use_sequence_loss=True)
    layer = _identity_layer(score_function, balance, device_limit=LM)
    spread = torch.where(torch.arange(LN) % (LN // LK) == 0, 1.0, -1.0)  # +1 on 0 and 4
    balanced = torch.stack([spread.roll(s) for s in range(LS)])[:, None, :].expand(LS, LB, LN)
    _, info = layer(balanced.contiguous())
    assert (info["tokens_per_expert"] == LS * LB * LK // LN).all()
    for name, value in _per_coefficient(layer, info).items():
        assert value == pytest.approx(1.0, rel=1e-6), (name, value)
    collapsed = torch.full((LS, LB, LN), -30.0)
    collapsed[..., :LK] = 30.0
    _, info = layer(collapsed)
    assert info["tokens_per_expert"].tolist() == [LS * LB] * LK + [0] * (LN - LK)
    worst = _per_coefficient(layer, info)
    assert worst == pytest.approx({"expert": LN / LK, "device": LD, "communication": LD / LM,
                                   "sequence": LN / LK}, rel=1e-6)


def test_layer_balance_losses_of_a_sigmoid_router_weigh_its_normalised_affinities():
    """On random tokens the V2 losses of a sigmoid layer are the pure losses of
    ``scores / scores.sum(-1)`` (Megatron-Core 0.20.0, d98e8a64, moe_utils.py,
    ``compute_routing_scores_for_aux_loss``), and their gradient reaches the router."""
    layer = moe.MoELayer(8, LN, LK, 4, score_function="sigmoid", balance=moe_balance.BalanceConfig(),
                         device_limit=LM, num_devices=LD, ep_group=None, tp_group=None, seed=2)
    x = torch.randn(LS, LB, 8, generator=torch.Generator().manual_seed(3))
    _, info = layer(x)
    route = layer.router(x.reshape(-1, 8))
    probs = route.scores / route.scores.sum(-1, keepdim=True)
    c = layer.balance
    want = {"expert": moe_balance.expert_balance_loss(probs, route.topk_idx, LN, LK, c.alpha1),
            "device": moe_balance.device_balance_loss(probs, route.topk_idx, LN, LK, LD, c.alpha2),
            "communication": moe_balance.communication_balance_loss(probs, route.topk_idx, LN, LD,
                                                                    LM, c.alpha3)}
    for name, value in want.items():
        torch.testing.assert_close(info["aux_losses"][name], value, rtol=1e-6, atol=0)
    sum(info["aux_losses"].values()).backward()
    assert layer.router.weight.grad.abs().sum() > 0


def _v3_layer_losses(bias, sequence_loss_topk):
    """A V3 layer's sequence-wise loss and its router gradient, routed with ``bias``."""
    balance = moe_balance.BalanceConfig.deepseek_v3(sequence_loss_topk=sequence_loss_topk)
    layer = moe.MoELayer(8, LN, LK, 4, score_function="sigmoid", balance=balance,
                         num_devices=LD, ep_group=None, tp_group=None, seed=4)
    layer.router.expert_bias.copy_(bias)
    x = torch.randn(LS, LB, 8, generator=torch.Generator().manual_seed(5))
    _, info = layer(x)
    (grad,) = torch.autograd.grad(info["aux_losses"]["sequence"], layer.router.weight)
    return info, grad, layer.router(x.reshape(-1, 8)).scores


def test_sequence_loss_counts_the_unbiased_topk_so_the_bias_never_moves_it():
    """DeepSeek-V3 (arXiv:2412.19437, section 2.1.2, eq. of L_Bal): f_i counts
    ``s_{i,t} in Topk({s_{j,t}}, K_r)``, the top-K_r of the affinities, with no bias.
    Megatron-Core 0.20.0 (d98e8a64) counts the same: megatron/core/transformer/moe/router.py
    ``TopKRouter.routing`` passes ``_apply_seq_aux_loss`` the routing map of
    moe_utils.py ``compute_routing_scores_for_aux_loss``, a plain top-k of the scores, not
    the bias-steered map of ``topk_routing_with_score_function``.

    So a bias that changes many choices changes neither the loss nor its router gradient,
    and the loss is the pure loss of ``torch.topk(scores, K')``.  ``"routed"`` (kept to
    compare, in chapter 5) counts the steered choice instead and does move.
    """
    none = torch.zeros(LN)
    steer = torch.linspace(0.3, -0.3, LN)  # pulls tokens toward the low-numbered experts
    plain, grad_plain, scores = _v3_layer_losses(none, "unbiased")
    steered, grad_steered, _ = _v3_layer_losses(steer, "unbiased")
    changed = (plain["topk_idx"].sort(-1).values != steered["topk_idx"].sort(-1).values).any(-1)
    assert changed.sum() >= 4                                  # the bias really moved choices
    assert torch.equal(plain["aux_losses"]["sequence"], steered["aux_losses"]["sequence"])
    assert torch.equal(grad_plain, grad_steered)
    unbiased = torch.topk(scores, LK, dim=-1).indices
    as_sequences = lambda t: t.view(LS, LB, -1).transpose(0, 1)  # [s, b] tokens -> [b, s]
    want = moe_balance.sequence_balance_loss(as_sequences(scores), as_sequences(unbiased), LN, LK,
                                             1e-4)
    torch.testing.assert_close(steered["aux_losses"]["sequence"], want, rtol=1e-6, atol=0)
    routed, grad_routed, _ = _v3_layer_losses(steer, "routed")
    counted = moe_balance.sequence_balance_loss(as_sequences(scores),
                                                as_sequences(routed["topk_idx"]), LN, LK, 1e-4)
    torch.testing.assert_close(routed["aux_losses"]["sequence"], counted, rtol=1e-6, atol=0)
    assert not torch.equal(grad_routed, grad_plain)
