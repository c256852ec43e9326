"""The planner: its search against brute force on small worlds, its command line."""
import itertools
import json

import pytest

from tutorial_lib import plan as planner
from tutorial_lib.config import ConfigError, ModelConfig
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.model_flops import gpt
from tutorial_lib.costs.step_time import Layout, check_layout, predict_step


def _brute_force(model, where, gpus, batch, efficiency):
    """Every combination of every choice in ranges wider than the planner's, predicted one
    by one with its memory; the valid ones that fit, fastest first."""
    out = []
    sizes = range(1, gpus + 1)
    for tp, cp, pp, mbs, v in itertools.product(sizes, sizes, sizes, range(1, batch + 1),
                                                range(1, model.num_layers + 1)):
        if gpus % (tp * cp * pp):
            continue
        for schedule, recompute, sharding in itertools.product(
                ("1f1b", "interleaved", "dualpipev", "gpipe"), (None, "selective", "full"),
                ("no_shard", "optim", "optim_grads", "optim_grads_params")):
            layout = Layout(tp, cp, pp, 1, gpus // (tp * cp * pp), v, schedule, mbs,
                            recompute, sharding)
            try:
                check_layout(model, layout, batch)
            except ConfigError:
                continue
            result = predict_step(model, where, layout, batch, efficiency)
            if result.fits:
                out.append(result)
    return sorted(out, key=lambda r: r.step_time_s)


def test_search_returns_exactly_the_fitting_layouts_brute_force_finds():
    # big enough that the A100 40GB refuses some layouts, small enough to try them all
    model = gpt(8, 4096, 32, seq_length=2048, vocab_size=32000)
    where = cluster("a100-40gb", gpus_per_node=4)
    found = planner.plan(model, where, 8, 16, efficiency=0.5, top=None)
    expected = _brute_force(model, where, 8, 16, 0.5)
    assert found.candidates > len(found.layouts) > 0    # some do not fit
    assert {r.layout for r in found.layouts} == {r.layout for r in expected}
    assert len(found.layouts) == len(expected)
    times = [r.step_time_s for r in found.layouts]
    assert times == sorted(times) and all(r.fits for r in found.layouts)


def test_top_stops_early_with_the_same_leaders():
    model = gpt(8, 4096, 32, seq_length=2048, vocab_size=32000)
    where = cluster("a100-40gb", gpus_per_node=4)
    every = planner.plan(model, where, 8, 16, efficiency=0.5, top=None)
    three = planner.plan(model, where, 8, 16, efficiency=0.5, top=3)
    assert [r.layout for r in three.layouts] == [r.layout for r in every.layouts[:3]]
    assert three.memory_checked < every.memory_checked


def test_fixed_choices_are_held():
    model = gpt(8, 4096, 32, seq_length=2048, vocab_size=32000)
    found = planner.plan(model, cluster("a100-80gb"), 16, 32, efficiency=0.5,
                         fixed={"tp": 2, "pp": 2, "recompute_granularity": "none"}, top=None)
    # CP is searched: DP x CP is what TP and PP leave of the 16 GPUs
    assert {(r.layout.tp, r.layout.pp, r.layout.dp * r.layout.cp, r.layout.recompute_granularity)
            for r in found.layouts} == {(2, 2, 4, None)}


def test_sixteen_thousand_gpus_is_a_bounded_search():
    """The work is counted, not timed: the candidates the planner times for 16,384 GPUs."""
    model = gpt(128, 25600, 160)
    count = sum(1 for _ in planner.candidate_layouts(model, 16384, 8192))
    assert 0 < count < 40_000


