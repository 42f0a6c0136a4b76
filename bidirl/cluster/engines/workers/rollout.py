"""The vLLM rollout engine: interruptible group generation, partial-rollout resume, weight reload, offload.

One ``RolloutEngine`` is one rollout replica (paper §2.1): a vLLM engine run **in-process** (no engine
subprocess: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``distributed_executor_backend="uni"`` for one GPU, vLLM's
multiprocess executor for ``tensor_parallel_size > 1``, CUDA only), with CUDA graphs on GPU and eager mode on
CPU (``enforce_eager``), prefix caching on (a group's responses share their prompt), a KV cache of
``kv_cache_gib`` (checked to hold one ``max_model_len`` sequence), fp32 on CPU and bf16 on GPU (the trainer's
compute precision there), over any local checkpoint folder of an
architecture both vLLM and transformers implement (checked up front: ``bidirl.rl.model_folder``). Generation
is driven step by step through ``LLMEngine.add_request`` / ``step`` so it can be stopped between any two decode
steps:

* :meth:`start` adds the requests of prompt-level groups (``group_size`` responses each). Response ``i``
  of group ``g`` samples with its own seed ``request_seed(seed, g, i)``, and the token at each position is
  drawn with noise keyed by (that seed, the position) (``bidirl.cluster.engines.workers.sampler``): the same seeds
  give the same tokens, whichever replica generated them, in whatever batch, and however often the
  response was interrupted and resumed.
* :meth:`step_until` runs engine steps until a stop condition, a step or time budget, or until nothing is
  left, and returns the groups that completed, as ``bidirl.core.protocol.GroupState`` with a
  ``bidirl.rl.samples.GroupPayload`` (token ids and the sampled tokens' log-probs from
  ``SamplingParams(logprobs=0)``; texts and rewards when a ``reward_fn`` is given — called as
  ``reward_fn(request.meta, text)`` through ``bidirl.rl.rewards.score_response``, so a failing reward raises
  ``RewardError`` naming the function, the group and the response).
* :meth:`interrupt` aborts unfinished requests at a synchronisation point and returns each group's state:
  finished responses plus the prefixes (tokens and log-probs so far) of unfinished ones (partial rollout,
  §2.2 / §3.2).
* Resuming is :meth:`start` with ``resume=`` that state: each unfinished response is submitted as
  ``prompt + prefix`` with ``max_tokens`` reduced by the prefix length, and the output is stitched so the
  final response is the old prefix (never regenerated, log-probs kept) followed by the new tokens.

:meth:`load_weights` reloads weights in place through ``collective_rpc`` (the full ``state_dict`` including
the tied ``lm_head``, under the HF checkpoint's names, checked against the checkpoint's names and shapes
first) — the actor→rollout weight sync (§6.2) — and resets the prefix cache (cached blocks hold the old
weights' keys and values); :meth:`receive_weights` does the same from the trainer gang over the weight transport
(:mod:`bidirl.cluster.engines.workers.weight_transport`), bucket by bucket as they arrive. The engine keeps no copy of
the weights it loads. :meth:`offload` / :meth:`onload` are the rollout half of a hot switch (§3.2,
C_in / C_out), in the order vLLM intends:

* switch-out on GPU: ``sleep(level=2)`` — weights and KV cache discarded (the switch-in pushes the current
  weights anyway, so level 1's host copy of the old ones would be made for nothing); until the next
  :meth:`load_weights` / :meth:`receive_weights` the engine refuses to generate;
* switch-in in two phases: ``onload(kv=False)`` wakes the weights (GPU: ``wake_up(tags=["weights"])``), the
  caller loads the current version (:meth:`load_weights` / :meth:`receive_weights`), then ``onload()`` wakes the
  KV cache (``wake_up(tags=["kv_cache"])``) and resets the prefix cache; ``onload()`` alone does both phases;
* on CPU, where vLLM has no sleep mode, the KV cache's memory is released (its storage resized to zero bytes)
  and re-allocated by the KV phase. The CPU path does not free the weights' own memory (vLLM's CPU backend keeps
  them packed in oneDNN handles that only a reload replaces), so they stay as loaded and the weights phase has
  nothing to move.

``last_switch`` says what was moved and times each phase (seconds). The GPU branches follow vLLM 0.32's
``LLM.sleep`` / ``LLM.wake_up`` and are not exercised by the CPU tests.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from bidirl.core.protocol import GroupState
from bidirl.cluster.engines.workers.rollout_routes import RolloutRoutes
from bidirl.cluster.engines.workers.rollout_weights import RolloutWeights
from bidirl.rl.samples import GroupPayload


def cpu_scheduling(max_model_len: int) -> dict:
    """vLLM scheduler settings of a CPU engine: no chunked prefill, a step's token budget of at least one whole
    sequence (vLLM's CPU default, 4,096 tokens, or ``max_model_len`` if longer).

    Each response carries its seed in ``SamplingParams`` (vLLM's sampler then draws from a per-request
    ``torch.Generator`` and never from the global RNG), and vLLM 0.32 rewinds that generator's offset for a request
    whose prefill was split over steps — which a CPU ``torch.Generator`` does not support: the step raises "CPU
    Generator does not use offset". Splits happen as soon as a step's prompts exceed its token budget (32 groups
    of 8 responses with 46-token prompts did), so CPU engines schedule whole prompts only."""
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, int(max_model_len)))


def request_seed(seed: int, group_id: int, index: int) -> int:
    """The sampling seed of response ``index`` of group ``group_id`` (the same when it is resumed)."""
    state = np.random.SeedSequence([int(seed), int(group_id), int(index)]).generate_state(1)
    return int(state[0] & 0x7FFFFFFF)


@dataclass(frozen=True)
class GroupRequest:
    """One group to generate: ``group_size`` responses to ``prompt_ids``, each at most ``max_tokens`` long.

    ``resume`` is the ``GroupState`` an earlier :meth:`RolloutEngine.interrupt` returned for this group
    (its payload must be a ``GroupPayload``); ``meta`` is handed to the engine's ``reward_fn``
    (e.g. the expected answer). ``ignore_eos`` generates exactly ``max_tokens`` tokens per response
    (fixed-length runs for measurements and tests). ``response_tokens`` forces each response's own length
    instead (one entry per response, each in ``[1, max_tokens]``; ``workload.forced_lengths``): response ``i``
    generates exactly ``response_tokens[i]`` tokens, and its reward scores the text before its first EOS.
    """
    group_id: int
    prompt_ids: tuple
    group_size: int
    max_tokens: int
    meta: Any = None
    resume: Optional[GroupState] = None
    ignore_eos: bool = False
    response_tokens: Optional[tuple] = None

    def target_tokens(self, index: int) -> int:
        """How many tokens response ``index`` generates at most (exactly, when forced)."""
        return self.max_tokens if self.response_tokens is None else int(self.response_tokens[index])

    @property
    def forced(self) -> bool:
        """Whether responses ignore EOS (one length for all, or forced lengths per response)."""
        return self.ignore_eos or self.response_tokens is not None


@dataclass
class _Response:
    tokens: list
    logprobs: list
    version: int
    done: bool = False
    finish_reason: Optional[str] = None
    request_id: Optional[str] = None
    routes: Optional[dict] = None       # position → (layers, k) expert ids, when the engine records routes


@dataclass
class _Group:
    request: GroupRequest
    responses: list
    started: float = 0.0

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.responses)


@contextlib.contextmanager
def _preserved_global_rng():
    """Restore Python's, numpy's and torch's global RNG states after the block."""
    import random

    import torch

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class RolloutEngine(RolloutRoutes, RolloutWeights):
    """An interruptible vLLM rollout replica (see the module docstring)."""

    def __init__(self, model_dir: Union[str, Path], seed: int = 0, max_model_len: int = 64,
                 kv_cache_gib: float = 0.0625, *, temperature: float = 1.0, top_p: float = 1.0,
                 reward_fn: Optional[Callable[[Any, str], float]] = None, max_num_seqs: int = 256,
                 device: Optional[str] = None, dtype: Optional[str] = None, tensor_parallel_size: int = 1,
                 enforce_eager: Optional[bool] = None, enable_prefix_caching: bool = True,
                 block_size: Optional[int] = None, memory_bytes: Optional[int] = None, quiet: bool = True,
                 routes: bool = False):
        """``kv_cache_gib``: the KV cache per GPU (the default suits the tiny model standalone; engine runs pass
        the planner's budget, ``bidirl.cluster.engines.rollout_setup``); ``enforce_eager``: ``None`` is eager on
        CPU and CUDA graphs on GPU; ``block_size``: tokens per KV block (``None``: vLLM's default for the
        device); ``memory_bytes`` (GPU): what this engine may take of its device, weights and KV included —
        vLLM's start-up check then asks for that much free memory (``gpu_memory_utilization`` = memory_bytes /
        the device's total) instead of 90 % of it; ``routes`` (a mixture-of-experts model only): record each
        token's expert routes and return them with the tokens (``GroupPayload.routes``; R3, see
        :mod:`bidirl.cluster.engines.workers.rollout_routes`)."""
        from bidirl.perf import memory
        from bidirl.rl import model_folder as checkpoint

        path = checkpoint.model_folder(model_dir, "RolloutEngine.model_dir")
        config = checkpoint.causal_lm_config(path, "RolloutEngine.model_dir")
        if dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"RolloutEngine.dtype must be 'float32', 'bfloat16' or None (by device), got {dtype!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"RolloutEngine.seed must be a non-negative integer, got {seed!r}")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, (int, np.integer)) or max_model_len < 2:
            raise ValueError(f"RolloutEngine.max_model_len must be an integer ≥ 2 (prompt + response tokens), "
                             f"got {max_model_len!r}")
        if not kv_cache_gib > 0:
            raise ValueError(f"RolloutEngine.kv_cache_gib must be > 0, got {kv_cache_gib!r}")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"RolloutEngine.tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"RolloutEngine.block_size must be a positive integer or None, got {block_size!r}")
        if memory_bytes is not None and not memory_bytes > 0:
            raise ValueError(f"RolloutEngine.memory_bytes must be > 0 or None, got {memory_bytes!r}")
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            raise ValueError("RolloutEngine: VLLM_CPU_KVCACHE_SPACE is set, and vLLM would replace the KV cache size "
                             "given (kv_cache_gib) with it; unset it (engine runs take cluster.rollout_kv_cache_gib)")
        if not temperature > 0:
            raise ValueError(f"RolloutEngine.temperature must be > 0 (sampling), got {temperature!r}")
        if top_p != 1.0:
            raise ValueError(f"RolloutEngine.top_p must be 1.0, got {top_p!r}: responses are sampled from the "
                             "full distribution by position-keyed Gumbel-max (bidirl.cluster.engines.workers.sampler)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # in-process engine (no __main__ guard needed)
        if quiet:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        t0 = time.perf_counter()
        import torch
        from vllm import LLM

        from bidirl.cluster.engines.workers.sampler import PositionKeyedSampler

        checkpoint.check_vllm_architecture(path, "RolloutEngine.model_dir")
        self.route_shape = self.route_shape_of(config) if routes else None
        self.tied = checkpoint.tied_embeddings(config)
        self.checkpoint_shapes = checkpoint.checkpoint_shapes(path)
        self.model_dir, self.seed = path, int(seed)
        self.max_model_len = int(max_model_len)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.reward_fn = None                 # set after the warm-up: a user's reward never scores its output
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.gpu = device.startswith("cuda")
        if tensor_parallel_size > 1 and not self.gpu:
            raise ValueError(f"RolloutEngine.tensor_parallel_size={tensor_parallel_size} needs CUDA: vLLM's in-process "
                             "CPU engine runs one worker (distributed_executor_backend='uni')")
        self.dtype = dtype or ("bfloat16" if self.gpu else "float32")
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.enforce_eager = (not self.gpu) if enforce_eager is None else bool(enforce_eager)
        self.prefix_caching = bool(enable_prefix_caching)
        kv_bytes = int(kv_cache_gib * 2**30)
        per_token = memory.attention_kv_bytes(*checkpoint.kv_cache_shape(config),
                                              2 if self.dtype == "bfloat16" else 4, self.tensor_parallel_size)
        block = block_size or memory.KV_BLOCK_TOKENS["cuda" if self.gpu else "cpu"]
        one = memory.sequence_blocks(self.max_model_len, block) * block
        if memory.kv_cache_tokens(kv_bytes, per_token, block) < one:
            raise ValueError(f"RolloutEngine.kv_cache_gib={kv_cache_gib:g} holds "
                             f"{memory.kv_cache_tokens(kv_bytes, per_token, block)} tokens ({per_token} bytes per "
                             f"token, blocks of {block}), fewer than one max_model_len={self.max_model_len} sequence "
                             f"({one} tokens in whole blocks); give at least {one * per_token / 2**30:.4g} GiB")
        kwargs = dict(model=str(path), dtype=self.dtype, enforce_eager=self.enforce_eager,
                      max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
                      distributed_executor_backend="uni" if self.tensor_parallel_size == 1 else "mp",
                      seed=self.seed, enable_prefix_caching=self.prefix_caching,
                      max_num_seqs=int(max_num_seqs), disable_log_stats=True,
                      kv_cache_memory_bytes=kv_bytes, logprobs_mode="raw_logprobs",
                      **({} if self.gpu else cpu_scheduling(self.max_model_len)),
                      logits_processors=[PositionKeyedSampler])
        if block_size is not None:
            kwargs["block_size"] = int(block_size)
        if self.route_shape is not None and self.gpu:
            kwargs["enable_return_routed_experts"] = True  # vLLM records them itself (RequestOutput.routed_experts)
        if self.gpu:
            kwargs["enable_sleep_mode"] = True        # sleep(level=2) / wake_up(tags) for hot switching
            if memory_bytes is not None:
                total = torch.cuda.get_device_properties(torch.device(device)).total_memory
                kwargs["gpu_memory_utilization"] = min(1.0, float(memory_bytes) / total)
        # vLLM collects garbage five times while it starts (each a walk of every object of torch, transformers and
        # vLLM: ≈ 0.25 s of CPU) and freezes the heap when done (vllm.utils.gc_utils.freeze_gc_heap); freezing it
        # before, after one collection, leaves those walks only the objects the engine creates: ≈ 1 s less per start
        gc.collect()
        gc.freeze()
        # in-process vLLM seeds random / numpy / torch globally
        with _preserved_global_rng(), self._eager_steps():
            self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        cache = self.engine.vllm_config.cache_config
        self.kv_block_tokens = int(cache.block_size)
        self._start_route_capture()
        self.kv_cache_tokens = int(cache.num_gpu_blocks or 0) * self.kv_block_tokens    # what vLLM allocated
        from bidirl.rl.tiny_model import load_tokenizer
        self.tokenizer = load_tokenizer(path)
        self.eos_id = self.tokenizer.eos_token_id
        self.version = 0
        self._groups: dict = {}            # group_id -> _Group (in flight or complete, not yet returned)
        self._by_request: dict = {}        # request id -> (group_id, index)
        self._counter = 0
        self._offloaded = False            # the weights are switched out (until onload's weights phase)
        self._kv_released = False          # the KV cache is switched out (until onload's KV phase)
        self._weights_stale = False        # discarded by a level-2 sleep: generation waits for load_weights
        self.steps = 0
        self.generated_tokens = 0
        self.prefix_cached_tokens = 0      # prompt tokens of finished requests served from the prefix cache
        self.last_switch: dict = {}
        self._warm_up()
        self.reward_fn = reward_fn
        self.start_seconds = time.perf_counter() - t0

    def _eager_steps(self):
        """A block in which an eager engine (``enforce_eager``: CPU) compiles nothing.

        vLLM's sampler still wraps its count of logits above the sampled token's (the log-prob rank,
        ``batched_count_greater_than``) in ``torch.compile`` when the engine is eager: tracing and compiling it cost
        ≈ 1.6 s of CPU at the first step of every engine process, for an exact integer count (run eagerly, a batch
        of 256 responses of the tiny model takes the same time). Dynamo is switched off for the block
        (``torch._dynamo.config.disable``, restored after), so the function runs as plain torch. An engine with CUDA
        graphs compiles as vLLM means it to."""
        import torch

        return torch._dynamo.config.patch(disable=True) if self.enforce_eager else contextlib.nullcontext()

    def _warm_up(self) -> None:
        """Run one two-token request through the engine and the sampler at start-up, then forget it.

        A new engine's first generation step is slower than the later ones: one-time kernel and allocator set-up
        (and, were it not for :meth:`_eager_steps`, ≈ 1.6 s of compiling on CPU). Paid here it counts as start-up:
        a fresh engine's first busy period then costs what a kept one's does (``KeptWorkers``), so whether a
        borrowing window finds work left (§4) and what the online profiler's first rollout records say (§5.1)
        do not depend on whether the process is new."""
        token = self.eos_id if self.eos_id is not None else 0
        with _preserved_global_rng():     # as at construction: the warm-up leaves the process's RNGs alone
            self.generate([GroupRequest(group_id=0, prompt_ids=(int(token),), group_size=1,
                                        max_tokens=min(2, self.max_model_len - 1))])
        self.steps = self.generated_tokens = self.prefix_cached_tokens = 0
        self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether any request is in flight."""
        return bool(self._by_request)

    @property
    def group_ids(self) -> list:
        return sorted(self._groups)

    def _params(self, max_tokens: int, seed: int, ignore_eos: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from bidirl.cluster.engines.workers.sampler import SEED_KEY, TEMPERATURE_KEY

        # The processor picks the token; vLLM's sampler (seeded, so it never touches the global RNG) only
        # returns it, and the reported log-probs are the raw policy log-probs.
        return SamplingParams(n=1, max_tokens=int(max_tokens), temperature=1.0, top_p=1.0, top_k=0, seed=int(seed),
                              logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA,
                              ignore_eos=bool(ignore_eos),
                              extra_args={SEED_KEY: int(seed), TEMPERATURE_KEY: self.temperature})

    def start(self, requests: Iterable[GroupRequest]) -> int:
        """Add the requests of ``requests`` (fresh or resumed groups); returns the number of requests added."""
        if self.offloaded:
            raise RuntimeError("RolloutEngine.start: the engine is offloaded; call onload() first")
        if self._weights_stale:
            raise RuntimeError("RolloutEngine.start: the weights were discarded when the engine slept (level 2); "
                               "load_weights() the current version first")
        if self.version is None:
            raise RuntimeError("RolloutEngine.start: a weight transfer broke off and left the weights partly loaded; "
                               "load a version (load_weights / receive_weights) first")
        requests = list(requests)
        for req in requests:
            self._validate(req)
        added = 0
        now = time.perf_counter()
        for req in requests:
            responses = self._initial_responses(req)
            group = _Group(req, responses, now)
            self._groups[req.group_id] = group
            for i, resp in enumerate(responses):
                if resp.done:
                    continue
                remaining = req.target_tokens(i) - len(resp.tokens)
                if remaining <= 0:
                    resp.done, resp.finish_reason = True, "length"
                    continue
                rid = f"g{req.group_id}-r{i}-{self._counter}"
                self._counter += 1
                prompt = list(req.prompt_ids) + list(resp.tokens)
                self.engine.add_request(rid, {"prompt_token_ids": prompt},
                                        self._params(remaining, request_seed(self.seed, req.group_id, i),
                                                     req.forced))
                resp.request_id = rid
                self._by_request[rid] = (req.group_id, i)
                added += 1
        return added

    def _validate(self, req: GroupRequest) -> None:
        if not isinstance(req, GroupRequest):
            raise ValueError(f"RolloutEngine.start expects GroupRequest items, got {type(req).__name__}")
        if req.group_id in self._groups:
            raise ValueError(f"group {req.group_id} is already on this engine; interrupt or collect it first")
        if req.group_size < 1:
            raise ValueError(f"group {req.group_id}: group_size must be ≥ 1, got {req.group_size}")
        if req.max_tokens < 1:
            raise ValueError(f"group {req.group_id}: max_tokens must be ≥ 1, got {req.max_tokens}")
        if not req.prompt_ids:
            raise ValueError(f"group {req.group_id}: prompt_ids is empty")
        if req.response_tokens is not None and (
                len(req.response_tokens) != req.group_size
                or any(not 1 <= int(n) <= req.max_tokens for n in req.response_tokens)):
            raise ValueError(f"group {req.group_id}: response_tokens must give each of the {req.group_size} "
                             f"responses a length in [1, max_tokens={req.max_tokens}], got {req.response_tokens}")
        if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
            raise ValueError(f"group {req.group_id}: prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                             f"({req.max_tokens}) exceeds max_model_len={self.max_model_len}; lower max_tokens "
                             "or start the engine with a larger max_model_len")
        if req.resume is not None:
            p = req.resume.payload
            if not isinstance(p, GroupPayload):
                raise ValueError(f"group {req.group_id}: resume.payload must be a GroupPayload "
                                 "(the state RolloutEngine.interrupt returned)")
            if len(p.token_ids) != req.group_size or req.resume.group_id != req.group_id:
                raise ValueError(f"group {req.group_id}: resume state is for group {req.resume.group_id} with "
                                 f"{len(p.token_ids)} responses, not {req.group_size}")
            if tuple(p.prompt_ids) != tuple(req.prompt_ids):
                raise ValueError(f"group {req.group_id}: resume state has a different prompt")

    def _initial_responses(self, req: GroupRequest) -> list:
        routes = self.route_shape is not None
        if req.resume is None:
            return [_Response([], [], self.version, routes={} if routes else None) for _ in range(req.group_size)]
        p = req.resume.payload
        if routes and p.routes is None:
            raise ValueError(f"group {req.group_id}: the resume state has no routes, and this engine records them "
                             "(a resumed response's routes continue its prefix's); resume it on an engine that "
                             "records routes from the start")
        out = []
        for i in range(req.group_size):
            tokens, lps = list(p.token_ids[i]), list(p.logprobs[i])
            version = int(p.versions[i]) if tokens else self.version
            done = bool(req.resume.done[i])
            # the prefix keeps the routes it was generated with: a resumed sequence's routes are the concatenation
            rows = dict(enumerate(p.routes[i])) if routes else None
            out.append(_Response(tokens, lps, version, done, p.finish_reasons[i] if done else None, routes=rows))
        return out

    def step_until(self, stop: Optional[Callable[[list], bool]] = None, max_steps: Optional[int] = None,
                   max_seconds: Optional[float] = None) -> list:
        """Run engine steps; return the groups that completed (each returned once, then forgotten).

        Stops when nothing is in flight, after ``max_steps`` steps, after ``max_seconds`` of wall time, or
        when ``stop(completed_so_far)`` returns true (checked after each step).
        """
        completed = self._collect_complete()
        if stop is not None and completed and stop(completed):
            return completed
        t0 = time.perf_counter()
        n = 0
        while self._by_request:
            if max_steps is not None and n >= max_steps:
                break
            if max_seconds is not None and time.perf_counter() - t0 >= max_seconds:
                break
            with self._eager_steps():
                outputs = self.engine.step()
            n += 1
            self.steps += 1
            for out in outputs:
                self._absorb(out)
            done = self._collect_complete()
            completed += done
            if stop is not None and done and stop(completed):
                break
        if not self._by_request and self.engine.has_unfinished_requests():
            raise RuntimeError("RolloutEngine: vLLM reports unfinished requests this engine does not track")
        return completed

    def _absorb(self, out) -> None:
        key = self._by_request.get(out.request_id)
        if key is None:
            return
        gid, i = key
        resp = self._groups[gid].responses[i]
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        if ids:
            if comp.logprobs is None or len(comp.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no per-token log-probs; requests must use logprobs=0")
            resp.tokens += ids
            resp.logprobs += [float(d[t].logprob) for t, d in zip(ids, comp.logprobs)]
            self.generated_tokens += len(ids)
        if out.finished:
            self._take_routes(gid, resp, out.request_id, comp)
            self.prefix_cached_tokens += int(getattr(out, "num_cached_tokens", None) or 0)
            resp.done = True
            resp.finish_reason = comp.finish_reason or ("stop" if resp.tokens and resp.tokens[-1] == self.eos_id
                                                         else "length")
            resp.request_id = None
            del self._by_request[out.request_id]

    def _collect_complete(self) -> list:
        ready = [gid for gid, g in self._groups.items() if g.complete]
        return [self._state(self._groups.pop(gid)) for gid in sorted(ready)]

    def _state(self, group: _Group) -> GroupState:
        req = group.request
        rs = group.responses
        texts = rewards = None
        if self.reward_fn is not None:
            from bidirl.rl.rewards import score_response
            texts = tuple(self.tokenizer.decode(self._scored_tokens(req, r.tokens), skip_special_tokens=True)
                          for r in rs)
            rewards = tuple(score_response(self.reward_fn, req.meta, t, req.group_id, i) if r.done else float("nan")
                            for i, (r, t) in enumerate(zip(rs, texts)))
        payload = GroupPayload(
            prompt_ids=tuple(req.prompt_ids), token_ids=tuple(tuple(r.tokens) for r in rs),
            logprobs=tuple(tuple(r.logprobs) for r in rs), versions=tuple(r.version for r in rs),
            finish_reasons=tuple(r.finish_reason for r in rs), max_tokens=req.max_tokens,
            texts=texts, rewards=rewards, meta=req.meta,
            routes=None if self.route_shape is None else tuple(self._routes_of(req, r) for r in rs))
        return GroupState(group_id=req.group_id, prompt_len=len(req.prompt_ids),
                          generated=tuple(len(r.tokens) for r in rs), done=tuple(r.done for r in rs),
                          version=min(r.version for r in rs), payload=payload)

    def _scored_tokens(self, req: GroupRequest, tokens: list) -> list:
        """The tokens a reward scores: with forced lengths only those before the first EOS (the answer the
        model gave; what follows stands in for a longer response's work), else all of them."""
        if req.response_tokens is not None and self.eos_id in tokens:
            return tokens[:tokens.index(self.eos_id)]
        return tokens

    def interrupt(self, group_ids: Optional[Sequence[int]] = None, missing_ok: bool = False) -> list:
        """Abort the listed groups (``None``: all) and return their states (complete ones included).

        ``missing_ok`` skips listed groups that are not on the engine (already returned as complete: a
        driver's interrupt can cross a completion in flight) instead of raising.
        """
        targets = sorted(self._groups) if group_ids is None else [int(g) for g in group_ids]
        unknown = [g for g in targets if g not in self._groups]
        if missing_ok:
            targets = [g for g in targets if g in self._groups]
        elif unknown:
            raise ValueError(f"interrupt: groups {unknown} are not on this engine (on it: {sorted(self._groups)})")
        abort = []
        for gid in targets:
            for r in self._groups[gid].responses:
                if r.request_id is not None:
                    self._take_routes(gid, r, r.request_id, None)
                    abort.append(r.request_id)
                    del self._by_request[r.request_id]
                    r.request_id = None
        if abort:
            self.engine.abort_request(abort)
        return [self._state(self._groups.pop(gid)) for gid in targets]

    def generate(self, requests: Iterable[GroupRequest]) -> list:
        """Start ``requests`` and run until all complete; returns their states in group-id order."""
        self.start(requests)
        return sorted(self.step_until(), key=lambda s: s.group_id)

    def shutdown(self) -> None:
        """Abort everything and drop the engine (frees its memory once garbage-collected)."""
        if getattr(self, "engine", None) is not None and self._by_request:
            self.engine.abort_request(list(self._by_request))
        self._by_request.clear()
        self._groups.clear()
        self.engine = None
        self.llm = None
