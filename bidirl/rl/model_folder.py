"""A model folder both engines load, and the names its weights travel under.

The rollout engine (vLLM) and the trainer engine (transformers) load the same local checkpoint folder — a
``save_pretrained`` folder of any causal LM both libraries support (``config.json``, ``*.safetensors`` or
``pytorch_model*.bin``, tokenizer files). This module checks such a folder up front, so a bad one fails with
a message that names the folder, what is wrong and the fix, instead of deep inside either library:

* :func:`model_folder` — the folder exists and holds ``config.json`` and weight files;
* :func:`causal_lm_config` — transformers can read the config and has a causal-LM class for it
  (``AutoModelForCausalLM``); :func:`load_causal_lm` loads it, :func:`empty_causal_lm` builds it with its
  parameters on the meta device and :func:`checkpoint_slices` reads parts of the stored tensors (a sharded gang's
  rank reads only its rows: ``bidirl.cluster.engines.workers.trainer``);
* :func:`check_vllm_architecture` — vLLM has a model class for one of the config's ``architectures``;
* :func:`load_tokenizer` — the tokenizer (prompts go through its chat template where the data asks for one:
  ``bidirl.rl.data``).

**Weight names.** The trainer sends its weights to vLLM under the names of the HF checkpoint: transformers'
``state_dict()`` names are the ``save_pretrained`` names, and vLLM's ``load_weights`` of an HF-format model
takes checkpoint names (and maps them to its fused modules itself). :func:`hf_weights` strips the prefixes
that module wrappers add (``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, ``_fsdp_wrapped_module.``
of FSDP1, ``_checkpoint_wrapped_module.`` of activation checkpointing; FSDP2 adds none) and adds the tied
``lm_head.weight`` when the model ties it to the input embedding but the state lacks it (vLLM's in-place
reload refreshes the head only when its name is loaded: without it the head stayed stale on the CPU backend).
:func:`check_weights` compares names and shapes with the checkpoint's own, so weights of another model
are refused with the names that differ rather than half-loaded.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from bidirl.errors import BidirlError

#: fragments module wrappers insert into parameter names (removed wherever they appear)
WRAPPER_FRAGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
#: a prefix that data-parallel wrappers put in front of every name
WRAPPER_PREFIX = "module."
#: checkpoint entries that are not weights of the model (older Llama checkpoints store RoPE's inv_freq)
NON_WEIGHT_SUFFIXES = (".rotary_emb.inv_freq",)
#: the marker file of the built-in tiny model (``bidirl.rl.tiny_model.create``)
TINY_MARKER = "bidirl_tiny.json"


class ModelFolderError(BidirlError, ValueError):
    """A model folder that the engines cannot load; the message names the folder, the problem and the fix."""


def model_folder(model_dir: Union[str, Path], who: str = "model_dir") -> Path:
    """``model_dir`` as a ``Path`` after checking that it holds ``config.json`` and weight files."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelFolderError(f"{who} {str(path)!r} is not a folder; pass a local checkpoint folder "
                               "(save_pretrained), e.g. bidirl.rl.bootstrap.ensure_tiny_model()")
    if not (path / "config.json").exists():
        raise ModelFolderError(f"{who} {str(path)!r} holds no config.json; pass a transformers checkpoint folder "
                               "(save_pretrained) or create the built-in tiny model first "
                               "(bidirl.rl.bootstrap.ensure_tiny_model())")
    if not weight_files(path):
        raise ModelFolderError(f"{who} {str(path)!r} holds no weights (*.safetensors or pytorch_model*.bin); "
                               "save the model with save_pretrained into this folder")
    return path


def weight_files(model_dir: Path) -> list:
    """The checkpoint's weight files: safetensors if any, else PyTorch ``.bin`` files, sorted by name."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return files or sorted(Path(model_dir).glob("pytorch_model*.bin"))


def causal_lm_config(model_dir: Union[str, Path], who: str = "model_dir"):
    """The model's transformers config, after checking that ``AutoModelForCausalLM`` can build it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = model_folder(model_dir, who)
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        model_type = _raw_config(path).get("model_type")
        raise ModelFolderError(f"{who} {str(path)!r}: transformers cannot read its config.json (model_type "
                               f"{model_type!r}): {exc}; use a model type this transformers version supports "
                               "or upgrade transformers") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelFolderError(f"{who} {str(path)!r}: model_type {config.model_type!r} "
                               f"(architectures {getattr(config, 'architectures', None)}) has no causal-LM class in "
                               "transformers (AutoModelForCausalLM); RL post-training needs a decoder language model")
    return config


def model_identity(model_dir: Union[str, Path]) -> dict:
    """What identifies the model a run trains (a run checkpoint records it; ``bidirl.runtime.checkpoints``): its
    architectures, the SHA-256 of its ``config.json`` and its weight files' names and sizes (not their contents:
    hashing a large model at every checkpoint would cost minutes). The folder's path is not part of it."""
    import hashlib

    path = model_folder(model_dir)
    return {"architectures": list(_raw_config(path).get("architectures") or []),
            "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
            "weight_files": {f.name: f.stat().st_size for f in weight_files(path)}}


