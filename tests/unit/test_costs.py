"""Closed-form communication costs: hand-computed bytes and times, the fit, the error messages."""
import math

import numpy as np
import pytest

from tutorial_lib import costs, timing
from tutorial_lib.costs import AlphaBeta, Sample
from tests.asserts import every

KIB = 1024
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


# --- bytes each rank sends ----------------------------------------------------------------


@pytest.mark.parametrize("op", COLLECTIVES)
def test_a_group_of_one_sends_nothing(op):
    assert costs.ring_bytes_sent(op, 4096, 1) == 0
    assert costs.ring_steps(op, 1) == 0
    assert costs.predict_time(op, 4096, 1, AlphaBeta(1e-5, 1e-9)) == 0


@pytest.mark.parametrize("op, n, expected", [
    # all-reduce 2(N-1)/N * B with B = 1024
    ("all_reduce", 2, 1024), ("all_reduce", 4, 1536), ("all_reduce", 8, 1792),
    # reduce-scatter (N-1)/N * B, B = full input
    ("reduce_scatter", 2, 512), ("reduce_scatter", 4, 768), ("reduce_scatter", 8, 896),
    # all-gather (N-1) * b, b = 1024-byte shard
    ("all_gather", 2, 1024), ("all_gather", 4, 3072), ("all_gather", 8, 7168),
    # all-to-all (N-1)/N * B, equal splits
    ("all_to_all", 2, 512), ("all_to_all", 4, 768), ("all_to_all", 8, 896),
    # broadcast: the root sends the whole tensor once
    ("broadcast", 2, 1024), ("broadcast", 4, 1024), ("broadcast", 8, 1024),
])
def test_ring_bytes_sent_matches_hand_computed_values(op, n, expected):
    assert costs.ring_bytes_sent(op, KIB, n) == pytest.approx(expected)


def test_per_op_functions_agree_with_the_dispatcher():
    for n in (2, 4, 8):
        assert costs.all_reduce_bytes(KIB, n) == costs.ring_bytes_sent("all_reduce", KIB, n)
        assert costs.reduce_scatter_bytes(KIB, n) == costs.ring_bytes_sent("reduce_scatter", KIB, n)
        assert costs.all_gather_bytes(KIB, n) == costs.ring_bytes_sent("all_gather", KIB, n)
        assert costs.all_to_all_bytes(KIB, n) == costs.ring_bytes_sent("all_to_all", KIB, n)


def test_all_gather_of_shards_costs_what_reduce_scatter_of_the_full_tensor_costs():
    for n in (2, 4, 8):
        shard = KIB
        assert costs.all_gather_bytes(shard, n) == pytest.approx(
            costs.reduce_scatter_bytes(n * shard, n))


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 4, 8):
        full = 8 * KIB
        assert costs.all_reduce_bytes(full, n) == pytest.approx(
            costs.reduce_scatter_bytes(full, n) + costs.all_gather_bytes(full / n, n))


def test_broadcast_last_rank_in_the_chain_sends_nothing():
    assert [costs.broadcast_bytes(KIB, 4, p) for p in range(4)] == [1024, 1024, 1024, 0]
    with pytest.raises(ValueError, match=r"position must be in 0..N-1 = 0..3, got 4"):
        costs.broadcast_bytes(KIB, 4, position=4)


def test_send_carries_the_bytes_and_recv_sends_none():
    assert costs.send_bytes(KIB) == 1024
    assert costs.ring_bytes_sent("send", KIB, 4) == 1024
    assert costs.ring_bytes_sent("recv", KIB, 4) == 0


@pytest.mark.parametrize("op, n, steps", [
    ("all_reduce", 2, 2), ("all_reduce", 4, 6), ("all_reduce", 8, 14),
    ("reduce_scatter", 8, 7), ("all_gather", 4, 3), ("all_to_all", 8, 7),
    ("broadcast", 4, 3), ("send", 8, 1), ("recv", 2, 1),
])
def test_ring_steps(op, n, steps):
    assert costs.ring_steps(op, n) == steps


