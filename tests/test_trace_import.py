"""Importing foreign traces (issue: see the bubbles of a run you already have): a Ray timeline recorded from a real
bidirl CPU run against bidirl's own event log of the same run, the veRL-shaped fixture through the shipped veRL
map, malformed inputs as named errors, the veRL step log, the CLI and a 100 k-span timeline."""

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from bidirl.calibrate.from_log import UnderdeterminedFit
from bidirl.calibrate.step_log import LogError
from bidirl.cli import main
from bidirl.errors import BidirlError
from bidirl.ingest import MapError, TraceFormatError, WorkerPoolConflict, load_foreign
from bidirl.ingest.bubbles import COLOCATED_NAMES, bubble_breakdown, parts, pool_idle
from bidirl.ingest.maps import load_map, shipped_maps
from bidirl.ingest.whatif import imported_what_if
from bidirl.results import metrics
from bidirl.results.trace import EventLog
from bidirl.viz.aggregate import MAX_BARS, MAX_LANES, thin
from bidirl.viz.imported import imported_gantt

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "data" / "traces"
RAY = TRACES / "tiny-cpu.ray-timeline.json"
VERL = TRACES / "verl-colocated.ray-timeline.json"


# ------------------------------------------------------------------------------------------------
# a real bidirl CPU run: its Ray timeline against its own event log
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded():
    meta = json.loads((TRACES / "tiny-cpu.meta.json").read_text())
    run = load_foreign(RAY, "ray-timeline", "bidirl", origin_s=meta["clock_origin_unix_s"],
                       pool_gpus=meta["pool_gpus"])
    return run, EventLog.load(TRACES / "tiny-cpu.events.parquet"), meta


def test_the_recorded_timeline_imports_with_every_span_placed(recorded):
    run, _, _ = recorded
    assert run.unmapped_count == 0
    assert set(run.workers["pool"]) == {"rollout_pool", "trainer_pool"}
    # tiny-cpu: 2 primary rollouters and a 2-rank trainer gang, 2 auxiliary workers of each kind
    assert sorted(run.workers["label"].tolist()) == ["rollouter"] * 4 + ["trainer"] * 4
    assert run.pool_gpus == {"rollout_pool": 2.0, "trainer_pool": 2.0}
    assert len(run.log.steps) >= 3


def test_idle_per_pool_matches_bidirls_own_event_log_of_the_same_run(recorded):
    """Both records on one clock (the run's origin), over the steps the timeline holds completely.

    The two records time the same calls from two places: Ray's span of a call runs from the worker taking the
    task to storing its result, bidirl's from inside the method (``_Timed._reply``), and bidirl draws a trainer
    gang as one lane (each chunk from its first rank's start to its last rank's end) and a weight sync on the
    sending trainer's lane too (the lane rule). Moving one end of one interval by δ changes a union's length by
    at most δ, so the idle of a pool can differ by at most the summed end differences of the calls that both
    record. The bound used: Σ over the pool's Ray calls in the window of (Ray's span − its ``task:execute`` phase,
    Ray's own bookkeeping around the method), plus bidirl's trainer-lane sync spans (time bidirl counts busy on
    the trainer pool that Ray sees as the rollouters' load_weights), plus one Chrome-trace tick (1 µs) per call
    end. The recorded numbers are in the issue's closing note."""
    run, own, meta = recorded
    raw = pd.DataFrame(json.loads(RAY.read_text()))
    t0, t1 = float(run.log.steps[0].start), float(run.log.steps[-1].end)
    a, b = max(t0, float(own.steps[0].start)), t1
    origin_us = meta["clock_origin_unix_s"] * 1e6
    raw["start"] = (raw["ts"] - origin_us) * 1e-6
    raw["end"] = raw["start"] + raw["dur"] * 1e-6
    inside = raw[(raw["end"] > a) & (raw["start"] < b)]
    execute = inside[inside["cat"] == "task:execute"]
    spans = run.log.spans_df()
    own_spans = own.spans_df()
    for pool in ("rollout_pool", "trainer_pool"):
        mine = metrics.idle(spans, pool, a, b)
        theirs = metrics.idle(own_spans, pool, a, b)
        calls = spans[(spans["pool"] == pool) & (spans["end"] > a) & (spans["start"] < b)]
        overhead = 0.0
        for _, c in calls.iterrows():
            phase = execute[(execute["start"] >= c["start"] - 1e-6) & (execute["end"] <= c["end"] + 1e-6)]
            overhead += (c["end"] - c["start"]) - float((phase["end"] - phase["start"]).max() if len(phase) else 0)
        lane_sync = own_spans[(own_spans["pool"] == pool) & (own_spans["kind"] == "sync") &
                              own_spans["worker"].str.endswith("/trainer")]
        bound = overhead + metrics.union_length(lane_sync["start"], lane_sync["end"], a, b) + 2e-6 * len(calls)
        assert abs(mine - theirs) <= bound, (pool, mine, theirs, bound)
        assert abs(mine - theirs) / (b - a) < 0.02, (pool, mine, theirs)      # and within 2 % of the window


