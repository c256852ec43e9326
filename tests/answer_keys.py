"""The answer keys of every exercise, and the check that a checker never hands them out.

A checker says what is wrong with an answer and why, never the reference's answer
to a case the student has not solved (2.3, 3.2 and 4.2 printed "expected X" for every
failing case, so an empty answer revealed the whole key). :data:`KEYS` lists, for every
exercise of every chapter, its checker, the answers a student might hand in (empty,
constant, typical mistakes) and, per case, the reference answer and how it could be
printed; :func:`assert_keeps_its_key` runs one answer through the checker and fails if

* a failing case's line shows a rendering of that case's reference (one the student's own
  answer to the case would not also produce: echoing the student is allowed),
* anything reads ``expected`` followed by a value,
* a hint line is not one of the checker's fixed hints (so no hint is built from a case's
  answer); the answers-per-situation checkers (2.3, 3.2, 4.2) build theirs, and
  :func:`why_names_the_answer` checks each of those against the situation's answer.

``tests/unit/test_exercises_answer_keys.py`` runs the checkers that start no process,
``tests/dist/test_exercises_answer_keys.py`` the ones that launch gloo workers.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import html
import itertools
import math
import re
from fractions import Fraction
from dataclasses import dataclass, field
from typing import Callable

import torch

from tutorial_lib import moe_balance
from tutorial_lib.context_parallel import held_chunks
from tutorial_lib.exercises import (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09,
                                    ch10, ch11, ch12, ch13, kit)
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.grid import build_grid
from tutorial_lib.pipeline_parallel.actions import Action
from tutorial_lib.pipeline_parallel.schedules import one_f_one_b
from tutorial_lib.pipeline_parallel.zero_bubble import zb_h1

# --- the keys the library does not hold ----------------------------------------------------
# The answers of the exercises whose answer is a choice per situation.  The library keeps the
# statements and only digests of these (kit.answer_digest); tests/unit/test_exercises_answer_keys.py
# checks that the digests are of these answers and that no object reachable from tutorial_lib
# holds them.

COLLECTIVE_KEY = {
    "tp_row_parallel_output": "all_reduce",
    "tp_column_parallel_input_grad": "all_reduce",
    "dp_gradients": "all_reduce",
    "zero_gradients": "reduce_scatter",
    "zero_parameters": "all_gather",
    "moe_dispatch": "all_to_all",
    "pipeline_activations": "send",
    "initial_weights": "broadcast",
}
"""Exercise 2.3: situation -> the collective."""

GROUPS_KEY = {
    "qkv_weight": frozenset({"dp"}),
    "fc2_weight": frozenset({"dp"}),
    "fc2_bias": frozenset({"dp"}),
    "layernorm_weight": frozenset({"dp"}),
    "layernorm_weight_sp": frozenset({"tp", "dp"}),
    "fc2_bias_sp": frozenset({"tp", "dp"}),
    "fc1_weight_sp": frozenset({"dp"}),
    "embedding_weight": frozenset({"dp"}),
}
"""Exercise 3.2: parameter -> the groups its gradient is reduced over."""

DOMAINS_KEY = {
    "router_weight": (frozenset({"dp"}), 8),
    "shared_expert_weight": (frozenset({"dp"}), 8),
    "routed_expert_weight": (frozenset({"expert_dp"}), 8),
    "router_weight_sp": (frozenset({"tp", "dp"}), 4),
    "shared_expert_weight_sp": (frozenset({"dp"}), 4),
    "routed_expert_weight_sp": (frozenset({"expert_dp"}), 4),
}
"""Exercise 4.2: parameter -> (the groups its gradient is summed over, the divisor)."""

CHOICE_KEYS = {"2.3": COLLECTIVE_KEY, "3.2": GROUPS_KEY, "4.2": DOMAINS_KEY}
"""Every key kept out of the library, by exercise."""


# --- how a reference could be printed -----------------------------------------------------


def numbers(value) -> set[str]:
    """The ways a number shows up in text: 1536, 1536.0, 1.54e+03, 0.4286, 1,536, ..."""
    x = float(value)
    out = {repr(x), f"{x:g}", f"{x:.3g}", f"{x:.4g}", f"{x:.6g}", f"{x:.4f}", f"{x:.2f}",
           f"{x:.3f}", f"{x:+.3f}"}
    if x.is_integer():
        out |= {str(int(x)), f"{int(x):,}"}
    return out


def listed(value) -> set[str]:
    """A list of numbers as Python and torch print it, in the given order and sorted."""
    out = set()
    for items in (list(value), sorted(value)):
        out |= {repr(items), repr(tuple(items)), repr([float(v) for v in items])}
    return out


def found(needle: str, text: str) -> bool:
    """``needle`` in ``text`` as a whole token: 24 is not found in 240, 2.4 or B=124."""
    return re.search(rf"(?<![\w.]){re.escape(needle)}(?![\w]|\.\d)", text) is not None


EXPECTED_VALUE = re.compile(r"\bexpected\s*(?:ranks?\s*)?[\[\(\{'\"\d\-]")
"""``expected 24``, ``expected [0, 2]``, ``expected ('dp', 8)``, ``expected rank 1``."""


def output_of(result) -> str:
    """What the student sees: the printed result and the notebook's HTML box, as text."""
    page = html.unescape(re.sub(r"<[^>]+>", " ", result._repr_html_()))
    return f"{result}\n{page}"


# --- one exercise's key -------------------------------------------------------------------


@dataclass
class AnswerKey:
    """One exercise: its checker, answers to try, and what must never be printed."""

    exercise: str
    """Its number, e.g. ``"2.2"``."""
    checker: Callable
    answers: dict[str, Callable]
    """Label -> a student's function: empty, constant, typical mistakes."""
    forbidden: Callable[[str, str, Callable], set[str]]
    """``(case name, the case's detail, the student's fn)`` -> renderings of the case's
    reference that the detail must not contain (the student's own answer's removed)."""
    table: kit.Mistakes | None = None
    """The checker's hints: every hint line must be one of their stages (None: built per
    situation, see :func:`why_names_the_answer`)."""
    launches: bool = False
    """Whether the checker starts gloo workers (tests/dist)."""
    extra_hints: tuple = ()
    """Fixed hints the checker gives besides its table's (3.3's DP part)."""
    marks: list = field(default_factory=list)
    """pytest marks for every run of this key (an xfail for a checker that still leaks)."""
    deadlocking: tuple = ()
    """Labels of answers that deadlock: checked with the launcher timeout
    :data:`DEADLOCK_TIMEOUT`, since the verdict is a deadlock whatever the limit (the
    checker's own limit, and its retry at four times it, would only make them slow)."""

    def options(self, label: str) -> dict:
        """The checker's keywords for the answer ``label``."""
        return {"timeout": DEADLOCK_TIMEOUT} if label in self.deadlocking else {}


