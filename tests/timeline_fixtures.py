"""Hand-written Ray timelines of today's veRL, with the per-GPU truth of each (the schedule below, not the importer).

Every event name is a method of veRL's source at commit :data:`VERL_COMMIT` (Jan 2026), cited file:line in the
event's ``args.source``; ``args.gpus`` lists the physical GPUs the call keeps busy (``[]`` for CPU actors and
control calls) — the truth the tests compare the importer's GPU-weighted idle with, computed by
:func:`gpu_idle_truth` from these lists alone. ``python -m tests.timeline_fixtures`` rewrites the JSON files in
``data/traces/``; a test checks the committed files equal what this module builds.

* **verl-colocated-async** — ``RayPPOTrainer`` with the hybrid engine and async rollout (agent loop): 4 GPUs, a
  ``WorkerDict`` per GPU (actor, rollout, ref roles) and a ``vLLMHttpServer`` actor per replica (TP 1) on the same
  GPU; per step the servers generate, sleep, the workers compute log-probs and update, then ``update_weights``
  wakes the engines with the new weights. One replica holds the longest responses each step (the long tail).
* **verl-fully-async** — ``verl/experimental/fully_async_policy``: 4 rollout GPUs (a ``vLLMHttpServerForPartial``
  per GPU, the rollout ``WorkerDict`` beside it) and 2 trainer GPUs; the trainer's steps, the weight sync by
  checkpoint between them, generation never stopping except for the sync.
* **verl-one-step-off** — ``verl/experimental/one_step_off_policy`` (veRL's V1 async trainer): 4 rollout GPUs (a
  ``vLLMHttpServer`` per GPU, TP 1, the rollout ``WorkerDict`` beside it) and 2 trainer GPUs (actor and ref roles in
  one ``WorkerDict`` per GPU); each step waits for the batch launched the step before, syncs the weights over NCCL
  (``sync_rollout_weights`` on both pools), launches the next batch and trains on the current one, one step behind.
* **areal** — AReaL at :data:`AREAL_COMMIT`: not a Ray timeline but AReaL's own perf trace (``perf_tracer``'s
  per-rank JSON lines merged by ``python -m areal.tools.perf_trace_converter``: Chrome trace JSON, a process per
  rank and role, each rank's times from its tracer's start). Two actor ranks (GPUs 0–1) run the ``rpc.<method>``
  calls the controller sends (recompute log-probs, advantages, PPO update, weight update), the engine's own spans
  nested inside; the controller (``master``) records its ``train.*`` view of each stage, the rollout workers their
  client calls (``rpc.submit`` …). The inference servers' generation is in no AReaL trace, so no GPU of the rollout
  is here: the truth is the trainer ranks'.
* **openrlhf**, **openrlhf-colocated** — OpenRLHF at :data:`OPENRLHF_COMMIT`, its default placement and
  ``--colocate_all_models`` (engines and models on the same GPUs, ``offload_states`` / ``reload_states`` between).
"""

from __future__ import annotations

import json
from pathlib import Path

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
#: OpenRLHF's commit the OpenRLHF fixtures' names are cited at (Aug 2026)
OPENRLHF_COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
FA = "verl/experimental/fully_async_policy"
W = "verl/workers/fsdp_workers.py"
SERVER = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
#: Ray's epoch microseconds of the fixtures' time 0
T0_US = 1_790_000_000_000_000
ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "data" / "traces"

