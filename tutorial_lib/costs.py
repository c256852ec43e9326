"""Closed-form costs of communication: bytes on the wire, time, and what each parallelism needs.

Chapters print these predictions next to what the traced collectives actually
did, and tests compare the two.  Everything here except
:func:`measure_collective` is a pure function of its arguments: no processes.
(:func:`tp_dp_step_collectives` reads the block's collectives from
:func:`tutorial_lib.transformer.block_collectives`, which lives beside the block
it describes.)

Sections, top to bottom:

1. **Bytes each rank sends** with the ring algorithms (and pairwise all-to-all).
2. **The alpha-beta model**: ``time = steps * alpha + bytes * beta``.
3. **Fitting alpha and beta** to measured timings (least squares, non-negative).
4. **Measuring** collectives on the reader's machine (starts real processes).
5. **Which parallelism uses which collective**, how often, on how many bytes,
   and the links it usually runs over (chapter 1's bandwidth table).
6. **TP + DP: the collectives of one training step** (chapter 3).
7. **ZeRO-1: optimizer state per rank.**

Notation used in every docstring: ``N`` ranks in the group, ``B`` bytes handed
to the op as counted by the library's byte convention (see :mod:`tutorial_lib.comm`):

=================  ===============================================
op                 ``B`` (what ``TraceEvent.bytes`` records)
=================  ===============================================
``all_reduce``     the tensor
``reduce_scatter`` the full input (``N`` shards)
``all_gather``     this rank's shard ``b`` (the input), so the output is ``N * b``
``all_to_all``     the rows this rank sends, its own share included
``broadcast``      the tensor
``send``/``recv``  the tensor sent or received
=================  ===============================================

Because the argument follows that convention, ``ring_bytes_sent(e.op, e.bytes,
len(e.group_ranks))`` works directly on a trace event ``e``.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv")
"""Every op the formulas here know, named as in :mod:`tutorial_lib.comm` and the traces."""

_POINT_TO_POINT = ("send", "recv")


def _check(op: str, nbytes: float, n: int) -> None:
    """Refuse an unknown op, a negative byte count or a group size below one, naming the rule."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: the cost formulas know {', '.join(OPS)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (ranks in the group) must be a whole number >= 1, got {n!r}")
    if not isinstance(nbytes, (int, float, np.integer, np.floating)) or nbytes < 0:
        raise ValueError(f"nbytes must be a number >= 0, got {nbytes!r}")


# --- 1. bytes each rank sends ------------------------------------------------------------
#
# Ring algorithms split the data into N chunks and pass chunks to the next rank
# N-1 times per phase.  Each rank therefore sends the same amount, and that
# amount divided by the link bandwidth is the transfer time: it is the number
# to compare across ops and group sizes.


def all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of a ``B``-byte tensor: ``2 (N-1)/N * B``.

    A reduce-scatter ((N-1) steps of B/N bytes) followed by an all-gather (the
    same again).  It approaches ``2 B`` as N grows: the per-rank cost barely
    depends on the group size, which is why rings scale.
    """
    _check("all_reduce", nbytes, n)
    return 2 * (n - 1) / n * nbytes


def reduce_scatter_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter of a ``B``-byte input: ``(N-1)/N * B``.

    ``B`` is the full input (every rank's N shards); each rank ends with one
    reduced shard of ``B/N`` bytes after N-1 steps of ``B/N`` bytes.
    """
    _check("reduce_scatter", nbytes, n)
    return (n - 1) / n * nbytes


