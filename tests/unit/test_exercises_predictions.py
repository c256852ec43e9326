"""Exercises that teach: the prediction and reasoning exercises added to chapters
1, 5 and 6, whose checkers start no process.

* 1.3 ``node_crossings``: which group kinds of four layouts cross the boundary of two
  8-GPU nodes, checked against the groups ``grid.build_grid`` builds;
* 5.4 ``blind_routing``: a device-limited routing whose device balance loss is 1 and whose
  communication loss is D/M, checked with ``moe_balance``'s losses;
* 5.5 ``predicted_balance``: the expert-level loss, the MaxVio and each expert's bias
  direction after one V3 step of three small routings, checked with ``moe_balance``;
* 6.4 ``mixed_deadlock``: which pipelines mixing GPipe and 1F1B deadlock, and which ranks
  wait on each other, checked by ``pipeline_parallel.simulator.simulate``;
* 8.4 ``flushed_values``: how many ordinary values an outlier flushes to zero, per tile and
  per tensor, checked with ``fp8``'s quantizers;
* 9.4 ``ring_work``: the (query, key) pairs each rank of a causal ring attends under the
  naive and the balanced split. Its checker runs the ring on gloo ranks (the notebook's
  solution cell does, in tests/dist/test_exercises_notebooks.py); here it is handed the
  counts of ``context_parallel.causal_pairs`` instead, so its judging runs without a
  process.

* 2.4 ``dispatch``: which tokens arrive on each rank of an uneven all-to-all, and in what
  order; its checker runs the dispatch on 4 gloo ranks (tests/dist runs the notebook's
  solution), here it is handed a plain transposition of the routing table.

For each: the right answer passes; typical wrong answers fail with the hint that names
their mistake (and the more specific stage when they fail again); and empty, constant and
typical wrong answers never see a reference answer in the output (tests/answer_keys.py's
check, on these exercises' keys).
"""
from __future__ import annotations

import re
from fractions import Fraction

import pytest
import torch

from tutorial_lib.context_parallel import causal_pairs
from tutorial_lib.exercises import ch01, ch02, ch05, ch06, ch08, ch09, kit

from ..answer_keys import AnswerKey, assert_keeps_its_key, listed, numbers, raising
from ..notebook_cells import CHAPTERS, assert_hint, assert_staged_hint, run_cell, tagged_cells
from tests.asserts import every

# --- exercise 1.3: which groups cross the node boundary ------------------------------------

CROSSINGS = {"A": {"pp"}, "B": {"dp", "ep"}, "C": {"dp", "expert_dp"}, "D": {"pp"}}
"""Worked out by hand in the notebook's solution; the checker asks the grid."""


def test_the_worked_answer_is_the_grid_s():
    assert {name: set(ch01.node_crossings_of(sizes))
            for name, (_, sizes) in ch01.NODE_SCENARIOS.items()} == CROSSINGS
    assert ch01.check_node_crossings(lambda: CROSSINGS)
    spelled = {name: "+".join(sorted(kinds)) for name, kinds in CROSSINGS.items()}
    assert ch01.check_node_crossings(lambda: spelled)  # "dp+ep" reads as {"dp", "ep"}


@pytest.mark.parametrize("answer,hint", [
    # a group must outgrow a node to cross it: no kind anywhere
    ({name: set() for name in CROSSINGS}, ch01.HINT_NODES_BY_SIZE),
    # ETP = 1 assumed in B, EP's stride taken as TP in C: the dense kinds right
    ({**CROSSINGS, "B": {"dp", "expert_dp"}, "C": {"dp", "ep"}}, ch01.HINT_NODES_EXPERT),
    # DP's stride taken as TP alone (CP and EP forgotten) in A and D: the expert kinds right
    ({**CROSSINGS, "A": {"pp", "dp"}, "D": {"dp"}}, ch01.HINT_NODES_DENSE),
    ({**CROSSINGS, "A": {"tp"}, "B": {"pp", "expert_tp"}}, ch01.HINT_NODES_STRIDE),
    ({"A": {"pp"}}, ch01.HINT_NODES_FORMAT),
    ({**CROSSINGS, "C": {"dp", "node"}}, ch01.HINT_NODES_FORMAT),
    (None, ch01.HINT_NODES_FORMAT),
], ids=["by-size", "expert-grid", "dense-grid", "strides", "missing", "unknown-kind",
        "not-a-dict"])
