"""Bad input to a real (engine) run is rejected before anything starts: no Ray, no engines (unit tests)."""
import os

import pytest

from bidirl.cluster.engines.driver import EngineDriver
from bidirl.core import protocol as P
from bidirl.job import config as cfgmod


def test_engine_runs_need_the_built_in_task():
    cfg = cfgmod.load("tiny-cpu").with_overrides({"workload.dataset": "gsm8k"})
    with pytest.raises(cfgmod.ConfigError) as info:
        EngineDriver(cfg, "bidirl", 1, 0)
    assert info.value.field == "workload.dataset" and "arithmetic" in info.value.fix


def test_engine_runs_of_a_preset_model_need_its_weights():
    with pytest.raises(cfgmod.ConfigError) as info:
        EngineDriver(cfgmod.load("a6000-default").with_overrides({"workload.dataset": "arithmetic"}), "bidirl", 1, 0)
    assert info.value.field == "model" and "model_dir" in info.value.fix


def test_the_report_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="report_seconds"):
        EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=str(tmp_path), report_seconds=0)


def test_unknown_policy_names_the_field():
    from bidirl.cluster.run import run
    with pytest.raises(cfgmod.ConfigError) as info:
        run("tiny-cpu", "bidirll", steps=1)
    assert info.value.field == "scheduler.policy" and "bidirl" in str(info.value)


def test_a_model_folder_without_a_checkpoint_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model_dir .* holds no config.json"):
        EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=str(tmp_path))


# --------------------------------------------------------------------------------------------------
# prompts from a data file and the reward function (workload.data_file, rl.reward)
# --------------------------------------------------------------------------------------------------

SAMPLE = "data/datasets/arithmetic_word/train.parquet"


@pytest.fixture(scope="module")
def fresh_model(tmp_path_factory):
    """A freshly initialised tiny model folder (no warm start): enough to build a driver."""
    from bidirl.rl.tiny_model import create
    return str(create(tmp_path_factory.mktemp("tiny")))


def _driver(model_dir, **overrides):
    cfg = cfgmod.load("tiny-cpu").with_overrides(overrides)
    return EngineDriver(cfg, "bidirl", 1, 0, model_dir=model_dir)


def test_a_data_file_replaces_the_built_in_task_whatever_the_workload_preset(fresh_model):
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    driver = _driver(fresh_model, **{"workload.dataset": "gsm8k", "workload.data_file": str(root / SAMPLE),
                                     "rl.reward": "last_number"})
    assert driver.prompts.source.layout == "verl" and driver.prompts.source.size == 128
    assert driver.max_model_len == driver.prompts.max_prompt_len + 16 <= 64
    req = driver.backend.rollouts.request(P.GroupTask(130))
    row = driver.prompts.source.row(130 % 16)                                          # tiny-cpu's prompt_pool
    assert req.meta == row.reward_input() and req.prompt_ids == driver.prompts.prompt_ids(130)
    assert driver.reward.name == "last_number"


def test_a_missing_data_file_is_named_before_anything_starts(fresh_model, tmp_path):
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"workload.data_file": str(tmp_path / "none.jsonl")})
    assert info.value.field == "workload.data_file" and "no such file" in str(info.value)


def test_a_malformed_row_stops_the_run_before_it_starts(fresh_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(cfgmod.ConfigError, match=r"d.jsonl, row 1 \(line 2\), column 'answer'"):
        _driver(fresh_model, **{"workload.data_file": str(path), "workload.prompt_pool": None})


def test_a_pool_larger_than_the_data_file_is_refused(fresh_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"workload.data_file": str(path)})        # tiny-cpu's prompt_pool is 16
    assert info.value.field == "workload.prompt_pool"


def test_prompts_too_long_for_the_model_are_refused(fresh_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "' + "1+" * 30 + '1=", "answer": "31"}\n')
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"workload.data_file": str(path), "workload.prompt_pool": None})
    assert info.value.field == "workload.max_response_len" and "64 positions" in str(info.value)


