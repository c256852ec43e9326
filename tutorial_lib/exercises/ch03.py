"""Checkers for chapter 3, tensor parallel + data parallel.

* :func:`check_row_parallel_linear`: the student's ``fn(x, weight, bias)`` is the
  forward (and, through autograd, the backward) of a row-parallel linear layer on one
  TP rank.  The checker launches it at TP=2, TP=4 and TP=2 x DP=2 on real gloo ranks
  and compares the output, the input gradient and the weight and bias gradients with
  the serial ``nn.Linear`` built from the same seed.  A bias added before the
  reduction, a missing all-reduce, an all-reduce in the backward too, the wrong
  group, an average instead of a sum and an untracked in-place all-reduce each get a
  hint of their own.
* :func:`check_gradient_groups`: for parameters of a TP=2, DP=2 Transformer (sharded
  weights, replicated LayerNorms and biases, with and without sequence parallelism),
  the groups their gradients must be reduced over; every wrong choice gets its reason.
* :func:`check_step_bytes`: the student's formula for the bytes one rank sends on each
  group (``tp``, ``dp``) in one training step of a stack of Transformer blocks.  The
  checker runs that step on real ranks for several configurations (TP, DP, sequence
  parallelism, microbatches, layers) and counts the bytes from the trace with the
  ring formulas of :func:`tutorial_lib.costs.ring_bytes_sent`.

Student code never makes a checker raise: exceptions, deadlocks and stubs become
failed cases with a hint.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from ..launch import LaunchTimeout
from .kit import (Case, Checking, CheckResult, Mistakes, as_group_kinds, as_number, check_answers,
                  group_sets, group_text, is_close, launch_retrying, misnamed_groups,
                  recover_answer)

# --- hints (tests look for these exact strings) ---------------------------------------

HINT_ROW_BIAS_BEFORE = (
    'the output holds the bias T times: you added it before the all-reduce, so every '
    "TP rank's partial sum brought its own copy of b. The bias is replicated, not "
    'split: reconsider when it joins the sum of the partial products.'
)
HINT_ROW_NO_REDUCE = (
    'every rank returned only its own partial product X_i W_i^T (+ b). A row-parallel '
    "layer's output is the SUM of those partials over the TP group: reconsider which "
    'collective gives every TP rank that sum, and over which group.'
)
HINT_ROW_BACKWARD_REDUCE = (
    'the forward is right but the gradients are T times too large: your backward '
    'all-reduces dY as well. After the forward all-reduce every TP rank already holds '
    'the same, complete dY: reconsider what the backward of a sum does with it. The '
    'all-reduce in backward belongs to the column-parallel layer (copy_to), not here.'
)
HINT_ROW_WRONG_GROUP = (
    'your all-reduce ran over the wrong group: with DP=2 it also added the partial '
    'sums of the other data-parallel replica, which computed them from different '
    'samples. Reduce over the tensor-parallel group only.'
)
HINT_ROW_AVERAGED = (
    "you averaged the partial products (an all-reduce followed by a division by T): the "
    "layer's output is their sum, Y = sum_i X_i W_i^T, so do not divide."
)
HINT_ROW_NO_GRAD = (
    'no gradient reached x or the weight: the output is cut off from autograd (a '
    'detach, torch.no_grad, .data, or a tensor rebuilt from values). The all-reduce '
    "must be a step autograd can differentiate: re-read 'Row-parallel: split the "
    "input features' and reconsider what its backward does with dY."
)
HINT_ROW_UNTRACKED = (
    'the numbers are right, but only because autograd passes the gradient straight '
    'through an in-place all-reduce it knows nothing about, and torch warns that this '
    'fallback is deprecated and will be removed. Make the backward explicit, a '
    "torch.autograd.Function of your own (or the library's "
    'reduce_from_tensor_model_parallel_region), and reconsider which tensor the '
    'all-reduce may change in place.'
)
HINT_ROW_SHAPE = (
    "return Y with shape [s, b, out]: every output feature, the same full tensor on every TP "
    "rank (only the input features are split)."
)
HINT_ROW_NUDGE = (
    "each TP rank multiplies its slice of the input by its slice of the weight: a partial "
    "product. How do the ranks turn their partial products into the layer's output, where "
    "does the bias go, and what must the backward of that step do with dY?"
)
HINT_ROW_GENERIC = (
    "re-read 'Row-parallel: split the input features': each rank's product is a partial "
    'sum of the output; reconsider which collective completes it, where that collective '
    'sits in the forward and backward passes, and when the bias is added.'
)

HINT_GROUPS_FORMAT = (
    "return a dict from every case name in GRADIENT_CASES to the set of group kinds the "
    "gradient is reduced over, e.g. {'qkv_weight': {'dp'}, ...}; use set() for none."
)

HINT_STEP_FORMAT = (
    "return a dict {'tp': bytes, 'dp': bytes}: the bytes ONE rank sends on its tensor-parallel "
    "group and on its data-parallel group in one step, as numbers."
)
HINT_STEP_RAISED = (
    "your function raised an exception for some configurations (see the cases above): try it "
    "on each of STEP_CASES, e.g. with sequence_parallel=True, tensor_parallel=1 or data_parallel=1."
)
HINT_STEP_PAYLOAD = (
    'you counted the tensors handed to the collectives, not the bytes a rank sends. '
    "With the ring algorithm a rank sends less than the tensor's size: re-read 'Ring "
    "all-reduce: a reduce-scatter, then an all-gather' (chapter 2, exercise 2.2) for "
    'what an all-reduce, a reduce-scatter and an all-gather each send per rank.'
)
HINT_STEP_ONE_PHASE = (
    'your ring factor is (N-1)/N: that is one phase. An all-reduce is a '
    'reduce-scatter followed by an all-gather: reconsider what the two phases send '
    'together.'
)
HINT_STEP_FORWARD_ONLY = (
    "you counted the forward pass only. Each block has 2 TP all-reduces in the forward "
    "(after attention and after the MLP) and 2 in the backward (before the QKV and the fc1 "
    "projections, the column-parallel layers' copy_to): 4 per block per microbatch."
)
HINT_STEP_TP_ONCE = (
    "the TP traffic happens in every microbatch: each microbatch runs the forward and backward "
    "of every block, so multiply the per-block activation traffic by num_microbatches."
)
HINT_STEP_SP_SMALLER = (
    'sequence parallelism does not shrink the TP traffic: it splits each all-reduce '
    'into a reduce-scatter and an all-gather of the same activation, which together '
    'send what the all-reduce sent. It saves activation memory, not bytes on the wire '
    '(its backward even adds one all-gather per column-parallel layer).'
)
HINT_STEP_SP_NO_REGATHER = (
    'with sequence parallelism the backward pass sends one more all-gather per '
    'column-parallel layer (QKV and fc1): each keeps only its [s/T, b, h] input shard '
    'for backward and gathers the whole input again to compute its weight gradient. '
    "Re-read 'What the column-parallel layers keep for backward'."
)
HINT_STEP_SP_NO_SYNC = (
    "with sequence parallelism there is one more TP all-reduce per step: the gradients of "
    "the replicated LayerNorm weights and biases and of the row-parallel biases (6h values "
    "per block) are partial sums over each rank's tokens and are summed over TP once, after "
    "the last microbatch."
)
HINT_STEP_SP_SYNC_NO_SP = (
    "without sequence parallelism every TP rank sees all tokens, so the LayerNorm and bias "
    "gradients are already complete: there is no extra TP all-reduce."
)
HINT_STEP_DP_PER_MICROBATCH = (
    "the gradients are all-reduced over DP once per step, after the last microbatch, not after "
    "every microbatch: with accumulation the earlier microbatches only add into the buffers."
)
HINT_STEP_DP_UNSHARDED = (
    "a rank all-reduces over DP the gradients of the parameters IT holds: the TP shards "
    "(1/T of each column- or row-parallel weight, and the column-parallel biases) plus the "
    "replicated LayerNorms and row-parallel biases in full. You counted the whole block."
)
HINT_STEP_DP_REPLICATED_SPLIT = (
    "you divided every parameter of the block by T, the replicated ones too. Only the "
    "column- and row-parallel weights (and the column-parallel biases) are split over TP; "
    "the two LayerNorms and the row-parallel biases are whole on every TP rank, so their "
    "6h values per block count in full on each rank's DP all-reduce."
)
HINT_STEP_DP_WEIGHTS_ONLY = (
    'count every parameter, not only the weight matrices: the LayerNorms (weight and '
    'bias) and every bias too, and reconsider which of them are split over TP and '
    'which are whole on every TP rank.'
)
HINT_STEP_FFN_4H = (
    "use cfg.ffn_hidden_size: it is not always 4 * hidden_size in the cases tried."
)
HINT_STEP_TP_NUDGE = (
    "for the TP part, list the collectives one block runs on the activations in one "
    "microbatch, forward and backward (and with sequence parallelism, what it gathers "
    "again in backward and what it syncs once per step), then the bytes each sends per rank."
)
HINT_STEP_DP_NUDGE = (
    "for the DP part, count the parameters this rank holds (which are split over TP, which "
    "are whole on every TP rank?), and how often per step their gradients are all-reduced."
)
HINT_STEP_TP_GENERIC = (
    "re-read 'Every byte of one step, predicted' and 'Sequence parallelism': "
    'reconsider how many TP collectives one block runs per microbatch (forward and '
    'backward), what each sends per rank on a ring of T ranks, and, with sequence '
    'parallelism, what the backward gathers again and what is summed once per step.'
)
HINT_STEP_DP_GENERIC = (
    "re-read 'Every byte of one step, predicted' and 'Data parallelism: one training "
    "step': reconsider which parameters one rank holds (the TP shards, and what is "
    'whole on every TP rank), the bytes of their gradients, and what one all-reduce '
    'of them sends per rank on a ring of D ranks.'
)

#: The mistakes of exercise 3.1, in order of preference.
ROW_MISTAKES = Mistakes(
    (HINT_ROW_NUDGE, HINT_ROW_GENERIC), shape=HINT_ROW_SHAPE, bias_before=HINT_ROW_BIAS_BEFORE,
    no_reduce=HINT_ROW_NO_REDUCE, wrong_group=HINT_ROW_WRONG_GROUP, averaged=HINT_ROW_AVERAGED,
    no_grad=HINT_ROW_NO_GRAD, backward_reduce=HINT_ROW_BACKWARD_REDUCE, untracked=HINT_ROW_UNTRACKED)
#: The mistakes of exercise 3.3: a wrong format or an exception on any case first, then the
#: TP part's and the DP part's mistakes (their switches: :data:`STEP_MISTAKES`).
STEP_HINTS = Mistakes(
    (HINT_STEP_TP_NUDGE, HINT_STEP_TP_GENERIC), any_case={"format", "raised"},
    format=HINT_STEP_FORMAT, raised=HINT_STEP_RAISED,
    payload=HINT_STEP_PAYLOAD, one_phase=HINT_STEP_ONE_PHASE, forward_only=HINT_STEP_FORWARD_ONLY,
    tp_once=HINT_STEP_TP_ONCE, sp_smaller=HINT_STEP_SP_SMALLER,
    sp_no_regather=HINT_STEP_SP_NO_REGATHER, sp_no_sync=HINT_STEP_SP_NO_SYNC,
    sp_sync_always=HINT_STEP_SP_SYNC_NO_SP, dp_payload=HINT_STEP_PAYLOAD,
    dp_one_phase=HINT_STEP_ONE_PHASE, dp_per_microbatch=HINT_STEP_DP_PER_MICROBATCH,
    dp_unsharded=HINT_STEP_DP_UNSHARDED, dp_replicated_split=HINT_STEP_DP_REPLICATED_SPLIT,
    dp_weights_only=HINT_STEP_DP_WEIGHTS_ONLY, ffn_4h=HINT_STEP_FFN_4H)


# --- exercise 3.1: a row-parallel linear layer -----------------------------------------

#: (TP, DP) of each launch; world = TP * DP.  DP=2 catches a reduction over the world.
ROW_PARALLEL_CASES = [(2, 1), (4, 1), (2, 2)]
ROW_SEQ, ROW_BATCH, ROW_IN, ROW_OUT = 3, 2, 8, 5
ROW_SEED = 7
_UNTRACKED_WARNING = "autograd kernel was not registered"


def row_parallel_inputs(dp_rank: int):
    """The input ``[s, b, in]`` and output gradient ``[s, b, out]`` of DP replica ``dp_rank``."""
    import torch
    g = torch.Generator().manual_seed(100 + dp_rank)
    return (torch.randn(ROW_SEQ, ROW_BATCH, ROW_IN, generator=g),
            torch.randn(ROW_SEQ, ROW_BATCH, ROW_OUT, generator=g))


def _row_worker(ctx, fn, tp_size):
    import torch

    from .. import parallel_state
    from ..config import ParallelConfig
    from ..tensor_parallel import serial_linear
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp_size))
    i, T = parallel_state.get_rank_in("tp"), parallel_state.get_size("tp")
    x_full, dy = row_parallel_inputs(parallel_state.get_rank_in("dp"))
    serial = serial_linear(ROW_IN, ROW_OUT, seed=ROW_SEED)
    cols = slice(i * ROW_IN // T, (i + 1) * ROW_IN // T)
    x = x_full[..., cols].clone().requires_grad_()
    weight = torch.nn.Parameter(serial.weight.detach()[:, cols].clone())
    bias = torch.nn.Parameter(serial.bias.detach().clone())
    with ctx.tracer.tags(student=True, phase="forward"):
        y = fn(x, weight, bias)
    out = {"tp_rank": i, "dp_rank": parallel_state.get_rank_in("dp"),
           "tp_ranks": parallel_state.get_group_ranks("tp"), "y": y}
    if isinstance(y, torch.Tensor):
        out["y"] = y.detach().clone()
        if y.shape == dy.shape and y.requires_grad:
            with ctx.tracer.tags(student=True, phase="backward"):
                (y * dy).sum().backward()  # a scalar: y.backward(dy) would import sympy per rank
    out["grads"] = [None if t.grad is None else t.grad.clone() for t in (x, weight, bias)]
    return out


def _serial_row_reference(dp_rank: int) -> dict:
    import torch

    from ..tensor_parallel import serial_linear
    x_full, dy = row_parallel_inputs(dp_rank)
    serial = serial_linear(ROW_IN, ROW_OUT, seed=ROW_SEED)
    x = x_full.clone().requires_grad_()
    y = serial(x)
    (y * dy).sum().backward()
    partial = {}  # what each TP size's rank i computes alone: X_i W_i^T
    for T in {tp for tp, _ in ROW_PARALLEL_CASES}:
        w, xs = serial.weight.detach().chunk(T, dim=1), x_full.chunk(T, dim=-1)
        partial[T] = [torch.nn.functional.linear(xs[i], w[i]) for i in range(T)]
    return {"y": y.detach(), "grads": [x.grad, serial.weight.grad, serial.bias.grad],
            "bias": serial.bias.detach(), "partial": partial}


def _close_tensor(a, b, atol: float = 1e-5) -> bool:
    import torch
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-5)))


def _expected_grads(ref: dict, i: int, T: int) -> list:
    dx, dw, db = ref["grads"]
    return [dx.chunk(T, dim=-1)[i], dw.chunk(T, dim=1)[i], db]


def _row_answer_ok(results, refs, T) -> bool:
    for res in results:
        ref = refs[res["dp_rank"]]
        if not _close_tensor(res["y"], ref["y"]):
            return False
        if not all(_close_tensor(g, e) for g, e in zip(res["grads"], _expected_grads(ref, res["tp_rank"], T))):
            return False
    return True


def _classify_row(results, refs, T, trace) -> tuple[set, str]:
    """(names of the mistakes that explain the answer, a detail line for the case)."""
    import torch
    rank, bad = 0, results[0]
    for r, res in enumerate(results):
        ref = refs[res["dp_rank"]]
        if not _close_tensor(res["y"], ref["y"]) or not all(
                _close_tensor(g, e) for g, e in zip(res["grads"], _expected_grads(ref, res["tp_rank"], T))):
            rank, bad = r, res
            break
    ref = refs[bad["dp_rank"]]
    y, i = bad["y"], bad["tp_rank"]
    mine = trace.filter(rank=rank)
    forward_ops = [e for e in mine if e.op != "compute" and e.tags.get("phase") == "forward"]
    backward_ops = [e for e in mine if e.op != "compute" and e.tags.get("phase") == "backward"]
    if not isinstance(y, torch.Tensor):
        return {"shape"}, f"rank {rank}: returned {type(y).__name__}, not a tensor"
    if y.shape != ref["y"].shape:
        return {"shape"}, (f"rank {rank}: output shape {tuple(y.shape)}, but the layer's output "
                           f"[s, b, out] has shape {tuple(ref['y'].shape)}")
    if not _close_tensor(y, ref["y"]):
        worst = (y - ref["y"]).abs().max().item()
        detail = f"rank {rank}: output differs from the serial layer by up to {worst:.3g}"
        partial = ref["partial"][T][i]
        if _close_tensor(y, ref["y"] + (T - 1) * ref["bias"]):
            return {"bias_before"}, detail
        if not forward_ops or _close_tensor(y, partial + ref["bias"]) or _close_tensor(y, partial):
            return {"no_reduce"}, detail
        if any(list(e.group_ranks) != list(bad["tp_ranks"]) for e in forward_ops):
            return {"wrong_group"}, detail
        if _close_tensor(y, (ref["y"] - ref["bias"]) / T + ref["bias"]) or _close_tensor(y, ref["y"] / T):
            return {"averaged"}, detail
        return set(), detail
    grads, want = bad["grads"], _expected_grads(ref, i, T)
    names = ("dX", "dW", "db")
    if grads[0] is None or grads[1] is None:
        missing = [n for n, g in zip(("x", "weight", "bias"), grads) if g is None]
        return {"no_grad"}, f"rank {rank}: the output is right, but no gradient reached {', '.join(missing)}"
    wrong = [n for n, g, e in zip(names, grads, want) if not _close_tensor(g, e)]
    detail = f"rank {rank}: the output is right, but {', '.join(wrong)} differ from the serial layer's"
    if backward_ops or _close_tensor(grads[0], T * want[0]):
        return {"backward_reduce"}, detail
    return set(), detail


def _untracked(output: dict) -> bool:
    return any(_UNTRACKED_WARNING in line for lines in output.values() for _, line in lines)


def check_row_parallel_linear(fn: Callable, timeout: float = 30.0) -> CheckResult:
    """Launch ``fn(x, weight, bias) -> y`` at TP=2, TP=4 and TP=2 x DP=2; compare with ``nn.Linear``.

    On TP rank i, ``x`` is ``[s, b, in/T]`` (columns ``i*in/T ..`` of the input),
    ``weight`` the ``[out, in/T]`` columns of the serial weight and ``bias`` the full
    ``[out]`` bias.  Every rank must return the full ``[s, b, out]`` output, and
    ``(y * dy).sum().backward()`` must leave in ``x.grad``, ``weight.grad`` and
    ``bias.grad`` the matching slices of the serial layer's gradients.  DP replicas
    get different inputs.
    """
    check = Checking("Exercise 3.1: row_parallel_linear", ROW_MISTAKES)
    refs = {d: _serial_row_reference(d) for d in range(max(dp for _, dp in ROW_PARALLEL_CASES))}
    for tp_size, dp_size in ROW_PARALLEL_CASES:
        case, got = check.run_on_ranks(
            f"TP={tp_size}, DP={dp_size} ({tp_size * dp_size} ranks)", _row_worker, tp_size * dp_size,
            args=(fn, tp_size), timeout=timeout,
            compare=lambda out, _, T=tp_size: _row_answer_ok(out.results, refs, T))
        if check.stub:
            break
        if isinstance(got, LaunchTimeout):  # "deadlocked after t s, and again after 4t s"
            case.detail = (f"{case.detail.split(' (')[0]}: some rank waited in a collective "
                           "the others never joined (does every rank of the TP group call it?)")
            check.shows()
            break
        if isinstance(got, BaseException):  # a rank raised, or the launcher itself failed
            check.shows()
            continue
        student = got.trace.filter(student=True)
        if case.passed and _untracked(got.output):
            case.passed = False
            case.detail = ("right numbers, but torch warned: 'c10d::allreduce_: an autograd kernel "
                           "was not registered'")
            check.shows({"untracked"})
        elif not case.passed:
            mistakes, case.detail = _classify_row(got.results, refs, tp_size, student)
            check.shows(mistakes)
    return check.verdict()


# --- exercise 3.2: which groups must a gradient be reduced over? --------------------------

#: Case name -> the parameter, in a TP=2, DP=2 Megatron grid (the statement; the answers
#: are kept as digests below).
GRADIENT_CASES = {
    "qkv_weight":
        "self_attention.linear_qkv.weight: column-parallel; each TP rank holds the rows "
        "(output features) of its own attention heads.",
    "fc2_weight":
        "mlp.linear_fc2.weight: row-parallel; each TP rank holds its own columns (input "
        "features).",
    "fc2_bias":
        "mlp.linear_fc2.bias: the row-parallel layer's bias, a full copy on every TP rank, "
        "added after the all-reduce.",
    "layernorm_weight":
        "input_layernorm.weight: a full copy on every TP rank; no sequence parallelism.",
    "layernorm_weight_sp":
        "input_layernorm.weight with sequence parallelism: each TP rank normalises only its "
        "own s/T tokens.",
    "fc2_bias_sp":
        "mlp.linear_fc2.bias with sequence parallelism: added after the reduce-scatter, to "
        "this rank's s/T tokens only.",
    "fc1_weight_sp":
        "mlp.linear_fc1.weight with sequence parallelism: column-parallel; its input is "
        "all-gathered along the sequence before the matmul.",
    "embedding_weight":
        "the word embedding of a VocabParallelEmbedding: each TP rank holds the rows of its own "
        "range of the vocabulary.",
}

#: Case -> the digest of its set of groups (``kit.answer_digest`` of ``kit.group_text``).
GRADIENT_DIGESTS = {
    "qkv_weight": "2673854107f2d1847226cdd2f9347f22",
    "fc2_weight": "df3a99688c4081cf28ba7867a5cb93b8",
    "fc2_bias": "e8b7c54e4f58a92c7a90839cd2ec503b",
    "layernorm_weight": "7f953617cd3d8b13c95dabd935f91476",
    "layernorm_weight_sp": "cdcd4f5e613ba68ba9b1945fd44a0093",
    "fc2_bias_sp": "c8976b44cd2fb5cb55a78ea3759b4493",
    "fc1_weight_sp": "d505351da923f6bff14bb82aaccc50f6",
    "embedding_weight": "a3636264da1a301fcc2e56b2aa511d73",
}

KNOWN_GROUPS = ("tp", "dp", "pp", "world")

#: Case -> why a TP sum is wrong where none is needed, or missing where one is: one table
#: for all cases, so which cases need a TP sum is not written in its shape.  A text, or
#: stages (what is wrong, then what to look at).
_TP_WHY = {
    "qkv_weight":
        "the TP ranks hold different pieces of this weight, so adding their gradients would add "
        "gradients of different numbers; its gradient dW_i = X^T dY_i is already complete on "
        "rank i: X is the full input on every TP rank and dY_i is the gradient of this rank's "
        "own outputs.",
    "fc2_weight":
        "the TP ranks hold different pieces of this weight, so adding their gradients would add "
        "gradients of different numbers; its gradient dW_i = X_i^T dY is already complete on "
        "rank i: X_i is this rank's slice of the input and dY is the same full gradient on every "
        "TP rank.",
    "fc1_weight_sp":
        "the TP ranks hold different pieces of this weight, so adding their gradients would add "
        "gradients of different numbers; its input is all-gathered before the matmul (and again "
        "in backward, for dW), so X is the full sequence and dW_i = X^T dY_i is already complete "
        "on rank i.",
    "embedding_weight":
        "the TP ranks hold different pieces of this weight, so adding their gradients would add "
        "gradients of different numbers; each rank's rows are the rows of its own vocabulary "
        "range and dY reaches every rank whole, so each rank's row gradients are already "
        "complete.",
    "fc2_bias":
        "no TP reduction is needed: without sequence parallelism dY is the same full tensor on "
        "every TP rank, so db = sum over tokens of dY is already identical on all of them. "
        "Summing over TP would multiply the gradient by T.",
    "layernorm_weight":
        "no TP reduction is needed: without sequence parallelism every TP rank normalises all s "
        "tokens with the same dY, so the copies' gradients are already identical and complete. "
        "Summing over TP would multiply the gradient by T.",
    "layernorm_weight_sp": (
        "dgamma = sum over tokens of dy * x_hat, and with sequence parallelism this rank only "
        "saw its s/T tokens: its gradient is a partial sum. Which ranks hold the other parts?",
        "this rank's gradient is a partial sum over its s/T tokens. Re-read the section on "
        "sequence parallelism: which ranks saw the other tokens of the same samples, and "
        "which saw other samples?"),
    "fc2_bias_sp": (
        "db = sum over tokens of dY, and after the reduce-scatter this rank holds dY for its "
        "s/T tokens only: its gradient is a partial sum. Which ranks hold the other parts?",
        "this rank's gradient is a partial sum over its s/T tokens. Re-read the section on "
        "sequence parallelism: which ranks hold dY for the other tokens of the same samples, "
        "and which for other samples?"),
}


def _why_groups_wrong(case: str, given: frozenset, want: frozenset):
    """Why ``given`` is wrong for ``case``: a text, or its stages (never the right set)."""
    misnamed = misnamed_groups(given, KNOWN_GROUPS, "'tp', 'dp' (or 'pp', 'world')", (
        "the world group mixes everything: it adds the TP ranks' (different) shards or "
        "partial sums together with the other replica's gradients. Name the groups "
        "whose ranks hold copies of this parameter, or parts of one sum."))
    if misnamed:
        return misnamed
    if "pp" in given:
        return ("there is no pipeline here (PP = 1), and pipeline stages hold different layers, "
                "never copies of one parameter: no gradient is ever reduced over PP.")
    if ("tp" in given) != ("tp" in want):
        return _TP_WHY[case]
    if "dp" in want and "dp" not in given:
        return ("the data-parallel replicas processed different samples: without averaging over "
                "DP each replica would step with the gradient of its own samples and the replicas "
                "would drift apart.")
    return "this is not the set of groups over which this gradient's copies or parts are spread."


def check_gradient_groups(fn: Callable) -> CheckResult:
    """Check ``fn() -> {case: groups}`` for every parameter in :data:`GRADIENT_CASES`.

    ``groups`` is a set (or list, or a string like ``"tp+dp"``) of group kinds; the
    order does not matter.
    """
    return check_answers("Exercise 3.2: gradient_groups", fn, GRADIENT_CASES, _judge_groups,
                         HINT_GROUPS_FORMAT)


def _judge_groups(name: str, answer) -> tuple[str, str | None] | None:
    want = recover_answer("3.2", name, GRADIENT_DIGESTS[name],
                          ((group_text(g), g) for g in group_sets(KNOWN_GROUPS, len(KNOWN_GROUPS))))
    given = as_group_kinds(answer)
    if given == want:
        return None
    return (f"got {answer!r}", None if given is None else _why_groups_wrong(name, given, want))


# --- exercise 3.3: the bytes one training step sends ---------------------------------------


@dataclass(frozen=True)
class StepConfig:
    """One training step of a stack of Transformer blocks under TP x DP (fp32)."""

    seq_length: int
    """s: tokens per sequence (the whole sequence, before any sequence-parallel split)."""
    micro_batch_size: int
    """b: sequences per microbatch on one DP replica."""
    hidden_size: int
    """h: width of the residual stream."""
    ffn_hidden_size: int
    """The MLP's inner width (not always 4h)."""
    num_layers: int
    """L: Transformer blocks in the stack."""
    num_microbatches: int
    """M: microbatches accumulated per step on each replica (one gradient sync per step)."""
    tensor_parallel: int
    """T: ranks in each TP group."""
    data_parallel: int
    """D: ranks in each DP group (replicas)."""
    sequence_parallel: bool = False
    """Split the LayerNorm/residual activations along the sequence over the TP ranks."""
    num_attention_heads: int = 4
    """Heads; each TP rank holds heads / T of them."""


