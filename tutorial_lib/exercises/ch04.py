"""Checkers for chapter 4, DeepSeekMoE with expert parallelism (TP + EP + DP).

* :func:`check_send_splits`: the student's ``fn(topk_idx, num_experts, ep_size)`` returns
  the rows one EP rank hands to each EP rank in the dispatch all-to-all (the
  ``input_splits``), from that rank's routing map.  The checker compares them with the
  library's count (:func:`tutorial_lib.costs.moe_send_counts`, the rule
  :class:`tutorial_lib.moe.AllToAllDispatcher` dispatches by) on routings of several EP
  sizes, among them a rank whose experts receive nothing and a rank with no tokens.
  Counting tokens instead of token copies, placing experts round-robin, dividing by
  the EP size instead of by the experts per rank, dropping the ranks that receive
  nothing, returning per-expert counts and counting only the first choice each get a
  hint of their own.
* :func:`check_gradient_domains`: for the router, the shared experts and the routed
  experts of a Megatron-layout grid, with and without sequence parallelism, the groups
  each gradient is summed over and what the sum is divided by; every wrong choice gets
  its reason (among them averaging routed-expert gradients over the expert-data-parallel
  group, which makes them DP / EDP times too large).
* :func:`check_layer_bytes_sent`: the student's formula for the bytes one EP rank sends
  to *other* ranks in one MoE layer's forward and backward, from the send-count matrix.
  The checker runs MoE layers on 4 real ranks, counts the bytes each rank sent from the
  trace (each all-to-all event's splits), and compares.

Student code never makes a checker raise: exceptions and stubs become failed cases with
a hint.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from .kit import (Case, Checking, CheckResult, Mistakes, as_group_kinds, as_number, as_whole_numbers,
                  check_answers, group_sets, group_text, launch_retrying, misnamed_groups,
                  recover_answer)

# --- hints (tests look for these exact strings) ---------------------------------------

HINT_SPLITS_TOKENS = (
    "you counted tokens, not token copies. This chapter's default dispatcher (like "
    "Megatron's all-to-all dispatcher) sends one row per (token, k) copy, so a token whose K "
    "experts include two on the same rank sends that rank two rows. One row per token and "
    "rank is what the deduplicating dispatcher (deduplicate=True, DeepEP's scheme) sends, "
    "with the token's expert ids so the receiver can fan it out; this exercise asks for the "
    "copy dispatcher's splits. Count every (token, k) entry of topk_idx."
)
HINT_SPLITS_ROUND_ROBIN = (
    'you placed expert e on rank e % ep_size (round-robin). The library gives each EP '
    "rank a contiguous block of experts: re-read 'The communication domains' and "
    'reconsider which rank holds expert e.'
)
HINT_SPLITS_DIVIDED_BY_EP = (
    'you computed the rank of expert e by dividing by ep_size. The two agree only when '
    'num_experts == ep_size ** 2: reconsider how many experts one rank holds, and divide '
    'by that.'
)
HINT_SPLITS_PER_EXPERT = (
    'you returned one count per expert (num_experts of them). The all-to-all needs one '
    'split per EP rank: add up the counts of the experts each rank holds.'
)
HINT_SPLITS_MISSING_ZEROS = (
    "your list is shorter than ep_size when the last ranks receive nothing (bincount without "
    "minlength?). Every rank of the EP group takes part in the all-to-all, and the split for "
    "a rank that gets no rows is 0: return exactly ep_size numbers."
)
HINT_SPLITS_FIRST_CHOICE = (
    "you counted only each token's first choice (topk_idx[:, 0]). Every token goes to all K "
    "of its experts: count every column of topk_idx."
)
HINT_SPLITS_FORMAT = (
    "return a list of ep_size whole numbers (or a 1-D integer tensor): the rows this rank "
    "sends to EP rank 0, 1, ..., ep_size - 1."
)
HINT_SPLITS_NUDGE = (
    "two questions: which EP rank does expert e live on (each rank holds a contiguous block "
    "of num_experts / ep_size experts), and how many rows does one entry of topk_idx send?"
)
HINT_SPLITS_GENERIC = (
    "re-read 'Dispatch, expert compute, combine': reconsider which EP rank holds each "
    'expert, and how many rows one entry of topk_idx sends; the split for a rank that '
    'receives nothing is 0.'
)

HINT_DOMAINS_FORMAT = (
    "return a dict from every case name in GRADIENT_DOMAIN_CASES to a pair (groups, divisor): "
    "the set of group kinds the gradient is summed over and the number the sum is divided "
    "by, e.g. {'router_weight': ({'dp'}, 8), ...}."
)

HINT_BYTES_FORMAT = (
    "return one number: the bytes this rank sends to OTHER ranks in one forward and backward "
    "of the layer."
)
HINT_BYTES_RAISED = (
    "your function raised for some cases (see above): try it on a rank that receives "
    "nothing and on a rank with no tokens of its own (zeros in the matrix)."
)
HINT_BYTES_DIAGONAL = (
    'you counted data a rank sends to itself: the rows it keeps for its own experts '
    '(the diagonal of the matrix), or its own counts in the counts exchange. '
    'All-to-all hands those over in local memory, no byte leaves the rank: leave them '
    'out of every exchange, the counts exchange too.'
)
HINT_BYTES_FORWARD_ONLY = (
    'you counted the forward pass only. The all-to-all is an autograd function whose '
    "backward is the reverse all-to-all: the combine's backward sends the gradients "
    "of the dispatched rows (the same splits as the dispatch) and the dispatch's "
    'backward sends those of the combined rows.'
)
HINT_BYTES_NO_COUNTS = (
    'you left out the counts exchange: before the tokens move, the ranks swap how '
    'many copies they send to each expert, as int64 numbers. Reconsider how many '
    'numbers go to each other rank.'
)
HINT_BYTES_COMBINE_ROW = (
    "you made the combine send what the dispatch sent (row `rank` of the matrix). The "
    "combine sends back what the rank RECEIVED: column `rank`, the experts' outputs for "
    "the other ranks' tokens."
)
HINT_BYTES_COUNTS_BACKWARD = (
    "the counts exchange has no backward: it moves integers, outside autograd, once per "
    "forward."
)
HINT_BYTES_ELEMENTS = (
    "you counted elements, not bytes: each row holds `hidden` elements of bytes_per_element "
    "bytes (4 here, fp32), and each count is an int64 of 8 bytes."
)
HINT_BYTES_NUDGE = (
    "list the all-to-alls of one forward and backward (the counts exchange, the dispatch, "
    "the combine, and the backward of each autograd one), and for each the rows this rank "
    "hands to OTHER ranks: which entries of the matrix are they?"
)
HINT_BYTES_GENERIC = (
    "re-read 'Every byte, predicted': reconsider each all-to-all of one forward and "
    'backward (the counts exchange, the dispatch, the combine, and the backward of '
    'each autograd one), which entries of the matrix it hands to OTHER ranks, and the '
    'bytes of one row and of one count.'
)

#: The mistakes of exercise 4.1, in order of preference (what each returns: ``_splits_mistakes``).
SPLITS_HINTS = Mistakes(
    (HINT_SPLITS_NUDGE, HINT_SPLITS_GENERIC), any_case={"format"}, format=HINT_SPLITS_FORMAT,
    per_expert=HINT_SPLITS_PER_EXPERT, missing_zeros=HINT_SPLITS_MISSING_ZEROS,
    tokens=HINT_SPLITS_TOKENS, first_choice=HINT_SPLITS_FIRST_CHOICE,
    round_robin=HINT_SPLITS_ROUND_ROBIN, divided_by_ep=HINT_SPLITS_DIVIDED_BY_EP)
#: The mistakes of exercise 4.3, in order of preference (their switches: :data:`BYTES_MISTAKES`).
BYTES_HINTS = Mistakes(
    (HINT_BYTES_NUDGE, HINT_BYTES_GENERIC), any_case={"format", "raised"}, format=HINT_BYTES_FORMAT,
    raised=HINT_BYTES_RAISED, diagonal=HINT_BYTES_DIAGONAL, diagonal_rows=HINT_BYTES_DIAGONAL,
    diagonal_counts=HINT_BYTES_DIAGONAL, forward_only=HINT_BYTES_FORWARD_ONLY,
    no_counts=HINT_BYTES_NO_COUNTS, combine_row=HINT_BYTES_COMBINE_ROW,
    counts_backward=HINT_BYTES_COUNTS_BACKWARD, elements=HINT_BYTES_ELEMENTS)


# --- exercise 4.1: the dispatch splits from a routing map -----------------------------


def _routing(rows: list[list[int]]):
    import torch
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1 if rows else 2)


def _random_routing(num_tokens: int, num_experts: int, topk: int, seed: int, allowed=None):
    """``[T, K]`` distinct experts per token, drawn from ``allowed`` (default: all)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(allowed if allowed is not None else range(num_experts))
    rows = [pool[torch.randperm(len(pool), generator=g)[:topk]].tolist() for _ in range(num_tokens)]
    return _routing(rows)