def test_node_crossings_names_the_mistake(answer, hint):
    assert_hint(ch01.check_node_crossings(lambda: answer), hint)


def test_a_wrong_set_is_echoed_not_corrected():
    result = ch01.check_node_crossings(lambda: {**CROSSINGS, "B": {"dp", "expert_dp"}})
    (case,) = [c for c in result.cases if not c.passed]
    assert case.name == "B" and "['dp', 'expert_dp']" in case.detail
    assert "'ep'" not in str(result)


# --- exercise 5.4: a routing the device loss cannot see ------------------------------------


def blind(num_tokens, num_experts, topk, num_devices, max_devices, *, share=None,
          spread=False, uniform=False):
    """A routing with device 0 holding all the probability and getting ``share`` of each
    token's picks (K'/D: the answer), or every token spread over all D devices, or the
    probability spread over every expert."""
    per_device = num_experts // num_devices
    rows = []
    for t in range(num_tokens):
        if spread:
            rows.append([(j % num_devices) * per_device + j // num_devices
                         for j in range(topk)])
            continue
        first = topk // num_devices if share is None else share(topk, num_devices)
        other = 1 + t % (num_devices - 1)
        rows.append(list(range(first)) + [other * per_device + j for j in range(topk - first)])
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    if uniform:
        probs[:] = 1 / num_experts
    else:
        probs[:, :per_device] = 1 / per_device
    return probs, torch.tensor(rows)


def test_the_blind_routing_passes_and_its_losses_are_the_bounds():
    assert ch05.check_blind_routing(blind)
    for tokens, experts, topk, devices, reach in ch05.BLIND_CASES:
        probs, idx = blind(tokens, experts, topk, devices, reach)
        device, comm = ch05.blind_losses(probs, idx, experts, topk, devices, reach)
        assert device == pytest.approx(1.0) and comm == pytest.approx(devices / reach)


def collapse(num_tokens, num_experts, topk, num_devices, max_devices):
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    probs[:, :topk] = 1 / topk
    return probs, torch.arange(topk).expand(num_tokens, topk)


def balanced(num_tokens, num_experts, topk, num_devices, max_devices):
    rows = [[(t * topk + j) % num_experts for j in range(topk)] for t in range(num_tokens)]
    return torch.full((num_tokens, num_experts), 1 / num_experts, dtype=torch.float64), \
        torch.tensor(rows)


@pytest.mark.parametrize("wrong,hint", [
    (collapse, ch05.HINT_BLIND_DEVICE_HIGH[0]),
    (lambda *case: blind(*case, spread=True), ch05.HINT_BLIND_REACH),
    (lambda *case: blind(*case, share=lambda k, d: 1), None),  # below the share
    (lambda *case: blind(*case, uniform=True), ch05.HINT_BLIND_COMM[0]),
    (lambda *case: None, ch05.HINT_BLIND_FORMAT),
    (lambda t, n, k, d, m: (torch.full((t, n), 1.0), torch.zeros(t, k, dtype=torch.int64)),
     ch05.HINT_BLIND_FORMAT),
], ids=["collapse", "every-device", "too-few-picks", "uniform-probabilities", "none",
        "not-a-routing"])
def test_blind_routing_names_the_mistake(wrong, hint):
    result = ch05.check_blind_routing(wrong)
    assert not result.passed
    if hint is None:  # K' = 8 > D: one pick per token is below device 0's share
        assert ch05.HINT_BLIND_DEVICE_LOW in result.hints, result.hint
    else:
        assert hint in result.hints, result.hint


