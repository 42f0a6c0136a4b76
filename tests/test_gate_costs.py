"""The costs that make the borrowing gate matter (§3.2, §5.2): each from its mechanism, each visible in the Gantt.

* what is left of a switch's first pinned allocation after the engines reserved it in the background since their
  load (``pin_alloc``), from ``benchmarks/trainer_scale.md``'s H200 measurement;
* a window that pays both switches for no work (``switch_no_work``);
* the re-prefill of a resumed or moved request's prompt + kept prefix (``reprefill``);
* every cost constant registered with its source, and a check that fails on one without.
"""

import ast
import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.perf import controller_data, costs
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
COST_MODULES = (costs, controller_data)


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
        if hasattr(module, name):
            assert getattr(module, name) == const.value, name


def test_every_registered_constant_lives_in_a_checked_module():
    assert [n for n in costs.COST_CONSTANTS if not any(hasattr(m, n) for m in COST_MODULES)] == []


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


def test_first_switch_pays_what_is_left_of_its_pinned_allocation_once():
    """The engines reserve the pinned buffer in the background from their load (the run's start), so the first
    switch of a direction and phase starting at ``t`` pays ``max(0, allocation − t)`` on top of its steady cost."""
    cfg = cfgmod.from_dict(BASE)
    driver = SimDriver(cfg, "opportunistic", steps=4, seed=0, jitter=0.0)
    log = driver.run().log
    hw, model, rho = cfg.hardware_spec, cfg.model_spec, driver.plan.envelope.trainer_layout
    allocs = _spans(log, "pin_alloc")
    keys = [(s.detail["direction"], s.detail["phase"]) for s in allocs]
    assert len(keys) == len(set(keys)) and keys, keys          # once per direction and phase, and some
    shortened = []
    for direction, phase in [(d, ph) for d in P.DIRECTIONS for ph in ("in", "out")]:
        want = costs.first_switch_allocation(hw, model, direction, phase, trainer_layout=rho)
        kind = "switch_in" if phase == "in" else "switch_out"
        same = [w for w in _spans(log, kind) if w.detail["direction"] == direction]
        if not same:
            continue
        left = max(0.0, want - same[0].start)                # the formula, the engines loaded at t = 0
        if want > 0 and left < want:
            shortened.append((direction, phase))
        steady = getattr(cfg.switch_costs(direction), "c_in" if phase == "in" else "c_out")
        span = [s for s in allocs if (s.detail["direction"], s.detail["phase"]) == (direction, phase)]
        assert len(span) == (left > 0)
        if left > 0:
            assert span[0].start == same[0].start and span[0].end - span[0].start == pytest.approx(left, abs=EXACT)
            assert span[0].detail["seconds"] == pytest.approx(left, abs=EXACT)
        # the first switch lasts the steady cost plus what is left; every later one of its kind the steady cost
        assert same[0].end - same[0].start == pytest.approx(steady + left, abs=EXACT)
        assert all(w.end - w.start == pytest.approx(steady, abs=EXACT) for w in same[1:])
    # on this job the first Trainer-on-RolloutPool switch out starts after its 8·N/ρ_t allocation (13.5 s) is reserved
    assert (P.TRAINER_ON_ROLLOUT_POOL, "out") in shortened
    # the formula: 12·N/ρ_t (primary trainer, first Rollouter-on-TrainerPool switch in) bytes per GPU
    rot = costs.first_switch_allocation(hw, model, P.ROLLOUT_ON_TRAINER_POOL, "in", trainer_layout=rho)
    assert rot == pytest.approx(12 * model.params_total / rho * costs.PINNED_ALLOC_SECONDS_PER_BYTE, rel=1e-12)
    assert costs.first_switch_allocation(hw, model, P.ROLLOUT_ON_TRAINER_POOL, "out", trainer_layout=rho) == 0


def test_the_simulator_keeps_one_copy_of_the_allocation():
    """The switch's duration and its ``pin_alloc`` span come from the same entry: change it and both follow."""
    cfg = cfgmod.from_dict(BASE)
    driver = SimDriver(cfg, "opportunistic", steps=2, seed=0, jitter=0.0)
    key = (P.ROLLOUT_ON_TRAINER_POOL, "in")
    driver.switch_times.first[key] = 1000.0                   # far longer than any start time of this run
    log = driver.run().log
    first_in = [w for w in _spans(log, "switch_in") if w.detail["direction"] == key[0]][0]
    span = [s for s in _spans(log, "pin_alloc") if (s.detail["direction"], s.detail["phase"]) == key]
    steady = cfg.switch_costs(key[0]).c_in
    assert len(span) == 1 and span[0].end - span[0].start == pytest.approx(1000.0 - first_in.start, abs=EXACT)
    assert first_in.end - first_in.start == pytest.approx(steady + 1000.0 - first_in.start, abs=EXACT)
    assert key not in driver.switch_times.first                # consumed by the switch that paid it


