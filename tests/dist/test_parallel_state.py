"""Live process groups built from the pure grid, checked inside real gloo workers."""
import pytest
import torch
import torch.distributed as dist

from tutorial_lib import comm, parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.grid import EXTRA_GROUP_KINDS, GROUP_KINDS, ProcessGrid
from tutorial_lib.launch import launch

pytestmark = pytest.mark.dist

KINDS = GROUP_KINDS + EXTRA_GROUP_KINDS


def _report_groups(ctx, config, layout, order=None):
    parallel_state.initialize_model_parallel(config, layout=layout, order=order)
    live, sums = {}, {}
    for kind in KINDS:
        try:
            group = parallel_state.get_group(kind)
            live[kind] = dist.get_process_group_ranks(group)
            # The library's index of this rank must be the live group's own rank.
            assert parallel_state.get_rank_in(kind) == dist.get_rank(group=group), kind
        except ValueError as err:  # a middle pipeline stage has no embedding group
            live[kind] = str(err)
    # Closed-form check that each live group really connects its members: the sum of
    # 2**rank over a group is a number no other set of ranks can produce.
    for kind in KINDS:
        if isinstance(live[kind], str):
            continue
        t = torch.tensor([float(2 ** ctx.rank)], dtype=torch.float64)
        comm.all_reduce(t, group=kind)
        sums[kind] = int(t.item())
    parallel_state.destroy_model_parallel()
    return live, sums


@pytest.mark.parametrize("world,tp,pp,ep,cp,layout", [
    (8, 2, 2, 2, 1, "megatron"),
    (8, 1, 2, 4, 1, "megatron"),
    (8, 2, 2, 2, 1, "course"),
    (8, 2, 1, 2, 2, "visualizer"),
    (6, 1, 3, 2, 1, "course"),
    (4, 2, 1, 1, 2, "megatron"),
    (16, 2, 1, 2, 2, "course"),  # expert_dp mixes tp and cp: members must come out sorted
    # Megatron's two grids from another order; whole experts (ETP 1), so that DP = EDP = 2 as
    # an order without pp last needs (with ETP = TP = 2, EDP = 1: refused, test_grid)
    (8, 2, 2, 2, 1, "megatron tp-cp-ep-pp-dp"),
])
def test_live_groups_equal_the_grid(world, tp, pp, ep, cp, layout):
    etp = 1 if " " in layout else None  # None: ETP = TP, Megatron's default
    config = ParallelConfig(world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep, context_parallel_size=cp,
                            expert_tensor_parallel_size=etp)
    layout, _, order = layout.partition(" ")
    grid = ProcessGrid(config, layout=layout, order=order or None)
    if order:  # the order moves groups: the live ones must follow it
        assert grid.groups("dp") != ProcessGrid(config, layout=layout).groups("dp")
    out = launch(_report_groups, world, args=(config, layout, order or None), timeout=90)
    for rank, (live, sums) in enumerate(out.results):
        for kind in KINDS:
            if isinstance(live[kind], str):
                assert kind == "embedding" and "middle pipeline stage" in live[kind]
                assert grid.coords(rank)["pp"] not in (0, pp - 1)
                continue
            expected = grid.group_of(kind, rank)
            assert live[kind] == expected, (rank, kind)
            assert sums[kind] == sum(2 ** r for r in expected), (rank, kind)


def _wrong_world(ctx):
    parallel_state.initialize_model_parallel(ParallelConfig(8, tensor_model_parallel_size=2))


def test_config_world_must_match_the_launch():
    from tutorial_lib.launch import WorkerError
    with pytest.raises(WorkerError, match=r"config.world_size \(8\) differs from the launched world size \(2\)"):
        launch(_wrong_world, 2)