def _raw_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def tied_embeddings(config) -> bool:
    """Whether the model ties its output head to its input embedding."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def kv_cache_shape(config) -> tuple:
    """``(layers, KV heads, head dimension)`` of a causal LM's attention (its text model's): a token's KV cache is
    ``2 · layers · kv_heads · head_dim`` values (keys and values; ``bidirl.perf.memory.attention_kv_bytes``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads, head_dim


def load_causal_lm(model_dir: Union[str, Path], dtype, who: str = "model_dir"):
    """``AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)`` on CPU after :func:`causal_lm_config`."""
    from transformers import AutoModelForCausalLM

    config = causal_lm_config(model_dir, who)
    return AutoModelForCausalLM.from_pretrained(Path(model_dir), config=config, dtype=dtype)


def empty_causal_lm(model_dir: Union[str, Path], dtype, who: str = "model_dir"):
    """The checkpoint's model with its parameters on the meta device (no memory, nothing read) and its buffers as its
    constructor computes them, on CPU: a non-persistent buffer (RoPE's ``inv_freq``) has no checkpoint entry to fill
    it from, and a buffer is small. How a rank of a sharded gang builds the model before it reads its shard."""
    import torch
    from transformers import AutoModelForCausalLM

    config = causal_lm_config(model_dir, who)
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:       # the constructor's (empty) CPU tensor is dropped at once
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)
    torch.nn.Module.register_parameter = on_meta          # initialisers then run on meta tensors: no work
    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.nn.Module.register_parameter = register


def check_vllm_architecture(model_dir: Union[str, Path], who: str = "model_dir") -> str:
    """The first of the config's ``architectures`` that vLLM implements; raises if it implements none."""
    from vllm import ModelRegistry

    path = model_folder(model_dir, who)
    archs = _raw_config(path).get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    for arch in archs:
        if arch in supported:
            return arch
    raise ModelFolderError(f"{who} {str(path)!r}: vLLM implements none of the architectures {archs} named in "
                           "config.json; use a model vLLM supports (vllm.ModelRegistry.get_supported_archs())")


def transformer_blocks(model) -> list:
    """The model's repeated transformer blocks (FSDP2 shards each one as a unit).

    transformers names the block class in ``_no_split_modules`` (e.g. ``Qwen2DecoderLayer``); a model without
    it falls back to the longest ``ModuleList`` of the model.
    """
    import torch

    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------

