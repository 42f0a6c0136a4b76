"""A short deterministic supervised warm start of the tiny model, and a cache that builds it once.

RL post-training (paper §2.1) starts from a model that already solves part of the task: GRPO's group-
normalised advantages vanish when every response of a group gets the same reward, so a freshly
initialised model (reward ≈ 0 everywhere) gives no signal. :func:`warm_start` trains the tiny model for a
few hundred AdamW steps on ``prompt + answer + EOS`` (cross-entropy on the answer and EOS only) until it
solves a fraction of the arithmetic task when sampling at temperature 1; GRPO then has room to improve.

:func:`ensure_tiny_model` creates + warm-starts the model once into a cache folder (``$BIDIRL_CACHE`` or
``~/.cache/bidirl``) keyed by a hash of everything that determines the weights, under a file lock, so
parallel test processes and Ray workers share one copy.

Both built-in architectures (``bidirl.rl.tiny_model.ARCHITECTURES``: the default Qwen2 and the tiny Llama)
are built and warm-started the same way.

Command line: ``python -m bidirl.rl.bootstrap --out DIR [--seed 0] [--steps 180] [--architecture llama]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

from bidirl.rl import tiny_model
from bidirl.rl.model_folder import TINY_MARKER
from bidirl.rl.tasks import ArithmeticTask

#: bump when something outside :data:`BUILD_MODULES` changes the weights (invalidates caches)
SCRIPT_VERSION = 1
#: the modules whose code determines the warm-started weights: their source is part of the cache key, so a cached
#: model is always the one the installed code would build (tests take it from the cache too)
BUILD_MODULES = ("bidirl.rl.bootstrap", "bidirl.rl.tiny_model", "bidirl.rl.tasks")


@dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start settings. ``data_seed`` picks the training problems (a different stream
    from the RL prompts' task seed)."""
    steps: int = 180
    batch_size: int = 128
    lr: float = 3e-3
    data_seed: int = 1000
    max_operand: int = ArithmeticTask.max_operand
    ops: str = ArithmeticTask.ops

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "steps" else 1):
                raise ValueError(f"WarmStart.{name} must be a {'non-negative' if name == 'steps' else 'positive'} "
                                 f"integer, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"WarmStart.lr must be > 0, got {self.lr!r}")

    def task(self) -> ArithmeticTask:
        return ArithmeticTask(seed=self.data_seed, max_operand=self.max_operand, ops=self.ops)


def _batch(tok, problems):
    import torch

    ids, labels = [], []
    for p in problems:
        prompt = tok(p.text).input_ids
        answer = tok(p.answer).input_ids + [tok.eos_token_id]
        ids.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in ids)
    pad = tok.pad_token_id
    x = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
    y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    m = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    return x, y, m


@contextlib.contextmanager
def torch_threads(n: Optional[int]):
    """Run a block with ``n`` intra-op torch threads (``None``: unchanged), restoring the count after.

    On a 2-core machine shared with other processes one thread is several times faster than two for a
    model this small (two OpenMP threads wait on each other when a core is busy elsewhere).
    """
    import torch

    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive integer or None, got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start(model_dir: Union[str, Path], spec: WarmStart = WarmStart(), progress: bool = False,
               threads: Optional[int] = 1) -> dict:
    """Train the model in ``model_dir`` in place on the task for ``spec.steps`` steps; returns statistics.

    Deterministic for a given ``model_dir`` content and ``spec`` on a given machine (no dropout, fixed
    data stream, fixed batch order).
    """
    with torch_threads(threads):
        return _warm_start(model_dir, spec, progress)


