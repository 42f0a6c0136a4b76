"""RL pieces shared by every data plane: GRPO math, the built-in verifiable task, the tiny model.

* ``bidirl.rl.grpo``       group advantages, clipped policy loss, k3 KL (pure torch)
* ``bidirl.rl.tasks``      ``ArithmeticTask``: seeded prompts, exact-match reward
* ``bidirl.rl.tiny_model`` character tokenizer + 2-layer Qwen2 (default) or Llama configs, ``create(dir, seed)``
* ``bidirl.rl.bootstrap``  supervised warm start, ``ensure_tiny_model()`` cache
* ``bidirl.rl.samples``    ``GroupPayload`` / ``Sample`` records between rollout and training
* ``bidirl.rl.data``       prompt files (veRL's parquet layout, plain JSONL), prompt token ids, group → prompt
* ``bidirl.rl.rewards``    rule rewards (exact, last number, boxed) and veRL ``compute_score`` functions
* ``bidirl.rl.word_problems``  the sample prompt file's generator (arithmetic word problems, veRL layout)
* ``bidirl.rl.model_folder``  a local Hugging Face causal-LM folder: checks, config, weight names

The synchronous on-policy GRPO loop over the two engines (the reference run) is
``bidirl.cluster.engines.sync_grpo.run_grpo``: it needs the engines, a layer above this one.

Submodules are imported on use (torch and transformers are heavy); ``ArithmeticTask`` and
``ensure_tiny_model`` are re-exported lazily.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ArithmeticTask": "bidirl.rl.tasks",
    "Problem": "bidirl.rl.tasks",
    "ensure_tiny_model": "bidirl.rl.bootstrap",
    "GroupPayload": "bidirl.rl.samples",
    "Sample": "bidirl.rl.samples",
    "samples_from_groups": "bidirl.rl.samples",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bidirl.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
