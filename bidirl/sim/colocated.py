"""veRL's colocated (hybrid-engine) baseline: one time-shared pool, strictly on-policy (s = 0).

Every GPU generates the batch, then every GPU trains on it: rollout on ``G / ρ_r`` replicas until the last
response of the batch finishes (no partial rollout: the step is tied to its slowest response), a switch to
training (vLLM sleep + FSDP onload), stage-ordered training on ``G / ρ_t`` replicas, the optimizer step,
and a switch back with the weight update (FSDP offload + vLLM wake + in-place weight load).
The switch costs are the configured Rollouter-on-TrainerPool costs, the same state movement.

Rollout replicas have ``cluster.rollout_tensor_parallel`` GPUs when the job sets it (the planner's layout
otherwise). When the job sets any of veRL's trainer settings — a token budget per micro-batch, optimizer
mini-batches, sequence parallelism, parameter or optimizer offload — the trainer stages run as veRL's FSDP workers
run them (:mod:`bidirl.sim.verl_update`: data ranks of ``sequence_parallel`` GPUs, one optimizer step per
mini-batch, balanced token-budget micro-batches synchronised across ranks, offload copies around each stage);
otherwise as chunks of one micro-batch per device on the planner's trainer replicas.
"""

from __future__ import annotations

import math

import numpy as np

from bidirl.core import protocol as P
from bidirl.perf.predictor import StagePredictor
from bidirl.perf.replica import BatchingEngine, EngineGroup
from bidirl.perf.workload import GroupLengths
from bidirl.results.run_result import RunResult
from bidirl.results.trace import EventLog, Span, StepRecord
from bidirl.runtime.loop import EventLoop
from bidirl.sim.verl_update import VerlUpdate


def simulate_colocated(config, *, steps: int, seed: int, policy: str = "verl-colocated") -> RunResult:
    from bidirl.job.planner import plan as make_plan
    from bidirl.results import metrics

    cfg = config
    env = make_plan(cfg).envelope
    G = cfg.cluster.gpus
    rho_r = cfg.cluster.rollout_tensor_parallel or env.rollout_layout
    d_r, d_t = G // rho_r, G // env.trainer_layout
    models = StagePredictor.from_config(cfg, rho_r, env.trainer_layout, expert_parallel=env.trainer_expert_parallel)
    r_cfg = cfg.rl
    verl = (VerlUpdate.of(cfg, env.trainer_layout)
            if (r_cfg.max_tokens_per_micro_batch is not None or r_cfg.mini_batch_prompts is not None
                or r_cfg.sequence_parallel > 1 or r_cfg.param_offload or r_cfg.optimizer_offload
                or cfg.hardware_spec.controller_data_rate is not None) else None)
    lengths = GroupLengths.of(cfg, seed)
    loop, log, rng = EventLoop(), EventLog(), np.random.default_rng([seed, 1])
    w = cfg.workload
    costs = cfg.switch_costs(P.ROLLOUT_ON_TRAINER_POOL)
    jitter = lambda s: float(s * math.exp(rng.normal(0.0, 0.03))) if s > 0 else 0.0
    finished = []
    engines = [BatchingEngine(P.rollouter(P.ROLLOUT_POOL, i), models.engine_costs(), loop,
                         np.random.default_rng([seed, 3, i]),
                         lambda wk, st, el: finished.append(st),
                         lambda wk, kind, a, b, det: log.add_span(Span(wk, P.ROLLOUT_POOL, P.PRIMARY, kind, a, b,
                                                                       len(log.steps), len(log.steps), det)),
                         lambda *a: None) for i in range(d_r)]
    stages = cfg.rl.stages
    lane = P.AUX_TRAINER
    t = 0.0
    gid = 0
    for step in range(steps):
        start = t
        groups = []
        for k in range(w.prompts_per_step):
            groups.append(EngineGroup.from_task(P.GroupTask(gid), *lengths(gid), step))
            gid += 1
        for i, g in enumerate(groups):
            engines[i % d_r].add(g)
        loop.run()
        t = loop.now
        consume_start = t
        span = lambda kind, dur, det: log.add_span(Span(lane, P.ROLLOUT_POOL, P.AUXILIARY, kind, t, t + dur, step, step, det))
        dur = jitter(costs.c_out); span("switch_in", dur, {"direction": "colocated"}); t += dur
        p_all = np.concatenate([[g.prompt_len] * w.group_size for g in groups])
        r_all = np.concatenate([g.targets for g in groups])
        if verl is None:
            for stage in stages:
                size = models.trainer.chunk_size(cfg.rl.micro_batch_per_device, d_t)   # one micro-batch per device
                for a in range(0, len(r_all), size):
                    dur = jitter(models.chunk_time(stage, p_all[a:a + size], r_all[a:a + size], d_t))
                    span("chunk", dur, {"stage": stage, "chunk_id": -1, "samples": int(min(size, len(r_all) - a))})
                    t += dur
            dur = jitter(models.optimizer_time(G)); span("optimizer", dur, {}); t += dur
        else:
            at = lambda kind, a, dur, det: log.add_span(Span(lane, P.ROLLOUT_POOL, P.AUXILIARY, kind, a, a + dur, step,
                                                             step, det))
            t = _verl_stages(verl, stages, p_all, r_all, models.optimizer_update_time(G), at, jitter, t)
        dur = jitter(costs.c_in + cfg.weight_sync_time(rollout_layout=rho_r))   # the sync to the replicas of ρ_r
        span("switch_out", dur, {"direction": "colocated"}); t += dur
        tokens = int(p_all.sum() + r_all.sum())
        log.add_step(StepRecord(step=step, start=start, end=t, tokens=tokens, samples=len(r_all),
                                wait=consume_start - start, consume=t - consume_start, version=step + 1))
        loop.run(until=t)          # the engines idle while the pool trains
    n = len(finished) * w.group_size
    summary = metrics.summary(log, policy=policy, staleness=0.0, pool_gpus={P.ROLLOUT_POOL: G, P.TRAINER_POOL: 0},
                              gpus_per_worker={**{e.name: env.rollout_layout for e in engines}, lane: G},
                              samples={"generated": n, "consumed": n, "buffered": 0, "lost": 0, "duplicated": 0})
    summary["provenance"] = "simulated"
    return RunResult(policy, cfg, log, summary, "simulated", events_processed=loop.processed)