# ------------------------------------------------------------------------------------------------
# the veRL-shaped fixture through the shipped veRL map
# ------------------------------------------------------------------------------------------------

def test_the_verl_fixture_imports_through_the_shipped_map_with_no_unmapped_spans():
    run = load_foreign(VERL, "ray-timeline", "verl-colocated")
    assert run.unmapped_count == 0 and len(run.unmapped) == 0
    assert run.colocated and set(run.workers["pool"]) == {"rollout_pool"}
    assert len(run.log.steps) == 3
    assert set(run.ignored["name"]) >= {"WorkerDict.actor_rollout_init_model", "TaskRunner.run", "submit_task"}


def test_the_bubble_breakdown_sums_to_the_step_time():
    run = load_foreign(VERL, "ray-timeline", "verl-colocated")
    b = bubble_breakdown(run)
    # the parts are sums of elementary intervals that partition each step; float addition of a few dozen
    # terms of ≤ 100 s loses at most ~1e-13 s, so 1e-9 s is a safe bound
    np.testing.assert_allclose(b[parts(b)].sum(axis=1), b["step_s"], rtol=0, atol=1e-9)
    # the fixture's numbers: step 0 generates for 14.0 s (longest GPU) of which 7.2 s on all four GPUs; the
    # driver's 0.6 s reward and 0.4 s + 3 × 0.05 s gaps are idle (nothing recorded runs); 1.2 + 1.0 + 3.0 s train.
    # Colocated: every GPU generating is generation, not "waiting for the batch"
    first = b.iloc[0]
    assert "waiting for the batch" not in b.columns and "trainer waiting" not in b.columns
    assert first[COLOCATED_NAMES["waiting for the batch"]] == pytest.approx(7.2, abs=1e-6)
    assert first["long-tail generation"] == pytest.approx(14.0 - 7.2, abs=1e-6)
    assert first["training"] == pytest.approx(1.2 + 1.0 + 3.0, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# malformed inputs: named errors
# ------------------------------------------------------------------------------------------------

def test_truncated_json_is_a_named_error_with_the_line(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text(VERL.read_text()[:1000])
    with pytest.raises(TraceFormatError, match=r"cut\.json, line \d+, column \d+.*truncated"):
        load_foreign(bad, "ray-timeline", "verl-colocated")


def test_an_event_without_ts_names_its_index(tmp_path):
    events = json.loads(VERL.read_text())
    del events[5]["ts"]
    bad = tmp_path / "nots.json"
    bad.write_text(json.dumps(events))
    with pytest.raises(TraceFormatError, match=r"event 5: .* has no 'ts'"):
        load_foreign(bad, "ray-timeline", "verl-colocated")


def test_a_regex_that_does_not_compile_names_the_rule(tmp_path):
    doc = yaml.safe_load(shipped_maps()["verl-colocated"].read_text())
    doc["spans"][2]["name"] = "compute_(log_prob"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(MapError, match=r"broken\.yaml, spans\[2\]: 'name' regular expression .* does not compile"):
        load_map(path)


def test_a_worker_mapped_to_two_pools_is_a_named_error():
    doc = yaml.safe_load(shipped_maps()["verl-colocated"].read_text())
    for rule in doc["spans"]:
        if rule.get("name") == "update_actor$":
            rule["pool"] = "trainer_pool"
    with pytest.raises(WorkerPoolConflict, match=r"worker .*two pools: rollout_pool .* trainer_pool"):
        load_foreign(VERL, "ray-timeline", doc)


def test_every_import_error_is_a_bidirl_error_and_the_cli_reports_it(tmp_path, capsys):
    assert issubclass(TraceFormatError, BidirlError) and issubclass(MapError, BidirlError)
    bad = tmp_path / "cut.json"
    bad.write_text("[{\"ph\": \"X\", ")
    assert main(["trace", "import", str(bad), "--format", "ray-timeline", "--map", "verl-colocated",
                 "--out", str(tmp_path / "out")]) == 2
    assert "cut.json, line 1" in capsys.readouterr().err


def test_unmapped_spans_are_reported_by_name_with_counts(tmp_path):
    events = json.loads(VERL.read_text())
    events += [dict(events[3], cat="task::WorkerDict.actor_rollout_mystery", name="mystery") for _ in range(3)]
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(events))
    run = load_foreign(path, "ray-timeline", "verl-colocated")
    assert run.unmapped.to_dict("records") == [{"name": "WorkerDict.actor_rollout_mystery", "count": 3}]
    assert any("3 events matched no rule" in n for n in run.notes)


def test_every_shipped_map_loads():
    assert {"verl-colocated", "verl-fully-async", "openrlhf", "bidirl"} <= set(shipped_maps())
    for name in shipped_maps():
        tmap = load_map(name)
        assert tmap.spans and (tmap.sources or name == "bidirl")


# ------------------------------------------------------------------------------------------------
# the other formats and the command line
# ------------------------------------------------------------------------------------------------

def test_a_verl_step_log_is_a_coarse_timeline_whose_bubbles_sum_to_its_steps():
    log = ROOT / "data" / "logs" / "tiny-cpu-s0" / "metrics.jsonl"
    run = load_foreign(log, "verl-log")
    assert run.coarse and len(run.log.steps) == len(pd.read_json(log, lines=True))
    b = bubble_breakdown(run)
    # a step log's parts are its logged stages (each a float parsed from 3 decimals, < 1e4 s) and the remainder
    # step_s − their sum; adding back ~15 such values loses at most ~15 · 2⁻⁵² · 1e4 ≈ 3e-11 s, so 1e-9 s is safe.
    # That a remainder cannot hide stages counted twice is guarded by
    # test_a_step_log_whose_stages_exceed_the_step_names_the_row (logged stages past the step are refused)
    np.testing.assert_allclose(b[parts(b)].sum(axis=1), b["step_s"], rtol=0, atol=1e-9)
    idle = pool_idle(run).set_index("pool")["idle_fraction"]
    assert 0 <= idle["rollout_pool"] <= 1 and 0 <= idle["trainer_pool"] <= 1
    assert "coarse" in imported_gantt(run).layout.annotations[0].text


def test_bidirls_own_log_imports(tmp_path):
    run = load_foreign(TRACES / "tiny-cpu.events.parquet", "bidirl")
    assert len(run.log.steps) == 4 and run.format == "bidirl"


def test_cli_trace_import_writes_the_views(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["trace", "import", str(VERL), "--format", "ray-timeline", "--map", "verl-colocated",
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unmapped"] == {} and doc["steps"] == 3
    for name in ("events.parquet", "trace.json", "idle.csv", "bubbles.csv", "unmapped.csv", "gantt.html",
                 "summary.json"):
        assert (out / name).is_file(), name


# ------------------------------------------------------------------------------------------------
# large traces
# ------------------------------------------------------------------------------------------------

def _synthetic(path: Path, n: int, workers: int = 256) -> None:
    """A veRL-colocated-shaped timeline of ``n`` spans on ``workers`` GPUs: rounds of generate / log-prob / update."""
    rng = np.random.default_rng(0)
    per_round = 3 * workers
    events, t = [], 0.0
    for r in range(n // per_round):
        gen = rng.lognormal(0.0, 0.5, workers)
        for w in range(workers):
            events.append({"cat": "task::WorkerDict.actor_rollout_generate_sequences", "name": "g", "ph": "X",
                           "pid": 1, "tid": w, "ts": t * 1e6, "dur": gen[w] * 1e6})
        t += gen.max()
        for name, d in (("actor_rollout_compute_log_prob", 0.3), ("actor_rollout_update_actor", 0.6)):
            for w in range(workers):
                events.append({"cat": f"task::WorkerDict.{name}", "name": "x", "ph": "X", "pid": 1, "tid": w,
                               "ts": t * 1e6, "dur": d * 1e6})
            t += d
    path.write_text(json.dumps(events))


def test_a_100k_span_timeline_imports_in_seconds_and_the_gantt_thins_it(tmp_path):
    path = tmp_path / "big.json"
    _synthetic(path, 100_000)
    t = time.perf_counter()
    run = load_foreign(path, "ray-timeline", "verl-colocated")
    seconds = time.perf_counter() - t
    assert len(run.log.spans) >= 99_000
    # "in seconds": 1.5 s measured on the 2-core build machine under a load average of 18; 12 s leaves 8× room
    assert seconds < 12, seconds
    drawn = thin(run.log.spans_df())
    assert len(drawn.spans) <= MAX_BARS and len(drawn.lanes) <= MAX_LANES
    assert "aggregated for drawing" in drawn.note


# ------------------------------------------------------------------------------------------------
# the other shipped maps, more malformed inputs, the what-if
# ------------------------------------------------------------------------------------------------

def _ray_events(calls) -> list:
    """Ray-shaped complete events: ``calls`` is ``(Class.method, worker, start s, duration s)``."""
    return [{"cat": f"task::{name}", "name": name.rsplit(".", 1)[-1], "ph": "X", "pid": "10.0.0.1",
             "tid": worker, "ts": 1e15 + start * 1e6, "dur": dur * 1e6, "args": {}}
            for name, worker, start, dur in calls]


def test_the_fully_async_map_places_rollout_server_trainer_and_sync_on_two_pools(tmp_path):
    calls = [("vLLMHttpServerForPartial.generate_for_partial", "server", 0.0, 3.0),
             ("vLLMHttpServerForPartial.generate_for_partial", "server", 0.5, 4.0),
             ("WorkerDict.actor_compute_log_prob", "t0", 4.0, 0.5), ("WorkerDict.actor_update_actor", "t0", 4.6, 1.0),
             ("WorkerDict.actor_sync_rollout_weights", "t0", 5.7, 0.2),
             ("WorkerDict.rollout_sync_rollout_weights", "r0", 5.7, 0.2), ("FullyAsyncTrainer.fit", "ctl", 4.0, 2.0),
             ("MessageQueue.get_sample", "mq", 3.9, 0.1)]
    path = tmp_path / "async.json"
    path.write_text(json.dumps(_ray_events(calls)))
    run = load_foreign(path, "ray-timeline", "verl-fully-async")
    assert run.unmapped_count == 0
    pools = dict(zip(run.workers["source"].str.rsplit("/", n=1).str[-1], run.workers["pool"]))
    assert pools == {"server": "rollout_pool", "r0": "rollout_pool", "t0": "trainer_pool"}
    # the server holds the replica's GPU; the rollout WorkerDict beside it shares that GPU (counted once)
    assert run.pool_gpus == {"rollout_pool": 1.0, "trainer_pool": 1.0}
    assert len(run.log.steps) == 1


def test_the_openrlhf_map_places_engines_and_models(tmp_path):
    calls = [("RolloutRayActor.generate", "e0", 0.0, 2.0), ("PolicyModelActor.forward", "a0", 2.1, 0.3),
             ("ReferenceModelActor.forward", "ref", 2.1, 0.3), ("PolicyModelActor.fit", "a0", 2.5, 1.0),
             ("PolicyModelActor.broadcast_to_vllm", "a0", 3.5, 0.2), ("RolloutRayActor.update_weight", "e0", 3.5, 0.2)]
    path = tmp_path / "openrlhf.json"
    path.write_text(json.dumps(_ray_events(calls)))
    run = load_foreign(path, "ray-timeline", "openrlhf")
    assert run.unmapped_count == 0
    kinds = run.log.spans_df().groupby("pool")["kind"].agg(lambda k: sorted(set(k))).to_dict()
    assert kinds == {"rollout_pool": ["generate", "sync"], "trainer_pool": ["chunk", "sync"]}
    stages = {s.detail["name"]: s.detail.get("stage") for s in run.log.spans if s.kind == "chunk"}
    assert stages == {"PolicyModelActor.forward": "old_logprob", "ReferenceModelActor.forward": "ref_logprob",
                      "PolicyModelActor.fit": "actor_update"}


@pytest.mark.parametrize("change, message", [
    (lambda d: d["spans"][0].update(pool="gpu_pool"), r"spans\[0\]: 'pool' must be one of rollout_pool"),
    (lambda d: d["spans"][0].update(kind="decode"), r"spans\[0\]: 'kind' must be one of"),
    (lambda d: next(r for r in d["spans"] if r.get("kind") == "chunk").pop("stage"),
     r"spans\[\d+\]: 'stage' must be one of"),
    (lambda d: d["spans"][0].update(colour="red"), r"spans\[0\]: unknown key\(s\) \['colour'\]"),
    (lambda d: d.update(steps={"end": {"kind": "nap"}}), r"steps.end: 'kind' must be one of"),
])
def test_a_malformed_map_names_the_rule_and_field(tmp_path, change, message):
    doc = yaml.safe_load(shipped_maps()["verl-colocated"].read_text())
    change(doc)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(MapError, match=message):
        load_map(path)


def test_malformed_events_name_their_index(tmp_path):
    cases = {"negative duration": ({"ph": "X", "ts": 1, "dur": -5, "name": "x"}, r"event 0: negative duration"),
             "text ts": ({"ph": "X", "ts": "soon", "dur": 5, "name": "x"}, r"event 0: 'ts' must be a number"),
             "no phase": ({"ts": 1, "dur": 5, "name": "x"}, r"event 0: the event has no 'ph'"),
             "open B": ({"ph": "B", "ts": 1, "name": "x", "pid": 1, "tid": 1}, r"event 0: a 'B' event .* never closed")}
    for name, (event, message) in cases.items():
        path = tmp_path / "e.json"
        path.write_text(json.dumps([event]))
        with pytest.raises(TraceFormatError, match=message):
            load_foreign(path, "ray-timeline", "verl-colocated")


def test_a_step_log_whose_stages_exceed_the_step_names_the_row(tmp_path):
    path = tmp_path / "log.jsonl"
    rows = [{"step": 1, "timing_s/step": 2.0, "timing_s/gen": 1.0, "timing_s/update_actor": 0.5},
            {"step": 2, "timing_s/step": 1.0, "timing_s/gen": 0.8, "timing_s/update_actor": 0.5}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(LogError, match=r"log\.jsonl, row 1: the logged stages add up to 1\.300 s, more than "
                                       r"timing_s/step \(1\.000 s\)"):
        load_foreign(path, "verl-log")


def test_begin_end_pairs_and_bidirls_chrome_trace_import(tmp_path):
    events = [{"ph": "B", "ts": 0, "name": "WorkerDict.actor_rollout_generate_sequences", "pid": 1, "tid": 1},
              {"ph": "E", "ts": 2e6, "pid": 1, "tid": 1},
              {"ph": "B", "ts": 2e6, "name": "WorkerDict.actor_rollout_update_actor", "pid": 1, "tid": 1},
              {"ph": "E", "ts": 3e6, "pid": 1, "tid": 1}]
    path = tmp_path / "be.json"
    path.write_text(json.dumps({"traceEvents": events}))
    run = load_foreign(path, "ray-timeline", "verl-colocated")
    assert [(s.kind, s.start, s.end) for s in run.log.spans] == [("generate", 0.0, 2.0), ("chunk", 2.0, 3.0)]
    own = EventLog.load(TRACES / "tiny-cpu.events.parquet")
    own.save(tmp_path / "trace.json")
    back = load_foreign(tmp_path / "trace.json", "bidirl")
    assert len(back.log.spans) == len(own.spans) and len(back.log.steps) == len(own.steps)


def test_the_what_if_of_an_imported_step_log_simulates_beside_the_measured(tmp_path, capsys):
    log = ROOT / "data" / "logs" / "tiny-cpu-s0"
    out = tmp_path / "out"
    assert main(["trace", "import", str(log / "metrics.jsonl"), "--format", "verl-log", "--out", str(out),
                 "--config", str(log / "config.yaml"), "--what-if", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w = doc["what_if"]
    assert w["what_if"]["provenance"] == "simulated" and len(w["what_if"]["throughput"]) == 3
    assert w["measured"]["throughput"] > 0 and w["measured"]["steps"] == doc["steps"]
    assert (out / "what_if.json").is_file()


def _colocated_config(tmp_path, **rl) -> Path:
    """The tiny-cpu job at staleness 0 (a colocated trainer is synchronous) with ``rl`` settings added."""
    doc = yaml.safe_load((ROOT / "data" / "logs" / "tiny-cpu-s0" / "config.yaml").read_text())
    doc["rl"].update(rl)
    path = tmp_path / ("job-" + "-".join(f"{k}={v}" for k, v in sorted(rl.items())) + ".yaml")
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_what_if_of_a_colocated_run_says_what_it_assumes_of_the_disaggregated_trainer(tmp_path, capsys):
    """The assumptions are the job-settings keys as simulated (JSON and text), and they are what the simulation ran
    under: the same colocated timeline with offload on gives the disaggregated trainer other times than with it
    off (its time is predicted under the settings, not the colocated trainer's copied)."""
    trace = TRACES / "verl-colocated-async.ray-timeline.json"
    run = load_foreign(trace, "ray-timeline", "verl-colocated")
    with pytest.warns(UnderdeterminedFit):
        plain = imported_what_if(run, _colocated_config(tmp_path), steps=4, seed=0)
        offload = imported_what_if(run, _colocated_config(tmp_path, param_offload=True, optimizer_offload=True),
                                   steps=4, seed=0)
    said = {a["key"]: a for a in offload["assumptions"]}
    assert set(said) == {"rl.param_offload", "rl.optimizer_offload", "rl.activation_checkpointing",
                         "rl.micro_batch_per_device", "rl.sequence_parallel", "cluster.rollout_tensor_parallel",
                         "basis"}
    assert said["rl.param_offload"]["value"] is True and "host_bandwidth" in said["rl.param_offload"]["as_simulated"]
    assert {a["key"]: a["value"] for a in plain["assumptions"]}["rl.param_offload"] is False
    assert said["rl.micro_batch_per_device"]["value"] == 8
    assert "not copied from the colocated run" in said["basis"]["as_simulated"]
    assert "rl.param_offload / rl.optimizer_offload: false" in said["basis"]["as_simulated"]
    key = next(k for k in plain["what_if"]["throughput"] if "planner's choice" in k)
    assert offload["what_if"]["throughput"][key] != plain["what_if"]["throughput"][key]
    out = tmp_path / "out"
    with pytest.warns(UnderdeterminedFit):
        assert main(["trace", "import", str(trace), "--format", "ray-timeline", "--map", "verl-colocated",
                     "--out", str(out), "--config", str(_colocated_config(tmp_path, max_tokens_per_micro_batch=64)),
                     "--what-if"]) == 0
    text = capsys.readouterr().out
    assert "assuming, for the simulated trainer:" in text
    assert "rl.max_tokens_per_micro_batch = 64: token-budget micro-batches: up to 64 tokens per device" in text
    assert json.loads((out / "what_if.json").read_text())["assumptions"][-1]["key"] == "basis"
