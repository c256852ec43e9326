"""Run a pipeline schedule with real stages: the executor (chapter 6).

:mod:`tutorial_lib.pipeline_schedules` says, for each pipeline rank, the ordered list of
actions of one training step; :mod:`tutorial_lib.p2p` moves tensors between neighbours.
:func:`forward_backward_pipelining` walks one rank's list and does each action for real
(``i`` is a microbatch, ``c`` a chunk of this rank, which runs model stage
``c * PP + rank``)::

    recv_activation i c  -> a tensor [s, b, h] from the previous model stage
                            (it will need a gradient)
    recv_labels i        -> the last model stage receives i's labels from the first
    forward i c          -> chunk c's forward_stage on that input;
                            on the last model stage: the loss / M
    send_activation i c  -> the output to the next model stage
    recv_grad i c        -> the gradient of that output, from the next model stage
    backward i c         -> autograd from the output (with that gradient, or from the
                            loss); B alone where the list also holds weight i c
    weight i c           -> W: the weight gradients that B left (issue 20)
    send_grad i c        -> the gradient of the input, to the previous model stage
    send_labels i        -> the first model stage sends i's labels to the last

**B and W** (chapter 11).  A schedule that splits a backward runs B, the gradient of the
stage's input (what the previous stage waits for), and later W, the weights' gradients
(what nobody waits for): :func:`backward_input` and :func:`backward_weight`, the same
autograd nodes on the same tensors as one backward, so the same gradients bit for bit.
Where a schedule places two stages on one rank (the V of ZBV and DualPipeV; the
placement is the action's, :func:`~tutorial_lib.pipeline_schedules.model_stage`), the
activation and its gradient pass between the rank's two chunks without a message.
DualPipe's two chunks are two copies of the model: after the last backward each weight's
gradient is summed with its twin's (:func:`sum_model_copy_gradients`).  An overlapped
pair (DualPipe's ``F&B``: a forward directly followed by a backward, both marked
``overlapped``) runs in two threads that take turns at every all-to-all
(:class:`Turns`): one half's MoE dispatch or combine is in flight while the other half
computes.

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
(:func:`~tutorial_lib.pipeline_schedules.check_schedule_and_mode`).
Labels are different: the first model stage sends a microbatch's labels *before* its
forward, and the last model stage receives them only after that microbatch's
activation has crossed the whole pipeline.  A blocking send would wait for that
receive, and the activation it waits for can never be computed: so labels always go
with ``isend``, waited on at the end of the step.  (Megatron avoids the message
altogether: its first and last stages both read the batch from the data loader.
This course sends them to show the path.)

After the last backward (or W) every parameter gradient is complete; the caller syncs them
once over the data-parallel groups (:class:`~tutorial_lib.data_parallel.DataParallel`
with every backward inside ``no_sync``).

Trace: each forward and backward is a ``compute`` span named ``forward``/``backward``
tagged ``microbatch`` and ``chunk`` (a B also ``part="input"``; a W is named
``weight``; the two halves of an overlapped pair are tagged ``overlapped``, ``pair`` and
``half``, and each stretch a half computes is a ``turn`` span); every P2P op carries
``p2p_op`` (the helper name), ``p2p_mode``, ``microbatch`` and ``chunk``.  That is what
the chapter's timeline draws next to the planned schedule.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from . import comm, parallel_state
from .config import ConfigError
from .deepseek import Microbatch
from .devices import module_device, resolve_device
from .p2p import communicate
from .pipeline_schedules import (PAYLOAD, SCHEDULE_PLACEMENT, TWO_CHUNK_SCHEDULES, Action,
                                 build_schedules, check_schedule_and_mode, model_stage,
                                 num_model_stages, num_warmup_microbatches, split_backwards,
                                 stage_holder)
from .tensor_parallel import SavedTensorBytes
from .trace import TraceEvent, get_tracer

__all__ = ["StepOutput", "PipelineExecutor", "forward_backward_pipelining",
           "helper_name", "group_actions", "combined_helpers", "schedule_steps",
           "WeightGradWork", "backward_input", "backward_weight", "Turns",
           "overlapped_all_to_alls",
           "check_schedule_and_mode",
           "SyntheticStage", "synthetic_chunks", "check_chunks",
           "MODEL_COPY_ATTR", "mark_model_copies", "sum_model_copy_gradients",
           "synthetic_microbatches", "synthetic_run_name",
           "measure_synthetic_schedules"]

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
    # issue 20's schedules (Megatron has none of them): every message its own call,
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


# --- the backward in two parts: B (input gradient) and W (weight gradients) -----------


def _grad_node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or for a leaf
    its gradient accumulator (made on demand, through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reaching(parents: dict, targets) -> set:
    """The nodes from which one of ``targets`` is reached in the backward graph."""
    found, todo = set(targets), list(targets)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in found:
                found.add(parent)
                todo.append(parent)
    return found


@dataclass
class WeightGradWork:
    """What B leaves for W: where the weight gradients leave the input gradient's path.

    ``junctions``: for every node on the path from the stage's output to its input that
    also feeds a weight, the gradient it received in B and the edges towards the weights
    (``(node, grad_outputs, edges)``).  ``output`` / ``output_grad``: the stage's output
    and its gradient, for a stage without an input gradient (the first), whose whole
    backward is W.
    """

    junctions: list = field(default_factory=list)
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


def backward_input(output: torch.Tensor, output_grad: torch.Tensor | None,
                   stage_input: torch.Tensor | None) -> tuple:
    """B: the gradient of the stage's input only; returns ``(input_grad, work for W)``.

    Autograd runs from ``output`` (with ``output_grad``; ``None`` for a scalar loss) to
    ``stage_input`` alone, so it visits only the nodes on that path (the MoE all-to-alls
    included) and skips every weight gradient; the graph is kept.  A hook on each
    *junction* (a node of that path with an edge towards a weight) records the gradient
    that reached it, where :func:`backward_weight` starts later.  The same split as
    ``torch.distributed.pipelining``'s ``stage_backward_input`` /
    ``stage_backward_weight`` (torch 2.13.0, ``torch/distributed/pipelining/_backward.py``),
    with two differences: W re-runs each junction for its weight-side outputs only (one
    junction at a time, so a junction below another is not counted twice), and W's last
    pass runs through the parameters' gradient accumulators, so gradient hooks fire as in
    a plain backward (:class:`~tutorial_lib.data_parallel.DataParallel`'s ``main_grad``
    buckets, ZeRO-1's fp32 accumulation).  With no ``stage_input`` (the first model
    stage: nothing to send back) B does nothing and W is the whole backward, as in torch's
    ``PipelineStage.backward_one_chunk``.
    """
    if stage_input is None:
        return None, WeightGradWork(output=output, output_grad=output_grad)
    root, target = output.grad_fn, _grad_node(stage_input)
    parents: dict = {}  # the backward graph reversed: node -> the nodes with an edge to it
    seen, todo = {root}, [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                todo.append(child)
    on_path = _reaching(parents, [target])
    accumulators = [n for n in seen if not n.next_functions and n is not target
                    and type(n).__name__ == "AccumulateGrad"]
    feeds_weight = _reaching(parents, accumulators)
    junctions = []
    for node in on_path:
        edges = [(child, nr) for child, nr in node.next_functions
                 if child is not None and child not in on_path and child in feeds_weight]
        if edges:
            junctions.append([node, None, edges])
    handles = []
    for junction in junctions:
        def record(grad_outputs, junction=junction):
            junction[1] = grad_outputs
        handles.append(junction[0].register_prehook(record))
    try:
        (input_grad,) = torch.autograd.grad(output, stage_input, output_grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, WeightGradWork([j for j in junctions if j[1] is not None])


def backward_weight(work: WeightGradWork) -> None:
    """W: the weight gradients B deferred, accumulated into ``.grad`` (hooks fire).

    For each junction: its gradients towards the weights, from the gradient it received
    in B; then one backward from all those edges into the parameters.
    """
    from torch.autograd.graph import GradientEdge

    if work.output is not None:  # the first stage: the whole backward
        torch.autograd.backward(work.output, work.output_grad)
        return
    roots, grads = [], []
    for node, grad_outputs, edges in work.junctions:
        outputs = [GradientEdge(node, k) for k, g in enumerate(grad_outputs) if g is not None]
        seeds = [g for g in grad_outputs if g is not None]
        targets = [GradientEdge(child, nr) for child, nr in edges]
        found = torch.autograd.grad(outputs, targets, seeds, retain_graph=True,
                                    allow_unused=True)
        roots += [t for t, g in zip(targets, found) if g is not None]
        grads += [g for g in found if g is not None]
    if roots:
        torch.autograd.backward(roots, grads)


# --- an overlapped forward-backward pair: two threads taking turns --------------------


class Turns:
    """Two halves of an overlapped pair (0: the forward, 1: the backward), one thread
    each, of which exactly one runs at any time.

    A half runs until it issues an all-to-all (:func:`tutorial_lib.comm.overlap_switch`),
    then :meth:`switch` hands the turn to the other half and waits for it to come back;
    the all-to-all proceeds on gloo's own threads (NCCL: its own stream) meanwhile, and is
    waited on only when the turn returns.  The order of everything a rank issues is then
    fixed (forward first; then each half up to its next all-to-all, in turn), the same on
    every rank of an EP group, so their collectives pair up as without overlap.  Each
    stretch a half holds the turn is recorded as a ``compute`` span named ``turn``
    (tagged ``half``: ``forward`` / ``backward``, ``microbatch``, ``chunk``, ``piece``,
    and, as every event of the pair, ``pair``: ``"F5.1&B2.0"``).
    """

    def __init__(self, actions: tuple):
        self.actions = actions
        self.pair = f"{actions[0].label}&{actions[1].label}"
        self.condition = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.pieces = [0, 0]
        self.started: list = [None, None]
        self.tracer = get_tracer()

    def _begin(self, me: int) -> None:
        self.started[me] = time.time()

    def _end(self, me: int) -> None:
        action = self.actions[me]
        event = TraceEvent(rank=self.tracer.rank, op="compute", t_start=self.started[me],
                           t_end=time.time(),
                           tags={**self.tracer.current_tags(), "name": "turn",
                                 "half": ("forward", "backward")[me],
                                 "microbatch": action.microbatch, "chunk": action.chunk,
                                 "pair": self.pair, "piece": self.pieces[me]})
        self.pieces[me] += 1
        if self.tracer.enabled:
            self.tracer.events.append(event)

    def wait_for_turn(self, me: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == me)
        self._begin(me)

    def switch(self, me: int) -> None:
        """Give the turn to the other half (unless it has finished) and wait for it back."""
        with self.condition:
            if self.done[1 - me]:
                return
            self._end(me)
            self.turn = 1 - me
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == me)
        self._begin(me)

    def finish(self, me: int) -> None:
        with self.condition:
            self._end(me)
            self.done[me] = True
            self.turn = 1 - me
            self.condition.notify_all()


def overlapped_all_to_alls(events) -> list[dict]:
    """Each all-to-all run inside an overlapped pair, from a recorded trace (pure).

    ``events``: a :class:`~tutorial_lib.trace.Trace` or its events.  One row per
    all-to-all tagged ``overlapped``: ``rank``, ``pair``, ``half`` (whose it is),
    ``op_name`` (``dispatch`` / ``combine``, ...), ``microbatch``, ``chunk``, ``seconds``
    (issue to wait) and ``hidden_seconds``: the part of that interval during which the
    pair's other half was computing (its ``turn`` spans on the same rank), the time the
    all-to-all cost nobody.  The other tags that tell steps and runs apart (``run``,
    ``repeat``, ``step``) must match too.
    """
    def key(e):
        return (e.rank, e.tags.get("run"), e.tags.get("repeat"), e.tags.get("step"),
                e.tags.get("pair"))

    turns: dict = {}
    for e in events:
        if e.op == "compute" and e.tags.get("name") == "turn":
            turns.setdefault((key(e), e.tags["half"]), []).append(e)
    rows = []
    for e in events:
        if e.op != "all_to_all" or not e.tags.get("overlapped"):
            continue
        other = "backward" if e.tags["half"] == "forward" else "forward"
        hidden = sum(max(0.0, min(e.t_end, t.t_end) - max(e.t_start, t.t_start))
                     for t in turns.get((key(e), other), ()))
        rows.append({"rank": e.rank, "pair": e.tags["pair"], "half": e.tags["half"],
                     "op_name": e.tags.get("op_name"), "microbatch": e.tags.get("microbatch"),
                     "chunk": e.tags.get("chunk"), "seconds": e.t_end - e.t_start,
                     "hidden_seconds": hidden})
    return rows


# --- the executor ---------------------------------------------------------------------


@dataclass
class StepOutput:
    """What one pipeline step leaves on this rank."""

    losses: dict[int, float] = field(default_factory=dict)
    """Microbatch -> its mean language-model loss (on the last model stage; empty
    elsewhere)."""
    peak_activations: int = 0
    """Most (microbatch, chunk) activations this rank held at once."""
    actions: int = 0
    """Actions executed (the schedule's length on this rank)."""
    activation_bytes: dict = field(default_factory=dict)
    """``(microbatch, chunk)`` -> bytes its forward saved for backward (autograd's saved
    tensors, :class:`~tutorial_lib.tensor_parallel.SavedTensorBytes`; chapter 10)."""
    peak_activation_bytes: int = 0
    """Most of those bytes this rank held at once: a forward's from its end to its
    backward's start, or to its W where split; an overlapped pair's forward in before its
    backward out (the list's order, which :func:`tutorial_lib.costs.memory_per_rank` walks)."""


class PipelineExecutor:
    """This rank's tensors in flight during one pipeline step, and how each action runs.

    ``rank`` is this rank's place in its pipeline group of ``pp`` ranks; the other
    arguments are :func:`forward_backward_pipelining`'s.  ``defer_sends``: post every
    P2P send and wait for it only at the end of the step (``deferred_sends``) instead
    of at once.  Every table is keyed by ``(microbatch, chunk)``.  An entry appears
    with the action that makes its tensor and leaves with the action that uses it up,
    so ``outputs`` holds exactly the activations kept for a backward still to come.
    """

    def __init__(self, chunks: list, microbatches: list[Microbatch], rank: int, pp: int,
                 p2p_mode: str, tensor_shape: tuple | None, dtype: torch.dtype,
                 defer_sends: bool, device=None, split_backward: bool = False,
                 placement: str = "loop", split=()):
        self.chunks, self.microbatches = chunks, microbatches
        self.device = module_device(chunks[0]) if device is None else torch.device(device)
        self.rank, self.pp = rank, pp
        self.p2p_mode, self.tensor_shape, self.dtype = p2p_mode, tensor_shape, dtype
        self.pp_ranks = parallel_state.get_group_ranks("pp") if pp > 1 else [0]
        self.placement = placement
        # the model stage with the loss (of each copy, in DualPipe's two copies)
        self.last_stage = num_model_stages(placement, pp, len(chunks)) - 1
        self.split = set(split)  # (microbatch, chunk): the backwards split into B and W
        self.tracer = get_tracer()
        self.inputs: dict[tuple, torch.Tensor] = {}  # received activations
        self.outputs: dict[tuple, torch.Tensor] = {}  # forward outputs (last: loss / M)
        self.output_grads: dict[tuple, torch.Tensor] = {}  # received output gradients
        self.input_grads: dict[tuple, torch.Tensor] = {}  # input gradients, to send
        self.labels = {i: batch.labels for i, batch in enumerate(microbatches)}
        self.losses: dict[int, float] = {}
        self.peak_activations = 0
        self.activation_bytes: dict[tuple, int] = {}  # what each forward saved for backward
        self.held_bytes = self.peak_activation_bytes = 0
        self.pair_releases: list | None = None  # inside an overlapped pair: freed at its end
        self.label_sends: list = []  # the labels' isends, waited on at the step's end
        self.defer_sends = defer_sends
        self.deferred_sends: list = []  # with defer_sends: P2P sends not waited on yet
        self.keep_alive: list = []  # what those sends read: it must outlive them
        self.split_backward = split_backward
        self.weight_work: dict[tuple, WeightGradWork] = {}  # B done, W still to come

    def run_forward(self, action: Action) -> None:
        """Chunk ``c``'s forward of microbatch ``i``; keep the output."""
        i, c = action.microbatch, action.chunk
        batch = self.microbatches[i]
        is_last = action.model_stage(self.rank, self.pp) == self.last_stage
        if is_last:  # the labels, received from the first model stage
            batch = batch._replace(labels=self.labels[i])
        with self.tracer.tags(microbatch=i, chunk=c), \
                self.tracer.span("forward", microbatch=i, chunk=c), \
                SavedTensorBytes(self.chunks[c].parameters()) as saved:
            output = self.chunks[c].forward_stage(self.inputs.get((i, c)), batch)
        self.activation_bytes[(i, c)] = saved.bytes
        self.held_bytes += saved.bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.held_bytes)
        if is_last:
            self.losses[i] = float(output.detach())
            output = output / len(self.microbatches)
        else:  # the V's turn: the next stage is this rank's other chunk, no message
            local = self._local_chunk(action, +1)
            if local is not None:
                self.inputs[(i, local)] = output.detach().requires_grad_()
        self.outputs[(i, c)] = output
        self.peak_activations = max(self.peak_activations, self.activations_held)

    def run_backward(self, action: Action) -> None:
        """Backward from the kept output: from the loss or the gradient received.

        With ``split_backward``: B then W at once (:meth:`run_backward_input`,
        :meth:`run_backward_weight`), the same gradients in another order of work.
        """
        if self.split_backward:
            self.run_backward_input(action)
            self.run_backward_weight(action)
            return
        i, c = action.microbatch, action.chunk
        stage = action.model_stage(self.rank, self.pp)
        output, stage_input = self.outputs.pop((i, c)), self.inputs.pop((i, c), None)
        self._release((i, c))
        with self.tracer.tags(microbatch=i, chunk=c), \
                self.tracer.span("backward", microbatch=i, chunk=c):
            if stage == self.last_stage:
                torch.autograd.backward(output)
            else:
                grad = self.output_grads.pop((i, c))
                torch.autograd.backward(output, grad_tensors=grad)
        if stage > 0:  # the gradient to send back to the previous model stage
            self._input_grad(action, stage_input.grad)

    def run_backward_input(self, action: Action) -> None:
        """B: the gradient of the stage's input (to send back); W's work is kept."""
        i, c = action.microbatch, action.chunk
        stage = action.model_stage(self.rank, self.pp)
        output, stage_input = self.outputs.pop((i, c)), self.inputs.pop((i, c), None)
        grad = None if stage == self.last_stage else self.output_grads.pop((i, c))
        with self.tracer.tags(microbatch=i, chunk=c), \
                self.tracer.span("backward", microbatch=i, chunk=c, part="input"):
            input_grad, self.weight_work[(i, c)] = backward_input(
                output, grad, stage_input if stage > 0 else None)
        if stage > 0:
            self._input_grad(action, input_grad)

    def run_backward_weight(self, action: Action) -> None:
        """W: the weight gradients of a microbatch whose B has run."""
        i, c = action.microbatch, action.chunk
        self._release((i, c))  # B kept the graph until W
        with self.tracer.tags(microbatch=i, chunk=c), \
                self.tracer.span("weight", microbatch=i, chunk=c):
            backward_weight(self.weight_work.pop((i, c)))

    def _release(self, key: tuple) -> None:
        """The bytes a forward saved leave the count: at its backward, or at its W when
        split.  Inside an overlapped pair, only once both halves are done (see
        :meth:`run_overlapped`)."""
        if self.pair_releases is not None:
            self.pair_releases.append(key)
        else:
            self.held_bytes -= self.activation_bytes[key]

    @property
    def activations_held(self) -> int:
        """(microbatch, chunk) pairs whose activations autograd keeps: from the forward
        to the backward, or to the W of a split backward (B keeps the graph for W)."""
        return len(self.outputs) + len(self.weight_work)

    def _local_chunk(self, action: Action, step: int) -> int | None:
        """This rank's chunk that runs the model stage ``step`` after (``+1``) or before
        (``-1``) the action's, when this rank holds it (the V's turn); else ``None``."""
        stage = action.model_stage(self.rank, self.pp) + step
        if not 0 <= stage <= self.last_stage:
            return None
        copy = action.chunk if self.placement == "dual" else 0
        rank, chunk = stage_holder(self.placement, stage, self.pp, copy)
        return chunk if rank == self.rank else None

    def _input_grad(self, action: Action, grad: torch.Tensor) -> None:
        """The input's gradient: to send, or to hand to this rank's previous stage."""
        key = (action.microbatch, action.chunk)
        local = self._local_chunk(action, -1)
        if local is None:
            self.input_grads[key] = grad
        else:
            self.output_grads[(action.microbatch, local)] = grad

    def run_overlapped(self, forward: Action, backward: Action) -> None:
        """DualPipe's ``F&B``: ``forward`` and ``backward`` (of other microbatches) as one
        step, each all-to-all of one issued asynchronously while the other computes.

        The forward runs in this thread, the backward in a second one; :class:`Turns`
        lets one run at a time, switching at each all-to-all (where DualPipe switches
        between its two streams' kernels).  The gradients are the same as running the
        two one after the other: the same operations on the same tensors."""
        # while the pair runs, the forward's new activations and the backward's (freed
        # only once its B is done) are alive together: count the pair as the list orders it
        # (the bytes too: the backward's are released once the pair is done, whichever
        # half the turns finish first, so the peak is the list's order, forward then backward)
        self.peak_activations = max(self.peak_activations, self.activations_held + 1)
        self.pair_releases = []
        turns = Turns((forward, backward))
        tags = self.tracer.current_tags()
        errors: list = []

        def half(me: int, action: Action) -> None:
            if me:
                self.tracer.adopt_tags(tags)
            try:
                turns.wait_for_turn(me)
                with comm.overlap_switch(lambda: turns.switch(me)), \
                        self.tracer.tags(overlapped=True, pair=turns.pair,
                                         half=("forward", "backward")[me]):
                    self.run_compute(action)
            except BaseException as error:  # noqa: BLE001 - raised below, in this thread
                errors.append(error)
            finally:
                turns.finish(me)

        other = threading.Thread(target=half, args=(1, backward), daemon=True)
        other.start()
        half(0, forward)
        other.join()
        released, self.pair_releases = self.pair_releases, None
        for key in released:
            self._release(key)
        if errors:
            raise errors[0]

    def run_compute(self, action: Action) -> None:
        """A ``forward``, a ``backward`` (B where the schedule splits it), a ``weight`` (W)."""
        if action.kind == "forward":
            self.run_forward(action)
        elif action.kind == "weight":
            self.run_backward_weight(action)
        elif (action.microbatch, action.chunk) in self.split:
            self.run_backward_input(action)
        else:
            self.run_backward(action)

    def run_p2p(self, messages: list[Action]) -> None:
        """One Megatron P2P helper: at most one send, then at most one receive."""
        name = helper_name(messages)
        send = recv = None
        send_tag = recv_tag = 0
        for a in messages:
            key, peer = (a.microbatch, a.chunk), self.pp_ranks[a.peer]
            if a.kind == "send_activation":
                send, send_tag = (self.outputs[key].detach(), peer), TAGS["activation"]
            elif a.kind == "send_grad":
                send, send_tag = (self.input_grads.pop(key), peer), TAGS["grad"]
            else:
                recv = (tuple(self.tensor_shape), self.dtype, peer)
                recv_tag = TAGS[PAYLOAD[a.kind]]
        first, last = messages[0], messages[-1]
        unwaited = self.deferred_sends if self.defer_sends else None
        with self.tracer.tags(microbatch=first.microbatch, chunk=first.chunk):
            received = communicate(name, self.p2p_mode, send=send, recv=recv,
                                    send_tag=send_tag, recv_tag=recv_tag,
                                    unwaited_sends=unwaited, device=self.device)
        if self.defer_sends and send is not None:
            self.keep_alive.append(send[0])
        # a receive is always the run's last message
        if last.kind == "recv_activation":
            self.inputs[(last.microbatch, last.chunk)] = received.requires_grad_()
        elif last.kind == "recv_grad":
            self.output_grads[(last.microbatch, last.chunk)] = received

    def move_labels(self, action: Action) -> None:
        """First model stage: ``isend`` the labels; last: receive them (blocking)."""
        peer = self.pp_ranks[action.peer]
        with self.tracer.tags(microbatch=action.microbatch, p2p_op=action.kind,
                              p2p_mode="isend"):
            if action.kind == "send_labels":
                self.label_sends.append(comm.isend(self.labels[action.microbatch], peer,
                                                   group="pp", tag=TAGS["labels"]))
            else:
                rows = self.microbatches[action.microbatch].sample_ids.shape[0]
                buffer = torch.empty((rows, self.tensor_shape[0]), dtype=torch.int64,
                                     device=self.device)
                self.labels[action.microbatch] = comm.recv(buffer, peer, group="pp",
                                                           tag=TAGS["labels"])