DEADLOCK_TIMEOUT = 0.5
"""Seconds before a deadlocking answer's launch is declared deadlocked (then once more at
four times it): the ranks are all blocked by then, a busy machine only delays the report."""


def fixed_hints(table: kit.Mistakes) -> set[str]:
    stages = set(table.generic) | {kit.STUB_HINT}
    for mistake in table:
        stages |= set(mistake.stages)
    return stages


def assert_keeps_its_key(key: AnswerKey, label: str, result=None) -> None:
    """Run the answer ``label`` through the checker (or read ``result``, a verdict it already
    gave) and fail if the verdict shows a failing case's answer, an ``expected <value>`` or a
    hint that is not one of the checker's."""
    fn = key.answers[label]
    result = key.checker(fn, **key.options(label)) if result is None else result
    shown = output_of(result)
    assert not result.passed, f"{key.exercise} {label}: the wrong answer passed"
    assert not EXPECTED_VALUE.search(shown), f"{key.exercise} {label}: {shown}"
    for case in result.cases:
        if case.passed:
            continue
        for text in key.forbidden(case.name, case.detail, fn):
            assert not found(text, case.detail), \
                f"{key.exercise} {label}: case {case.name!r} shows its answer {text!r}: {case.detail}"
    if key.table is not None:
        allowed = fixed_hints(key.table) | set(key.extra_hints)
        for line in result.hints:
            assert any(line == h or line.startswith(h + " (") for h in allowed), \
                f"{key.exercise} {label}: a hint that is not one of the checker's: {line!r}"


def own(fn: Callable, *args):
    """The student's own answer to one case (None if it raises)."""
    try:
        return fn(*args)
    except BaseException:  # noqa: BLE001 - a raising answer has nothing of its own to show
        return None


def number_forbidden(reference: float, mine) -> set[str]:
    mine = kit.as_number(mine)
    return numbers(reference) - (numbers(mine) if mine is not None else set())


def raising(*args, **kwargs):
    raise ValueError("a broken answer")


# --- chapter 1 ------------------------------------------------------------------------------

_RANK = re.compile(r"^rank (\d+):")


def _rank_in(detail: str) -> int | None:
    match = _RANK.match(detail)
    return int(match.group(1)) if match else None


def _coords_cases() -> dict[str, tuple]:
    out = {}
    for order, sizes in ch01.RANK_TO_COORDS_SHAPES:
        given = {d: sizes[d] for d in sorted(sizes)}
        out[f"order {order!r}, sizes {given}"] = (order, given)
    return out


def _coords_forbidden(name, detail, fn):
    order, sizes = _coords_cases()[name]
    rank = _rank_in(detail)
    if rank is None:
        return set()
    want = ch01._reference_coords(order, sizes)[rank]
    mine = own(fn, rank, order, dict(sizes))
    renders = {repr(want), repr({d: want[d] for d in sorted(want)})}
    return renders - ({repr(mine)} if mine is not None else set())


def _dp_cases() -> dict[str, tuple]:
    return {f"world_size={w}, tp={t}, pp={p}, cp={c}": (w, t, p, c)
            for w, t, p, c in ch01.DATA_PARALLEL_SHAPES}


def _dp_forbidden(name, detail, fn):
    world, tp, pp, cp = _dp_cases()[name]
    rank = _rank_in(detail)
    if rank is None:
        return set()
    want = sorted(build_grid(world, tp=tp, pp=pp, cp=cp, layout="megatron").group_of("dp", rank))
    mine = own(fn, rank, world, tp, pp, cp)
    return listed(want) - (listed(mine) if isinstance(mine, (list, tuple)) else set())


