"""Expert parallelism as a planner layout dimension (bidirl.perf.expert_parallel, docs/architecture.md "MoE")."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bidirl.job import presets
from bidirl.job.config import ConfigError, load
from bidirl.job.planner import plan
from bidirl.perf import expert_parallel as ep_mod
from bidirl.perf.params import default_trainer_params, ring_bandwidth
from bidirl.perf.trainer import TrainerModel

Q30 = presets.model("qwen3-30b-a3b")
QMOE = presets.model("qwen1.5-moe-a2.7b")
DENSE = presets.model("qwen2.5-3b")
A6000, H100 = presets.hardware("a6000"), presets.hardware("h100")


def _job(model="qwen3-30b-a3b", hardware="a6000", gpus=32, **rl):
    return {"model": model, "hardware": hardware,
            "cluster": {"gpus": gpus, "gpus_per_node": 8, "placement": "node-aligned"},
            "workload": {"dataset": "gsm8k", "prompts_per_step": 128, "group_size": 8, "max_response_len": 2048,
                         "steps": 20},
            "rl": {"staleness": 1, "partial_rollout": True, "micro_batch_per_device": 4, **rl}, "seed": 0}


# --------------------------------------------------------------------------------------------------
# sharding: EP conserves the expert parameters; states per GPU do not depend on ep
# --------------------------------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8, 16, 32]), st.data())
def test_ep_sharding_conserves_expert_parameters(per_rank, layout, data):
    ep = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if layout % d == 0]))
    experts = per_rank * ep
    m = dataclasses.replace(Q30, experts=experts, experts_per_token=min(Q30.experts_per_token, experts),
                            params_nonembedding=Q30.params_nonembedding
                            - Q30.moe_layers * (Q30.experts - experts) * Q30.expert_params
                            - Q30.moe_layers * Q30.hidden * (Q30.experts - experts))
    held = ep_mod.expert_params_per_gpu(m, layout, ep)
    # every expert is held by exactly one EP rank, and its parameters are split over the rank's EDP group
    owners = np.concatenate([list(ep_mod.experts_of_rank(m, ep, i)) for i in range(ep)])
    assert sorted(owners.tolist()) == list(range(experts))
    assert held.sum() == pytest.approx(m.routed_expert_params, rel=1e-12)
    # each GPU keeps 1/ρ of the experts whatever ep: EP moves no memory between GPUs, only communication
    assert np.allclose(held, m.routed_expert_params / layout, rtol=1e-12)


def test_ep_degrees_divide_the_replica_and_the_experts_and_are_whole_nodes():
    assert ep_mod.expert_parallel_sizes(Q30, 16, 8) == [1, 2, 4, 8, 16]
    assert ep_mod.expert_parallel_sizes(QMOE, 16, 8) == [1, 2, 4]          # 60 experts: 8 and 16 do not divide
    assert ep_mod.expert_parallel_sizes(QMOE, 24, 8) == [1, 2, 3, 4, 6]    # 12 spans nodes without being whole ones
    assert ep_mod.expert_parallel_sizes(DENSE, 16, 8) == [1]
    assert "dense model" in ep_mod.ep_problem(DENSE, 8, 2, 8)
    assert "whole nodes" in ep_mod.ep_problem(QMOE, 24, 12, 8)
    assert ep_mod.rollout_expert_parallel_sizes(Q30, 2) == [1, 2]
    assert ep_mod.rollout_expert_parallel_sizes(Q30, 1) == [1]


# --------------------------------------------------------------------------------------------------
# communication: FSDP gathers inside the EDP group, all-to-alls from their mechanism
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hw", [A6000, H100])
@pytest.mark.parametrize("layout", [1, 2, 8, 16, 32])
def test_ep_1_moves_what_fsdp_alone_moves(hw, layout):
    w = Q30.params_total * Q30.dtype_bytes
    share = (layout - 1) / layout
    assert ep_mod.fsdp_message_bytes(Q30, hw, layout, 1, "old_logprob") == pytest.approx(w * share, rel=1e-12)
    assert ep_mod.fsdp_message_bytes(Q30, hw, layout, 1, "actor_update") == pytest.approx(
        (2 * w + 4 * Q30.params_total) * share, rel=1e-12)


def test_ep_gathers_only_the_ranks_own_experts():
    # inside a node (ρ = 8, all links NVLink): experts / ep gathered over the ρ/ep GPUs of the EDP group
    rest = Q30.params_total - Q30.routed_expert_params
    for ep in (2, 4, 8):
        edp = 8 // ep
        want = 2 * (rest * 7 / 8 + Q30.routed_expert_params / ep * (edp - 1) / edp)
        assert ep_mod.fsdp_message_bytes(Q30, H100, 8, ep, "old_logprob") == pytest.approx(want, rel=1e-12)
    assert ep_mod.fsdp_message_bytes(Q30, H100, 8, 8, "old_logprob") == pytest.approx(2 * rest * 7 / 8, rel=1e-12)
    # across two A6000 nodes the EP-8 EDP pairs (one GPU per node, 8 pairs at once) share the node's NIC: each
    # gets its per-GPU 3.125 GB/s, 8× slower than the 16-GPU ring's 25 GB/s, so its bytes weigh 8× at the ring's rate
    ring, edp = ring_bandwidth(A6000, 16), ep_mod.edp_bandwidth(A6000, 16, 8)
    assert (ring, edp) == (pytest.approx(25e9), pytest.approx(3.125e9))
    want = 2 * (rest * 15 / 16 + Q30.routed_expert_params / 8 * 0.5 * ring / edp)
    assert ep_mod.fsdp_message_bytes(Q30, A6000, 16, 8, "old_logprob") == pytest.approx(want, rel=1e-12)


def test_all_to_all_seconds_from_the_mechanism():
    per_pass = 2 * Q30.moe_layers * Q30.experts_per_token * Q30.hidden * Q30.dtype_bytes   # dispatch + combine
    # inside a node: (ep − 1)/ep of a token's copies leave the GPU, over NVLink
    assert ep_mod.all_to_all_seconds_per_token(Q30, H100, 8, "old_logprob") == pytest.approx(
        per_pass * 7 / 8 / H100.intra_node_bandwidth, rel=1e-12)
    # the update: forward + backward; a recomputing backward redoes the forward's
    assert ep_mod.all_to_all_seconds_per_token(Q30, H100, 8, "actor_update") == pytest.approx(
        2 * per_pass * 7 / 8 / H100.intra_node_bandwidth, rel=1e-12)
    assert ep_mod.all_to_all_seconds_per_token(Q30, H100, 8, "actor_update", recompute=True) == pytest.approx(
        3 * per_pass * 7 / 8 / H100.intra_node_bandwidth, rel=1e-12)
    # across two nodes: 7/16 over NVLink and 8/16 over the network at once; the network's share is slower
    assert ep_mod.all_to_all_seconds_per_token(Q30, A6000, 16, "old_logprob") == pytest.approx(
        max(per_pass * 7 / 16 / A6000.intra_node_bandwidth, per_pass * 8 / 16 / A6000.inter_node_bandwidth), rel=1e-12)
    assert ep_mod.all_to_all_seconds_per_token(Q30, H100, 1, "old_logprob") == 0.0
    assert ep_mod.all_to_all_seconds_per_token(DENSE, H100, 8, "old_logprob") == 0.0


def test_all_to_alls_raise_alpha_per_linear_flop():
    base = default_trainer_params(Q30, H100, 8)
    got = ep_mod.with_expert_parallel(base, Q30, H100, 8, 8)
    for s, m in (("old_logprob", 1), ("actor_update", 3)):
        delta = ep_mod.all_to_all_seconds_per_token(Q30, H100, 8, s) / (8 * 2 * Q30.params_active_nonembedding * m)
        assert got.alpha[s] == pytest.approx(base.alpha[s] + delta, rel=1e-12)
    assert ep_mod.with_expert_parallel(base, Q30, H100, 1, 8) is base
    model = TrainerModel(Q30, H100, layout=8, params=got, expert_parallel=8)
    assert model.message_bytes("old_logprob") == ep_mod.fsdp_message_bytes(Q30, H100, 8, 8, "old_logprob")


def test_fsdp_across_nodes_runs_at_the_nodes_network_not_one_gpus_share():
    """The A6000 MoE trainer step was charged FSDP's ring at one GPU's share of the node's NIC (3.125 GB/s): 8× too
    slow for a ring, which crosses each node boundary once per channel over the node's whole 200 Gb/s."""
    for hw in (A6000, H100):
        assert ring_bandwidth(hw, 8) == hw.intra_node_bandwidth
        assert ring_bandwidth(hw, 16) == min(hw.intra_node_bandwidth, 8 * hw.inter_node_bandwidth)
        assert default_trainer_params(Q30, hw, 16).beta_comm["old_logprob"] == 1 / ring_bandwidth(hw, 16)
    # one actor_update micro-batch's FSDP traffic of Qwen3-30B-A3B on a 16-GPU A6000 replica: (2·2 + 4)·N·15/16 bytes
    t = TrainerModel(Q30, A6000, layout=16)
    comm = t.params.beta_comm["actor_update"] * t.message_bytes("actor_update")
    assert comm == pytest.approx(8 * Q30.params_total * 15 / 16 / 25e9, rel=1e-12)           # 9.2 s, was 73 s
    assert comm < 8 * Q30.params_total * 15 / 16 / A6000.inter_node_bandwidth / 7


