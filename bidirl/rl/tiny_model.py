"""The built-in tiny actors: a character-level tokenizer and 2-layer decoders of two architectures.

Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library over the arithmetic task's
alphabet (``bidirl.rl.tasks.ALPHABET``) plus special tokens, and the model is a freshly initialised
``Qwen2ForCausalLM`` (the default: the architecture family the paper trains, §7.1, at toy size; tied
embeddings, biased q/k/v projections) or ``LlamaForCausalLM`` (:data:`TINY_LLAMA`: an untied output head, no
biases), both sharing the tokenizer. :func:`create` writes a standard transformers checkpoint folder
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``generation_config.json``) that vLLM (rollout)
and transformers (trainer) both load, so the same weights run on both engines as in the paper's prototype
(§6.1).

Every id of the model's vocabulary is a token of the tokenizer (unused ids are named ``<|extra_i|>``
special tokens), so anything the model samples can be decoded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

from bidirl.rl.model_folder import TINY_MARKER
from bidirl.rl.tasks import ALPHABET

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
SPECIAL_TOKENS: tuple = (PAD, EOS, UNK)
#: the architectures :func:`create` builds (``TinyConfig.architecture``)
ARCHITECTURES = ("qwen2", "llama")


@dataclass(frozen=True)
class TinyConfig:
    """Architecture of the tiny model (the Qwen2 default is mirrored in ``data/presets/models/tiny.yaml``)."""
    vocab_size: int = 32
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    architecture: str = "qwen2"
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"TinyConfig.architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        need = len(SPECIAL_TOKENS) + len(ALPHABET)
        if self.vocab_size < need:
            raise ValueError(f"TinyConfig.vocab_size must be ≥ {need} (special tokens + task alphabet), "
                             f"got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"TinyConfig.hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"TinyConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")

    def to_dict(self) -> dict:
        return asdict(self)


#: the second built-in architecture: a tiny Llama with an untied output head (same sizes and tokenizer)
TINY_LLAMA = TinyConfig(architecture="llama", tie_word_embeddings=False)


def config_for(architecture: str) -> TinyConfig:
    """The built-in tiny model of ``architecture`` (``"qwen2"``: the default, ``"llama"``: :data:`TINY_LLAMA`)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    return TINY_LLAMA if architecture == "llama" else TinyConfig()


def vocabulary(vocab_size: int = TinyConfig.vocab_size) -> dict:
    """Token → id: special tokens first, then the task alphabet, then ``<|extra_i|>`` up to ``vocab_size``."""
    tokens = list(SPECIAL_TOKENS) + list(ALPHABET)
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(vocab_size: int = TinyConfig.vocab_size):
    """A character-level ``PreTrainedTokenizerFast`` (one token per character, no BOS, EOS ends a response)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = [t for t in vocab if t.startswith("<|")]
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                   model_max_length=TinyConfig.max_position_embeddings, padding_side="right")


def _common_config(cfg: TinyConfig) -> dict:
    vocab = vocabulary(cfg.vocab_size)
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
                initializer_range=cfg.initializer_range, tie_word_embeddings=cfg.tie_word_embeddings,
                eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], bos_token_id=None, dtype="float32")


def qwen2_config(cfg: TinyConfig = TinyConfig()):
    """The transformers ``Qwen2Config`` of ``cfg`` (fp32, EOS/PAD ids of the tokenizer, no sliding window)."""
    from transformers import Qwen2Config

    return Qwen2Config(use_sliding_window=False, **_common_config(cfg))


def llama_config(cfg: TinyConfig = TINY_LLAMA):
    """The transformers ``LlamaConfig`` of ``cfg`` (fp32, EOS/PAD ids of the tokenizer, no biases)."""
    from transformers import LlamaConfig

    return LlamaConfig(attention_bias=False, mlp_bias=False, **_common_config(cfg))


def transformers_model(cfg: TinyConfig):
    """A freshly initialised transformers model of ``cfg`` (draws from torch's global RNG)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    if cfg.architecture == "llama":
        return LlamaForCausalLM(llama_config(cfg))
    return Qwen2ForCausalLM(qwen2_config(cfg))


def parameter_counts(cfg: TinyConfig = TinyConfig()) -> dict:
    """Total and non-embedding parameters (the preset's ``params_total`` / ``params_nonembedding``).

    Qwen2 has biases on the q/k/v projections, Llama none; an untied output head adds ``vocab × hidden``.
    """
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    d = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * d
    biases = h + 2 * kv if cfg.architecture == "qwen2" else 0
    attention = 2 * h * h + 2 * h * kv + biases               # q, k, v, o (+ q/k/v biases in Qwen2)
    mlp = 3 * h * i
    norms = 2 * h
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    nonemb = L * (attention + mlp + norms) + h                # + final norm
    return {"params_total": nonemb + embedding + head, "params_nonembedding": nonemb, "embedding": embedding}


@dataclass(frozen=True)
class TinyMoeConfig:
    """The tiny mixture-of-experts model: the dense tiny model's attention, vocabulary and tokenizer with every
    layer's MLP replaced by ``num_experts`` gated experts of ``moe_intermediate_size`` of which the router picks
    ``num_experts_per_tok`` per token (Qwen3-MoE architecture, ``Qwen3MoeForCausalLM``; mirrored in
    ``data/presets/models/tiny-moe.yaml``). Active per token: k × 64 = 128 intermediate units, a third of the
    dense tiny model's 384."""
    vocab_size: int = 32
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True

    def __post_init__(self):
        TinyConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"TinyMoeConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    def to_dict(self) -> dict:
        return asdict(self)


def qwen3_moe_config(cfg: TinyMoeConfig = TinyMoeConfig()):
    """The transformers ``Qwen3MoeConfig`` of ``cfg``: every layer sparse (``decoder_sparse_step=1``, no
    ``mlp_only_layers``), top-k weights renormalised (``norm_topk_prob``), fp32."""
    from transformers import Qwen3MoeConfig

    vocab = vocabulary(cfg.vocab_size)
    return Qwen3MoeConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                          intermediate_size=cfg.moe_intermediate_size * cfg.num_experts_per_tok,
                          moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
                          num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], num_hidden_layers=cfg.num_hidden_layers,
                          num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                          head_dim=cfg.hidden_size // cfg.num_attention_heads,
                          max_position_embeddings=cfg.max_position_embeddings,
                          rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
                          initializer_range=cfg.initializer_range, tie_word_embeddings=cfg.tie_word_embeddings,
                          eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], bos_token_id=None, dtype="float32")