def _dp_group(rank, world, tp, pp, cp=1):
    dp = world // (tp * cp * pp)
    tp_i, cp_i, pp_i = rank % tp, (rank // tp) % cp, rank // (tp * cp * dp)
    return [tp_i + tp * (cp_i + cp * (d + dp * pp_i)) for d in range(dp)]


# --- chapter 2 ------------------------------------------------------------------------------


def _ring_bytes_forbidden(name, detail, fn):
    b, n = (int(v) for v in re.match(r"B=(\d+) bytes, N=(\d+) ranks", name).groups())
    return number_forbidden(2 * (n - 1) * b / n, own(fn, b, n))


def _all_gather_forbidden(name, detail, fn):
    n = int(re.match(r"world_size=(\d+)", name).group(1))
    rows = dict(ch02.ALL_GATHER_CASES)[n]
    gathered = torch.cat([ch02.chunk_of(r, rows) for r in range(n)])
    return {str(gathered), repr(gathered.tolist())}


def _op_spellings(op: str) -> set[str]:
    words = op.split("_")
    return {op, "-".join(words), " ".join(words), "".join(words), "".join(w.title() for w in words)}


def _choice_forbidden(name, detail, fn):
    if name not in COLLECTIVE_KEY:
        return set()
    return _op_spellings(COLLECTIVE_KEY[name])


def _ring_without_wrapping(ctx, chunk):
    """A ring all-gather that forgets the ring wraps around: rank 0 receives from rank -1
    and the last rank sends to rank N, which the traced ops refuse (a rank raises: no named
    mistake, the generic hint)."""
    from tutorial_lib import comm
    i, n = ctx.rank, ctx.world_size
    chunks, current = {i: chunk}, chunk
    for step in range(n - 1):
        incoming = torch.empty_like(chunk)
        comm.wait_all([comm.isend(current, i + 1), comm.irecv(incoming, i - 1)])
        chunks[i - step - 1] = current = incoming
    return torch.cat([chunks[r] for r in range(n)])


# --- chapter 3 ------------------------------------------------------------------------------


def _groups_forbidden(name, detail, fn):
    if name not in GROUPS_KEY:
        return set()
    want = GROUPS_KEY[name]
    return {repr(sorted(want)), repr(set(want)), repr(frozenset(want))}


def _step_forbidden(name, detail, fn):
    cfg = next(c for c in ch03.STEP_CASES if ch03._describe(c) == name)
    want = ch03.reference_step_bytes(cfg)
    mine = own(fn, cfg)
    out = set()
    for part in ("tp", "dp"):
        mine_part = mine.get(part) if isinstance(mine, dict) else None
        if kit.as_number(mine_part) is None or not math.isclose(kit.as_number(mine_part), want[part],
                                                                 rel_tol=1e-6, abs_tol=1e-6):
            out |= number_forbidden(want[part], mine_part)
    return {t for t in out if t not in ("0", "0.0")}  # T = 1 or D = 1: zero bytes, not a secret


def _row_forbidden(name, detail, fn):
    reference = ch03._serial_row_reference(0)
    return {str(reference["y"]), repr(reference["y"].tolist())}


# --- chapter 4 ------------------------------------------------------------------------------


def _splits_forbidden(name, detail, fn):
    case = next(c for c in ch04.send_splits_cases() if c[0] == name)
    _, topk_idx, num_experts, ep = case
    want = ch04.reference_send_splits(topk_idx, num_experts, ep)
    mine = kit.as_whole_numbers(own(fn, topk_idx.clone(), num_experts, ep))
    return listed(want) - (listed(mine) if mine is not None else set())


def _domains_forbidden(name, detail, fn):
    if name not in DOMAINS_KEY:
        return set()
    want, divisor = DOMAINS_KEY[name]
    return {f"({sorted(want)}, {divisor})", f"({set(want)!r}, {divisor})"}


def _layer_bytes_cases() -> dict[str, tuple]:
    out = {}
    for name, routings in ch04.bytes_cases():
        counts = ch04.send_count_matrix(routings)
        for rank in range(len(routings)):
            out[f"{name}, rank {rank}"] = (counts, rank)
    return out


def _layer_bytes_forbidden(name, detail, fn):
    counts, rank = _layer_bytes_cases()[name]
    want = ch04.reference_layer_bytes_sent(counts, rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS, 4)
    mine = own(fn, [list(r) for r in counts], rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS, 4)
    return number_forbidden(want, mine)


# --- chapter 5 ------------------------------------------------------------------------------


def _loss_forbidden(name, detail, fn):
    _, probs, topk_idx, n, k = next(c for c in ch05.loss_cases() if c[0] == name)
    want = float(moe_balance.expert_balance_loss(probs, topk_idx, n, k))
    mine = own(fn, probs.clone().requires_grad_(True), topk_idx.clone(), n, k)
    mine = float(mine.detach()) if isinstance(mine, torch.Tensor) and mine.numel() == 1 else mine
    return number_forbidden(want, mine)


def _topk_forbidden(name, detail, fn):
    _, scores, bias, k = next(c for c in ch05.topk_cases() if c[0] == name)
    idx, gates = ch05.reference_topk(scores, k, bias.detach())
    return {str(idx), repr(idx.tolist()), repr(gates.detach().tolist())}


def _update_forbidden(name, detail, fn):
    direct = {c[0]: c for c in ch05.update_cases()}
    if name in direct:
        _, bias, load, gamma = direct[name]
        want = ch05.update_variant(bias, load, gamma)
        return {repr([round(v, 6) for v in want.tolist()]), repr(want.tolist())}
    first, settled, bias = ch05._simulated(None)
    return {f"{settled:.2f}", f"{bias[0].item():+.3f}"}


# --- chapter 6 ------------------------------------------------------------------------------


def _one_f_one_b_forbidden(name, detail, fn):
    pp, m = (int(v) for v in re.match(r"PP=(\d+), M=(\d+)", name).groups())
    rank = _rank_in(detail)
    if rank is None:
        return set()
    want = " ".join(a.label for a in one_f_one_b(pp, m, rank) if a.is_compute)
    mine = own(fn, pp, m, rank)
    mine = " ".join(a.label for a in mine if isinstance(a, Action) and a.is_compute) \
        if isinstance(mine, list) else None
    return set() if want == mine else {want, f"expected rank"}


def _bubble_forbidden(name, detail, fn):
    pp, m, v = (int(x) for x in re.match(r"PP=(\d+), M=(\d+), V=(\d+)", name).groups())
    _, value = ch06.stated_bubble(own(fn, pp, m, v))
    out = set()
    for definition in ch06.BUBBLE_DEFINITIONS.values():
        out |= number_forbidden(definition(pp, m, v), value)
    return {t for t in out if t not in ("0", "0.0", "0.00", "0.000", "0.0000")}  # PP = 1: no bubble


def _holdings_forbidden(name, detail, fn):
    layers, pp, v, rank = (int(x) for x in
                           re.match(r"L=(\d+), PP=(\d+), V=(\d+), rank (\d+)", name).groups())
    want = ch06.stage_holdings(layers, pp, v, rank)
    mine = own(fn, layers, pp, v, rank)
    mine_layers = mine.get("layers") if isinstance(mine, dict) else None
    mine_layers = list(mine_layers) if isinstance(mine_layers, (list, tuple, range)) else None
    return (listed(want["layers"]) - (listed(mine_layers) if mine_layers else set())) | {repr(want)}


# --- chapter 11 -----------------------------------------------------------------------------


def _place_weights_forbidden(name, detail, fn):
    """ZB-H1's compute order of the rank named, unless it is the student's own."""
    pp, m = (int(v) for v in re.match(r"PP=(\d+), M=(\d+)", name).groups())
    rank = _rank_in(detail)
    ranks = range(pp) if rank is None else [rank]
    out = set()
    for r in ranks:
        want = " ".join(a.label for a in zb_h1(pp, m, r) if a.is_compute)
        mine = own(fn, pp, m, r)
        mine = " ".join(a.label for a in mine if isinstance(a, Action) and a.is_compute) \
            if isinstance(mine, list) else None
        if want != mine:
            out.add(want)
    return out


def _idle_forbidden(name, detail, fn):
    """The simulated idle time of the schedule the case names (not the student's value)."""
    pp, f, b, w = re.match(r"pp=(\d+), f=([\d/]+), b=([\d/]+), w=([\d/]+)", name).groups()
    costs = [Fraction(x) for x in (f, b, w)]
    want = ch11.simulated_idle_times(int(pp), *costs)
    schedule = name.split(": ")[-1] if ": " in name else None
    mine = own(fn, int(pp), *costs)
    out = set()
    for key, value in want.items():
        if schedule not in (None, key):
            continue
        theirs = mine.get(key) if isinstance(mine, dict) else None
        out |= number_forbidden(float(value), kit.as_number(theirs))
    return {t for t in out if t not in ("0", "0.0", "0.00", "0.000", "0.0000")}


# --- chapter 7 ------------------------------------------------------------------------------


def _fix_forbidden(name, detail, fn):
    pp = int(re.match(r"PP=(\d+)", name).group(1))
    out = set()
    for stage in ch07._expected_fix(pp):
        out |= {repr(v) for v in stage.values() if v is not None}
    echoed = re.match(r"stage \d+ of \d+ returned ([^,:;]+)", detail)  # the student's own value
    return out - ({echoed.group(1)} if echoed else set())


def _mode_forbidden(name, detail, fn):
    match = re.match(r"interleaved=(\w+), no_overlap_flag=(\w+), nvlink=(\w+)", name)
    interleaved, flag, nvlink = (v == "True" for v in match.groups())
    return {repr(ch07.megatron_training_mode(interleaved, flag))}


def _exchanges_but_returns_what_it_sent(tensor, shape, dtype=torch.float32):
    from tutorial_lib import comm, p2p
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype=dtype)
    comm.wait_all(comm.batch_isend_irecv([("send", tensor, peer), ("recv", buffer, peer)], group="pp"))
    return tensor


