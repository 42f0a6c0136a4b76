"""The torch trainer engine, one rank of a trainer gang (paper §2.1, §5): its settings, and the concerns it is made of.

:class:`TrainerEngine` holds the rank's state (model, optimizer, gradients, published versions, host buffer) and
combines one module per concern: :mod:`.loading`, :mod:`.distribution` (FSDP2), :mod:`.compute`, :mod:`.weights`
(publish / send / receive), :mod:`.windows`, :mod:`.recovery` and :mod:`.offload` (see the package docstring).
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Optional, Union

import torch

from bidirl.cluster.engines.workers import snapshot_files
from bidirl.cluster.engines.workers.host_buffer import HostStash
from bidirl.cluster.engines.workers.logprob import DEFAULT_CHUNK
from bidirl.cluster.engines.workers.state_copy import StateCopy
from bidirl.cluster.engines.workers.trainer.compute import Compute
from bidirl.cluster.engines.workers.trainer.distribution import Distribution
from bidirl.cluster.engines.workers.trainer.loading import Loading
from bidirl.cluster.engines.workers.trainer.micro_batches import MicroBatches
from bidirl.cluster.engines.workers.trainer.offload import Offload
from bidirl.cluster.engines.workers.trainer.ordered_sum import OrderedSum
from bidirl.cluster.engines.workers.trainer.recovery import Recovery
from bidirl.cluster.engines.workers.trainer.state_offload import StateOffload
from bidirl.cluster.engines.workers.trainer.replay import Replay
from bidirl.cluster.engines.workers.trainer.tensors import local_part
from bidirl.cluster.engines.workers.trainer.weights import Weights
from bidirl.cluster.engines.workers.trainer.windows import Windows
from bidirl.core.protocol import PRIMARY, ROLES
from bidirl.rl import grpo
from bidirl.rl import model_folder as checkpoint

#: ``precision=`` values: fp32 throughout, or bf16 compute over fp32 master weights (FSDP2 mixed precision)
PRECISIONS = ("fp32", "bf16-mixed")


def settings_from(rl) -> dict:
    """The engine keyword arguments of a job's trainer settings (its ``rl`` section): token-budget micro-batches
    and parameter / optimizer offload."""
    return {"max_tokens_per_micro_batch": rl.max_tokens_per_micro_batch, "param_offload": bool(rl.param_offload),
            "optimizer_offload": bool(rl.optimizer_offload)}


def resolve_precision(precision: str, device) -> str:
    """``"auto"`` → ``"bf16-mixed"`` on CUDA, ``"fp32"`` elsewhere; other values are checked."""
    if precision == "auto":
        return "bf16-mixed" if torch.device(device).type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"TrainerEngine.precision must be 'auto' or one of {PRECISIONS}, got {precision!r}")
    return precision



class TrainerEngine(StateOffload, MicroBatches, Compute, Replay, Weights, Windows, Recovery, Offload, Distribution,
                    Loading):
    """A GRPO trainer over a transformers causal LM (see the package docstring for stages and sharding).
    
    ``lr``, ``weight_decay``, ``betas``: AdamW; ``kl_coef``: β of the k3 KL to the reference (the initial
    weights); ``clip_eps`` / ``clip_eps_high``: PPO clip range; ``loss_agg``: see ``bidirl.rl.grpo``;
    ``max_grad_norm``: clip the summed gradient (``None``: no clipping); ``precision``: ``"auto"``, ``"fp32"``
    or ``"bf16-mixed"``. ``seed`` seeds the (forked) torch RNG while the model loads; training itself draws no
    random numbers (the model runs in eval mode, without dropout). ``threads`` sets torch's intra-op thread
    count for the whole process (for an engine that owns its process, e.g. inside a Ray actor). ``gang=True``: the
    engine will join a gang (:meth:`init_process_group`) before any work, so the model is built on the meta device
    and each rank reads only its shards from the checkpoint once the mesh is known (package docstring, "Loading");
    an engine built so that does work without joining loads the whole model then, as ``gang=False`` does at once.
    ``max_tokens_per_micro_batch`` (``rl.max_tokens_per_micro_batch``): a rank's share runs in micro-batches of at
    most that many padded tokens (:mod:`.micro_batches`; ``None``: the share in one pass); ``param_offload`` /
    ``optimizer_offload`` (``rl.param_offload`` / ``rl.optimizer_offload``): the weights between stage calls, AdamW's
    moments between optimizer steps, in host memory (:mod:`.state_offload`).
    ``route_replay`` (a mixture-of-experts model only; R3, :mod:`bidirl.rl.route_replay`): every forward of the
    log-prob and update passes sends each token to the experts the rollout sent it to (``Sample.routes``).
    """

    def __init__(self, model_dir: Union[str, Path], lr: float = 1e-3, seed: int = 0, kl_coef: float = 0.0,
                 role: str = PRIMARY, device: str = "cpu", *, clip_eps: float = 0.2,
                 clip_eps_high: Optional[float] = None, loss_agg: str = "token-mean",
                 max_grad_norm: Optional[float] = 1.0, weight_decay: float = 0.0,
                 betas: tuple = (0.9, 0.999), precision: str = "auto", threads: Optional[int] = None,
                 activation_checkpointing: Optional[bool] = None, logprob_chunk: int = DEFAULT_CHUNK,
                 gang: bool = False, publish_dtype: Optional[str] = None,
                 max_tokens_per_micro_batch: Optional[int] = None, param_offload: bool = False,
                 optimizer_offload: bool = False, route_replay: bool = False):
        if role not in ROLES:
            raise ValueError(f"TrainerEngine.role must be one of {ROLES}, got {role!r}")
        if not lr > 0:
            raise ValueError(f"TrainerEngine.lr must be > 0, got {lr!r}")
        if kl_coef < 0:
            raise ValueError(f"TrainerEngine.kl_coef must be ≥ 0, got {kl_coef!r}")
        if loss_agg not in grpo.LOSS_AGGS:
            raise ValueError(f"TrainerEngine.loss_agg must be one of {grpo.LOSS_AGGS}, got {loss_agg!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"TrainerEngine.max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.device = self._check_device(device)
        self.precision = resolve_precision(precision, self.device)
        if activation_checkpointing is None:
            activation_checkpointing = self.device.type == "cuda"
        if not isinstance(activation_checkpointing, bool):
            raise ValueError("TrainerEngine.activation_checkpointing must be True, False or None (on for CUDA), "
                             f"got {activation_checkpointing!r}")
        if isinstance(logprob_chunk, bool) or not isinstance(logprob_chunk, int) or logprob_chunk < 1:
            raise ValueError(f"TrainerEngine.logprob_chunk must be a positive integer (response tokens per LM-head "
                             f"chunk), got {logprob_chunk!r}")
        if max_tokens_per_micro_batch is not None and (isinstance(max_tokens_per_micro_batch, bool)
                                                       or not isinstance(max_tokens_per_micro_batch, int)
                                                       or max_tokens_per_micro_batch < 1):
            raise ValueError("TrainerEngine.max_tokens_per_micro_batch must be a positive number of tokens or None "
                             f"(the share in one pass), got {max_tokens_per_micro_batch!r}")
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self._init_state_offload(param_offload, optimizer_offload)
        if not isinstance(gang, bool):
            raise ValueError(f"TrainerEngine.gang must be True or False, got {gang!r}")
        from bidirl.cluster.engines.workers.weight_transport import DTYPES
        if publish_dtype is not None and publish_dtype not in DTYPES:
            raise ValueError("TrainerEngine.publish_dtype must be None (no weight transport) or one of "
                             f"{list(DTYPES)}, got {publish_dtype!r}")
        self.publish_dtype = publish_dtype
        self.activation_checkpointing, self.logprob_chunk = activation_checkpointing, logprob_chunk
        if threads == "auto":
            threads = self.host_threads(self.device)
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"TrainerEngine.threads must be a positive integer, 'auto' or None, got {threads!r}")
            torch.set_num_threads(threads)   # the engine owns its process (a Ray actor) when this is set
        self.model_dir = checkpoint.model_folder(model_dir, "TrainerEngine.model_dir")
        self.config = checkpoint.causal_lm_config(self.model_dir, "TrainerEngine.model_dir")
        self.tied = checkpoint.tied_embeddings(self.config)
        if not isinstance(route_replay, bool):
            raise ValueError(f"TrainerEngine.route_replay must be True or False, got {route_replay!r}")
        if route_replay:
            from bidirl.rl.route_replay import RouteReplayError
            from bidirl.rl.routes import moe_route_shape
            try:
                moe_route_shape(self.config)
            except ValueError as exc:
                raise RouteReplayError(f"TrainerEngine.route_replay: {exc}; replay routes only for an MoE "
                                       "model") from None
        self.route_replay = route_replay
        self.role, self.seed, self.lr, self.kl_coef = role, int(seed), float(lr), float(kl_coef)
        self.clip_eps, self.clip_eps_high, self.loss_agg = float(clip_eps), clip_eps_high, loss_agg
        self.max_grad_norm = max_grad_norm
        self.betas, self.weight_decay = tuple(betas), float(weight_decay)
        self.mesh = None                 # the gang's device mesh once sharded (FSDP2)
        self._group = None
        self.rank, self.world, self.replicas = 0, 1, 1
        self._reference = None
        self.windows: dict = {}           # transfer id -> an auxiliary window's gradient shard (receive_window)
        self._host = HostStash()         # offload's host buffer: allocated once, reused by every switch
        self._snapshots = snapshot_files.SnapshotWriter()    # recovery snapshots on this node's disk (save_snapshot)
        self._state_copy = StateCopy(self._host)   # the snapshot's copy into the host buffer, beside the chunks
        self.snapshot_waits: dict = {}    # call -> seconds it last waited for the snapshot's copy
        self._published_readers = threading.Condition()    # sends reading published shards from the host buffer
        self._host_readers = 0
        self._published_on_host = False
        self.published: dict = {}         # actor version -> {name: (shard in the wire dtype, rows or None)}
        self._transport_group = None      # the gang's second group, for the weight transport's gathers
        self._launches = None             # the gang's launch order over both threads (launch_order)
        self._rendezvous = None           # (host:port, store) of the gang's rendezvous opened here (listen)
        self.accumulated: list = []       # chunk gradients accumulated into p.grad since the last step (their ids)
        self.order = OrderedSum()         # the step's gradient in unit order (chunks given a position: ordered_sum)
        self.version = 0
        self.passes_run = 0               # model passes over samples (token-budget micro-batches: several a share)
        self._pending = gang              # built on the meta device for a gang: loaded once the mesh is known
        self.model = self._load_model(empty=gang)
        if self.kl_coef > 0:              # the reference is loaded at start (bf16 when computing in bf16)
            self._reference = self._load_model(frozen=True, empty=gang)
        self._track_parameters()

    @staticmethod
    def host_threads(device) -> int:
        """``threads="auto"``: inside a Ray actor, the whole CPUs Ray granted it (at least one) — what Ray sets
        ``OMP_NUM_THREADS`` to; on a GPU cluster the actor's half of its GPU slot's bundle, ``cluster.cpus_per_gpu``
        (``bidirl.cluster.slots.gpu_bundle_cpus``), so host work (optimizer bookkeeping, copies, batching) is not
        single-threaded. Outside Ray: this machine's CPUs shared evenly by its GPUs on a CUDA device, one thread on
        CPU (the engine's compute then owns a core, as the CPU gangs are laid out)."""
        import os
        import sys
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            return max(1, math.floor(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        if torch.device(device).type != "cuda":
            return 1
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cpus // max(1, torch.cuda.device_count()))

    @staticmethod
    def _check_device(device) -> torch.device:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"TrainerEngine.device must be 'cpu' or 'cuda[:i]', got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TrainerEngine.device={device!r} but this torch sees no CUDA device; use device='cpu'")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _track_parameters(self) -> None:
        """(Re)build the parameter list, shard shapes and the optimizer (primary only) after loading/sharding."""
        self.params = list(self.model.parameters())
        self.local_shapes = [tuple(local_part(p).shape) for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.local_numel = sum(math.prod(s) for s in self.local_shapes)
        self.optimizer = (torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
                          if self.role == PRIMARY else None)
        if not self._pending:            # loaded: the host buffer is allocated in the background from now on
            self._reserve_host()

    def _check_onloaded(self, what: str):
        if self._host.holding:
            raise RuntimeError(f"TrainerEngine.{what}: the engine is offloaded; call onload() first")
        self._load_if_pending()
        self._params_back()               # rl.param_offload: the weights between stage calls (.state_offload)

    def _ready(self, what: str) -> None:
        """Checks shared by every call that touches the model: onloaded, and sharded when bf16-mixed needs it."""
        self._check_onloaded(what)
        if self.precision == "bf16-mixed" and not self.sharded:
            self._shard_alone()

    def reset(self) -> float:
        """Back to what a fresh engine holds — the model folder's weights, a new optimizer, version 0 — for a
        new run on the same process (the sharding and the gang stay). Returns seconds."""
        t0 = time.perf_counter()
        self.onload()
        self._state_back()                 # what rl.param_offload / rl.optimizer_offload put away
        self._ready("reset")
        self._wait_state_copy("reset")
        with torch.no_grad():
            self._fill(self.model)           # a sharded rank reads its shards alone, as at start
        self.version = 0
        self._clear_grads()
        if self.optimizer is not None:
            self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas,
                                               weight_decay=self.weight_decay)
        return time.perf_counter() - t0