def send_splits_cases():
    """(name, topk_idx, num_experts, ep_size) for every case the checker tries."""
    import torch
    return [
        ("EP=2, 4 experts, top-2, 6 tokens", _random_routing(6, 4, 2, seed=1), 4, 2),
        ("EP=4, 8 experts, top-2: tokens whose two experts share a rank",
         _routing([[0, 1], [2, 3], [0, 5], [6, 7], [1, 4], [3, 2]]), 8, 4),
        ("EP=4, 8 experts, top-2: nothing for rank 3 (experts 6, 7)",
         _random_routing(8, 8, 2, seed=2, allowed=range(6)), 8, 4),
        ("EP=4, 16 experts, top-3, 7 tokens", _random_routing(7, 16, 3, seed=3), 16, 4),
        ("EP=2, 8 experts, top-4: nothing for rank 1 (experts 4..7)",
         _random_routing(5, 8, 4, seed=4, allowed=range(4)), 8, 2),
        ("EP=8, 8 experts (one per rank), top-1", _random_routing(9, 8, 1, seed=5), 8, 8),
        ("EP=1: every copy stays on this rank", _random_routing(4, 4, 2, seed=6), 4, 1),
        ("EP=4, 8 experts, top-2: this rank has no tokens",
         torch.zeros(0, 2, dtype=torch.int64), 8, 4),
    ]


