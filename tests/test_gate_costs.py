"""The costs that make the borrowing gate matter (§3.2, §5.2): each from its mechanism, each visible in the Gantt.

* a switch's first pinned allocation (``pin_alloc``), from ``benchmarks/trainer_scale.md``'s H200 measurement;
* a window that pays both switches for no work (``switch_no_work``);
* the re-prefill of a resumed or moved request's prompt + kept prefix (``reprefill``);
* every cost constant registered with its source, and a check that fails on one without.
"""

import ast
import inspect

import numpy as np
import pytest

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.perf import costs
from bidirl.perf.replica import BatchingEngine, EngineCosts, EngineGroup
from bidirl.runtime.loop import EventLoop
from bidirl.sim.driver import SimDriver
from bidirl.viz.gantt import spans_to_bars

BASE = {
    "model": "qwen3-vl-2b", "hardware": "a6000",
    "cluster": {"gpus": 8, "gpus_per_node": 8, "placement": "any", "partition": [4, 4]},
    "workload": {"dataset": "geo3k", "prompts_per_step": 8, "group_size": 4, "max_response_len": 512, "steps": 5},
    "rl": {"staleness": 0, "micro_batch_per_device": 2},
    "scheduler": {"policy": "bidirl"},
}
#: float arithmetic on span ends a few hundred seconds into a run: t0 + x − t0 loses at most a few ulps of t0
#: (≈ 1e-13 s at t0 < 1e3 s); 1e-9 s is far above that and far below any cost checked here (≥ 1e-3 s)
EXACT = 1e-9


# ---- the registry of cost constants ----------------------------------------------------------------

#: modules whose module-level numeric constants are cost constants (each needs a registered source)
COST_MODULES = (costs,)


def unsourced_constants(source: str, registry: dict) -> list:
    """Module-level UPPER_CASE names bound to a number (a literal, an arithmetic expression of literals, or a
    ``cost_constant(...)`` call) in ``source`` that ``registry`` does not hold with a source."""
    out = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        value = getattr(node, "value", None)
        for t in targets:
            if not (isinstance(t, ast.Name) and t.id.isupper()) or value is None:
                continue
            numeric = all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
                          and (not isinstance(n, ast.Constant) or isinstance(n.value, (int, float)))
                          for n in ast.walk(value))
            registered = isinstance(value, ast.Call) and getattr(value.func, "id", "") == "cost_constant"
            if (numeric or registered) and (t.id not in registry or not registry[t.id].source.strip()):
                out.append(t.id)
    return out


@pytest.mark.parametrize("module", COST_MODULES, ids=lambda m: m.__name__)
def test_every_cost_constant_has_a_source(module):
    assert unsourced_constants(inspect.getsource(module), costs.COST_CONSTANTS) == []
    for name, const in costs.COST_CONSTANTS.items():
        assert getattr(costs, name) == const.value, name


def test_the_check_fails_on_a_constant_without_a_source():
    src = ("A_SOURCED = cost_constant('A_SOURCED', 1.0, 's', 'a measurement in benchmarks/x.md')\n"
           "NEW_COST = 0.25\nHALF = 1.0 / 2.0\nNAME = 'x'\n")
    registry = {"A_SOURCED": costs.CostConstant(1.0, "s", "a measurement in benchmarks/x.md")}
    assert unsourced_constants(src, registry) == ["NEW_COST", "HALF"]


def test_a_constant_cannot_be_registered_without_a_source():
    with pytest.raises(ValueError, match="needs its source"):
        costs.CostConstant(1.0, "s", "")


def test_pinned_allocation_rate_is_the_h200_measurement():
    # benchmarks/trainer_scale.md: 36.7 s first vs 1.00 s steady offload of 45.0 GB → 0.793 s per GB
    assert costs.PINNED_ALLOC_SECONDS_PER_BYTE * 1e9 == pytest.approx(0.7933, abs=1e-4)


# ---- the first switch's pinned allocation ------------------------------------------------------------

def _spans(log, kind):
    return [s for s in log.spans if s.kind == kind]