@given(alloc=st.floats(0.0, 1e3), loaded=st.floats(0.0, 1e3), after=st.floats(0.0, 2e3),
       steady=st.floats(0.0, 50.0))
def test_switch_times_charge_what_is_left_once(alloc, loaded, after, steady):
    times = costs.SwitchTimes({d: P.SwitchCosts(steady, steady, 0.0) for d in P.DIRECTIONS},
                              {(P.TRAINER_ON_ROLLOUT_POOL, "out"): alloc}, loaded_at=loaded)
    now = loaded + after
    # (loaded + after) − loaded differs from ``after`` by at most an ulp of ``now`` < 3e3 s (≈ 5e-13 s): EXACT
    got_steady, got_left = times.take(P.TRAINER_ON_ROLLOUT_POOL, "out", now)
    assert got_steady == steady and got_left == pytest.approx(max(0.0, alloc - after), abs=EXACT)
    assert times.take(P.TRAINER_ON_ROLLOUT_POOL, "out", now) == (steady, 0.0)      # reused afterwards
    assert times.take(P.ROLLOUT_ON_TRAINER_POOL, "in", loaded) == (steady, 0.0)    # no entry: nothing to pin


def test_pinned_allocation_left_refuses_a_negative_allocation():
    with pytest.raises(ValueError, match="allocation must be"):
        costs.pinned_allocation_left(-1.0, 0.0)


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

def test_the_first_switch_is_expected_with_what_is_left_and_observed_without_it():
    from bidirl.core.profiler import Profiler
    steady = P.SwitchCosts(2.0, 3.0, 0.5)
    prof = Profiler(costs={d: steady for d in P.DIRECTIONS}, smoothing=0.5,
                    first_switch={(P.ROLLOUT_ON_TRAINER_POOL, "c_in"): 10.0}, loaded_at=1.0)
    # the steady costs stay steady; a switch starting at t (and a gate judging a window at t) is charged
    # max(0, 10 − (t − 1)) more
    assert prof.costs[P.ROLLOUT_ON_TRAINER_POOL] == steady
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL, 1.0) == P.SwitchCosts(12.0, 3.0, 0.5)
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL, 5.0) == P.SwitchCosts(8.0, 3.0, 0.5)
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL, 11.0) == steady          # reserved by then
    assert prof.charged(P.TRAINER_ON_ROLLOUT_POOL, 1.0) == steady
    with pytest.raises(ValueError, match="needs the time it ended"):
        prof.observe_cost(P.ROLLOUT_ON_TRAINER_POOL, "c_in", 8.4)
    # started at t = 5 (6 s of the allocation left), took 8.4 s, ended at 13.4: folded in as 2.4 s
    prof.observe_cost(P.ROLLOUT_ON_TRAINER_POOL, "c_in", 8.4, 13.4)
    prof.recalibrate()
    # 0.5·2.0 + 0.5·2.4 = 2.2; nothing more to allocate
    assert prof.costs[P.ROLLOUT_ON_TRAINER_POOL].c_in == pytest.approx(2.2, abs=1e-12)
    assert prof.charged(P.ROLLOUT_ON_TRAINER_POOL, 5.0).c_in == pytest.approx(2.2, abs=1e-12)


def test_the_tail_split_counts_the_switch_back_after_the_auxiliaries_last_chunk():
    """The step ends at max(t_p + g, t_a + max(g, C_out)), g = C_grad + optimizer: the auxiliary side's ready
    time carries max(0, C_out − g) in the last segment, nothing before it."""
    from types import SimpleNamespace

    from bidirl.runtime.assemble import assemble
    cfg = cfgmod.from_dict(BASE)
    coord = assemble(cfg, "bidirl", steps=1, seed=0).coordinator
    costs_ = coord.profiler.charged(P.TRAINER_ON_ROLLOUT_POOL, coord._now)
    opt = coord.settings.optimizer_seconds
    last = SimpleNamespace(segment_index=1, segments=[("old_logprob",), ("actor_update",)])
    first = SimpleNamespace(segment_index=0, segments=last.segments)
    assert coord._yield_lag(first) == 0.0
    assert coord._yield_lag(last) == pytest.approx(max(0.0, costs_.c_out - costs_.c_grad - opt), abs=EXACT)
    # on this preset the switch back outlasts the merge and the optimizer step, so the lag is what is left of it
    assert costs_.c_out > costs_.c_grad + opt and coord._yield_lag(last) > 0