#: The configurations the checker runs, grouped by launch (same TP and DP).
STEP_CASES = [
    StepConfig(8, 2, 16, 64, 2, 2, tensor_parallel=2, data_parallel=2),
    StepConfig(8, 1, 16, 40, 2, 3, tensor_parallel=2, data_parallel=2, sequence_parallel=True),
    StepConfig(6, 2, 12, 24, 1, 2, tensor_parallel=2, data_parallel=1, sequence_parallel=True),
    StepConfig(8, 2, 16, 48, 2, 1, tensor_parallel=4, data_parallel=1, sequence_parallel=True),
    StepConfig(4, 3, 8, 32, 1, 2, tensor_parallel=4, data_parallel=1),
    StepConfig(8, 1, 8, 32, 2, 2, tensor_parallel=1, data_parallel=4),
]


def block_params_per_rank(h: int, ffn: int, T: int) -> int:
    """Parameters of one Transformer block held by one TP rank.

    ``6h`` replicated (two LayerNorms' weight and bias, two row-parallel biases) plus
    ``(4h^2 + 3h + 2 h ffn + ffn) / T`` in shards (QKV weight and bias, output
    projection weight, fc1 weight and bias, fc2 weight).
    """
    return 6 * h + (4 * h * h + 3 * h + 2 * h * ffn + ffn) // T