def test_command_line_json_lists_layouts_best_first(capsys):
    code = planner.main(["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads",
                         "32", "--seq-length", "2048", "--vocab-size", "32000", "--gpu",
                         "a100-80gb", "--gpus", "16", "--global-batch-size", "32", "--top", "4",
                         "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 4
    for key in ("tp", "cp", "pp", "ep", "dp", "step_time_s", "tflops_per_gpu", "mfu",
                "hardware_tflops_per_gpu", "memory_gib", "fits"):
        assert key in out["layouts"][0]
    times = [layout["step_time_s"] for layout in out["layouts"]]
    assert times == sorted(times) and all(layout["fits"] for layout in out["layouts"])


@pytest.mark.parametrize("argv, rule", [
    (["--preset", "gpt-175b", "--gpu", "v100", "--gpus", "64", "--global-batch-size", "64"],
     "unknown GPU 'v100'"),
    (["--preset", "gpt-175b", "--gpu", "a100-80gb", "--gpus", "64", "--global-batch-size",
      "64", "--tp", "3"], "do not divide|does not divide"),
    (["--preset", "gpt-175b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch-size", "8"],
     "fits nowhere"),
    (["--num-layers", "4", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch-size", "8"],
     "no --preset"),
])
def test_bad_input_exits_2_naming_the_rule(argv, rule, capsys):
    assert planner.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: [") and __import__("re").search(rule, err)


def test_decision_flow_walks_from_data_parallelism_to_pipelines():
    where = cluster("a100-80gb")
    small = planner.decision_flow(gpt(4, 1024, 16, seq_length=1024, vocab_size=1000), where,
                                  8, 32)
    assert small[0].answer == "yes" and small[0].best.layout.tp == small[0].best.layout.pp == 1
    assert small[-1].question == "Which knob first?"
    # 24 layers of h 12288 (~44B parameters) on 16 A100s: plain DP and ZeRO-1 or 2 keep 2 to
    # 18 bytes of every parameter on each GPU (88 GB and more); ZeRO-3 keeps 16 bytes of a
    # sixteenth, 44 GB, and fits without model parallelism
    big = planner.decision_flow(gpt(24, 12288, 96, seq_length=2048, vocab_size=51200), where,
                                16, 16)
    assert big[0].best is None and big[1].question.startswith("Does sharding")
    assert big[1].best.layout.sharding == "optim_grads_params"
    assert (big[1].best.layout.tp, big[1].best.layout.pp) == (1, 1)
    assert big[-1].best.step_time_s <= big[1].best.step_time_s
    # on 8 of them ZeRO-3's sixteenth is an eighth, 88 GB: the flow walks on to TP and PP
    tight = planner.decision_flow(gpt(24, 12288, 96, seq_length=2048, vocab_size=51200),
                                  where, 8, 8)
    assert [d.best for d in tight] == [None] * 4
    assert tight[2].question.startswith("Does TP") and tight[3].answer.startswith("none")


def test_decision_flow_shards_a_moe_model_with_zero_2():
    """A MoE model of 20 layers (two routed experts of width 14336 each, about 8.2B
    parameters) on 8 A100 40GB: neither plain DP nor ZeRO-1 fits without model
    parallelism (ZeRO-1 keeps 6 bytes of every parameter on each GPU), ZeRO-2 (2 bytes, the
    routed experts' slices over expert-DP) does, so the flow stops at sharding."""
    model = ModelConfig(20, 4096, 32, 2048, 32000, num_experts=2, moe_router_topk=1,
                        moe_ffn_hidden_size=14336, num_query_groups=8, swiglu=True,
                        num_shared_experts=0, first_k_dense_replace=0)
    where = cluster("a100-40gb")
    flow = planner.decision_flow(model, where, 8, 32)
    assert flow[0].best is None and flow[1].question.startswith("Does sharding")
    found = flow[1].best.layout
    assert (found.sharding, found.tp, found.cp, found.pp) == ("optim_grads", 1, 1, 1)
    assert flow[1].answer == "yes, from optim_grads (ZeRO-2)"
    alone = {"tp": 1, "cp": 1, "pp": 1, "sharding": "optim"}
    with pytest.raises(ConfigError, match="fit"):
        planner.plan(model, where, 8, 32, fixed=alone, top=1)


def test_command_line_decide_prints_the_flow(capsys):
    assert planner.main(["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads",
                         "16", "--seq-length", "1024", "--vocab-size", "1000", "--gpu",
                         "a100-80gb", "--gpus", "8", "--global-batch-size", "32",
                         "--decide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Does it fit with data parallelism alone? yes (")
    assert lines[-1].startswith("Which knob first?")


def test_a_model_from_flags_takes_megatrons_moe_defaults_not_the_course_models():
    """``ModelConfig``'s defaults are the course's small model (one shared expert, the first
    layer dense); a model given by flags alone has neither, as Megatron-LM's
    ``--moe-shared-expert-intermediate-size`` (unset) and ``--moe-layer-freq`` (1)."""
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "128", "--num-experts", "8",
             "--gpus", "8", "--global-batch-size", "8"]
    model = planner.model_from_args(planner._parser().parse_args(flags))
    assert (model.num_experts, model.num_shared_experts, model.first_k_dense_replace) == (8, 0, 0)
    given = planner.model_from_args(planner._parser().parse_args(
        flags + ["--num-shared-experts", "2", "--first-k-dense-replace", "1"]))
    assert (given.num_shared_experts, given.first_k_dense_replace) == (2, 1)


def _predicted_from_scratch(model, where, layout, batch, efficiency):
    """``predict_step`` with every cache of the step-time model emptied first: nothing one
    layout computed (the per-rank layers, FLOPs and parameters, the groups' links, the
    memory) can stand in for another's.  (The schedule's simulation stays kept: its key is
    the whole of its input, the schedule, PP, M and V.)"""
    from tutorial_lib.costs import model_flops, step_time
    for module in (step_time, model_flops):
        for value in vars(module).values():
            if hasattr(value, "cache_clear") and value is not step_time._simulated:
                value.cache_clear()
    return predict_step(model, where, layout, batch, efficiency)


@pytest.mark.parametrize("model, gpu, per_node, gpus, batch, shown", [
    # MoE (dense first layer, a shared expert), 7 layers: uneven PP, EP searched, ZeRO-2
    # and ZeRO-3 (routed experts over expert-DP)
    (ModelConfig(7, 4096, 32, 1024, 32000, num_experts=8, num_query_groups=8, swiglu=True),
     "a100-40gb", 2, 4, 16, {"uneven", "ep 2", "optim", "optim_grads", "optim_grads_params"}),
    # dense, 12 layers: interleaved and DualPipeV, ZeRO-2 and ZeRO-3
    (gpt(12, 4096, 32, vocab_size=32000), "a100-40gb", 2, 4, 4,
     {"interleaved", "dualpipev", "optim_grads", "optim_grads_params"}),
])
def test_the_ranked_list_is_each_layout_predicted_on_its_own(model, gpu, per_node, gpus,
                                                            batch, shown):
    """The planner keeps what many layouts share (per-rank layers, FLOPs and parameters by
    pipeline placement, each group's link by sizes): its whole ranked list equals every
    candidate predicted one at a time from empty caches, fitting ones sorted by time."""
    where = cluster(gpu, gpus_per_node=per_node)
    found = planner.plan(model, where, gpus, batch, efficiency=0.5, top=None)
    alone = [_predicted_from_scratch(model, where, layout, batch, 0.5)
             for layout in planner.candidate_layouts(model, gpus, batch)]
    expected = sorted((r for r in alone if r.fits), key=lambda r: r.step_time_s)
    assert found.candidates == len(alone) > len(expected) > 0
    assert [r.layout for r in found.layouts] == [r.layout for r in expected]
    assert found.layouts == expected  # every time, part, byte count and link, to the bit
    kinds = {k for r in found.layouts for k in (r.layout.schedule, r.layout.sharding,
                                                 f"ep {r.layout.ep}")}
    kinds |= {"uneven" for r in found.layouts
              if r.layout.num_layers_in_first_pipeline_stage is not None}
    assert kinds >= shown, kinds  # the cases reach what they are here for