def load_tokenizer(model_dir: Union[str, Path]):
    """The folder's tokenizer: the built-in tiny model's character tokenizer as built, else ``AutoTokenizer``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(model_dir)
    if (path / TINY_MARKER).exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFolderError(f"model_dir {str(path)!r}: no tokenizer transformers can load ({exc}); save the "
                               "model's tokenizer into the folder (tokenizer.save_pretrained)") from None


# --------------------------------------------------------------------------------------------------
# weight names
# --------------------------------------------------------------------------------------------------

def hf_name(name: str) -> str:
    """A parameter name as the HF checkpoint spells it (wrapper prefixes and fragments removed)."""
    for fragment in WRAPPER_FRAGMENTS:
        name = name.replace(fragment, "")
    while name.startswith(WRAPPER_PREFIX):
        name = name[len(WRAPPER_PREFIX):]
    return name


def hf_weights(state: Union[Mapping, Iterable], tied: bool) -> dict:
    """``{checkpoint name: tensor}`` from a trainer's ``state_dict`` (or ``(name, tensor)`` items).

    Wrapper prefixes are removed; with ``tied`` the output head is added as ``lm_head.weight`` (the input
    embedding) when the state lacks it. Two names that map to one checkpoint name raise.
    """
    items = state.items() if isinstance(state, Mapping) else state
    out: dict = {}
    for name, tensor in items:
        key = hf_name(str(name))
        if key in out and out[key] is not tensor:
            raise ValueError(f"weights: {name!r} and another entry both map to checkpoint name {key!r}")
        out[key] = tensor
    if tied and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


#: transformers 5 holds an MoE layer's routed experts fused — ``<layer>.mlp.experts.gate_up_proj`` ``[E, 2·I, H]``
#: (each expert's gate rows, then its up rows) and ``<layer>.mlp.experts.down_proj`` ``[E, H, I]`` — while checkpoints
#: (``save_pretrained`` converts back) and vLLM's loader name them per expert: ``<layer>.mlp.experts.<e>.gate_proj.weight``,
#: ``….up_proj.weight``, ``….down_proj.weight``
FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def split_experts(weights: Mapping) -> dict:
    """``weights`` with every fused expert tensor (:data:`FUSED_EXPERTS`) replaced by its per-expert checkpoint
    entries (views, no copies); other entries as they are."""
    out: dict = {}
    for key, t in weights.items():
        if key.endswith(FUSED_EXPERTS[0]) and t.dim() == 3:
            base, half = key[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        elif key.endswith(FUSED_EXPERTS[1]) and t.dim() == 3:
            base = key[:-len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return out


def fuse_experts(weights: Mapping, names: Iterable) -> dict:
    """The inverse of :func:`split_experts` for a model whose parameter names are ``names``: the per-expert entries
    of each fused name stacked into it (experts ``0 … E − 1``, all present, else ValueError naming the first
    missing); other entries as they are."""
    import torch

    out = dict(weights)
    for name in names:
        if not name.endswith(FUSED_EXPERTS):
            continue
        base = name[:name.rindex(".") + 1]
        parts = ("gate_proj", "up_proj") if name.endswith(FUSED_EXPERTS[0]) else ("down_proj",)
        count = sum(1 for k in weights if k.startswith(base) and k.endswith(f".{parts[0]}.weight")
                    and k[len(base):].split(".")[0].isdigit())
        if not count:
            continue                                  # given fused already (or not at all: the caller's check)
        rows = []
        for e in range(count):
            keys = [f"{base}{e}.{p}.weight" for p in parts]
            missing = [k for k in keys if k not in weights]
            if missing:
                raise ValueError(f"weights: {missing[0]!r} is missing (experts of {name!r} are stored per expert)")
            rows.append(torch.cat([out.pop(k) for k in keys]) if len(keys) > 1 else out.pop(keys[0]))
        out[name] = torch.stack(rows)
    return out


def checkpoint_shapes(model_dir: Union[str, Path]) -> dict:
    """``{name: shape}`` of every tensor stored in the checkpoint (read from file headers, no weights loaded)."""
    import torch

    shapes: dict = {}
    for f in weight_files(Path(model_dir)):
        if f.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():
                    shapes[k] = tuple(handle.get_slice(k).get_shape())
        else:
            for k, v in torch.load(str(f), map_location="cpu", mmap=True, weights_only=True).items():
                shapes[k] = tuple(v.shape)
    return shapes


@contextmanager
def checkpoint_slices(model_dir: Union[str, Path]):
    """``{name: tensor-like}`` over every tensor stored in the checkpoint, where indexing one (``t[rows, cols]``, a
    tuple of slices) reads only that part from the file: a safetensors slice (``safe_open(...).get_slice``), or a
    ``.bin`` file's tensor memory-mapped. How a rank of a sharded gang reads only the rows it holds; valid inside the
    block."""
    import torch

    with ExitStack() as files:
        out: dict = {}
        for f in weight_files(Path(model_dir)):
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                handle = files.enter_context(safe_open(str(f), framework="pt"))
                out.update({k: handle.get_slice(k) for k in handle.keys()})
            else:
                out.update(torch.load(str(f), map_location="cpu", mmap=True, weights_only=True))
        yield out


def checkpoint_weights(model_dir: Union[str, Path], tied: bool) -> list:
    """The checkpoint's weights as ``(name, tensor)`` items in file order (the tied head added, as sent)."""
    import torch

    items = []
    for f in weight_files(Path(model_dir)):
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file
            items += [(k, v.clone()) for k, v in load_file(str(f)).items()]
        else:
            items += list(torch.load(str(f), map_location="cpu", weights_only=True).items())
    return list(hf_weights(items, tied).items())


def check_weights(weights: Mapping, expected: Mapping, tied: bool, where: str,
                  fix: Optional[str] = None) -> None:
    """Raise unless ``weights`` (``{name: tensor}``) has exactly the checkpoint's names and shapes.

    ``expected`` is :func:`checkpoint_shapes` of the checkpoint; the tied head may be present though the
    checkpoint stores it once; entries that are not weights (:data:`NON_WEIGHT_SUFFIXES`) may be absent.
    """
    allowed = dict(expected)
    if tied and "model.embed_tokens.weight" in allowed:
        allowed.setdefault("lm_head.weight", allowed["model.embed_tokens.weight"])
    unexpected = sorted(k for k in weights if k not in allowed)
    missing = sorted(k for k in expected if k not in weights and not k.endswith(NON_WEIGHT_SUFFIXES))
    wrong = sorted(f"{k} {tuple(weights[k].shape)} != {tuple(allowed[k])}" for k in weights
                   if k in allowed and tuple(weights[k].shape) != tuple(allowed[k]))
    if unexpected or missing or wrong:
        parts = [f"{label} {vals[:5]}{' ...' if len(vals) > 5 else ''}" for label, vals in
                 (("unexpected names", unexpected), ("missing names", missing), ("shape mismatches", wrong)) if vals]
        raise ValueError(f"{where}: the weights do not match the checkpoint: {'; '.join(parts)}; "
                         f"{fix or 'pass the state_dict() of a trainer of this model'}")
