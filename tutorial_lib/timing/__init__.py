"""Timing runs: the course's measurements on this machine, in one place, apart from the
techniques they time.

Each run starts processes (:func:`tutorial_lib.launch.launch`, through
:func:`timed_launch`), times what a technique module does, and hands back numbers a
chapter compares with its stored reference (:mod:`tutorial_lib.reference`).  The technique
modules never import the launcher; these modules do.

==================  =======  ===============================================================
module              chapter  what it times
==================  =======  ===============================================================
``runs``            all      the shared pieces: :func:`check_timing_args` (every run's
                             argument check), :func:`timed_launch`, :func:`rounds_by_size`
``alpha_beta``      2        every collective per size (:func:`measure_collective`,
                             :func:`measure_alpha_beta`), rows as nccl-tests prints them
``p2p_modes``       7        one steady-state pipeline round in each P2P mode
                             (:func:`steady_state_round`, :func:`measure_p2p_modes`)
``fp8_all_to_all``  8        one all-to-all in BF16 against FP8 (:func:`time_all_to_all`)
``cp_attention``    9        context-parallel attention in each ``cp_comm_type``
                             (:func:`measure_cp_modes`) and the ring's work per rank
                             (:func:`measure_ring_work`)
==================  =======  ===============================================================

Every public name is re-exported here: ``timing.measure_cp_modes``.
"""
from .alpha_beta import (ALPHA_BETA_OPS, ALPHA_BETA_RANKS, ALPHA_BETA_SIZES, COLLECTIVE_SIZES,
                         MEASURABLE_OPS, MEASURE_DEVICES, bandwidth_rows, measure_alpha_beta,
                         measure_collective, samples_from_trace)
from .cp_attention import measure_cp_modes, measure_ring_work
from .fp8_all_to_all import time_all_to_all
from .p2p_modes import (ACTIVATION, GRADIENT, P2P_SIZES, ModeTiming, expected_round,
                        init_pipeline, measure_p2p_modes, ratios_to, steady_state_round,
                        timings_from_trace)
from .runs import TimedRounds, check_timing_args, rounds_by_size, timed_launch

__all__ = [
    "check_timing_args", "timed_launch", "TimedRounds", "rounds_by_size",
    "ALPHA_BETA_OPS", "ALPHA_BETA_RANKS", "ALPHA_BETA_SIZES", "COLLECTIVE_SIZES",
    "MEASURABLE_OPS", "MEASURE_DEVICES", "bandwidth_rows", "measure_alpha_beta",
    "measure_collective", "samples_from_trace",
    "ACTIVATION", "GRADIENT", "P2P_SIZES", "ModeTiming", "expected_round", "init_pipeline",
    "measure_p2p_modes", "ratios_to", "steady_state_round", "timings_from_trace",
    "time_all_to_all",
    "measure_cp_modes", "measure_ring_work",
]
