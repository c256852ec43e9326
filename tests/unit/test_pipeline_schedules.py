"""Pipeline schedules as data: shapes, messages, simulated causality, bubbles, memory, the bug."""
from collections import Counter, defaultdict
from fractions import Fraction

import pytest

from tutorial_lib.config import ConfigError
from tutorial_lib.pipeline_parallel import build_schedules
from tutorial_lib.pipeline_parallel.actions import Action, check_microbatch_groups
from tutorial_lib.pipeline_parallel.formulas import (expected_bubble, expected_peak_activations,
                                                     peak_activations_in_flight)
from tutorial_lib.pipeline_parallel.schedules import (get_schedule_table, gpipe,
                                                      interleaved_one_f_one_b,
                                                      num_warmup_microbatches, one_f_one_b)
from tutorial_lib.pipeline_parallel.simulator import (DeadlockError, MismatchError,
                                                      bubble_fraction, makespan, planned_spans,
                                                      simulate)
from tests.asserts import every

# Every valid (schedule, PP, M, V): PP 1..6, M 1..12; interleaved needs V >= 2, PP >= 2, M % PP == 0.
CASES = ([(name, pp, m, 1) for name in ("gpipe", "1f1b") for pp in range(1, 7) for m in range(1, 13)]
         + [("interleaved", pp, m, v) for pp in range(2, 7) for m in range(pp, 13, pp) for v in (2, 3)])
IDS = [f"{n}-pp{p}-m{m}-v{v}" for n, p, m, v in CASES]
SIMULATED = {}


def schedules(case):
    name, pp, m, v = case
    return build_schedules(name, pp, m, v)


def timelines(case):
    """Simulated with exact fractions (forward 1, backward 2, P2P free), cached across tests."""
    if case not in SIMULATED:
        SIMULATED[case] = simulate(schedules(case), Fraction(1), Fraction(2), Fraction(0))
    return SIMULATED[case]


def compute_order(actions):
    return " ".join(a.label for a in actions if a.is_compute)


# --- shape: each compute exactly once, warm-up counts -----------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_rank_runs_every_forward_and_backward_once_per_chunk(case):
    name, pp, m, v = case
    for rank, actions in schedules(case).items():
        expected = Counter({(i, c): 1 for i in range(m) for c in range(v)})
        for kind in ("forward", "backward"):
            assert Counter((a.microbatch, a.chunk) for a in actions if a.kind == kind) == expected
        assert every(a.peer is None for a in actions if a.is_compute)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_warmup_forwards_before_the_first_backward(case):
    name, pp, m, v = case
    for rank, actions in schedules(case).items():
        computes = [a.kind for a in actions if a.is_compute]
        before_first_backward = computes.index("backward")
        if name == "gpipe":
            assert before_first_backward == m
        elif name == "1f1b":
            warmup = min(pp - rank - 1, m)  # Megatron's count, written out
            assert num_warmup_microbatches(pp, m, rank) == warmup
            assert before_first_backward == min(warmup + 1, m)  # steady state starts with a forward
            steady = computes[warmup:warmup + 2 * (m - warmup)]
            assert steady == ["forward", "backward"] * (m - warmup)
        else:
            warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, v * m)  # M == PP too (Megatron >= 0.10)
            assert num_warmup_microbatches(pp, m, rank, v) == warmup
            assert before_first_backward == min(warmup + 1, v * m)
            steady = computes[warmup:warmup + 2 * (v * m - warmup)]
            assert steady == ["forward", "backward"] * (v * m - warmup)


