"""The executor's pure parts: how a schedule's actions become P2P calls."""
import itertools

import pytest

from tutorial_lib.config import ConfigError
from tutorial_lib.pipeline_parallel.modes import (check_schedule_and_mode, combined_helpers,
                                                  group_actions, helper_name, schedule_steps)
from tutorial_lib.pipeline_parallel import build_schedules
from tutorial_lib.pipeline_parallel.actions import Action

CASES = [(s, pp, m, v) for s in ("gpipe", "1f1b") for pp, m in itertools.product((2, 3, 4), (1, 3, 4, 8))
         for v in (1,)] + [("interleaved", pp, m, 2) for pp in (2, 3, 4) for m in (pp, 2 * pp)]


@pytest.mark.parametrize("schedule,pp,m,v", CASES)
def test_every_run_of_messages_is_one_megatron_helper(schedule, pp, m, v):
    for rank, actions in build_schedules(schedule, pp, m, v).items():
        steps = group_actions(actions, combine=schedule != "gpipe")
        assert [a for step in steps for a in step] == actions  # nothing lost, nothing reordered
        for step in steps:
            if len(step) > 1 or not (step[0].is_compute or "labels" in step[0].kind):
                name = helper_name(step)
                peers = {a.peer for a in step}
                if name in ("send_forward_recv_backward",):
                    assert peers == {(rank + 1) % pp}, "both halves talk to the NEXT rank"
                if name in ("send_backward_recv_forward",):
                    assert peers == {(rank - 1) % pp}, "both halves talk to the PREVIOUS rank"


def test_one_f_one_b_steady_state_uses_the_combined_helpers_and_gpipe_never_does():
    names = {helper_name(step) for step in group_actions(build_schedules("1f1b", 4, 8)[1])
             if not step[0].is_compute}
    assert {"send_forward_recv_backward", "send_backward_recv_forward"} <= names
    gpipe = {helper_name(step) for step in group_actions(build_schedules("gpipe", 4, 8)[1], combine=False)
             if not step[0].is_compute}
    assert gpipe == {"send_forward", "recv_forward", "send_backward", "recv_backward"}


def megatron_non_interleaved_calls(pp: int, m: int, rank: int) -> list[str]:
    """The P2P helpers Megatron-Core's 1F1B calls on pipeline rank ``rank``, in order, with
    the calls that move nothing on that rank left out.

    Written from the loop structure of ``forward_backward_pipelining_without_interleaving``
    (NVIDIA/Megatron-LM, megatron/core/pipeline_parallel/schedules.py, Megatron-Core
    0.20.0, d98e8a64): ``w = min(pp - rank - 1, m)`` warm-up rounds of ``recv_forward``,
    forward, ``send_forward``; one more ``recv_forward`` when steady rounds remain; each
    steady round is forward, ``send_forward_recv_backward``, backward, then
    ``send_backward_recv_forward`` (``send_backward`` in the last round); each cool-down
    round is ``recv_backward``, backward, ``send_backward``.  On the first stage the
    helpers that receive activations or send gradients do nothing (and
    ``send_backward_recv_forward`` as a whole); on the last stage those that send
    activations or receive gradients (``send_forward_recv_backward`` as a whole).
    """
    w = min(pp - rank - 1, m)
    calls = []
    for _ in range(w):
        calls += ["recv_forward", "send_forward"]
    if m - w > 0:
        calls.append("recv_forward")
    for i in range(m - w):
        calls.append("send_forward_recv_backward")
        calls.append("send_backward" if i == m - w - 1 else "send_backward_recv_forward")
    for _ in range(w):
        calls += ["recv_backward", "send_backward"]
    idle = set()
    if rank == 0:
        idle |= {"recv_forward", "send_backward", "send_backward_recv_forward"}
    if rank == pp - 1:
        idle |= {"send_forward", "recv_backward", "send_forward_recv_backward"}
    return [c for c in calls if c not in idle]


@pytest.mark.parametrize("pp,m", [(3, 2), (3, 6), (4, 4), (4, 6), (5, 3), (5, 8)])
def test_one_f_one_b_calls_the_helpers_megatron_calls_in_every_phase(pp, m):
    """Found reading the book: the warm-up's ``send_forward`` + next ``recv_forward`` were one
    ``send_forward_recv_forward`` call and the cool-down's ``send_backward`` + next
    ``recv_backward`` one ``send_backward_recv_backward``, helpers Megatron's
    non-interleaved schedule never calls (only its interleaved one does)."""
    for rank, actions in build_schedules("1f1b", pp, m).items():
        steps = schedule_steps("1f1b", pp, m, rank)  # what the executor runs
        assert [a for step in steps for a in step] == actions
        calls = [helper_name(step) for step in steps
                 if not step[0].is_compute and "labels" not in step[0].kind]
        assert calls == megatron_non_interleaved_calls(pp, m, rank), (pp, m, rank)


def test_combined_helpers_by_schedule():
    assert combined_helpers("gpipe") == ()
    assert set(combined_helpers("1f1b")) == {"send_forward_recv_backward",
                                              "send_backward_recv_forward"}
    assert combined_helpers("interleaved") is None  # any send with the receive after it
    with pytest.raises(ValueError, match="schedule must be one of"):
        combined_helpers("zigzag")
    warmup = build_schedules("1f1b", 4, 6)[1][:4]  # recv, F0, send, recv
    assert len(group_actions(warmup, combine=True)) == 3  # the old grouping: send + recv
    assert len(group_actions(warmup, combine=combined_helpers("1f1b"))) == 4
    assert len(group_actions(warmup, combine=False)) == 4
    # PP 3, M 2, rank 0: two warm-up forwards and no steady state, so the last warm-up
    # send and the first cool-down receive stay two calls (same actions as M - 1 warm-up
    # forwards and one steady round, which would join them)
    rank_0 = build_schedules("1f1b", 3, 2)[0]
    calls = [len(s) for s in group_actions(rank_0, combined_helpers("1f1b"), warmup=2)
             if not s[0].is_compute and "labels" not in s[0].kind]
    assert calls == [1, 1, 1, 1]
    calls = [len(s) for s in group_actions(rank_0, combined_helpers("1f1b"), warmup=1)
             if not s[0].is_compute and "labels" not in s[0].kind]
    assert calls == [1, 2, 1]


def test_labels_are_never_merged_into_an_activation_exchange():
    for actions in build_schedules("1f1b", 3, 4).values():
        for step in group_actions(actions):
            kinds = {a.kind for a in step}
            assert not (kinds & {"send_labels", "recv_labels"}) or len(step) == 1


def test_helper_name_refuses_what_no_helper_does():
    two_sends = [Action("send_activation", 0, 0, 1), Action("send_grad", 0, 0, 1)]
    with pytest.raises(ValueError, match="at most one send"):
        helper_name(two_sends)


def test_the_executor_takes_megatrons_modes_and_refuses_the_blocking_one():
    """The executor checks the pair the way a run does (tests/unit/test_pipeline_schedules.py)."""
    with pytest.raises(ConfigError, match="teaching construct") as error:
        check_schedule_and_mode("interleaved", "sequential")
    assert error.value.rule == "p2p mode"
    with pytest.raises(ConfigError, match="schedule must be one of"):
        check_schedule_and_mode("zigzag", "batched")
    for schedule, mode in itertools.product(("gpipe", "1f1b"), ("overlapped", "batched")):
        check_schedule_and_mode(schedule, mode, 2)