def _verl_stages(verl: VerlUpdate, stages, p_all, r_all, optimizer_seconds: float, span, jitter, t: float) -> float:
    """The trainer stages of one step as veRL's FSDP workers run them (:mod:`bidirl.sim.verl_update`): for each
    stage, the parameter shard loaded (offload), every micro-batch round of every pass (an optimizer update — the
    gradient all-reduce across replicas and AdamW, ``optimizer_seconds`` — after each mini-batch of the update, the
    Adam moments loaded once around the stage), the shard offloaded again (switch spans with direction
    ``offload``). The offload copies are these spans only, never also in ``optimizer_seconds``. Before all that, the
    driver's data path for the stage's call (a ``switch_in`` span with direction ``dispatch``; only when the preset
    has a ``controller_data_rate``). Returns the time the last span ends; ``span(kind, start, duration, detail)``
    logs one."""
    tokens = (p_all + r_all).astype(np.int64)
    for stage in stages:
        sent = verl.controller_time(stage)
        if sent > 0:
            dur = jitter(sent)
            span("switch_in", t, dur, {"stage": stage, "direction": "dispatch"})
            t += dur
        copies = verl.param_copy_time() + (verl.optimizer_copy_time() if stage == "actor_update" else 0.0)
        if copies > 0:
            dur = jitter(copies / 2)
            span("switch_in", t, dur, {"stage": stage, "direction": "offload"})
            t += dur
        for m, rounds in enumerate(verl.passes(stage, tokens)):
            for k, ranks in enumerate(rounds):
                dur = jitter(verl.round_time(stage, p_all, r_all, ranks))
                span("chunk", t, dur, {"stage": stage, "chunk_id": -1, "samples": int(sum(len(ix) for ix in ranks)),
                                    "mini_batch": m, "micro_batch": k})
                t += dur
            if stage == "actor_update":
                dur = jitter(optimizer_seconds)
                span("optimizer", t, dur, {"mini_batch": m})
                t += dur
        if copies > 0:
            dur = jitter(copies / 2)
            span("switch_out", t, dur, {"stage": stage, "direction": "offload"})
            t += dur
    return t
