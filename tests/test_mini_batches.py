"""Optimizer mini-batches in the trainer's chunk queue (``rl.mini_batch_prompts``, veRL's ``ppo_mini_batch_size``):
the update stage is cut into mini-batches of ``mini_batch_prompts · group_size`` samples in batch order, no chunk
spans two of them, and one optimizer step follows each (veRL's ``DataParallelPPOActor.update_policy``)."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from bidirl.core import protocol as P
from bidirl.core.chunks import TrainerStep
from bidirl.core.protocol import GroupState
from bidirl.job import config as cfgmod
from bidirl.sim import simulate
from bidirl.sim.driver import SimDriver

STAGES = ("old_logprob", "ref_logprob", "actor_update")


def make_step(groups, size, mini_prompts, micro_batch_per_device=1, budget=None, grid=None, lengths=None,
              stages=STAGES):
    ids = itertools.count()
    lengths = lengths or [20 + 7 * (k % 5) for k in range(groups * size)]
    gs = [GroupState(g, 10 + g, tuple(lengths[g * size:(g + 1) * size]), (True,) * size, 0) for g in range(groups)]
    return TrainerStep(step=0, version=0, groups=gs, stages=stages, micro_batch_per_device=micro_batch_per_device,
                       next_chunk_id=lambda: next(ids), max_tokens_per_micro_batch=budget, grid=grid,
                       mini_batch=None if mini_prompts is None else mini_prompts * size)


def linear_time(stage, p, r, d, side):
    return 0.01 + sum(a + b for a, b in zip(p, r)) / d / 1000


def run_step(step, choices, d_p=1, d_a=1):
    """Drive ``step`` to its end as the coordinator does: sides pull (a tail split when TailWindow fires), chunks
    start and finish in the drawn order, and at each finished mini-batch that another follows one optimizer step is
    taken before the next segment opens. Returns (segment, chunk record) of every finished chunk, and the optimizer
    steps (the mini-batches' and the step's last one)."""
    ran, optimizer_steps = [], 0
    it = itertools.chain(choices, itertools.cycle([0, 1, 2, 3, 2, 3]))
    for _ in range(100_000):
        if step.done:
            break
        if step.segment_done:
            if step.at_mini_batch_end:
                optimizer_steps += 1
            assert step.advance_segment()
            continue
        c, live = next(it), step.live()
        if c in (0, 1):
            side = P.PRIMARY if c == 0 else P.AUXILIARY
            if step.in_tail_window(d_p, d_a, tail_window=1):
                step.plan_tail(d_p, d_a, 0.0, 0.0, linear_time)
            if len(step.live(side)) < 2:
                step.pull(side, d_p if side == P.PRIMARY else d_a, side)
        elif c == 2:
            queued = [x for x in live if x.status == "queued"]
            if queued:
                step.started(queued[-1].chunk.chunk_id, 0.0)
        elif c == 3:
            running = [x for x in live if x.status == "running"]
            if running:
                ran.append((step.segment_index, running[-1]))
                step.finish(running[-1].chunk.chunk_id)
        if not step.live() and not step.has_work(P.PRIMARY) and not step.has_work(P.AUXILIARY) \
                and step.pending:
            step.release_plan()
    assert step.done, "the step finished"
    return ran, optimizer_steps + 1


@settings(max_examples=80, deadline=None)
@given(groups=st.integers(1, 8), size=st.integers(1, 4), data=st.data(), micro=st.integers(1, 3),
       budget=st.sampled_from([None, 40, 90]), grid=st.sampled_from([None, 1, 2]),
       d_p=st.integers(1, 3), d_a=st.integers(1, 2),
       choices=st.lists(st.integers(0, 3), max_size=200))
def test_every_sample_runs_once_no_chunk_spans_two_mini_batches_and_each_mini_batch_steps_once(
        groups, size, data, micro, budget, grid, d_p, d_a, choices):
    divisors = [k for k in range(1, groups + 1) if groups % k == 0]
    mini = data.draw(st.sampled_from(divisors + [None]), label="mini_batch_prompts")
    step = make_step(groups, size, mini, micro, budget, grid)
    ran, optimizer_steps = run_step(step, choices, d_p, d_a)
    n, m = groups * size, (mini or groups) * size
    for stage in STAGES:
        samples = sorted(u % n for _, rec in ran if rec.chunk.stage == stage for u in rec.units)
        assert samples == list(range(n)), f"every sample of {stage} is in exactly one chunk"
    for _, rec in ran:
        if rec.chunk.stage == "actor_update":
            first, last = rec.units[0] % n, rec.units[-1] % n
            assert first // m == last // m, "an update chunk stays inside one mini-batch"
            assert rec.chunk.samples == tuple(step.sample_refs[first:last + 1])
    assert optimizer_steps == n // m == (groups // mini if mini else 1), "one optimizer step per mini-batch"
    # the update chunks of a mini-batch are merged, in order, before any chunk of the next one runs
    update_segments = [seg for seg, rec in ran if rec.chunk.stage == "actor_update"]
    assert update_segments == sorted(update_segments)


def test_the_update_stage_becomes_one_segment_per_mini_batch_and_forward_stages_stay_whole():
    step = make_step(groups=4, size=2, mini_prompts=1)
    assert step.segments == [("old_logprob", "ref_logprob")] + [("actor_update",)] * 4
    assert step.sample_ranges == [(0, 8), (0, 2), (2, 4), (4, 6), (6, 8)]
    assert step.update_segments == 4 and step.aux_last_segment == 1
    whole = make_step(groups=4, size=2, mini_prompts=4)       # one mini-batch: the plain step
    assert whole.segments == [("old_logprob", "ref_logprob"), ("actor_update",)]
    assert whole.aux_last_segment == 1 and make_step(4, 2, None).sample_ranges == whole.sample_ranges


def test_a_token_budget_chunk_stops_at_the_mini_batch_end():
    # 2 mini-batches of 4 samples of 30 tokens (10 + 20); a budget of 300 tokens on one device would pack all 8
    step = make_step(groups=4, size=2, mini_prompts=2, budget=300, lengths=[20] * 8, stages=("actor_update",))
    first = step.pull(P.PRIMARY, 1, "p")
    assert first.units == (0, 1, 2, 3)
    assert step.pull(P.PRIMARY, 1, "p") is None            # the next mini-batch waits for the optimizer step
    step.started(first.chunk.chunk_id, 0.0)
    step.finish(first.chunk.chunk_id)
    assert step.at_mini_batch_end and step.advance_segment()
    assert step.pull(P.PRIMARY, 1, "p").units == (4, 5, 6, 7)


def _tiny(**overrides):
    return cfgmod.load("tiny-cpu").with_overrides(overrides)


class Recording(SimDriver):
    """The simulator, recording the chunk and optimizer commands it executes."""

    def __post_init__(self):
        super().__post_init__()
        self.commands = []

    def do_RunChunk(self, cmd):
        self.commands.append(cmd)
        super().do_RunChunk(cmd)

    def do_OptimizerStep(self, cmd):
        self.commands.append(cmd)
        super().do_OptimizerStep(cmd)

    def do_StartStep(self, cmd):
        self.commands.append(cmd)
        super().do_StartStep(cmd)


def _recorded(cfg, policy="bidirl", steps=2, seed=0):
    driver = Recording(cfg, policy, steps, seed)
    driver.run()
    return driver


@settings(max_examples=6, deadline=None)
@given(mini=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 3))
def test_the_simulator_takes_one_optimizer_step_per_mini_batch_between_its_chunks(mini, seed):
    cfg = _tiny(**{"rl.mini_batch_prompts": mini})
    driver = _recorded(cfg, seed=seed)
    per_step = cfg.workload.prompts_per_step // mini
    g = cfg.workload.group_size
    opts = [c for c in driver.commands if isinstance(c, P.OptimizerStep)]
    assert len(opts) == 2 * per_step
    for k in range(2):
        mine = [c for c in opts if c.step == k]
        assert [c.final for c in mine] == [False] * (per_step - 1) + [True]
        assert [c.version for c in mine] == [k] * (per_step - 1) + [k + 1], "one new version per step"
    # between two optimizer steps of a step, the update chunks are one mini-batch's, each inside it
    mini_batch, seen = {}, {}
    for c in driver.commands:
        if isinstance(c, P.OptimizerStep):
            mini_batch[c.step] = mini_batch.get(c.step, 0) + 1
        elif isinstance(c, P.RunChunk) and c.chunk.stage == "actor_update":
            k = mini_batch.get(c.chunk.step, 0)
            ids = {gid for gid, _ in c.chunk.samples}
            seen.setdefault((c.chunk.step, k), set()).update(ids)
    groups = {}
    for (step, k), ids in seen.items():
        assert len(ids) <= mini
        groups.setdefault(step, []).append(ids)
    for step, parts in groups.items():
        assert len(parts) == per_step and len(set().union(*parts)) == per_step * mini
        assert sum(len(c.chunk.samples) for c in driver.commands if isinstance(c, P.RunChunk)
                   and c.chunk.step == step and c.chunk.stage == "actor_update") >= per_step * mini * g


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 50), policy=st.sampled_from(["bidirl", "no-borrow"]))
def test_one_mini_batch_over_the_whole_batch_is_the_job_without_the_key(seed, policy):
    cfg = _tiny()
    same = _tiny(**{"rl.mini_batch_prompts": cfg.workload.prompts_per_step})
    assert (simulate(same, policy, steps=2, seed=seed).log.fingerprint()
            == simulate(cfg, policy, steps=2, seed=seed).log.fingerprint())


def test_mini_batches_lengthen_the_simulated_step_by_their_barriers_and_optimizer_steps():
    def trainer_busy(res):
        return sum(s.end - s.start for s in res.log.spans
                   if s.worker == P.PRIMARY_TRAINER and s.kind in ("chunk", "optimizer"))
    plain = simulate(_tiny(), "no-borrow", steps=2, seed=0)
    mini = simulate(_tiny(**{"rl.mini_batch_prompts": 1}), "no-borrow", steps=2, seed=0)
    assert len([s for s in mini.log.spans if s.kind == "optimizer"]) == 2 * _tiny().workload.prompts_per_step
    # smaller update chunks (a chunk never spans two mini-batches) and 16 optimizer updates per step, not 1
    assert trainer_busy(mini) > trainer_busy(plain)


def _aux_chunks(driver) -> list:
    """(local update, mini-batch, stage) of every chunk sent to the auxiliary trainer gang."""
    local, mini_batch, aux = None, 0, []
    for c in driver.commands:
        if isinstance(c, P.StartStep):
            local, mini_batch = c.local, 0
        elif isinstance(c, P.OptimizerStep):
            mini_batch += 1
        elif c.worker == P.AUX_TRAINER:
            aux.append((local, mini_batch, c.chunk.stage))
    return aux


class RecordingUnrefreshed(Recording):
    """A driver whose auxiliary gangs load weights at the switch in only (as engine runs' do)."""
    refreshes_aux_weights = False


@pytest.mark.parametrize("overrides", [{"rl.mini_batch_prompts": 16}, {"rl.updates_per_sync": 2, "rl.staleness": 0}])
def test_an_unrefreshed_auxiliary_gang_runs_only_what_computes_on_the_versions_weights(overrides):
    """A Trainer-on-RolloutPool window whose gang is never refreshed (``Driver.refreshes_aux_weights`` False) holds
    the version's weights: with mini-batches it runs the forward stages and the first mini-batch's update chunks, and
    in a streamed step (``rl.updates_per_sync``) only the first local update's chunks — later ones compute on weights
    an optimizer step changed. (Refreshed gangs work on: tests/test_aux_weight_refresh.py.)"""
    driver = RecordingUnrefreshed(cfgmod.load("a6000-default").with_overrides(overrides), "bidirl", 4, 0)
    driver.run()
    aux = _aux_chunks(driver)
    assert any(stage == "actor_update" for _, _, stage in aux), "the job borrows the rollout pool for its update"
    assert {(loc, mb) for loc, mb, _ in aux} == {(0, 0)}, sorted(set(aux))
    u = overrides.get("rl.updates_per_sync", 1)
    assert [c.local for c in driver.commands if isinstance(c, P.StartStep)] == list(range(u)) * 4


def test_a_restarted_gang_replays_a_step_one_optimizer_step_per_mini_batch():
    """The primary gang's recovery replays each step it lost as the run trained it: per mini-batch its update chunks
    (none across the mini-batch's end, each with its mini-batch's loss normaliser), then an optimizer step that keeps
    the version, the last one making it."""
    from types import SimpleNamespace

    import torch

    from bidirl.cluster.engines.step_data import StepData
    from bidirl.cluster.engines.trainer_recovery import TrainerRecovery
    from bidirl.cluster.engines.training import mini_batch_normalizers

    calls = []

    class Call:
        def __init__(self, rank, name):
            self.rank, self.name = rank, name

        def remote(self, *args, **kwargs):
            calls.append((self.rank, self.name, args, kwargs))
            return (self.rank, self.name)

    ranks = [SimpleNamespace(chunk_gradient=Call(r, "chunk"), apply_kept=Call(r, "apply")) for r in range(2)]
    cfg = _tiny(**{"rl.mini_batch_prompts": 4, "rl.micro_batch_per_device": 3})     # 16 prompts × 4: 4 of 16
    lens = [1 + k % 7 for k in range(64)]
    samples = [SimpleNamespace(response_len=n) for n in lens]
    minis = mini_batch_normalizers(samples, cfg)
    assert minis["mini_batch"] == 16 and minis["mini_normalizers"] == tuple(
        float(sum(lens[lo:lo + 16])) for lo in range(0, 64, 16))
    data = StepData(step=0, version=0, samples=samples, index={}, advantages=torch.zeros(64), normalizer=sum(lens),
                    old=[None] * 64, ref=[None] * 64, **minis)
    recovery = TrainerRecovery(SimpleNamespace(config=cfg), every=100)
    recovery.stepped(data, 1)
    _, version = recovery.restore_calls(ranks)
    assert version == 1
    applies = [c for c in calls if c[1] == "apply" and c[0] == 0]
    assert [c[3]["final"] for c in applies] == [False, False, False, True]
    chunks = [c for c in calls if c[1] == "chunk"]
    by_id, position = {}, {id(s): k for k, s in enumerate(samples)}
    for rank, _, args, _ in chunks:
        cid, share_samples, normalizer = args[0], args[1], args[5]
        ids = [position[id(s)] for s in share_samples]
        by_id.setdefault(cid, []).extend(ids)
        if ids:
            assert normalizer == minis["mini_normalizers"][ids[0] // 16]
    for cid, ids in by_id.items():
        assert len({k // 16 for k in ids}) == 1, "a replayed chunk stays inside one mini-batch"
    assert sorted(k for ids in by_id.values() for k in ids) == list(range(64))
    # each optimizer step names exactly its mini-batch's chunks
    for k, (_, _, args, _) in enumerate(applies):
        assert {j // 16 for cid in args[0] for j in by_id[cid]} == {k}


def test_a_restarted_gang_replays_a_streamed_steps_local_updates_keeping_the_version_until_the_last():
    """Streaming consumption (``rl.updates_per_sync``): a finished step's local updates are replayed in order, only
    the last making the step's version; the local updates the step under way had applied are replayed after the
    version is restored (and published), keeping it."""
    from types import SimpleNamespace

    import torch

    from bidirl.cluster.engines.step_data import StepData
    from bidirl.cluster.engines.trainer_recovery import TrainerRecovery

    calls = []

    class Call:
        def __init__(self, name):
            self.name = name

        def remote(self, *args, **kwargs):
            calls.append((self.name, args, kwargs))
            return self.name

    rank = SimpleNamespace(chunk_gradient=Call("chunk"), apply_kept=Call("apply"))
    cfg = _tiny(**{"rl.updates_per_sync": 2, "rl.micro_batch_per_device": 64})

    def local(step, k):
        samples = [SimpleNamespace(response_len=3) for _ in range(32)]
        return StepData(step=step, version=step, samples=samples, index={}, advantages=torch.zeros(32),
                        normalizer=96.0, old=[None] * 32, ref=[None] * 32, local=k)
    recovery = TrainerRecovery(SimpleNamespace(config=cfg), every=100)
    recovery.local_update(local(0, 0))
    recovery.stepped(local(0, 1), 1)
    recovery.local_update(local(1, 0))            # step 1's first local update was applied when the gang died
    restore, version = recovery.restore_calls([rank])
    assert version == 1 and recovery.summary()["steps_kept"] == 1
    assert [c[2]["final"] for c in calls if c[0] == "apply"] == [False, True]
    before = len(calls)
    recovery.partial_calls([rank])
    assert [c[2]["final"] for c in calls[before:] if c[0] == "apply"] == [False]
    assert sum(len(c[1][1]) for c in calls if c[0] == "chunk") == 3 * 32, "every sample of each local update once"