def test_blind_routing_hints_come_in_stages():
    assert_staged_hint(ch05.check_blind_routing, collapse, *ch05.HINT_BLIND_DEVICE_HIGH)
    kit.forget_attempts()
    assert_staged_hint(ch05.check_blind_routing, balanced, *ch05.HINT_BLIND_COMM)


def test_blind_routing_never_raises():
    assert not ch05.check_blind_routing(raising)
    result = ch05.check_blind_routing(lambda *a: ("probs", "idx"))
    assert not result.passed and result.hint == ch05.HINT_BLIND_FORMAT


# --- exercise 5.5: predict the balance numbers ---------------------------------------------

BALANCE = {("A", "loss"): 1.0, ("A", "maxvio"): 3.0, ("A", "bias"): [-1, -1, 1, 1, 1, 1, 1, 1],
           ("B", "loss"): 1.25, ("B", "maxvio"): 1.0, ("B", "bias"): [-1, 0, 1, 1],
           ("C", "loss"): 0.55, ("C", "maxvio"): 0.5, ("C", "bias"): [1, -1, -1, 0]}
"""Worked out by hand in the notebook's solution; the checker asks ``moe_balance``."""


def test_the_worked_balance_is_the_library_s():
    for routing in ch05.BALANCE_ROUTINGS:
        truth = ch05.library_balance(routing)
        assert truth["loss"] == pytest.approx(BALANCE[routing, "loss"], rel=1e-12)
        assert truth["maxvio"] == pytest.approx(BALANCE[routing, "maxvio"], rel=1e-12)
        assert truth["bias"] == BALANCE[routing, "bias"]
    assert ch05.check_predicted_balance(lambda: BALANCE)
    spelled = {key: (torch.tensor(v) if isinstance(v, list) else Fraction(str(v)))
               for key, v in BALANCE.items()}  # a tensor of directions, 11/20: fine
    assert ch05.check_predicted_balance(lambda: spelled)


def balance_with(**mistakes):
    """The worked answer with one classic mistake per quantity (``loss="no_scale"``)."""
    return {(routing, quantity): (ch05.balance_variants(routing, quantity)[mistakes[quantity]]
                                  if quantity in mistakes else BALANCE[routing, quantity])
            for routing, quantity in BALANCE}


def test_every_mistake_is_wrong_somewhere_and_told_apart():
    """Each classic mistake changes at least one case, and where it does, no other
    mistake of the same quantity gives the same value (so the hint names the right one)."""
    for quantity in ch05.BALANCE_QUANTITIES:
        names = ch05.balance_variants("A", quantity)
        for mistake in names:
            changed = [r for r in ch05.BALANCE_ROUTINGS
                       if ch05.balance_variants(r, quantity)[mistake] != pytest.approx(
                           BALANCE[r, quantity])]
            assert changed, (quantity, mistake)
            for routing in changed:
                values = ch05.balance_variants(routing, quantity)
                mine = values[mistake]
                assert every(values[other] != pytest.approx(mine) for other in values
                           if other != mistake), (routing, quantity, mistake)