def test_first_switch_pays_its_pinned_allocation_once():
    cfg = cfgmod.from_dict(BASE)
    driver = SimDriver(cfg, "opportunistic", steps=4, seed=0, jitter=0.0)
    log = driver.run().log
    hw, model, rho = cfg.hardware_spec, cfg.model_spec, driver.plan.envelope.trainer_layout
    allocs = _spans(log, "pin_alloc")
    keys = [(s.detail["direction"], s.detail["phase"]) for s in allocs]
    assert len(keys) == len(set(keys)) and keys, keys          # once per direction and phase, and some
    for s, (direction, phase) in zip(allocs, keys):
        want = costs.first_switch_allocation(hw, model, direction, phase, trainer_layout=rho)
        assert want > 0 and s.end - s.start == pytest.approx(want, abs=EXACT)
        # the switch it starts lasts the steady cost plus the allocation; the next one of its kind the steady cost
        kind = "switch_in" if phase == "in" else "switch_out"
        same = [w for w in _spans(log, kind) if w.detail["direction"] == direction]
        steady = getattr(cfg.switch_costs(direction), "c_in" if phase == "in" else "c_out")
        assert same[0].start == s.start and same[0].end - same[0].start == pytest.approx(steady + want, abs=EXACT)
        assert all(w.end - w.start == pytest.approx(steady, abs=EXACT) for w in same[1:])
    # the formula: 12·N/ρ_t (primary trainer, first Rollouter-on-TrainerPool switch in) bytes per GPU
    rot = costs.first_switch_allocation(hw, model, P.ROLLOUT_ON_TRAINER_POOL, "in", trainer_layout=rho)
    assert rot == pytest.approx(12 * model.params_total / rho * costs.PINNED_ALLOC_SECONDS_PER_BYTE, rel=1e-12)
    assert costs.first_switch_allocation(hw, model, P.ROLLOUT_ON_TRAINER_POOL, "out", trainer_layout=rho) == 0


# ---- a switch paid for no work ----------------------------------------------------------------------

def test_window_closing_before_its_switch_completes_pays_both_switches_for_no_work():
    """Switches far longer than the wait: the opportunistic variant lends the idle trainer pool anyway, the batch
    is ready before the switch in completes, and the pool comes back without its guests running anything."""
    expensive = {"c_in": 50.0, "c_out": 40.0, "c_grad": 1.0}
    cfg = cfgmod.from_dict(BASE).with_overrides({"scheduler.rollout_on_trainer_pool": expensive,
                                                 "scheduler.trainer_on_rollout_pool": expensive})
    driver = SimDriver(cfg, "opportunistic", steps=3, seed=0, jitter=0.0)
    log = driver.run().log
    wasted = _spans(log, "switch_no_work")
    assert wasted, "no window paid for no work"
    rho = driver.plan.envelope.trainer_layout
    for s in wasted:
        switch = [w for w in log.spans if w.kind in ("switch_in", "switch_out") and w.worker == s.worker
                  and w.start == s.start and w.end == s.end]
        assert len(switch) == 1 and switch[0].kind == "switch_" + s.detail["phase"]
    ins = [s for s in wasted if s.detail["phase"] == "in"]
    first = {(s.detail["direction"], s.detail["phase"]) for s in _spans(log, "pin_alloc")}
    for s in ins:
        d = s.detail["direction"]
        alloc = costs.first_switch_allocation(cfg.hardware_spec, cfg.model_spec, d, "in", trainer_layout=rho)
        # C_in (+ the first allocation, if this was the first switch in) and C_out, both paid
        paid = s.detail["paid"]
        assert paid == pytest.approx(50.0 + 40.0, abs=EXACT) or (
            (d, "in") in first and paid == pytest.approx(90.0 + alloc, abs=EXACT))
    # nothing of the guests' work falls inside a window marked as paid for nothing
    for s in ins:
        out = next(w for w in wasted if w.detail["phase"] == "out" and w.start >= s.end)
        pool = P.worker_pool(s.worker)
        assert not [w for w in log.spans if w.kind in ("generate", "chunk") and w.role == P.AUXILIARY
                    and w.pool == pool and s.start <= w.start < out.end]
    # the gated policy refuses those windows, so it pays no such switch
    gated = SimDriver(cfg, "bidirl", steps=3, seed=0, jitter=0.0).run().log
    assert not _spans(gated, "switch_no_work")


# ---- re-prefill of a resumed request --------------------------------------------------------------

def _engine(costs_):
    spans = []
    loop = EventLoop()
    eng = BatchingEngine("rollouter/rollout_pool/0", costs_, loop, np.random.default_rng(0),
                         lambda *a: None, lambda w, k, a, b, d: spans.append((k, a, b, d)), lambda *a: None)
    return eng, loop, spans