def reference_send_splits(topk_idx, num_experts: int, ep_size: int) -> list[int]:
    """Rows this rank sends to each EP rank: the library's count, ``costs.moe_rank_send_splits``
    (the dispatcher's rule: expert ``e`` lives on rank ``e // (N / EP)``).
    """
    from ..costs import moe_rank_send_splits
    from ..moe_balance import expert_load
    return moe_rank_send_splits(expert_load(topk_idx, num_experts).tolist(), ep_size)


def _splits_mistakes(topk_idx, num_experts: int, ep_size: int) -> dict[str, list[int]]:
    """What each classic mistake returns on this input."""
    import torch
    local = num_experts // ep_size
    flat = topk_idx.reshape(-1)
    ranks_of_copies = flat // local
    out = {
        "round_robin": torch.bincount(flat % ep_size, minlength=ep_size).tolist(),
        "divided_by_ep": torch.bincount(flat // ep_size, minlength=ep_size).tolist(),
        "per_expert": torch.bincount(flat, minlength=num_experts).tolist(),
        "missing_zeros": torch.bincount(ranks_of_copies).tolist() if flat.numel() else [],
        "first_choice": (torch.bincount(topk_idx[:, 0] // local, minlength=ep_size).tolist()
                         if topk_idx.numel() else [0] * ep_size),
    }
    token_ranks = topk_idx // local
    out["tokens"] = [int((token_ranks == j).any(dim=1).sum()) for j in range(ep_size)]
    return out


def _splits_difference(answer: list[int], topk_idx, ep_size: int) -> str:
    """What is wrong with a list of splits, without the right splits."""
    copies = topk_idx.numel()
    if len(answer) != ep_size:
        return f"got {answer}: {len(answer)} numbers for an EP group of {ep_size} ranks"
    if sum(answer) != copies:
        return (f"got {answer}: {sum(answer)} rows in all, but topk_idx holds {copies} "
                "(token, k) copies")
    return f"got {answer}: the right number of rows in all, sent to the wrong ranks"


def check_send_splits(fn: Callable) -> CheckResult:
    """Check ``fn(topk_idx, num_experts, ep_size) -> [rows to EP rank 0, 1, ...]``.

    ``topk_idx`` is this rank's ``[T, K]`` int64 routing map; the answer may be a list,
    tuple or 1-D tensor of whole numbers.
    """
    check = Checking("Exercise 4.1: send_splits", SPLITS_HINTS)
    for name, topk_idx, num_experts, ep_size in send_splits_cases():
        want = reference_send_splits(topk_idx, num_experts, ep_size)
        case, got = check.run(name, lambda t=topk_idx, n=num_experts, e=ep_size: fn(t.clone(), n, e),
                              want, compare=lambda g, w: as_whole_numbers(g) == w)
        if case.passed or isinstance(got, BaseException):
            continue
        answer = as_whole_numbers(got)
        if answer is None:
            check.shows({"format"})
            continue
        case.detail = _splits_difference(answer, topk_idx, ep_size)
        mistakes = _splits_mistakes(topk_idx, num_experts, ep_size)
        check.shows({m for m, wrong in mistakes.items() if wrong == answer and wrong != want})
    return check.verdict()


# --- exercise 4.2: which groups, divided by what? ----------------------------------------

#: Case name -> the parameter and its grid (the statement; the answers, the groups it is
#: summed over and the divisor, are kept as digests below).
#: Megatron's folded layout, world 8, CP = PP = 1, ETP = 1.
GRADIENT_DOMAIN_CASES = {
    "router_weight":
        "router.weight, TP 1 x EP 4 (DP 8, EDP 2): the gate [N, h], a full copy on every rank.",
    "shared_expert_weight":
        "shared_experts.weight_up, TP 1 x EP 4 (DP 8, EDP 2): the always-on expert, a full "
        "copy on every rank.",
    "routed_expert_weight":
        "experts.weight_up, TP 1 x EP 4 (DP 8, EDP 2): this EP rank's 2 of the 8 routed "
        "experts.",
    "router_weight_sp":
        "router.weight, TP 2 x EP 4 with sequence parallelism (DP 4, EDP 2): a full copy "
        "on every rank; each TP rank routes its own s/TP tokens.",
    "shared_expert_weight_sp":
        "shared_experts.weight_up, TP 2 x EP 4 with sequence parallelism (DP 4, EDP 2): split "
        "over TP like a dense MLP, as Megatron-Core's SharedExpertMLP, so this is a "
        "column-parallel shard [f/TP, h], fed the whole sequence by the all-gather of the TP "
        "ranks' tokens.",
    "routed_expert_weight_sp":
        "experts.weight_up, TP 2 x EP 4 with sequence parallelism (DP 4, EDP 2): this EP "
        "rank's 2 of the 8 routed experts.",
}

#: Case -> the digest of ``"groups/divisor"`` (``kit.answer_digest``; groups as
#: ``kit.group_text``).
GRADIENT_DOMAIN_DIGESTS = {
    "router_weight": "cfc3f91d61e231f7d83f81a806c7fab2",
    "shared_expert_weight": "8610dc3c6bb4feb4afda657626f02dcc",
    "routed_expert_weight": "dc5f2fbba1352dc278f16360fe179407",
    "router_weight_sp": "21bfc1cad077c0ae65964438b8d9ac72",
    "shared_expert_weight_sp": "d6f01686e143d056f9e8a5e73ab66a93",
    "routed_expert_weight_sp": "85df84fd0d16d997cc5f9bdc6165a11c",
}

#: The sizes behind each case: (TP, EP, DP, EDP) of the world-8 grid.
GRADIENT_DOMAIN_GRIDS = {
    name: ((2, 4, 4, 2) if name.endswith("_sp") else (1, 4, 8, 2)) for name in GRADIENT_DOMAIN_CASES
}

KNOWN_GROUPS = ("tp", "dp", "ep", "expert_dp", "expert_tp", "pp", "world")


def _why_domain_wrong(case: str, given: frozenset, divisor, want: frozenset, want_divisor: int):
    """Why ``(given, divisor)`` is wrong for ``case``: a text, or its stages (what is wrong,
    then what to do), never the right groups or divisor themselves."""
    tp, ep, dp, edp = GRADIENT_DOMAIN_GRIDS[case]
    routed = case.startswith("routed")
    misnamed = misnamed_groups(given, KNOWN_GROUPS, "'tp', 'dp', 'ep', 'expert_dp' (or 'world')", (
        "the world group mixes everything: with EP > 1 it adds the gradients of different "
        "experts, and with TP > 1 it adds TP ranks' partial sums to other replicas'. Name "
        "the groups whose ranks hold copies of this weight, or parts of one sum."))
    if misnamed:
        return misnamed
    if given != want:
        if routed and "ep" in given:
            return ("the EP ranks hold different experts, so their gradients are gradients of "
                    "different numbers. The EP group carries the dispatch and combine "
                    "all-to-alls; where do the copies of one expert live?",
                    "the EP ranks hold different experts, so their gradients are gradients of "
                    "different numbers. The EP group carries the dispatch and combine "
                    "all-to-alls; the copies of one expert sit on the ranks with the same EP "
                    "rank in the other expert-data-parallel replicas.")
        if routed and "dp" in given:
            return ("the dense dp group contains EP ranks that hold other experts: summing over "
                    "it adds gradients of different experts. Which ranks hold a copy of this "
                    "rank's experts?",
                    "the dense dp group contains EP ranks that hold other experts: summing over "
                    "it adds gradients of different experts. A routed expert is replicated only "
                    "on the ranks with the same EP rank in the other expert-data-parallel "
                    "replicas, fewer than the dense replicas.")
        if routed and "tp" in given:
            return ("in Megatron's folded layout the TP ranks of a replica sit on different EP "
                    "ranks and hold different experts (EP folds onto TP). The tokens of every "
                    "TP rank already reached the expert through the all-to-all; only the copies "
                    "of the expert itself need summing.")
        if not routed and "expert_dp" in given:
            return ("the router and the shared experts are dense: every rank of the dense dp "
                    "group holds a copy and saw different tokens. expert_dp holds only some of "
                    "them, so the copies would drift apart.")
        if not routed and "ep" in given and "dp" not in given:
            return ("the EP ranks of one replica are not all the copies of a dense weight: in "
                    "Megatron's layout every rank of the dense data-parallel replicas holds one, "
                    "EP ranks and the rest (DP = W / (TP * CP * PP)).")
        if not routed and "ep" in given:
            return ("in Megatron's layout the dense dp group already contains the EP ranks "
                    "(DP = W / (TP * CP * PP)): a dense weight is replicated over all of them, "
                    "so adding 'ep' counts some copies twice.",
                    "in Megatron's layout the dense dp group already contains the EP ranks "
                    "(DP = W / (TP * CP * PP)): a dense weight is replicated over all of them, "
                    "so sum it over 'dp' alone; adding 'ep' would count some copies twice.")
        if "pp" in given:
            return ("there is no pipeline here (PP = 1), and pipeline stages hold different "
                    "layers, never copies of one parameter.")
        if "tp" in want and "tp" not in given:
            return ("with sequence parallelism each TP rank routes and runs only its own s/TP "
                    "tokens, so its gradient of this replicated weight is a partial sum. Which "
                    "ranks hold the other parts?",
                    "with sequence parallelism each TP rank routes and runs only its own s/TP "
                    "tokens, so its gradient of this replicated weight is a partial sum: add "
                    "the TP ranks' parts (allreduce_sequence_parallel_grads), then the DP sum.")
        if "tp" in given and case == "shared_expert_weight_sp":
            return ("the shared expert is tensor-parallel, as Megatron's: the TP ranks hold "
                    "different shards (different rows of the gate and up projections), and "
                    "the all-gather in front of it gives each shard the whole sequence, so its "
                    "gradient is already complete on its rank. A TP sum would add different "
                    "rows. Only the router, whole on every TP rank and run on s/TP tokens per "
                    "rank, needs the TP sum.")
        if "tp" in given and "tp" not in want:
            return ("no TP sum without sequence parallelism: every TP rank would already hold "
                    "the same gradient.")
        if not given:
            return ("the replicas processed different tokens: without a sum over their group "
                    "each copy steps with its own tokens' gradient and they drift apart.")
        return ("this is not the set of groups over which this weight's copies, or the parts "
                "of its gradient, are spread.")
    number = as_number(divisor)
    if number is None:
        return HINT_DOMAINS_FORMAT
    count_once = ("after the sum, each token of the global batch has contributed once: how many "
                  "copies of the gradient of the mean loss does the sum hold?")
    by_replicas = ("re-read 'Gradient domains': reconsider how many copies of one token's "
                   "contribution the sum holds, counted in replicas of the dense model.")
    if routed and math.isclose(number, edp) and edp != want_divisor:
        return (("dividing by the expert-data-parallel size, as an all-reduce that averages over "
                 "the expert-data-parallel group does, makes expert gradients DP * CP / EDP = "
                 "EP * ETP / TP times too large (CP = ETP = 1 here). The backward of the combine "
                 "all-to-all has already added, on the expert's rank, the gradients of every EP "
                 f"rank's tokens; {count_once}"),
                ("dividing by the expert-data-parallel size makes expert gradients DP * CP / EDP "
                 "times too large: the combine's backward already added every EP rank's tokens, "
                 "and after the expert_dp sum each token of the global batch has contributed "
                 "once, as after the dense sum; " + by_replicas))
    if math.isclose(number, 1):
        return (f"a sum of the replicas' gradients is not the gradient of the mean loss: {count_once}",
                "a sum of the replicas' gradients is not the gradient of the mean loss: "
                + by_replicas)
    if tp > 1 and math.isclose(number, tp * dp):
        return ("the TP ranks of a replica are not replicas of each other: they share the "
                "replica's samples (each routes s/TP of its tokens), so they do not count in "
                "the divisor.")
    return (count_once, by_replicas)


def _read_domain_answer(answer):
    """``(groups, divisor)`` -> (frozenset | None, divisor) ; None when unreadable."""
    if isinstance(answer, dict):
        answer = (answer.get("groups"), answer.get("divisor"))
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return None
    groups = as_group_kinds(answer[0])
    if groups is None:
        return None
    return groups, answer[1]


def check_gradient_domains(fn: Callable) -> CheckResult:
    """Check ``fn() -> {case: (groups, divisor)}`` for every case of :data:`GRADIENT_DOMAIN_CASES`.

    ``groups`` is a set (or list, or a string like ``"tp+dp"``) of group kinds the
    gradient is summed over; ``divisor`` the number the sum is divided by.
    """
    return check_answers("Exercise 4.2: gradient_domains", fn, GRADIENT_DOMAIN_CASES, _judge_domain,
                         HINT_DOMAINS_FORMAT)


def _domain_answer(name: str) -> tuple[frozenset, int]:
    """The right ``(groups, divisor)`` of case ``name``, found among the possible ones."""
    sets = group_sets(("tp", "dp", "ep", "expert_dp"), 4)
    world = 8
    return recover_answer("4.2", name, GRADIENT_DOMAIN_DIGESTS[name], (
        (f"{group_text(g)}/{d}", (g, d)) for g in sets for d in range(1, world + 1)))


def _judge_domain(name: str, answer):
    want, want_divisor = _domain_answer(name)
    read = _read_domain_answer(answer)
    if read is None:
        return f"got {answer!r}: not a pair (groups, divisor)", None
    groups, divisor = read
    number = as_number(divisor)
    if groups == want and number is not None and math.isclose(number, want_divisor):
        return None
    return f"got {answer!r}", _why_domain_wrong(name, groups, divisor, want, want_divisor)


# --- exercise 4.3: the bytes one EP rank sends in one layer ------------------------------

#: (name, EP group size, routings): each routing is ``topk_idx`` per EP rank, built from a
#: seed and the experts it may choose.  One launch of 4 ranks runs them all.
BYTES_HIDDEN, BYTES_EXPERTS, BYTES_TOPK = 6, 8, 2


def bytes_cases():
    """(name, per-rank topk_idx list) for the 4-rank EP group the checker launches."""
    import torch
    cases = []
    cases.append(("random top-2 routing, 6 tokens per rank",
                  [_random_routing(6, BYTES_EXPERTS, BYTES_TOPK, seed=10 + r) for r in range(4)]))
    cases.append(("nothing reaches rank 3's experts",
                  [_random_routing(5, BYTES_EXPERTS, BYTES_TOPK, seed=20 + r, allowed=range(6))
                   for r in range(4)]))
    cases.append(("rank 1 has no tokens; rank 0 keeps all its copies",
                  [_random_routing(4, BYTES_EXPERTS, BYTES_TOPK, seed=30, allowed=range(2)),
                   torch.zeros(0, BYTES_TOPK, dtype=torch.int64),
                   _random_routing(7, BYTES_EXPERTS, BYTES_TOPK, seed=31),
                   _random_routing(3, BYTES_EXPERTS, BYTES_TOPK, seed=32)]))
    return cases


def send_count_matrix(routings, num_experts: int = BYTES_EXPERTS) -> list[list[int]]:
    """``counts[i][j]``: copies EP rank i sends to EP rank j (``costs.moe_send_counts``)."""
    from ..costs import moe_send_counts
    from ..moe_balance import expert_load
    return moe_send_counts([expert_load(t, num_experts).tolist() for t in routings])


def reference_layer_bytes_sent(counts, rank: int, hidden: int, num_experts: int,
                               bytes_per_element: int = 4, *, diagonal: bool = False,
                               diagonal_rows: bool = False, diagonal_counts: bool = False,
                               backward: bool = True, count_exchange: bool = True,
                               combine_row: bool = False, counts_backward: bool = False,
                               elements: bool = False) -> float:
    """Bytes EP rank ``rank`` sends to other ranks in one forward + backward of the layer.

    Forward: the counts exchange (``(EP - 1) * N/EP`` int64 to the other ranks), the
    dispatch (row ``rank`` of ``counts`` minus the diagonal) and the combine (column
    ``rank`` minus the diagonal); backward: the combine's reverse (the row again) and the
    dispatch's (the column again).  These are the all-to-alls of
    :func:`tutorial_lib.costs.moe_rank_all_to_alls` minus the rows a rank keeps (the
    unit tests check the two agree, and the checker compares with traces).  The keyword
    arguments switch on the classic mistakes (the checker's hints); with the defaults
    this is the right answer.  ``diagonal`` counts what a rank hands itself everywhere,
    ``diagonal_rows`` in the token exchanges only, ``diagonal_counts`` in the counts
    exchange only.
    """
    ep = len(counts)
    if ep == 1:
        return 0.0
    d, count_size = (1, 1) if elements else (bytes_per_element, 8)
    row = counts[rank]
    column = [counts[i][rank] for i in range(ep)]
    keep = 0 if diagonal or diagonal_rows else counts[rank][rank]
    sent_rows = sum(row) - keep
    returned_rows = (sum(row) if combine_row else sum(column)) - keep
    per_pass = (sent_rows + returned_rows) * hidden * d
    total = per_pass * (2 if backward else 1)
    local = num_experts // ep
    if count_exchange:
        exchange = (ep if diagonal or diagonal_counts else ep - 1) * local * count_size
        total += exchange * (2 if counts_backward else 1)
    return float(total)


BYTES_MISTAKES = {
    "diagonal": dict(diagonal=True),
    "diagonal_rows": dict(diagonal_rows=True),
    "diagonal_counts": dict(diagonal_counts=True),
    "forward_only": dict(backward=False),
    "no_counts": dict(count_exchange=False),
    "combine_row": dict(combine_row=True),
    "counts_backward": dict(counts_backward=True),
    "elements": dict(elements=True),
}


def _bytes_worker(ctx, cases):
    import torch

    from .. import parallel_state
    from ..config import ParallelConfig
    from ..moe import AllToAllDispatcher, RoutedExperts
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, expert_model_parallel_size=ctx.world_size))
    ep_rank = parallel_state.get_rank_in("ep")
    experts = RoutedExperts(BYTES_EXPERTS, BYTES_HIDDEN, 4, ctx.world_size, ep_rank, seed=1)
    dispatcher = AllToAllDispatcher(BYTES_EXPERTS, "ep")
    for index, (_, routings) in enumerate(cases):
        topk_idx = routings[ep_rank]
        g = torch.Generator().manual_seed(index)
        x = torch.randn(topk_idx.shape[0], BYTES_HIDDEN, generator=g).requires_grad_()
        with ctx.tracer.tags(case=index):
            rows, per_expert, state = dispatcher.dispatch(x, topk_idx)
            copies = dispatcher.combine(experts(rows, per_expert), state)
            copies.sum().backward()
    return ep_rank