def test_hand_written_orders():
    # 1F1B, PP=4, M=6, rank 1: two warm-up forwards, four 1F1B pairs, two cool-down backwards.
    assert compute_order(one_f_one_b(4, 6, 1)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert compute_order(one_f_one_b(4, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert compute_order(one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"  # warm-up capped at M
    assert compute_order(gpipe(3, 3, 2)) == "F0 F1 F2 B0 B1 B2"
    # Interleaved, PP=2, M=4, V=2 (".1" = chunk 1): microbatches go through chunks in groups of PP,
    # backwards take the chunks in reverse; rank 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards.
    assert compute_order(interleaved_one_f_one_b(2, 4, 0, 2)) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3")
    # Megatron's figure (PP=4, M=8, V=2): device 1 runs 10 forwards before its first backward.
    assert compute_order(interleaved_one_f_one_b(4, 8, 0, 2)).split()[:12] == [
        "F0", "F1", "F2", "F3", "F0.1", "F1.1", "F2.1", "F3.1", "F4", "F5", "F6", "B0.1"]
    # M == PP: rank 0 warms up with 2 + 2 = 4 = V*M forwards (all of them), rank 1 with 2.
    assert compute_order(interleaved_one_f_one_b(2, 2, 0, 2)) == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"
    assert compute_order(interleaved_one_f_one_b(2, 2, 1, 2)) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    # V = 1 is plain 1F1B.
    assert interleaved_one_f_one_b(4, 6, 2, 1) == one_f_one_b(4, 6, 2)


# --- interleaved 1F1B in Megatron-Core's order ------------------------------------------------
#
# Upstream: NVIDIA/Megatron-LM, megatron/core/pipeline_parallel/schedules.py at d98e8a64
# (Megatron-Core 0.20.0): forward_backward_pipelining_with_interleaving, get_schedule_table,
# get_pp_rank_microbatches; the default group size PP from ModelParallelConfig.__post_init__
# (megatron/core/model_parallel_config.py).  The order has been table-driven for every M since
# Megatron-Core 0.10 (commit 4295be1a, "tunable schedule with overlapping"); up to 0.9 a step
# with M == PP ran every forward before any backward.


def group_size_is_accepted(pp, m, n):
    """Megatron's two refusals, stated on their own: N outside [PP, M], or a last group of 1..PP-1."""
    return pp <= n <= m and not 0 < m % n < pp


def megatron_interleaved_order(pp, m, v, rank, group=None):
    """One rank's computes, ``(kind, microbatch, chunk)``, derived here without the library.

    Forward slot ``k`` takes the ``k``-th ``(microbatch i, chunk c)`` ordered by the key
    ``(i // N, c, i)``: consecutive groups of ``N`` microbatches (``N = PP`` unless given),
    each group through every chunk before the next group starts.  Backward slot ``k`` takes
    the same pair with the chunk mirrored (``V - 1 - c``).  ``w = min(2 (PP - rank - 1) +
    (V - 1) N, V M)`` forwards come first; then forwards and backwards alternate; then the
    backwards left.  As positions on a line of ``2 V M`` steps: forward ``k`` sits at
    ``max(k, 2k - w)``, backward ``k`` at ``min(2k + w + 1, V M + k)``.
    """
    n = pp if group is None else group
    slots = sorted(((i, c) for i in range(m) for c in range(v)), key=lambda ic: (ic[0] // n, ic[1], ic[0]))
    w = min(2 * (pp - rank - 1) + (v - 1) * n, v * m)
    placed = {}
    for k, (i, c) in enumerate(slots):
        placed[max(k, 2 * k - w)] = ("forward", i, c)
        placed[min(2 * k + w + 1, v * m + k)] = ("backward", i, v - 1 - c)
    assert sorted(placed) == list(range(2 * v * m))  # every step of the line holds one compute
    return [placed[t] for t in range(2 * v * m)]


# Default group size (N = PP): M = PP, 2 PP, 3 PP for PP 2..8 and V 2..4; and every accepted
# non-default N for PP 2..5, M up to 12 (M need not be a multiple of PP there: PP 3, N 4, M 4 or 7).
PARITY = ([(pp, m, v, None) for pp in range(2, 9) for v in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp)]
          + [(pp, m, v, n) for pp in range(2, 6) for m in range(pp, 13) for n in range(pp + 1, m + 1)
             for v in (2, 3) if group_size_is_accepted(pp, m, n)])


def library_order(pp, m, v, rank, group=None):
    options = {} if group is None else {"microbatch_group_size_per_vp_stage": group}
    actions = interleaved_one_f_one_b(pp, m, rank, v, **options)
    return [(a.kind, a.microbatch, a.chunk) for a in actions if a.is_compute]


@pytest.mark.parametrize("pp", range(2, 9))
def test_interleaved_order_is_megatrons_for_every_accepted_m(pp):
    """Every rank's computes equal :func:`megatron_interleaved_order`, M == PP included.

    Upstream rule: NVIDIA/Megatron-LM, megatron/core/pipeline_parallel/schedules.py,
    ``get_schedule_table`` + ``get_pp_rank_microbatches`` as used by
    ``forward_backward_pipelining_with_interleaving`` (Megatron-Core 0.20.0, d98e8a64).
    """
    cases = [c for c in PARITY if c[0] == pp]
    assert any(m == pp for _, m, _, _ in cases) and any(m == 2 * pp for _, m, _, _ in cases)
    wrong = [(m, v, n, rank) for _, m, v, n in cases for rank in range(pp)
             if library_order(pp, m, v, rank, n) != megatron_interleaved_order(pp, m, v, rank, n)]
    assert not wrong, f"(M, V, N, rank) off Megatron's order: {wrong[:8]} ({len(wrong)} in all)"


def test_m_not_a_multiple_of_pp_runs_where_megatron_accepts_it():
    """A group size N != PP (Megatron-Core >= 0.10, ``microbatch_group_size_per_vp_stage``)
    admits M that PP does not divide; those schedules run, with the closed-form bubble."""
    assert any(m % pp for pp, m, _, _ in PARITY)
    for pp, m, v, n in PARITY:
        if n is None:
            continue
        scheds = build_schedules("interleaved", pp, m, v, microbatch_group_size_per_vp_stage=n)
        tl = simulate(scheds, Fraction(1), Fraction(2), Fraction(0))  # no deadlock, messages matched
        assert bubble_fraction(tl) == Fraction(pp - 1, v * m + pp - 1), (pp, m, v, n)
        for rank, actions in scheds.items():
            assert peak_activations_in_flight(actions) == expected_peak_activations(
                "interleaved", pp, m, rank, v, microbatch_group_size_per_vp_stage=n)


def test_m_equal_to_pp_is_no_longer_all_forwards_first():
    """M == PP follows the warm-up count too (Megatron-Core >= 0.10; 0.20.0, d98e8a64,
    ``get_pp_rank_microbatches``), where Megatron-Core <= 0.9 ran all V * M forwards first."""
    # PP = 2, M = 2, V = 2, rank 1: warm-up 2 (0 + 1 * 2), not all 4 (Megatron-Core <= 0.9).
    assert num_warmup_microbatches(2, 2, 1, 2) == 2
    assert [f"{k[0].upper()}{i}" + (f".{c}" if c else "") for k, i, c in megatron_interleaved_order(2, 2, 2, 1)] \
        == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1".split()
    assert compute_order(interleaved_one_f_one_b(2, 2, 1, 2)) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    # PP = 8, V = 2, M = 8: the cap V * M = 16 binds on ranks 0-3 only.
    peaks = [peak_activations_in_flight(interleaved_one_f_one_b(8, 8, r, 2)) for r in range(8)]
    assert peaks == [16, 16, 16, 16, 15, 13, 11, 9]
    assert peaks == [expected_peak_activations("interleaved", 8, 8, r, 2) for r in range(8)]


def test_schedule_table_matches_megatrons_documented_examples():
    # ModelParallelConfig.microbatch_group_size_per_vp_stage's docstring (PP 2, V 2): N = 2, M = 4
    # runs microbatches 0 1 0 1 2 3 2 3; N = 3, M = 5 runs 0 1 2 0 1 2 3 4 3 4, and the comment in
    # forward_backward_pipelining_with_interleaving gives that table's chunks 0 0 0 1 1 1 0 0 1 1.
    assert [i for i, _ in get_schedule_table(4, 2, 2)] == [0, 1, 0, 1, 2, 3, 2, 3]
    table = get_schedule_table(5, 2, 3)
    assert [i for i, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    forwards = [(a.microbatch, a.chunk) for a in interleaved_one_f_one_b(2, 5, 0, 2, 3) if a.kind == "forward"]
    assert forwards == table


@pytest.mark.parametrize("pp", range(1, 6))
def test_group_size_rules_are_megatrons(pp):
    """The refusals of ``forward_backward_pipelining_with_interleaving`` (Megatron-Core 0.20.0,
    d98e8a64): N within [PP, M], no last group of 1..PP-1; N defaults to PP."""
    for m in range(1, 13):
        default_ok = m % pp == 0  # N = PP: both rules reduce to "M a multiple of PP"
        if pp > 1:
            assert default_ok == group_size_is_accepted(pp, m, pp)
        for n in [None] + list(range(1, 14)):
            ok = default_ok if n is None else group_size_is_accepted(pp, m, n)
            if ok:
                assert check_microbatch_groups(pp, m, n) == (pp if n is None else n)
                continue
            with pytest.raises(ConfigError) as error:
                check_microbatch_groups(pp, m, n)
            message = str(error.value)
            assert error.value.rule == "interleaved schedule"
            assert f"({m})" in message and ("try" in message or "run at least" in message), message
    with pytest.raises(ConfigError, match=r"microbatch_group_size_per_vp_stage \(2\) must lie between "
                                          r"pp_size \(3\) and num_microbatches \(6\).*from 3 to 6"):
        interleaved_one_f_one_b(3, 6, 0, 2, 2)
    with pytest.raises(ConfigError, match=r"num_microbatches \(5\) in groups of microbatch_group_size_per_vp"
                                          r"_stage \(4\) leaves a last group of 1 microbatch, fewer than "
                                          r"pp_size \(3\).*try 4 or 7 microbatches"):
        interleaved_one_f_one_b(3, 5, 0, 2, 4)
    with pytest.raises(ConfigError, match=r"only applies to the interleaved schedule"):
        num_warmup_microbatches(3, 6, 0, 1, 3)


# --- messages: peers, labels, every send matched in order -------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_peers_and_static_matching(case):
    name, pp, m, v = case
    scheds = schedules(case)
    channels = defaultdict(lambda: {"send": [], "recv": []})  # (src, dst, payload) -> microbatches
    for rank, actions in scheds.items():
        for a in actions:
            if a.is_compute:
                continue
            stage = a.model_stage(rank, pp)
            payload = a.kind.split("_", 1)[1]
            if a.kind == "send_activation":
                assert stage < v * pp - 1 and a.peer == (rank + 1) % pp
            elif a.kind == "recv_activation":
                assert stage > 0 and a.peer == (rank - 1) % pp
            elif a.kind == "send_grad":
                assert stage > 0 and a.peer == (rank - 1) % pp
            elif a.kind == "recv_grad":
                assert stage < v * pp - 1 and a.peer == (rank + 1) % pp
            elif a.kind == "send_labels":
                assert (rank, stage, a.peer) == (0, 0, pp - 1)
            else:
                assert (rank, stage, a.peer) == (pp - 1, v * pp - 1, 0)
            if a.kind.startswith("send"):
                channels[(rank, a.peer, payload)]["send"].append(a.microbatch)
            else:
                channels[(a.peer, rank, payload)]["recv"].append(a.microbatch)
    for key, ends in channels.items():
        assert ends["send"] == ends["recv"], key  # same messages, same order: nothing left hanging
    # Totals: one activation and one gradient per microbatch per stage boundary, one label message.
    boundaries = v * pp - 1
    totals = Counter()
    for (_, _, payload), ends in channels.items():
        totals[payload] += len(ends["send"])
    assert totals == Counter({"activation": boundaries * m, "grad": boundaries * m,
                              "labels": m if pp > 1 else 0}) - Counter()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_labels_sent_before_stage0_forward_and_received_before_the_loss(case):
    name, pp, m, v = case
    scheds = schedules(case)
    if pp == 1:
        assert not any("labels" in a.kind for a in scheds[0])
        return
    first, last = scheds[0], scheds[pp - 1]
    for i in range(m):
        forward0 = first.index(Action("forward", i, 0))
        assert first[forward0 - 1] == Action("send_labels", i, 0, pp - 1)
        loss = last.index(Action("forward", i, v - 1))
        assert last[loss - 1] == Action("recv_labels", i, v - 1, 0)


# --- simulation: completion and causality ----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_simulation_completes_and_respects_causality(case):
    name, pp, m, v = case
    scheds, tl = schedules(case), timelines(case)
    last = v * pp - 1
    done = {}
    for rank, timed in tl.items():
        assert [t.action for t in timed] == scheds[rank]  # every action ran: no deadlock
        assert every(t.start <= t.end for t in timed)
        assert every(a.end <= b.start for a, b in zip(timed, timed[1:]))  # one thing at a time
        for t in timed:
            if t.action.is_compute:
                stage = t.action.model_stage(rank, pp)
                assert stage % pp == rank
                done[(t.action.kind, t.action.microbatch, stage)] = t
    for i in range(m):
        for s in range(last + 1):
            fwd, bwd = done[("forward", i, s)], done[("backward", i, s)]
            if s > 0:
                assert fwd.start >= done[("forward", i, s - 1)].end
            assert bwd.start >= fwd.end  # backward after its own forward
            if s < last:
                assert bwd.start >= done[("backward", i, s + 1)].end  # and after the next stage's
        if last > 0:  # the loss waits for the labels read by stage 0
            assert done[("forward", i, last)].start >= done[("forward", i, 0)].end


def test_simulated_times_by_hand():
    # 1F1B, PP=2, M=2, forward 1, backward 2.
    tl = simulate(build_schedules("1f1b", 2, 2))
    rank0 = [(t.action.label, t.start, t.end) for t in tl[0]
             if t.action.is_compute or t.action.kind.startswith("recv")]
    assert rank0 == [("F0", 0, 1), ("F1", 1, 2), ("recv_grad 0 <- 1", 2, 4), ("B0", 4, 6),
                     ("recv_grad 1 <- 1", 6, 7), ("B1", 7, 9)]
    rank1 = [(t.action.label, t.start, t.end) for t in tl[1] if t.action.is_compute]
    assert rank1 == [("F0", 1, 2), ("B0", 2, 4), ("F1", 4, 5), ("B1", 5, 7)]
    assert makespan(tl) == 9 == (2 + 2 - 1) * (1 + 2)


def test_p2p_cost_delays_receives_and_grows_the_bubble():
    c = Fraction(1, 4)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        scheds = build_schedules(name, 4, 8, v)
        tl = simulate(scheds, 1, 2, c)
        sends = defaultdict(list)
        for rank, timed in tl.items():
            for t in timed:
                if t.action.kind.startswith("send"):
                    assert t.end - t.start == c
                    sends[(rank, t.action.peer, t.action.kind[5:])].append(t)
        for rank, timed in tl.items():
            taken = Counter()
            for t in timed:
                if t.action.kind.startswith("recv"):
                    key = (t.action.peer, rank, t.action.kind[5:])
                    assert t.end >= sends[key][taken[key]].end
                    taken[key] += 1
        assert bubble_fraction(tl) > expected_bubble(4, 8, v)


def test_result_does_not_depend_on_the_order_ranks_are_visited():
    scheds = build_schedules("interleaved", 3, 6, 2)
    backwards = {r: scheds[r] for r in reversed(range(3))}
    assert simulate(backwards, 1, 3) == simulate(scheds, 1, 3)


# --- the bubble ------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [(1, 1), (1, 2), (1, 3), (2, 1), (1, 10)])
def test_bubble_is_the_closed_form_for_any_forward_backward_ratio(ratio):
    f, b = map(Fraction, ratio)
    for name, pp, m, v in CASES:
        tl = simulate(schedules((name, pp, m, v)), f, b, Fraction(0))
        expected = Fraction(pp - 1, v * m + pp - 1)
        assert bubble_fraction(tl) == expected == pytest.approx(expected_bubble(pp, m, v))
        assert makespan(tl) == (v * m + pp - 1) * (f + b)
        assert every(bubble_fraction(tl, r) == expected for r in tl)  # every rank idles alike


def test_interleaving_shrinks_the_bubble():
    for name, pp, m, v in CASES:
        if name == "interleaved":
            plain = bubble_fraction(timelines(("1f1b", pp, m, 1)))
            assert bubble_fraction(timelines((name, pp, m, v))) < plain
    assert expected_bubble(4, 8) == 3 / 11
    assert expected_bubble(4, 8, 2) == 3 / 19
    assert expected_bubble(1, 5) == 0


# --- memory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_peak_activations_match_the_formula(case):
    name, pp, m, v = case
    for rank, actions in schedules(case).items():
        peak = peak_activations_in_flight(actions)
        assert peak == expected_peak_activations(name, pp, m, rank, v)
        if name == "gpipe":
            assert peak == m
        elif name == "1f1b":
            assert peak == min(pp - rank, m)
        elif m >= 2 * pp and rank == 0:
            # Korthikanti et al.: PP * (1 + (PP-1)/(V*PP)) full stages = V*PP + PP - 1 chunks.
            assert Fraction(peak, v) == pp * (1 + Fraction(pp - 1, v * pp))


# --- a batched-mode bug: send_forward_recv_backward receiving from the previous rank -----------


@pytest.mark.parametrize("pp", [3, 4, 5, 6])
@pytest.mark.parametrize("m", [2, 3, 8])
def test_wrong_recv_backward_peer_deadlocks_from_pp3(pp, m):
    wrong = build_schedules("1f1b", pp, m, wrong_recv_backward_peer=True)
    with pytest.raises(DeadlockError) as err:
        simulate(wrong)
    waiting = err.value.waiting
    stuck_on_prev = [r for r, a in waiting.items() if a.kind == "recv_grad" and a.peer == (r - 1) % pp]
    assert stuck_on_prev, waiting  # someone waits for a gradient from the previous rank
    report = str(err.value)
    assert every(f"rank {r}:" in report for r in range(pp))
    assert "recv_grad" in report and "blocked" in report
    assert sum(len(t) for t in err.value.partial.values()) < sum(len(a) for a in wrong.values())


@pytest.mark.parametrize("m", range(1, 9))
def test_wrong_recv_backward_peer_looks_fine_with_pp2(m):
    wrong = build_schedules("1f1b", 2, m, wrong_recv_backward_peer=True)
    assert wrong == build_schedules("1f1b", 2, m)  # previous == next: the very same messages
    assert simulate(wrong) == simulate(build_schedules("1f1b", 2, m))


def test_wrong_peer_is_latent_without_a_steady_state():
    # M = 1: only the last stage has a 1F1B pair, and it receives no gradient, so the bug hides.
    wrong = build_schedules("1f1b", 4, 1, wrong_recv_backward_peer=True)
    assert wrong == build_schedules("1f1b", 4, 1)


# --- the simulator on hand-made mistakes ------------------------------------------------------


def test_receive_first_on_both_sides_deadlocks():
    scheds = {0: [Action("recv_grad", 0, peer=1), Action("send_activation", 0, peer=1)],
              1: [Action("recv_activation", 0, peer=0), Action("send_grad", 0, peer=0)]}
    with pytest.raises(DeadlockError) as err:
        simulate(scheds)
    assert err.value.waiting == {0: scheds[0][0], 1: scheds[1][0]}
    assert "rank 1 is itself blocked" in str(err.value)


def test_out_of_order_and_unreceived_messages_are_mismatches():
    out_of_order = {0: [Action("send_activation", 1, peer=1), Action("send_activation", 0, peer=1)],
                    1: [Action("recv_activation", 0, peer=0), Action("recv_activation", 1, peer=0)]}
    with pytest.raises(MismatchError, match="microbatch 1"):
        simulate(out_of_order)
    unreceived = {0: [Action("forward", 0), Action("send_activation", 0, peer=1)], 1: [Action("forward", 0)]}
    with pytest.raises(MismatchError, match="never received"):
        simulate(unreceived)
    wrong_stage = {0: [Action("send_grad", 0, peer=1)], 1: [Action("recv_grad", 0, peer=0)]}
    with pytest.raises(MismatchError, match="model stage"):
        simulate(wrong_stage)


# --- validation ----------------------------------------------------------------------------------


def test_validation_errors_name_the_numbers():
    with pytest.raises(ConfigError, match=r"pp_size \(0\) must be an integer >= 1"):
        one_f_one_b(0, 4, 0)
    with pytest.raises(ConfigError, match=r"num_microbatches \(0\) must be an integer >= 1"):
        gpipe(2, 0, 0)
    with pytest.raises(ConfigError, match=r"rank \(2\) must be a pipeline rank in 0\.\.1"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ConfigError, match=r"num_microbatches \(6\) must be divisible by pp_size \(4\)"
                                          r".*try 4 or 8 microbatches"):
        interleaved_one_f_one_b(4, 6, 0, 2)
    with pytest.raises(ConfigError, match=r"try 3 microbatches"):
        interleaved_one_f_one_b(3, 2, 0, 2)
    with pytest.raises(ConfigError, match=r"virtual_pipeline_size \(2\) > 1 needs pp_size >= 2"):
        interleaved_one_f_one_b(1, 4, 0, 2)
    with pytest.raises(ConfigError, match=r"virtual_pipeline_size \(0\)"):
        interleaved_one_f_one_b(2, 4, 0, 0)
    with pytest.raises(ConfigError, match=r"pp_size \(2\.0\)"):
        gpipe(2.0, 4, 0)
    with pytest.raises(ConfigError, match=r"m \(0\)"):
        expected_bubble(4, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build_schedules("zb", 2, 2)
    with pytest.raises(ValueError, match="needs the interleaved schedule"):
        build_schedules("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="the peer must be another rank in 0..1"):
        simulate({0: [Action("recv_grad", 0, peer=2)], 1: []})
    with pytest.raises(ValueError, match="keyed by the pipeline ranks"):
        simulate({1: []})
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("send", 0, peer=1)
    with pytest.raises(ValueError, match="peer"):
        Action("forward", 0, peer=1)
    with pytest.raises(ValueError, match="peer"):
        Action("recv_grad", 0)


# --- drawing ---------------------------------------------------------------------------------------


def test_planned_spans_draw_with_the_timeline_widget():
    from tutorial_lib.viz.timeline import timeline_from_spans

    tl = simulate(build_schedules("interleaved", 2, 4, 2))
    spans = planned_spans(tl)
    assert len(spans) == 2 * 2 * 4 * 2 and {s[4] for s in spans} == {"compute"}
    assert (0, 0, 1, "F0", "compute", "planned") in spans
    assert {s[4] for s in planned_spans(tl, p2p=True)} == {"compute", "pp"}
    html = timeline_from_spans(spans, scale=1, unit="step")._repr_html_()
    assert "F0.1" in html


# --- which (schedule, P2P mode) pairs a run takes: Megatron's --------------------------------

# Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64):
# * megatron/core/pipeline_parallel/p2p_communication.py, P2PCommunicator._communicate: the
#   P2P layer has two paths, _batched_p2p_ops (batch_p2p_comm) and _p2p_ops, and both post
#   every isend / irecv of a call before anything waits on them: no blocking send-then-receive.
# * megatron/training/arguments.py, validate_args: with a virtual pipeline (interleaving) and
#   overlap_p2p_comm off, it asserts pipeline_model_parallel_size > 2; with overlap on, > 1.
# * megatron/training/argument_utils.py: batch_p2p_comm = not overlap_p2p_comm.
# * megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_without_interleaving
#   refuses overlap_p2p_comm, but takes batch_p2p_comm=False (the unbatched _p2p_ops, waited
#   on at once): our "overlapped" mode with 1F1B.
MEGATRON_PAIRS = {  # (schedule, mode, PP) -> accepted
    ("1f1b", "batched", 2): True, ("1f1b", "batched", 3): True,
    ("1f1b", "overlapped", 2): True, ("1f1b", "overlapped", 3): True,
    ("interleaved", "overlapped", 2): True, ("interleaved", "overlapped", 3): True,
    ("interleaved", "batched", 2): False, ("interleaved", "batched", 3): True,
    ("interleaved", "batched", 4): True,
    ("gpipe", "batched", 3): True, ("gpipe", "overlapped", 3): True,
    **{(s, "sequential", pp): False for s in ("gpipe", "1f1b", "interleaved") for pp in (2, 3)},
}


@pytest.mark.parametrize("schedule,mode,pp", list(MEGATRON_PAIRS),
                         ids=[f"{s}-{m}-pp{p}" for s, m, p in MEGATRON_PAIRS])
def test_schedule_and_mode_pairs_are_the_ones_megatron_runs(schedule, mode, pp):
    """Chapter 7's table: a run takes exactly the (schedule, P2P mode) pairs Megatron allows
    (the citations above MEGATRON_PAIRS).  An earlier version accepted the blocking mode with
    1F1B and GPipe, and interleaved + batched at PP = 2."""
    from tutorial_lib.pipeline_parallel.modes import check_schedule_and_mode
    if MEGATRON_PAIRS[schedule, mode, pp]:
        check_schedule_and_mode(schedule, mode, pp)
        return
    with pytest.raises(ConfigError) as error:
        check_schedule_and_mode(schedule, mode, pp)
    if mode == "sequential":
        assert error.value.rule == "p2p mode"
        assert "not a mode Megatron has" in str(error.value)
    else:
        assert error.value.rule == "interleaved schedule"
        assert "needs pipeline_model_parallel_size > 2, got 2" in str(error.value)
    assert "--p2p-mode" in str(error.value)  # and the fix


def test_training_p2p_modes_are_megatrons_two():
    from tutorial_lib.pipeline_parallel.modes import P2P_MODES, TRAINING_P2P_MODES
    assert set(TRAINING_P2P_MODES) == {"batched", "overlapped"} < set(P2P_MODES)