def reference_step_bytes(cfg: StepConfig, *, wire: bool = True, backward: bool = True,
                         tp_per_microbatch: bool = True, sp_smaller: bool = False,
                         sp_regather: bool = True,
                         sp_sync: bool | None = None, ring_phases: int = 2,
                         dp_per_microbatch: bool = False, dp_unsharded: bool = False,
                         dp_replicated_split: bool = False, dp_weights_only: bool = False,
                         ffn_4h: bool = False) -> dict:
    """Bytes one rank sends on ``tp`` and on ``dp`` in one step (ring algorithms, fp32).

    The keyword arguments switch on the classic mistakes (the checker's hints), so
    with the defaults this is the right answer:

    * TP: ``L * M * 4 * 2(T-1)/T * A`` with ``A = s b h * 4`` bytes; with sequence
      parallelism ``L * M * 5 * 2(T-1)/T * A`` (the backward all-gathers the inputs of
      QKV and fc1 again: two more ``(T-1)/T * A`` per block), plus ``2(T-1)/T * 6 h L * 4``
      for the LayerNorm and bias gradients;
    * DP: ``2(D-1)/D * 4 * L * block_params_per_rank(h, ffn, T)``.
    """
    s, b, h, L, M = cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, cfg.num_layers, cfg.num_microbatches
    T, D = cfg.tensor_parallel, cfg.data_parallel
    ffn = 4 * h if ffn_4h else cfg.ffn_hidden_size

    def ring(n):  # bytes sent per byte all-reduced
        if n == 1:
            return 0.0
        return ring_phases * (n - 1) / n if wire else 1.0

    def gather(n):  # bytes sent per byte of an all-gather's result (payload: my 1/n shard)
        if n == 1:
            return 0.0
        return (n - 1) / n if wire else 1.0 / n

    activation = s * b * h * 4
    per_block = (4 if backward else 2) * ring(T) * activation
    if cfg.sequence_parallel and backward and sp_regather:
        per_block += 2 * gather(T) * activation  # QKV's and fc1's saved inputs, gathered again
    if cfg.sequence_parallel and sp_smaller:
        per_block /= T
    tp = L * (M if tp_per_microbatch else 1) * per_block
    if cfg.sequence_parallel if sp_sync is None else sp_sync:
        tp += ring(T) * 6 * h * L * 4
    params = block_params_per_rank(h, ffn, 1 if dp_unsharded else T)
    if dp_replicated_split:  # the replicated 6h divided by T as well
        params = (6 * h + 4 * h * h + 3 * h + 2 * h * ffn + ffn) // T
    if dp_weights_only:
        params = (4 * h * h + 2 * h * ffn) // (1 if dp_unsharded else T)
    dp = ring(D) * 4 * L * params * (M if dp_per_microbatch else 1)
    return {"tp": float(tp), "dp": float(dp)}