# --- the alpha-beta model -------------------------------------------------------------------


def test_predict_time_matches_the_formulas_by_hand():
    m = AlphaBeta(alpha=10e-6, beta=1e-9)
    mib = 1 << 20
    # all-reduce, N=4: 2*3 alpha + 2*3/4 * B beta
    assert costs.predict_time("all_reduce", mib, 4, m) == pytest.approx(6 * 10e-6 + 1.5 * mib * 1e-9)
    # reduce-scatter, N=8: 7 alpha + 7/8 B beta
    assert costs.predict_time("reduce_scatter", mib, 8, m) == pytest.approx(7e-5 + 0.875 * mib * 1e-9)
    # all-gather of a B/8 shard on 8 ranks: the same as the reduce-scatter of B
    assert costs.predict_time("all_gather", mib // 8, 8, m) == pytest.approx(
        costs.predict_time("reduce_scatter", mib, 8, m))
    # all-to-all, N=2: 1 alpha + 1/2 B beta
    assert costs.predict_time("all_to_all", mib, 2, m) == pytest.approx(1e-5 + 0.5 * mib * 1e-9)
    # pipelined ring broadcast, N=4: 3 alpha + B beta
    assert costs.predict_time("broadcast", mib, 4, m) == pytest.approx(3e-5 + mib * 1e-9)
    # send and recv: alpha + B beta, whatever the group size
    for op in ("send", "recv"):
        assert costs.predict_time(op, mib, 8, m) == pytest.approx(1e-5 + mib * 1e-9)
    assert m.time("all_reduce", mib, 4) == costs.predict_time("all_reduce", mib, 4, m)


def test_tree_broadcast_pays_log2_rounds_of_the_whole_tensor():
    m = AlphaBeta(alpha=1e-5, beta=1e-9)
    assert costs.tree_broadcast_time(KIB, 8, m) == pytest.approx(3 * (1e-5 + KIB * 1e-9))
    assert costs.tree_broadcast_time(KIB, 5, m) == pytest.approx(3 * (1e-5 + KIB * 1e-9))
    assert costs.tree_broadcast_time(KIB, 1, m) == 0


def test_bandwidth_and_bus_bandwidth():
    assert AlphaBeta(0.0, 1e-9).bandwidth == pytest.approx(1e9)
    assert AlphaBeta(1e-6, 0.0).bandwidth == math.inf
    # all-reduce of 1 MB on 4 ranks in 1 ms: each rank sent 1.5 MB, so 1.5 GB/s on its link
    assert costs.bus_bandwidth("all_reduce", 1e6, 4, 1e-3) == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        costs.bus_bandwidth("all_reduce", 1e6, 4, 0.0)


# --- fitting ------------------------------------------------------------------------------------


def _synthetic(model, noise, seed=0):
    """Timings the model predicts, times (1 + noise * standard normal)."""
    rng = np.random.default_rng(seed)
    samples = []
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send"):
        for n in (2, 4, 8):
            for size in (KIB * 4 ** i for i in range(7)):
                t = costs.predict_time(op, size, n, model) * (1 + noise * rng.standard_normal())
                samples.append(Sample(op, size, n, t))
    return samples


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_known_alpha_and_beta_from_noisy_samples(relative):
    truth = AlphaBeta(alpha=50e-6, beta=1 / 5e9)  # 50 us per step, 5 GB/s
    fit = costs.fit_alpha_beta(_synthetic(truth, noise=0.03), relative=relative)
    assert fit.model.alpha == pytest.approx(truth.alpha, rel=0.05)
    assert fit.model.beta == pytest.approx(truth.beta, rel=0.05)
    assert fit.r_squared > 0.99 and fit.n_samples == 105 and fit.relative is relative
    assert fit.predict("all_reduce", 1 << 20, 4) == pytest.approx(
        costs.predict_time("all_reduce", 1 << 20, 4, truth), rel=0.05)


