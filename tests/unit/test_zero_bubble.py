"""Chapter 11's schedules as data: ZB-H1, ZBV, DualPipeV and DualPipe.

Three kinds of test:

* invariants, for many (PP, M): every forward before its B before its W on the rank that
  runs them, every message received, no deadlock (the simulator checks all three);
* the simulated bubble and peak activations equal the formulas of the DualPipe
  README's table (deepseek-ai/DualPipe, README.md, "Pipeline Bubbles and Memory Usage
  Comparison", commit 3da1bbea53606543d7f5f232338fc58096db30e3, 2025-03-06);
* each rank's order of F, B and W equals the one torch.distributed.pipelining builds
  (torch 2.13.0, torch/distributed/pipelining/schedules.py): the schedule objects are
  built on stand-in stages that have no process group, and only their
  ``pipeline_order`` is read; nothing runs.
"""
from collections import Counter
from fractions import Fraction

import pytest

from tutorial_lib.config import ConfigError
from tutorial_lib.pipeline_parallel import build_schedules
from tutorial_lib.pipeline_parallel.actions import Action, split_backwards
from tutorial_lib.pipeline_parallel.formulas import peak_activations_in_flight
from tutorial_lib.pipeline_parallel.simulator import COSTS, OrderError, makespan, simulate
from tutorial_lib.pipeline_parallel.zero_bubble import zb_h1

F, B, W = COSTS["F"], COSTS["B"], COSTS["W"]


def computes(actions):
    return [a for a in actions if a.is_compute]


def timelines(name, pp, m, f=F, b=B, w=W, fb=None):
    return simulate(build_schedules(name, pp, m), Fraction(f), Fraction(b), 0,
                    Fraction(w), None if fb is None else Fraction(fb))


# --- invariants --------------------------------------------------------------------------

ZB_CASES = [(pp, m) for pp in range(1, 7) for m in range(1, 13)]


def check_each_compute_once(schedules, pairs):
    """Every rank runs F and B once per (microbatch, chunk) it holds, W once per split B."""
    for rank, actions in schedules.items():
        forwards = Counter((a.microbatch, a.chunk) for a in actions if a.kind == "forward")
        backwards = Counter((a.microbatch, a.chunk) for a in actions if a.kind == "backward")
        weights = Counter((a.microbatch, a.chunk) for a in actions if a.kind == "weight")
        assert forwards == backwards == Counter(pairs(rank))
        assert set(weights) <= set(backwards) and set(weights.values()) <= {1}


def check_causal_order(schedules):
    """On each rank: F before its B before its W (written out, not the simulator's check)."""
    for rank, actions in schedules.items():
        seen = set()
        for a in computes(actions):
            key = (a.microbatch, a.chunk)
            if a.kind == "backward":
                assert ("forward", key) in seen, (rank, a.label)
            if a.kind == "weight":
                assert ("backward", key) in seen, (rank, a.label)
            seen.add((a.kind, key))


@pytest.mark.parametrize("pp,m", ZB_CASES)
def test_zb_h1_invariants(pp, m):
    schedules = build_schedules("zb-h1", pp, m)
    check_each_compute_once(schedules, lambda rank: [(i, 0) for i in range(m)])
    check_causal_order(schedules)
    for rank, actions in schedules.items():
        assert split_backwards(actions) == {(i, 0) for i in range(m)}  # ZB-H1 splits every one
        # without the W's it is 1F1B, messages included
        one_f_one_b = build_schedules("1f1b", pp, m)[rank]
        assert [a for a in actions if a.kind != "weight"] == one_f_one_b
    simulate(schedules)  # raises on a deadlock, a mismatched or unreceived message


def test_simulator_refuses_a_w_before_its_b():
    actions = zb_h1(1, 2, 0)
    i = next(k for k, a in enumerate(actions) if a.kind == "weight")
    swapped = actions[:i - 1] + [actions[i], actions[i - 1]] + actions[i + 1:]
    with pytest.raises(OrderError, match="before B"):
        simulate({0: swapped})


# --- bubbles and memory: the DualPipe README's table ---------------------------------------
# deepseek-ai/DualPipe, README.md at 3da1bbea (2025-03-06): with PP pipeline stages, F the
# forward of a chunk, B its whole backward, W its weight-gradient part, the bubble is
# 1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W), DualPipe and DualPipeV (PP/2-1)(F&B+B-3W); the
# activations per device are PP for 1F1B and ZB1P, PP+1 for DualPipe and DualPipeV, the
# parameters per device 1x, 1x, 2x, 2x.  "Bubble" is a rank's idle time in a step:
# makespan minus its compute, the same on every rank since every rank computes as much.