def check_chunks(schedule: str, num_chunks: int) -> None:
    """Refuse a number of model chunks per rank the schedule cannot run."""
    if schedule == "interleaved":
        if num_chunks < 2:
            raise ValueError("the interleaved schedule needs at least 2 chunks per rank "
                             "(virtual_pipeline_model_parallel_size >= 2)")
    elif schedule in TWO_CHUNK_SCHEDULES:
        if num_chunks != 2:
            raise ValueError(f"{schedule!r} runs 2 chunks per rank (a V, or DualPipe's two "
                             f"model copies), got {num_chunks}")
    elif num_chunks != 1:
        raise ValueError(f"{schedule!r} runs one chunk per rank, got {num_chunks}; "
                         f"use schedule='interleaved'")


def forward_backward_pipelining(chunks: list, microbatches: list[Microbatch],
                                schedule: str = "1f1b", p2p_mode: str = "batched",
                                tensor_shape: tuple | None = None,
                                dtype: torch.dtype = torch.float32, device=None,
                                split_backward: bool = False) -> StepOutput:
    """Run one step's forwards and backwards on this pipeline rank; every rank calls it.

    ``chunks``: this rank's model chunks (a ``DeepSeekModel`` of one model stage each):
    one, or ``V`` for the interleaved schedule, chunk ``c`` being model stage
    ``c * PP + rank``.
    ``microbatches``: the ``M`` microbatches in order (``input_ids`` and ``labels`` on
    the first model stage, ``None`` elsewhere; ``sample_ids`` and ``step`` everywhere).
    ``tensor_shape``: the activation ``[s, b, h]`` that crosses model stage boundaries.
    ``device``: where received activations, gradients and labels land (``None``: the first
    chunk's device).  Gradients accumulate in the parameters (each loss is divided by ``M``).
    ``split_backward``: run every ``backward`` as B then W (:func:`backward_input`,
    :func:`backward_weight`): the same gradients, the work in another order.
    """
    pp = parallel_state.group_size("pp")
    check_schedule_and_mode(schedule, p2p_mode, pp)
    rank = parallel_state.get_rank_in("pp") if pp > 1 else 0
    check_chunks(schedule, len(chunks))
    if pp > 1 and tensor_shape is None:
        raise ValueError("tensor_shape ([s, b, h] of the activations between stages) "
                         "is needed with PP > 1")

    steps = schedule_steps(schedule, pp, len(microbatches), rank,
                           len(chunks) if schedule == "interleaved" else 1)
    actions = [a for step in steps for a in step]
    # The interleaved schedule posts each send as soon as its tensor exists and waits
    # for it only at the end (Megatron runs it with overlap_p2p_comm): waiting at once,
    # rank r's send to r + 1 and rank r + 1's send to r (another chunk's tensor) can
    # each wait for a receive the other posts only later.  1F1B and GPipe wait at once.
    # Issue 20's schedules post every send as the simulator assumes (buffered sends).
    executor = PipelineExecutor(chunks, microbatches, rank, pp, p2p_mode, tensor_shape,
                                dtype, defer_sends=schedule not in ("gpipe", "1f1b"),
                                device=device, split_backward=split_backward,
                                placement=actions[0].placement if actions else "loop",
                                split=split_backwards(actions))
    index = 0
    while index < len(steps):
        step, index = steps[index], index + 1
        action = step[0]
        if action.is_compute and action.overlapped and action.kind == "forward":
            executor.run_overlapped(action, steps[index][0])  # the pair's backward
            index += 1
        elif action.is_compute:
            executor.run_compute(action)
        elif action.kind in LABEL_KINDS:
            executor.move_labels(action)
        else:  # sends/receives with a neighbour: one Megatron P2P helper
            executor.run_p2p(step)
    comm.wait_all(executor.label_sends + executor.deferred_sends)
    return StepOutput(executor.losses, executor.peak_activations,
                      actions=sum(len(step) for step in steps),
                      activation_bytes=executor.activation_bytes,
                      peak_activation_bytes=executor.peak_activation_bytes)