def _warm_start(model_dir, spec, progress) -> dict:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    tok = tiny_model.load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    task = spec.task()
    t0 = time.perf_counter()
    losses = []
    for step in tqdm(range(spec.steps), desc="warm start", disable=not progress):
        x, y, m = _batch(tok, task.prompts(spec.batch_size, start=step * spec.batch_size))
        loss = model(input_ids=x, attention_mask=m, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    model.eval()
    tiny_model.save(model, model_dir)
    return {"steps": spec.steps, "seconds": seconds, "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None}


def sample_reward(model_dir: Union[str, Path], task: ArithmeticTask, n: int = 256, temperature: float = 1.0,
                  seed: int = 0, max_new_tokens: int = 8) -> float:
    """Mean exact-match reward of ``n`` sampled responses (transformers ``generate``, forked RNG)."""
    with torch_threads(1):
        return _sample_reward(model_dir, task, n, temperature, seed, max_new_tokens)


def _sample_reward(model_dir, task, n, temperature, seed, max_new_tokens) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    tok = tiny_model.load_tokenizer(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    problems = task.prompts(n)
    enc = tok([p.text for p in problems], return_tensors="pt", padding=True)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        kwargs = dict(do_sample=True, temperature=temperature, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, **kwargs)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return float(task.rewards([p.answer for p in problems], texts).mean())


def build(out: Union[str, Path], seed: int = 0, spec: WarmStart = WarmStart(),
          cfg: tiny_model.TinyConfig = tiny_model.TinyConfig(), progress: bool = False,
          evaluate: bool = True) -> dict:
    """Create the tiny model in ``out`` and warm-start it; records the summary in ``out`` under
    :data:`~bidirl.rl.model_folder.TINY_MARKER`."""
    out = Path(out)
    if isinstance(cfg, tiny_model.TinyMoeConfig):
        tiny_model.create_moe(out, seed=seed, cfg=cfg)
    else:
        tiny_model.create(out, seed=seed, cfg=cfg)
    stats = warm_start(out, spec, progress=progress)
    if evaluate:
        eval_task = ArithmeticTask(seed=0, max_operand=spec.max_operand, ops=spec.ops)
        stats["sample_reward"] = sample_reward(out, eval_task, temperature=1.0)
        stats["greedy_reward"] = sample_reward(out, eval_task, temperature=0.0)
    info_path = out / TINY_MARKER
    info = json.loads(info_path.read_text())
    info.update({"warm_start": asdict(spec), "warm_start_stats": stats, "script_version": SCRIPT_VERSION})
    info_path.write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


def cache_key(seed: int = 0, spec: WarmStart = WarmStart(), cfg: tiny_model.TinyConfig = tiny_model.TinyConfig()) -> str:
    """A hash of everything that determines the warm-started weights.

    That is the seed, the warm-start settings, the model's configuration and vocabulary, and the source of
    :data:`BUILD_MODULES` (any change to them builds anew; :data:`SCRIPT_VERSION` stays for what they cannot
    see). The default Qwen2 model's key leaves out ``architecture`` and ``tie_word_embeddings`` (they do not
    change its weights).
    """
    config = cfg.to_dict()
    if isinstance(cfg, tiny_model.TinyMoeConfig):
        config["moe"] = True
    elif cfg.architecture == "qwen2" and cfg.tie_word_embeddings:
        del config["architecture"], config["tie_word_embeddings"]
    source = hashlib.sha256()
    for name in BUILD_MODULES:
        source.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    blob = json.dumps({"seed": seed, "warm_start": asdict(spec), "config": config,
                       "vocabulary": tiny_model.vocabulary(cfg.vocab_size), "script_version": SCRIPT_VERSION,
                       "source": source.hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_root(cache_dir: Optional[Union[str, Path]] = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("BIDIRL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bidirl"


def ensure_tiny_model(cache_dir: Optional[Union[str, Path]] = None, seed: int = 0, spec: WarmStart = WarmStart(),
                      cfg: tiny_model.TinyConfig = tiny_model.TinyConfig(), progress: bool = False) -> Path:
    """The warm-started tiny model's folder, building it on first use (safe across processes).

    The folder is ``<cache>/tiny-<key>`` (``tiny-<architecture>-<key>`` for an architecture other than the
    default Qwen2, ``tiny-moe-<key>`` for the mixture-of-experts model, ``cfg`` a ``TinyMoeConfig``) with ``<key>``
    from :func:`cache_key`. A build happens in a temporary folder under an exclusive ``fcntl`` lock and is renamed
    into place when complete, so a reader never sees a half-written model.
    """
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(seed, spec, cfg)
    architecture = "moe" if isinstance(cfg, tiny_model.TinyMoeConfig) else cfg.architecture
    name = f"tiny-{key}" if architecture == "qwen2" else f"tiny-{architecture}-{key}"
    final = root / name
    if (final / TINY_MARKER).exists():
        return final
    with open(root / f".tiny-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / TINY_MARKER).exists():
                return final
            tmp = root / f".tiny-{key}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp, seed=seed, spec=spec, cfg=cfg, progress=progress)
            if final.exists():               # a stale, incomplete folder from an interrupted older layout
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bidirl.rl.bootstrap",
                                 description="Create a tiny model and warm-start it on the arithmetic task.")
    ap.add_argument("--out", required=True, help="folder to write the transformers checkpoint to")
    ap.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    ap.add_argument("--steps", type=int, default=WarmStart.steps, help=f"warm-start steps (default {WarmStart.steps})")
    ap.add_argument("--architecture", choices=tiny_model.ARCHITECTURES, default="qwen2",
                    help="the tiny model's architecture (default qwen2)")
    ap.add_argument("--no-eval", action="store_true", help="skip measuring the sampled reward afterwards")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error("--seed must be ≥ 0")
    try:
        spec = WarmStart(steps=args.steps)
    except ValueError as exc:
        ap.error(str(exc))
    info = build(args.out, seed=args.seed, spec=spec, cfg=tiny_model.config_for(args.architecture), progress=True,
                 evaluate=not args.no_eval)
    json.dump(info, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
