"""Parameters and optimizer state in host memory between uses (``rl.param_offload`` / ``rl.optimizer_offload``;
veRL's ``actor.fsdp_config.param_offload`` / ``optimizer_offload``).

A trainer rank that offloads its parameters keeps its (sharded) fp32 weights in a host buffer of their own between
stage calls: a call that runs the model brings them back first (``TrainerEngine._check_onloaded``, which every such
call passes) and :meth:`StateOffload.logprobs`, :meth:`StateOffload.chunk_gradients` and :meth:`StateOffload.apply`
put them away again when they end. A rank that offloads its optimizer state keeps AdamW's two moments in another
host buffer from the end of one optimizer step to the start of the next (and brings them back for a training-state
read: a run checkpoint or a recovery snapshot, ``Recovery._train_state``). The step's accumulated gradient stays on
the device between chunks (it is summed there, paper §6.3).

Both move storages as the hot switch does (:class:`~bidirl.cluster.engines.workers.host_buffer.HostStash`: one
flat buffer allocated once and reused, pinned where the engine runs on CUDA; each storage copied byte for byte,
then freed in place and re-allocated on the way back), so the state a rank computes with is the same bits with or
without offload, and what the device holds between uses drops by the moved bytes (``resident_bytes``; the
device-memory terms are ``bidirl.perf.memory.device_budget``'s). The cost is a host↔device copy of the moved bytes
each way around each use (``bidirl.perf.execution.offload_seconds`` models it). On CPU the host is the device: the
copies and frees are real, the memory saved is not.

A put-away waits for a recovery snapshot's copy in flight (it reads the state it would free). Parameters put away
are not moved again by a hot switch (its offload moves what is resident: ``Offload._state_tensors``) and come back
with the next call that needs them.

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`, ahead of the compute and recovery
mixins whose calls it wraps.
"""

from __future__ import annotations

import torch

from bidirl.cluster.engines.workers.host_buffer import HostStash
from bidirl.cluster.engines.workers.trainer.tensors import local_part


def _resident(tensors) -> list:
    """``tensors`` one per storage, those whose storage is allocated."""
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0 and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(t)
    return out


class StateOffload:
    """Parameter and optimizer-state offload between uses (the module docstring)."""

    def _init_state_offload(self, param_offload: bool, optimizer_offload: bool) -> None:
        for name, value in (("param_offload", param_offload), ("optimizer_offload", optimizer_offload)):
            if not isinstance(value, bool):
                raise ValueError(f"TrainerEngine.{name} must be True or False, got {value!r}")
        self.param_offload, self.optimizer_offload = param_offload, optimizer_offload
        self._param_stash = HostStash()          # the weights between stage calls (param_offload)
        self._moment_stash = HostStash()         # AdamW's moments between optimizer steps (optimizer_offload)

    @property
    def params_on_host(self) -> bool:
        return self._param_stash.holding

    @property
    def optimizer_state_on_host(self) -> bool:
        return self._moment_stash.holding

    def _params_back(self) -> None:
        if self._param_stash.holding:
            self._param_stash.restore()

    def _optimizer_state_back(self) -> None:
        if self._moment_stash.holding:
            self._moment_stash.restore()

    def _moments(self) -> list:
        if self.optimizer is None:
            return []
        return [local_part(v) for st in self.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.numel() > 1]

    def _put_away(self, stash: HostStash, tensors: list, what: str) -> None:
        if stash.holding or self._host.holding:
            return
        tensors = _resident(tensors)
        if tensors:
            self._wait_state_copy(what)
            stash.offload(tensors)

    def _put_away_params(self) -> None:
        if self.param_offload:
            self._put_away(self._param_stash, [local_part(p) for p in self.params], "param_offload")

    def _put_away_optimizer_state(self) -> None:
        if self.optimizer_offload:
            self._put_away(self._moment_stash, self._moments(), "optimizer_offload")

    def _state_back(self) -> None:
        """Everything put away back on the device (before a reset rebuilds the optimizer)."""
        self._params_back()
        self._optimizer_state_back()

    # the calls wrapped -------------------------------------------------------------------------------------------
    def logprobs(self, samples, model: str = "actor") -> list:
        out = super().logprobs(samples, model)
        self._put_away_params()
        return out

    def chunk_gradients(self, *args, **kwargs):
        out = super().chunk_gradients(*args, **kwargs)
        self._put_away_params()
        return out

    def apply(self, *args, **kwargs) -> dict:
        self._optimizer_state_back()
        out = super().apply(*args, **kwargs)
        self._put_away_optimizer_state()
        self._put_away_params()
        return out

    def _train_state(self, what: str) -> dict:
        self._optimizer_state_back()
        return super()._train_state(what)