#: name -> file:line at VERL_COMMIT
SOURCES = {
    "vLLMHttpServer.generate": f"{SERVER}:445",
    "vLLMHttpServer.wake_up": f"{SERVER}:549",
    "vLLMHttpServer.sleep": f"{SERVER}:563",
    "WorkerDict.actor_rollout_init_model": f"{W}:759",
    "WorkerDict.actor_rollout_compute_log_prob": f"{W}:989",
    "WorkerDict.ref_compute_ref_log_prob": f"{W}:1041",
    "WorkerDict.actor_rollout_update_actor": f"{W}:893",
    "WorkerDict.actor_rollout_update_weights": f"{W}:1987",
    "WorkerDict.actor_rollout_save_checkpoint": f"{W}:1074",
    "WorkerDict.critic_compute_values": f"{W}:1540",
    "WorkerDict.critic_update_critic": f"{W}:1560",
    "WorkerDict.rm_compute_rm_score": f"{W}:1928",
    "AgentLoopWorker.generate_sequences": "verl/experimental/agent_loop/agent_loop.py:406",
    "TaskRunner.run": "verl/trainer/main_ppo.py:261",
    # fully async
    "vLLMHttpServerForPartial.generate_for_partial": f"{FA}/vllm_rollout/vllm_async_server.py:78",
    "vLLMHttpServerForPartial.cancel": f"{FA}/vllm_rollout/vllm_async_server.py:119",
    "vLLMHttpServerForPartial.resume": f"{FA}/vllm_rollout/vllm_async_server.py:125",
    "FullyAsyncAgentLoopWorker.generate_sequences_no_post": f"{FA}/agent_loop/agent_loop.py:88",
    "WorkerDict.rollout_init_model": f"{W}:759",
    "WorkerDict.rollout_set_actor_weights_info": f"{FA}/fsdp_workers.py:245",
    "WorkerDict.actor_init_model": f"{W}:759",
    "WorkerDict.actor_get_actor_weights_info": f"{FA}/fsdp_workers.py:202",
    "WorkerDict.actor_compute_log_prob": f"{W}:989",
    "WorkerDict.actor_update_actor": f"{W}:893",
    "WorkerDict.actor_compute_ref_log_prob": f"{W}:1041",
    "WorkerDict.critic_save_checkpoint": f"{W}:1592",
    "WorkerDict.actor_sync_rollout_weights_by_checkpoint": f"{FA}/fsdp_workers.py:123",
    "WorkerDict.rollout_sync_rollout_weights_by_checkpoint": f"{FA}/fsdp_workers.py:123",
    "WorkerDict.actor_sync_rollout_weights": f"{FA}/fsdp_workers.py:56",
    "WorkerDict.rollout_sync_rollout_weights": f"{FA}/fsdp_workers.py:56",
    "WorkerDict.actor_save_model_to_cpu": f"{FA}/fsdp_workers.py:222",
    "WorkerDict.actor_restore_model_from_cpu": f"{FA}/fsdp_workers.py:228",
    "WorkerDict.actor_clear_cpu_model": f"{FA}/fsdp_workers.py:234",
    "ParameterSynchronizer.sync_weights": f"{FA}/param_sync.py:117",
    "FullyAsyncTrainer.fit": f"{FA}/fully_async_trainer.py:287",
    "FullyAsyncRollouter.fit": f"{FA}/fully_async_rollouter.py:652",
    "MessageQueue.put_sample": f"{FA}/message_queue.py:67",
    "FullyAsyncTaskRunner.run": f"{FA}/fully_async_main.py:142",
}
OSO = "verl/experimental/one_step_off_policy"
#: veRL one-step-off name -> file:line at VERL_COMMIT (its WorkerDict roles are `actor`, `rollout`, `ref`: Role's
#: strings, verl/trainer/ppo/utils.py:44; bound as `<role>_<method>`, verl/single_controller/ray/base.py:891)
ONE_STEP_OFF_SOURCES = {
    "OneStepTaskRunner.run": f"{OSO}/main_ppo.py:135",
    "WorkerDict.actor_init_model": f"{W}:759", "WorkerDict.rollout_init_model": f"{W}:759",
    "WorkerDict.ref_init_model": f"{W}:759",
    "WorkerDict.actor_get_actor_weights_info": f"{OSO}/fsdp_workers.py:144",
    "WorkerDict.rollout_set_actor_weights_info": f"{OSO}/fsdp_workers.py:170",
    "WorkerDict.actor_create_weight_sync_group": f"{OSO}/fsdp_workers.py:57",
    "WorkerDict.rollout_create_weight_sync_group": f"{OSO}/fsdp_workers.py:57",
    "WorkerDict.actor_sync_rollout_weights": f"{OSO}/fsdp_workers.py:68",
    "WorkerDict.rollout_sync_rollout_weights": f"{OSO}/fsdp_workers.py:68",
    "vLLMHttpServer.generate": f"{SERVER}:445", "vLLMHttpServer.clear_kv_cache": f"{SERVER}:595",
    "AgentLoopWorker.generate_sequences": "verl/experimental/agent_loop/agent_loop.py:406",
    "WorkerDict.actor_compute_log_prob": f"{W}:989", "WorkerDict.ref_compute_ref_log_prob": f"{W}:1041",
    "WorkerDict.actor_update_actor": f"{W}:893", "WorkerDict.actor_save_checkpoint": f"{W}:1074",
}
#: AReaL's commit the AReaL fixture's names are cited at
AREAL_COMMIT = "4aef98d8d"
_RT, _TC, _PA, _FE, _RC = ("areal/trainer/rl_trainer.py", "areal/infra/controller/train_controller.py",
                           "areal/trainer/ppo/actor.py", "areal/engine/fsdp_engine.py",
                           "areal/infra/controller/rollout_controller.py")
