"""The run cache of ``bidirl reproduce`` (``bidirl.experiments.cache``): keys, storage, and that a cached run
is answered without simulating it again."""

from __future__ import annotations

import pytest
from tqdm.auto import tqdm

from bidirl.experiments import run as runmod
from bidirl.experiments.cache import RunCache, cache_root, code_version, run_key
from bidirl.job import config as cfgmod

CONFIG = {"model": "qwen3-vl-4b", "gpus": 16}


def test_key_depends_on_every_input_and_the_code_version():
    base = run_key(CONFIG, "bidirl", 10, 0, "v1")
    assert base == run_key(dict(reversed(list(CONFIG.items()))), "bidirl", 10, 0, "v1")     # key order is irrelevant
    others = [run_key({**CONFIG, "gpus": 32}, "bidirl", 10, 0, "v1"), run_key(CONFIG, "no-borrow", 10, 0, "v1"),
              run_key(CONFIG, "bidirl", 11, 0, "v1"), run_key(CONFIG, "bidirl", 10, 1, "v1"),
              run_key(CONFIG, "bidirl", 10, 0, "v2")]
    assert len({base, *others}) == 6


def test_code_version_is_stable_and_root_follows_the_environment(monkeypatch, tmp_path):
    assert code_version() == code_version() and len(code_version()) == 16
    monkeypatch.setenv("BIDIRL_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "given") == tmp_path / "given"


def test_entries_round_trip_and_a_broken_entry_is_a_miss(tmp_path):
    cache = RunCache(tmp_path, "v1")
    key = cache.key(CONFIG, "bidirl", 10, 0)
    assert cache.get(key) is None
    cache.put(key, {"status": "ok", "values": {"x": 1.0}})
    assert cache.get(key) == {"status": "ok", "values": {"x": 1.0}}
    assert RunCache(tmp_path, "v2").get(RunCache(tmp_path, "v2").key(CONFIG, "bidirl", 10, 0)) is None
    cache._path(key).write_bytes(b"not a pickle")
    assert cache.get(key) is None
    assert not list(tmp_path.rglob("*.tmp"))


def _task(policy: str) -> runmod.Task:
    cfg = cfgmod.load("a6000-default").with_overrides({"workload.prompts_per_step": 8})
    return runmod.Task("test", "ablation", 0, "p", 1, policy, cfg.to_dict(), 3, 0, "total_run_throughput")


def test_a_cached_run_is_not_simulated_again(tmp_path):
    cache = RunCache(tmp_path, code_version())
    tasks = [_task("no-borrow"), _task("no-borrow"), _task("bidirl")]       # two cells share one run
    calls = []

    def counting(config, policy, **kw):
        from bidirl.sim import simulate
        calls.append(policy)
        return simulate(config, policy, **kw)

    with tqdm(disable=True) as bar:
        first = runmod._simulate_all(tasks, simulate_fn=counting, max_workers=0, executor=None, cache=cache, bar=bar)
    assert sorted(calls) == ["bidirl", "no-borrow"]                            # each distinct run once

    def exploding(*_a, **_k):
        raise AssertionError("a cached run was simulated again")
    with tqdm(total=len(tasks), disable=True) as bar:
        again = runmod._simulate_all(tasks, simulate_fn=exploding, max_workers=0, executor=None, cache=cache,
                                     bar=bar)
        # the bar's rate now counts look-ups: it says the runs came from the cache
        assert bar.postfix == f"{len(tasks)} of {len(tasks)} from the run cache, not simulated now"
    assert [r["throughput"] for r in again] == [r["throughput"] for r in first]
    assert all(r["status"] == "ok" and r["throughput"] > 0 for r in first)
    assert first[0]["throughput"] == first[1]["throughput"]


@pytest.mark.parametrize("status", ["failed"])
def test_failed_runs_are_not_cached(tmp_path, status):
    cache = RunCache(tmp_path, "v1")

    def failing(*_a, **_k):
        raise MemoryError("out of memory (test)")
    with tqdm(disable=True) as bar:
        rows = runmod._simulate_all([_task("bidirl")], simulate_fn=failing, max_workers=0, executor=None, cache=cache,
                                    bar=bar)
    assert rows[0]["status"] == status
    assert not list(tmp_path.rglob("*.pkl"))
