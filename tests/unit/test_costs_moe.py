"""``costs`` section 8 (MoE dispatch and combine) against numbers worked out by hand.

The routing: EP = 2, N = 4 experts (rank 0 owns experts 0, 1; rank 1 owns 2, 3), h = 4,
fp32 (a row is 16 bytes).  Rank 0 sends copies to experts [3, 1, 0, 2]: 4 to itself,
2 to rank 1; rank 1 sends [0, 0, 5, 1]: 0 to rank 0, 6 to itself.  So counts = [[4, 2], [0, 6]].
Rank 1 dispatches 6 rows (96 bytes), receives 2 + 6 = 8 (combine: 128 bytes).
"""
import pytest

from tutorial_lib import costs


def test_moe_all_to_all_bytes_is_tokens_times_topk_times_hidden_times_dtype():
    assert costs.moe_all_to_all_bytes(8, 2, 16, 4) == 1024            # 8 * 2 * 16 * 4
    assert costs.moe_all_to_all_bytes(4096, 8, 7168, 1) == 234_881_024  # V3-like, fp8 dispatch
    assert costs.moe_all_to_all_bytes(0, 2, 16, 4) == 0
    with pytest.raises(ValueError, match="topk"):
        costs.moe_all_to_all_bytes(8, -1, 16, 4)


def test_send_counts_sum_each_ranks_load_over_the_destinations_experts():
    assert costs.moe_send_counts([[3, 1, 0, 2], [0, 0, 5, 1]]) == [[4, 2], [0, 6]]
    assert costs.moe_send_counts([[1, 2, 3, 4]]) == [[10]]
    with pytest.raises(ValueError, match="divisible"):
        costs.moe_send_counts([[1, 2, 3], [1, 2, 3]])


def test_rank_all_to_alls_in_issue_order_with_hand_numbers():
    counts = [[4, 2], [0, 6]]
    rows = costs.moe_rank_all_to_alls(counts, rank=1, hidden=4, num_experts=4, bytes_per_element=4)
    got = [(r.phase, r.op_name, r.payload, r.bytes, r.input_splits, r.output_splits) for r in rows]
    assert got == [
        ("forward", "dispatch", "counts", 32, (1, 1), (1, 1)),    # 4 int64 counts
        ("forward", "dispatch", "tokens", 96, (0, 6), (2, 6)),    # row 1 out, column 1 in
        ("forward", "combine", "tokens", 128, (2, 6), (0, 6)),    # the 8 received go back
        ("backward", "combine", "tokens", 96, (0, 6), (2, 6)),
        ("backward", "dispatch", "tokens", 128, (2, 6), (0, 6)),
    ]
    rank0 = costs.moe_rank_all_to_alls(counts, rank=0, hidden=4, num_experts=4, bytes_per_element=4)
    assert [r.bytes for r in rank0] == [32, 96, 64, 96, 64]  # sends 6 rows, receives 4
    # over the group, dispatch bytes sent = combine bytes sent (every copy comes back)
    both = rank0 + rows
    assert (sum(r.bytes for r in both if r.op_name == "dispatch" and r.payload == "tokens"
                and r.phase == "forward")
            == sum(r.bytes for r in both if r.op_name == "combine" and r.phase == "forward"))


def test_one_ep_rank_communicates_nothing_and_bad_ranks_are_refused():
    assert costs.moe_rank_all_to_alls([[12]], rank=0, hidden=4, num_experts=4) == []
    with pytest.raises(ValueError, match="rank"):
        costs.moe_rank_all_to_alls([[4, 2], [0, 6]], rank=2, hidden=4, num_experts=4)


def test_one_ranks_splits_are_its_row_of_the_send_matrix():
    loads = [[3, 0, 1, 2], [0, 0, 4, 1]]  # 4 experts on 2 EP ranks: experts 0-1 on rank 0
    assert costs.moe_rank_send_splits(loads[0], 2) == [3, 3]
    assert costs.moe_rank_send_splits(loads[1], 2) == [0, 5]
    assert costs.moe_send_counts(loads) == [costs.moe_rank_send_splits(row, 2) for row in loads]
    with pytest.raises(ValueError, match=r"N = 3, EP = 2"):
        costs.moe_rank_send_splits([1, 1, 1], 2)


