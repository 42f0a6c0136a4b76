"""The single controller's data path (bidirl.perf.controller_data): the bytes a veRL trainer call moves through its
driver, their charge in the colocated baseline and the asynchronous trainer, and the fit of its rate on one row."""

import math

import pytest

from bidirl.experiments import fidelity_external as F
from bidirl.job import config as cfgmod
from bidirl.job import presets
from bidirl.perf import controller_data as D
from bidirl.perf.predictor import StagePredictor, controller_seconds_per_local_update
from bidirl.sim import simulate
from bidirl.sim.verl_update import VerlUpdate

#: the fidelity jobs' padded lengths: max_prompt_length 2,048 + max_response_length 28,672
P, R = 2048, 28672


def test_a_sample_of_the_fidelity_job_moves_its_padded_tensors():
    # log-prob call: int64 input_ids, attention_mask, position_ids over P + R, responses and response_mask over R,
    # prompts over P, sent; fp32 old_log_probs and entropys over R, returned
    sent = 8 * (3 * (P + R) + 2 * R + P)
    assert sent == 1_212_416
    assert D.sample_bytes("old_logprob", P, R) == sent + 4 * R * 2 == 1_441_792
    # update call: the same plus fp32 old_log_probs, token_level_scores, token_level_rewards, advantages, returns
    assert D.sample_bytes("actor_update", P, R) == sent + 4 * R * 5 == 1_785_856
    # fully-async bypass: the rollout's log-probs ride in the batch as one more fp32 response tensor
    assert D.sample_bytes("actor_update", P, R, rollout_log_probs=True) == sent + 4 * R * 6


def test_a_call_moves_one_copy_per_gpu_of_a_ulysses_group_and_no_more_with_more_gpus():
    one = D.call_bytes("actor_update", 8192, 1, P, R)
    assert D.call_bytes("actor_update", 8192, 4, P, R) == 4 * one
    assert D.call_bytes("actor_update", 2048, 4, P, R) * 4 == D.call_bytes("actor_update", 8192, 4, P, R)


@pytest.mark.parametrize("stage, p, r", [("rollout", P, R), ("actor_update", P, 0), ("old_logprob", -1, R)])
def test_bad_calls_are_refused_by_name(stage, p, r):
    with pytest.raises(ValueError, match="sample_bytes"):
        D.sample_bytes(stage, p, r)


def _preset(tmp_path, base="h100", rate=1e9):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return F._write_preset(presets.hardware(base), {"controller_data_rate": rate}, tmp_path)


def _cfg(hardware="h100", **rl):
    base = {"model": "qwen3-8b", "hardware": hardware, "seed": 0,
            "cluster": {"gpus": 16, "gpus_per_node": 8, "rollout_tensor_parallel": 2},
            "workload": {"dataset": "gsm8k", "prompts_per_step": 16, "group_size": 4, "max_response_len": 1024,
                         "max_prompt_len": 512, "steps": 2},
            "rl": {"staleness": 0, "partial_rollout": False, "micro_batch_per_device": 1, "reference_model": False,
                   "max_tokens_per_micro_batch": 4096, "mini_batch_prompts": 4, "sequence_parallel": 2, **rl},
            "scheduler": {"policy": "no-borrow"}}
    return cfgmod.from_dict(base)


def test_a_preset_without_a_rate_charges_nothing():
    cfg = _cfg()
    assert cfg.hardware_spec.controller_data_rate is None
    assert D.call_seconds("actor_update", 64, cfg) == 0.0
    assert VerlUpdate.of(cfg, trainer_layout=4).controller_time("actor_update") == 0.0
    sp = simulate(cfg, "verl-colocated", steps=1).log.spans_df()
    assert not sp["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") == "dispatch").any()


