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
"""

from __future__ import annotations

import json
from pathlib import Path

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
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
    "WorkerDict.critic_compute_values": f"{W}:1540",
    "WorkerDict.critic_update_critic": f"{W}:1560",
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


class Trace:
    """Events of one hand-written timeline: ``call(worker, name, start_s, end_s, gpus)``."""

    def __init__(self, node: str = "10.0.0.1"):
        self.node, self.events = node, []

    def call(self, worker: str, name: str, start: float, end: float, gpus=()) -> None:
        cls, method = name.split(".", 1)
        self.events.append({"cat": f"task::{name}", "name": method, "pid": self.node, "tid": f"worker:{worker}",
                            "ts": T0_US + round(start * 1e6), "dur": round((end - start) * 1e6), "ph": "X",
                            "args": {"func_or_class_name": name, "source": f"{SOURCES[name]}@{VERL_COMMIT[:7]}",
                                     "gpus": list(gpus)}})

    def document(self, what: str, steps: list, gpus: int) -> dict:
        return {"traceEvents": sorted(self.events, key=lambda e: (e["ts"], e["tid"])),
                "otherData": {"what": what, "verl_commit": VERL_COMMIT, "gpus": gpus, "steps_s": steps}}


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
        # 1 s of the driver's reward and advantage work: no span
        c = gen_end + 1.5
        for g in range(4):
            t.call(f"w{g}", "WorkerDict.actor_rollout_compute_log_prob", c, c + 2.5, [g])
            t.call(f"w{g}", "WorkerDict.ref_compute_ref_log_prob", c + 2.5, c + 4.5, [g])
            t.call(f"w{g}", "WorkerDict.actor_rollout_update_actor", c + 4.5, c + 12.5, [g])
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


FIXTURES = {"verl-colocated-async.ray-timeline.json": colocated_async, "verl-fully-async.ray-timeline.json": fully_async}


def gpu_idle_truth(doc: dict, t0: float, t1: float) -> float:
    """GPU-weighted idle over ``[t0, t1]`` (seconds from the fixture's time 0) from the events' ``args.gpus`` alone:
    for each GPU the union of its busy calls, then ``Σ_gpu idle / (GPUs · (t1 − t0))``."""
    busy = {g: [] for g in range(doc["otherData"]["gpus"])}
    for e in doc["traceEvents"]:
        a = (e["ts"] - T0_US) / 1e6
        for g in e["args"]["gpus"]:
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