@pytest.mark.parametrize("answer,hint", [
    (balance_with(loss="no_scale"), ch05.HINT_PREDICT_NO_SCALE[0]),
    (balance_with(loss="assignments"), ch05.HINT_PREDICT_ASSIGNMENTS[0]),
    (balance_with(loss="per_token"), ch05.HINT_PREDICT_PER_TOKEN[0]),
    (balance_with(loss="gates"), ch05.HINT_PREDICT_GATES[0]),
    (balance_with(loss="own_topk"), ch05.HINT_PREDICT_OWN_TOPK[0]),
    (balance_with(loss="closed_form"), ch05.HINT_PREDICT_CLOSED_FORM[0]),
    (balance_with(loss="one"), ch05.HINT_PREDICT_ONE[0]),
    (balance_with(maxvio="ratio"), ch05.HINT_PREDICT_RATIO[0]),
    (balance_with(maxvio="mean_tokens"), ch05.HINT_PREDICT_MEAN_TOKENS[0]),
    (balance_with(bias="flipped"), ch05.HINT_PREDICT_FLIPPED[0]),
    (balance_with(bias="at_mean"), ch05.HINT_PREDICT_AT_MEAN[0]),
    ({**BALANCE, ("B", "loss"): 1.3}, ch05.HINT_PREDICT_GENERIC[0]),
    ({**BALANCE, ("C", "bias"): [1, -1, -1]}, ch05.HINT_PREDICT_FORMAT),
    ({**BALANCE, ("C", "bias"): [0.001, -0.001, -0.001, 0]}, ch05.HINT_PREDICT_FORMAT),
    ({**BALANCE, ("A", "maxvio"): "three"}, ch05.HINT_PREDICT_FORMAT),
    ({k: v for k, v in BALANCE.items() if k != ("B", "bias")}, ch05.HINT_PREDICT_FORMAT),
    ([1.0, 3.0], ch05.HINT_PREDICT_FORMAT),
], ids=["no-scale", "assignments", "per-token", "gates", "own-topk", "closed-form", "one",
        "max-over-mean", "mean-of-tokens", "flipped", "at-mean", "other", "short-list",
        "bias-values", "text", "missing", "not-a-dict"])
def test_predicted_balance_names_the_mistake(answer, hint):
    assert_hint(ch05.check_predicted_balance(lambda: answer), hint)


def test_predicted_balance_names_every_mistake_it_sees():
    """Slips in different quantities are each named, one hint per line."""
    result = ch05.check_predicted_balance(
        lambda: balance_with(loss="no_scale", maxvio="ratio", bias="flipped"))
    assert not result.passed and result.hints == [
        ch05.HINT_PREDICT_NO_SCALE[0], ch05.HINT_PREDICT_RATIO[0], ch05.HINT_PREDICT_FLIPPED[0]]


def test_predicted_balance_hints_come_in_stages():
    assert_staged_hint(ch05.check_predicted_balance, lambda: balance_with(loss="no_scale"),
                       *ch05.HINT_PREDICT_NO_SCALE)
    kit.forget_attempts()
    assert_staged_hint(ch05.check_predicted_balance, lambda: balance_with(bias="flipped"),
                       *ch05.HINT_PREDICT_FLIPPED)


def test_predicted_balance_never_raises():
    result = ch05.check_predicted_balance(raising)
    assert not result.passed and "raised ValueError" in result.cases[0].detail
    assert result.hint == ch05.HINT_PREDICT_FORMAT


# --- exercise 6.4: which mixed pipelines deadlock ------------------------------------------

DEADLOCKS = {"A": {2, 3}, "B": None, "C": {0, 1}, "D": {2, 3}, "E": None}
"""Worked out by hand in the notebook's solution; the checker asks the simulator."""


def test_the_worked_deadlocks_are_the_simulator_s():
    for name, (_, pp, m, gpipe_ranks) in ch06.MIXED_SCENARIOS.items():
        want = DEADLOCKS[name]
        assert ch06.simulated_deadlock(pp, m, gpipe_ranks) == (frozenset(want) if want else None)
    assert ch06.check_mixed_deadlock(lambda: DEADLOCKS)
    spelled = {name: (sorted(v) if v else "completes") for name, v in DEADLOCKS.items()}
    assert ch06.check_mixed_deadlock(lambda: spelled)


def test_pure_1f1b_and_pure_gpipe_complete():
    """The mixed pipelines are the only ones that can deadlock: either schedule alone
    completes, at the scenarios' sizes."""
    for _, pp, m, _ in ch06.MIXED_SCENARIOS.values():
        assert ch06.simulated_deadlock(pp, m, ()) is None
        assert ch06.simulated_deadlock(pp, m, tuple(range(pp))) is None