#: AReaL name -> file:line at AREAL_COMMIT. ``rpc.<method>``: the span areal/infra/rpc/guard/engine_blueprint.py:533
#: records around every engine call on a worker, cited at the line naming the method the controller sends
AREAL_SOURCES = {
    "train.rollout": f"{_RT}:565", "train.recompute_logp": f"{_RT}:647", "train.compute_advantage": f"{_RT}:660",
    "train.ppo_update": f"{_RT}:680", "train.update_weights": f"{_RT}:725", "train.clear_batches": f"{_RT}:791",
    "train.log_stats": f"{_RT}:813",
    "rpc.compute_logp": f"{_PA}:371", "rpc.compute_advantages": f"{_PA}:376", "rpc.ppo_update": f"{_PA}:381",
    "rpc.step_lr_scheduler": f"{_TC}:710", "rpc.update_weights": f"{_TC}:714", "rpc.set_version": f"{_TC}:671",
    "rpc.get_device_stats": f"{_TC}:725", "rpc.clear_batches": f"{_TC}:839",
    "ppo_actor.compute_logp": f"{_PA}:129", "ppo_actor.compute_advantages": f"{_PA}:141",
    "ppo_actor.ppo_update": f"{_PA}:251", "fsdp_engine.forward": f"{_FE}:745", "fsdp_engine.backward": f"{_FE}:757",
    "fsdp_engine.step": f"{_FE}:700", "fsdp_engine.update_weights_from_distributed": f"{_FE}:1506",
    "rpc.submit": f"{_RC}:801", "rpc.wait_for_task": f"{_RC}:823", "rpc.pause_generation": f"{_RC}:1038",
    "remote_inf_engine.pause_generation": "areal/infra/remote_inf_engine.py:1204",
}
#: AReaL's tracer times: µs since the tracer was configured (perf_tracer.py, PerfTracer._relative_us); the
#: fixture's time 0 is this far in
AREAL_T0_US = 5_000_000
_E, _A, _L, _C = ("openrlhf/trainer/ray/vllm_engine.py", "openrlhf/trainer/ray/ppo_actor.py",
                  "openrlhf/trainer/ray/launcher.py", "openrlhf/trainer/ray/ppo_critic.py")
#: OpenRLHF name -> file:line at OPENRLHF_COMMIT
OPENRLHF_SOURCES = {
    "RolloutRayActor.generate_responses": f"{_E}:185", "RolloutRayActor.generate": f"{_E}:155",
    "RolloutRayActor.update_weight": f"{_E}:117", "RolloutRayActor.update_weight_cuda_ipc": f"{_E}:123",
    "RolloutRayActor.sleep": f"{_E}:138", "RolloutRayActor.wake_up": f"{_E}:141",
    "RolloutRayActor.init_process_group": f"{_E}:109", "RolloutRayActor.reset_prefix_cache": f"{_E}:129",
    "PolicyModelActor.init_model_from_pretrained": f"{_A}:494", "PolicyModelActor.forward": f"{_A}:617",
    "PolicyModelActor.append": f"{_A}:651", "PolicyModelActor.fit": f"{_A}:597",
    "PolicyModelActor.broadcast_to_vllm": f"{_A}:645", "PolicyModelActor.reload_states": f"{_A}:654",
    "PolicyModelActor.offload_states": f"{_A}:657", "PolicyModelActor.save_checkpoint": f"{_A}:660",
    "ReferenceModelActor.forward": f"{_L}:127", "RewardModelActor.forward": f"{_L}:183",
    "CriticModelActor.forward": f"{_C}:260", "CriticModelActor.fit": f"{_C}:284",
    "CriticModelActor.append": f"{_C}:280", "CriticModelActor.reload_states": f"{_C}:320",
    "CriticModelActor.offload_states": f"{_C}:323",
}


class Trace:
    """Events of one hand-written timeline: ``call(worker, name, start_s, end_s, gpus)``."""

    def __init__(self, node: str = "10.0.0.1", sources: dict = SOURCES, commit: str = VERL_COMMIT):
        self.node, self.events, self.sources, self.commit = node, [], sources, commit

    def call(self, worker: str, name: str, start: float, end: float, gpus=()) -> None:
        cls, method = name.split(".", 1)
        self.events.append({"cat": f"task::{name}", "name": method, "pid": self.node, "tid": f"worker:{worker}",
                            "ts": T0_US + round(start * 1e6), "dur": round((end - start) * 1e6), "ph": "X",
                            "args": {"func_or_class_name": name, "source": f"{self.sources[name]}@{self.commit[:7]}",
                                     "gpus": list(gpus)}})

    def document(self, what: str, steps: list, gpus: int) -> dict:
        return {"traceEvents": sorted(self.events, key=lambda e: (e["ts"], e["tid"])),
                "otherData": {"what": what, "commit": self.commit, "gpus": gpus, "steps_s": steps}}