def _buffer_with_dtype_as_a_size(tensor, shape, dtype=torch.float32):
    """Exchanges with the next stage, but passes the dtype where torch.empty takes sizes:
    torch raises on every stage that has a next one (no named mistake: the generic hint)."""
    from tutorial_lib import comm, p2p
    peer = p2p.next_rank()
    if peer is None:
        return None
    buffer = torch.empty(shape, dtype)
    comm.wait_all(comm.batch_isend_irecv([("send", tensor, peer), ("recv", buffer, peer)], group="pp"))
    return buffer


def _off_by_one_gradient(tensor, shape, dtype=torch.float32):
    """Exchanges with the next stage, then returns what it received plus one: a gradient
    filled with another stage's number (and zeros on the last stage)."""
    from tutorial_lib import comm, p2p
    peer = p2p.next_rank()
    if peer is None:
        return torch.zeros(shape, dtype=dtype)
    buffer = torch.empty(shape, dtype=dtype)
    comm.wait_all(comm.batch_isend_irecv([("send", tensor, peer), ("recv", buffer, peer)], group="pp"))
    return buffer + 1


# --- chapter 8 ------------------------------------------------------------------------------


def _quantize_forbidden(name, detail, fn):
    from tutorial_lib import fp8
    x = dict(ch08.quantize_cases())[name]
    _, scales = fp8.quantize_1x128(x)
    return {repr(scales.flatten()[:3].tolist())}


def _payload_forbidden(name, detail, fn):
    case = next(c for c in ch08.payload_cases() if c[0] == name)
    want = ch08.reference_payload_bytes(*case[1:])
    return number_forbidden(want, own(fn, *case[1:]))


# --- chapter 9 ------------------------------------------------------------------------------


def _merge_forbidden(name, detail, fn):
    _, parts, want, want_lse = next(c for c in ch09.merge_cases() if c[0] == name)
    return {str(want), str(want_lse)}


def _held_forbidden(name, detail, fn):
    r, size = (int(v) for v in re.match(r"rank (\d+) of CP (\d+)", name).groups())
    want = list(held_chunks(r, size))
    mine = kit.as_whole_numbers(own(fn, r, size))
    return listed(want) - (listed(mine) if mine is not None else set())


def _ring_forbidden(name, detail, fn):
    b, h, s, d, size, e = next(c for c in ch09.RING_CASES
                               if name == f"b={c[0]}, h={c[1]}, s={c[2]}, d={c[3]}, CP={c[4]}, "
                                          f"{c[5]} B/element")
    return number_forbidden(ch09.reference_ring_pass_bytes(b, h, s, d, size, e),
                            own(fn, b, h, s, d, size, e))


# --- chapter 12 -----------------------------------------------------------------------------


def _state_forbidden(name, detail, fn):
    case = next(c for c in ch12.STATE_CASES if name == f"{len(c[0])} units, DP {c[1]}, {c[2]}")
    units, dp, strategy = case
    return number_forbidden(ch12.reference_state_bytes(units, dp, strategy),
                            own(fn, list(units), dp, strategy))


def _gathers_forbidden(name, detail, fn):
    case = next(c for c in ch12.GATHER_CASES
                if name == f"{c[0]} blocks, prefetch={c[1]}, reshard_root={c[2]}")
    want = ch12.reference_backward_gathers(*case)
    if ch12._read_gathers(own(fn, *case) or []) == want:
        return set()
    return {repr(want), repr(tuple(want)), ", ".join(unit for unit, _ in want)}


# --- chapter 13 -----------------------------------------------------------------------------


def _pick_forbidden(name, detail, fn):
    _, model, gpu, nodes, batch = next(c for c in ch13.PICK_CASES if c[0] == name)
    where = cluster(gpu)
    gpus = nodes * where.gpus_per_node
    best = ch13.reference_pick_layout(model, where, gpus, batch)
    mine = ch13._read_layout(own(fn, model, where, gpus, batch))
    shown = {best.describe()} if mine != best else set()
    return shown | numbers(ch13.best_step_time(model, where, gpus, batch))


def _tp_forbidden(name, detail, fn):
    _, model, gpu, per_node, gpus, batch = next(c for c in ch13.TP_CASES if c[0] == name)
    where = cluster(gpu, gpus_per_node=per_node)
    return number_forbidden(ch13.reference_tp_stops_paying(model, where, gpus, batch),
                            own(fn, model, where, gpus, batch))


# --- chapter 10 -----------------------------------------------------------------------------


def _layer_forbidden(name, detail, fn):
    case = next(c for c in ch10.LAYER_CASES
                if name == f"s={c[0]}, b={c[1]}, h={c[2]}, heads={c[3]}, ffn={c[4]}, TP={c[5]}")
    return number_forbidden(ch10.reference_dense_layer_bytes(*case), own(fn, *case))


def _layout_forbidden(name, detail, fn):
    budget = int(re.match(r"budget (\d+) GiB", name).group(1))
    tp, pp = ch10.reference_smallest_layout(budget)
    mine = own(fn, budget)
    if kit.as_whole_numbers(mine) == [tp, pp]:
        return set()
    return {f"TP {tp} x PP {pp}", f"({tp}, {pp})", f"tp={tp}, pp={pp}"}


# --- every exercise -------------------------------------------------------------------------