# Costs with W <= F and W <= B - W (W never longer than the work it hides behind): the
# course's (1, 2, 1) and others where B, W and F differ.
COST_CASES = [(1, 2, 1), (1, 3, 1), (2, 2, Fraction(1, 2)), (3, 2, 1), (1, 2, Fraction(1, 3))]


@pytest.mark.parametrize("f,b,w", COST_CASES)
def test_zb_h1_bubble_is_the_tables_zb1p(f, b, w):
    for pp in range(1, 7):
        for m in range(pp, 13):  # a full pipeline: M >= PP
            timed = timelines("zb-h1", pp, m, f, b, w)
            one_f_one_b = simulate(build_schedules("1f1b", pp, m), Fraction(f), Fraction(b))
            assert makespan(timed) - m * (f + b) == (pp - 1) * (f + b - 2 * w)
            assert makespan(one_f_one_b) - m * (f + b) == (pp - 1) * (f + b)


# The ZB paper and sail-sg's README write the backward's input part as T_B (the course's
# and DualPipe's B - W) and its weight part as T_W: sail-sg/zero-bubble-pipeline-parallelism,
# README.md at 3a91d0c8, "Comparision of Schedules": bubble rates 1F1B (p-1)/m, ZB1P
# (p-1)/3m, ZBV 0, "assuming T_F = T_B = T_W"; the ZB paper (Qi et al., ICLR 2024, its
# ZB-H1 schedule) gives ZB-H1's bubble as (p-1)(T_F + T_B - T_W).


@pytest.mark.parametrize("f,b,w", COST_CASES)
def test_the_zb_papers_zb_h1_bubble_is_the_dualpipe_tables(f, b, w):
    """(p-1)(T_F + T_B - T_W) with T_B = B - W is (PP-1)(F + B - 2W): one bubble, two
    notations, and the simulation gives it."""
    t_f, t_b, t_w = f, b - w, w
    for pp in range(2, 6):
        bubble = makespan(timelines("zb-h1", pp, 2 * pp, f, b, w)) - 2 * pp * (f + b)
        assert bubble == (pp - 1) * (t_f + t_b - t_w) == (pp - 1) * (f + b - 2 * w)


def test_zbv_bubble_rate_is_half_zb1p_not_zero():
    """sail-sg's README rates ZBV's bubble 0 at T_F = T_B = T_W; the simulation of the same
    order (torch's ScheduleZBVZeroBubble, checked below) idles (PP-1) chunk forwards on
    every rank: the last rank cannot start before the first microbatch has crossed PP-1
    chunks.  As a rate of the step's work, 2M chunks of F + B = 3F each, that is
    (PP-1)/6M: half of ZB1P's (p-1)/3m, and 0 only as M grows."""
    for pp in range(2, 6):
        for m in (2 * pp, 4 * pp):
            plan = timelines("zbv", pp, m, 1, 2, 1)  # a chunk: T_F = T_B = T_W = 1
            work = 2 * m * 3
            bubble = makespan(plan) - work
            assert bubble == pp - 1 > 0
            assert Fraction(bubble, work) == Fraction(pp - 1, 6 * m)
            zb1p = makespan(timelines("zb-h1", pp, m, 2, 4, 2)) - m * 6  # a stage: 2 chunks
            assert Fraction(zb1p, m * 6) == Fraction(pp - 1, 3 * m) == 2 * Fraction(bubble, work)


def test_zb_h1_holds_1f1b_activations():
    """The table's "PP" for ZB1P: counted until each W, rank 0 of PP holds PP microbatches,
    as in 1F1B (M >= PP); the last rank holds PP too, where 1F1B's held 1."""
    for pp in range(1, 7):
        for m in range(pp, 13):
            peaks = [peak_activations_in_flight(a) for a in build_schedules("zb-h1", pp, m).values()]
            assert max(peaks) == pp and peaks[0] == pp and peaks[-1] == pp


# --- torch.distributed.pipelining's orders --------------------------------------------------