# --------------------------------------------------------------------------------------------------
# hot-switch compatibility when the roles' EP differ
# --------------------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 6), st.integers(1, 6),
       st.data())
def test_differing_ep_leaves_compatibility_to_the_replicas(rho_r, rho_t, a, b, data):
    from bidirl.job.planner import compatible
    g_r, g_t = a * 8, b * 8
    ep_r = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if rho_r % d == 0]))
    ep_t = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if rho_t % d == 0]))
    # an EP group inside its replica: whole replicas of both roles in each pool is the whole rule, whatever EPs
    assert ep_mod.compatible(g_r, g_t, rho_r, rho_t, ep_r, ep_t) == compatible(g_r, g_t, rho_r, rho_t)
    assert ep_mod.compatible(g_r, g_t, rho_r, rho_t, ep_r, ep_t) == ep_mod.compatible(g_r, g_t, rho_r, rho_t, 1, 1)


def test_an_ep_group_wider_than_its_replica_is_incompatible():
    assert ep_mod.compatible(16, 16, 2, 16, 1, 8)
    assert not ep_mod.compatible(16, 16, 2, 16, 4, 8)        # a 4-GPU rollout EP group in a 2-GPU replica
    assert not ep_mod.compatible(16, 16, 2, 8, 1, 16)