def all_gather_bytes(shard_nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather of ``b``-byte shards: ``(N-1) * b``.

    Written with the full output ``B = N b`` this is ``(N-1)/N * B``, the same
    as a reduce-scatter of ``B``: all-gather is reduce-scatter run backwards.
    """
    _check("all_gather", shard_nbytes, n)
    return (n - 1) * shard_nbytes


def all_to_all_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in an all-to-all with equal splits: ``(N-1)/N * B``.

    ``B`` is everything this rank hands to the op; the share addressed to
    itself (``B/N``) never leaves it.  All-to-all is a pairwise exchange, not a
    ring, but with equal splits it moves the same bytes as a reduce-scatter.
    Uneven splits (MoE dispatch) send ``B`` minus whatever this rank keeps.
    """
    _check("all_to_all", nbytes, n)
    return (n - 1) / n * nbytes


def broadcast_bytes(nbytes: float, n: int, position: int = 0) -> float:
    """Bytes one rank sends in a pipelined ring broadcast: ``B``, except the last rank: ``0``.

    The root streams the tensor to the next rank, which forwards it, and so on
    along a chain.  ``position`` is the rank's place in the chain (0 = the
    root, N-1 = the last rank, which only receives).
    """
    _check("broadcast", nbytes, n)
    if not 0 <= position < n:
        raise ValueError(f"position must be in 0..N-1 = 0..{n - 1}, got {position}")
    return float(nbytes) if position < n - 1 else 0.0


def send_bytes(nbytes: float) -> float:
    """Bytes a ``send`` puts on the wire: ``B`` (the matching ``recv`` sends nothing)."""
    _check("send", nbytes, 1)
    return float(nbytes)


def ring_bytes_sent(op: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for ``op`` on ``nbytes`` (the library's byte convention) over ``n`` ranks.

    =================  =========================
    all_reduce         ``2 (N-1)/N * B``
    reduce_scatter     ``(N-1)/N * B``
    all_gather         ``(N-1) * b``  (b = shard)
    all_to_all         ``(N-1)/N * B``
    broadcast          ``B`` (the root; every rank but the last in the chain)
    send               ``B``
    recv               ``0`` (its bytes are counted by the matching send)
    =================  =========================

    A group of one rank sends nothing: every collective is then a no-op.
    """
    _check(op, nbytes, n)
    if op in _POINT_TO_POINT:
        return float(nbytes) if op == "send" else 0.0
    if n == 1:
        return 0.0
    per_op = {"all_reduce": all_reduce_bytes, "reduce_scatter": reduce_scatter_bytes,
              "all_gather": all_gather_bytes, "all_to_all": all_to_all_bytes,
              "broadcast": broadcast_bytes}
    return per_op[op](nbytes, n)


# --- 2. the alpha-beta model --------------------------------------------------------------


@dataclass(frozen=True)
class AlphaBeta:
    """The latency-bandwidth ("alpha-beta", Hockney) model of one link.

    Sending one message of ``m`` bytes costs ``alpha + m * beta``.  A ring
    collective is a sequence of such steps, so its time is
    ``steps * alpha + bytes * beta`` with the counts from :func:`cost_coefficients`.
    """

    alpha: float
    """Seconds per message (per ring step): start-up latency, paid however small the message."""
    beta: float
    """Seconds per byte on the critical path: ``1 / bandwidth``."""

    def __post_init__(self):
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0 (a time cannot shrink as you send "
                             f"more), got alpha={self.alpha!r}, beta={self.beta!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second, ``1 / beta`` (infinite when beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def time(self, op: str, nbytes: float, n: int) -> float:
        """Shorthand for :func:`predict_time` with this model."""
        return predict_time(op, nbytes, n, self)


def ring_steps(op: str, n: int) -> int:
    """Messages each rank sends one after another (each paying ``alpha``) in the ring algorithm.

    all-reduce ``2(N-1)``; reduce-scatter, all-gather, all-to-all ``N-1``;
    broadcast ``N-1`` (hops along the pipeline chain); send/recv ``1``.
    """
    _check(op, 0, n)
    if op in _POINT_TO_POINT:
        return 1
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def cost_coefficients(op: str, nbytes: float, n: int) -> tuple[int, float]:
    """``(steps, bytes)``: how many alphas and how many betas ``op`` costs.

    ``bytes`` is what crosses one link one after another on the critical path:
    the bytes each rank sends (:func:`ring_bytes_sent`), except that a ``recv``
    waits for the ``B`` bytes of its matching send.  :func:`predict_time` and
    :func:`fit_alpha_beta` are both built on these two numbers.
    """
    steps = ring_steps(op, n)
    on_path = float(nbytes) if op in _POINT_TO_POINT else ring_bytes_sent(op, nbytes, n)
    return steps, on_path


def predict_time(op: str, nbytes: float, n: int, model: AlphaBeta) -> float:
    """Seconds the ring algorithm for ``op`` takes under the alpha-beta ``model``.

    ====================================  ======================================
    all_reduce                            ``2(N-1) alpha + 2(N-1)/N B beta``
    reduce_scatter (B = full input)       ``(N-1) alpha + (N-1)/N B beta``
    all_gather (b = shard, B = N b)       ``(N-1) alpha + (N-1)/N B beta``
    all_to_all (equal splits)             ``(N-1) alpha + (N-1)/N B beta``
    broadcast (pipelined ring)            ``(N-1) alpha + B beta``
    send / recv                           ``alpha + B beta``
    ====================================  ======================================

    The broadcast line is the limit of a ring pipeline cut into many chunks:
    each hop adds a latency, but the bytes stream through every link at once.

    These are the textbook algorithms, not exactly what a library runs.  gloo,
    for instance, broadcasts along a binomial tree
    (:func:`tree_broadcast_time`), may pick other algorithms or split messages
    into segments depending on their size, and on one machine every "link" is
    a memory copy between processes that share the CPU cores.  A model fitted
    with :func:`fit_alpha_beta` absorbs those differences into its two numbers:
    it predicts the machine it was measured on well, and explains why the
    curves bend where they do, without claiming the algorithm is a ring.
    """
    steps, on_path = cost_coefficients(op, nbytes, n)
    return steps * model.alpha + on_path * model.beta


def tree_broadcast_time(nbytes: float, n: int, model: AlphaBeta) -> float:
    """Seconds for a binomial-tree broadcast (gloo's algorithm): ``ceil(log2 N) (alpha + B beta)``.

    Each round doubles the ranks that hold the tensor, and every round sends
    the whole tensor: fewer latencies than a ring for small ``B``, ``log2 N``
    times the bandwidth term for large ``B``.
    """
    _check("broadcast", nbytes, n)
    return math.ceil(math.log2(n)) * (model.alpha + nbytes * model.beta)


def bus_bandwidth(op: str, nbytes: float, n: int, seconds: float) -> float:
    """Bytes per second each rank pushed through its link: ``ring_bytes_sent / seconds``.

    This is nccl-tests' "bus bandwidth": unlike ``B / seconds`` it does not
    depend on the op or the group size, so it compares directly with a link's
    rated bandwidth.  (For a ``recv`` it counts the bytes received.)
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0 to compute a bandwidth, got {seconds!r}")
    return cost_coefficients(op, nbytes, n)[1] / seconds


# --- 3. fitting alpha and beta -----------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One measured timing: ``op`` on ``nbytes`` over ``n`` ranks took ``seconds``."""

    op: str
    """Op name as in :data:`OPS`."""
    nbytes: int
    """Bytes handed to the op, by the library's byte convention (see the module docstring)."""
    n: int
    """Ranks in the group."""
    seconds: float
    """Measured time of one op (a median over repeats when it comes from :func:`measure_collective`)."""


@dataclass(frozen=True)
class Fit:
    """What :func:`fit_alpha_beta` found."""

    model: AlphaBeta
    """The fitted alpha and beta (both >= 0)."""
    r_squared: float
    """``1 - SS_res / SS_tot`` on the measured seconds: 1 is a perfect fit, 0 no better than
    their mean (negative is possible: a relative fit may lose to the mean on absolute errors)."""
    n_samples: int
    """How many samples the fit used."""
    relative: bool
    """True if each sample was weighted by 1/seconds (relative errors), False for plain least squares."""

    def predict(self, op: str, nbytes: float, n: int) -> float:
        """Predicted seconds for ``op`` with the fitted model."""
        return predict_time(op, nbytes, n, self.model)


def _as_sample(s) -> Sample:
    return s if isinstance(s, Sample) else Sample(*s)


def _nonnegative_least_squares(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise ``|X p - y|^2`` subject to ``p >= 0`` for two parameters.

    With two parameters the optimum either has both positive (the ordinary
    least-squares solution), or one of them at zero (fit the other alone),
    or both zero.  Try each case and keep the best feasible one.
    """
    candidates = [np.zeros(2)]
    full, *_ = np.linalg.lstsq(X, y, rcond=None)
    if np.all(full >= 0):
        candidates.append(full)
    for j in range(2):  # only parameter j free, the other held at 0
        col = X[:, j]
        denom = float(col @ col)
        if denom > 0:
            p = np.zeros(2)
            p[j] = max(0.0, float(col @ y) / denom)
            candidates.append(p)
    return min(candidates, key=lambda p: float(np.sum((X @ p - y) ** 2)))


def fit_alpha_beta(samples: Iterable[Sample | tuple], relative: bool = True) -> Fit:
    """Least-squares fit of ``alpha`` and ``beta`` (both >= 0) to measured timings.

    Each sample ``(op, nbytes, n, seconds)`` gives one equation
    ``seconds = steps * alpha + bytes * beta`` with ``(steps, bytes)`` from
    :func:`cost_coefficients`, so samples of different ops and group sizes can
    be fitted together.

    ``relative=True`` (the default) divides each equation by its ``seconds``,
    minimising relative rather than absolute errors: timings from 1 KB to 4 MB
    span three orders of magnitude, and a plain fit would let the largest
    messages decide everything, leaving ``alpha`` to noise.  ``r_squared`` is
    computed on the unweighted seconds either way.
    """
    rows = [_as_sample(s) for s in samples]
    if len(rows) < 2:
        raise ValueError(f"fitting two parameters (alpha, beta) needs at least 2 samples, "
                         f"got {len(rows)}")
    for s in rows:
        if not s.seconds > 0:
            raise ValueError(f"every measured time must be > 0 seconds, got {s.seconds!r} "
                             f"for {s.op} of {s.nbytes} bytes on {s.n} ranks")
    X = np.array([cost_coefficients(s.op, s.nbytes, s.n) for s in rows], dtype=float)
    y = np.array([s.seconds for s in rows], dtype=float)
    if not np.any(X[:, 0]) and not np.any(X[:, 1]):
        raise ValueError("every sample has zero steps and zero bytes (groups of one rank?): "
                         "there is nothing to fit")
    weights = 1.0 / y if relative else np.ones_like(y)
    alpha, beta = _nonnegative_least_squares(X * weights[:, None], y * weights)
    residual = y - X @ np.array([alpha, beta])
    ss_res = float(residual @ residual)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return Fit(model=AlphaBeta(float(alpha), float(beta)), r_squared=r_squared,
               n_samples=len(rows), relative=relative)


# --- 4. measuring on this machine --------------------------------------------------------

MEASURABLE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
"""Ops :func:`measure_collective` can time (``send`` times a send from rank 0 to rank 1)."""

DEFAULT_SIZES = tuple(1024 * 4 ** i for i in range(7))
"""1 KiB, 4 KiB, ..., 4 MiB: wide enough to see both the alpha and the beta regime."""

_ELEMENT = 4  # measurements use float32


def _make_tensors(op: str, nbytes: int, n: int):
    """Zero float32 tensors whose size follows the byte convention for ``op`` (rounded to fit ``n``)."""
    import torch
    numel = max(1, int(nbytes) // _ELEMENT)
    if op in ("reduce_scatter", "all_to_all"):
        numel = max(n, numel - numel % n)  # the input must split into n equal slices
        out_numel = numel // n if op == "reduce_scatter" else numel
        return torch.zeros(numel), torch.zeros(out_numel)
    if op == "all_gather":
        return torch.zeros(numel), torch.zeros(numel * n)
    return torch.zeros(numel), None  # zeros: repeated in-place sums never overflow


def _run_op(op: str, tensors, rank: int) -> None:
    from tutorial_lib import comm
    x, out = tensors
    if op == "all_reduce":
        comm.all_reduce(x)
    elif op == "reduce_scatter":
        comm.reduce_scatter(out, x)
    elif op == "all_gather":
        comm.all_gather(out, x)
    elif op == "all_to_all":
        comm.all_to_all(out, x)
    elif op == "broadcast":
        comm.broadcast(x, src=0)
    elif op == "send":
        if rank == 0:
            comm.send(x, dst=1)
        elif rank == 1:
            comm.recv(x, src=0)


def _measure_worker(ctx, ops: Sequence[str], sizes: Sequence[int], repeats: int,
                    warmup: int) -> None:
    """Runs in every rank: each op on each size, ``warmup + repeats`` times, barrier first."""
    import torch.distributed as dist
    for op in ops:
        for size in sizes:
            tensors = _make_tensors(op, size, ctx.world_size)
            for iteration in range(warmup + repeats):
                # Untraced barrier: every timed op starts from (nearly) the same moment,
                # and the trace shows only the ops being measured.
                dist.barrier()
                with ctx.tracer.tags(measured_op=op, size=size, iteration=iteration,
                                     warmup=iteration < warmup):
                    _run_op(op, tensors, ctx.rank)


def samples_from_trace(trace, n: int) -> list[Sample]:
    """Turn the trace of a :func:`measure_collective` run into one :class:`Sample` per (op, size).

    One iteration's time is ``max(t_end) - max(t_start)`` over its events on
    all ranks: from the moment the last rank joins (before that, early ranks
    only wait for it) until the last rank is done.  A sample's ``seconds`` is
    the median over the non-warm-up iterations, which shrugs off the odd
    iteration where the scheduler paused a process.
    """
    iterations: dict[tuple, list] = {}
    for e in trace:
        if "measured_op" not in e.tags or e.tags.get("warmup"):
            continue
        key = (e.tags["measured_op"], e.tags["size"], e.tags["iteration"])
        iterations.setdefault(key, []).append(e)
    per_size: dict[tuple, list[float]] = {}
    recorded_bytes: dict[tuple, int] = {}
    for (op, size, _), events in iterations.items():
        per_size.setdefault((op, size), []).append(
            max(e.t_end for e in events) - max(e.t_start for e in events))
        # The bytes actually moved (sizes are rounded to split evenly over the ranks).
        recorded_bytes[(op, size)] = next(e.bytes for e in events if e.op != "recv")
    return [Sample(op=op, nbytes=recorded_bytes[(op, size)], n=n,
                   seconds=max(statistics.median(times), 1e-9))
            for (op, size), times in sorted(per_size.items())]


def measure_collective(op: str | Sequence[str], sizes: Sequence[int] = DEFAULT_SIZES,
                       world_size: int = 4, repeats: int = 10, warmup: int = 1,
                       timeout: float = 120.0) -> list[Sample]:
    """Time ``op`` (one name or several) on this machine for each size in ``sizes`` bytes.

    Starts ``world_size`` gloo ranks with :func:`tutorial_lib.launch.launch`.
    Each rank runs every size ``warmup + repeats`` times through the traced
    :mod:`tutorial_lib.comm` wrappers with a barrier before each run; the
    times come from the trace events (see :func:`samples_from_trace`).
    Sizes follow the byte convention, so for ``all_gather`` a size is the
    shard each rank contributes.  Feed the result to :func:`fit_alpha_beta`.
    """
    from tutorial_lib.launch import launch
    ops = (op,) if isinstance(op, str) else tuple(op)
    for name in ops:
        if name not in MEASURABLE_OPS:
            raise ValueError(f"cannot measure {name!r}: measure_collective times "
                             f"{', '.join(MEASURABLE_OPS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be a whole number >= 2 to measure communication, "
                         f"got {world_size!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"warmup={warmup}")
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"sizes must be a non-empty list of byte counts >= 1, got {list(sizes)}")
    result = launch(_measure_worker, world_size,
                    args=(ops, [int(s) for s in sizes], int(repeats), int(warmup)),
                    timeout=timeout, print_output=False)
    return samples_from_trace(result.trace, world_size)


# --- 5. which parallelism needs which bandwidth (chapter 1) ---------------------------------
#
# Symbols: b micro-batch size (sequences), s sequence length held by a rank
# (already divided by CP when context parallelism is on), h hidden size, h_kv
# the key/value width (h without grouped-query attention), k experts per token,
# E experts, P parameters held by a rank, d bytes per element.


@dataclass(frozen=True)
class ParallelismTraffic:
    """One row of the table: the communication one parallelism adds to a training step."""

    parallelism: str
    """``TP``, ``CP``, ``EP``, ``DP`` or ``PP``."""
    collective: str
    """The collective(s) it issues, and the variant Megatron uses."""
    frequency: str
    """How often: per layer, per MoE layer, per microbatch, per step."""
    volume_per_op: str
    """Bytes handed to one collective by one rank, as a formula in the symbols above."""
    bandwidth_need: str
    """How much it suffers from a slow link, and why."""
    typical_link: str
    """Where it is usually placed: inside a node (NVLink) or across nodes (InfiniBand)."""


def bandwidth_table() -> list[ParallelismTraffic]:
    """Which parallelism uses which collective, how often, on what volume, over which link.

    Ordered from the most to the least bandwidth-hungry, which is also the
    order Megatron lays the axes out in the rank grid: TP fastest-varying, so a
    TP group sits on neighbouring GPUs of one node.
    """
    return [
        ParallelismTraffic(
            "TP", "all-reduce of activations (reduce-scatter + all-gather with sequence parallelism)",
            "every layer: 2 in the forward pass (after attention, after the MLP), 2 in the backward",
            "b*s*h*d bytes per all-reduce: O(b s h), the layer's whole activation",
            "highest: on the critical path of every layer, with little compute to hide it behind",
            "inside a node (NVLink)"),
        ParallelismTraffic(
            "CP", "all-gather of K and V forward, reduce-scatter of dK, dV backward "
                  "(Megatron passes K/V chunks around a ring with send/recv)",
            "every attention layer, forward and backward",
            "2*b*s*h_kv*d bytes: this rank's K and V chunk, O(b s h_kv); each rank receives "
            "CP-1 such chunks per layer",
            "high: every layer, but overlapped with the attention computation",
            "inside a node, or across nodes for very long sequences"),
        ParallelismTraffic(
            "EP", "all-to-all: dispatch tokens to their experts, combine the results back",
            "every MoE layer: 2 in the forward pass, 2 in the backward",
            "b*s*h*k*d bytes per all-to-all: O(b s h k), each of the rank's b*s tokens goes to "
            "k experts; with E experts spread evenly over EP ranks, (EP-1)/EP of it leaves the rank",
            "high: every MoE layer, every pair of ranks at once, uneven when routing is unbalanced",
            "inside a node when it fits, otherwise InfiniBand"),
        ParallelismTraffic(
            "DP", "all-reduce of gradients (reduce-scatter of gradients + all-gather of "
                  "parameters with a distributed optimizer)",
            "once per optimizer step, in buckets overlapped with the backward pass",
            "P*d bytes: O(params), the gradients of every parameter this rank holds",
            "moderate: the largest volume, but only once per step and mostly hidden",
            "across nodes (InfiniBand)"),
        ParallelismTraffic(
            "PP", "send/recv of activations (forward) and their gradients (backward)",
            "every microbatch at every stage boundary, forward and backward",
            "b*s*h*d bytes: O(b s h), one microbatch's activation at the boundary "
            "(divided by TP when sequence parallelism scatters it)",
            "lowest: point-to-point between neighbouring stages, small and infrequent",
            "across nodes (InfiniBand)"),
    ]


def tp_all_reduce_bytes(b: int, s: int, h: int, d: int = 2) -> int:
    """Bytes of one TP all-reduce: the activation ``b * s * h`` elements of ``d`` bytes."""
    return b * s * h * d


def cp_kv_chunk_bytes(b: int, s: int, h_kv: int, d: int = 2) -> int:
    """Bytes of one rank's K and V chunk in context parallelism: ``2 * b * s * h_kv * d`` (s per rank)."""
    return 2 * b * s * h_kv * d


def ep_all_to_all_bytes(b: int, s: int, h: int, k: int, d: int = 2) -> int:
    """Bytes one rank hands to one EP all-to-all: ``b * s * k`` token copies of ``h * d`` bytes."""
    return b * s * h * k * d


def dp_gradient_bytes(params: int, d: int = 4) -> int:
    """Bytes of one DP gradient all-reduce: ``params * d`` (fp32 gradients by default)."""
    return params * d


def pp_activation_bytes(b: int, s: int, h: int, d: int = 2) -> int:
    """Bytes sent across one pipeline stage boundary per microbatch: ``b * s * h * d``."""
    return b * s * h * d


@dataclass(frozen=True)
class LinkSpec:
    """A typical interconnect and its rated (vendor spec, peak) bandwidth."""

    name: str
    """The link, e.g. ``NVLink 4 (H100 SXM)``."""
    gb_per_s_per_direction: float
    """GB/s (10^9 bytes) one way: what a one-directional transfer can reach at best."""
    gb_per_s_bidirectional: float
    """GB/s both ways together: the figure vendors usually quote."""
    connects: str
    """What it connects."""
    source: str
    """Where the figure comes from: vendor specifications, not measurements."""


def link_bandwidths() -> list[LinkSpec]:
    """Typical link bandwidths (vendor spec figures, peak; real transfers reach somewhat less)."""
    return [
        LinkSpec("NVLink 4 (H100 SXM, 18 links)", 450.0, 900.0,
                 "GPU to GPU inside a node, through NVSwitch",
                 "vendor spec (NVIDIA H100 datasheet: 900 GB/s total)"),
        LinkSpec("PCIe Gen5 x16", 64.0, 128.0,
                 "GPU to CPU or network card; GPU to GPU in PCIe-only servers",
                 "vendor spec (PCI-SIG: 32 GT/s per lane, ~64 GB/s per direction)"),
        LinkSpec("InfiniBand NDR, one 400 Gb/s port", 50.0, 100.0,
                 "node to node, usually one port per GPU",
                 "vendor spec (NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s per port)"),
    ]


def transfer_seconds(nbytes: float, link: LinkSpec) -> float:
    """Seconds to push ``nbytes`` one way at the link's rated bandwidth (a lower bound)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return nbytes / (link.gb_per_s_per_direction * 1e9)


# --- 6. TP + DP: the collectives of one training step --------------------------------------
#
# Every collective that tutorial_lib.train.train_step issues on one rank, predicted from
# the model's shape and the layout alone: the chapter prints this table beside the
# recorded trace, and a test checks that they agree op for op and byte for byte.
#
# Per microbatch, inside one DP replica (TP collectives, group "tp", only when TP > 1):
#   forward:  word embedding all-reduce; each block's (transformer.block_collectives);
#             the output layer's all-gather (SP only); the cross-entropy's 3 all-reduces
#   backward: the output layer's all-reduce of dX (SP: reduce-scatter); each block's;
#             the embedding scatter's all-gather (SP only)
# Once per step:
#   grad_sync: one all-reduce of every sequence-parallel gradient over TP (SP only)
#   backward:  DataParallel's bucket all-reduces over DP (not with ZeRO-1)
#   clip_grad: the squared norm summed over TP (ZeRO-1: over DP too), 4 bytes each
#   optimizer: ZeRO-1's reduce-scatter of the gradients and all-gather of the parameters
#   logging:   the loss averaged over DP, 4 bytes

#: ``tutorial_lib.data_parallel.DEFAULT_BUCKET_SIZE_BYTES``, repeated here so this module
#: stays free of torch (a unit test checks the two agree).
DATA_PARALLEL_BUCKET_SIZE_BYTES = 40_000_000

_NORM_BYTES = 4  # the clip's squared norm and the logged loss are float32 scalars
_ZERO1_BYTES = 4  # ZeRO-1's flat buffers are float32 (the master copy) whatever the model's dtype


@dataclass(frozen=True)
class StepCollective:
    """One row of the prediction: ``count`` identical collectives of one kind, on one rank."""

    op: str
    """``all_reduce``, ``reduce_scatter`` or ``all_gather``, as in the trace."""
    group_kind: str
    """``tp`` (inside a DP replica) or ``dp`` (across the replicas of one shard)."""
    phase: str
    """The trace's ``phase`` tag: forward, backward, grad_sync, clip_grad, optimizer, logging."""
    count: int
    """How many per optimizer step (microbatches and layers multiplied in)."""
    bytes_each: int
    """Bytes of each, in :mod:`tutorial_lib.comm`'s convention (``TraceEvent.bytes``)."""
    what: str
    """Which part of the model or the step issues it."""

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes_each


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(value)


def _per_rank(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) must be divisible by the tensor-parallel size ({tp}); "
                         f"try {what} = {(total // tp + 1) * tp}")
    return total // tp


def gpt_parameter_shapes(model_config, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter one TP rank of ``tutorial_lib.model.GPTModel``
    holds, in registration order (the order DataParallel fills its buckets from, reversed).

    ``model_config`` needs ``hidden_size``, ``num_layers``, ``seq_length``, ``vocab_size``;
    the MLP is ``4 * hidden_size`` wide.  Sharded: the word table and the output layer by
    vocabulary rows, qkv and fc1 (weights and biases) by output rows, proj and fc2 by input
    columns.  Replicated: the position table, the LayerNorms, the row-parallel biases.
    """
    tp = _positive("tp", tp)
    h, ffn = model_config.hidden_size, 4 * model_config.hidden_size
    vocab = _per_rank(model_config.vocab_size, tp, "vocab_size")
    shapes = [("embedding.word_embeddings.weight", (vocab, h)),
              ("embedding.position_embeddings.weight", (model_config.seq_length, h))]
    for layer in range(model_config.num_layers):
        p = f"layers.{layer}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "input_layernorm.bias", (h,)),
                   (p + "self_attention.linear_qkv.weight", (_per_rank(3 * h, tp, "3 * hidden_size"), h)),
                   (p + "self_attention.linear_qkv.bias", (3 * h // tp,)),
                   (p + "self_attention.linear_proj.weight", (h, _per_rank(h, tp, "hidden_size"))),
                   (p + "self_attention.linear_proj.bias", (h,)),
                   (p + "pre_mlp_layernorm.weight", (h,)), (p + "pre_mlp_layernorm.bias", (h,)),
                   (p + "mlp.linear_fc1.weight", (ffn // tp, h)), (p + "mlp.linear_fc1.bias", (ffn // tp,)),
                   (p + "mlp.linear_fc2.weight", (h, ffn // tp)), (p + "mlp.linear_fc2.bias", (h,))]
    shapes += [("final_layernorm.weight", (h,)), ("final_layernorm.bias", (h,)),
               ("output_layer.weight", (vocab, h))]
    return shapes


def data_parallel_bucket_bytes(param_bytes: Sequence[int], bucket_size_bytes: float) -> list[int]:
    """Bytes of each DataParallel bucket, in launch order, for parameters of ``param_bytes``
    (registration order, one domain, one dtype).

    The rule of ``tutorial_lib.data_parallel.build_buckets``: walk the parameters from the
    last to the first (backward produces their gradients roughly in that order) and close
    a bucket as soon as it holds at least ``bucket_size_bytes`` (0: one parameter a bucket).
    """
    if bucket_size_bytes < 0:
        raise ValueError(f"bucket_size_bytes must be >= 0, got {bucket_size_bytes}")
    buckets, current = [], 0
    for nbytes in reversed(list(param_bytes)):
        current += nbytes
        if current >= bucket_size_bytes:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def tp_dp_step_collectives(model_config, tp: int, dp: int, micro_batch_size: int,
                           num_microbatches: int, sequence_parallel: bool | None = None,
                           zero1: bool = False,
                           bucket_size_bytes: float = DATA_PARALLEL_BUCKET_SIZE_BYTES,
                           clip_grad: bool = False, log_loss: bool = True,
                           bytes_per_element: int = 4) -> list[StepCollective]:
    """Every collective one rank issues in one ``train_step`` of ``GPTModel``, as rows.

    ``tp``, ``dp``: the layout; ``micro_batch_size`` sequences per microbatch,
    ``num_microbatches`` of them per replica per step; ``sequence_parallel`` (``None``:
    ``model_config.sequence_parallel``); ``zero1``: DistributedOptimizer instead of
    DataParallel (whose buckets hold about ``bucket_size_bytes``); ``clip_grad``: a
    ``max_grad_norm`` is given; ``log_loss``: the loss is averaged over DP for the log.
    Every rank issues the same list (the shards are of equal size).

    Two things the trace shows that a reader may not expect: DataParallel and ZeRO-1
    issue their collectives even when DP = 1 (a group of one rank, where gloo returns at
    once), while the clip and the log skip groups of one rank; and with sequence
    parallelism the word embedding still all-reduces (Megatron's pattern with a learned
    position embedding), the split along the sequence comes after it for free.
    """
    tp, dp = _positive("tp", tp), _positive("dp", dp)
    b, m = _positive("micro_batch_size", micro_batch_size), _positive("num_microbatches", num_microbatches)
    sp = model_config.sequence_parallel if sequence_parallel is None else bool(sequence_parallel)
    s, h, layers = model_config.seq_length, model_config.hidden_size, model_config.num_layers
    shapes = gpt_parameter_shapes(model_config, tp)  # checks vocab and hidden divide over TP
    _per_rank(model_config.num_attention_heads, tp, "num_attention_heads")
    if sp and tp > 1:
        _per_rank(s, tp, "seq_length")
    activation = s * b * h * bytes_per_element      # one [s, b, h] tensor
    shard = activation // tp                        # this rank's [s/T, b, h] slice
    per_token = s * b * bytes_per_element           # one number per token: [s, b]
    rows: list[StepCollective] = []

    def add(op, kind, phase, count, nbytes, what):
        if count:
            rows.append(StepCollective(op, kind, phase, count, int(nbytes), what))

    if tp > 1:
        # Each block's TP collectives, from the block's own accounting (transformer.py).
        from .transformer import block_collectives
        block = block_collectives(s, b, h, tp, sp, bytes_per_element)
        per_block: dict[tuple, int] = {}
        for row in block:
            key = (row["phase"], row["op"], row["bytes"], row["op_name"])
            per_block[key] = per_block.get(key, 0) + 1

        def add_blocks(phase):
            for (row_phase, op, nbytes, op_name), n in per_block.items():
                if row_phase == phase:
                    add(op, "tp", phase, n * layers * m, nbytes, f"transformer blocks: {op_name}")

        add("all_reduce", "tp", "forward", m, activation,
            "word embedding: sum the vocabulary shards' rows")
        add_blocks("forward")
        if sp:
            add("all_gather", "tp", "forward", m, shard,
                "output layer: gather the sequence back for the vocabulary-parallel matmul")
        add("all_reduce", "tp", "forward", 3 * m, per_token,
            "vocab-parallel cross-entropy: max, target logit, sum of exponentials")
        if sp:
            add("reduce_scatter", "tp", "backward", m, activation,
                "output layer: dX partial sums over vocabulary shards, back to my tokens")
        else:
            add("all_reduce", "tp", "backward", m, activation,
                "output layer: dX partial sums over vocabulary shards")
        add_blocks("backward")
        if sp:
            add("all_gather", "tp", "backward", m, shard,
                "embedding: gather the gradient of the sequence split")
            # The blocks' LayerNorms and row-parallel biases (the block's own grad_sync row
            # says how many bytes a block has), plus the final LayerNorm: one flat buffer.
            block_sync = sum(r["bytes"] for r in block if r["phase"] == "grad_sync")
            add("all_reduce", "tp", "grad_sync", 1, layers * block_sync + 2 * h * bytes_per_element,
                "sequence-parallel gradients (LayerNorms, row-parallel biases)")

    numels = [math.prod(shape) for _, shape in shapes]
    if not zero1:
        sizes = data_parallel_bucket_bytes([n * bytes_per_element for n in numels], bucket_size_bytes)
        for nbytes in sorted(set(sizes), reverse=True):
            add("all_reduce", "dp", "backward", sizes.count(nbytes), nbytes,
                "DataParallel buckets: average the gradients over the replicas")
        if clip_grad and tp > 1:
            add("all_reduce", "tp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over TP shards")
    else:
        padded = math.ceil(sum(numels) / dp) * dp
        add("reduce_scatter", "dp", "optimizer", 1, padded * _ZERO1_BYTES,
            "ZeRO-1: my slice of the averaged gradients")
        if clip_grad and dp > 1:
            add("all_reduce", "dp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over DP slices")
        if clip_grad and tp > 1:
            add("all_reduce", "tp", "clip_grad", 1, _NORM_BYTES, "global gradient norm: sum over TP shards")
        add("all_gather", "dp", "optimizer", 1, padded // dp * _ZERO1_BYTES,
            "ZeRO-1: every replica gets every updated slice")
    if log_loss and dp > 1:
        add("all_reduce", "dp", "logging", 1, _NORM_BYTES, "the loss averaged over replicas (logging only)")
    return rows


def step_bytes_by_group(rows: Iterable[StepCollective]) -> dict[str, int]:
    """Bytes one rank hands to collectives in one step, per group kind (``{"tp": ..., "dp": ...}``)."""
    out: dict[str, int] = {}
    for row in rows:
        out[row.group_kind] = out.get(row.group_kind, 0) + row.total_bytes
    return out


# --- 7. ZeRO-1: optimizer state per rank ---------------------------------------------------


def zero1_state_bytes_per_rank(num_params: int, data_parallel_size: int,
                               bytes_per_param: int = 12) -> int:
    """Predicted optimizer-state bytes per rank with ZeRO-1: ``ceil(N / DP) * bytes_per_param``.

    Adam with an fp32 master copy keeps 4 (master) + 4 (exp_avg) + 4 (exp_avg_sq)
    = 12 bytes per parameter; unsharded that is ``12 N`` on every rank.
    """
    return math.ceil(num_params / data_parallel_size) * bytes_per_param


# --- 8. MoE dispatch and combine -------------------------------------------------------------
#
# Expert parallelism moves token *copies*: each of a rank's T tokens goes to its K experts,
# so a dropless dispatch hands T*K rows of h elements to the all-to-all (the rows that stay
# on this rank included: the byte convention above).  Which rank receives how many depends
# on the routing, so the per-rank predictions start from the routing's counts.  Experts
# lie in contiguous blocks: expert e lives on EP rank e // (N / EP) (tutorial_lib.moe).


def moe_all_to_all_bytes(tokens: int, topk: int, hidden: int, bytes_per_element: int = 2) -> int:
    """Bytes one rank hands to one dropless dispatch all-to-all: ``T * K * h * d``.

    The combine hands back what the rank *received*; summed over the EP group the two
    are equal.  The same product as :func:`ep_all_to_all_bytes` with ``T = b * s``.
    """
    for name, value in (("tokens", tokens), ("topk", topk), ("hidden", hidden),
                        ("bytes_per_element", bytes_per_element)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return tokens * topk * hidden * bytes_per_element


def moe_rank_send_splits(tokens_per_expert: Sequence[int], ep_size: int) -> list[int]:
    """Token copies one EP rank sends to each EP rank: its ``input_split_sizes``.

    ``tokens_per_expert`` is the rank's routing load over all ``N`` experts (after any
    capacity dropping); rank ``j`` owns experts ``[j N/EP, (j+1) N/EP)``.
    """
    num_experts = len(tokens_per_expert)
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"need N experts divisible by EP; got N = {num_experts}, EP = {ep_size}")
    local = num_experts // ep_size
    return [int(sum(tokens_per_expert[j * local:(j + 1) * local])) for j in range(ep_size)]


def moe_send_counts(tokens_per_expert_by_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """``counts[i][j]``: token copies EP rank ``i`` sends to EP rank ``j``.

    ``tokens_per_expert_by_rank[i]`` is rank ``i``'s routing load over all ``N`` experts;
    each row is :func:`moe_rank_send_splits` of that rank.
    """
    ep = len(tokens_per_expert_by_rank)
    num_experts = len(tokens_per_expert_by_rank[0]) if ep else 0
    if ep == 0 or num_experts % ep or any(len(row) != num_experts for row in tokens_per_expert_by_rank):
        raise ValueError(f"need one load row of N experts per EP rank, N divisible by EP; got "
                         f"{ep} rows of lengths {[len(r) for r in tokens_per_expert_by_rank]}")
    return [moe_rank_send_splits(row, ep) for row in tokens_per_expert_by_rank]


@dataclass(frozen=True)
class MoEAllToAll:
    """One all-to-all of a MoE layer on one rank, as its trace event will record it."""

    phase: str
    """``forward`` or ``backward``."""
    op_name: str
    """``dispatch`` or ``combine`` (the counts exchange belongs to the dispatch)."""
    payload: str
    """``counts`` (int64 metadata, ``[EP, N/EP]``) or ``tokens`` (rows of ``h`` elements)."""
    bytes: int
    """Bytes this rank hands to the op (its own share included)."""
    input_splits: tuple[int, ...]
    """Rows sent to each EP rank."""
    output_splits: tuple[int, ...]
    """Rows received from each EP rank."""


def moe_rank_all_to_alls(send_counts: Sequence[Sequence[int]], rank: int, hidden: int,
                         num_experts: int, bytes_per_element: int = 4) -> list[MoEAllToAll]:
    """Every all-to-all EP rank ``rank`` issues in one MoE forward + backward, in issue order.

    Forward: the counts exchange (``N`` int64 numbers, one row of ``N/EP`` per peer), the
    dispatch (row ``rank`` of ``send_counts``), the combine (column ``rank``: what it
    received goes back).  Backward: the combine's reverse, then the dispatch's; autograd
    skips the dispatch's reverse when the layer's input does not require a gradient, so
    the prediction assumes it does.  With one EP rank nothing is communicated.
    ``send_counts`` comes from :func:`moe_send_counts`.
    """
    ep = len(send_counts)
    if not 0 <= rank < ep:
        raise ValueError(f"rank ({rank}) must be an EP rank in [0, {ep})")
    if ep == 1:
        return []
    row = tuple(int(c) for c in send_counts[rank])
    column = tuple(int(send_counts[i][rank]) for i in range(ep))
    row_bytes = hidden * bytes_per_element
    sent, received = sum(row) * row_bytes, sum(column) * row_bytes
    return [
        MoEAllToAll("forward", "dispatch", "counts", num_experts * 8, (1,) * ep, (1,) * ep),
        MoEAllToAll("forward", "dispatch", "tokens", sent, row, column),
        MoEAllToAll("forward", "combine", "tokens", received, column, row),
        MoEAllToAll("backward", "combine", "tokens", sent, row, column),
        MoEAllToAll("backward", "dispatch", "tokens", received, column, row),
    ]