def bytes_left_rank(event) -> int:
    """Bytes an all-to-all event really sent to other ranks: its rows minus the ones it kept."""
    kept = event.splits["input"][list(event.group_ranks).index(event.rank)]
    rows = sum(event.splits["input"])
    return event.bytes - (event.bytes // rows * kept if rows else 0)


@lru_cache(maxsize=1)
def measured_layer_bytes() -> tuple[tuple[int, ...], ...]:
    """Per case, the bytes each of the 4 ranks sent to other ranks (from the trace); cached."""
    cases = bytes_cases()
    out = launch_retrying(_bytes_worker, 4, args=(cases,), timeout=120)
    measured = []
    for index in range(len(cases)):
        per_rank = []
        for rank in range(4):
            events = out.trace.filter(op="all_to_all", rank=rank, case=index)
            per_rank.append(sum(bytes_left_rank(e) for e in events))
        measured.append(tuple(per_rank))
    return tuple(measured)


def check_layer_bytes_sent(fn: Callable) -> CheckResult:
    """Check ``fn(counts, rank, hidden, num_experts, bytes_per_element) -> bytes`` against traces.

    ``counts[i][j]`` is the send-count matrix of the EP group (copies rank i sends to
    rank j); the answer is what rank ``rank`` sends to other ranks in one forward and
    backward of the layer (fp32 rows of ``hidden`` elements).
    """
    check = Checking("Exercise 4.3: layer_bytes_sent", BYTES_HINTS)
    answers = []
    for name, routings in bytes_cases():  # the student's formula first: a stub costs no launch
        counts = send_count_matrix(routings)
        for rank in range(len(routings)):
            case, got = check.attempt(f"{name}, rank {rank}",
                                      lambda c=counts, r=rank: fn([list(row) for row in c], r,
                                                                  BYTES_HIDDEN, BYTES_EXPERTS, 4),
                                      None, compare=lambda *_: True)
            if check.stub:
                check.add(case)
                return check.verdict()
            answers.append((case, got, counts, rank))
    try:
        measured = measured_layer_bytes()
    except Exception as err:  # noqa: BLE001 - a broken machine is not the student's fault
        check.add(Case("the traced layers", False, f"could not run them: {err}"))
        return check.verdict("the reference run failed; re-run the cell.")
    per_rank = [b for case_bytes in measured for b in case_bytes]
    for (case, got, counts, rank), want in zip(answers, per_rank):
        if isinstance(got, BaseException):
            check.add(case)
            check.shows({"raised"})
            continue
        number = as_number(got)
        if number is None:
            check.add(Case(case.name, False, f"got {got!r}, not a number of bytes"))
            check.shows({"format"})
            continue
        if math.isclose(number, want, rel_tol=1e-9, abs_tol=1e-6):
            check.add(Case(case.name, True))
            continue
        check.add(Case(case.name, False, f"got {number:g} bytes; the traced layer sends another count"))
        check.shows({name for name, switches in BYTES_MISTAKES.items() if math.isclose(
            number, reference_layer_bytes_sent(counts, rank, BYTES_HIDDEN, BYTES_EXPERTS, 4, **switches),
            rel_tol=1e-9, abs_tol=1e-6)})
    return check.verdict()


__all__ = ["check_send_splits", "check_gradient_domains", "check_layer_bytes_sent",
           "send_splits_cases", "reference_send_splits", "GRADIENT_DOMAIN_CASES",
           "GRADIENT_DOMAIN_GRIDS", "bytes_cases", "send_count_matrix",
           "reference_layer_bytes_sent", "measured_layer_bytes", "bytes_left_rank"]
