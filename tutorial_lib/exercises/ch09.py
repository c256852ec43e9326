"""Checkers for chapter 9, context parallelism.

* :func:`check_merge_partials`: the student's ``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)``
  merges two partial attentions of the same queries over disjoint keys by the
  log-sum-exp rule.  Compared with :func:`tutorial_lib.context_parallel.merge_partials`
  and with attention over all the keys at once, on cases that include a part with no
  keys (``lse = -inf``) and scores near 1000 (where ``exp(lse)`` overflows in fp32).  A
  plain average, a plain sum, keeping the larger part, weights that are not renormalised,
  a wrong merged ``lse`` and an overflow each get a hint.
* :func:`check_held_chunks`: ``fn(cp_rank, cp_size) -> chunk indices`` under the
  load-balanced split (``2 CP`` chunks; rank ``r`` holds ``r`` and ``2 CP - 1 - r``), any
  order; the naive split, the striped ``r, r + CP`` and the off-by-one mirror get hints.
* :func:`check_ring_pass_bytes`: ``fn(batch, heads, seq_length, head_dim, cp_size,
  bytes_per_element) -> bytes`` one rank sends in the forward ring of one attention call
  (``CP - 1`` blocks of its K and V), against
  :func:`tutorial_lib.costs.cp_attention_messages`.  Counting ``CP`` steps, K alone, the
  whole sequence, bits, or the backward too each get a hint.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

from typing import Callable

from .kit import HINT_RUN_FAILED, Case, Checking, CheckResult, Mistakes, as_whole_numbers, check_formula

# --- exercise 9.1: merge two partial attentions -------------------------------------------

HINT_MERGE_FORMAT = (
    "return a pair (out, lse): out with out_a's shape [..., queries, head_dim] and lse with "
    "lse_a's shape [..., queries]."
)
HINT_MERGE_AVERAGE = (
    "you averaged the two parts with equal weights. Each part is normalised by its own keys' "
    "softmax sum e^lse; weigh part a by e^(lse_a - lse) and part b by e^(lse_b - lse), with "
    "lse = log(e^lse_a + e^lse_b): the part whose keys hold more of the softmax mass counts more."
)
HINT_MERGE_SUM = (
    "you added the two parts. Each is already a weighted average of its values (its weights "
    "sum to 1), so the sum weighs 2 in all: re-weight each by its share of the softmax sum, "
    "e^(lse_x - lse)."
)
HINT_MERGE_MAX = (
    "you kept the part with the larger lse. The other part's keys still carry some softmax "
    "mass: both parts contribute, each weighted by e^(lse_x - lse)."
)
HINT_MERGE_LSE = (
    'the output is right but the merged lse is not: it is the log of the whole softmax '
    "sum over both parts' keys, not the max or the sum of the two lse's; the next merge "
    'needs it.'
)
HINT_MERGE_UNNORMALISED = (
    "you weighted the parts by e^lse_a and e^lse_b but did not divide by their sum: the "
    "weights are e^lse_x / (e^lse_a + e^lse_b) = e^(lse_x - lse)."
)
HINT_MERGE_OVERFLOW = (
    'a case with scores near 1000 gave inf or NaN: e^1000 overflows. Never form e^lse '
    'itself: work with differences of log-sum-exps, whose exponentials are at most 1 '
    '(torch has a log-add-exp).'
)
HINT_MERGE_EMPTY = (
    'a part with no keys (lse = -inf, out = 0) must weigh nothing. A formula that '
    'subtracts lse_a from itself, or divides by e^lse_a, turns that case into NaN.'
)
HINT_MERGE_NUDGE = (
    "each part is a softmax average over its own keys, normalised by its own sum e^lse. "
    "Over all the keys, what share of the softmax mass does each part hold, and what is the "
    "log of the whole sum? Compute it without ever forming e^lse."
)
HINT_MERGE_GENERIC = (
    "re-read 'The merge: attention in pieces, exactly': reconsider each part's share of "
    'the whole softmax sum, and the log of that whole sum, computed without forming '
    'e^lse.'
)

#: The mistakes of exercise 9.1, in order of preference: a wrong format on any case; a wrong
#: formula when it explains every failing case; an overflow or a NaN for an empty part as
#: soon as one case shows it (a right formula written unstably).
MERGE_HINTS = Mistakes(
    (HINT_MERGE_NUDGE, HINT_MERGE_GENERIC), any_case={"format", "overflow", "empty"}, format=HINT_MERGE_FORMAT,
    average=HINT_MERGE_AVERAGE, sum=HINT_MERGE_SUM, max=HINT_MERGE_MAX,
    unnormalised=HINT_MERGE_UNNORMALISED, lse=HINT_MERGE_LSE, overflow=HINT_MERGE_OVERFLOW,
    empty=HINT_MERGE_EMPTY)


def merge_cases():
    """(name, (out_a, lse_a, out_b, lse_b), out, lse): two partial attentions of the same
    queries over disjoint keys, and attention over all the keys with its log-sum-exp."""
    import torch
    import torch.nn.functional as F
    from ..context_parallel import block_attention
    g = torch.Generator().manual_seed(9)
    out = []
    for name, shape, keys, split, shift in (
            ("4 queries, 6 keys split 3 + 3", (1, 1, 4, 8), 6, 3, 0.0),
            ("2 heads x 5 queries, 7 keys split 1 + 6", (1, 2, 5, 4), 7, 1, 0.0),
            ("3 queries, 8 keys split 6 + 2, every score + 1000", (1, 1, 3, 4), 8, 6, 1000.0),
            ("part a has no keys yet (lse = -inf, out = 0)", (1, 1, 4, 8), 6, 0, 0.0)):
        q = torch.randn(*shape, generator=g)
        k, v = (torch.randn(*shape[:-2], keys, shape[-1], generator=g) for _ in range(2))
        scale = shape[-1] ** -0.5
        if split:
            out_a, lse_a = block_attention(q, k[..., :split, :], v[..., :split, :], scale)
        else:
            out_a, lse_a = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
        out_b, lse_b = block_attention(q, k[..., split:, :], v[..., split:, :], scale)
        lse = torch.logsumexp(q @ k.transpose(-1, -2) * scale, dim=-1)
        # adding a constant to every score changes no probability, only the lse
        out.append((name, (out_a, lse_a + shift, out_b, lse_b + shift),
                    F.scaled_dot_product_attention(q, k, v, scale=scale), lse + shift))
    return out


def _merge_mistakes(out_a, lse_a, out_b, lse_b) -> dict:
    """What each classic mistake returns as ``out`` for these parts."""
    import torch
    bigger = (lse_a >= lse_b).unsqueeze(-1)
    return {"average": (out_a + out_b) / 2, "sum": out_a + out_b,
            "max": torch.where(bigger, out_a, out_b),
            "unnormalised": out_a * torch.exp(lse_a).unsqueeze(-1) + out_b * torch.exp(lse_b).unsqueeze(-1)}


def _read_merge(got, shape_out, shape_lse):
    import torch
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return None
    out, lse = got
    if not (isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)):
        return None
    if tuple(out.shape) != tuple(shape_out) or tuple(lse.shape) != tuple(shape_lse):
        return None
    return out.float(), lse.float()


def check_merge_partials(fn: Callable) -> CheckResult:
    """``fn(out_a, lse_a, out_b, lse_b) -> (out, lse)``; see the module docstring."""
    import torch
    check = Checking("Exercise 9.1: merge two partial attentions", MERGE_HINTS)
    for name, parts, want, want_lse in merge_cases():
        case, got = check.attempt(name, lambda: fn(*[t.clone() for t in parts]), None,
                                  compare=lambda a, b: False)
        if isinstance(got, BaseException):
            check.add(case)
            check.shows()
            continue
        answer = _read_merge(got, parts[0].shape, parts[1].shape)
        if answer is None:
            check.add(Case(name, False, "not a pair (out, lse) of the parts' shapes"))
            check.shows({"format"})
            continue
        out, lse = answer
        finite = bool(torch.isfinite(out).all())
        out_ok = finite and torch.allclose(out, want, atol=1e-5, rtol=1e-4)
        if out_ok and torch.allclose(lse, want_lse, atol=1e-4, rtol=1e-5):
            check.add(Case(name, True))
            continue
        shown = set()
        if not finite:
            shown.add("empty" if "no keys" in name else "overflow")
        elif out_ok:
            shown.add("lse")
        for mistake, value in _merge_mistakes(*parts).items():  # an overflow overflows alike
            if torch.allclose(torch.nan_to_num(out), torch.nan_to_num(value), atol=1e-5, rtol=1e-4):
                shown.add(mistake)
        worst = (torch.nan_to_num(out, 1e30) - want).abs().max().item()
        check.add(Case(name, False, f"out is off by up to {worst:.3g}" if not out_ok
                       else f"out is right; lse is off by up to "
                            f"{(torch.nan_to_num(lse, 1e30) - want_lse).abs().max().item():.3g}"))
        check.shows(shown)
    return check.verdict()


# --- exercise 9.2: the chunks a rank holds ----------------------------------------------------

HELD_CASES = [(r, size) for size in (1, 2, 3, 4, 8) for r in range(size)]

HINT_HELD_FORMAT = "return the chunk indices (whole numbers), e.g. [1, 6] or (1, 6)."
HINT_HELD_NAIVE = (
    "that is the naive split (CP chunks, rank r holds chunk r). The balanced split cuts the "
    "sequence into 2 x CP chunks and gives each rank TWO: an early one and its mirror image."
)
HINT_HELD_STRIPED = (
    "r and r + CP pairs early chunks with middle ones: under a causal mask rank CP - 1 still "
    "does more work than rank 0. Pair chunk r with the chunk as far from the end as r is from "
    "the start: 2 x CP - 1 - r."
)
HINT_HELD_OFF_BY_ONE = (
    "off by one: with 2 x CP chunks numbered 0 .. 2 CP - 1, the mirror of chunk r is "
    "2 CP - 1 - r (rank 0 holds the first and the last chunk, 0 and 2 CP - 1)."
)
HINT_HELD_MIRROR_CP = (
    "CP - 1 - r mirrors chunk r inside the first CP chunks only: the sequence has 2 x CP "
    "chunks, and the mirror of r is 2 x CP - 1 - r."
)
HINT_HELD_NUDGE = (
    "under a causal mask a late chunk costs more than an early one. With 2 x CP chunks and "
    "two per rank, which pairs of chunks cost the same in total?"
)
HINT_HELD_GENERIC = "rank r of CP holds chunks r and 2 * CP - 1 - r of 2 * CP."

HELD_HINTS = Mistakes((HINT_HELD_NUDGE, HINT_HELD_GENERIC), any_case={"format"}, format=HINT_HELD_FORMAT,
                      naive=HINT_HELD_NAIVE, striped=HINT_HELD_STRIPED,
                      off_by_one=HINT_HELD_OFF_BY_ONE, mirror_cp=HINT_HELD_MIRROR_CP)


def _held_mistakes(r: int, size: int) -> dict[str, list[int]]:
    return {"naive": [r], "striped": sorted([r, r + size]), "off_by_one": sorted([r, 2 * size - r]),
            "mirror_cp": sorted([r, size - 1 - r])}


def check_held_chunks(fn: Callable[[int, int], object]) -> CheckResult:
    """``fn(cp_rank, cp_size)`` -> the chunk indices; see the module docstring."""
    from ..context_parallel import held_chunks
    check = Checking("Exercise 9.2: the chunks a rank holds", HELD_HINTS)

    def same(got, want):
        numbers = as_whole_numbers(got)
        return numbers is not None and sorted(numbers) == sorted(want)

    for r, size in HELD_CASES:
        want = list(held_chunks(r, size))
        case, got = check.run(f"rank {r} of CP {size}", lambda: fn(r, size), want, compare=same)
        numbers = None if isinstance(got, BaseException) else as_whole_numbers(got)
        if not case.passed and numbers is not None:
            bad = [c for c in numbers if not 0 <= c < 2 * size]
            case.detail = (f"got {got!r}: chunk {bad[0]} is not one of the 2 x CP chunks" if bad
                           else f"got {got!r}: {len(numbers)} chunks, each rank holds two"
                           if len(numbers) != 2 else f"got {got!r}: not the balanced pair")

        def explain(numbers, r=r, size=size):
            return {m for m, v in _held_mistakes(r, size).items() if sorted(numbers) == v}
        check.judge(case, got, as_whole_numbers, explain, exceptions=False)
    return check.verdict()


# --- exercise 9.3: the bytes of one ring pass -------------------------------------------------

#: (batch, heads, seq_length, head_dim, cp_size, bytes per element)
RING_CASES = [(1, 32, 131072, 128, 8, 2), (2, 4, 16, 8, 2, 4), (2, 4, 16, 8, 4, 4),
              (4, 8, 4096, 64, 4, 2), (1, 1, 8, 1, 1, 4), (1, 16, 32768, 128, 16, 2)]

HINT_RING_FORMAT = "return one number: the bytes this rank sends in the forward ring of one attention."
HINT_RING_STEPS = (
    "the ring has CP steps but only CP - 1 sends: at the last step each rank attends to the "
    "last block it received and has nothing left to pass on."
)
HINT_RING_K_ONLY = "the ring carries keys AND values: each block is 2 x b x h x (s / CP) x d elements."
HINT_RING_WHOLE_SEQUENCE = (
    "a block holds one rank's tokens, s / CP of them, not the whole sequence: that is what "
    "makes each message CP times smaller than all-gathering."
)
HINT_RING_BITS = "you counted bits: divide by 8 (bytes_per_element is already in bytes)."
HINT_RING_BACKWARD = (
    "that is forward and backward. The forward ring alone sends CP - 1 K/V blocks; the "
    "backward sends the blocks around again plus CP - 1 dK/dV accumulators."
)
HINT_RING_NUDGE = (
    "how many times does a rank pass a block on in the forward ring, and what does one "
    "block hold (whose tokens, which tensors)?"
)
HINT_RING_GENERIC = (
    "re-read 'The ring (`p2p`)': reconsider how many sends one rank makes in the forward "
    'ring, and what one block holds (whose tokens, which tensors, bytes per element).'
)

RING_HINTS = Mistakes((HINT_RING_NUDGE, HINT_RING_GENERIC), any_case={"format"}, format=HINT_RING_FORMAT,
                      backward=HINT_RING_BACKWARD, steps=HINT_RING_STEPS, k_only=HINT_RING_K_ONLY,
                      whole_sequence=HINT_RING_WHOLE_SEQUENCE, bits=HINT_RING_BITS)


def reference_ring_pass_bytes(batch, heads, seq_length, head_dim, cp_size, bytes_per_element) -> int:
    """The forward sends of :func:`tutorial_lib.costs.cp_attention_messages` (p2p)."""
    from ..costs import cp_attention_messages
    rows = cp_attention_messages("p2p", cp_size, batch, heads, seq_length, head_dim, bytes_per_element)
    return sum(r["count"] * r["bytes"] for r in rows if r["phase"] == "forward" and r["op"] == "send")


def _ring_mistakes(b, h, s, d, size, e) -> dict[str, float]:
    block = 2 * b * h * (s // size) * d * e
    right = (size - 1) * block
    return {"steps": size * block, "k_only": right / 2, "whole_sequence": (size - 1) * 2 * b * h * s * d * e,
            "bits": 8 * right, "backward": 3 * right}  # + K/V again + CP - 1 dK/dV


def check_ring_pass_bytes(fn: Callable) -> CheckResult:
    """``fn(batch, heads, seq_length, head_dim, cp_size, bytes_per_element)``; see the module docstring."""
    cases = {f"b={b}, h={h}, s={s}, d={d}, CP={size}, {e} B/element": (b, h, s, d, size, e)
             for b, h, s, d, size, e in RING_CASES}
    return check_formula("Exercise 9.3: the bytes of one ring pass", RING_HINTS, fn, cases,
                         reference_ring_pass_bytes, _ring_mistakes,
                         "bytes; the forward ring sends another count", rel_tol=1e-12, abs_tol=1e-9)


__all__ = ["check_merge_partials", "check_held_chunks", "check_ring_pass_bytes", "merge_cases",
           "HELD_CASES", "RING_CASES", "reference_ring_pass_bytes"]


# --- exercise 9.4: predict each rank's causal work, then run the ring -----------------------

#: Exercise 9.4's ring: CP ranks, sequence length (one sequence, one head).
WORK_CP, WORK_SEQ = 3, 12
SPLITS = ("naive", "balanced")

HINT_WORK_FORMAT = (
    "return a dict with one whole number per (split, CP rank): {('naive', 0): ..., ..., "
    "('balanced', 2): ...}, the (query, key) pairs the ring attends on that rank."
)
HINT_WORK_DIAGONAL_FULL = (
    "a chunk attending to its own keys does not see all of them: under the causal mask "
    "the query at a chunk's i-th position sees i + 1 of the chunk's keys, a triangle with "
    "its diagonal, not the whole c x c square.",
)
HINT_WORK_DIAGONAL_HALF = (
    "the triangle a chunk attends in its own block includes the diagonal (every query "
    "sees itself): c (c + 1) / 2 pairs for a chunk of c tokens, not c * c / 2.",
)
HINT_WORK_NOT_CAUSAL = (
    "the ring here is causal: a query never attends to a later key, so a chunk skips "
    "every block after its own, and only earlier chunks are attended whole.",
)
HINT_WORK_STRIPED = (
    "the balanced split does not give rank r the chunks r and r + CP: it pairs an early "
    "chunk with a late one, r and 2 CP - 1 - r, so that their work adds up to the same "
    "on every rank.",
)
HINT_WORK_NAIVE = (
    "under the naive split rank r holds the r-th contiguous piece of the sequence: its "
    "queries come after every query of rank r - 1 and see more keys. Only the balanced "
    "split evens the work out.",
)
HINT_WORK_GENERIC = (
    "for each chunk a rank holds, count the (query, key) pairs: the query at position p "
    "attends to p + 1 keys. Sum over the rank's positions, for each split's chunks."
)

#: The mistakes of exercise 9.4, in order of preference.
WORK_MISTAKES = Mistakes(HINT_WORK_GENERIC, any_case={"format"}, format=HINT_WORK_FORMAT,
                         not_causal=HINT_WORK_NOT_CAUSAL, diagonal_full=HINT_WORK_DIAGONAL_FULL,
                         diagonal_half=HINT_WORK_DIAGONAL_HALF, striped=HINT_WORK_STRIPED,
                         naive_even=HINT_WORK_NAIVE)


def ring_work_variant(split: str, rank: int, cp: int = WORK_CP, seq: int = WORK_SEQ, *,
                      diagonal=lambda c: c * (c + 1) // 2, causal: bool = True,
                      striped: bool = False, even: bool = False) -> int:
    """The pairs a rank attends under a counting rule (the defaults: the right one);
    ``even``: the naive split counted as if it were balanced."""
    from ..context_parallel import held_chunks, num_chunks
    balanced = split == "balanced" or even
    chunks = (rank, rank + cp) if striped and balanced else held_chunks(rank, cp, balanced)
    c = seq // num_chunks(cp, balanced)
    total = 0
    for q in chunks:
        if not causal:
            total += c * seq
            continue
        total += q * c * c + diagonal(c)
    return int(total)


def measured_ring_work(cp: int = WORK_CP, seq: int = WORK_SEQ) -> dict:
    """Run the causal ring on ``cp`` gloo ranks under both splits (one sequence, one head)
    and read each rank's attended pairs from the trace: ``{(split, rank): pairs}``."""
    from ..timing import measure_ring_work
    rows, _, _ = measure_ring_work(cp, batch=1, heads=1, seq_length=seq, head_dim=4,
                                   timeout=120)
    return {(row["split"], row["rank"]): int(row["pairs"]) for row in rows}


