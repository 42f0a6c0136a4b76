"""The paper's evaluation as data: specs, grid runs, speedups, claims and the report (paper §7).

The simulator, the planner, calibration and the switch-cost derivation are replaced by small fakes here,
so these tests check the experiment plumbing and the verdict logic; the real stack runs in
``bidirl reproduce``.
"""

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from bidirl.experiments import cli_reproduce, reproduce
from bidirl.experiments import report as rep
from bidirl.experiments import run as runmod
from bidirl.experiments import specs as S
from bidirl.experiments.claims import RANGE_RULE, allowed_deviation, judge, load_claims
from bidirl.job import config as cfgmod
from bidirl.sim import baselines as B

# --------------------------------------------------------------------------------------------------
# fakes (module level so worker processes can unpickle them)
# --------------------------------------------------------------------------------------------------

FAKE_TP = {"bidirl": 150.0, "verl-colocated": 145.0, "verl-async": 100.0, "areal": 110.0, "roll": 90.0,
           "no-borrow": 100.0, "rot-only": 130.0, "tor-only": 120.0, "opportunistic": 125.0}


class FakeResult:
    def __init__(self, policy, throughput, steps):
        self.policy, self.tp, self.steps = policy, throughput, steps
        self.log = SimpleNamespace(steps_df=self._steps)

    def _steps(self):
        n = self.steps
        return pd.DataFrame({"start": np.arange(n, dtype=float), "end": np.arange(1, n + 1, dtype=float),
                             "tokens": np.full(n, self.tp * 0.9)})

    def summary(self):
        return {"policy": self.policy, "throughput": self.tp, "step_times": [1.0] * self.steps,
                "idle": {"rollout_pool": 0.1, "trainer_pool": 0.2}, "utilization": 0.8,
                "borrows": {"rollout_on_trainer_pool": 1, "trainer_on_rollout_pool": 2, "rejected": 0},
                "samples": {"generated": 10, "consumed": 10, "lost": 0, "duplicated": 0}}


def fake_simulate(config, policy, *, steps=None, seed=None, progress=False):
    assert isinstance(config, cfgmod.JobConfig)
    tp = FAKE_TP[policy] * (1 + 0.01 * config.rl.staleness)
    return FakeResult(policy, tp, steps)


def failing_simulate(config, policy, *, steps=None, seed=None, progress=False):
    if policy == "verl-async":
        raise MemoryError("CUDA out of memory (fake)")
    return fake_simulate(config, policy, steps=steps, seed=seed)


