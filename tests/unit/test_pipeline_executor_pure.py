"""The executor's pure parts: how a schedule's actions become P2P calls."""
import itertools

import pytest

from tutorial_lib.config import ConfigError
from tutorial_lib.pipeline import check_schedule_and_mode, group_actions, helper_name
from tutorial_lib.pipeline_schedules import Action, build_schedules

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