def test_fit_is_exact_without_noise_and_accepts_plain_tuples():
    truth = AlphaBeta(alpha=2e-6, beta=3e-10)
    samples = [(s.op, s.nbytes, s.n, s.seconds) for s in _synthetic(truth, noise=0.0)]
    fit = costs.fit_alpha_beta(samples)
    assert fit.model.alpha == pytest.approx(truth.alpha, rel=1e-9)
    assert fit.model.beta == pytest.approx(truth.beta, rel=1e-9)
    assert fit.r_squared == pytest.approx(1.0)


def test_fit_never_returns_a_negative_parameter():
    # These sends follow seconds = -100 us + B / (1 GB/s): plain least squares would
    # answer alpha = -1e-4, a negative latency.  The constrained fit holds alpha at 0.
    samples = [Sample("send", size, 2, -1e-4 + size * 1e-9) for size in (1e6, 2e6, 4e6)]
    unconstrained, *_ = np.linalg.lstsq(np.array([[1, 1e6], [1, 2e6], [1, 4e6]]),
                                        np.array([s.seconds for s in samples]), rcond=None)
    assert unconstrained[0] == pytest.approx(-1e-4)
    for relative in (True, False):
        fit = costs.fit_alpha_beta(samples, relative=relative)
        assert fit.model.alpha == 0.0 and fit.model.beta == pytest.approx(1e-9, rel=0.1)


# --- errors name the rule and the numbers ------------------------------------------------------


def test_unknown_op_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown op 'allreduce'.*all_reduce, reduce_scatter"):
        costs.ring_bytes_sent("allreduce", KIB, 4)
    with pytest.raises(ValueError, match="unknown op 'gather'"):
        costs.predict_time("gather", KIB, 4, AlphaBeta(1e-6, 1e-9))


@pytest.mark.parametrize("n", [0, -2, 2.5, True])
def test_group_size_must_be_a_whole_number_of_at_least_one(n):
    with pytest.raises(ValueError, match=r"n \(ranks in the group\) must be a whole number >= 1, "
                                         rf"got {n!r}"):
        costs.ring_bytes_sent("all_reduce", KIB, n)


def test_negative_bytes_are_refused():
    with pytest.raises(ValueError, match="nbytes must be a number >= 0, got -1"):
        costs.all_reduce_bytes(-1, 4)


def test_alpha_beta_must_be_non_negative():
    with pytest.raises(ValueError, match=r"alpha and beta must be >= 0.*alpha=-1e-06"):
        AlphaBeta(alpha=-1e-6, beta=1e-9)


def test_fit_needs_two_samples_and_positive_times():
    with pytest.raises(ValueError, match="needs at least 2 samples, got 1"):
        costs.fit_alpha_beta([Sample("send", 10, 2, 1e-3)])
    with pytest.raises(ValueError, match=r"must be > 0 seconds, got 0.0 for all_reduce of 10 bytes"):
        costs.fit_alpha_beta([Sample("send", 10, 2, 1e-3), Sample("all_reduce", 10, 2, 0.0)])
    with pytest.raises(ValueError, match="nothing to fit"):
        costs.fit_alpha_beta([Sample("all_reduce", 10, 1, 1e-3), Sample("all_gather", 10, 1, 1e-3)])


def test_measure_collective_checks_its_arguments_before_starting_processes():
    with pytest.raises(ValueError, match=r"cannot measure 'recv'"):
        timing.measure_collective("recv")
    with pytest.raises(ValueError, match="world_size must be a whole number >= 2"):
        timing.measure_collective("all_reduce", world_size=1)
    with pytest.raises(ValueError, match="need repeats >= 1"):
        timing.measure_collective("all_reduce", repeats=0)
    with pytest.raises(ValueError, match="sizes must be a non-empty list"):
        timing.measure_collective("all_reduce", sizes=[])


# --- chapter 1's bandwidth table ----------------------------------------------------------------


