"""The engine backend's trainer gangs: a step's data, its chunks, the merge of the windows and the optimizer step (§6).

* ``StartStep`` — the step's groups become its samples, GRPO advantages and loss normaliser (:class:`.StepData`);
* ``RunChunk`` — each rank of the gang takes ``per_device`` samples of the chunk: ``old_logprob`` / ``ref_logprob``
  recompute log-probs, ``actor_update`` computes the chunk's gradient, kept on the ranks (an auxiliary gang's until
  its window ends, :mod:`.gradient_windows`; without the weight transport an auxiliary gang hands each chunk's
  gradient back through the object store);
* ``MergeGradients`` — waits for windows in flight, or moves the object-store gradients to every primary rank;
* ``OptimizerStep`` — each primary rank sums every update chunk's gradient and window and takes one AdamW step; the
  new version is put out (published, or gathered on the object-store path) before the step counts. With optimizer
  mini-batches (``rl.mini_batch_prompts``) one comes per mini-batch, over its chunks: all but the last
  (``final``) keep the version and put nothing out — the rollouters get the weights once per step.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from bidirl.cluster.engines.step_data import StepData
from bidirl.cluster.pool import ClusterError
from bidirl.core import protocol as P

PRIMARY_TRAINER = P.PRIMARY_TRAINER


class EngineTraining:
    """The trainer gangs' work in one engine run (module doc). ``backend``: the
    :class:`~bidirl.cluster.engines.backend.EngineBackend`."""

    def __init__(self, backend):
        self.backend, self.pool = backend, backend.pool
        self.step_data: Optional[StepData] = None
        self.aux_grads: dict = {}         # chunk id -> object ref of an auxiliary chunk's gradient
        self.chunk_positions: dict = {}   # chunk id -> (first unit, units) of the step's update chunks (reproducible)
        self.locals: list = []            # a streamed step's local updates applied so far (StepData), in order

    def start_step(self, cmd: P.StartStep):
        """The step's samples, GRPO advantages (normalised per group) and loss normaliser, in batch order (again
        after a rollback: what an earlier attempt of the step left behind is dropped)."""
        d = self.pool
        from bidirl.rl import grpo
        from bidirl.rl.samples import samples_from_groups
        import torch

        self.aux_grads.clear()
        self.chunk_positions.clear()
        # a rolled-back step (or local update) starts over: what its lost attempt left on a living gang is dropped;
        # a streamed step's next local update (rl.updates_per_sync) is not a repeat: it has its own index
        held = self.step_data
        d.windows.new_attempt(again=held is not None and (held.step, held.local) == (cmd.step, cmd.local))
        if cmd.local == 0:
            self.locals = []
        samples = samples_from_groups(cmd.groups)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        self.step_data = StepData(
            step=cmd.step, version=cmd.version, samples=samples, local=cmd.local,
            index={(s.group_id, s.index): k for k, s in enumerate(samples)},
            advantages=grpo.group_advantages(rewards, group_size=d.config.workload.group_size).float(),
            normalizer=grpo.loss_normalizer([s.response_len for s in samples], "token-mean"),
            **mini_batch_normalizers(samples, d.config),
            # without an old_logprob stage the rollout's own log-probs are the behaviour policy's (veRL's bypass)
            old=([None] * len(samples) if "old_logprob" in d.config.rl.stages
                 else [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]),
            ref=[None] * len(samples))

    def run_chunk(self, cmd: P.RunChunk):
        d = self.pool
        from bidirl.cluster.engines.workers.trainer import rank_shares
        ch, gang = cmd.chunk, cmd.worker
        data = self.step_data
        idx = [data.index[(g, i)] for g, i in ch.samples]
        ranks = d.gangs[gang]
        shares = rank_shares(idx, ch.per_device, len(ranks))      # per_device samples on each rank (device)

        # a gang behind the chunk's version loads it first (an auxiliary gang restarted since it was switched in
        # holds the model folder's weights); calls on one actor run in order
        d._when_all(self.backend.loads.calls([gang], cmd.version),
                    lambda replies: self.backend.loads.record(replies, cmd.version, lane=gang))

        def finished(replies):
            starts = [sp["start"] for r in replies if r is not None for sp in r.spans]
            ends = [sp["end"] for r in replies if r is not None for sp in r.spans]
            d._chunk_done(cmd, self.backend.wall(min(starts)), self.backend.wall(max(ends)))

        from bidirl.cluster.engines.workers.trainer.replay import fed_tokens
        fed = fed_tokens([data.samples[k] for k in idx])
        if ch.stage in P.FORWARD_STAGES:
            model = "actor" if ch.stage == "old_logprob" else "reference"
            target = data.old if ch.stage == "old_logprob" else data.ref
            # every rank of the gang, a replica without samples too: the gang's ranks take the same turns of its
            # launch order (bidirl.cluster.engines.workers.launch_order), so each runs every gang call
            live = list(zip(ranks, shares))
            compare = d.config.rl.route_replay_compare and model == "actor"

            def done(replies):
                for (_, share), reply in zip(live, replies):
                    for k, lp in zip(share, reply.value):
                        target[k] = lp
                    for k, gap in zip(share, reply.spans[0]["detail"].get("gap_without_replay", ())):
                        data.gaps_without_replay[k] = gap
                d.route_tally.chunk(ch.stage, sum(r.spans[0]["detail"].get("replayed_tokens", 0)
                                                  for r in replies), fed)
                finished(replies)
            d._when_all([(gang, r.logprobs.remote([data.samples[k] for k in s], model, compare))
                         for r, s in live], done)
            return

        primary = gang == PRIMARY_TRAINER
        # an auxiliary gang keeps its window's gradient on its devices with the transport (GradientWindows), or
        # hands each chunk's gradient back through the object store without it
        keep = primary or d.sync.collective
        # the reproducible mode sums the step's gradient in unit order, whichever gang computed each chunk: each
        # optimizer update's gradient, from its mini-batch's first unit
        first = ch.order % data.mini_batch if data.mini_batch else ch.order
        position = (first, len(ch.samples)) if d.assembly.reproducible else None
        if position is not None:
            self.chunk_positions[ch.chunk_id] = position
        if not primary and keep:
            d.windows.hold(ch.chunk_id, position)
        refs, grad_ref = [], None
        for rank, (r, s) in enumerate(zip(ranks, shares)):
            reply_ref, flat_ref = r.chunk_gradient.remote(
                ch.chunk_id, *data.chunk_inputs(s, d.config.rl.kl_coef > 0), keep=keep, give=not keep and rank == 0,
                position=position if keep else None)
            refs.append((gang, reply_ref))
            if not keep and rank == 0:
                grad_ref = flat_ref

        def done(replies):
            data.stats += [r.value for r in replies if r.value.get("samples")]
            d.route_tally.chunk(ch.stage, sum(r.value.get("replayed_tokens", 0) for r in replies), fed)
            if grad_ref is not None:
                self.aux_grads[ch.chunk_id] = grad_ref
            finished(replies)
        d._when_all(refs, done)

    def merge_gradients(self, cmd: P.MergeGradients):
        d = self.pool
        if d.sync.collective:             # the windows were handed over when they ended (GradientWindows)
            d.windows.after_windows(
                lambda: d.feed(P.GradientsMerged(d.now(), cmd.step, d.windows.seconds)))
            return
        start = d.now()
        ranks = d.gangs[PRIMARY_TRAINER]
        grads = [(cid, self.aux_grads.pop(cid)) for cid in cmd.chunk_ids]
        calls = [(PRIMARY_TRAINER, r.receive_gradient.remote(cid, grad)) for cid, grad in grads for r in ranks]

        def done(replies):
            end = d.now()
            d._measure((P.TRAINER_ON_ROLLOUT_POOL, "c_grad"), end - start)
            d.record_merge(cmd, start, end)
            d.feed(P.GradientsMerged(end, cmd.step, end - start))
        d._when_all(calls, done)

    def optimizer_step(self, cmd: P.OptimizerStep):
        """Each primary rank's optimizer update over ``cmd.merge_order``. It makes the next version only when the
        scheduler asks for one (``cmd.version`` past the step's): an optimizer mini-batch's update and a streamed
        step's local update before its last keep it (the weights sync once per step)."""
        d = self.pool
        ranks = d.gangs[PRIMARY_TRAINER]
        data = self.step_data
        new_version = cmd.version != data.version

        def done(replies):
            out = replies[0].value
            if out["version"] != cmd.version:
                raise ClusterError(f"the primary trainer produced version {out['version']}, the scheduler expected "
                                   f"{cmd.version}; a rank missed an update")
            sp = replies[0].spans[0]
            d.record_optimizer(cmd, self.backend.wall(sp["start"]), self.backend.wall(sp["end"]))
            if not new_version:
                # an optimizer mini-batch's update, or a streamed step's local update before its last: the weights
                # changed, the version did not; the windows it added are spent, and the next chunks run on these
                # weights. A finished local update is kept for the step's metrics and for a restarted gang's replay
                d.windows.applied()
                if cmd.final:
                    self.locals.append(data)
                    d.recovery.local_update(data)
                else:
                    data.earlier_updates += 1
                d.feed(P.OptimizerStepped(d.now(), cmd.step, cmd.version))
                return
            acks, weights = self.backend.loads.version_calls()

            def kept(_acks):
                # the step counts once the version is out (published, or gathered on the object-store path) and
                # the driver holds what a restarted gang replays it from; a gang that dies before this point
                # rolls the step back
                self.backend.loads.keep_version(cmd.version, weights)
                d.recovery.stepped(data, cmd.version)
                d.step_stats.append(self.step_stats_row(whole_step(self.locals + [data]), out))
                self.locals = []
                d.feed(P.OptimizerStepped(d.now(), cmd.step, cmd.version))
            d._when_all([(PRIMARY_TRAINER, a) for a in acks], kept)
        positions = ({c: self.chunk_positions[c] for c in cmd.merge_order if c in self.chunk_positions}
                     if d.assembly.reproducible else None)
        d._when_all([(PRIMARY_TRAINER, r.apply_kept.remote(list(cmd.merge_order), d.windows.windows_for(i),
                                                           positions, new_version))
                     for i, r in enumerate(ranks)], done)

    def step_stats_row(self, data: StepData, update: dict) -> dict:
        """Per-step learning metrics (veRL names where the meaning is the same)."""
        import torch
        from bidirl.rl.grpo import token_weighted
        samples = data.samples
        rewards = [s.reward for s in samples]
        response_lens = [s.response_len for s in samples]
        prompt_lens = [len(s.prompt_ids) for s in samples]
        # vLLM's log-probs of sampled tokens against the trainer's recomputation (old_logprob) for responses
        # generated entirely by the weights the trainer held: the weight sync's correctness check (none in bypass,
        # where the old log-probs are vLLM's own)
        recomputed = "old_logprob" in self.pool.config.rl.stages
        # (a streamed step's later local updates recompute on weights its earlier ones moved: only the first's are
        # checked, ``sync_checked``)
        checked = len(samples) if data.sync_checked is None else data.sync_checked
        gaps = [float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples[:checked], data.old)
                if recomputed and s.version == data.version and s.response_len]
        # the same samples' gap with the trainer routing by itself (rl.route_replay_compare; R3 on)
        plain = [g for k, g in data.gaps_without_replay.items()
                 if samples[k].version == data.version and samples[k].response_len]
        max_len = self.pool.config.workload.max_response_len
        row = {"step": data.step, "version": update["version"],
                "reward": float(np.mean(rewards)), "reward_max": float(np.max(rewards)),
                "reward_min": float(np.min(rewards)),
                "response_length": float(np.mean(response_lens)), "response_length_max": int(np.max(response_lens)),
                "response_length_min": int(np.min(response_lens)),
                "response_clip_ratio": float(np.mean([n >= max_len for n in response_lens])),
                "prompt_length": float(np.mean(prompt_lens)), "prompt_length_max": int(np.max(prompt_lens)),
                "prompt_length_min": int(np.min(prompt_lens)),
                "loss": float(sum(s["loss"] for s in data.stats)),
                "pg_loss": float(sum(s["pg_loss"] for s in data.stats)), "kl": token_weighted(data.stats, "kl"),
                "clip_frac": token_weighted(data.stats, "clip_frac"), "grad_norm": float(update["grad_norm"]),
                "on_policy_samples": len(gaps), "logprob_diff_max": max(gaps) if gaps else None}
        if self.pool.config.rl.max_tokens_per_micro_batch is not None:   # the update's passes over every rank
            row["micro_batch_passes"] = int(sum(s.get("passes", 0) for s in data.stats))
        if data.mini_batch or data.local:                     # optimizer updates: per mini-batch and local update
            row["optimizer_updates"] = data.optimizer_updates
        if self.pool.config.rl.route_replay_compare:          # R3's comparison ran (MoE): the gap without it
            row["logprob_diff_max_no_r3"] = max(plain) if plain else None
        return row


