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
from tutorial_lib.pipeline_schedules import (
    COSTS, Action, OrderError, build_schedules, makespan, peak_activations_in_flight, simulate,
    split_backwards, zb_h1,
)

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
    for m in range(pp, 3 * pp + 2):
        if m % max(1, m // pp):  # torch refuses M not a multiple of its rounds
            continue
        want = {}
        for rank in range(pp):
            stage = StandInStage(rank, pp, rank, pp)
            want[rank] = torch_order(pipelining.ScheduleInterleavedZeroBubble, [stage], m)[rank]
        assert our_order(build_schedules("zb-h1", pp, m)) == want, (pp, m)
