"""An auxiliary trainer gang across optimizer mini-batches (paper §5.2, Trainer-on-RolloutPool;
``rl.mini_batch_prompts``, ``rl.updates_per_sync``): after each optimizer step that keeps the version the primaries
send it their new weights (``RefreshWeights``) before it is handed a chunk computed on them, so it never computes a
chunk of mini-batch m + 1 on weights older than mini-batch m's step; the gate charges the refreshes."""

import pytest
from hypothesis import given, settings, strategies as st

from bidirl.core import gates
from bidirl.core import protocol as P
from bidirl.job import config as cfgmod
from bidirl.perf.costs import aux_weight_transfer_time, derive_switch_costs
from bidirl.runtime.assemble import assemble
from bidirl.sim.driver import SimDriver
from bidirl.perf.flops import STAGES
from tests.test_mini_batches import make_step


class WatchingAuxWeights:
    """A driver mixin checking as the run goes which weights the auxiliary gang holds when it is handed a chunk: the
    primaries' (every optimizer step since the version), read from the events alone (any driver: the simulator's
    :class:`Watching`, the emulated workers' in ``tests/test_emulated_aux_refresh.py``)."""

    def __post_init__(self):
        super().__post_init__()
        self.since_version = 0          # optimizer steps the primaries took since the version
        self.watched_version = 0
        self.aux_holds = None           # optimizer steps since the version in the auxiliary gang's weights
        self.aux_chunks = []            # (step, local update, optimizer steps since the version) per aux chunk
        self.refreshes = []
        self.local = 0
        self.switch_phase = None

    def do_Switch(self, cmd):
        if cmd.pool == P.ROLLOUT_POOL:
            self.switch_phase = cmd.phase
        super().do_Switch(cmd)

    def feed(self, event):
        if isinstance(event, P.OptimizerStepped):
            if event.version != self.watched_version:
                self.watched_version, self.since_version = event.version, 0
            else:
                self.since_version += 1
        if isinstance(event, P.SwitchFinished) and event.pool == P.ROLLOUT_POOL:
            # the switch in loads the version's weights; after the switch out the gang holds none
            self.aux_holds = 0 if self.switch_phase == "in" else None
        if isinstance(event, P.WeightsRefreshed):
            assert event.updates <= self.since_version, "a refresh carries no optimizer step not yet taken"
            self.aux_holds = event.updates
        super().feed(event)

    def do_StartStep(self, cmd):
        self.local = cmd.local
        super().do_StartStep(cmd)

    def do_RefreshWeights(self, cmd):
        self.refreshes.append(cmd)
        super().do_RefreshWeights(cmd)

    def do_RunChunk(self, cmd):
        if cmd.worker == P.AUX_TRAINER:
            assert self.aux_holds == self.since_version, (
                f"auxiliary chunk {cmd.chunk.chunk_id} ({cmd.chunk.stage}) sent on weights {self.aux_holds} optimizer "
                f"steps after the version; the primaries are {self.since_version} steps on")
            self.aux_chunks.append((cmd.chunk.step, self.local, self.since_version, cmd.chunk.stage))
        super().do_RunChunk(cmd)


class Watching(WatchingAuxWeights, SimDriver):
    """The simulator under :class:`WatchingAuxWeights`."""


def _watched(config, overrides, steps, seed=0, policy="bidirl"):
    driver = Watching(cfgmod.load(config).with_overrides(overrides), policy, steps, seed)
    driver.run()
    return driver


@pytest.mark.parametrize("overrides", [{"rl.mini_batch_prompts": 16}, {"rl.mini_batch_prompts": 4},
                                       {"rl.mini_batch_prompts": 16, "rl.updates_per_sync": 2, "rl.staleness": 0}])
def test_an_auxiliary_gang_works_across_mini_batches_on_the_weights_of_each(overrides):
    driver = _watched("a6000-default", overrides, steps=4)
    worked = {(step, local, since) for step, local, since, stage in driver.aux_chunks if stage == "actor_update"}
    # it works past the first mini-batch (and, streamed, in the later local update): the refresh is what lets it
    assert any(since > 0 for _, _, since in worked), sorted(worked)
    assert len({since for _, _, since in worked}) >= 2
    if overrides.get("rl.updates_per_sync", 1) > 1:
        assert any(local > 0 for _, local, _ in worked), "an auxiliary gang in a streamed step's later local update"
    # every refresh is one weight transfer of the model's shard, what the switch in's transfer charges
    cfg = driver.config
    want = aux_weight_transfer_time(cfg.hardware_spec, cfg.model_spec, driver.topology.trainer_layout)
    assert driver.refreshes and {r.expected for r in driver.refreshes} == {want}
    assert {r.worker for r in driver.refreshes} == {P.AUX_TRAINER} and all(r.updates > 0 for r in driver.refreshes)