def colocated_async() -> dict:
    """veRL's colocated trainer in async-rollout mode (module doc); times in seconds."""
    t = Trace()
    t.call("driver", "TaskRunner.run", -12.0, 80.0)
    for g in range(4):
        t.call(f"w{g}", "WorkerDict.actor_rollout_init_model", -11.0, -2.0, [g])
        t.call(f"s{g}", "vLLMHttpServer.wake_up", 0.0, 1.0, [g])
    # (generation requests per replica, the step's long-tail replica last)
    steps = [({0: [(1, 7), (1.5, 10)], 1: [(1, 8)], 2: [(1, 13)], 3: [(1, 6), (2, 9)]}, 13.0),
             ({0: [(28, 35)], 1: [(28, 33), (29, 36)], 2: [(28, 31)], 3: [(28, 40)]}, 40.0),
             ({0: [(55.5, 62)], 1: [(55.5, 60)], 2: [(55.5, 65)], 3: [(55.5, 61)]}, 65.0)]
    bounds, start = [], 0.0
    for k, (requests, gen_end) in enumerate(steps):
        gen_start = min(a for rs in requests.values() for a, _ in rs)
        for agent in range(2):
            t.call(f"agent{agent}", "AgentLoopWorker.generate_sequences", gen_start, gen_end)
        for g, rs in requests.items():
            for a, b in rs:
                t.call(f"s{g}", "vLLMHttpServer.generate", a, b, [g])
            t.call(f"s{g}", "vLLMHttpServer.sleep", gen_end, gen_end + 0.5, [g])
        # the reward model's 0.5 s, then 0.5 s of the driver's advantage work (no span)
        c = gen_end + 1.5
        for g in range(4):
            # PPO with a reward model and a critic, all roles in each GPU's WorkerDict
            t.call(f"w{g}", "WorkerDict.rm_compute_rm_score", c - 1.0, c - 0.5, [g])
            t.call(f"w{g}", "WorkerDict.actor_rollout_compute_log_prob", c, c + 1.5, [g])
            t.call(f"w{g}", "WorkerDict.critic_compute_values", c + 1.5, c + 2.5, [g])
            t.call(f"w{g}", "WorkerDict.ref_compute_ref_log_prob", c + 2.5, c + 4.5, [g])
            t.call(f"w{g}", "WorkerDict.critic_update_critic", c + 4.5, c + 6.5, [g])
            t.call(f"w{g}", "WorkerDict.actor_rollout_update_actor", c + 6.5, c + 12.5, [g])
            if k < len(steps) - 1:
                t.call(f"w{g}", "WorkerDict.actor_rollout_update_weights", c + 12.5, c + 14.5, [g])
        bounds.append([start, c + 12.5])
        start = c + 12.5
    for g in range(4):
        t.call(f"w{g}", "WorkerDict.actor_rollout_save_checkpoint", 79.0, 80.0, [g])
    return t.document("veRL RayPPOTrainer, hybrid engine, async rollout (agent loop), 4 GPUs, TP 1", bounds, 4)


