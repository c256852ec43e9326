"""P2P modes, and which of Megatron's P2P helper calls a schedule's messages become (chapter 7).

Consecutive sends and receives of activations and gradients become the calls of
Megatron's P2P helpers (``send_forward_recv_backward`` and so on) that the schedule
makes, run in the chosen P2P mode: :func:`group_actions` and :func:`helper_name`, two
pure functions, make that grouping, and :func:`combined_helpers` says which pairs each
schedule combines.  1F1B calls exactly what Megatron-Core's non-interleaved schedule
calls: ``recv_forward`` / ``send_forward`` in the warm-up, the two combined helpers in
the steady state (after its first ``recv_forward``, before its last ``send_backward``),
``recv_backward`` / ``send_backward`` in the cool-down.  The interleaved schedule may
also combine a send and a receive of the same direction, as Megatron's does.  GPipe
is the exception: each message is its own call.  The combined helpers are made for
1F1B, where rank ``r``'s ``send_forward_recv_backward`` always meets rank ``r + 1``'s
``send_backward_recv_forward``.  At GPipe's turn from forwards to backwards a rank
would combine "send my last activation, receive the first gradient" while its
neighbour is still receiving activations, one call waiting on a gradient that cannot
come yet.  The executor runs Megatron's two P2P modes, batched and overlapped
(:func:`check_schedule_and_mode`).

Everything here is pure: a run's (schedule, mode) pair is checked
(:func:`check_schedule_and_mode`) before torch is loaded.
"""
from __future__ import annotations

from ..config import ConfigError
from . import build_schedules
from .actions import ALL_SCHEDULES, Action
from .schedules import num_warmup_microbatches


P2P_MODES = ("sequential", "overlapped", "batched")
"""How :mod:`tutorial_lib.p2p` issues a step's sends and receives (``p2p.MODES``); named here,
without torch, so that a run's arguments can be checked before torch is loaded."""

TRAINING_P2P_MODES = ("batched", "overlapped")
"""The modes a training run takes: Megatron's two (``batch_p2p_comm`` on or off).
``sequential`` (blocking send, then blocking receive) is chapter 7's teaching construct:
Megatron has no such mode."""


LABEL_KINDS = ("send_labels", "recv_labels")

#: One message stream per payload: gloo and NCCL match messages between two ranks in
#: order (per tag), so activations, gradients and labels that share a pair of ranks
#: (PP = 2, or the interleaved schedule's wrap-around) must not queue behind each other.
TAGS = {"activation": 1, "grad": 2, "labels": 3, "model_copy": 4}

_HELPERS = {
    (("send", "activation"),): "send_forward",
    (("recv", "activation"),): "recv_forward",
    (("send", "grad"),): "send_backward",
    (("recv", "grad"),): "recv_backward",
    (("send", "activation"), ("recv", "grad")): "send_forward_recv_backward",
    (("send", "grad"), ("recv", "activation")): "send_backward_recv_forward",
    (("send", "activation"), ("recv", "activation")): "send_forward_recv_forward",
    (("send", "grad"), ("recv", "grad")): "send_backward_recv_backward",
}


def check_schedule_and_mode(schedule: str, p2p_mode: str, pp_size: int | None = None) -> None:
    """Refuse unknown names and every (schedule, P2P mode) pair Megatron does not run.

    What Megatron-Core 0.20.0 allows, and so what a run here accepts:

    * ``sequential`` with any schedule: refused.  Megatron's P2P layer has two paths,
      ``_batched_p2p_ops`` and ``_p2p_ops``, and both post every send and receive of
      a call before waiting for any; nothing sends, blocks, then receives.
    * ``1f1b`` with ``batched`` (Megatron-LM's only choice without interleaving: its
      argument check turns ``overlap_p2p_comm`` off, and ``batch_p2p_comm = not
      overlap_p2p_comm``) or ``overlapped`` (Megatron-Core's ``batch_p2p_comm=False``:
      the unbatched ``_p2p_ops``, every helper waiting before it returns).
    * ``interleaved`` with ``overlapped`` (Megatron-LM's default with interleaving) at
      any ``PP >= 2``, or with ``batched`` (``--no-overlap-p2p-communication``) only at
      ``PP > 2``: Megatron-LM's ``validate_args`` asserts it, because at ``PP = 2`` one
      batch would hold two sends and two receives between the same two ranks.
    * ``gpipe`` is the course's schedule (Megatron has none); it runs with Megatron's
      two modes.  So do chapter 11's (:data:`~.actions.SPLIT_BACKWARD_SCHEDULES`; Megatron has none
      of them either): the executor posts every one of their sends at once and waits
      for it at the end of the step, in either mode.

    ``pp_size``: the pipeline size, for the last rule (``None``: not checked).
    """
    if schedule not in ALL_SCHEDULES:
        raise ConfigError("malformed", f"schedule must be one of "
                                       f"{', '.join(ALL_SCHEDULES)}, got {schedule!r}")
    if p2p_mode not in P2P_MODES:
        raise ConfigError("malformed", f"p2p_mode must be one of {', '.join(P2P_MODES)}, "
                                       f"got {p2p_mode!r}")
    if p2p_mode not in TRAINING_P2P_MODES:
        raise ConfigError(
            "p2p mode",
            f"p2p_mode {p2p_mode!r} (a blocking send, then a blocking receive) is chapter 7's "
            f"teaching construct, not a mode Megatron has: its batched and unbatched paths "
            f"both post every send and receive before waiting.  Use --p2p-mode batched "
            f"(Megatron's default) or overlapped (batch_p2p_comm=False)")
    if schedule == "interleaved" and p2p_mode == "batched" and pp_size is not None \
            and pp_size <= 2:
        raise ConfigError(
            "interleaved schedule",
            f"the interleaved schedule with batched P2P (overlap_p2p_comm off) needs "
            f"pipeline_model_parallel_size > 2, got {pp_size}: at PP = 2 the previous and "
            f"the next rank are the same, and one batch would send and receive twice "
            f"between the same two ranks (Megatron-LM's validate_args refuses it).  Use "
            f"--p2p-mode overlapped (Megatron's default with interleaving) or PP >= 3")