def test_resumed_requests_pay_the_reprefill_of_their_kept_prefix():
    """Prefill wave of a group resumed with prefixes (10, 0, 30) over a 100-token prompt: the wave costs
    τ_pre + α·F(110, 100, 130); the re-prefill span is its share α·(F(110, 100, 130) − F(100, 100, 100)), ending
    where the wave ends."""
    flops = lambda lens: float(np.sum(np.asarray(lens, float) ** 2))   # noqa: E731 (attention-like, superlinear)
    c = EngineCosts(tau_pre=0.01, alpha_pre=1e-6, tau_dec=0.02, beta_tok=0.0, beta_hist=0.0, prefill_flops=flops,
                    kv_tokens=10**6, max_seqs=256, noise=0.0)
    eng, loop, spans = _engine(c)
    task = P.GroupTask(7, P.GroupState(7, 100, (10, 0, 30), (False, False, False), 0))
    eng.add(EngineGroup.from_task(task, 100, (50, 40, 60), 0))
    loop.run()
    re = [s for s in spans if s[0] == "reprefill"]
    assert len(re) == 1
    _, a, b, detail = re[0]
    want = 1e-6 * (flops([110, 100, 130]) - flops([100, 100, 100]))
    assert b - a == pytest.approx(want, abs=EXACT)
    assert b == pytest.approx(0.01 + 1e-6 * flops([110, 100, 130]), abs=EXACT)
    assert detail == {"tokens": 40, "requests": 2}


def test_fresh_requests_pay_no_reprefill():
    c = EngineCosts(tau_pre=0.01, alpha_pre=1e-6, tau_dec=0.02, beta_tok=0.0, beta_hist=0.0,
                    prefill_flops=lambda lens: float(np.sum(lens)), kv_tokens=10**6, noise=0.0)
    eng, loop, spans = _engine(c)
    eng.add(EngineGroup.from_task(P.GroupTask(1), 100, (5, 5), 0))
    loop.run()
    assert [s for s in spans if s[0] == "reprefill"] == []


def test_the_gantt_shows_each_cost_as_its_own_trace():
    cfg = cfgmod.from_dict(BASE).with_overrides({"rl.partial_rollout": True, "cluster.partition": [2, 6],
                                                 "workload.max_response_len": 2048})
    log = SimDriver(cfg, "opportunistic", steps=4, seed=0, jitter=0.0).run().log
    bars = spans_to_bars(log)
    kinds = {k for k, _ in bars}
    assert {"reprefill", "pin_alloc"} <= kinds, kinds
    total = sum(s.end - s.start for s in _spans(log, "reprefill"))
    drawn = sum(float(np.sum(b["x"])) for (k, _), b in bars.items() if k == "reprefill")
    assert drawn == pytest.approx(total, rel=1e-12)


# ---- what the control plane charges ---------------------------------------------------------------

def test_the_first_switch_is_expected_with_its_allocation_and_observed_without_it():
    from bidirl.core.profiler import Profiler
    steady = P.SwitchCosts(2.0, 3.0, 0.5)
    prof = Profiler(costs={d: steady for d in P.DIRECTIONS}, smoothing=0.5,
                    first_switch={(P.ROLLOUT_ON_TRAINER_POOL, "c_in"): 10.0})
    # the gates judge the steady costs; the switch itself is expected to take the allocation once
    assert prof.costs[P.ROLLOUT_ON_TRAINER_POOL] == steady
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL) == P.SwitchCosts(12.0, 3.0, 0.5)
    assert prof.charged(P.TRAINER_ON_ROLLOUT_POOL) == steady
    prof.observe_cost(P.ROLLOUT_ON_TRAINER_POOL, "c_in", 12.4)      # 10 s of it was the one-time allocation
    prof.recalibrate()
    # folded in as 2.4 s: 0.5·2.0 + 0.5·2.4 = 2.2; nothing more to allocate
    assert prof.costs[P.ROLLOUT_ON_TRAINER_POOL].c_in == pytest.approx(2.2, abs=1e-12)
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL).c_in == pytest.approx(2.2, abs=1e-12)


def test_the_tail_split_counts_the_switch_back_after_the_auxiliaries_last_chunk():
    """The step ends at max(t_p + g, t_a + max(g, C_out)), g = C_grad + optimizer: the auxiliary side's ready
    time carries max(0, C_out − g) in the last segment, nothing before it."""
    from types import SimpleNamespace

    from bidirl.runtime.assemble import assemble
    cfg = cfgmod.from_dict(BASE)
    coord = assemble(cfg, "bidirl", steps=1, seed=0).coordinator
    costs_ = coord.profiler.charged(P.TRAINER_ON_ROLLOUT_POOL)
    opt = coord.settings.optimizer_seconds
    last = SimpleNamespace(segment_index=1, segments=[("old_logprob",), ("actor_update",)])
    first = SimpleNamespace(segment_index=0, segments=last.segments)
    assert coord._yield_lag(first) == 0.0
    assert coord._yield_lag(last) == pytest.approx(max(0.0, costs_.c_out - costs_.c_grad - opt), abs=EXACT)
    # on this preset the switch back outlasts the merge and the optimizer step, so the lag is what is left of it
    assert costs_.c_out > costs_.c_grad + opt and coord._yield_lag(last) > 0
