"""Predicted (``tutorial_lib.costs.memory_model``) against measured memory, per rank of a 4D run.

Shared by the equivalence tests (``test_pipeline_training.py`` checks every run it launches)
and ``test_memory.py``: no launch of its own.
"""
from tutorial_lib import costs
from tutorial_lib.grid import megatron_grids

#: Saved activations per rank with EP: a rank's experts hold as many routed copies as the
#: router sends them, the model assumes the balanced ``K T / EP``.  Measured on the
#: equivalence tests' EP layouts (each chunk's mean over a step's microbatches, and the
#: peak, each of 3 steps): within 5 % on most, 5.9 % on PP 2 x EP 4 and 5.0 % on TP 2 x EP 4
#: (one expert per EP rank: a rank's routed load is one expert's), 5.5 % with interleaved
#: 1F1B on PP 3 x EP 2 (a chunk holds one MoE layer): a freshly drawn router is that
#: unbalanced on a few dozen tokens.  Hence 7 %; the EP group's mean is exact (below).
ACTIVATION_RTOL = 0.07


def predicted_memory(args):
    """The model's prediction for ``args`` (a ``TrainingArgs``), one entry per pipeline rank."""
    parallel, model, train = args.configs()
    return costs.memory_per_rank(model, parallel, train, args.schedule, args.chunks_per_rank,
                                 data_parallel_sharding_strategy=args.sharding_strategy,
                                 recompute=args.recompute)


def assert_memory_as_predicted(args, results, rtol: float | None = None) -> None:
    """Every rank's logged ``memory`` (each step) against the prediction: weights,
    gradients and optimizer state equal to the byte; saved activations of each microbatch
    and their peak equal to the byte without EP; with EP the peak and the mean over the
    step's microbatches within :data:`ACTIVATION_RTOL` on each rank (``rtol``: a caller's
    own, stated where it is passed), and each microbatch's mean over the EP group to the
    byte."""
    parallel = args.configs()[0]
    parallel.world_size = args.world_size
    predicted = predicted_memory(args)
    dense, _ = megatron_grids(parallel)
    exact = args.expert_model_parallel_size == 1
    rtol = ACTIVATION_RTOL if rtol is None else rtol
    for rank, records in enumerate(results):
        expected = predicted[dense.coords(rank)["pp"]]
        for record in records:
            got = record["memory"]
            where = f"rank {rank} iteration {record['iteration']}"
            for key in ("weights", "gradients", "optimizer"):
                assert got[key] == getattr(expected, key), (where, key, got[key], getattr(expected, key))
            per_chunk: dict[int, list[int]] = {}
            for key, n in got["activations_per_microbatch"].items():
                per_chunk.setdefault(int(key.split(",")[1]), []).append(n)
            if exact:  # every microbatch of every chunk, and the peak, to the byte
                for chunk, values in per_chunk.items():
                    assert set(values) == {expected.activations_per_microbatch[chunk]}, (where, chunk, values)
                assert got["peak_activations"] == expected.activations, where
                continue
            # EP: each microbatch's routed copies per EP rank follow the routing
            pairs = [(got["peak_activations"], expected.activations)]
            pairs += [(sum(values) / len(values), expected.activations_per_microbatch[chunk])
                      for chunk, values in per_chunk.items()]
            for measured, model in pairs:
                assert abs(measured - model) <= rtol * model, (where, measured, model)
    if not exact:
        _assert_the_ep_groups_mean_is_exact(parallel, predicted, results, dense)


def _assert_the_ep_groups_mean_is_exact(parallel, predicted, results, dense) -> None:
    """The all-to-all moves every copy somewhere: an EP group's ranks receive together
    exactly the ``K T`` copies each sends, so their mean bytes per microbatch are the
    prediction's to the byte."""
    _, expert = megatron_grids(parallel)
    for group in expert.groups("ep"):
        stage = {dense.coords(rank)["pp"] for rank in group}
        assert len(stage) == 1
        expected = predicted[stage.pop()]
        for step in range(len(results[group[0]])):
            keys = results[group[0]][step]["memory"]["activations_per_microbatch"]
            for key in keys:
                total = sum(results[r][step]["memory"]["activations_per_microbatch"][key] for r in group)
                chunk = int(key.split(",")[1])
                assert total == len(group) * expected.activations_per_microbatch[chunk], (group, key)