def test_bandwidth_table_covers_every_parallelism_with_its_collective():
    rows = {r.parallelism: r for r in costs.bandwidth_table()}
    assert list(rows) == ["TP", "CP", "EP", "DP", "PP"]
    assert "all-reduce" in rows["TP"].collective and "O(b s h)" in rows["TP"].volume_per_op
    assert "all-to-all" in rows["EP"].collective and "O(b s h k)" in rows["EP"].volume_per_op
    assert "once per optimizer step" in rows["DP"].frequency and "O(params)" in rows["DP"].volume_per_op
    assert "send/recv" in rows["PP"].collective and "microbatch" in rows["PP"].frequency
    for row in rows.values():
        assert every(getattr(row, f) for f in ("collective", "frequency", "volume_per_op",
                                              "bandwidth_need", "typical_link"))


def test_link_bandwidths_are_labelled_vendor_figures():
    links = {l.name.split(" (")[0].split(",")[0]: l for l in costs.link_bandwidths()}
    assert links["NVLink 4"].gb_per_s_bidirectional == 900
    assert links["PCIe Gen5 x16"].gb_per_s_per_direction == 64
    assert links["InfiniBand NDR"].gb_per_s_per_direction == 50  # 400 Gb/s / 8
    assert every("vendor spec" in l.source for l in links.values())
    assert costs.transfer_seconds(50e9, links["InfiniBand NDR"]) == pytest.approx(1.0)


def test_volume_helpers():
    assert costs.tp_all_reduce_bytes(b=2, s=4, h=8) == 2 * 4 * 8 * 2
    assert costs.dp_gradient_bytes(1000) == 4000
    assert costs.pp_activation_bytes(b=1, s=16, h=8, d=4) == 16 * 8 * 4


# --- what a negative R^2 means ---------------------------------------------------------


def test_a_relative_fit_can_have_a_negative_r_squared_and_still_find_the_model():
    """Pauses as large as the largest honest timing drive R^2 below 0 although alpha and beta
    are recovered; the median relative miss stays small, and sizes up to 64 MiB (timings
    far above the pauses) bring R^2 back near 1 (chapter 2's made-up example)."""
    truth = AlphaBeta(alpha=150e-6, beta=1e-9)
    paused = {4 * KIB, 16 * KIB, 64 * KIB}

    def fit_up_to(top):
        sizes = [KIB * 4 ** i for i in range(9) if KIB * 4 ** i <= top]
        return costs.fit_alpha_beta([
            Sample("all_reduce", b, 2, truth.time("all_reduce", b, 2) + 3e-3 * (b in paused))
            for b in sizes])

    small, large = fit_up_to(4 * 2 ** 20), fit_up_to(64 * 2 ** 20)
    assert small.r_squared < 0 < 0.99 < large.r_squared
    for fit in (small, large):
        assert fit.model.alpha == pytest.approx(truth.alpha, rel=0.25)
        assert fit.model.beta == pytest.approx(truth.beta, rel=0.1)
    assert small.relative_error < 0.25 and large.relative_error < 0.1


def test_relative_error_is_the_median_relative_miss():
    samples = [Sample("send", 10, 2, t) for t in (1e-4, 1e-4, 2e-4, 4e-4, 1e-4)]
    fit = costs.fit_alpha_beta(samples)
    misses = sorted(abs(fit.predict("send", 10, 2) / s.seconds - 1) for s in samples)
    assert fit.relative_error == pytest.approx(misses[2])
    assert costs.fit_alpha_beta([Sample("send", 10, 2, 1e-4), Sample("send", 20, 2, 1e-4)]
                                ).relative_error == pytest.approx(0.0, abs=1e-9)


def test_measure_collective_takes_sizes_per_op_and_checks_each_list():
    with pytest.raises(ValueError, match="for all_gather"):
        timing.measure_collective(["all_reduce", "all_gather"],
                                  sizes={"all_reduce": [1024], "all_gather": []})
    assert timing.ALPHA_BETA_SIZES[-1] == 64 * 2 ** 20 and timing.ALPHA_BETA_RANKS == 2
