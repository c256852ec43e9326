"""Run a pipeline schedule with real stages: the executor (chapter 6).

:mod:`tutorial_lib.pipeline_parallel` says, for each pipeline rank, the ordered list of
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
    weight i c           -> W: the weight gradients that B left (chapter 11)
    send_grad i c        -> the gradient of the input, to the previous model stage
    send_labels i        -> the first model stage sends i's labels to the last

Where a schedule splits a backward (chapter 11) a ``backward`` is B and a ``weight`` W
(:mod:`~tutorial_lib.pipeline_parallel.backward_split`).  Where a schedule places two
stages on one rank (the V of ZBV and DualPipeV; the placement is the action's,
:func:`~.actions.model_stage`), the activation and its
gradient pass between the rank's two chunks without a message.  DualPipe's overlapped
pairs run in two threads taking turns (:mod:`~tutorial_lib.pipeline_parallel.dualpipe`).
Consecutive sends and receives become the calls of Megatron's P2P helpers
(:func:`~.modes.schedule_steps`), run in the chosen mode.

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
from dataclasses import dataclass, field

import torch

from .. import comm, parallel_state
from ..deepseek import Microbatch
from ..devices import module_device
from ..p2p import communicate
from ..saved_activations import SavedTensorBytes
from ..trace import get_tracer
from .actions import PAYLOAD, TWO_CHUNK_SCHEDULES, Action, num_model_stages, split_backwards, \
    stage_holder
from .backward_split import WeightGradWork, backward_input, backward_weight
from .dualpipe import Turns
from .modes import LABEL_KINDS, TAGS, check_schedule_and_mode, helper_name, schedule_steps

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
    tensors, :class:`~tutorial_lib.saved_activations.SavedTensorBytes`; chapter 10)."""
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
                 placement: str = "loop", split=(), label_length: int | None = None):
        self.chunks, self.microbatches = chunks, microbatches
        self.device = module_device(chunks[0]) if device is None else torch.device(device)
        self.rank, self.pp = rank, pp
        self.p2p_mode, self.tensor_shape, self.dtype = p2p_mode, tensor_shape, dtype
        self.label_length = (label_length if label_length is not None
                             else tensor_shape[0] if tensor_shape is not None else None)
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
                buffer = torch.empty((rows, self.label_length), dtype=torch.int64,
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
                                split_backward: bool = False,
                                label_length: int | None = None) -> StepOutput:
    """Run one step's forwards and backwards on this pipeline rank; every rank calls it.

    ``chunks``: this rank's model chunks (a ``DeepSeekModel`` of one model stage each):
    one, or ``V`` for the interleaved schedule, chunk ``c`` being model stage
    ``c * PP + rank``.
    ``microbatches``: the ``M`` microbatches in order (``input_ids`` and ``labels`` on
    the first model stage, ``None`` elsewhere; ``sample_ids`` and ``step`` everywhere).
    ``tensor_shape``: the activation ``[s, b, h]`` that crosses model stage boundaries
    (``[s/T, b, h]`` under sequence parallelism).  ``label_length``: the tokens of each
    label row the first stage sends the last (``None``: ``tensor_shape[0]``, right
    without sequence parallelism).
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
    # Chapter 11's schedules post every send as the simulator assumes (buffered sends).
    executor = PipelineExecutor(chunks, microbatches, rank, pp, p2p_mode, tensor_shape,
                                dtype, defer_sends=schedule not in ("gpipe", "1f1b"),
                                device=device, split_backward=split_backward,
                                placement=actions[0].placement if actions else "loop",
                                split=split_backwards(actions), label_length=label_length)
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