class StandInStage:
    """What torch's schedule constructors read from a stage, and nothing else: no module,
    no process group (torch 2.13.0's PipelineScheduleMulti.__init__ reads num_stages,
    group_size, group_rank and sets stage_index_to_group_rank)."""

    def __init__(self, stage_index, num_stages, group_rank, group_size):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = group_rank, group_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None


def torch_order(schedule_class, stage_lists, m):
    """Every rank's compute order from torch, as ``(kind, microbatch, stage)`` triples with
    kind F, I (input backward), B (full backward), W; overlapped pairs flattened in order
    and their halves marked ``+``."""
    schedule = schedule_class(stage_lists, m, loss_fn=lambda output, target: output)
    out = {}
    for rank, ops in schedule.pipeline_order.items():
        flat = []
        for op in ops:
            if op is None:
                continue
            if op.sub_actions is not None:
                flat += [(s.computation_type.value + "+", s.microbatch_index, s.stage_index)
                         for s in op.sub_actions]
            else:
                flat.append((op.computation_type.value, op.microbatch_index, op.stage_index))
        out[rank] = flat
    return out


def our_order(schedules):
    """The same triples from our lists: B for a whole backward, I for a split one."""
    pp, out = len(schedules), {}
    for rank, actions in schedules.items():
        split = split_backwards(actions)
        row = []
        for a in computes(actions):
            kind = {"forward": "F", "weight": "W"}.get(a.kind) or (
                "I" if (a.microbatch, a.chunk) in split else "B")
            row.append((kind + ("+" if a.overlapped else ""), a.microbatch, a.model_stage(rank, pp)))
        out[rank] = row
    return out


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_zb_h1_is_torchs_interleaved_zero_bubble_with_one_stage_per_rank(pp):
    """torch 2.13.0, torch/distributed/pipelining/schedules.py, ScheduleInterleavedZeroBubble
    (``_calculate_single_rank_operations`` with ``_get_1f1b_rank_ops(enable_zero_bubble=True)``):
    with one stage per rank, rank r runs 1F1B's forwards and input backwards and, from its
    r-th backward on, the oldest owed W after each; the rest at the end."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in sorted({pp, pp + 1, 2 * pp, 3 * pp}):
        if m % max(1, m // pp):  # torch refuses M not a multiple of its rounds
            continue
        want = {}
        for rank in range(pp):
            stage = StandInStage(rank, pp, rank, pp)
            want[rank] = torch_order(pipelining.ScheduleInterleavedZeroBubble, [stage], m)[rank]
        assert our_order(build_schedules("zb-h1", pp, m)) == want, (pp, m)


def v_stages(pp, rank):
    return [StandInStage(rank, 2 * pp, rank, pp), StandInStage(2 * pp - 1 - rank, 2 * pp, rank, pp)]


def torch_v_order(schedule_class, pp, m):
    return torch_order(schedule_class, v_stages(pp, 0), m)


# --- ZBV, DualPipeV, DualPipe --------------------------------------------------------------

V_CASES = [(pp, m) for pp in range(1, 7) for m in range(1, 15)]
DUALPIPEV_CASES = [(pp, m) for pp in range(1, 7) for m in range(2 * pp, 4 * pp + 3)]
DUALPIPE_CASES = [(pp, m) for pp in (2, 4, 6, 8) for m in range(2 * pp, 4 * pp + 3, 2)]


def v_pairs(m):
    return lambda rank: [(i, c) for i in range(m) for c in (0, 1)]


@pytest.mark.parametrize("name,cases", [("zbv", V_CASES), ("dualpipev", DUALPIPEV_CASES)])
def test_v_schedules_invariants(name, cases):
    for pp, m in cases:
        schedules = build_schedules(name, pp, m)
        check_each_compute_once(schedules, v_pairs(m))
        check_causal_order(schedules)
        for rank, actions in schedules.items():
            assert {a.placement for a in actions} == {"v"}
            # the V's turn: on the last rank, chunk 1's forward of a microbatch comes
            # after chunk 0's (no message carries it), its backward before chunk 0's
            if rank == pp - 1:
                order = [(a.kind, a.microbatch, a.chunk) for a in computes(actions)]
                for i in range(m):
                    assert order.index(("forward", i, 0)) < order.index(("forward", i, 1))
                    assert order.index(("backward", i, 1)) < order.index(("backward", i, 0))
            assert not any(a.kind.endswith("labels") for a in actions)  # rank 0 has both ends
        simulate(schedules)


def test_zbv_splits_every_backward_and_dualpipev_only_some():
    for pp, m in [(2, 4), (4, 8), (4, 11)]:
        for rank, actions in build_schedules("zbv", pp, m).items():
            assert split_backwards(actions) == set(v_pairs(m)(rank))
    for pp, m in [(2, 4), (4, 8), (4, 16)]:
        for rank, actions in build_schedules("dualpipev", pp, m).items():
            split = split_backwards(actions)
            overlapped = [a for a in actions if a.overlapped and a.kind == "backward"]
            # the steady state's F&B pairs run whole backwards; the ends split them
            assert overlapped and all((a.microbatch, a.chunk) not in split for a in overlapped)
            assert 0 < len(split) < 2 * m


@pytest.mark.parametrize("pp,m", DUALPIPE_CASES)
def test_dualpipe_invariants(pp, m):
    schedules = build_schedules("dualpipe", pp, m)
    # copy 0 carries microbatches 0 .. M/2 - 1 down, copy 1 the others up
    check_each_compute_once(schedules, lambda rank: [(i, 0) for i in range(m // 2)]
                            + [(i, 1) for i in range(m // 2, m)])
    check_causal_order(schedules)
    for rank, actions in schedules.items():
        labels = {(a.kind, a.chunk, a.peer) for a in actions if a.kind.endswith("labels")}
        # each copy's labels go from its first stage to its last: rank 0 -> PP-1 for copy 0,
        # PP-1 -> 0 for copy 1
        want = {0: {("send_labels", 0, pp - 1), ("recv_labels", 1, pp - 1)},
                pp - 1: {("send_labels", 1, 0), ("recv_labels", 0, 0)}}.get(rank, set())
        assert labels == want
    simulate(schedules)
    # the two halves mirror each other: rank r's list is rank PP-1-r's with the copies swapped
    for rank in range(pp):
        mine = [(a.kind, a.microbatch % (m // 2), a.chunk, a.overlapped) for a in computes(schedules[rank])]
        mirror = [(a.kind, a.microbatch % (m // 2), 1 - a.chunk, a.overlapped)
                  for a in computes(schedules[pp - 1 - rank])]
        assert mine == mirror


def test_dualpipe_first_half_is_dualpipev_on_half_the_ranks():
    """DualPipeV is DualPipe cut in half (deepseek-ai/DualPipe README.md and
    dualpipe/dualpipev.py at 3da1bbea: DualPipeV.step is DualPipe.step with the first
    half's ranks, PP ranks for PP/2, M for M/2).  So DualPipe's rank r < PP/2, its copy
    of this side (phase 0) read as DualPipeV's chunk 0, runs DualPipeV's order on PP/2
    ranks and M/2 microbatches, which test_v_orders_are_torchs checks against torch."""
    for pp, m in DUALPIPE_CASES:
        dual, half = build_schedules("dualpipe", pp, m), build_schedules("dualpipev", pp // 2, m // 2)
        for rank in range(pp // 2):
            mine = [(a.kind, a.microbatch - a.chunk * (m // 2), a.chunk, a.overlapped)
                    for a in computes(dual[rank])]
            want = [(a.kind, a.microbatch, a.chunk, a.overlapped) for a in computes(half[rank])]
            assert mine == want, (pp, m, rank)


def test_refusals():
    with pytest.raises(ConfigError, match="at least 8 for dualpipev"):
        build_schedules("dualpipev", 4, 7)
    with pytest.raises(ConfigError, match="must be even for dualpipe"):
        build_schedules("dualpipe", 3, 6)
    with pytest.raises(ConfigError, match="num_microbatches .9. must be even"):
        build_schedules("dualpipe", 4, 9)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedules("dualpipe-v", 4, 8)
    with pytest.raises(ValueError, match="two chunks per rank"):
        Action("forward", 0, 2, placement="v")
    with pytest.raises(ValueError, match="only a forward and a backward"):
        Action("weight", 0, overlapped=True)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6])
def test_v_orders_are_torchs(pp):
    """torch 2.13.0, torch/distributed/pipelining/schedules.py: ScheduleZBVZeroBubble and
    ScheduleDualPipeV (``_calculate_single_rank_operations``), built on stand-in stages
    placed in a V (stage r and 2PP-1-r on rank r).  Every rank's F / I / B / W order, the
    overlapped pairs (torch's OVERLAP_F_B) included, equals ours for every M tried."""
    pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in sorted({1, 2, pp, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp + 1, 4 * pp}):
        assert our_order(build_schedules("zbv", pp, m)) == \
            torch_v_order(pipelining.ScheduleZBVZeroBubble, pp, m), ("zbv", pp, m)
        if m >= 2 * pp:
            assert our_order(build_schedules("dualpipev", pp, m)) == \
                torch_v_order(pipelining.ScheduleDualPipeV, pp, m), ("dualpipev", pp, m)


# The DualPipe table's premise (its figure): F equal to B - W; W <= F; F&B <= F + B.
DUAL_COSTS = [(1, 2, 1, None), (1, 2, 1, 2), (1, 2, 1, Fraction(5, 2)),
              (1, Fraction(3, 2), Fraction(1, 2), None), (2, 3, 1, 4), (2, 4, 2, Fraction(9, 2))]


@pytest.mark.parametrize("f,b,w,fb", DUAL_COSTS)
def test_dualpipe_bubbles_are_the_tables(f, b, w, fb):
    """deepseek-ai/DualPipe README.md (3da1bbea): DualPipe and DualPipeV, (PP/2-1)(F&B+B-3W)
    with PP the pipeline stages: DualPipeV's pp_size ranks hold 2 pp_size stages, DualPipe's
    pp_size ranks pp_size stages (twice).  The rank that idles most idles exactly that long."""
    from tutorial_lib.pipeline_parallel.formulas import expected_bubble_time
    from tutorial_lib.pipeline_parallel.simulator import idle_time
    pair = f + b if fb is None else fb
    for name, cases in (("dualpipev", DUALPIPEV_CASES), ("dualpipe", DUALPIPE_CASES)):
        for pp, m in cases[::3]:
            timed = timelines(name, pp, m, f, b, w, fb)
            stages = 2 * pp if name == "dualpipev" else pp
            formula = (Fraction(stages, 2) - 1) * (pair + b - 3 * w)  # the table, written out
            assert idle_time(timed) == formula == expected_bubble_time(name, pp, f, b, w, fb)


@pytest.mark.parametrize("f", [1, Fraction(1, 2), 2])
def test_zbv_bubble(f):
    """ZBV with F = B - W = W (its paper's setting): every rank idles (PP - 1) F, half of
    ZB-H1's (PP - 1)(F + B - 2W) for the same model (a ZB-H1 stage is two ZBV chunks)."""
    from tutorial_lib.pipeline_parallel.formulas import expected_bubble_time
    from tutorial_lib.pipeline_parallel.simulator import idle_time
    for pp in range(1, 7):
        for m in range(2 * pp - 1, 2 * pp + 4):
            timed = timelines("zbv", pp, m, f, 2 * f, f)
            assert {idle_time(timed, r) for r in range(pp)} == {(pp - 1) * f}
            assert idle_time(timed) == expected_bubble_time("zbv", pp, f, 2 * f, f)
            zb_h1 = timelines("zb-h1", pp, m, 2 * f, 4 * f, 2 * f)
            assert 2 * idle_time(timed) == idle_time(zb_h1)


def test_peak_activations_are_the_tables():
    """The table's activation column, per rank and counted until each W: 1F1B and ZB1P
    PP (rank 0; ZB-H1 every rank), DualPipe PP + 1; DualPipeV PP + 1 with PP its stages
    (2 pp_size chunks of half a stage, + 1); ZBV 2 pp_size chunks, 1F1B's PP stages."""
    from tutorial_lib.pipeline_parallel.formulas import expected_peak_activations
    for name, cases in (("zb-h1", ZB_CASES), ("zbv", V_CASES), ("dualpipev", DUALPIPEV_CASES),
                        ("dualpipe", DUALPIPE_CASES)):
        for pp, m in cases:
            peaks = [peak_activations_in_flight(a) for a in build_schedules(name, pp, m).values()]
            assert peaks == [expected_peak_activations(name, pp, m, r) for r in range(pp)]
            full = {"zb-h1": m >= pp, "zbv": m >= 2 * pp - 1}.get(name, True)
            if full:
                table = {"zb-h1": pp, "zbv": 2 * pp, "dualpipev": 2 * pp + 1,
                         "dualpipe": pp + 1}[name]
                assert set(peaks) == {table}