def mini_batch_normalizers(samples: list, config) -> dict:
    """``StepData``'s optimizer mini-batches for ``samples`` (a step's, batch order): ``rl.mini_batch_prompts`` ×
    group size samples each and each one's token-mean loss normaliser; nothing without the key (one update)."""
    from bidirl.rl import grpo
    prompts = config.rl.mini_batch_prompts
    m = prompts * config.workload.group_size if prompts else 0
    if not m or m >= len(samples):
        return {}
    return {"mini_batch": m,
            "mini_normalizers": tuple(grpo.loss_normalizer([s.response_len for s in samples[lo:hi]], "token-mean")
                                      for lo, hi in P.mini_batch_bounds(len(samples), m))}


def whole_step(parts: list) -> StepData:
    """A step's data from its local updates' (one without streaming consumption), for the step's metrics row:
    their samples, log-probs and loss statistics in order; ``optimizer_updates`` counts every update they took; the
    weight sync is checked on the first local update's samples only (``sync_checked``: the later ones' old
    log-probs are recomputed on weights the earlier updates moved)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    out = StepData(step=last.step, version=last.version, samples=[s for p in parts for s in p.samples], index={},
                   advantages=None, normalizer=0.0, old=[x for p in parts for x in p.old],
                   ref=[x for p in parts for x in p.ref], stats=[x for p in parts for x in p.stats],
                   local=last.local, earlier_updates=sum(p.optimizer_updates for p in parts) - 1,
                   sync_checked=len(parts[0].samples))
    offset = 0
    for p in parts:
        out.gaps_without_replay.update({offset + k: g for k, g in p.gaps_without_replay.items()})
        offset += len(p.samples)
    return out