def test_dedup_rows_count_each_token_once_per_node_then_per_rank():
    """DeepEP (deepseek-ai/DeepEP dd758ca, tests/legacy/test_internode.py): a token crosses
    to each node holding one of its experts once (``num_tokens_per_rdma_rank``), to the
    rank with the sender's local index, and reaches each rank holding one of them once
    (``is_token_in_rank``).  EP = 4 as 2 nodes of 2 ranks, 8 experts (2 per rank)."""
    routing = [
        [[0, 1, 2, 7]],          # rank 0: experts on ranks 0, 0, 1, 3 -> nodes 0, 1
        [[4, 5, -1, -1]],        # rank 1: two copies dropped; both left on rank 2 (node 1)
        [],                      # rank 2: no tokens
        [[6, 7, 0, 4]],          # rank 3: ranks 3, 3, 0, 2 -> nodes 1, 0
    ]
    rows = costs.moe_dedup_rows(routing, 8, ranks_per_node=2)
    # node hop: rank 0's token -> node 0 (rank 0 itself) and node 1 (rank 2);
    # rank 1's -> node 1 via rank 3; rank 3's -> node 1 (itself) and node 0 (rank 1)
    assert rows["node"] == [[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1]]
    # rank hop, from where each row landed: rank 0 holds its own token (experts 0, 1, 2
    # on ranks 0, 0, 1); rank 2 holds rank 0's (expert 7 on rank 3); rank 3 holds rank
    # 1's (4, 5 on rank 2) and its own (6, 7 on rank 3, 4 on rank 2); rank 1 holds rank
    # 3's (expert 0 on rank 0)
    assert rows["rank"] == [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 2, 1]]
    one_node = costs.moe_dedup_rows(routing, 8)
    assert list(one_node) == ["rank"]
    assert one_node["rank"] == [[1, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]]
    # the copy dispatcher would send 4 + 2 + 0 + 4 rows; deduplicated, 3 + 1 + 0 + 3
    assert [sum(r) for r in one_node["rank"]] == [3, 1, 0, 3]
    calls = costs.moe_dedup_rank_all_to_alls(one_node, 3, hidden=4, topk=4)
    forward = [(c.op_name, c.payload, c.bytes) for c in calls if c.phase == "forward"]
    assert forward == [("dispatch", "counts", 32), ("dispatch", "tokens", 3 * 16),
                       ("dispatch", "topk_idx", 3 * 32), ("dispatch", "gates", 3 * 16),
                       ("combine", "tokens", 2 * 16)]  # it received 2 rows (ranks 0, 1)
    assert costs.moe_dedup_rows([[[1, 0]]], 2) == {}  # one rank: nothing moves
    with pytest.raises(ValueError, match="ranks_per_node"):
        costs.moe_dedup_rows(routing, 8, ranks_per_node=3)


def test_expert_tp_bytes_gather_my_rows_and_reduce_scatter_every_gathered_row():
    """TP and EP together: with ETP > 1, after its dispatch all-to-all each rank all-gathers the rows it
    received over the expert-TP group and reduce-scatters the partial outputs of all the
    group's rows (Megatron-Core 0.20.0, d98e8a64, token_dispatcher.py
    ``MoEAlltoAllTokenDispatcher.dispatch_postprocess`` / ``combine_preprocess``); comm's byte
    convention: an all-gather counts the rank's shard, a reduce-scatter its whole input."""
    # ETP 2: rank 0 of the group received 5 rows, rank 1 received 3; h = 8, fp32
    assert costs.moe_expert_tp_bytes([5, 3], 0, 8) == {"all_gather": 160, "reduce_scatter": 256}
    assert costs.moe_expert_tp_bytes([5, 3], 1, 8, 2) == {"all_gather": 48, "reduce_scatter": 128}
    assert costs.moe_expert_tp_bytes([0, 0, 4, 0], 3, 4) == {"all_gather": 0, "reduce_scatter": 64}
    with pytest.raises(ValueError, match=r"etp_rank \(2\)"):
        costs.moe_expert_tp_bytes([1, 1], 2, 8)