def fully_async() -> dict:
    """veRL's fully-async trainer (module doc); rollout GPUs 0–3, trainer GPUs 4–5."""
    t = Trace()
    t.call("driver", "FullyAsyncTaskRunner.run", -12.0, 40.0)
    t.call("trainer-ctl", "FullyAsyncTrainer.fit", -1.0, 40.0)
    t.call("rollouter-ctl", "FullyAsyncRollouter.fit", -1.0, 40.0)
    for g in range(4):
        t.call(f"r{g}", "WorkerDict.rollout_init_model", -11.0, -3.0, [g])
        t.call(f"r{g}", "WorkerDict.rollout_set_actor_weights_info", -2.5, -2.0, [g])
    for g in (4, 5):
        t.call(f"t{g}", "WorkerDict.actor_init_model", -11.0, -3.0, [g])
        t.call(f"t{g}", "WorkerDict.actor_get_actor_weights_info", -2.8, -2.5, [g])
    # generation: (replica, start, end) requests; the servers pause only for the syncs at 16 and 24
    requests = [(0, 0, 4), (0, 1, 6), (0, 2, 8), (1, 0, 5), (1, 3, 9.5), (2, 0, 7), (3, 0.5, 3),
                (0, 10, 15), (1, 11, 14), (2, 9, 15.5), (3, 4, 12),
                (0, 17.2, 22), (1, 17.3, 20), (2, 18, 23.5), (3, 17.5, 19),
                (0, 25.1, 30), (1, 25.1, 26), (2, 25.5, 29), (3, 26, 31)]
    for g, a, b in requests:
        t.call(f"s{g}", "vLLMHttpServerForPartial.generate_for_partial", a, b, [g])
    for agent in range(2):
        t.call(f"agent{agent}", "FullyAsyncAgentLoopWorker.generate_sequences_no_post", 0.0, 31.0)
    for k, when in enumerate((3.0, 8.0, 20.0, 29.0)):
        t.call("mq", "MessageQueue.put_sample", when, when + 0.01)
    # trainer steps: (log-prob start, update start, update end)
    steps = [(10.0, 12.0, 16.0), (18.0, 20.0, 24.0), (26.0, 27.5, 31.0)]
    bounds, start = [], 0.0
    for k, (lp, up, end) in enumerate(steps):
        for g in (4, 5):
            t.call(f"t{g}", "WorkerDict.actor_compute_log_prob", lp, up - 0.8, [g])
            t.call(f"t{g}", "WorkerDict.actor_compute_ref_log_prob", up - 0.8, up - 0.3, [g])
            t.call(f"t{g}", "WorkerDict.critic_compute_values", up - 0.3, up, [g])
            t.call(f"t{g}", "WorkerDict.critic_update_critic", up, up + 1.0, [g])
            t.call(f"t{g}", "WorkerDict.actor_update_actor", up + 1.0, end, [g])
        bounds.append([start, end])
        start = end
        if k == len(steps) - 1:
            break
        # the weight sync by checkpoint: servers paused, trainer sends, rollout workers load
        t.call("ps", "ParameterSynchronizer.sync_weights", end, end + 1.3)
        for g in range(4):
            t.call(f"s{g}", "vLLMHttpServerForPartial.cancel", end, end + 0.05)
            t.call(f"r{g}", "WorkerDict.rollout_sync_rollout_weights_by_checkpoint", end + 0.2, end + 1.2, [g])
            t.call(f"s{g}", "vLLMHttpServerForPartial.resume", end + 1.2, end + 1.25)
        for g in (4, 5):
            t.call(f"t{g}", "WorkerDict.actor_sync_rollout_weights_by_checkpoint", end, end + 1.0, [g])
            if k == 0:          # the first sync keeps a copy of the model in host memory (validation)
                t.call(f"t{g}", "WorkerDict.actor_save_model_to_cpu", end + 1.0, end + 1.4, [g])
                t.call(f"t{g}", "WorkerDict.actor_restore_model_from_cpu", end + 1.4, end + 1.6, [g])
                t.call(f"t{g}", "WorkerDict.actor_clear_cpu_model", end + 1.6, end + 1.7, [g])
    # an NCCL weight sync (the path for SGLang replicas) after the last step, outside the measured steps
    for g in range(4):
        t.call(f"r{g}", "WorkerDict.rollout_sync_rollout_weights", 32.0, 33.0, [g])
    for g in (4, 5):
        t.call(f"t{g}", "WorkerDict.actor_sync_rollout_weights", 32.0, 33.0, [g])
        t.call(f"t{g}", "WorkerDict.critic_save_checkpoint", 34.0, 35.0, [g])
    return t.document("veRL fully-async trainer, 4 rollout GPUs (TP 1) + 2 trainer GPUs", bounds, 6)


def one_step_off() -> dict:
    """veRL's one-step-off trainer (module doc; OneStepOffRayTrainer.fit, OSO/ray_trainer.py:412): rollout GPUs 0–3,
    trainer GPUs 4–5. Batch k+1 is generated while the trainer trains on batch k."""
    t = Trace(sources=ONE_STEP_OFF_SOURCES)
    t.call("driver", "OneStepTaskRunner.run", -12.0, 40.0)
    for g in range(4):
        t.call(f"r{g}", "WorkerDict.rollout_init_model", -11.0, -3.0, [g])
        t.call(f"r{g}", "WorkerDict.rollout_set_actor_weights_info", -2.5, -2.4, [g])
        t.call(f"r{g}", "WorkerDict.rollout_create_weight_sync_group", -2.3, -2.0, [g])
    for g in (4, 5):
        t.call(f"t{g}", "WorkerDict.ref_init_model", -11.0, -7.0, [g])
        t.call(f"t{g}", "WorkerDict.actor_init_model", -7.0, -3.0, [g])
        t.call(f"t{g}", "WorkerDict.actor_get_actor_weights_info", -2.8, -2.6, [g])
        t.call(f"t{g}", "WorkerDict.actor_create_weight_sync_group", -2.3, -2.0, [g])

    def generate(requests, a, b):
        for agent in range(2):
            t.call(f"agent{agent}", "AgentLoopWorker.generate_sequences", a, b)
        for g, x, y in requests:
            t.call(f"s{g}", "vLLMHttpServer.generate", x, y, [g])

    def sync(at):
        # the NCCL broadcast from the trainer ranks to the rollout workers (OSO/ray_trainer.py:303), then the
        # servers drop their KV cache (a control call: no GPU work to speak of)
        for g in (4, 5):
            t.call(f"t{g}", "WorkerDict.actor_sync_rollout_weights", at, at + 1.0, [g])
        for g in range(4):
            t.call(f"r{g}", "WorkerDict.rollout_sync_rollout_weights", at, at + 1.0, [g])
            t.call(f"s{g}", "vLLMHttpServer.clear_kv_cache", at + 1.0, at + 1.05)

    # batch 0 before the loop; in step k the trainer waits for batch k, syncs, launches batch k+1, trains on batch k
    generate([(0, 0.0, 6.0), (1, 0.0, 8.0), (2, 0.0, 5.0), (3, 0.5, 7.0)], 0.0, 8.0)
    batches = [[(0, 9.1, 14.0), (1, 9.1, 15.0), (2, 9.1, 17.0), (3, 9.5, 13.0)],
               [(0, 18.1, 21.0), (1, 18.1, 24.0), (2, 18.5, 22.0), (3, 18.1, 20.0)], None]
    # (batch ready, train start, update start, update end)
    steps = [(8.0, 9.1, 11.6, 16.0), (17.0, 18.1, 20.0, 25.0), (25.0, 26.1, 28.0, 33.0)]
    bounds, start = [], 0.0
    for (ready, tr, up, end), nxt in zip(steps, batches):
        sync(ready)
        if nxt is not None:
            generate(nxt, tr, max(y for _, _, y in nxt))
        for g in (4, 5):
            t.call(f"t{g}", "WorkerDict.actor_compute_log_prob", tr, tr + 1.5, [g])
            t.call(f"t{g}", "WorkerDict.ref_compute_ref_log_prob", tr + 1.5, up, [g])
            t.call(f"t{g}", "WorkerDict.actor_update_actor", up, end, [g])
        bounds.append([start, end])
        start = end
    for g in (4, 5):
        t.call(f"t{g}", "WorkerDict.actor_save_checkpoint", 34.0, 35.0, [g])
    return t.document("veRL one-step-off trainer, 4 rollout GPUs (TP 1) + 2 trainer GPUs", bounds, 6)