@pytest.mark.parametrize("answer,hint", [
    (dict.fromkeys(DEADLOCKS), ch06.HINT_MIXED_NEVER[0]),
    ({name: {2, 3} for name in DEADLOCKS}, None),
    ({**DEADLOCKS, "B": {0, 1}, "E": {2, 3}}, ch06.HINT_MIXED_COUNT[0]),
    ({**DEADLOCKS, "A": {3, 4}, "C": {1, 2}}, ch06.HINT_MIXED_PAIR[0]),
    ({**DEADLOCKS, "A": "deadlock"}, ch06.HINT_MIXED_FORMAT),
    ([], ch06.HINT_MIXED_FORMAT),
], ids=["never", "constant", "always", "wrong-pair", "unreadable", "not-a-dict"])
def test_mixed_deadlock_names_the_mistake(answer, hint):
    result = ch06.check_mixed_deadlock(lambda: answer)
    assert not result.passed
    if hint is None:  # wrong in different ways: the generic question
        assert result.hint == ch06.HINT_MIXED_GENERIC, result.hint
    else:
        assert_hint(result, hint)


def test_mixed_deadlock_hints_come_in_stages():
    assert_staged_hint(ch06.check_mixed_deadlock, lambda: dict.fromkeys(DEADLOCKS),
                       *ch06.HINT_MIXED_NEVER)


# --- exercise 8.4: what an outlier erases ---------------------------------------------------

FLUSHED = {("tile", 1e4): 0, ("tensor", 1e4): 0, ("tile", 3e5): 0, ("tensor", 3e5): 0,
           ("tile", 1e6): 127, ("tensor", 1e6): 511}
"""Worked out by hand in the notebook's solution; the checker asks the quantizers."""


def test_the_worked_counts_are_the_quantizer_s():
    assert {(s, a): ch08.flushed_ordinary_values(a, s)
            for s in ch08.SCALINGS for a in ch08.OUTLIERS} == FLUSHED
    assert ch08.check_flushed_values(lambda: FLUSHED)
    as_ints = {(s, int(a)): float(v) for (s, a), v in FLUSHED.items()}  # 10000, 0.0: fine
    assert ch08.check_flushed_values(lambda: as_ints)


@pytest.mark.parametrize("answer,hint", [
    (dict.fromkeys(FLUSHED, 0), ch08.HINT_FLUSH_NONE[0]),
    ({k: (511 if v else 0) for k, v in FLUSHED.items()}, ch08.HINT_FLUSH_TILES[0]),
    ({k: (v + 1 if v else 0) for k, v in FLUSHED.items()}, ch08.HINT_FLUSH_COUNT[0]),
    ({**FLUSHED, ("tile", 3e5): 127, ("tensor", 3e5): 511}, ch08.HINT_FLUSH_NORMAL[0]),
    ({**FLUSHED, ("tile", 1e6): 3}, ch08.HINT_FLUSH_GENERIC[0]),
    ({**FLUSHED, ("tile", 1e6): 12.5}, ch08.HINT_FLUSH_FORMAT),
    ("511", ch08.HINT_FLUSH_FORMAT),
], ids=["never-zero", "no-tiles", "outlier-counted", "normal-range-only", "other",
        "not-whole", "not-a-dict"])
def test_flushed_values_names_the_mistake(answer, hint):
    assert_hint(ch08.check_flushed_values(lambda: answer), hint)


# --- exercise 9.4: each rank's causal work ------------------------------------------------

WORK = {("naive", 0): 10, ("naive", 1): 26, ("naive", 2): 42,
        ("balanced", 0): 26, ("balanced", 1): 26, ("balanced", 2): 26}
"""Worked out by hand in the notebook's solution."""


def counted():
    """What the ring's trace counts, from the library's position arithmetic."""
    return {(split, rank): pairs for split in ch09.SPLITS for rank, pairs in
            enumerate(causal_pairs(ch09.WORK_SEQ, ch09.WORK_CP, split == "balanced"))}


def check_work(answer):
    return ch09.check_ring_work(lambda: answer, measured=counted)


def test_the_worked_work_is_the_position_count():
    assert counted() == WORK and check_work(WORK)