@pytest.fixture
def dp_one_per_gpu(monkeypatch):
    monkeypatch.setattr(B, "trainer_data_parallel",
                        lambda cfg: cfg.cluster.partition.trainer if cfg.cluster.partition else cfg.cluster.gpus // 2)


def fake_plan(config):
    """A planner stand-in whose predicted rate peaks at a quarter of the budget for rollout."""
    g = config.cluster.gpus
    r = np.arange(1, g)
    rate = 1.0 / (1.0 + np.abs(r - g / 4) / (g / 8))
    sweep = pd.DataFrame({"rollout_gpus": r, "trainer_gpus": g - r, "compatible": r % 2 == 0,
                          "pipeline_rate": rate})
    best = int(r[np.argmax(np.where(r % 2 == 0, rate, -1))])
    env = SimpleNamespace(rollout_gpus=best, trainer_gpus=g - best, pipeline_rate=float(rate.max()))
    return SimpleNamespace(sweep=sweep, envelope=env)


def fake_derive(hw, model):
    k = model.params_total / 2e9
    return {"trainer_on_rollout_pool": cfgmod.SwitchCosts(3.0 * k, 3.0 * k, 0.6 * k),
            "rollout_on_trainer_pool": cfgmod.SwitchCosts(5.0 * k, 4.0 * k, 0.0)}


# --------------------------------------------------------------------------------------------------
# specs against the paper's stated settings (§7.1–§7.4)
# --------------------------------------------------------------------------------------------------

def cfgs(panel_id):
    spec = S.get(panel_id)
    return {p.label: spec.config(p) for p in spec.points}


def test_every_panel_has_a_figure_title_claims_and_documented_assumptions():
    assert len(S.SPECS) == 20
    for spec in S.SPECS.values():
        assert spec.title and spec.figure.startswith("Fig. eval-") and spec.paper and spec.assumptions
        assert "Paper:" in spec.doc and "Assumed:" in spec.doc
        assert spec.claims


def test_default_workload_and_group_size():
    for spec in S.SPECS.values():
        for p in spec.points:
            cfg = spec.config(p)
            assert cfg.workload.group_size == 8
            assert cfg.hardware == spec.hardware
    a = cfgs("e2e-a6000-response")["2K"]
    assert (a.model, a.workload.dataset, a.workload.prompts_per_step, a.rl.staleness) == ("qwen3-vl-4b", "geo3k", 64, 1)
    assert (a.cluster.gpus, a.cluster.placement, a.cluster.partition) == (16, "node-aligned", cfgmod.Partition(8, 8))
    h = cfgs("e2e-h100-response")["2K"]
    assert (h.hardware, h.workload.prompts_per_step) == ("h100", 128)


def test_response_and_staleness_sweeps():
    for hw in ("a6000", "h100"):
        r = S.get(f"e2e-{hw}-response")
        assert r.values == (1024, 2048, 4096)
        st = S.get(f"e2e-{hw}-staleness")
        assert st.values[0] == 0 and max(st.values) == 4 and any(0 < s < 1 for s in st.values)
        assert [c.rl.staleness for c in cfgs(st.id).values()] == list(st.values)
        assert {"verl-colocated", "verl-async", "areal", "roll", "bidirl"} == set(st.policies)


def test_resource_and_scaling_budgets():
    for hw in ("a6000", "h100"):
        res = cfgs(f"e2e-{hw}-resource")
        assert sorted(c.cluster.gpus for c in res.values()) == [8, 16, 32]
        assert {c.workload.prompts_per_step for c in res.values()} == {128}
        sc = list(cfgs(f"e2e-{hw}-scaling").values())
        ratios = {c.workload.prompts_per_step / c.cluster.gpus for c in sc}
        assert len(ratios) == 1 and [c.cluster.gpus for c in sc] == [8, 16, 32]


def test_model_dataset_panels():
    for hw in ("a6000", "h100"):
        m = cfgs(f"e2e-{hw}-model")
        assert {(c.model, c.workload.dataset) for c in m.values()} == {
            ("qwen3-vl-2b", "geo3k"), ("qwen3-vl-4b", "geo3k"), ("qwen3-8b", "gsm8k")}
        assert m["8B/GSM8K"].workload.prompts_per_step == 256
        assert m["8B/GSM8K"].cluster.partition == cfgmod.Partition(8, 8)


def test_h100_partition_panels():
    for model in ("2b", "4b"):
        c = cfgs(f"e2e-h100-partition-{model}")
        assert set(c) == {"8-24", "16-16", "24-8"}
        for cfg in c.values():
            assert (cfg.model, cfg.cluster.gpus, cfg.workload.prompts_per_step) == (f"qwen3-vl-{model}", 32, 120)


def test_ablation_settings():
    for pid in ("abl-response", "abl-staleness"):
        for cfg in cfgs(pid).values():
            assert cfg.cluster.partition == cfgmod.Partition(4, 12) and cfg.workload.prompts_per_step == 60
            assert cfg.cluster.gpus == 16
    assert set(S.get("abl-response").policies) == {"bidirl", "no-borrow", "rot-only", "tor-only", "opportunistic"}
    m = cfgs("abl-model")
    assert m["8B/GSM8K"].cluster.partition == cfgmod.Partition(8, 8) and m["8B/GSM8K"].workload.prompts_per_step == 256
    assert m["2B/Geo3K"].cluster.partition == cfgmod.Partition(4, 12) and m["2B/Geo3K"].workload.prompts_per_step == 60
    assert {c.workload.prompts_per_step for c in cfgs("abl-resource").values()} == {120}
    assert sorted(c.cluster.gpus for c in cfgs("abl-resource").values()) == [16, 24, 32]
    for pid in ("abl-response", "abl-staleness", "abl-resource", "abl-model"):
        assert S.get(pid).metric == "total_run_throughput"


def test_static_planning_sweeps():
    two, four = cfgs("static-2b"), cfgs("static-4b")
    assert {c.model for c in two.values()} == {"qwen3-vl-2b"} and {c.cluster.gpus for c in two.values()} == {16}
    assert {c.model for c in four.values()} == {"qwen3-vl-4b"} and {c.cluster.gpus for c in four.values()} == {32}
    assert "8-8" in two and "8-24" in four          # the paper's chosen partitions are displayed


def test_every_point_plans_with_the_real_planner():
    """Each configured partition is hot-switch compatible and fits in memory (else the run would fail)."""
    from bidirl.job.planner import plan
    for spec in S.SPECS.values():
        if spec.kind == "stage-model":
            continue
        for p in spec.points:
            cfg = spec.config(p)
            env = plan(cfg).envelope
            assert (env.rollout_gpus, env.trainer_gpus) == (cfg.cluster.partition.rollout,
                                                             cfg.cluster.partition.trainer), (spec.id, p.label)


def test_steps_drop_head_and_tail():
    st = S.get("e2e-a6000-staleness")
    by = {c.rl.staleness: c.workload.steps for c in cfgs(st.id).values()}
    assert by == {0: 7, 0.5: 8, 1: 8, 2: 10, 4: 14}        # 6 measured + max(1, ⌈s⌉) + ⌈s⌉


def test_quick_variant_is_smaller():
    for spec in S.SPECS.values():
        q = spec.quick()
        assert q.id == spec.id and 1 <= len(q.points) <= len(spec.points)
        assert len(q.points) < len(spec.points) or spec.kind == "stage-model"
        assert q.measured_steps <= spec.measured_steps and q.measured_steps == S.QUICK_MEASURED_STEPS
    assert S.get("e2e-a6000-staleness", quick=True).labels == ("s=0", "s=0.5", "s=1")


def test_select_and_unknown_panels():
    assert [s.id for s in S.select(["e2e-h100-partition"])] == ["e2e-h100-partition-4b", "e2e-h100-partition-2b"]
    with pytest.raises(ValueError, match="did you mean e2e-a6000-response"):
        S.select(["e2e-a6000-respnse"])


def test_spec_validation():
    spec = S.get("abl-response")
    with pytest.raises(ValueError, match="kind"):
        S.PanelSpec(**{**spec.__dict__, "kind": "bogus"})
    with pytest.raises(ValueError, match="quick_labels"):
        S.PanelSpec(**{**spec.__dict__, "quick_labels": ("9K",)})


# --------------------------------------------------------------------------------------------------
# claims file
# --------------------------------------------------------------------------------------------------

def test_claims_reference_known_panels_and_back():
    claims = load_claims()
    ids = {c.id for c in claims}
    assert len(ids) == len(claims) >= 45
    for c in claims:
        for panel in c.panels:
            assert panel in S.SPECS, (c.id, panel)
            assert c.id in S.SPECS[panel].claims or c.metric != "speedup", (c.id, panel)
        for label in c.check.get("points", []) + c.check.get("exclude_points", []):
            assert any(label in S.SPECS[p].labels for p in c.panels), (c.id, label)
    for spec in S.SPECS.values():
        assert set(spec.claims) <= ids, spec.id


def test_claims_carry_the_paper_numbers():
    by = {c.id: c for c in load_claims()}
    assert by["e2e-a6000-response"].value == [1.27, 1.55]
    assert by["e2e-overall"].value == [1.05, 1.94]
    assert by["abl-over-no-borrow"].value == [1.12, 1.71]
    assert by["static-choice-4b"].value == "8-24"
    assert by["stage-rollout-p90"].value == 5.77
    assert by["table-hot-switch-2b"].value["trainer_on_rollout_pool"]["c_grad"] == [0.66]
    assert by["table-hot-switch-4b"].value["trainer_on_rollout_pool"]["c_grad"] == [1.21]
    assert {c.kind for c in by.values()} == {"speedup_range", "ratio", "choice", "table", "error", "gap"}


def test_bad_claims_file_names_the_problem(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text("claims:\n- {id: x, section: s, kind: ratio, value: 1, compares: c, check: {metric: speedup}, "
                    "tolerance: {abs_pp: 1}, role: held-out}\n")
    with pytest.raises(ValueError, match="tolerance.rel"):
        load_claims(path)
    path.write_text("claims:\n- {id: x, section: s, kind: ratio, value: 1, compares: c, check: {metric: speedup}, "
                    "tolerance: {rel: 0.1}, role: tuned}\n")
    with pytest.raises(ValueError, match="role 'tuned'"):
        load_claims(path)


# --------------------------------------------------------------------------------------------------
# verdicts
# --------------------------------------------------------------------------------------------------

GAIN = {"gain_rel": 0.25, "abs": 0.02}


def test_judge_each_kind():
    assert judge("speedup_range", [1.27, 1.55], [1.30, 1.50], GAIN) is True
    assert judge("speedup_range", [1.27, 1.55], [1.00, 1.50], GAIN) is False
    assert judge("speedup_range", [1.27, 1.55], [1.30, 1.80], GAIN) is False
    # near 1 the tolerance follows the gain: a claimed 1.02x-1.06x is not reproduced by 0.92x-1.00x
    assert judge("speedup_range", [1.02, 1.06], [0.92, 1.00], GAIN) is False
    assert judge("speedup_range", [1.02, 1.06], [1.00, 1.05], GAIN) is True
    # containment (RANGE_RULE): a reproduced range inside the paper's matches without reaching its ends (the
    # issue's case: 1.083 ≥ 1.0 − 0.02 and 1.177 ≤ 1.24 + 0.25·0.24 + 0.02 = 1.32), one point just past a widened
    # end does not (1.27 − (0.25·0.27 + 0.02) = 1.1825 > 1.18)
    assert judge("speedup_range", [1.0, 1.24], [1.083, 1.177], GAIN) is True
    assert judge("speedup_range", [1.27, 1.55], [1.30, 1.32], GAIN) is True
    assert judge("speedup_range", [1.27, 1.55], [1.18, 1.32], GAIN) is False
    assert judge("speedup_range", [1.27, 1.55], [1.19, 1.32], GAIN) is True


def test_the_range_rule_is_one_sentence_in_claims_yaml_and_the_report(tmp_path):
    from bidirl.experiments.claims import RANGE_RULE, default_path
    from bidirl.experiments.report import to_markdown
    header = " ".join(line.lstrip("# ").strip() for line in default_path().read_text().split("claims:")[0].splitlines())
    assert RANGE_RULE in header
    assert f"Range rule: {RANGE_RULE}" in to_markdown([])
    assert judge("ratio", 1.0, 1.04, {"abs": 0.05}) is True
    assert judge("ratio", 1.0, [0.95, 1.2], {"abs": 0.05}) is False
    assert judge("ratio", 1.94, 1.75, GAIN) is True and judge("ratio", 1.94, 1.65, GAIN) is False
    assert judge("choice", "8-8", "8-8", {"exact": True}) is True
    assert judge("choice", "8-8", "4-12", {"exact": True}) is False
    assert judge("choice", ["a", "b"], ["b", "a"], {"exact": True}) is True
    assert judge("error", 3.12, 4.5, {"abs_pp": 2}) is True
    assert judge("error", 3.12, 5.5, {"abs_pp": 2}) is False
    table = {"x": {"c_in": [1.0, 2.0]}}
    assert judge("table", table, {"x": {"c_in": [1.9, 1.1]}}, {"factor": 2}) is True
    assert judge("table", table, {"x": {"c_in": [2.1, 2.0]}}, {"factor": 2}) is False
    assert judge("table", table, {"x": {}}, {"factor": 2}) is False
    assert judge("gap", 0.017, 0.0, {"not_checkable": True}) is None
    assert judge("ratio", 1.0, None, {"abs": 0.05}) is None


def test_allowed_deviation():
    assert allowed_deviation(1.55, GAIN) == pytest.approx(0.1575)
    assert allowed_deviation(1.0, {"abs": 0.05}) == pytest.approx(0.05)
    assert allowed_deviation(2.0, {"rel": 0.1}) == pytest.approx(0.2)


def speedup_table(panel, values, labels):
    return pd.DataFrame({"panel": panel, "order": range(len(values)), "point": labels, "value": labels,
                         "bidirl": 1.0, "best": "areal", "best_throughput": 1.0, "speedup": values,
                         "valid_comparators": 3})


@pytest.mark.parametrize("values,expected", [([1.30, 1.45, 1.50], True), ([1.00, 1.45, 1.50], False),
                                             ([1.30, 1.45, 1.90], False)])
def test_report_match_is_computed_from_values(values, expected):
    claim = next(c for c in load_claims() if c.id == "e2e-a6000-response")
    ev = rep.Evidence(results=pd.DataFrame({"panel": ["e2e-a6000-response"]}),
                      speedups=speedup_table("e2e-a6000-response", values, ["1K", "2K", "4K"]))
    (row,) = rep.evaluate([claim], ev)
    assert row["match"] is expected and row["status"] == ("match" if expected else "mismatch")
    assert row["reproduced"] == [min(values), max(values)]


def test_point_claims_and_exclusions():
    by = {c.id: c for c in load_claims()}
    ev = rep.Evidence(results=pd.DataFrame({"panel": ["e2e-a6000-response", "e2e-a6000-staleness"]}),
                      speedups=pd.concat([
                          speedup_table("e2e-a6000-response", [1.56, 1.20, 1.27], ["1K", "2K", "4K"]),
                          speedup_table("e2e-a6000-staleness", [0.5, 1.5, 1.6, 1.6, 1.65],
                                        ["s=0", "s=0.5", "s=1", "s=2", "s=4"])]))
    rows = {r["id"]: r for r in rep.evaluate([by["e2e-a6000-response-1k"], by["e2e-a6000-response-2k"],
                                              by["e2e-a6000-staleness"]], ev)}
    assert rows["e2e-a6000-response-1k"]["match"] is True and rows["e2e-a6000-response-1k"]["reproduced"] == 1.56
    assert rows["e2e-a6000-response-2k"]["match"] is False
    assert rows["e2e-a6000-staleness"]["reproduced"] == [1.5, 1.65]     # s = 0 excluded


def test_every_claim_gets_a_row_even_with_no_evidence():
    claims = load_claims()
    rows = rep.evaluate(claims, rep.Evidence())
    assert [r["id"] for r in rows] == [c.id for c in claims]
    for r in rows:
        assert r["match"] is None
        if r["kind"] == "gap":
            assert r["status"] == rep.NOT_SIMULABLE
        else:
            assert r["status"] in (rep.NOT_RUN, rep.UNAVAILABLE)


# --------------------------------------------------------------------------------------------------
# running grids with a fake simulator
# --------------------------------------------------------------------------------------------------

def test_run_panel_marks_unsupported_and_never_simulates_them(dp_one_per_gpu):
    calls = []

    def sim(config, policy, **kw):
        calls.append((config.rl.staleness, policy))
        return fake_simulate(config, policy, **kw)

    spec = S.get("e2e-a6000-staleness")
    df = runmod.run_panel(spec, simulate_fn=sim, max_workers=0, progress=False)
    assert len(df) == len(spec.points) * len(spec.policies)
    uns = df[df["status"] == "unsupported"]
    marked = {(r.point, r.policy) for r in uns.itertuples()}
    assert {("s=0.5", "areal"), ("s=0.5", "roll")} <= marked
    assert {(p, "verl-colocated") for p in ("s=0.5", "s=1", "s=2", "s=4")} <= marked
    assert ("s=0", "verl-colocated") not in marked
    assert all(r.reason for r in uns.itertuples())
    assert (0.5, "areal") not in calls and (0.5, "roll") not in calls and (1.0, "verl-colocated") not in calls
    assert uns["throughput"].isna().all()

    sp = runmod.speedups(df, {spec.id: spec}).set_index("point")
    # s = 0.5: areal and roll excluded, verl-colocated unsupported -> verl-async is the only comparator
    assert sp.at["s=0.5", "best"] == "verl-async" and sp.at["s=0.5", "valid_comparators"] == 1
    assert math.isclose(sp.at["s=0.5", "speedup"], 150 / 100)
    # s = 0: colocated is valid and strongest
    assert sp.at["s=0", "best"] == "verl-colocated"
    assert math.isclose(sp.at["s=1", "speedup"], 150 / 110)
    assert math.isnan(sp.at["s=1", "over:verl-colocated"])


def test_failed_runs_are_recorded_and_excluded(dp_one_per_gpu):
    spec = S.get("e2e-a6000-response", quick=True)
    df = runmod.run_panel(spec, simulate_fn=failing_simulate, max_workers=0, progress=False)
    failed = df[df["status"] == "failed"]
    assert set(failed["policy"]) == {"verl-async"} and failed["reason"].str.contains("MemoryError").all()
    sp = runmod.speedups(df, {spec.id: spec})
    assert (sp["best"] == "areal").all()


def test_ablation_speedup_uses_total_run_throughput_and_ablated_variants():
    spec = S.get("abl-response", quick=True)
    df = runmod.run_panel(spec, simulate_fn=fake_simulate, max_workers=0, progress=False)
    ok = df[df["status"] == "ok"]
    assert np.allclose(ok["throughput"], ok["total_run_throughput"])
    assert np.allclose(ok["throughput"], ok["policy"].map(FAKE_TP) * 1.01 * 0.9)
    sp = runmod.speedups(df, {spec.id: spec})
    assert (sp["best"] == "rot-only").all()
    assert np.allclose(sp["speedup"], 150 / 130) and np.allclose(sp["over:no-borrow"], 1.5)


def test_process_pool_gives_the_same_rows(dp_one_per_gpu):
    spec = S.get("e2e-h100-partition-2b", quick=True)
    a = runmod.run_panel(spec, simulate_fn=fake_simulate, max_workers=0, progress=False)
    b = runmod.run_panel(spec, simulate_fn=fake_simulate, max_workers=2, progress=False)
    cols = ["panel", "point", "policy", "status", "throughput"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert ("16-16", "areal") in {(r.point, r.policy) for r in a.itertuples() if r.status == "unsupported"}


def test_unsupported_marks_claim(dp_one_per_gpu):
    claim = next(c for c in load_claims() if c.id == "e2e-unsupported-marks")
    specs = [S.get("e2e-a6000-staleness", quick=True), S.get("e2e-h100-partition-2b", quick=True)]
    df = runmod.run_specs(specs, simulate_fn=fake_simulate, max_workers=0, progress=False)
    ev = rep.Evidence(results=df, speedups=runmod.speedups(df, {s.id: s for s in specs}))
    (row,) = rep.evaluate([claim], ev)
    assert row["match"] is True
    assert set(row["reproduced"]) == {"e2e-a6000-staleness@s=0.5:areal", "e2e-a6000-staleness@s=0.5:roll",
                                      "e2e-h100-partition-2b@16-16:areal"}
    # a wrongly supported point flips the verdict
    bad = df[~((df["policy"] == "roll") & (df["point"] == "s=0.5"))]
    (row,) = rep.evaluate([claim], rep.Evidence(results=bad, speedups=ev.speedups))
    assert row["match"] is False


def test_static_evidence_with_a_fake_planner():
    spec = S.get("static-4b")
    results = pd.DataFrame({"panel": spec.id, "point": list(spec.labels), "status": "ok", "policy": "no-borrow",
                            "throughput": [5.0, 3.0, 1.0]})
    st = rep.static_evidence(spec, results, plan_fn=fake_plan)
    assert st["choice"] == "8-24" and st["measured_best"] == "8-24"
    assert math.isclose(st["measured_spread"], 5.0)
    rates = fake_plan(spec.config(spec.points[0])).sweep.set_index("rollout_gpus")["pipeline_rate"]
    shown = rates.loc[[8, 16, 24]]
    assert math.isclose(st["spread"], shown.max() / shown.min())
    by = {c.id: c for c in load_claims()}
    rows = {r["id"]: r for r in rep.evaluate([by["static-choice-4b"], by["static-choice-2b"]],
                                             rep.Evidence(static={spec.id: st}))}
    assert rows["static-choice-4b"]["match"] is True and rows["static-choice-2b"]["status"] == rep.NOT_RUN
    # a quick run judges the planner on every displayed partition, but the measured best needs the whole sweep
    quick = rep.static_evidence(S.get("static-4b", quick=True), results.iloc[:2], plan_fn=fake_plan)
    assert quick["spread"] == st["spread"] and quick["measured_points"] == 2
    (row,) = rep.evaluate([by["static-choice-is-measured-best"]],
                          rep.Evidence(static={spec.id: quick, "static-2b": quick}))
    assert row["status"] == rep.NOT_RUN and row["match"] is None


def test_switch_cost_table_claims():
    by = {c.id: c for c in load_claims()}
    ev = rep.Evidence(switch_costs=rep.switch_cost_evidence(fake_derive))
    ids = ["table-hot-switch-2b", "table-hot-switch-4b", "table-hot-switch-order"]
    rows = {r["id"]: r for r in rep.evaluate([by[i] for i in ids], ev)}
    assert rows["table-hot-switch-order"]["match"] is True
    assert rows["table-hot-switch-2b"]["match"] is True       # fake costs are within 2x of Table 3
    assert rows["table-hot-switch-4b"]["match"] is True
    assert rows["table-hot-switch-2b"]["role"] == "fit" and rows["table-hot-switch-4b"]["role"] == "held-out"
    tiny = rep.Evidence(switch_costs=rep.switch_cost_evidence(
        lambda hw, m: {d: cfgmod.SwitchCosts(c.c_in / 10, c.c_out, c.c_grad) for d, c in fake_derive(hw, m).items()}))
    (row,) = rep.evaluate([by["table-hot-switch-4b"]], tiny)
    assert row["match"] is False


# --------------------------------------------------------------------------------------------------
# stage-time model validation (§7.4)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("panel", ["stage-rollout", "stage-trainer"])
def test_stage_errors_are_measured_on_held_out_measured_points(panel):
    """The panel fits on the shipped CPU measurements' fit points and reports errors on the others."""
    from bidirl.experiments import stage_models as SM
    spec = S.get(panel, quick=True)
    seen = {}

    def capture(kind, records, base_model):
        """No calibration (the nominal priors), recording what the fit was shown."""
        seen["kind"], seen["points"] = kind, set(records["point"])
        return base_model.params
    uncalibrated = SM.run_stage_panel(spec, quick=True, fit_fn=capture)
    assert seen["kind"] == panel.split("-")[1]
    held = set(uncalibrated["records"]["point"])
    assert held and seen["points"] and held.isdisjoint(seen["points"])
    assert len(held) == round(SM.HOLDOUT * (len(held) + len(seen["points"])))
    res = SM.run_stage_panel(spec, quick=True)
    assert set(res["records"]["point"]) == held                      # the same seeded split
    assert res["label"] == "measured on CPU, tiny model" and res["note"].startswith(SM.LABEL)
    # the nominal CPU priors are off by factors; calibrated on measurements the error is noise-sized
    assert uncalibrated["median"] > 5 * res["median"]
    assert res["median"] <= res["p90"] and res["median"] < 10 and res["p90"] < 25
    r = res["records"]
    assert np.allclose(r["rel_error"], np.abs(r["predicted"] - r["observed"]) / r["observed"])
    assert {"x", "max_response_len", "observed", "predicted"} <= set(r.columns)


def test_stage_panel_rejects_other_panels():
    from bidirl.experiments import stage_models as SM
    with pytest.raises(ValueError, match="not a stage-model panel"):
        SM.run_stage_panel(S.get("static-2b", quick=True))


def test_perturb_scales_coefficients_but_not_exponents():
    from bidirl.experiments.stage_models import perturb
    from bidirl.perf import RolloutModel
    base = RolloutModel(S.get("stage-rollout").base_config().model_spec,
                        S.get("stage-rollout").base_config().hardware_spec).params
    out = perturb(base, np.random.default_rng(0), 0.15)
    assert out.r == base.r and out.tau_dec != base.tau_dec
    assert out == perturb(base, np.random.default_rng(0), 0.15)       # seeded


# --------------------------------------------------------------------------------------------------
# the whole pipeline and the CLI
# --------------------------------------------------------------------------------------------------

def fake_fit(kind, records, base_model):
    return base_model.params


def test_reproduce_writes_report_and_figures(tmp_path, dp_one_per_gpu):
    out = reproduce(tmp_path / "r", only=["e2e-a6000-response", "abl-response", "static-2b"], quick=True,
                    simulate_fn=fake_simulate, max_workers=0, progress=False, plan_fn=fake_plan,
                    derive_fn=fake_derive)
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    claims = load_claims()
    assert [c["id"] for c in report["claims"]] == [c.id for c in claims]
    by = {c["id"]: c for c in report["claims"]}
    assert by["e2e-a6000-response"]["reproduced"] == [pytest.approx(150 / 110, rel=1e-3)] * 2
    # containment: 1.36 lies inside [1.27 − (0.25·0.27 + 0.02), 1.55 + (0.25·0.55 + 0.02)] = [1.1825, 1.7075]
    # (under the endpoint rule it was a miss: 0.09 above 1.27, allowed 0.0875)
    assert by["e2e-a6000-response"]["match"] is True
    assert report["range_rule"] == RANGE_RULE
    assert by["abl-response"]["status"] in ("match", "mismatch")
    assert by["conv-last-s1"]["status"] == rep.NOT_SIMULABLE and by["conv-last-s1"]["match"] is None
    assert by["e2e-h100-response"]["status"] == rep.NOT_RUN
    assert by["table-hot-switch-2b"]["match"] is True and by["table-hot-switch-2b"]["role"] == "fit"
    assert "held-out matched" in out["summary"]
    for name in ("e2e-a6000-response", "abl-response", "static-2b"):
        assert (tmp_path / "r" / "figures" / f"{name}.html").exists()
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| e2e-overall |" in md and "Assumed:" in md and "## Modelled baselines" in md
    assert out["summary"]["claims"] == len(claims)
    assert "PNG" in out["png"]
    assert len(pd.read_csv(tmp_path / "r" / "results.csv")) == len(out["results"])


def test_cli_rejects_unknown_panels(capsys, tmp_path):
    assert cli_reproduce(["--out", str(tmp_path), "--only", "nope"]) == 2
    assert "unknown panel" in capsys.readouterr().err


def test_model_limits_name_known_claims_and_explain_misses(tmp_path):
    from bidirl.experiments.claims import load_limits
    limits = load_limits()
    assert limits and all(lim.claims and lim.text for lim in limits)
    rows = [{"id": "static-choice-2b", "status": "mismatch", "match": False, "role": "held-out"},
            {"id": "static-choice-4b", "status": "mismatch", "match": False, "role": "fit"},
            {"id": "e2e-s0-colocated", "status": "match", "match": True, "role": "held-out"}]
    rep.explain(rows, limits)
    assert rows[0]["limits"] == ["size-independent-efficiency"] and rows[1]["limits"] == [] and rows[2]["limits"] == []
    assert rep.counts(rows)["misses without a stated limit"] == 1
    bad = tmp_path / "limits.yaml"
    bad.write_text("limits:\n- {id: x, title: t, text: t, claims: [no-such-claim]}\n")
    with pytest.raises(ValueError, match="no-such-claim"):
        load_limits(bad)


def test_a_partial_run_says_which_claims_it_judges_and_why_not_the_others():
    from bidirl.experiments.report import NOT_RUN, NOT_SIMULABLE, claims_table, coverage, coverage_text
    spec = S.get("abl-staleness", quick=True)
    rows = [{"id": "own", "status": "mismatch", "match": False, "check": {"panels": ["abl-staleness"]}},
            {"id": "pooled", "status": "match", "match": True,
             "check": {"panels": ["abl-staleness", "abl-model"]}},
            {"id": "table", "status": "match", "match": True, "check": {}},
            {"id": "other", "status": NOT_RUN, "match": None, "check": {"panels": ["e2e-a6000-response"]}},
            {"id": "reward", "status": NOT_SIMULABLE, "match": None, "check": {}}]
    cov = coverage(rows, [spec])
    assert cov["own"] == ["own"] and cov["shared"] == {"pooled": ["abl-model"]} and cov["independent"] == ["table"]
    assert cov["not_run"] == ["other"] and cov["not_simulable"] == ["reward"]
    text = coverage_text(rows, [spec])
    assert f"quick variant: 2 of the {len(S.get('abl-staleness').points)} points (s=0, s=1)" in text
    assert "Of the paper's 5 claims" in text and "1 is this run's own (own)" in text
    assert "1 pool this run's panels with abl-model, not run" in text and "partial check" in text
    assert "1 are not judged because their panels were not run" in text and "training quality" in text
    for r in rows:
        r.update(paper=[1.0, 1.2], reproduced=[1.0, 1.1], tolerance="±", note="n")
    assert list(claims_table(rows)["claim"]) == ["own", "pooled", "table"]