#: Wrong answers, by name: the component they get wrong and the mistake's switches.
STEP_MISTAKES = {
    "payload": ("tp", dict(wire=False)),
    "one_phase": ("tp", dict(ring_phases=1)),
    "forward_only": ("tp", dict(backward=False)),
    "tp_once": ("tp", dict(tp_per_microbatch=False)),
    "sp_smaller": ("tp", dict(sp_smaller=True)),
    "sp_no_regather": ("tp", dict(sp_regather=False)),
    "sp_no_sync": ("tp", dict(sp_sync=False)),
    "sp_sync_always": ("tp", dict(sp_sync=True)),
    "dp_payload": ("dp", dict(wire=False)),
    "dp_one_phase": ("dp", dict(ring_phases=1)),
    "dp_per_microbatch": ("dp", dict(dp_per_microbatch=True)),
    "dp_unsharded": ("dp", dict(dp_unsharded=True)),
    "dp_replicated_split": ("dp", dict(dp_replicated_split=True)),
    "dp_weights_only": ("dp", dict(dp_weights_only=True)),
    "ffn_4h": ("dp", dict(ffn_4h=True)),
}


def _step_batch(cfg: StepConfig, dp_rank: int, microbatch: int):
    import torch
    g = torch.Generator().manual_seed(1000 * dp_rank + microbatch)
    shape = (cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def run_training_step(ctx, cfg: StepConfig, bucket_size_bytes: float = 4096):
    """One step on this rank: M microbatches of forward + backward, DP sync, SP sync.

    The model is ``cfg.num_layers`` :class:`~tutorial_lib.transformer.TransformerBlock`
    s in a row, wrapped in :class:`~tutorial_lib.data_parallel.DataParallel`; the loss
    is the mean squared error against a random target.  The groups must already be
    built.  Returns the stack (its gradients are the DP-averaged, SP-summed ones).
    """
    import torch
    import torch.nn.functional as F

    from .. import parallel_state
    from ..data_parallel import DataParallel
    from ..transformer import TransformerBlock, allreduce_sequence_parallel_grads
    T, i = parallel_state.get_size("tp"), parallel_state.get_rank_in("tp")
    stack = torch.nn.Sequential(*[
        TransformerBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size,
                         sequence_parallel=cfg.sequence_parallel, seed=layer)
        for layer in range(cfg.num_layers)])
    model = DataParallel(stack, bucket_size_bytes=bucket_size_bytes)
    model.zero_grad()
    tokens = slice(i * cfg.seq_length // T, (i + 1) * cfg.seq_length // T)
    for m in range(cfg.num_microbatches):
        x, target = _step_batch(cfg, parallel_state.get_rank_in("dp"), m)
        if cfg.sequence_parallel:
            x, target = x[tokens], target[tokens]
        quiet = model.no_sync() if m < cfg.num_microbatches - 1 else nullcontext()
        with ctx.tracer.tags(microbatch=m), quiet:
            loss = F.mse_loss(model(x), target) / cfg.num_microbatches
            loss.backward()
    model.finish_grad_sync()
    if cfg.sequence_parallel:
        allreduce_sequence_parallel_grads(stack)
    return stack


def _step_worker(ctx, configs):
    from .. import parallel_state
    from ..config import ParallelConfig
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=configs[0].tensor_parallel))
    for index, cfg in enumerate(configs):
        with ctx.tracer.tags(config=index):
            run_training_step(ctx, cfg)
    return parallel_state.get_rank_in("tp")


