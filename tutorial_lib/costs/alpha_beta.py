"""Bytes on the wire and time of one collective: ring formulas, the alpha-beta model, the fit.

Chapter 2 (collectives) prints these predictions next to what the traced collectives
did and fits the model to this machine; chapter 1 sizes its examples with them, chapter 3
turns its traced bytes into bytes sent with :func:`ring_bytes_sent`, and chapter 7 fits
the P2P modes' timings with :func:`fit_alpha_beta`.  Every function here is a pure
function of its arguments (numpy, no torch, no processes); measuring on this machine
lives in :mod:`tutorial_lib.timing.alpha_beta`.

Sections, top to bottom:

1. **Bytes each rank sends** with the ring algorithms (and pairwise all-to-all).
2. **The alpha-beta model**: ``time = steps * alpha + bytes * beta``.
3. **Fitting alpha and beta** to measured timings (least squares, non-negative).

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
from dataclasses import dataclass
from typing import Iterable

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


# nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md, commit 03a204a1) reports two
# bandwidths per size: the algorithm bandwidth, algbw = S / t, with S the size of the whole
# operation (for all-gather and reduce-scatter the N-shard array, for all-to-all every row
# a rank sends), and the bus bandwidth, busbw = algbw times a factor per collective that
# makes it independent of N: what one rank's link carried per second in the best
# algorithm, to compare with the link's rated bandwidth.

BUS_BANDWIDTH_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}
"""busbw / algbw per op as nccl-tests defines them (``doc/PERFORMANCE.md``): ``2(N-1)/N``
for all-reduce, ``(N-1)/N`` for reduce-scatter, all-gather and all-to-all, 1 for broadcast
and point-to-point."""


def nccl_tests_size(op: str, nbytes: float, n: int) -> float:
    """nccl-tests' size ``S`` of an op this library records as ``nbytes`` (its byte
    convention): the same, except for all-gather, where the library records one rank's
    shard and nccl-tests the gathered array, ``N`` shards."""
    _check(op, nbytes, n)
    return float(nbytes) * n if op == "all_gather" else float(nbytes)


def algorithm_bandwidth(op: str, nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests' ``algbw = S / t`` in bytes per second (:func:`nccl_tests_size`)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0 to compute a bandwidth, got {seconds!r}")
    return nccl_tests_size(op, nbytes, n) / seconds


def bus_bandwidth(op: str, nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth in bytes per second: ``algbw`` times the op's factor
    (:data:`BUS_BANDWIDTH_FACTORS`).

    Unlike ``algbw`` it does not depend on the op or the group size, so it compares
    directly with a link's rated bandwidth (the course's bandwidth table, or what
    nccl-tests' ``*_perf`` binaries print on the same machine).  For every op it equals
    the bytes each rank sends in the ring algorithm over the time,
    ``ring_bytes_sent / seconds`` (for a ``recv``: the bytes received).
    """
    return algorithm_bandwidth(op, nbytes, n, seconds) * BUS_BANDWIDTH_FACTORS[op](n)


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
    """Measured time of one op (a median over repeats when it comes from
    :func:`tutorial_lib.timing.measure_collective`)."""


@dataclass(frozen=True)
class Fit:
    """What :func:`fit_alpha_beta` found."""

    model: AlphaBeta
    """The fitted alpha and beta (both >= 0)."""
    r_squared: float
    """``1 - SS_res / SS_tot`` on the measured seconds: 1 is a perfect fit, 0 no better than
    predicting their mean for every sample.  It can be negative: a relative fit gives every
    size the same say, so when the small sizes pull it away from the largest timing, its
    error there (in seconds) can exceed the timings' whole spread around their mean, which
    the largest timing dominates."""
    n_samples: int
    """How many samples the fit used."""
    relative: bool
    """True if each sample was weighted by 1/seconds (relative errors), False for plain least squares."""
    relative_error: float = math.nan
    """The median over the samples of ``|predicted / measured - 1|``: the error a relative
    fit minimises, in the units a reader can judge (0.2 = 20 %)."""

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
    computed on the unweighted seconds either way (so it can fall below 0, see
    :class:`Fit`); ``relative_error`` is the median relative miss.
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
    relative_error = float(np.median(np.abs(residual) / y))
    return Fit(model=AlphaBeta(float(alpha), float(beta)), r_squared=r_squared,
               n_samples=len(rows), relative=relative, relative_error=relative_error)