class ArealTrace:
    """Events as AReaL's perf trace converter writes them: ``{"name", "ph": "X", "ts", "dur", "pid", "tid", "cat",
    "args": {"rank", "role", ...}}`` (areal/utils/perf_tracer.py, PerfTracer._record_complete and _record_event),
    a process per (rank, role) with its ``process_name``; ``span(process, name, start_s, end_s, gpus, cat)``."""

    def __init__(self):
        self.events, self.procs = [], {}

    def process(self, role: str, rank: int) -> int:
        if (role, rank) not in self.procs:
            pid = len(self.procs) + 1
            self.procs[(role, rank)] = pid
            self.events.append({"name": "process_name", "ph": "M", "pid": pid,
                                "args": {"name": f"[{role}] Rank {rank}, Process {4000 + pid}"}})
        return self.procs[(role, rank)]

    def span(self, role: str, rank: int, name: str, start: float, end: float, gpus=(), cat: str = "compute"):
        pid = self.process(role, rank)
        self.events.append({"name": name, "ph": "X", "ts": AREAL_T0_US + round(start * 1e6),
                            "dur": round((end - start) * 1e6), "pid": pid, "tid": pid, "cat": cat,
                            "args": {"rank": rank, "role": role, "source": f"{AREAL_SOURCES[name]}@{AREAL_COMMIT[:7]}",
                                     "gpus": list(gpus)}})


def areal() -> dict:
    """AReaL's asynchronous PPO (module doc): the controller waits for each batch (``train.rollout``), then the two
    actor ranks recompute log-probs, compute advantages, update, and push the weights to the inference servers."""
    t = ArealTrace()
    waits = (3.0, 1.0, 2.5)                     # each step: the trainer waiting for its batch first
    bounds, start = [], 0.0
    for k, wait in enumerate(waits):
        a = start + wait if k else 0.0          # the first step starts at the first rank's call (the trace's 0)
        t.span("master", 0, "train.rollout", start - 3.0 if not k else start, a, cat="compute")
        for r in (0, 1):
            t.span("rollout", r, "rpc.wait_for_task", a - 0.3, a - 0.29, cat="scheduler")
            for j in range(3):
                t.span("rollout", r, "rpc.submit", start + 0.1 * j, start + 0.1 * j + 0.01, cat="scheduler")
        lp, adv = a + 2.0 + 0.1 * k, a + 2.3 + 0.1 * k
        end = adv + 4.0
        t.span("master", 0, "train.recompute_logp", a, lp)
        t.span("master", 0, "train.compute_advantage", lp, adv)
        t.span("master", 0, "train.ppo_update", adv, end)
        for r in (0, 1):
            g = [r]
            skew = 0.05 * r                     # the ranks' tracers started a little apart
            t.span("actor", r, "rpc.compute_logp", a + skew, lp, g)
            t.span("actor", r, "ppo_actor.compute_logp", a + skew + 0.01, lp - 0.01, g)
            t.span("actor", r, "fsdp_engine.forward", a + skew + 0.02, lp - 0.02, g)
            # advantages: a few element-wise tensor ops, left as idle (as veRL's driver-side advantages are)
            t.span("actor", r, "rpc.compute_advantages", lp, adv)
            t.span("actor", r, "ppo_actor.compute_advantages", lp + 0.01, adv - 0.01)
            t.span("actor", r, "rpc.ppo_update", adv, end, g)
            t.span("actor", r, "ppo_actor.ppo_update", adv + 0.01, end - 0.01, g)
            for m in range(2):                  # two mini-batches: forward and backward, then the optimizer step
                m0 = adv + 0.02 + 1.99 * m
                t.span("actor", r, "fsdp_engine.forward", m0, m0 + 0.6, g)
                t.span("actor", r, "fsdp_engine.backward", m0 + 0.6, m0 + 1.6, g)
                t.span("actor", r, "fsdp_engine.step", m0 + 1.6, m0 + 1.9, g)
            t.span("actor", r, "rpc.step_lr_scheduler", end + 0.01, end + 0.02, cat="compute")
        bounds.append([start, end])
        # pause the servers, push the weights (NCCL broadcast from the ranks), resume
        t.span("master", 0, "train.update_weights", end + 0.05, end + 1.05, cat="comm")
        for r in (0, 1):
            t.span("rollout", r, "rpc.pause_generation", end + 0.05, end + 0.07, cat="misc")
            t.span("rollout", r, "remote_inf_engine.pause_generation", end + 0.05, end + 0.06, cat="misc")
            t.span("actor", r, "rpc.update_weights", end + 0.1, end + 1.0, [r], cat="comm")
            t.span("actor", r, "fsdp_engine.update_weights_from_distributed", end + 0.12, end + 0.98, [r], cat="comm")
            t.span("actor", r, "rpc.set_version", end + 1.0, end + 1.01, cat="misc")
            t.span("actor", r, "rpc.get_device_stats", end + 1.01, end + 1.02, cat="misc")
            t.span("actor", r, "rpc.clear_batches", end + 1.05, end + 1.06, cat="misc")
        t.span("master", 0, "train.clear_batches", end + 1.05, end + 1.07, cat="instr")
        t.span("master", 0, "train.log_stats", end + 1.07, end + 1.1, cat="instr")
        start = end
    return {"traceEvents": t.events, "displayTimeUnit": "ms",
            "otherData": {"what": "AReaL async PPO, perf trace of 2 actor ranks (the rollout servers untraced)",
                          "commit": AREAL_COMMIT, "gpus": 2, "steps_s": bounds, "t0_us": AREAL_T0_US}}