def wire_bytes_by_group(trace, rank: int) -> dict[str, float]:
    """Bytes ``rank`` sent on each group kind, by the ring formulas, from its trace events."""
    from ..costs import ring_bytes_sent
    out: dict[str, float] = {}
    for e in trace.filter(rank=rank, comm_only=True):
        out[e.group_kind] = out.get(e.group_kind, 0.0) + ring_bytes_sent(e.op, e.bytes, len(e.group_ranks))
    return out


@lru_cache(maxsize=None)
def measured_step_bytes(configs: tuple[StepConfig, ...]) -> tuple[dict, ...]:
    """Run :func:`run_training_step` for ``configs`` (one TP x DP world) on real ranks.

    Returns, per config, ``{"tp": bytes, "dp": bytes}`` one rank sent (the same on
    every rank, checked).  Cached: the step sends the same bytes every time.
    """
    cfg = configs[0]
    if any((c.tensor_parallel, c.data_parallel) != (cfg.tensor_parallel, cfg.data_parallel) for c in configs):
        raise ValueError("measured_step_bytes: every config of one launch needs the same TP and DP")
    world = cfg.tensor_parallel * cfg.data_parallel
    out = launch_retrying(_step_worker, world, args=(list(configs),), timeout=120)
    measured = []
    for index in range(len(configs)):
        trace = out.trace.filter(config=index)
        per_rank = [wire_bytes_by_group(trace, r) for r in range(world)]
        per_rank = [{"tp": d.get("tp", 0.0), "dp": d.get("dp", 0.0)} for d in per_rank]
        for r, d in enumerate(per_rank):
            if any(not math.isclose(d[k], per_rank[0][k], rel_tol=1e-9) for k in d):
                raise RuntimeError(f"ranks sent different byte counts in one step: rank 0 {per_rank[0]}, "
                                   f"rank {r} {d}")
        measured.append(per_rank[0])
    return tuple(measured)


