"""A rollout replica's weights and memory: weight loads (from items or over the weight transport) and the hot
switch's offload / onload (paper §3.2, §6.2; :mod:`bidirl.cluster.engines.workers.rollout`).

A mixin of :class:`~bidirl.cluster.engines.workers.rollout.RolloutEngine`: it uses the engine's ``llm``,
``engine``, ``gpu``, ``device``, ``model_dir``, ``tied`` and ``checkpoint_shapes``, and keeps ``version``,
``last_switch`` and the switch flags.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

#: the switch-out sleep level on CUDA (vLLM's level 2: weights and KV cache discarded; the switch-in pushes the
#: current weights anyway, so a host copy of the old ones would be copied for nothing)
SLEEP_LEVEL = 2


# functions run on the vLLM worker through collective_rpc (module level so they pickle by reference)
def _worker_reload(worker, weights) -> None:
    worker.reload_weights(weights_iterator=iter(weights))
    _repack_cpu_experts(worker)


def _repack_cpu_experts(worker) -> None:
    """Re-pack an MoE model's experts after a reload on CPU. vLLM 0.32's unquantized fused-MoE method packs the
    experts into its CPU grouped-GEMM layout once, at the first load (``UnquantizedFusedMoEMethod._setup_kernel``
    calls ``fused_experts.process_weights_after_loading`` only when the kernel is new); a weight update copies the new
    weights into the parameters but leaves the packed copy the kernel computes with as it was — the tiny MoE model then
    sampled with the old experts (its log-probs 0.1 away from the trainer's on the same weights). Calling the packing
    again for every MoE layer makes the kernel compute with the loaded weights (gap back to rounding, 2e-7)."""
    runner = worker.model_runner
    if getattr(runner.device, "type", "cpu") == "cuda":
        return
    for module in runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def _kv_tensors(worker) -> list:
    seen, out = set(), []
    for t in worker.model_runner.kv_caches:
        tensors = t if isinstance(t, (list, tuple)) else [t]
        for x in tensors:
            ptr = x.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                out.append(x)
    return out


def _worker_release_kv(worker) -> int:
    released = 0
    sizes = []
    for t in _kv_tensors(worker):
        storage = t.untyped_storage()
        sizes.append(storage.nbytes())
        released += storage.nbytes()
        storage.resize_(0)
    worker._bidirl_kv_sizes = sizes
    return released


def _worker_restore_kv(worker) -> int:
    sizes = getattr(worker, "_bidirl_kv_sizes", None)
    if sizes is None:
        return 0
    restored = 0
    for t, n in zip(_kv_tensors(worker), sizes):
        t.untyped_storage().resize_(n)
        t.zero_()
        restored += n
    worker._bidirl_kv_sizes = None
    return restored


def _worker_kv_bytes(worker) -> int:
    return sum(t.untyped_storage().nbytes() for t in _kv_tensors(worker))



def _as_items(weights) -> list:
    import torch

    items = weights.items() if hasattr(weights, "items") else weights
    out = []
    for name, value in items:
        t = value if torch.is_tensor(value) else torch.as_tensor(np.asarray(value))
        out.append((str(name), t.detach().to("cpu")))
    if not out:
        raise ValueError("load_weights: got no weights; pass the trainer's state_dict() (items)")
    return out



class RolloutWeights:
    """Weight loads, offload / onload and reset of a rollout replica."""

    def _require_idle(self, what: str) -> None:
        if self._by_request:
            raise RuntimeError(f"RolloutEngine.{what}: {len(self._by_request)} requests are in flight; "
                               "interrupt() them first (partial rollout resumes them afterwards)")

    def load_weights(self, state_dict_items, version: Optional[int] = None) -> float:
        """Reload the weights in place from ``(name, tensor)`` items or a dict; returns seconds.

        Pass the trainer's full ``state_dict()`` (the tied ``lm_head.weight`` included). Names are the HF
        checkpoint's (wrapper prefixes are removed); names or shapes that differ from the checkpoint's raise
        before anything is loaded. ``version`` becomes the engine's actor version (the staleness tag of tokens
        generated from now on). ``None``: the checkpoint's weights (a driver's version 0).
        """
        from bidirl.rl import model_folder as checkpoint

        if state_dict_items is None:
            state_dict_items = self._checkpoint_items()
        self._require_idle("load_weights")
        if self._offloaded:
            raise RuntimeError("RolloutEngine.load_weights: the engine is offloaded; call onload() first")
        weights = checkpoint.hf_weights(_as_items(state_dict_items), self.tied)
        checkpoint.check_weights(weights, self.checkpoint_shapes, self.tied, f"load_weights ({self.model_dir})",
                                 "pass the state_dict() of a trainer of this model (TrainerEngine(model_dir))")
        items = list(weights.items())
        t0 = time.perf_counter()
        self.llm.collective_rpc(_worker_reload, args=(items,))
        self._weights_stale = False
        self._reset_prefix_cache("load_weights")        # cached blocks hold the old weights' keys and values
        seconds = time.perf_counter() - t0
        if version is not None:
            self.version = int(version)
        return seconds

    def receive_weights(self, transfer, rank: int) -> dict:
        """Load actor ``transfer.version`` in place from the trainer gang over the weight transport, as receiver
        ``rank`` of ``transfer`` (:mod:`bidirl.cluster.engines.workers.weight_transport`): each bucket goes into vLLM's
        layerwise reload (``model.load_weights``) as it arrives, and nothing is kept. The names and shapes are
        checked against the checkpoint before anything is loaded (a refused transfer loads nothing). If the
        sender fails mid-way this raises ``WeightTransferError`` and the weights are partly the new version's:
        the engine must not generate before it loads a version again (the driver restarts it). Returns the
        receiver's report with ``seconds``."""
        import torch

        from bidirl.cluster.engines.workers.weight_transport import Receiver
        from bidirl.rl import model_folder as checkpoint

        self._require_idle("receive_weights")
        if self._offloaded:
            raise RuntimeError("RolloutEngine.receive_weights: the engine is offloaded; call onload() first")
        receiver = Receiver(transfer, rank, self.device)
        try:
            sent = {k: torch.empty(shape, device="meta") for k, shape in transfer.layout.shapes().items()}
            checkpoint.check_weights(sent, self.checkpoint_shapes, self.tied, f"receive_weights ({self.model_dir})",
                                     "send the weights of a trainer of this model (weight_transport.model_layout)")
        except ValueError as exc:
            receiver.abandon(str(exc))
            raise
        t0 = time.perf_counter()
        receiver.connect()
        self.version = None               # partly loaded until the last bucket is in
        self.llm.collective_rpc(_worker_reload, args=(receiver.items(),))
        self._weights_stale = False
        self._reset_prefix_cache("receive_weights")     # cached blocks hold the old weights' keys and values
        self.version = int(transfer.version)
        return dict(receiver.close(), seconds=time.perf_counter() - t0)

    @property
    def offloaded(self) -> bool:
        """Whether anything is switched out (the weights, the KV cache, or both)."""
        return self._offloaded or self._kv_released

    def _reset_prefix_cache(self, where: str) -> None:
        """Forget every cached block (their keys and values are no longer the current weights' or were freed)."""
        if not self.engine.reset_prefix_cache():
            raise RuntimeError(f"RolloutEngine.{where}: vLLM could not reset its prefix cache (blocks still in use); "
                               "cached blocks would serve stale keys and values")

    def offload(self) -> float:
        """Give the replica's memory up for a hot switch; returns seconds (see
        :mod:`bidirl.cluster.engines.workers.rollout`)."""
        self._require_idle("offload")
        if self.offloaded:
            return 0.0
        t0 = time.perf_counter()
        if self.gpu:
            self.llm.sleep(level=SLEEP_LEVEL)              # clears the prefix cache; weights and KV discarded
            self._weights_stale = True
            self.last_switch = {"mode": f"vllm-sleep-{SLEEP_LEVEL}", "weights_discarded": True}
        else:
            self._reset_prefix_cache("offload")
            released = sum(self.llm.collective_rpc(_worker_release_kv))
            self.last_switch = {"mode": "cpu", "kv_bytes_released": int(released), "weights_released": False}
        self._offloaded = self._kv_released = True
        seconds = time.perf_counter() - t0
        self.last_switch["offload_seconds"] = seconds
        return seconds

    def onload(self, kv: bool = True) -> float:
        """Restore what :meth:`offload` gave up: the weights, then (``kv``) the KV cache; returns seconds.

        A hot switch-in calls ``onload(kv=False)``, loads the current weights, then ``onload()`` — the KV cache
        comes back only once the weights are in place (:mod:`bidirl.cluster.engines.workers.rollout`). On GPU the
        weights phase gives the
        weights' memory back with undefined contents after a level-2 sleep: :meth:`load_weights` must follow
        before the engine generates."""
        if not self.offloaded:
            return 0.0
        t0 = time.perf_counter()
        if self._offloaded:
            t = time.perf_counter()
            if self.gpu:
                self.llm.wake_up(tags=["weights"])
            self._offloaded = False
            self.last_switch["wake_weights_seconds"] = time.perf_counter() - t
        if kv and self._kv_released:
            t = time.perf_counter()
            if self.gpu:
                self.llm.wake_up(tags=["kv_cache"])       # fully awake: vLLM resumes scheduling
            else:
                self.last_switch["kv_bytes_restored"] = int(sum(self.llm.collective_rpc(_worker_restore_kv)))
            self._reset_prefix_cache("onload")          # the restored blocks hold nothing a hash may point to
            self._kv_released = False
            self.last_switch["wake_kv_seconds"] = time.perf_counter() - t
        seconds = time.perf_counter() - t0
        self.last_switch["onload_seconds"] = self.last_switch.get("onload_seconds", 0.0) + seconds
        return seconds

    def reset(self, reward_fn: Optional[Callable[[Any, str], float]] = None) -> float:
        """Back to what a fresh engine holds — no groups, the model folder's weights, version 0, onloaded — for
        a new run on the same process, whose responses ``reward_fn`` scores (as the constructor's). Returns
        seconds."""
        t0 = time.perf_counter()
        self.reward_fn = reward_fn
        self.interrupt(None)
        self.onload()
        self.load_weights(self._checkpoint_items(), 0)
        return time.perf_counter() - t0

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache currently holds (0 while offloaded on CPU)."""
        return int(sum(self.llm.collective_rpc(_worker_kv_bytes)))

    def _checkpoint_items(self) -> list:
        """The checkpoint's weights as sent by a trainer (the tied head, stored once, added as ``lm_head``)."""
        from bidirl.rl import model_folder as checkpoint

        return checkpoint.checkpoint_weights(self.model_dir, self.tied)