def check_ring_work(fn: Callable, measured: Callable[[], dict] = measured_ring_work
                    ) -> CheckResult:
    """Check ``fn() -> {(split, rank): pairs}`` against the ring itself: once the student
    has committed a prediction, ``measured()`` runs the causal ring on WORK_CP ranks (gloo
    workers) and counts the pairs each rank attended.  A wrong count is shown as given."""
    check = Checking("Exercise 9.4: ring_work", WORK_MISTAKES)
    opened = check.prediction(fn, "the prediction", measured)  # nothing committed: no run
    if opened is None:
        return check.verdict()
    got, ran = opened
    rules = {"not_causal": dict(causal=False), "striped": dict(striped=True),
             "diagonal_full": dict(diagonal=lambda c: c * c),
             "diagonal_half": dict(diagonal=lambda c: c * c / 2),
             "naive_even": dict(even=True)}
    for split in SPLITS:
        for rank in range(WORK_CP):
            check.count(f"{split} split, rank {rank}", got.get((split, rank)),
                        ran[(split, rank)], "not what the ring attended",
                        lambda n: {m for m, rule in rules.items()
                                   if ring_work_variant(split, rank, **rule) == n})
    return check.verdict()


__all__ += ["check_ring_work", "measured_ring_work", "ring_work_variant", "WORK_CP",
            "WORK_SEQ"]