def _launch_groups() -> list[tuple[StepConfig, ...]]:
    groups: dict[tuple, list] = {}
    for cfg in STEP_CASES:
        groups.setdefault((cfg.tensor_parallel, cfg.data_parallel), []).append(cfg)
    return [tuple(g) for g in groups.values()]


def _close_bytes(got, want: float) -> bool:
    return is_close(got, want, rel_tol=1e-6, abs_tol=1e-6)


def _same_bytes(got, want) -> bool:
    return isinstance(got, dict) and all(_close_bytes(got.get(k), want[k]) for k in ("tp", "dp"))


def _describe(cfg: StepConfig) -> str:
    return (f"s={cfg.seq_length}, b={cfg.micro_batch_size}, h={cfg.hidden_size}, "
            f"ffn={cfg.ffn_hidden_size}, L={cfg.num_layers}, M={cfg.num_microbatches}, "
            f"T={cfg.tensor_parallel}, D={cfg.data_parallel}, SP={cfg.sequence_parallel}")


def check_step_bytes(fn: Callable) -> CheckResult:
    """Check ``fn(cfg: StepConfig) -> {"tp": bytes, "dp": bytes}`` against traced steps.

    For every configuration in :data:`STEP_CASES` the step of
    :func:`run_training_step` runs on ``T * D`` real ranks; the bytes each rank sent
    on each group are counted from its trace with the ring formulas.
    """
    check = Checking("Exercise 3.3: step_bytes", STEP_HINTS)
    answers = {}
    for cfg in STEP_CASES:  # the student's formula first: a stub costs no launch
        case, got = check.attempt(_describe(cfg), lambda cfg=cfg: fn(cfg), None, compare=lambda *_: True)
        if check.stub:
            check.add(case)
            return check.verdict()
        answers[cfg] = (case, got)
    failing = {"tp": [], "dp": []}  # the TP and the DP part are judged apart
    for configs in _launch_groups():
        try:
            measured = measured_step_bytes(configs)
        except Exception as err:  # noqa: BLE001 - a broken machine is not the student's fault
            for cfg in configs:
                check.add(Case(_describe(cfg), False, f"could not run the step: {err}"))
            continue
        for cfg, want in zip(configs, measured):
            case, got = answers[cfg]
            if isinstance(got, BaseException):  # the formula raised: run_case said so
                check.add(case)
                check.shows({"raised"})
                continue
            if _same_bytes(got, want):
                check.add(Case(_describe(cfg), True))
                continue
            if not isinstance(got, dict) or any(as_number(got.get(k)) is None for k in ("tp", "dp")):
                check.add(Case(_describe(cfg), False, f"got {got!r}, not {{'tp': bytes, 'dp': bytes}}"))
                check.shows({"format"})
                continue
            wrong = [k for k in ("tp", "dp") if not _close_bytes(got[k], want[k])]
            check.add(Case(_describe(cfg), False,
                           f"got {{'tp': {as_number(got['tp']):g}, 'dp': {as_number(got['dp']):g}}}: "
                           f"the traced step sends other {' and '.join(wrong)} bytes"))
            for key in ("tp", "dp"):
                if not _close_bytes(got[key], want[key]):
                    failing[key].append({name for name, (part, switches) in STEP_MISTAKES.items()
                                         if part == key and _close_bytes(
                                             got[key], reference_step_bytes(cfg, **switches)[key])})
    if check.failing:  # a wrong format or an exception: that first
        return check.verdict()
    stage = check.stage
    hints = [STEP_HINTS.hint(failing[key], generic, stage=stage) for key, generic in
             (("tp", (HINT_STEP_TP_NUDGE, HINT_STEP_TP_GENERIC)),
              ("dp", (HINT_STEP_DP_NUDGE, HINT_STEP_DP_GENERIC))) if failing[key]]
    hints = list(dict.fromkeys(hints))  # one mistake (e.g. no ring factor) may explain both
    return check.verdict("\n".join(hints) if hints else (HINT_STEP_TP_NUDGE, HINT_STEP_TP_GENERIC))


__all__ = ["check_row_parallel_linear", "check_gradient_groups", "check_step_bytes",
           "GRADIENT_CASES", "StepConfig", "STEP_CASES", "row_parallel_inputs",
           "reference_step_bytes", "block_params_per_rank", "run_training_step",
           "measured_step_bytes", "wire_bytes_by_group"]