def openrlhf() -> dict:
    """OpenRLHF's default placement: 2 vLLM engines (TP 1, GPUs 0–1), policy ranks on GPUs 2–3, the reference model
    on 4, the critic on 5, the reward model on 6; generation, experience, critic and policy fits, the broadcast."""
    t = Trace(sources=OPENRLHF_SOURCES, commit=OPENRLHF_COMMIT)
    engines, policy = (0, 1), (2, 3)
    for g in engines:
        t.call(f"e{g}", "RolloutRayActor.init_process_group", -3.0, -2.0, [g])
    for g in policy:
        t.call(f"p{g}", "PolicyModelActor.init_model_from_pretrained", -10.0, -4.0, [g])
    bounds, start = [], 0.0
    for k, gen in enumerate(((9.0, 12.0), (8.0, 10.5), (11.0, 7.5))):
        s0 = start
        for g, d in zip(engines, gen):
            t.call(f"e{g}", "RolloutRayActor.generate_responses", s0, s0 + d, [g])
        c = s0 + max(gen)
        for g in policy:
            t.call(f"p{g}", "PolicyModelActor.forward", c, c + 1.5, [g])
        t.call("ref", "ReferenceModelActor.forward", c, c + 1.2, [4])
        t.call("critic", "CriticModelActor.forward", c, c + 1.0, [5])
        t.call("reward", "RewardModelActor.forward", c, c + 0.8, [6])
        c += 2.0                                     # the driver's advantages: no span
        for g in policy:
            t.call(f"p{g}", "PolicyModelActor.append", c, c + 0.1)
        t.call("critic", "CriticModelActor.append", c, c + 0.1)
        t.call("critic", "CriticModelActor.fit", c + 0.1, c + 2.5, [5])
        for g in policy:
            t.call(f"p{g}", "PolicyModelActor.fit", c + 0.1, c + 4.1, [g])
            t.call(f"p{g}", "PolicyModelActor.broadcast_to_vllm", c + 4.1, c + 5.0, [g])
        for g in engines:
            t.call(f"e{g}", "RolloutRayActor.update_weight", c + 4.2, c + 4.9, [g])
            t.call(f"e{g}", "RolloutRayActor.reset_prefix_cache", c + 4.95, c + 5.0)
        bounds.append([s0, c + 5.0])
        start = c + 5.0
    for g in policy:
        t.call(f"p{g}", "PolicyModelActor.save_checkpoint", start + 1.0, start + 3.0, [g])
    return t.document("OpenRLHF PPO, default placement: 2 engines + 2 policy ranks + reference, critic, reward", bounds, 7)