def test_max_prompt_len_sizes_the_engines_for_any_data_and_refuses_a_longer_prompt(fresh_model, tmp_path):
    """``workload.max_prompt_len`` (veRL's ``data.max_prompt_length``): the rollouters' max_model_len and KV budget
    follow it, not the data's longest prompt, so jobs on other data have the same worker shape (kept workers)."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join('{"prompt": "%d+%d=", "answer": "%d"}\n' % (i, i, 2 * i) for i in range(16)))
    task = _driver(fresh_model, **{"workload.max_prompt_len": 40})
    data = _driver(fresh_model, **{"workload.max_prompt_len": 40, "workload.data_file": str(path),
                                   "rl.reward": "last_number"})
    own = _driver(fresh_model, **{"workload.data_file": str(path), "rl.reward": "last_number"})
    assert task.max_model_len == data.max_model_len == 40 + 16 and own.max_model_len < 40 + 16
    for d in (task, data, own):
        d.slots.resource_name = "gpu_slot"           # what a cluster without GPUs answers (read from Ray otherwise)
    assert task.rollout.shape() == data.rollout.shape() != own.rollout.shape()
    longest = max(len(ids) for ids in (own.prompts.prompt_ids(g) for g in range(16)))
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"workload.max_prompt_len": longest - 1, "workload.data_file": str(path),
                                "rl.reward": "last_number"})
    assert info.value.field == "workload.max_prompt_len" and f"prompt of {longest} tokens" in str(info.value)
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"workload.max_prompt_len": 0})
    assert info.value.field == "workload.max_prompt_len"


def test_a_ground_truth_the_built_in_reward_cannot_score_is_named(fresh_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "four"}\n')
    with pytest.raises(cfgmod.ConfigError, match=r"row 1 \(line 2\), column 'answer': ground truth 'four'"):
        _driver(fresh_model, **{"workload.data_file": str(path), "workload.prompt_pool": None,
                                "rl.reward": "last_number"})


def test_a_reward_file_that_cannot_be_loaded_is_named(fresh_model, tmp_path):
    with pytest.raises(cfgmod.ConfigError) as info:
        _driver(fresh_model, **{"rl.reward": str(tmp_path / "missing.py")})
    assert info.value.field == "rl.reward" and "does not exist" in str(info.value)
    bad = tmp_path / "reward.py"
    bad.write_text("def compute_score(x):\n    return 1\n")
    with pytest.raises(cfgmod.ConfigError, match="does not take veRL's keyword arguments"):
        _driver(fresh_model, **{"rl.reward": f"{bad}:compute_score"})


def test_cli_run_reports_a_bad_reward_or_data_file_without_a_traceback(fresh_model, tmp_path, capsys):
    from bidirl.cli import main
    assert main(["run", "tiny-cpu", "--reward", "exat", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "error: rl.reward: 'exat' is not a built-in reward; did you mean 'exact'? — write one of exact" in err
    assert main(["run", "tiny-cpu", "--model-dir", fresh_model, "--data-file", str(tmp_path / "none.parquet"),
                 "--out", str(tmp_path / "b")]) == 2
    assert "error: workload.data_file: " in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_output_folder_holding_another_run_is_refused_before_anything_starts(fresh_model, tmp_path):
    from bidirl.cli import main
    from bidirl.results.tracking import METRICS_FILE, OutputError
    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(OutputError, match="already holds a run's metrics"):
        EngineDriver(cfgmod.load("tiny-cpu"), "bidirl", 1, 0, model_dir=fresh_model, out_dir=str(tmp_path))
    assert main(["run", "tiny-cpu", "--emulate", "--out", str(tmp_path)]) == 2


# --------------------------------------------------------------------------------------------------
# CPUs for the workers of a GPU slot (cluster.cpus_per_gpu)
# --------------------------------------------------------------------------------------------------

def test_a_gpu_bundle_reserves_the_nodes_cpus_per_gpu():
    from bidirl.cluster.slots import BUNDLE_CPU, RESERVED_CPUS, gpu_bundle_cpus
    # auto: ⌊(CPUs − RESERVED_CPUS) / GPUs⌋ on the tightest GPU node; nodes without GPUs hold no bundle
    assert gpu_bundle_cpus("auto", [(16, 1)]) == 16 - RESERVED_CPUS
    assert gpu_bundle_cpus("auto", [(96, 8)]) == (96 - RESERVED_CPUS) // 8 == 11
    assert gpu_bundle_cpus("auto", [(96, 8), (64, 8), (32, 0)]) == (64 - RESERVED_CPUS) // 8 == 7
    assert gpu_bundle_cpus("auto", [(4, 8)]) == BUNDLE_CPU              # fewer CPUs than GPUs: today's small share
    assert gpu_bundle_cpus(6.0, [(96, 8), (64, 8)]) == 6.0
    with pytest.raises(cfgmod.ConfigError) as info:                     # 9 · 8 > 64: never placeable
        gpu_bundle_cpus(9.0, [(96, 8), (64, 8)])
    assert info.value.field == "cluster.cpus_per_gpu" and "at most 8" in info.value.fix


def test_logical_slots_keep_their_small_cpu_share_and_gpu_slots_get_the_nodes_cpus(fresh_model, monkeypatch):
    import ray

    from bidirl.cluster.slots import BUNDLE_CPU
    cpu = _driver(fresh_model, **{"cluster.cpus_per_gpu": 4})
    cpu.slots.resource_name = "gpu_slot"                     # engines on CPU: many actors share a 2-core machine
    assert cpu.slots.bundle_cpus() == BUNDLE_CPU and cpu.slots.at(0)["num_cpus"] == BUNDLE_CPU / 2
    gpu = _driver(fresh_model)
    gpu.slots.resource_name = "GPU"
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0}},
                                               {"Alive": False, "Resources": {"CPU": 2.0, "GPU": 1.0}}])
    opts = gpu.slots.at(0)
    assert gpu.slots.bundle_cpus() == 14 and (opts["num_cpus"], opts["num_gpus"]) == (7, 0.5)  # half a slot: half its CPUs
    assert gpu.worker_shape()["bundle_cpus"] == 14      # kept workers started with other CPUs are not reused


def test_an_embedded_ray_runs_its_workers_at_the_drivers_priority_and_a_cluster_keeps_its_own(fresh_model,
                                                                                               monkeypatch):
    import ray

    class Started(Exception):
        pass

    def init(*args, **kwargs):                          # what the raylet would inherit, at the moment it starts
        raise Started(os.environ.get("RAY_worker_niceness"), kwargs.get("address"))

    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    monkeypatch.setattr(os, "environ", env)             # this process's own environment is left as it was
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started) as info:
        _driver(fresh_model).slots.start(None)
    assert info.value.args == (str(os.nice(0)), None)   # Ray's own default, 15, starves the engines under load
    env.pop("RAY_worker_niceness")
    cluster = _driver(fresh_model)
    with pytest.raises(Started) as info:
        cluster.slots.start("auto")
    assert info.value.args == (None, "auto")
    env["RAY_worker_niceness"] = "19"                   # the user's own setting is kept
    with pytest.raises(Started) as info:
        _driver(fresh_model).slots.start(None)
    assert info.value.args == ("19", None)
