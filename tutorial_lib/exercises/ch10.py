"""Checkers for chapter 10, memory.

* :func:`check_dense_layer_bytes`: the student's ``fn(seq_length, micro_batch, hidden,
  heads, ffn, tp) -> bytes`` that one dense layer of the course's model keeps for backward
  on one TP rank for one microbatch, fp32, no sequence parallelism, against
  :func:`tutorial_lib.costs.layer_activation_bytes`.  LayerNorm tensors split over TP, the
  statistics forgotten, the log-sum-exp forgotten, the ``s x s`` probabilities of an
  unfused attention counted, and values instead of bytes each get a hint.
* :func:`check_smallest_layout`: ``fn(budget_gib) -> (tp, pp)``, the layout of the
  Llama 3.1 405B preset with the fewest model-parallel ranks ``TP x PP`` whose heaviest rank
  fits the budget (ZeRO-1, full recomputation of every layer; among layouts of equal size
  the one whose heaviest rank needs least), against the prediction of
  :func:`tutorial_lib.memory.heaviest_rank_bytes` over :data:`TP_CHOICES` x :data:`PP_CHOICES`.
  A layout that does not fit, one that fits but is larger than needed, and the right size
  but not the lightest each get a hint.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

from typing import Callable

from ..config import ConfigError, ModelConfig
from ..costs.memory_model import layer_activation_bytes
from ..memory import heaviest_rank_bytes
from ..recompute import Recompute
from .kit import CheckResult, Checking, Mistakes, as_whole_numbers, check_formula

# --- exercise 10.1: one dense layer's saved activations ------------------------------------

#: (seq_length, micro_batch, hidden, heads, ffn, tp): the course's size, then larger ones.
LAYER_CASES = [(8, 12, 16, 4, 64, 1), (8, 12, 16, 4, 64, 2), (4096, 1, 4096, 32, 16384, 8),
               (2048, 2, 1024, 16, 4096, 4), (16, 3, 32, 8, 96, 1)]

HINT_LAYER_FORMAT = "return one number: the bytes one dense layer keeps for backward on one TP rank."
HINT_LAYER_NORMS_SPLIT = (
    "without sequence parallelism every TP rank runs both LayerNorms on the whole sequence: "
    "their inputs, outputs and statistics are not divided by TP (only the heads' and the "
    "MLP's hidden tensors are)."
)
HINT_LAYER_STATS = (
    "each LayerNorm also keeps its mean and reciprocal standard deviation, one fp32 value "
    "per token each, for its backward."
)
HINT_LAYER_LSE = (
    "the fused attention keeps, besides its output, one log-sum-exp value per token and "
    "head (fp32, the rank's heads only): that is how its backward rebuilds the softmax."
)
HINT_LAYER_PROBS = (
    "torch's fused attention (flash on the CPU) never keeps the s x s probabilities: it keeps "
    "the log-sum-exp, one value per token and head, and recomputes the rest in backward."
)
HINT_LAYER_VALUES = "that is a count of values: in fp32 each takes 4 bytes."
HINT_LAYER_NUDGE = (
    "list the tensors: two LayerNorms (input, output, two statistics per token), the qkv "
    "output core attention keeps, its output and log-sum-exp, fc1's output and GELU's: "
    "which are split over TP?"
)
HINT_LAYER_GENERIC = (
    "re-read 'The anatomy of a rank': reconsider, tensor by tensor, what a dense layer "
    'keeps for backward, per token, and which of those tensors are split over TP.'
)

LAYER_HINTS = Mistakes((HINT_LAYER_NUDGE, HINT_LAYER_GENERIC), any_case={"format"},
                       format=HINT_LAYER_FORMAT, values=HINT_LAYER_VALUES,
                       norms_split=HINT_LAYER_NORMS_SPLIT, stats=HINT_LAYER_STATS,
                       probabilities=HINT_LAYER_PROBS, lse=HINT_LAYER_LSE)


def reference_dense_layer_bytes(seq_length, micro_batch, hidden, heads, ffn, tp) -> int:
    """:func:`tutorial_lib.costs.layer_activation_bytes` of a dense layer, summed."""
    model = ModelConfig(seq_length=seq_length, hidden_size=hidden, num_attention_heads=heads,
                        ffn_hidden_size=ffn, num_experts=0)
    return sum(layer_activation_bytes(model, 0, micro_batch, tp).values())


def _layer_mistakes(s, b, h, heads, ffn, tp) -> dict[str, int]:
    want, t = reference_dense_layer_bytes(s, b, h, heads, ffn, tp), s * b
    norms = 4 * (4 * t * h + 4 * t)
    return {"values": want // 4,
            "norms_split": want - norms + norms // tp,
            "stats": want - 4 * 4 * t,
            "probabilities": want - 4 * t * heads // tp + 4 * b * heads // tp * s * s,
            "lse": want - 4 * t * heads // tp}


def check_dense_layer_bytes(fn: Callable) -> CheckResult:
    """``fn(seq_length, micro_batch, hidden, heads, ffn, tp)``; see the module docstring."""
    cases = {f"s={s}, b={b}, h={h}, heads={heads}, ffn={ffn}, TP={tp}": (s, b, h, heads, ffn, tp)
             for s, b, h, heads, ffn, tp in LAYER_CASES}
    return check_formula("Exercise 10.1: one dense layer's saved activations", LAYER_HINTS, fn,
                         cases, reference_dense_layer_bytes, _layer_mistakes,
                         "bytes; the layer keeps another amount")


# --- exercise 10.2: the smallest layout that fits ------------------------------------------

PRESET = "llama-3.1-405b"
TP_CHOICES = (1, 2, 4, 8)
PP_CHOICES = (1, 2, 4, 8, 16)
RECOMPUTE = Recompute("full", "uniform", 1)
BUDGET_CASES = (141, 80, 40, 24)
"""GiB per GPU: an H200, an H100, a 40 GiB A100, and a tight one."""

HINT_FIT_FORMAT = "return a pair (tp, pp) of whole numbers, one of the choices the text lists."
HINT_FIT_TOO_BIG = (
    "that layout's heaviest rank does not fit: compare the budget with the heaviest rank, "
    "which is not always pipeline rank 0 (with recomputation the last stage's logits can win)."
)
HINT_FIT_NOT_SMALLEST = (
    "that layout fits, but one with fewer model-parallel ranks (TP x PP) fits too: more DP "
    "replicas for the same GPUs. Try every choice and keep the smallest TP x PP."
)
HINT_FIT_TIE = (
    "right size, but another layout with the same TP x PP needs less on its heaviest rank: "
    "among equals keep the lightest."
)
HINT_FIT_NUDGE = (
    "for every (tp, pp) of the choices, ask heaviest_rank_bytes (a ConfigError means the "
    "batch does not split: skip it); among those that fit, which has the fewest ranks?"
)
HINT_FIT_GENERIC = (
    "sort the layouts that fit by (TP x PP, heaviest rank's bytes) and return the first."
)

FIT_HINTS = Mistakes((HINT_FIT_NUDGE, HINT_FIT_GENERIC), any_case={"format"}, format=HINT_FIT_FORMAT,
                     too_big=HINT_FIT_TOO_BIG, not_smallest=HINT_FIT_NOT_SMALLEST, tie=HINT_FIT_TIE)


def layout_needs() -> dict[tuple[int, int], int]:
    """Bytes of the heaviest rank for every layout of the choices that the batch allows."""
    out = {}
    for tp in TP_CHOICES:
        for pp in PP_CHOICES:
            try:
                out[tp, pp] = heaviest_rank_bytes(PRESET, tp, pp, use_distributed_optimizer=True,
                                                  recompute=RECOMPUTE)
            except ConfigError:
                continue
    return out


def reference_smallest_layout(budget_gib: float, needs: dict | None = None) -> tuple[int, int] | None:
    """The fewest ``TP x PP`` that fits ``budget_gib``, the lightest among equals."""
    needs = layout_needs() if needs is None else needs
    fits = [(tp * pp, need, (tp, pp)) for (tp, pp), need in needs.items() if need <= budget_gib * 2**30]
    return min(fits)[2] if fits else None


def check_smallest_layout(fn: Callable) -> CheckResult:
    """``fn(budget_gib) -> (tp, pp)``; see the module docstring."""
    check = Checking("Exercise 10.2: the smallest layout that fits", FIT_HINTS)
    needs = layout_needs()
    for budget in BUDGET_CASES:
        want = reference_smallest_layout(budget, needs)

        def read(got):
            numbers = as_whole_numbers(got)
            return tuple(numbers) if numbers is not None and len(numbers) == 2 else None
        case, got = check.run(f"budget {budget} GiB", lambda: fn(budget), want,
                              compare=lambda g, w: read(g) == w)

        def explain(answer, budget=budget, want=want):
            if answer not in needs:
                return {"format"}
            if needs[answer] > budget * 2**30:
                return {"too_big"}
            if answer[0] * answer[1] > want[0] * want[1]:
                return {"not_smallest"}
            return {"tie"}
        if not case.passed and not isinstance(got, BaseException) and read(got) is not None:
            case.detail = f"got TP {read(got)[0]} x PP {read(got)[1]}; another layout is the answer"
        check.judge(case, got, read, explain, exceptions=False)
    return check.verdict()


__all__ = ["check_dense_layer_bytes", "check_smallest_layout", "reference_dense_layer_bytes",
           "reference_smallest_layout", "layout_needs", "LAYER_CASES", "BUDGET_CASES",
           "TP_CHOICES", "PP_CHOICES", "PRESET", "RECOMPUTE"]