# --- which P2P call each run of messages is (pure) ------------------------------------


#: The helpers that send and receive in one call, by schedule (``None``: any send
#: followed by a receive).  Megatron-Core 0.20.0's non-interleaved schedule
#: (``forward_backward_pipelining_without_interleaving``) calls only the two steady-state
#: ones: its warm-up sends each activation with ``send_forward`` and receives the next
#: with ``recv_forward``, its cool-down likewise with ``send_backward`` and
#: ``recv_backward``.  Its interleaved schedule also pairs two messages of one direction
#: (``send_forward_recv_forward``, ``send_backward_recv_backward``).
COMBINED_HELPERS = {
    "gpipe": (),
    "1f1b": ("send_forward_recv_backward", "send_backward_recv_forward"),
    "interleaved": None,
    # chapter 11's schedules (Megatron has none of them): every message its own call,
    # every send posted at once and waited on at the end of the step
    "zb-h1": (), "zbv": (), "dualpipev": (), "dualpipe": (),
}


def combined_helpers(schedule: str) -> tuple[str, ...] | None:
    """The helpers that ``schedule`` calls with a send and a receive together
    (:data:`COMBINED_HELPERS`); ``None``: every pair."""
    if schedule not in COMBINED_HELPERS:
        raise ValueError(f"schedule must be one of {', '.join(COMBINED_HELPERS)}, got {schedule!r}")
    return COMBINED_HELPERS[schedule]


def group_actions(actions: list[Action], combine=True,
                  warmup: int | None = None) -> list[list[Action]]:
    """Split a rank's list into steps: one compute, one label message, or one P2P call.

    A P2P call is one send and/or one receive of activations or gradients between two
    computes, the call of the Megatron helper :func:`helper_name` names.  ``combine``:
    ``True`` (or ``None``) joins any send with the receive after it; a collection of
    helper names joins only those pairs (``combined_helpers("1f1b")``: the two
    steady-state helpers); ``False`` (or empty) makes every message its own step (what
    GPipe uses).  ``warmup``: 1F1B's warm-up forwards on this rank; the activation of a
    warm-up forward is sent alone (``send_forward``), even when the cool-down's first
    receive follows at once (a rank whose warm-up takes every microbatch has no steady
    state).  :func:`schedule_steps` passes both for a schedule.
    """
    def is_p2p(a: Action) -> bool:
        return not a.is_compute and a.kind not in LABEL_KINDS

    if combine is None:
        combine = True
    joinable = None if combine is True else set(combine or ())

    def joins(run: list[Action], a: Action) -> bool:
        if not (is_p2p(a) and is_p2p(run[0])):
            return False
        if joinable is None:
            return True
        if len(run) != 1 or not (run[0].kind.startswith("send") and a.kind.startswith("recv")):
            return False
        if warmup is not None and run[0].kind == "send_activation" and run[0].microbatch < warmup:
            return False  # the end of the warm-up: send_forward
        return helper_name(run + [a]) in joinable

    steps: list[list[Action]] = []
    for a in actions:
        if steps and joins(steps[-1], a):
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


def schedule_steps(schedule: str, pp_size: int, num_microbatches: int, rank: int,
                   virtual_pipeline_size: int = 1) -> list[list[Action]]:
    """Pipeline rank ``rank``'s action list of ``schedule``, cut into the steps the
    executor runs: computes, label messages, and the P2P helper calls Megatron's schedule
    makes (:func:`group_actions` with :func:`combined_helpers` and, for 1F1B, the rank's
    warm-up count)."""
    actions = build_schedules(schedule, pp_size, num_microbatches,
                              virtual_pipeline_size)[rank]
    warmup = (num_warmup_microbatches(pp_size, num_microbatches, rank)
              if schedule == "1f1b" else None)
    return group_actions(actions, combined_helpers(schedule), warmup=warmup)


def helper_name(run: list[Action]) -> str:
    """The Megatron P2P helper a run of consecutive sends/receives amounts to."""
    key = tuple((a.kind.split("_")[0], a.kind.split("_")[1]) for a in run)
    if key not in _HELPERS:
        raise ValueError(f"no P2P helper sends/receives {[a.label for a in run]}: a "
                         f"run holds at most one send followed by at most one receive")
    return _HELPERS[key]
