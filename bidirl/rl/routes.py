"""Capturing a mixture-of-experts model's expert routes at its routers (the record half of Rollout Routing Replay).

R3 (issue 41; "Rollout Routing Replay": record the rollout's routes, replay them in the trainer's forward passes)
needs each token's chosen experts per MoE layer. On GPU, vLLM returns them itself
(``enable_return_routed_experts``). vLLM's CPU build refuses that flag (it needs the V2 model runner, whose kernels
need Triton; see docs/architecture.md, "MoE"), so on CPU the routes are read where they are decided: a forward hook
on each MoE layer's router (``…mlp.gate``) takes the router's logits and keeps their top-k expert ids.

The same hook works on a transformers model (``Qwen3MoeTopKRouter`` returns ``(logits, scores, indices)``) and on
vLLM's model inside its worker (``GateLinear`` returns the logits), so trainer and rollouter routes are recorded
the same way. The routing rule is the models' own: softmax over the logits, then top-k — top-k of the logits is the
same set (softmax is monotone).

A :class:`RouteRecorder` keeps the rows of every forward call in order; which row is which request's token is the
caller's to know (one sequence per forward in :func:`routes_of`; vLLM's batched steps are split by request in
:mod:`bidirl.cluster.engines.workers.rollout_routes`). :class:`PrefixRoutes` keeps full blocks' rows for the positions
a prefix cache serves, :func:`sequence_routes` assembles one sequence's rows; the replay half is
:mod:`bidirl.rl.route_replay`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: the module-name suffix of an MoE layer's router in Qwen2-MoE / Qwen3-MoE (transformers and vLLM alike)
ROUTER_SUFFIX = "mlp.gate"


def _layer_index(name: str) -> int:
    parts = name.split(".")
    if "layers" not in parts:
        raise ValueError(f"router module {name!r} has no '.layers.<i>.' in its name")
    return int(parts[parts.index("layers") + 1])


@dataclass
class RouteRecorder:
    """The top-k expert ids each router chose, per forward call (filled by the hooks of :func:`install_route_hooks`).

    ``calls[layer]`` lists one ``(tokens, k)`` int array per forward call of that layer's router."""
    top_k: int
    layers: tuple
    calls: dict = field(default_factory=dict)
    handles: list = field(default_factory=list)

    def record(self, layer: int, logits) -> None:
        import torch

        ids = torch.topk(logits.detach().float().reshape(-1, logits.shape[-1]), self.top_k, dim=-1).indices
        self.calls.setdefault(layer, []).append(np.sort(ids.cpu().numpy().astype(np.int64), axis=-1))

    def routes(self) -> np.ndarray:
        """All recorded rows as one ``(tokens, layers, k)`` array (expert ids sorted within a token's layer): the
        rows of every forward call in call order. ValueError if the layers saw different numbers of tokens."""
        if not self.calls:
            return np.zeros((0, len(self.layers), self.top_k), dtype=np.int64)
        per_layer = [np.concatenate(self.calls.get(layer, [np.zeros((0, self.top_k), np.int64)]))
                     for layer in self.layers]
        counts = {layer: len(rows) for layer, rows in zip(self.layers, per_layer)}
        if len(set(counts.values())) != 1:
            raise ValueError(f"MoE layers recorded different token counts {counts}: a forward was cut short")
        return np.stack(per_layer, axis=1)

    def clear(self) -> None:
        self.calls = {}

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def install_route_hooks(model, top_k: int) -> RouteRecorder:
    """Hook every MoE router of ``model`` (a ``torch.nn.Module``: a transformers MoE model or vLLM's model in its
    worker) and return the recorder the hooks fill. ValueError if ``top_k`` is not a positive integer or the model
    has no module named ``*.layers.<i>.mlp.gate`` (a dense model, or an MoE family whose router lives elsewhere)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer (the model's experts per token), got {top_k!r}")
    routers = [(name, module) for name, module in model.named_modules() if name.endswith(ROUTER_SUFFIX)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router (no module named '*.{ROUTER_SUFFIX}'): "
                         "routes exist only for mixture-of-experts models")
    recorder = RouteRecorder(top_k=top_k, layers=tuple(sorted(_layer_index(n) for n, _ in routers)))

    for name, module in routers:
        layer = _layer_index(name)

        def hook(_module, _args, output, layer=layer):
            recorder.record(layer, output[0] if isinstance(output, tuple) else output)

        recorder.handles.append(module.register_forward_hook(hook))
    return recorder


def routes_of(model, token_ids, top_k: int) -> np.ndarray:
    """The ``(tokens, layers, k)`` routes of one sequence under one full forward pass of a transformers MoE model
    (the trainer's view of the same tokens the rollouter routed)."""
    import torch

    recorder = install_route_hooks(model, top_k)
    try:
        with torch.no_grad():
            model(torch.as_tensor([list(token_ids)], dtype=torch.long))
        return recorder.routes()
    finally:
        recorder.remove()


#: the dtype of stored routes: expert ids < 32,768 (Qwen3-30B-A3B has 128 experts, the largest public MoE configs
#: a few hundred), two bytes per (token, layer, choice)
ROUTE_DTYPE = np.int16


def as_routes(rows, layers: int, top_k: int, name: str) -> np.ndarray:
    """``rows`` as a ``(tokens, layers, k)`` :data:`ROUTE_DTYPE` array; ValueError naming ``name`` if its shape is
    another."""
    out = np.asarray(rows)
    if out.ndim != 3 or out.shape[1:] != (layers, top_k):
        raise ValueError(f"{name}: routes must have shape (tokens, {layers} MoE layers, {top_k} experts per token), "
                         f"got {out.shape}")
    return out.astype(ROUTE_DTYPE, copy=False)


@dataclass
class PrefixRoutes:
    """The routes of token prefixes an engine computed, block by block, for the positions it later serves from its
    prefix cache (a cached block's tokens are not run again, so their routers are not called again).

    A block's key chains the keys of the blocks before it with its own tokens — the prefix cache's own rule (a
    block is reused only after the same tokens in the same order), so a key names one prefix exactly. Only full
    blocks are kept: a cache hit covers whole blocks. The routes are those of the weights they were computed
    with; :meth:`clear` when the weights change (the engine's prefix cache is reset then too)."""
    block: int
    blocks: dict = field(default_factory=dict)

    def _keys(self, tokens, n_blocks: int):
        key = ()
        for b in range(n_blocks):
            key = (key, tuple(int(t) for t in tokens[b * self.block:(b + 1) * self.block]))
            yield b, key

    def store(self, tokens, rows: dict) -> None:
        """Keep the full blocks of ``tokens`` whose every position has a row in ``rows`` (position → (layers, k))."""
        for b, key in self._keys(tokens, len(tokens) // self.block):
            span = range(b * self.block, (b + 1) * self.block)
            if key not in self.blocks and all(p in rows for p in span):
                self.blocks[key] = np.stack([rows[p] for p in span])

    def fill(self, tokens, rows: dict, upto: int) -> None:
        """Add to ``rows`` the kept rows of positions ``< upto`` it lacks (the blocks ``tokens`` shares with a kept
        prefix); positions of blocks never kept stay missing."""
        for b, key in self._keys(tokens, -(-upto // self.block)):
            kept = self.blocks.get(key)
            if kept is None:
                return
            for j in range(self.block):
                p = b * self.block + j
                if p < upto and p < len(tokens):
                    rows.setdefault(p, kept[j])

    def clear(self) -> None:
        self.blocks = {}


def sequence_routes(rows: dict, length: int, where: str) -> np.ndarray:
    """The ``(length, layers, k)`` routes of positions ``0 … length − 1`` from ``rows`` (position → (layers, k));
    RuntimeError naming ``where`` and the first missing positions if any is absent."""
    missing = [p for p in range(length) if p not in rows]
    if missing:
        raise RuntimeError(f"{where}: no route recorded for positions {missing[:8]}"
                           f"{' …' if len(missing) > 8 else ''} of {length}; every token the rollout fed its "
                           "model must have passed a hooked router or come from a kept prefix block")
    if not length:
        return np.zeros((0, 0, 0), dtype=ROUTE_DTYPE)
    return np.stack([rows[p] for p in range(length)]).astype(ROUTE_DTYPE, copy=False)


def moe_route_shape(config) -> tuple:
    """``(MoE layers, experts per token)`` of a transformers MoE config (Qwen2-MoE / Qwen3-MoE: layer ``i`` is sparse
    unless listed in ``mlp_only_layers``, and when ``(i + 1) % decoder_sparse_step == 0``); ValueError for a dense
    model's config (no ``num_experts``): only an MoE model has routes to record or replay."""
    experts = int(getattr(config, "num_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if experts < 1 or top_k < 1:
        raise ValueError(f"{type(config).__name__} ({getattr(config, 'model_type', '?')}) is not a mixture-of-experts "
                         "model (no num_experts / num_experts_per_tok): it has no expert routes to record or replay")
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    layers = [i for i in range(int(config.num_hidden_layers)) if i not in dense and (i + 1) % step == 0]
    return len(layers), top_k