def moe_parameter_counts(cfg: TinyMoeConfig = TinyMoeConfig()) -> dict:
    """Total, non-embedding and active (per token) parameters of the tiny MoE model.

    Per layer: attention q, k, v, o without biases plus the per-head q/k RMSNorms (2·d_head), the router
    (experts × hidden), ``num_experts`` gated experts of 3·hidden·I_e each, two layer norms; active counts only
    ``num_experts_per_tok`` experts.
    """
    h, L, E, k = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    d = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * d
    attention = 2 * h * h + 2 * h * kv + 2 * d
    expert = 3 * h * cfg.moe_intermediate_size
    layer = attention + h * E + E * expert + 2 * h
    nonemb = L * layer + h
    embedding = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    inactive = L * (E - k) * expert
    return {"params_total": nonemb + embedding + head, "params_nonembedding": nonemb, "embedding": embedding,
            "params_active": nonemb + embedding + head - inactive, "params_active_nonembedding": nonemb - inactive}


def create_moe(model_dir: Union[str, Path], seed: int = 0, cfg: TinyMoeConfig = TinyMoeConfig()) -> Path:
    """Write a freshly initialised tiny MoE model + the character tokenizer to ``model_dir`` (as :func:`create`:
    byte-identical per seed, the caller's global RNG untouched)."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(qwen3_moe_config(cfg)).to(torch.float32)
    save(model, out)
    vocab = vocabulary(cfg.vocab_size)
    GenerationConfig(eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], do_sample=True, temperature=1.0,
                     top_p=1.0, top_k=0).save_pretrained(out)
    build_tokenizer(cfg.vocab_size).save_pretrained(out)
    (out / TINY_MARKER).write_text(json.dumps({"seed": seed, "config": cfg.to_dict(), "moe": True}, indent=1,
                                              sort_keys=True))
    return out


def create(model_dir: Union[str, Path], seed: int = 0, cfg: TinyConfig = TinyConfig()) -> Path:
    """Write a freshly initialised tiny model + tokenizer to ``model_dir``; byte-identical for a given seed.

    The initialisation draws from a forked torch RNG seeded with ``seed``, so the caller's global RNG
    state is left untouched.
    """
    import torch
    from transformers import GenerationConfig

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers_model(cfg).to(torch.float32)
    save(model, out)
    vocab = vocabulary(cfg.vocab_size)
    GenerationConfig(eos_token_id=vocab[EOS], pad_token_id=vocab[PAD], do_sample=True, temperature=1.0,
                     top_p=1.0, top_k=0).save_pretrained(out)
    build_tokenizer(cfg.vocab_size).save_pretrained(out)
    (out / TINY_MARKER).write_text(json.dumps({"seed": seed, "config": cfg.to_dict()}, indent=1,
                                                     sort_keys=True))
    return out


def save(model, model_dir: Union[str, Path]) -> None:
    """``save_pretrained`` as safetensors (tied ``lm_head`` stored once, as transformers does)."""
    model.save_pretrained(Path(model_dir), safe_serialization=True)


def load_tokenizer(model_dir: Union[str, Path]):
    """The tokenizer of a model folder: for a folder :func:`create` wrote, the character tokenizer loaded as
    ``PreTrainedTokenizerFast`` from ``tokenizer.json``; for any other checkpoint, ``AutoTokenizer``.

    (``AutoTokenizer`` would pick the architecture's tokenizer class from ``config.json``; ids are the same for
    the task alphabet, but loading the fast tokenizer directly keeps decoding exactly as built here.)
    """
    from bidirl.rl.model_folder import load_tokenizer as load_any

    return load_any(model_dir)