def test_a_stub_or_garbage_runs_no_ring():
    def boom():
        raise AssertionError("the ring ran before a prediction was committed")
    for fn in (lambda: None, raising, lambda: [1, 2]):
        result = ch09.check_ring_work(fn, measured=boom)
        assert not result.passed


@pytest.mark.parametrize("rule,hint", [
    (dict(causal=False), ch09.HINT_WORK_NOT_CAUSAL),
    (dict(striped=True), ch09.HINT_WORK_STRIPED),
    (dict(diagonal=lambda c: c * c), ch09.HINT_WORK_DIAGONAL_FULL),
    (dict(diagonal=lambda c: c * c / 2), ch09.HINT_WORK_DIAGONAL_HALF),
    (dict(even=True), ch09.HINT_WORK_NAIVE),
], ids=["not-causal", "striped", "diagonal-square", "diagonal-half", "naive-even"])
def test_ring_work_names_the_mistake(rule, hint):
    answer = {key: ch09.ring_work_variant(*key, **rule) for key in WORK}
    assert_hint(check_work(answer), hint[0])


@pytest.mark.parametrize("answer,hint", [
    ({**WORK, ("naive", 2): 41}, ch09.HINT_WORK_GENERIC),
    ({**WORK, ("naive", 2): "42 pairs"}, ch09.HINT_WORK_FORMAT),
    ({}, ch09.HINT_WORK_FORMAT),
], ids=["off-by-one", "text", "empty"])
def test_ring_work_other_answers(answer, hint):
    assert_hint(check_work(answer), hint)


# --- exercise 2.4: the dispatch ---------------------------------------------------------------

ARRIVED = {0: [1, 4, 12, 14, 20, 25, 32, 33], 1: [],
           2: [0, 3, 5, 13, 21, 22, 31, 34], 3: [2, 10, 11, 15, 23, 24, 30, 35]}
"""Worked out by hand in the notebook's solution."""


def transposed():
    """The routing table read column-wise: sender by sender, token by token."""
    routes = ch02.DISPATCH_ROUTES
    return {k: [10 * r + t for r, row in enumerate(routes) for t, dest in enumerate(row)
                if dest == k] for k in range(len(routes))}


def check_dispatch(answer):
    return ch02.check_dispatch(lambda: answer, measured=transposed)


def test_the_worked_arrivals_are_the_transposed_table():
    assert transposed() == ARRIVED and check_dispatch(ARRIVED)
    assert check_dispatch({k: tuple(float(v) for v in vs) for k, vs in ARRIVED.items()})


def test_a_stub_or_garbage_launches_nothing():
    def boom():
        raise AssertionError("the dispatch ran before a prediction was committed")
    for fn in (lambda: None, raising, lambda: [1, 2]):
        assert not ch02.check_dispatch(fn, measured=boom)


def sent_by(rank):
    row = ch02.DISPATCH_ROUTES[rank]
    return [10 * rank + t for t in sorted(range(len(row)), key=lambda t: row[t])]