@settings(max_examples=8, deadline=None)
@given(mini=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 20), stream=st.sampled_from([1, 2]),
       policy=st.sampled_from(["bidirl", "tor-only", "opportunistic"]))
def test_no_auxiliary_chunk_computes_on_weights_older_than_the_last_optimizer_step(mini, seed, stream, policy):
    """The property, on the A6000 job (its rollout pool idles every step, so windows open): each chunk sent to the
    auxiliary gang finds it holding the primaries' weights (the :class:`Watching` driver asserts it as the run
    goes), the run completes (a refresh overtaken by the next optimizer step is followed by another, never a stall),
    and the gang is refreshed at least once."""
    overrides = {"rl.mini_batch_prompts": mini, "rl.updates_per_sync": stream}
    if stream > 1:
        overrides["rl.staleness"] = 0
    driver = _watched("a6000-default", overrides, steps=2, seed=seed, policy=policy)
    assert driver.coordinator.view().steps_done == 2
    assert driver.aux_chunks and driver.refreshes


def test_the_chunk_queue_hands_the_auxiliary_gang_no_chunk_until_it_holds_the_segments_weights():
    step = make_step(groups=4, size=2, mini_prompts=2)          # forward segment, then two mini-batches
    step.aux_refresh = True
    assert [step.weights_at(k) for k in range(len(step.segments))] == [0, 0, 1]
    assert step.pull(P.AUXILIARY, 1, "aux") is None, "nothing before the switch in loaded weights"
    step.aux_weights = 0
    assert step.pull(P.AUXILIARY, 1, "aux") is not None
    step.segment_index = 2
    step._open_segment()
    assert step.aux_needs_refresh and step.pull(P.AUXILIARY, 1, "aux") is None
    step.aux_refreshing = True
    assert not step.aux_needs_refresh and step.pull(P.AUXILIARY, 1, "aux") is None, "not while it is refreshed"
    step.aux_refreshing, step.aux_weights = False, 1
    assert step.pull(P.AUXILIARY, 1, "aux") is not None
    # refreshes a window pays: one per weights other than the version's in the segments it works in
    assert step.refreshes_from(0) == 1 and step.refreshes_from(2) == 1
    step.updates_before = 2                                     # a streamed step's third local update
    assert [step.weights_at(k) for k in range(3)] == [2, 2, 3] and step.refreshes_from(0) == 2


def test_without_refreshes_the_queue_keeps_the_auxiliary_gang_on_the_versions_weights():
    step = make_step(groups=4, size=2, mini_prompts=2)
    assert not step.aux_refresh and step.aux_last_segment == 1
    assert step.pull(P.AUXILIARY, 1, "aux") is not None, "the old rule: no weights bookkeeping"


def test_the_gate_charges_each_refresh_the_auxiliary_share_of_its_transfer():
    base = gates.TrainerGate(admitted=True, t_no=10.0, t_joint=6.0, t_borrow=8.0, drained=0, cost=2.0)
    # 3 refreshes of 1.5 s with d_p = 2, d_a = 1: the auxiliaries lose 1 × 1.5 replica-seconds each, which the
    # 3 replicas finish 0.5 s later: T_borrow 8 + 3 × 0.5 = 9.5 < 10, still admitted
    g = gates.charge_refreshes(base, 3, 1.5, d_p=2, d_a=1)
    assert g.t_borrow == pytest.approx(9.5) and g.cost == pytest.approx(3.5) and g.admitted
    assert g.gain == base.gain
    # 5 of them: 8 + 2.5 = 10.5 ≥ 10, refused; ungated it stays admitted
    assert not gates.charge_refreshes(base, 5, 1.5, d_p=2, d_a=1).admitted
    assert gates.charge_refreshes(base, 5, 1.5, d_p=2, d_a=1, gated=False).admitted
    assert gates.charge_refreshes(base, 0, 1.5, 2, 1) is base
    with pytest.raises(ValueError, match="refreshes"):
        gates.charge_refreshes(base, -1, 1.5, 2, 1)