KEYS = [
    AnswerKey("1.1", ch01.check_rank_to_coords, {
        "empty": lambda rank, order, sizes: None,
        "constant": lambda rank, order, sizes: {d: 0 for d in order.split("-")},
        "slowest_first": lambda rank, order, sizes: ch01._slowest_first_coords(order, sizes)[rank],
        "raises": raising,
    }, _coords_forbidden, ch01.COORDS_MISTAKES),
    AnswerKey("1.2", ch01.check_data_parallel_group, {
        "empty": lambda *a: [],
        "constant": lambda rank, world, tp, pp, cp=1: [0],
        "forgot_cp": lambda rank, world, tp, pp, cp=1: _dp_group(rank, world, tp, pp, 1),
        "same_rank_mod_tp": lambda rank, world, tp, pp, cp=1: [r for r in range(world) if r % tp == rank % tp],
    }, _dp_forbidden, ch01.DATA_PARALLEL_MISTAKES),
    AnswerKey("2.1", ch02.check_ring_all_gather, {
        "empty": lambda ctx, chunk: None,
        "own_chunk_only": lambda ctx, chunk: chunk,
        "no_wrap": _ring_without_wrapping,
    }, _all_gather_forbidden, ch02.ALL_GATHER_MISTAKES, launches=True),
    AnswerKey("2.2", ch02.check_ring_all_reduce_bytes, {
        "empty": lambda nbytes, n: None,
        "constant": lambda nbytes, n: 0,
        **{name: (lambda wrong: lambda nbytes, n: wrong(nbytes, n))(wrong)
           for name, wrong in ch02.RING_BYTES_MISTAKES.items()},
    }, _ring_bytes_forbidden, ch02.RING_BYTES_HINTS, launches=True),
    AnswerKey("2.3", ch02.check_choose_collectives, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(ch02.SCENARIOS, "all_reduce"),
        "broadcast_everywhere": lambda: dict.fromkeys(ch02.SCENARIOS, "broadcast"),
        "not_a_dict": lambda: None,
    }, _choice_forbidden),
    AnswerKey("3.1", ch03.check_row_parallel_linear, {
        "empty": lambda x, weight, bias: None,
        "no_reduce": lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias),
        "forgot_transpose": lambda x, weight, bias: x @ weight + bias,
    }, _row_forbidden, ch03.ROW_MISTAKES, launches=True),
    AnswerKey("3.2", ch03.check_gradient_groups, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(ch03.GRADIENT_CASES, "world"),
        "nothing": lambda: dict.fromkeys(ch03.GRADIENT_CASES, set()),
        "tp_everywhere": lambda: dict.fromkeys(ch03.GRADIENT_CASES, {"tp", "dp"}),
    }, _groups_forbidden),
    AnswerKey("3.3", ch03.check_step_bytes, {
        "empty": lambda cfg: None,
        "constant": lambda cfg: {"tp": 0, "dp": 0},
        **{name: (lambda switches: lambda cfg: ch03.reference_step_bytes(cfg, **switches))(switches)
           for name, (_, switches) in ch03.STEP_MISTAKES.items()
           if name in ("payload", "forward_only", "dp_replicated_split")},
    }, _step_forbidden, ch03.STEP_HINTS, launches=True,
        extra_hints=(ch03.HINT_STEP_DP_NUDGE, ch03.HINT_STEP_DP_GENERIC)),
    AnswerKey("4.1", ch04.check_send_splits, {
        "empty": lambda topk_idx, n, ep: [],
        "constant": lambda topk_idx, n, ep: [0] * ep,
        "round_robin": lambda topk_idx, n, ep: ch04._splits_mistakes(topk_idx, n, ep)["round_robin"],
        "tokens": lambda topk_idx, n, ep: ch04._splits_mistakes(topk_idx, n, ep)["tokens"],
    }, _splits_forbidden, ch04.SPLITS_HINTS),
    AnswerKey("4.2", ch04.check_gradient_domains, {
        "empty": lambda: {},
        "constant": lambda: dict.fromkeys(ch04.GRADIENT_DOMAIN_CASES, ({"world"}, 1)),
        "expert_dp_everywhere": lambda: dict.fromkeys(ch04.GRADIENT_DOMAIN_CASES, ({"expert_dp"}, 2)),
        "dp_by_one": lambda: dict.fromkeys(ch04.GRADIENT_DOMAIN_CASES, ({"dp"}, 1)),
    }, _domains_forbidden),
    AnswerKey("4.3", ch04.check_layer_bytes_sent, {
        "empty": lambda *a: None,
        "constant": lambda *a: 0,
        **{name: (lambda switches: lambda c, r, h, n, d: ch04.reference_layer_bytes_sent(
            c, r, h, n, d, **switches))(switches)
           for name, switches in ch04.BYTES_MISTAKES.items() if name in ("diagonal_rows", "forward_only")},
    }, _layer_bytes_forbidden, ch04.BYTES_HINTS, launches=True),
    AnswerKey("5.1", ch05.check_expert_balance_loss, {
        "empty": lambda *a: None,
        "constant": lambda probs, *a: probs.sum() * 0 + 1,
        **{m: (lambda m: lambda p, t, n, k: ch05.expert_loss_variant(p, t, n, k, m))(m)
           for m in ("no_scale", "gates")},
    }, _loss_forbidden, ch05.LOSS_HINTS),
    AnswerKey("5.2", ch05.check_biased_topk, {
        "empty": lambda *a: None,
        "ignores_bias": lambda s, k, b: ch05.topk_variant(s, k, b, "ignores_bias"),
        "biased_gates": lambda s, k, b: ch05.topk_variant(s, k, b, "biased_gates"),
    }, _topk_forbidden, ch05.TOPK_HINTS),
    AnswerKey("5.3", ch05.check_update_bias, {
        "does_nothing": lambda b, load, gamma: b,
        "flipped": lambda b, load, gamma: ch05.update_variant(b, load, gamma, "flipped"),
        "constant": lambda b, load, gamma: torch.zeros_like(b) + 1,
    }, _update_forbidden, ch05.UPDATE_HINTS),
    AnswerKey("6.1", ch06.check_one_f_one_b, {
        "empty": lambda pp, m, rank: [],
        "gpipe": lambda pp, m, rank: [Action("forward", i) for i in range(m)]
        + [Action("backward", i) for i in range(m)],
        "warmup_everywhere": lambda pp, m, rank: one_f_one_b(pp, m, 0),
    }, _one_f_one_b_forbidden, ch06.ONE_F_ONE_B_HINTS),
    AnswerKey("6.2", ch06.check_bubble, {
        "empty": lambda pp, m, v: None,
        "constant": lambda pp, m, v: 0.5,
        "idle_over_work": lambda pp, m, v: (pp - 1) / (v * m),
        "forgot_v": lambda pp, m, v: (pp - 1) / (m + pp - 1),
    }, _bubble_forbidden, ch06.BUBBLE_HINTS),
    AnswerKey("6.3", ch06.check_stage_holdings, {
        "empty": lambda *a: {},
        "constant": lambda layers, pp, v, rank: {"layers": [], "embedding": False, "head": False,
                                                 "labels": None},
        "contiguous": lambda layers, pp, v, rank: {
            **ch06.stage_holdings(layers, pp, v, rank),
            "layers": list(range(rank * layers // pp, (rank + 1) * layers // pp))},
    }, _holdings_forbidden, ch06.HOLDINGS_HINTS),
    AnswerKey("7.1", ch07.check_send_forward_recv_backward, {
        "returns_what_it_sent": _exchanges_but_returns_what_it_sent,
        "wrong_stage_gradient": _off_by_one_gradient,
        "empty": lambda tensor, shape, dtype=torch.float32: None,
        "dtype_as_a_size": _buffer_with_dtype_as_a_size,
    }, _fix_forbidden, ch07.FIX_HINTS, launches=True, deadlocking=("empty",)),
    AnswerKey("7.2", ch07.check_send_first, {
        "always": lambda stage, pp, helper: True,
        "never": lambda stage, pp, helper: False,
        "parity_as_a_number": lambda stage, pp, helper: stage % 2,
    }, lambda *a: set(), ch07.ORDER_HINTS, launches=True, deadlocking=("always", "never")),
    AnswerKey("7.3", ch07.check_megatron_p2p_mode, {
        "empty": lambda *a: None,
        "constant": lambda *a: "sequential",
        "nvlink": lambda interleaved, flag, nvlink: "overlapped" if nvlink else "batched",
    }, _mode_forbidden, ch07.MODE_HINTS),
    AnswerKey("8.1", ch08.check_quantize_1x128, {
        "per_tensor": lambda x: ch08._quantize_mistakes(x)["per_tensor"],
        "empty": lambda x: None,
        "constant": lambda x: (torch.zeros_like(x), torch.ones(x.shape[0], x.shape[1] // 128)),
        "no_clamp": lambda x: ch08._quantize_mistakes(x)["no_clamp"],
    }, _quantize_forbidden, ch08.QUANTIZE_HINTS),
    AnswerKey("8.2", ch08.check_payload_bytes, {
        "empty": lambda *a: None,
        "constant": lambda *a: 0,
        "bits": lambda t, k, h, p: 8 * ch08.reference_payload_bytes(t, k, h, p),
    }, _payload_forbidden, ch08.PAYLOAD_HINTS),
    AnswerKey("8.3", ch08.check_keep_ends_in_bf16, {
        "empty": lambda base, n: None,
        "unchanged": lambda base, n: base,
        "ends_first": lambda base, n: dataclasses.replace(
            base, rules=[("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")] + list(base.rules)),
    }, lambda *a: set(), ch08.ENDS_HINTS),
    AnswerKey("9.1", ch09.check_merge_partials, {
        "empty": lambda *a: None,
        "average": lambda a, la, b, lb: ((a + b) / 2, torch.logaddexp(la, lb)),
    }, _merge_forbidden, ch09.MERGE_HINTS),
    AnswerKey("9.2", ch09.check_held_chunks, {
        "empty": lambda r, c: [],
        "constant": lambda r, c: [0, 1],
        "naive": lambda r, c: [r],
        "striped": lambda r, c: [r, r + c],
    }, _held_forbidden, ch09.HELD_HINTS),
    AnswerKey("9.3", ch09.check_ring_pass_bytes, {
        "empty": lambda *a: None,
        "constant": lambda *a: 1,
        "steps": lambda b, h, s, d, c, e: c * 2 * b * h * (s // c) * d * e,
        "bits": lambda b, h, s, d, c, e: 8 * (c - 1) * 2 * b * h * (s // c) * d * e,
    }, _ring_forbidden, ch09.RING_HINTS),
    AnswerKey("10.1", ch10.check_dense_layer_bytes, {
        "empty": lambda *a: None,
        "constant": lambda *a: 1,
        "values": lambda *a: ch10.reference_dense_layer_bytes(*a) // 4,
        "norms_split": lambda *a: ch10._layer_mistakes(*a)["norms_split"],
    }, _layer_forbidden, ch10.LAYER_HINTS),
    AnswerKey("10.2", ch10.check_smallest_layout, {
        "empty": lambda budget: None,
        "largest": lambda budget: (8, 16),
        "first_tp": lambda budget: (1, 16),
    }, _layout_forbidden, ch10.FIT_HINTS),
    AnswerKey("11.1", ch11.check_place_weights, {
        "empty": lambda pp, m, rank: [],
        "plain_1f1b": lambda pp, m, rank: one_f_one_b(pp, m, rank),
        "right_after": lambda pp, m, rank: [x for a in one_f_one_b(pp, m, rank) for x in (
            [a, Action("weight", a.microbatch)] if a.kind == "backward" else [a])],
        "all_at_the_end": lambda pp, m, rank: one_f_one_b(pp, m, rank)
        + [Action("weight", i) for i in range(m)],
    }, _place_weights_forbidden, ch11.PLACE_HINTS),
    AnswerKey("11.2", ch11.check_idle_times, {
        "empty": lambda *a: None,
        "constant": lambda *a: {k: 1 for k in ("1f1b", "zb-h1", "dualpipev", "dualpipe")},
        "stages_as_ranks": lambda pp, f, b, w: {
            "1f1b": (pp - 1) * (f + b), "zb-h1": (pp - 1) * (f + b),
            "dualpipev": (pp - 1) * (f + b + b - 3 * w),
            "dualpipe": (pp - 1) * (f + b + b - 3 * w)},
    }, _idle_forbidden, ch11.IDLE_HINTS),
    AnswerKey("12.1", ch12.check_state_bytes, {
        "empty": lambda *a: None,
        "constant": lambda *a: 1,
        "no_padding": lambda u, dp, s: ch12._state_mistakes(u, dp, s)["padding"],
        "no_master": lambda u, dp, s: ch12._state_mistakes(u, dp, s)["master"],
    }, _state_forbidden, ch12.STATE_HINTS),
    AnswerKey("12.2", ch12.check_backward_gathers, {
        "empty": lambda *a: [],
        "forward_order": lambda n, p, r: ch12._gather_mistakes(n, p, r)["forward_order"],
        "root_last": lambda n, p, r: ch12._gather_mistakes(n, p, r)["root_last"],
        "flags": lambda n, p, r: ch12._gather_mistakes(n, p, r)["flags"],
    }, _gathers_forbidden, ch12.GATHER_HINTS),
    AnswerKey("13.1", ch13.check_pick_layout, {
        "empty": lambda *a: None,
        "dp_alone": lambda m, w, g, b: {"tp": 1, "pp": 1, "dp": g},
        "one_node": lambda m, w, g, b: {"tp": 1, "pp": 1, "dp": w.gpus_per_node},
    }, _pick_forbidden, ch13.PICK_HINTS),
    AnswerKey("13.2", ch13.check_tp_stops_paying, {
        "empty": lambda *a: None,
        "constant": lambda *a: 2,
        "fastest": lambda m, w, g, b: ch13._tp_mistakes(m, w, g, b)["fastest"],
        "leaves": lambda m, w, g, b: ch13._tp_mistakes(m, w, g, b)["leaves"],
    }, _tp_forbidden, ch13.TP_HINTS),
]
"""Every exercise of chapters 1-13, in order."""


def key_params(*, launching: bool):
    """``pytest.param(key, answer label)`` for every key that does (or does not) launch."""
    import pytest
    return [pytest.param(key, label, id=f"{key.exercise}-{label}", marks=key.marks)
            for key in KEYS if key.launches == launching for label in key.answers]


# --- the answers-per-situation checkers: every wrong answer's reason ---------------------------


def why_names_the_answer(why: str, answer_texts: set[str]) -> str | None:
    """The first of ``answer_texts`` that ``why`` contains, or None."""
    return next((t for t in answer_texts if found(t, why)), None)


ALL_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")


def collective_whys() -> list[tuple[str, str, str, set[str]]]:
    """(situation, wrong op, every stage of its reason, the answer's spellings)."""
    out = []
    for situation, answer in COLLECTIVE_KEY.items():
        for op in ALL_OPS:
            if op == answer:
                continue
            _, why = ch02._judge_collective(situation, op)
            spellings = _op_spellings(answer) | ({"point-to-point"} if answer == "send" else set())
            for stage in kit.stages_of(why):
                if all(why_names_the_answer(stage, _op_spellings(o)) for o in ALL_OPS):
                    continue  # it names every collective alike: no answer in that
                out.append((situation, op, stage, spellings))
    return out


def _set_texts(want: frozenset, given: frozenset) -> set[str]:
    """How a right set of groups could be named: the set itself, each group the student left
    out in quotes ('dp'), and expert_dp even bare (no other word reads like it)."""
    missing = want - given
    return ({repr(sorted(want)), repr(set(want))} | {f"'{g}'" for g in missing}
            | ({"expert_dp"} & missing))


GROUP_CHOICES = [frozenset(c) for n in range(3) for c in
                 itertools.combinations(("tp", "dp", "pp", "world"), n)]


def group_whys() -> list[tuple[str, frozenset, str, set[str]]]:
    """(case, wrong groups, every stage of its reason, the right set's spellings) for 3.2."""
    out = []
    for case, want in GROUPS_KEY.items():
        for given in GROUP_CHOICES:
            if given == want:
                continue
            why = ch03._why_groups_wrong(case, given, want)
            texts = _set_texts(want, given)
            out += [(case, given, stage, texts) for stage in kit.stages_of(why)]
    return out


DOMAIN_CHOICES = [frozenset(c) for n in range(3) for c in
                  itertools.combinations(("tp", "dp", "ep", "expert_dp", "pp", "world"), n)]


def domain_whys() -> list[tuple[str, tuple, str, set[str]]]:
    """(case, wrong (groups, divisor), every stage of its reason, the answer's texts) for 4.2."""
    out = []
    for case, (want, divisor) in DOMAINS_KEY.items():
        tp, ep, dp, edp = ch04.GRADIENT_DOMAIN_GRIDS[case]
        for given, number in itertools.product(DOMAIN_CHOICES + [want], (1, 2, 4, 8, 16, tp * dp)):
            if given == want and number == divisor:
                continue
            why = ch04._why_domain_wrong(case, given, number, want, divisor)
            texts = (_set_texts(want, given) if given != want else set()) | (
                {str(divisor)} if number != divisor else set())
            out += [(case, (given, number), stage, texts) for stage in kit.stages_of(why)]
    return out


# --- no key readable off the library ---------------------------------------------------------


def library_objects():
    """Every object a student's kernel can reach from ``tutorial_lib`` without calling
    anything: the globals of every submodule, and inside them, recursively, the items of
    containers, the attributes of the library's classes and instances, and the defaults,
    closure cells, wrapped functions and code constants of functions.  Yields each object
    once; the modules that do not import here are listed in ``library_objects.skipped``."""
    import importlib
    import inspect
    import pkgutil

    import tutorial_lib

    names = ["tutorial_lib"] + [m.name for m in pkgutil.walk_packages(tutorial_lib.__path__,
                                                                       "tutorial_lib.")]
    todo, skipped = [], []
    for name in names:
        try:
            todo += list(vars(importlib.import_module(name)).values())
        except Exception as err:  # noqa: BLE001 - what does not import cannot be read either
            skipped.append(f"{name}: {type(err).__name__}")
    library_objects.skipped = skipped

    def ours(obj) -> bool:
        return (getattr(obj, "__module__", None) or "").startswith("tutorial_lib")

    seen = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or inspect.ismodule(obj):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif isinstance(obj, (staticmethod, classmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo += [obj.fget, obj.fset]
        elif inspect.iscode(obj):
            todo += list(obj.co_consts)
        elif callable(obj) and hasattr(obj, "__code__"):
            todo += [obj.__code__, obj.__defaults__, obj.__kwdefaults__,
                     getattr(obj, "__wrapped__", None), getattr(obj, "__dict__", None)]
            todo += [cell.cell_contents for cell in (obj.__closure__ or ())
                     if _filled(cell)]
        elif hasattr(obj, "__wrapped__"):  # functools.lru_cache and other wrappers
            todo.append(obj.__wrapped__)
        elif isinstance(obj, type) and ours(obj):
            todo += list(vars(obj).values())
        elif ours(type(obj)) and hasattr(obj, "__dict__"):
            todo += list(vars(obj).values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _same_answer(value, answer) -> bool:
    """Whether a value found in the library is ``answer`` (a set, as any collection of the
    same strings; a tuple answer, item by item)."""
    if isinstance(answer, (set, frozenset)):
        return isinstance(value, (set, frozenset, list, tuple)) and all(
            isinstance(v, str) for v in value) and set(value) == set(answer)
    if isinstance(answer, tuple):
        return isinstance(value, (tuple, list)) and len(value) == len(answer) and all(
            _same_answer(v, a) for v, a in zip(value, answer))
    if isinstance(value, bool) or isinstance(answer, bool):
        return value is answer
    try:
        return type(value) in (int, float, str, type(None), list) and value == answer
    except Exception:  # noqa: BLE001 - not comparable: not the answer
        return False


def _holds(value, answer) -> bool:
    """Whether ``value`` is the answer, or a tuple or list with the answer as an item."""
    if _same_answer(value, answer):
        return True
    return isinstance(value, (tuple, list)) and any(_same_answer(v, answer) for v in value)


def keys_read_off(keys: dict[str, dict], objects) -> list[tuple[str, str]]:
    """``(exercise, what)`` for each key that a reachable object holds: a dict from the key's
    cases to their answers (each alone or in a tuple beside the case's statement), or one
    from answers to collections of cases, for more than half of the key's cases (and at
    least two): a single matching value is a coincidence, a table is the key."""
    found = []
    for obj in objects:
        if not isinstance(obj, dict) or not obj:
            continue
        for exercise, key in keys.items():
            need = max(2, len(key) // 2 + 1)
            paired = sum(case in obj and _holds(obj[case], answer) for case, answer in key.items())
            inverted = sum(any(_same_answer(k, answer) and isinstance(v, (list, tuple, set,
                                                                          frozenset))
                               and case in v for k, v in obj.items())
                           for case, answer in key.items() if not isinstance(answer, tuple))
            if paired >= need or inverted >= need:
                found.append((exercise, f"a dict of {len(obj)} entries: {sorted(map(str, obj))[:4]}"))
    return found


# --- hints stop at the text: what of a worked solution no output may show ----------------------


def worked_solutions():
    """(exercise number, the chapter's worked solution's source) for every exercise."""
    import nbformat

    from tutorial_lib import classroom
    for path in classroom.chapters():
        nb = nbformat.read(path, as_version=4)
        for ex in classroom.chapter_exercises(nb):
            yield ex.number, nb.cells[ex.solution_cell].source


def compact(text: str) -> str:
    """``text`` without spaces and backticks: how a piece is looked for."""
    return re.sub(r"[\s`]", "", text)


_FORMULA = (ast.BinOp, ast.IfExp, ast.Call, ast.ListComp, ast.BoolOp, ast.Compare)


def solution_pieces(source: str) -> set[str]:
    """What of a worked solution a hint must not show: each line of its code (14 characters
    or more once spaces are gone; not a def, import, comment or assert) and each formula it
    computes (the right side of a return or an assignment that is an operation or a call),
    written without spaces; a formula also with the names it assigned before replaced by
    their formulas (``steps = 2 * (n - 1)`` then ``steps * nbytes // n`` is also
    ``2 * (n - 1) * nbytes // n``, as a hint could write it)."""
    pieces = set()
    for line in source.split("\n"):
        line = line.split("  #")[0].strip()
        if line and not line.startswith(("#", "def ", "assert ", "import ", "from ")) \
                and len(compact(line)) >= 14:
            pieces.add(compact(line))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Return, ast.Assign, ast.AugAssign)) else None
        if isinstance(value, _FORMULA) and len(compact(ast.unparse(value))) >= 9:
            pieces.add(compact(ast.unparse(value)))
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            pieces |= {compact(ast.unparse(f)) for f in _inlined_formulas(function)
                       if len(compact(ast.unparse(f))) >= 9}
    return pieces


def _inlined_formulas(function: ast.FunctionDef) -> list[ast.expr]:
    """The formulas ``function`` assigns and returns, in the order it computes them, each
    with the local names computed before it replaced by their own (inlined) formulas."""
    known: dict[str, ast.expr] = {}

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node):
            if isinstance(node.ctx, ast.Load) and node.id in known:
                return copy.deepcopy(known[node.id])
            return node

    def inline(expr):
        return Inline().visit(copy.deepcopy(expr))

    statements = sorted((n for n in ast.walk(function) if isinstance(
        n, (ast.Assign, ast.AugAssign, ast.Return)) and n.value is not None),
        key=lambda n: (n.lineno, n.col_offset))
    out = []
    for node in statements:
        value = inline(node.value)
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                known[target.id] = value
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                    and len(target.elts) == len(value.elts):
                for name, item in zip(target.elts, value.elts):
                    if isinstance(name, ast.Name):
                        known[name.id] = item
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) \
                and node.target.id in known:
            value = ast.BinOp(known[node.target.id], node.op, value)
            known[node.target.id] = value
        if isinstance(value, _FORMULA):
            out.append(value)
    return out


def solution_pieces_of(exercise: str) -> set[str]:
    """:func:`solution_pieces` of the worked solution of ``exercise`` (e.g. ``"2.2"``)."""
    return set().union(*(solution_pieces(source) for number, source in worked_solutions()
                         if number == exercise))


def fail_five_times(key: AnswerKey, labels, pieces: set[str],
                    then: Callable | None = None) -> None:
    """Run each of ``labels`` (answers of ``key``) through the checker five times in a row
    (a deadlocking answer with a short timeout, :meth:`AnswerKey.options`): each verdict
    must fail, and no output may hold one of ``pieces``.  ``then(label, fifth verdict)``
    runs after the fifth, while the hints are at their latest stage.  The staged hints
    count from a clean slate, and are forgotten afterwards."""
    kit.forget_attempts()
    try:
        for label in labels:
            for attempt in range(5):
                result = key.checker(key.answers[label], **key.options(label))
                text = output_of(result)
                assert not result.passed, (key.exercise, label, attempt)
                shown = [p for p in pieces if p in compact(text)]
                assert not shown, (key.exercise, label, attempt, shown, text)
            if then is not None:
                then(label, result)
    finally:
        kit.forget_attempts()
