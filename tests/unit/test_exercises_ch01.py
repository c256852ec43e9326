"""Chapter 1's checkers name the classic mistakes (the notebook's exercise cells:
tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import pytest

from tutorial_lib.exercises import ch01
from tutorial_lib.exercises.ch01 import check_data_parallel_group, check_rank_to_coords

from ..notebook_cells import assert_hint, assert_staged_hint, hint_cases
from tests.asserts import every


# --- exercise 1.1: the checker recognises the classic mistakes --------------------------


def coords_fastest_first(rank, order, sizes):
    coords = {}
    for dim in order.split("-"):
        coords[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return coords


def coords_slowest_first(rank, order, sizes):
    coords = {}
    for dim in reversed(order.split("-")):  # the classic mistake
        coords[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return coords


def coords_in_dict_order(rank, order, sizes):
    coords = {}
    for dim, size in sizes.items():  # ignores the order string
        coords[dim] = rank % size
        rank //= size
    return coords


def coords_without_modulo(rank, order, sizes):
    coords, stride = {}, 1
    for dim in order.split("-"):
        coords[dim] = rank // stride
        stride *= sizes[dim]
    return coords


def coords_as_tuple(rank, order, sizes):
    return tuple(coords_fastest_first(rank, order, sizes).values())


def coords_raising(rank, order, sizes):
    return sizes["no such dimension"]


def test_correct_rank_to_coords_passes():
    assert check_rank_to_coords(coords_fastest_first)


@hint_cases([
    (coords_slowest_first, ch01.HINT_SLOWEST_FIRST),
    (coords_in_dict_order, ch01.HINT_DICT_ORDER),
    (coords_without_modulo, ch01.HINT_NO_MODULO),
    (coords_as_tuple, ch01.HINT_NOT_A_DICT),
])
def test_rank_to_coords_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_rank_to_coords(wrong), hint)


def test_an_unexplained_failure_gets_a_nudge_then_the_formula():
    """Exercises that teach: staged hints. The generic hint spells out the mixed-radix formula; a first
    failure gets a nudge toward it, and the formula only when the same cases fail again."""
    assert_staged_hint(check_rank_to_coords, coords_raising, ch01.HINT_COORDS_NUDGE,
                       ch01.HINT_COORDS_GENERIC)


def test_slowest_first_hint_says_fastest_first():
    result = check_rank_to_coords(coords_slowest_first)
    assert "first dimension of the order string as the slowest" in str(result)
    # the failure names a rank, its answer and which coordinates are wrong, never the right ones
    failed = [c.detail for c in result.cases if not c.passed]
    assert any("rank 1: got" in d and "coordinate" in d and "wrong" in d for d in failed)
    assert not any("expected" in d for d in failed)


def test_rank_to_coords_exception_becomes_a_case():
    result = check_rank_to_coords(coords_raising)
    assert every("raised KeyError" in c.detail for c in result.cases)


# --- exercise 1.2 -------------------------------------------------------------------------


def dp_group(rank, world_size, tp, pp, cp=1):
    dp = world_size // (tp * cp * pp)
    tp_i, cp_i, pp_i = rank % tp, (rank // tp) % cp, rank // (tp * cp * dp)
    return [tp_i + tp * (cp_i + cp * (d + dp * pp_i)) for d in range(dp)]


def dp_group_returns_tp_group(rank, world_size, tp, pp, cp=1):
    first = rank - rank % tp
    return list(range(first, first + tp))


def dp_group_forgets_cp(rank, world_size, tp, pp, cp=1):
    return dp_group(rank, world_size, tp, pp, cp=1)  # counts the CP ranks as more replicas


def dp_group_stride_tp(rank, world_size, tp, pp, cp=1):
    dp, stage = world_size // (tp * cp * pp), world_size // pp
    base = rank % tp + stage * (rank // stage)
    return [base + tp * j for j in range(dp)]


def dp_group_dp_outside_pp(rank, world_size, tp, pp, cp=1):
    dp = world_size // (tp * cp * pp)
    tp_i, cp_i, pp_i = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % pp
    return [tp_i + tp * (cp_i + cp * (pp_i + pp * d)) for d in range(dp)]


def dp_group_forgets_cp_everywhere(rank, world_size, tp, pp, cp=1):
    """The right number of replicas, but coordinates read as if the grid were tp-dp-pp."""
    dp = world_size // (tp * cp * pp)
    tp_i, pp_i = rank % tp, rank // (tp * dp)
    return [tp_i + tp * (d + dp * pp_i) for d in range(dp)]


def dp_group_same_rank_mod_tp(rank, world_size, tp, pp, cp=1):
    return [r for r in range(world_size) if r % tp == rank % tp]


def dp_group_whole_world(rank, world_size, tp, pp, cp=1):
    return list(range(world_size))


def dp_group_returns_an_int(rank, world_size, tp, pp, cp=1):
    return rank // tp


def test_correct_data_parallel_group_passes_in_any_order():
    assert check_data_parallel_group(dp_group)
    assert check_data_parallel_group(lambda *args: list(reversed(dp_group(*args))))


@hint_cases([
    (dp_group_returns_tp_group, ch01.HINT_TP_GROUP),
    (dp_group_forgets_cp, ch01.HINT_FORGOT_CP_MERGED),
    (dp_group_stride_tp, ch01.HINT_FORGOT_CP_STRIDE),
    (dp_group_dp_outside_pp, ch01.HINT_DP_OUTSIDE_PP),
    (dp_group_whole_world, ch01.HINT_WHOLE_WORLD),
    (dp_group_returns_an_int, ch01.HINT_NOT_A_LIST),
])
def test_data_parallel_group_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_data_parallel_group(wrong), hint)


@hint_cases([
    (dp_group_forgets_cp_everywhere, ch01.HINT_FORGOT_CP_EVERYWHERE),
    (dp_group_same_rank_mod_tp, ch01.HINT_SAME_TP_RANK),
])
def test_the_two_common_group_mistakes_get_their_own_hints(wrong, hint):
    """Exercises that teach: "forgot CP everywhere" and "all ranks with the same rank % tp" got the
    generic hint. Megatron-Core 0.20.0 (d98e8a64), megatron/core/parallel_state.py,
    initialize_model_parallel: the dense ranks are laid out in the order tp-cp-ep-dp-pp
    (its ``order`` argument), and the data-parallel group (RankGenerator.get_ranks("dp"))
    holds the ranks that share every coordinate but dp: one dp step is TP*CP ranks, one
    pipeline stage TP*CP*DP ranks (EP = 1 in the dense grid)."""
    assert_hint(check_data_parallel_group(wrong), hint)
    result = check_data_parallel_group(wrong)
    assert every("differs from rank" in c.detail for c in result.cases if not c.passed)


def test_a_wrong_group_is_described_not_corrected():
    """Exercises that teach: the detail says which member does not belong and why, never the group."""
    result = check_data_parallel_group(dp_group_returns_tp_group)
    failed = [c.detail for c in result.cases if not c.passed]
    assert failed and not any("expected" in d for d in failed)
    assert "rank 1 is in it, but its tp coordinate differs from rank 0's" in failed[0]


def test_forgetting_cp_fails_only_where_cp_is_above_one():
    result = check_data_parallel_group(dp_group_forgets_cp)
    failed = [c.name for c in result.cases if not c.passed]
    assert failed and all("cp=1" not in name for name in failed)


@pytest.mark.parametrize("garbage", [None, "0,2", {0: 2}, object()])
def test_checkers_never_raise_on_garbage(garbage):
    for checker in (check_rank_to_coords, check_data_parallel_group):
        result = checker(lambda *args, **kwargs: garbage)
        assert not result.passed and result.hint