@pytest.mark.parametrize("answer,hint", [
    ({k: sent_by(k) for k in ARRIVED}, ch02.HINT_DISPATCH_SENT[0]),
    ({k: [v for v in vs if v // 10 != k] for k, vs in ARRIVED.items()},
     ch02.HINT_DISPATCH_HOME[0]),
    ({k: sorted(vs, key=lambda v: (v % 10, v)) for k, vs in ARRIVED.items()},
     ch02.HINT_DISPATCH_ORDER[0]),
    ({**ARRIVED, 3: [2, 10]}, ch02.HINT_DISPATCH_GENERIC[0]),
    ({**ARRIVED, 1: None}, ch02.HINT_DISPATCH_FORMAT),
    ({**ARRIVED, 1: "nothing"}, ch02.HINT_DISPATCH_FORMAT),
], ids=["what-it-sends", "home-left-out", "token-order", "other", "missing", "text"])
def test_dispatch_names_the_mistake(answer, hint):
    assert_hint(check_dispatch(answer), hint)


# --- no checker hands out its key ----------------------------------------------------------


def _crossing_forbidden(name, detail, fn):
    want = CROSSINGS.get(name)
    if want is None:
        return set()
    mine = fn().get(name) if isinstance(fn(), dict) else None
    mine = kit.as_group_kinds(mine) if mine is not None else None
    texts = {repr(sorted(want)), repr(set(want))} | {f"'{k}'" for k in want - (mine or set())}
    return texts


def _deadlock_forbidden(name, detail, fn):
    want = DEADLOCKS.get(name)
    if want is None:  # a step that completes: its key is the word, not a pair
        return set()
    got = fn()
    mine = got.get(name) if isinstance(got, dict) else None
    return listed(sorted(want)) - (listed(sorted(mine)) if isinstance(mine, (set, list))
                                   else set())


def _blind_forbidden(name, detail, fn):
    tokens, experts, topk, devices, reach = (int(v) for v in re.findall(r"=(\d+)", name))
    probs, idx = blind(tokens, experts, topk, devices, reach)
    return {str(idx), repr(idx.tolist()), str(probs)}


def _balance_forbidden(name, detail, fn):
    routing, quantity = name.split(", ")
    want = BALANCE[routing, quantity]
    got = fn()
    mine = got.get((routing, quantity)) if isinstance(got, dict) else None
    if quantity == "bias":
        return listed(want) - (listed(mine) if isinstance(mine, list) else set())
    return numbers(want) - (numbers(mine) if kit.as_number(mine) is not None else set())


def _flushed_forbidden(name, detail, fn):
    scaling, outlier = re.match(r"(\w+), outlier (\S+)", name).groups()
    want = FLUSHED[(scaling, float(outlier))]
    return set() if want == 0 else {str(want)}  # 0: the count of a value nobody loses


def _work_forbidden(name, detail, fn):
    split, rank = re.match(r"(\w+) split, rank (\d+)", name).groups()
    return {str(WORK[(split, int(rank))])}


def _counted_checker(fn):
    return ch09.check_ring_work(fn, measured=counted)


def _arrived_forbidden(name, detail, fn):
    want = ARRIVED[int(name.split()[-1])]
    return {repr(want)} if want else set()  # an empty list: the rank that gets nothing


def _transposed_checker(fn):
    return ch02.check_dispatch(fn, measured=transposed)


KEYS = [
    AnswerKey("1.3", ch01.check_node_crossings, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(CROSSINGS, {"tp"}),
        "by_size": lambda: {name: set() for name in CROSSINGS},
        "etp_one": lambda: {**CROSSINGS, "B": {"dp", "expert_dp"}},
        "everything": lambda: dict.fromkeys(CROSSINGS, set(ch01.NODE_KINDS)),
    }, _crossing_forbidden, ch01.NODE_MISTAKES),
    AnswerKey("2.4", _transposed_checker, {
        "empty": lambda: {},
        "nothing_arrives": lambda: {k: [] for k in ARRIVED},
        "what_it_sends": lambda: {k: sent_by(k) for k in ARRIVED},
        "token_order": lambda: {k: sorted(vs, key=lambda v: (v % 10, v))
                                for k, vs in ARRIVED.items()},
    }, _arrived_forbidden, ch02.DISPATCH_MISTAKES),
    AnswerKey("5.4", ch05.check_blind_routing, {
        "empty": lambda *case: None,
        "collapse": collapse,
        "balanced": balanced,
        "every_device": lambda *case: blind(*case, spread=True),
    }, _blind_forbidden, ch05.BLIND_MISTAKES),
    AnswerKey("5.5", ch05.check_predicted_balance, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(BALANCE, 1),
        "ones": lambda: {k: ([1] * len(v) if isinstance(v, list) else 1.0)
                         for k, v in BALANCE.items()},
        "no_scale": lambda: balance_with(loss="no_scale"),
        "closed_form_and_flipped": lambda: balance_with(loss="closed_form", bias="flipped"),
        "max_over_mean": lambda: balance_with(maxvio="ratio", bias="at_mean"),
    }, _balance_forbidden, ch05.PREDICT_MISTAKES),
    AnswerKey("6.4", ch06.check_mixed_deadlock, {
        "empty": lambda: {},
        "never": lambda: dict.fromkeys(DEADLOCKS),
        "constant": lambda: dict.fromkeys(DEADLOCKS, {0, 1}),
        "always": lambda: {**DEADLOCKS, "B": {0, 1}, "E": {2, 3}},
    }, _deadlock_forbidden, ch06.MIXED_MISTAKES),
    AnswerKey("8.4", ch08.check_flushed_values, {
        "empty": lambda: {},
        "zeros": lambda: dict.fromkeys(FLUSHED, 0),
        "constant": lambda: dict.fromkeys(FLUSHED, 100),
        "no_tiles": lambda: {k: (511 if v else 0) for k, v in FLUSHED.items()},
        "outlier_counted": lambda: {k: (v + 1 if v else 0) for k, v in FLUSHED.items()},
    }, _flushed_forbidden, ch08.FLUSH_MISTAKES),
    AnswerKey("9.4", _counted_checker, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(WORK, 1),
        "not_causal": lambda: {k: ch09.ring_work_variant(*k, causal=False) for k in WORK},
        "striped": lambda: {k: ch09.ring_work_variant(*k, striped=True) for k in WORK},
    }, _work_forbidden, ch09.WORK_MISTAKES),
]