# --------------------------------------------------------------------------------------------------
# the planner: EP as a layout dimension, fixed by rl.expert_parallel, explained
# --------------------------------------------------------------------------------------------------

def test_the_planner_weighs_every_ep_degree_and_keeps_the_fastest():
    p = plan(_job())
    env, options = p.envelope, p.expert_parallel_options
    assert sorted(options) == [1, 2, 4, 8, 16]
    best = max(options, key=lambda ep: (options[ep][1], -options[ep][0], -ep))
    assert env.trainer_expert_parallel == best
    assert env.trainer_time == pytest.approx(options[best][0], rel=1e-12)
    # the chosen degree is a real improvement over FSDP alone on two A6000 nodes
    assert options[best][0] < options[1][0]
    d = p.to_dict()
    assert d["envelope"]["trainer_expert_parallel"] == best
    assert [o["trainer_expert_parallel"] for o in d["expert_parallel_options"]] == [1, 2, 4, 8, 16]


def test_a_fixed_ep_is_kept_and_the_same_as_the_planners_row():
    free = plan(_job())
    fixed = plan(_job(expert_parallel=1))
    assert fixed.envelope.trainer_expert_parallel == 1 and list(fixed.expert_parallel_options) == [1]
    assert fixed.envelope.trainer_time == pytest.approx(free.expert_parallel_options[1][0], rel=1e-12)
    dense = plan(_job("qwen2.5-3b"))
    assert dense.envelope.trainer_expert_parallel == 1 and list(dense.expert_parallel_options) == [1]