# --- DualPipe's two model copies --------------------------------------------------------


#: The attribute that marks the parameters of DualPipe's second model copy: the clip's
#: global norm leaves them out (:func:`~tutorial_lib.data_parallel.counts_in_grad_norm`),
#: since their twins in the first copy hold the same gradient.
MODEL_COPY_ATTR = "model_copy"


def mark_model_copies(chunks: list) -> None:
    """Tag each parameter of DualPipe's two chunks with its copy (0 or 1): chunk ``c``
    of every rank is copy ``c`` (:data:`MODEL_COPY_ATTR`)."""
    for copy, chunk in enumerate(chunks):
        for p in chunk.parameters():
            setattr(p, MODEL_COPY_ATTR, copy)


def sum_model_copy_gradients(chunks: list, expert_loads: bool = True) -> None:
    """DualPipe: add each weight's gradient from its twin in the other model copy.

    Rank ``r``'s chunk 0 (stage ``r`` of copy 0) and rank ``PP - 1 - r``'s chunk 1
    (stage ``r`` of copy 1) are the same layers, fed different halves of the
    microbatches; after the step's last backward both take the sum of the two
    gradients, so the copies, equal at the start, stay equal after every optimizer step.
    DeepSeek's DualPipe does the same in its example (deepseek-ai/DualPipe,
    examples/example_dualpipe.py, ``main``, "Check grads": each copy's gradient plus the
    twin's, from rank ``PP - 1 - rank``; 3da1bbea).  Here the pair exchanges its
    gradients with one batched send and receive over the pipeline group (the gradient
    of the step so far: ``main_grad`` inside :class:`~tutorial_lib.data_parallel.DataParallel`,
    before its data-parallel sync).  ``expert_loads``: also add the MoE layers' expert
    loads of the step (:class:`~tutorial_lib.deepseek.DeepSeekModel`), so both copies'
    expert biases take the same auxiliary-loss-free update.  The two sums are the
    same floating-point additions on both ranks of a pair, so the copies stay equal bit
    for bit.
    """
    from .data_parallel import main_grad_of

    pp = parallel_state.group_size("pp")
    rank = parallel_state.get_rank_in("pp")
    partner = parallel_state.get_group_ranks("pp")[pp - 1 - rank]

    def flat(chunk):
        parts = [main_grad_of(p) for p in chunk.parameters()]
        parts = [torch.zeros_like(p) if g is None else g
                 for p, g in zip(chunk.parameters(), parts)]
        if expert_loads and hasattr(chunk, "expert_loads"):
            parts += [chunk.expert_loads[i].to(parts[0].dtype) for i in sorted(chunk.expert_loads)]
        return torch.cat([t.reshape(-1) for t in parts])

    mine = [flat(chunk) for chunk in chunks]
    # theirs[c]: the partner's copy c (its own tag), the twin of my copy 1 - c
    theirs = [torch.empty_like(mine[1]), torch.empty_like(mine[0])]
    tags = (TAGS["model_copy"], TAGS["model_copy"] + 1)
    with get_tracer().tags(phase="model_copies"):
        works = comm.batch_isend_irecv(
            [("send", mine[0], partner, tags[0]), ("send", mine[1], partner, tags[1]),
             ("recv", theirs[0], partner, tags[0]), ("recv", theirs[1], partner, tags[1])],
            group="pp")
        comm.wait_all(works)
    for copy, chunk in enumerate(chunks):
        total = mine[copy] + theirs[1 - copy]
        offset = 0
        targets = [main_grad_of(p) for p in chunk.parameters()]
        for p, g in zip(chunk.parameters(), targets):
            piece = total[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if g is None:
                p.grad = piece.clone()
            else:
                g.copy_(piece)
        if expert_loads and hasattr(chunk, "expert_loads"):
            for i in sorted(chunk.expert_loads):
                load = chunk.expert_loads[i]
                load.copy_(total[offset:offset + load.numel()].round().to(load.dtype))
                offset += load.numel()


# --- a stage with a known cost, for measuring schedules -------------------------------


class _Busy(torch.autograd.Function):
    """Identity taking ``forward_seconds`` forward and ``backward_seconds`` backward."""

    @staticmethod
    def forward(ctx, x, forward_seconds, backward_seconds):
        time.sleep(forward_seconds)
        ctx.backward_seconds = backward_seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class SyntheticStage(torch.nn.Module):
    """A stand-in for model stage ``stage`` of ``num_stages``: its forward takes
    ``forward_seconds``, its backward ``backward_seconds``, of which ``weight_seconds``
    are the weight gradient (W) and the rest the input gradient (B).

    To see a schedule's bubble, every stage must cost the same, and on a laptop the
    ranks share a few cores, so real layers slow each other down.  This stage waits
    instead of computing (a sleep frees the core), while the executor, the P2P
    messages and the labels are the real ones: the recorded timeline is the
    schedule's, not the CPU scheduler's.  It has one weight so that autograd has a
    backward to run, and the same ``forward_stage`` interface as
    :class:`~tutorial_lib.deepseek.DeepSeekModel`.  The input's path waits in the
    backward of an identity on the activation, the weight's path in the backward of an
    identity on the weight: :func:`backward_input` runs only the first,
    :func:`backward_weight` only the second (on the first stage, which has no input
    gradient, W runs both).  ``ep_group`` (of more than one rank): halfway through the
    forward, a dispatch and a combine all-to-all over it, as a MoE layer's (their
    reverses halfway through B): what DualPipe's overlapped pairs hide.
    """

    def __init__(self, stage: int, num_stages: int, tensor_shape: tuple,
                 forward_seconds: float = 0.01, backward_seconds: float = 0.02,
                 weight_seconds: float = 0.0, ep_group: str | None = None, device=None):
        super().__init__()
        self.ep_group = ep_group
        if not 0 <= weight_seconds <= backward_seconds:
            raise ValueError(f"weight_seconds ({weight_seconds}) is part of the backward: "
                             f"it must be in 0..backward_seconds ({backward_seconds})")
        self.stage, self.num_stages = stage, num_stages
        self.tensor_shape = tuple(tensor_shape)
        self.forward_seconds, self.backward_seconds = forward_seconds, backward_seconds
        self.weight_seconds = weight_seconds
        self.weight = torch.nn.Parameter(torch.ones((), device=resolve_device(device)))

    def forward_stage(self, hidden: torch.Tensor | None,
                      batch: Microbatch) -> torch.Tensor:
        weight = _Busy.apply(self.weight, 0.0, self.weight_seconds)
        if hidden is None:
            x = weight.expand(self.tensor_shape)
        else:
            x = hidden * weight
        forward, backward = self.forward_seconds, self.backward_seconds - self.weight_seconds
        if parallel_state.group_size(self.ep_group) > 1:  # a MoE layer's two all-to-alls
            x = _Busy.apply(x, forward / 2, backward / 2)
            x = self._exchange(self._exchange(x, "dispatch"), "combine")
            y = _Busy.apply(x, forward / 2, backward / 2)
        else:
            y = _Busy.apply(x, forward, backward)
        return y.mean() if self.stage == self.num_stages - 1 else y

    def _exchange(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        """An all-to-all over ``ep_group`` that swaps equal shares of the rows (its
        backward: the reverse one), as a MoE layer's dispatch and combine."""
        from .moe import all_to_all
        n = parallel_state.group_size(self.ep_group)
        rows = x.reshape(-1, x.shape[-1])
        splits = [rows.shape[0] // n] * n
        return all_to_all(rows, self.ep_group, splits, splits, op_name).view_as(x)


def synthetic_microbatches(num_microbatches: int, first_stage: bool, rows: int = 2,
                           seq_length: int = 4, device=None) -> list[Microbatch]:
    """``M`` microbatches of zeros for :class:`SyntheticStage` (ids and labels on the
    first stage only), on ``device`` (``None``: torch's default device)."""
    device = resolve_device(device)
    out = []
    for i in range(num_microbatches):
        tokens = (torch.zeros(rows, seq_length, dtype=torch.int64, device=device)
                  if first_stage else None)
        out.append(Microbatch(tokens, tokens,
                              torch.arange(i * rows, (i + 1) * rows, device=device)))
    return out


def synthetic_run_name(schedule: str, num_microbatches: int,
                       virtual_pipeline_size: int = 1) -> str:
    """A measured schedule's ``run`` tag: ``"1f1b M=8"``, ``"interleaved M=8 V=2"``."""
    chunks = f" V={virtual_pipeline_size}" if schedule == "interleaved" else ""
    return f"{schedule} M={num_microbatches}{chunks}"


def synthetic_chunks(schedule: str, rank: int, pp: int, tensor_shape: tuple,
                     forward_seconds: float, backward_seconds: float,
                     weight_seconds: float | None = None, virtual_pipeline_size: int = 1,
                     ep_group: str | None = None, device=None) -> list[SyntheticStage]:
    """Pipeline rank ``rank``'s :class:`SyntheticStage` chunks for ``schedule``, placed as
    the schedule places its stages (:func:`~tutorial_lib.pipeline_schedules.model_stage`).

    The costs are one stage's (``PP`` ranks each running ``1 / PP`` of the model): a
    chunk of ``V`` per rank (interleaved: ``V``; ZBV and DualPipeV: 2) costs ``1/V`` of
    them, a chunk of DualPipe (a whole stage of one of its two model copies) all of them.
    ``weight_seconds``: the W part of the backward (``None``: half of it, the course's
    costs ``F 1, B 2, W 1``).
    """
    v = 2 if schedule in TWO_CHUNK_SCHEDULES else virtual_pipeline_size
    placement = SCHEDULE_PLACEMENT.get(schedule, "loop")
    stages = num_model_stages(placement, pp, v)
    scale = pp / stages  # the share of one of PP stages' work each chunk runs
    weight = backward_seconds / 2 if weight_seconds is None else weight_seconds
    return [SyntheticStage(model_stage(placement, rank, c, pp), stages, tensor_shape,
                           forward_seconds * scale, backward_seconds * scale, weight * scale,
                           ep_group=ep_group, device=device)
            for c in range(v)]


def measure_synthetic_schedules(ctx, runs: list[tuple], forward_seconds: float = 0.01,
                                backward_seconds: float = 0.02, repeats: int = 1,
                                p2p_mode: str | None = None,
                                weight_seconds: float | None = None,
                                expert_parallel_size: int = 1) -> dict:
    """Worker: run each ``(schedule, M, V)`` of ``runs`` on a pure pipeline of
    :class:`SyntheticStage`.

    Every rank of the launch is one pipeline stage (``PP = world size``; with
    ``expert_parallel_size = E > 1``, ``PP = world size / E`` and ``E`` pipelines side by
    side, data-parallel, whose stages exchange rows with two all-to-alls over the EP
    group in every forward and B, as a MoE layer: :class:`SyntheticStage`).  With ``V``
    chunks a chunk costs ``1/V`` of a stage, so every schedule does the same work
    (:func:`synthetic_chunks`; ZBV and DualPipeV have 2 chunks in a V, DualPipe two model
    copies of ``PP`` stages: ``V`` is ignored for them).  ``weight_seconds``: the W part
    of ``backward_seconds`` where a schedule splits the backward (``None``: half).
    One untraced interleaved step first opens every connection (neighbours, the
    wrap-around, the labels); then each run is traced ``repeats`` times, its events
    tagged ``run=synthetic_run_name(schedule, M, V)`` and ``repeat``, with a barrier
    before each step.  ``p2p_mode``: one mode for every run (default: overlapped for the
    interleaved schedule, as Megatron runs it, batched for the others).  Returns
    ``{run name: [the executor's peak_activations, per repeat]}``; with ``trace=True``
    the launch's trace holds every run's compute spans, named by their action's kind
    (``forward``, ``backward``: B, tagged ``part="input"``, where the schedule splits
    it, ``weight``: W) and tagged ``microbatch`` and ``chunk``, and its messages.
    """
    import torch.distributed as dist

    from .config import ParallelConfig

    ep = expert_parallel_size
    pp = ctx.world_size // ep
    config = ParallelConfig(ctx.world_size, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep)
    parallel_state.initialize_model_parallel(config)
    rank = parallel_state.get_rank_in("pp")
    shape = (4, 2, 8)  # [s, b, h]: small, the messages cost little next to the stage

    def step(schedule, m, v):
        chunks = synthetic_chunks(schedule, rank, pp, shape, forward_seconds,
                                  backward_seconds, weight_seconds, v,
                                  "ep" if ep > 1 else None, ctx.device)
        mode = p2p_mode or ("overlapped" if schedule == "interleaved" else "batched")
        first = any(c.stage == 0 for c in chunks)  # DualPipe: both ends read a batch
        microbatches = synthetic_microbatches(m, first, shape[1], shape[0], ctx.device)
        return forward_backward_pipelining(chunks, microbatches, schedule, mode, shape)

    tracer = get_tracer()
    enabled, tracer.enabled = tracer.enabled, False
    if pp > 1:
        step("interleaved", pp, 2)
    tracer.enabled = enabled
    peaks: dict = {}
    for schedule, m, v in runs:
        for repeat in range(repeats):
            dist.barrier()
            name = synthetic_run_name(schedule, m, v)
            with tracer.tags(run=name, repeat=repeat):
                peaks.setdefault(name, []).append(step(schedule, m, v).peak_activations)
    return peaks