def openrlhf_colocated() -> dict:
    """OpenRLHF with --colocate_all_models on 2 GPUs: per GPU an engine, a policy rank, a reference, a reward and a
    critic rank, taking turns (engines sleep after generating, models reload before fit and offload after)."""
    t = Trace(sources=OPENRLHF_SOURCES, commit=OPENRLHF_COMMIT)
    gpus = (0, 1)
    for g in gpus:
        t.call(f"p{g}", "PolicyModelActor.init_model_from_pretrained", -10.0, -4.0, [g])
        t.call(f"e{g}", "RolloutRayActor.init_process_group", -3.0, -2.0, [g])
    bounds, start = [], 0.0
    for k, gen in enumerate(((9.0, 12.0), (8.0, 10.5), (11.0, 7.5))):
        s0 = start
        for g, d in zip(gpus, gen):
            t.call(f"e{g}", "RolloutRayActor.wake_up", s0, s0 + 0.5, [g])
            t.call(f"e{g}", "RolloutRayActor.generate", s0 + 0.5, s0 + 0.5 + d, [g])
        c = s0 + 0.5 + max(gen)
        for g in gpus:
            t.call(f"e{g}", "RolloutRayActor.sleep", c, c + 0.4, [g])
        c += 0.4
        for g in gpus:
            t.call(f"p{g}", "PolicyModelActor.forward", c, c + 1.5, [g])
            t.call(f"ref{g}", "ReferenceModelActor.forward", c + 1.5, c + 2.5, [g])
            t.call(f"c{g}", "CriticModelActor.forward", c + 2.5, c + 3.0, [g])
            t.call(f"rm{g}", "RewardModelActor.forward", c + 3.0, c + 3.3, [g])
        c += 3.5                                     # the driver's advantages: no span
        for g in gpus:
            t.call(f"c{g}", "CriticModelActor.reload_states", c, c + 0.3, [g])
            t.call(f"c{g}", "CriticModelActor.fit", c + 0.3, c + 2.3, [g])
            t.call(f"c{g}", "CriticModelActor.offload_states", c + 2.3, c + 2.6, [g])
            t.call(f"p{g}", "PolicyModelActor.reload_states", c + 2.6, c + 2.9, [g])
            t.call(f"p{g}", "PolicyModelActor.fit", c + 2.9, c + 6.9, [g])
            t.call(f"p{g}", "PolicyModelActor.offload_states", c + 6.9, c + 7.2, [g])
            t.call(f"p{g}", "PolicyModelActor.broadcast_to_vllm", c + 7.2, c + 8.0, [g])
            t.call(f"e{g}", "RolloutRayActor.update_weight_cuda_ipc", c + 7.3, c + 7.9, [g])
            t.call(f"e{g}", "RolloutRayActor.reset_prefix_cache", c + 7.95, c + 8.0)
        bounds.append([s0, c + 8.0])
        start = c + 8.0
    return t.document("OpenRLHF PPO with --colocate_all_models, 2 GPUs", bounds, 2)


FIXTURES = {"verl-colocated-async.ray-timeline.json": colocated_async, "verl-fully-async.ray-timeline.json": fully_async,
            "verl-one-step-off.ray-timeline.json": one_step_off, "openrlhf.ray-timeline.json": openrlhf,
            "openrlhf-colocated.ray-timeline.json": openrlhf_colocated, "areal.perf-trace.json": areal}


#: fixture -> the name -> file:line table its names are cited from
SOURCES_OF = {name: SOURCES for name in FIXTURES} | {
    "verl-one-step-off.ray-timeline.json": ONE_STEP_OFF_SOURCES, "openrlhf.ray-timeline.json": OPENRLHF_SOURCES,
    "openrlhf-colocated.ray-timeline.json": OPENRLHF_SOURCES, "areal.perf-trace.json": AREAL_SOURCES}


def gpu_idle_truth(doc: dict, t0: float, t1: float, gpus=None) -> float:
    """GPU-weighted idle over ``[t0, t1]`` (seconds from the fixture's time 0) of ``gpus`` (default: all) from the
    events' ``args.gpus`` alone: for each GPU the union of its busy calls, then ``Σ_gpu idle / (GPUs · (t1 − t0))``."""
    busy = {g: [] for g in (range(doc["otherData"]["gpus"]) if gpus is None else gpus)}
    t0_us = doc["otherData"].get("t0_us", T0_US)
    for e in doc["traceEvents"]:
        if e["ph"] == "M":
            continue
        a = (e["ts"] - t0_us) / 1e6
        for g in e["args"]["gpus"]:
            if g in busy:
                busy[g].append((max(a, t0), min(a + e["dur"] / 1e6, t1)))
    idle = 0.0
    for intervals in busy.values():
        covered, reach = 0.0, t0
        for a, b in sorted(i for i in intervals if i[1] > i[0]):
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        idle += (t1 - t0) - covered
    return idle / (len(busy) * (t1 - t0))


def write_all() -> None:
    for name, build in FIXTURES.items():
        (TRACES / name).write_text(json.dumps(build(), indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    write_all()
