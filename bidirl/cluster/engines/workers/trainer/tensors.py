"""Tensor helpers of the trainer engine: a rank's part of a (possibly FSDP2-sharded) tensor, and state trees.

FSDP2 (``fully_shard``) holds parameters, gradients and optimizer state as DTensors sharded by rows (paper §5: a
gang's ranks each hold a shard); these helpers take a rank's local tensor out of one, say where it lies in the full
tensor, and wrap a local tensor back in a parameter's sharding.
"""

from __future__ import annotations

import torch

from bidirl.rl import model_folder as checkpoint


def as_1d(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32).reshape(-1)


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local_part(t) -> torch.Tensor:
    """The rank's own tensor of a (possibly sharded) parameter, gradient or optimizer state."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_index(like) -> tuple:
    """Where this rank's part of the (possibly sharded) tensor ``like`` lies in the full tensor: one slice per
    dimension (FSDP2 shards dimension 0; an unsharded tensor is all of it)."""
    if not is_dtensor(like):
        return tuple(slice(0, n) for n in like.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_slice(full: torch.Tensor, like) -> torch.Tensor:
    """The part of the full tensor ``full`` that this rank holds of the (possibly sharded) tensor ``like``."""
    return full[local_index(like)] if is_dtensor(like) else full


def on_meta(model) -> bool:
    """Whether ``model``'s parameters are still on the meta device (built, not yet loaded)."""
    return any(p.device.type == "meta" for p in model.parameters())


def checkpoint_tensors(model) -> dict:
    """``{checkpoint name: parameter or persistent buffer}`` of ``model``, each tensor once (a tied head is the
    embedding's parameter); non-persistent buffers (RoPE's ``inv_freq``) are no checkpoint entries."""
    modules = dict(model.named_modules())
    out: dict = {}
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        key = checkpoint.hf_name(name)
        owner, _, leaf = name.rpartition(".")
        if id(t) in seen or key.endswith(checkpoint.NON_WEIGHT_SUFFIXES):
            continue
        if leaf in getattr(modules[owner], "_non_persistent_buffers_set", ()):
            continue
        seen.add(id(t))
        out[key] = t
    return out


def like_param(local: torch.Tensor, param):
    """``local`` as a tensor of the same kind as ``param`` (a DTensor with the parameter's sharding)."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(),
                              run_check=False)


def tree_map(obj, fn):
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (dicts, lists and tuples rebuilt)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(v, fn) for v in obj)
    return obj


def rebuild(saved, template):
    """``saved`` (plain local tensors) shaped like ``template``: each tensor a copy on the template's device and, where
    the template holds a DTensor, a DTensor with the template's sharding.

    Always a copy: AdamW keeps the state tensors it is given, and a tensor ``torch.load`` read from a file (a
    recovery snapshot) sits in storage that cannot be resized — a hot switch frees state by resizing its storages
    (:mod:`bidirl.cluster.engines.workers.host_buffer`), so a restored gang could not switch out."""
    if torch.is_tensor(template):
        local = saved.to(local_part(template).device, copy=True)
        return like_param(local, template) if is_dtensor(template) else local
    if isinstance(template, dict):
        return {k: rebuild(saved[k], v) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(rebuild(a, b) for a, b in zip(saved, template))
    return saved