def test_the_refresh_cost_is_the_switch_ins_weight_transfer():
    cfg = cfgmod.load("a6000-default")
    hw, model = cfg.hardware_spec, cfg.model_spec
    a = assemble(cfg, "bidirl", steps=1, seed=0)
    rho = a.topology.trainer_layout
    b_n = model.dtype_bytes * float(model.params_total)
    assert a.coordinator.settings.aux_refresh_seconds == pytest.approx(b_n / (rho * hw.inter_node_bandwidth))
    # the derived switch in charges the same transfer as its last term
    tor = derive_switch_costs(hw, model, trainer_layout=rho)[P.TRAINER_ON_ROLLOUT_POOL]
    assert tor.c_in > aux_weight_transfer_time(hw, model, rho) > 0
    assert assemble(cfg, "bidirl", steps=1, seed=0, aux_refresh=False).coordinator.settings.aux_refresh_seconds is None


class FailingInSecondLocal(SimDriver):
    """The simulator; the primary trainer gang dies once, in step 0's second local update, and comes back."""

    def __post_init__(self):
        super().__post_init__()
        self.failed_once = False

    def do_StartStep(self, cmd):
        super().do_StartStep(cmd)
        if cmd.step == 0 and cmd.local == 1 and not self.failed_once:
            self.failed_once = True

            def fail(_t0):
                for job in self.gang_queue.pop(P.PRIMARY_TRAINER, []):
                    job["cancelled"] = True             # its queued chunks die with it
                self.feed(P.WorkerFailed(self.loop.now, P.PRIMARY_TRAINER, "killed by the test"))
                self._after(1.0, lambda _t: self.feed(P.WorkerRestarted(self.loop.now, P.PRIMARY_TRAINER)))
            self._after(0.001, fail)


def test_a_rollback_in_a_streamed_steps_later_local_update_keeps_the_earlier_ones_merge_log():
    """The merge log has one entry per local update applied; a rollback of the second local update drops its own
    attempt's entry only, never the first local update's, which was applied and is not redone."""
    cfg = cfgmod.load("tiny-cpu").with_overrides({"rl.updates_per_sync": 2, "rl.staleness": 0})
    clean = SimDriver(cfg, "no-borrow", 2, 0)
    clean.run()
    driver = FailingInSecondLocal(cfg, "no-borrow", 2, 0)
    driver.run()
    assert driver.failed_once and driver.coordinator.view().steps_done == 2
    steps = [s for s, _ in driver.coordinator.view().merge_log]
    assert steps == [s for s, _ in clean.coordinator.view().merge_log] == [0, 0, 1, 1]


def test_a_refresh_overtaken_by_the_next_optimizer_step_is_followed_by_another():
    """With 2-prompt mini-batches the primaries can finish a mini-batch and step while the auxiliary gang is still
    being refreshed to the step before: the refresh's arrival must lead to the next one, not leave the gang waiting
    for weights no refresh brings (this job stopped after 1 of 2 steps when the late refresh was dropped)."""
    driver = _watched("a6000-default", {"rl.mini_batch_prompts": 2}, steps=2, seed=3, policy="tor-only")
    assert driver.coordinator.view().steps_done == 2
    assert any(since > 0 for _, _, since, _ in driver.aux_chunks)


def _scanned_weights_at(step, k):
    """:meth:`AuxWeights.weights_at` as a scan of the segments before ``k``."""
    return step.updates_before + sum(1 for seg in step.segments[:k] if seg == P.UPDATE_STAGES)


@settings(max_examples=200, deadline=None)
@given(groups=st.integers(1, 8), size=st.integers(1, 3), data=st.data(), updates_before=st.integers(0, 3),
       stages=st.sets(st.sampled_from(STAGES), min_size=1))
def test_the_weights_tags_and_refreshes_in_closed_form_equal_the_scan_of_the_segments(groups, size, data,
                                                                                     updates_before, stages):
    """weights_at and refreshes_from (closed forms, O(1) per call) give what scanning the segments gives, on steps
    with or without a forward segment, one or many mini-batches, streamed or not."""
    mini = data.draw(st.sampled_from([None] + [m for m in range(1, groups + 1) if groups % m == 0]))
    step = make_step(groups=groups, size=size, mini_prompts=mini, stages=tuple(s for s in STAGES if s in stages))
    step.updates_before = updates_before
    n = len(step.segments)
    for k in range(-n - 2, n + 3):
        assert step.weights_at(k) == _scanned_weights_at(step, k), k
    for start in range(0, n + 2):
        for end in [None, *range(0, n + 3)]:
            stop = n if end is None else end
            tags = {_scanned_weights_at(step, k) for k in range(start, stop)}
            assert step.refreshes_from(start, end) == len(tags - {0}), (start, end)
    for index in range(n):
        step.segment_index = index
        assert step.weights_at() == _scanned_weights_at(step, index)


def test_refreshes_from_refuses_a_negative_segment():
    with pytest.raises(ValueError, match="start"):
        make_step(groups=4, size=2, mini_prompts=2).refreshes_from(-1)
