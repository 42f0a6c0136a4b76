"""The weight sync before and after the transport (issue #24, paper §3.2 / §6.2): Ray's object store vs buckets.

Two measurements, each run with both ``transport.weights`` settings side by side in one call:

* **Object store per step, by kind** — a real CPU run (``tiny-cpu``: two vLLM rollouters, a two-rank gloo trainer
  gang, the auxiliary workers borrowing switches in; policy ``opportunistic``, so both directions borrow) under
  :class:`~bidirl.cluster.engines.object_store_meter.ObjectStoreMeter`: the bytes the driver's calls put into
  Ray's object store per step, by kind (weights, gradients, groups, the recovery snapshot, metrics), and the
  object store's own count of bytes created (``raylet``). ``object_store`` is the path from before the transport,
  ``collective`` the transport. The final weights the run's result holds are gathered once after the last step
  and are counted apart (``result_weights``, bytes per run).
* **Sync time and bytes per rollouter against model size** — a two-rank FSDP2 trainer gang (gloo) and two vLLM
  rollouters, for the built-in tiny model (Qwen2, 0.4 M parameters) and a ``small`` random Qwen3
  (``bench_trainer_scale``'s shape, 11.5 M parameters): ``reps`` syncs of each path, medians. Before: rank 0's full
  state dict into the object store (what the optimizer step's snapshot does) and every rollouter's load of its own
  copy (what ``SyncWeights`` waits for); after: the ranks publish the version (what the snapshot does now) and one
  transfer sends it. ``sync_s`` is what the sync itself takes (the driver's ``SyncWeights`` wait), ``with_prep_s``
  adds the per-step preparation (gather into the store / publish). Bytes per rollouter: the object each one
  deserialises, or the buckets it receives.

On CPU the tiny models' syncs take milliseconds to tenths of a second: the figures characterise the two paths'
overheads and traffic, not a GPU job (no GPU with vLLM was available: the NCCL and CUDA-IPC branches are
unmeasured).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bidirl.job import config as cfgmod

MODES = ("object_store", "collective")
KINDS = ("weights", "gradients", "groups", "snapshot", "metrics")


def object_store_per_step(steps: int) -> dict:
    """Run ``tiny-cpu`` under ``opportunistic`` once per transport on the same workers; bytes per step by kind."""
    import ray

    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.cluster.engines.object_store_meter import ObjectStoreMeter

    from bidirl.cluster.kept_workers import KeptWorkers

    cfg = cfgmod.load("tiny-cpu")
    out = {}
    try:                                                # the first run starts an embedded Ray with its GPU slots
        with KeptWorkers(capacity=1) as kept:          # both paths on the same workers: one start
            for mode in MODES:
                job = cfg.with_overrides({"transport.weights": mode})
                driver = EngineDriver(job, "opportunistic", steps, job.seed, kept_workers=kept)
                meter = ObjectStoreMeter()
                with meter:
                    result = driver.run(kill=lambda d: meter.poll())
                report = meter.report(steps)
                for kind in KINDS:
                    out[f"{mode}.object_store.{kind}"] = (report["object_store"][kind], "B/step")
                    out[f"{mode}.inline.{kind}"] = (report["inline"][kind], "B/step")
                out[f"{mode}.object_store.total"] = (report["object_store_total"] - report["object_store"]["result"],
                                                     "B/step")
                out[f"{mode}.result_weights"] = (meter.store["result"], "B/run")
                out[f"{mode}.raylet"] = (report["raylet_bytes"], "B/step")
                out[f"{mode}.sync_s"] = (result.summary()["weight_sync"] or 0.0, "s")
    finally:
        ray.shutdown()
    return out


def _ray_init() -> None:
    """A local Ray for the engine-level syncs (three tries: a loaded machine may miss its start-up deadline)."""
    import os

    import ray
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    for attempt in range(3):
        try:
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise


def _model(size: str, folder: Path) -> str:
    if size == "tiny":
        from bidirl.rl.bootstrap import ensure_tiny_model
        return str(ensure_tiny_model())
    from benchmarks.bench_trainer_scale import make_model
    return str(make_model(size, folder, "cpu"))


def sync_by_model_size(sizes=("tiny", "small"), reps: int = 3, bucket_mb: float = None) -> dict:
    """Sync ``reps`` times per path and model size with a two-rank gang and two rollouters (module docstring)."""
    import ray

    from bidirl.cluster.engines.workers import weight_transport as wt
    from bidirl.cluster.engines.workers.actors import RolloutActor, TrainerActor

    out = {}
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            md = _model(size, Path(tmp) / size)
            _ray_init()
            try:
                ranks = [TrainerActor.remote(f"trainer_pool/trainer/{j}", md, lr=1e-4, threads=1) for j in range(2)]
                rolls = [RolloutActor.remote(f"rollout_pool/rollouter/{i}", md, 0, max_model_len=64, kv_cache_gib=0.03)
                         for i in range(2)]
                ray.get([a.ready.remote() for a in ranks + rolls], timeout=900)
                addr = ray.get(ranks[0].address.remote())
                ray.get([r.init_process_group.remote(j, 2, addr, 1) for j, r in enumerate(ranks)], timeout=300)
                layout = wt.model_layout(md, "float32", int((bucket_mb or wt.DEFAULT_BUCKET_MB) * 2**20))
                rendezvous = wt.Rendezvous()
                times = {m: {"sync": [], "prep": []} for m in MODES}
                per_rollouter = {}
                for rep in range(reps):
                    version = rep + 1
                    # before: the snapshot's gather into the object store, then each rollouter loads its own copy
                    t0 = time.perf_counter()
                    weights = [r.weights.remote() for r in ranks]
                    ray.wait(weights, num_returns=2, fetch_local=False)
                    t1 = time.perf_counter()
                    ray.get([a.load_weights.remote(weights[0], version) for a in rolls], timeout=900)
                    t2 = time.perf_counter()
                    times["object_store"]["prep"].append(t1 - t0)
                    times["object_store"]["sync"].append(t2 - t1)
                    size_info = ray.experimental.get_object_locations([weights[0]])[weights[0]]
                    per_rollouter["object_store"] = int(size_info["object_size"])
                    del weights
                    # after: publish on the ranks, then one transfer
                    t0 = time.perf_counter()
                    ray.get([r.publish.remote(version, "float32") for r in ranks], timeout=900)
                    t1 = time.perf_counter()
                    transfer = rendezvous.open([f"rollout_pool/rollouter/{i}" for i in range(2)], version, layout, 600)
                    recv = [a.receive_weights.remote(transfer, i + 1) for i, a in enumerate(rolls)]
                    sent = [r.send_weights.remote(transfer) for r in ranks]
                    replies = ray.get(recv + sent, timeout=900)
                    t2 = time.perf_counter()
                    rendezvous.close(transfer.tid)
                    times["collective"]["prep"].append(t1 - t0)
                    times["collective"]["sync"].append(t2 - t1)
                    per_rollouter["collective"] = int(replies[0].value["bytes"])
                    report = replies[2].value                    # rank 0's: the gang's gathers, its sends
                    for part in ("handshake_seconds", "gather_seconds", "send_seconds"):
                        times["collective"].setdefault(part, []).append(report[part])
                    times["collective"].setdefault("receive", []).append(
                        statistics.median(r.value["seconds"] for r in replies[:2]))
                for mode in MODES:
                    sync = statistics.median(times[mode]["sync"])
                    prep = statistics.median(times[mode]["prep"])
                    out[f"{size}.{mode}.sync_s"] = (sync, "s")
                    out[f"{size}.{mode}.with_prep_s"] = (sync + prep, "s")
                    out[f"{size}.{mode}.bytes_per_rollouter"] = (per_rollouter[mode], "B")
                for part in ("handshake_seconds", "gather_seconds", "send_seconds", "receive"):
                    name = part.replace("_seconds", "")
                    out[f"{size}.collective.{name}_s"] = (statistics.median(times["collective"][part]), "s")
                out[f"{size}.model_bytes_fp32"] = (layout.nbytes, "B")
                out[f"{size}.buckets"] = (len(layout.buckets), "")
            finally:
                ray.shutdown()
    return out


def bench_weight_sync(quick: bool) -> dict:
    out = sync_by_model_size(("tiny",) if quick else ("tiny", "small"), reps=2 if quick else 3)
    out.update(object_store_per_step(2 if quick else 4))
    return out


BENCHMARKS = {"weight_sync": bench_weight_sync}