def test_rollout_ep_changes_no_modelled_time():
    a, b = plan(_job()), plan(_job() | {"cluster": {**_job()["cluster"], "rollout_expert_parallel": 2}})
    assert b.envelope.rollout_expert_parallel == 2
    assert b.envelope.rollout_time == a.envelope.rollout_time
    assert b.choice == a.choice


@pytest.mark.parametrize("where, value, match", [
    ("rl", 2, "dense model"),
    ("cluster", 2, "dense model"),
])
def test_ep_on_a_dense_model_is_a_named_error(where, value, match):
    job = _job("qwen2.5-3b")
    key = "expert_parallel" if where == "rl" else "rollout_expert_parallel"
    job[where] = {**job[where], key: value}
    with pytest.raises(ConfigError, match=match) as e:
        load(job)
    assert e.value.field == f"{where}.{key}"


def test_bad_ep_degrees_are_named_errors():
    with pytest.raises(ConfigError, match="does not divide") as e:
        load(_job(expert_parallel=3))
    assert e.value.field == "rl.expert_parallel"
    with pytest.raises(ConfigError, match="whole nodes") as e:
        load(_job("qwen1.5-moe-a2.7b", expert_parallel=12))
    assert e.value.field == "rl.expert_parallel"
    with pytest.raises(ConfigError, match="replica") as e:          # 32 GPUs cannot shard a 16-GPU replica's experts
        plan(_job(expert_parallel=32))
    assert e.value.field == "rl.expert_parallel"
    job = _job()
    job["cluster"]["rollout_expert_parallel"] = 4                   # the A6000 rollout replica is 2 GPUs
    with pytest.raises(ConfigError, match="1, 2") as e:
        plan(job)
    assert e.value.field == "cluster.rollout_expert_parallel"


def test_engine_runs_refuse_expert_parallel():
    from bidirl.job.config import check_engine_run
    job = _job(expert_parallel=8)
    job["transport"] = {"weights": "object_store"}
    with pytest.raises(ConfigError) as e:
        check_engine_run(load(job))
    assert e.value.field == "rl.expert_parallel"


def test_from_verl_maps_the_rollouts_expert_parallel_size():
    from bidirl.job.from_verl import convert
    args = ["actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B", "actor_rollout_ref.rollout.name=vllm",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "trainer.nnodes=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.train_batch_size=128",
            "actor_rollout_ref.actor.ppo_mini_batch_size=128"]
    ok = convert(args + ["actor_rollout_ref.rollout.expert_parallel_size=4"], hardware="h100")
    assert ok.config["cluster"]["rollout_expert_parallel"] == 4
    with pytest.raises(ConfigError) as e:
        convert(args + ["actor_rollout_ref.rollout.expert_parallel_size=8"], hardware="h100")
    assert e.value.field == "actor_rollout_ref.rollout.expert_parallel_size"


def test_plan_cli_says_why_an_moe_split_differs_from_a_dense_one(tmp_path, capsys):
    import yaml

    from bidirl.cli import main
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(_job()))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "why this split, against the dense qwen2.5-3b" in out
    assert "EP groups of" in out and "compute follows active parameters" in out
    assert main(["plan", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["moe_contrast"]["dense"]["model"] == "qwen2.5-3b"
    assert d["moe_contrast"]["moe"]["trainer_expert_parallel"] == d["envelope"]["trainer_expert_parallel"]
    path.write_text(yaml.safe_dump(_job("qwen2.5-3b")))
    assert main(["plan", str(path)]) == 0
    assert "why this split" not in capsys.readouterr().out


def test_the_dense_counterpart_is_the_dense_model_of_the_active_size():
    from bidirl.job.moe import dense_counterpart
    assert dense_counterpart(Q30) == "qwen2.5-3b"
    assert dense_counterpart(presets.model("tiny-moe")) == "tiny"