@pytest.mark.parametrize("key,label", [pytest.param(k, label, id=f"{k.exercise}-{label}")
                                       for k in KEYS for label in k.answers])
def test_no_new_checker_shows_the_answer_to_an_unsolved_case(key, label):
    assert_keeps_its_key(key, label)


# --- the notebook cells ----------------------------------------------------------------------


@pytest.mark.parametrize("notebook,stub", [("01", "node_crossings"), ("05", "blind_routing"),
                                           ("05", "predicted_balance"),
                                           ("06", "mixed_deadlock"), ("08", "flushed_values")])
def test_the_chapter_carries_the_exercise(notebook, stub):
    """Registered in tests/notebook_cells.py (whose tests run its cells), introduced by an
    "Exercise" heading, and its solution cell is the one the test above worked out."""
    chapter = next(c for c in CHAPTERS if c.notebook.startswith(notebook))
    index = [e.stub for e in chapter.exercises].index(stub)
    solution = tagged_cells(chapter.path, "solution")[index]
    defined = run_cell(chapter.path, solution, chapter.namespace())
    answer = defined[f"{stub}_solution"]
    if stub == "node_crossings":
        assert answer() == CROSSINGS
    elif stub == "mixed_deadlock":
        assert answer() == DEADLOCKS
    elif stub == "flushed_values":
        assert answer() == FLUSHED
    elif stub == "predicted_balance":
        assert answer() == BALANCE


@pytest.mark.parametrize("checker,answer", [(ch02.check_dispatch, ARRIVED),
                                            (ch09.check_ring_work, WORK)],
                         ids=["2.4", "9.4"])
def test_a_failed_reference_run_is_a_failed_case_not_an_exception(checker, answer):
    """The workers the checker starts may time out on a busy machine: the verdict says so
    and asks for a re-run, and blames nothing on the prediction."""
    def timed_out():
        raise TimeoutError("the ranks did not finish")
    result = checker(lambda: answer, measured=timed_out)
    assert not result.passed and [c.name for c in result.cases] == ["the run"]
    assert result.hint == ch02.HINT_RUN_FAILED == ch09.HINT_RUN_FAILED


def test_a_raising_routing_gets_the_two_step_hint():
    result = ch05.check_blind_routing(raising)
    assert not result.passed and result.hint == ch05.HINT_BLIND_GENERIC
    assert "raised ValueError" in result.cases[0].detail