def test_the_colocated_baseline_pays_each_stage_calls_bytes_over_the_rate(tmp_path):
    """One dispatch span per stage per step, each the step batch's bytes over the rate up to jitter: a span is scaled
    by exp(N(0, 0.03)), within exp(±0.15) = 0.86–1.16 at 5 σ."""
    cfg = _cfg(hardware=_preset(tmp_path, rate=1e8))
    samples = 16 * 4
    sp = simulate(cfg, "verl-colocated", steps=2).log.spans_df()
    disp = sp[sp["detail"].map(lambda d: isinstance(d, dict) and d.get("direction") == "dispatch")]
    assert len(disp) == 2 * len(cfg.rl.stages)
    for _, s in disp.iterrows():
        nominal = D.job_call_bytes(s["detail"]["stage"], samples, cfg) / 1e8
        assert nominal == pytest.approx(2 * samples * D.sample_bytes(s["detail"]["stage"], 512, 1024) / 1e8)
        assert math.exp(-0.15) <= (s["end"] - s["start"]) / nominal <= math.exp(0.15)


def test_the_fidelity_page_counts_the_dispatch_in_its_stage(tmp_path):
    """simulate_row's old_log_prob / update_actor include their calls' data path: the stage figures move by the
    bytes over the rate (jitter as above: each within 16 %)."""
    fs = F.load()
    row = fs.row("colocated-64")
    fast = F.simulate_row(fs, row, _preset(tmp_path / "a", "h20", 1e12), quick=True)
    slow = F.simulate_row(fs, row, _preset(tmp_path / "b", "h20", 1e9), quick=True)
    cfg = fs.config(row)
    for metric, stage in F.STAGE_OF_METRIC.items():
        nominal = D.job_call_bytes(stage, 512 * 16, cfg) * (1e-9 - 1e-12)
        assert math.exp(-0.16) <= (slow[metric] - fast[metric]) / nominal <= math.exp(0.16)


def test_the_async_trainer_pays_its_local_updates_calls_and_the_step_total_does_not_depend_on_their_count(tmp_path):
    hw = _preset(tmp_path, rate=1e8)
    per_step = []
    for ups in (1, 2, 4):
        cfg = _cfg(hardware=hw, recompute_old_logprob=False, updates_per_sync=ups)
        per_update = controller_seconds_per_local_update(cfg, cfg.hardware_spec)
        assert per_update == pytest.approx(
            D.job_call_bytes("actor_update", 16 // ups * 4, cfg) / 1e8)
        per_step.append(ups * per_update)
        plain = StagePredictor.from_config(_cfg(recompute_old_logprob=False, updates_per_sync=ups), 2, 4)
        charged = StagePredictor.from_config(cfg, 2, 4)
        assert charged.step_overhead - plain.step_overhead == pytest.approx(per_update)
    assert per_step == pytest.approx([per_step[0]] * 3)


def test_a_preset_with_a_bad_rate_is_refused_by_name(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(open(_preset(tmp_path)).read().replace("controller_data_rate: 1000000000.0",
                                                             "controller_data_rate: -3"))
    with pytest.raises(presets.PresetError, match="controller_data_rate"):
        presets.load_hardware_file(path)


def test_the_joint_fit_recovers_a_known_rate_and_efficiency():
    """On a model whose workers' seconds are c / mfu (log-prob c = 10, update c = 40), stage times with mfu 0.5 and
    rate 2e9 B/s are reproduced by those knobs."""
    data_bytes = {"old_log_prob": 1.0e11, "update_actor": 1.3e11}
    workers = lambda mfu: {"old_log_prob": 10 / mfu, "update_actor": 40 / mfu}
    targets = {m: workers(0.5)[m] + data_bytes[m] / 2e9 for m in data_bytes}
    knobs, hit = F._solve_with_data_path(workers, data_bytes, targets)
    assert knobs["train_mfu"] == pytest.approx(0.5, rel=1e-3)
    assert knobs["controller_data_rate"] == pytest.approx(2e9, rel=1e-3)
    assert hit == ()


def test_the_joint_fit_reports_a_knob_pressed_against_its_bound():
    """Stage times whose split would need mfu > 1 leave train_mfu at its bound, named."""
    data_bytes = {"old_log_prob": 1.0e11, "update_actor": 1.3e11}
    workers = lambda mfu: {"old_log_prob": 10 / mfu, "update_actor": 40 / mfu}
    targets = {m: workers(2.0)[m] + data_bytes[m] / 2e9 for m in data_bytes}
    knobs, hit = F._solve_with_data_path(workers, data_bytes, targets)
    assert knobs["train_mfu"] == pytest.approx(1.0)
    assert hit == ("train_mfu",)
