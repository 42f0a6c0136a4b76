"""Loading the checkpoint into a trainer rank: whole, or only this rank's shards (the ``TrainerEngine`` docstring,
"Loading").

A mixin of :class:`~bidirl.cluster.engines.workers.trainer.engine.TrainerEngine`: it uses the engine's
``model_dir``, ``device``, ``precision``, ``seed``, ``tied``, ``mesh`` and ``activation_checkpointing`` and its
distribution mixin's ``_fully_shard``.
"""

from __future__ import annotations

import torch

from bidirl.cluster.engines.workers.trainer.tensors import checkpoint_tensors, local_index, local_part
from bidirl.rl import model_folder as checkpoint


class Loading:
    """Build the model and fill it from the checkpoint (whole or this rank's shards)."""

    def _load_model(self, frozen: bool = False, empty: bool = False):
        """The checkpoint's model on the engine's device, with its own (resizable) storage, sharded when the
        engine is: fp32 master weights, or — ``frozen``, the reference, which is never updated — held in bf16
        when the engine computes in bf16 (FSDP2 would cast it to bf16 for every forward anyway: same values,
        half the memory and no cast). The trained model gets activation checkpointing when configured.

        Unsharded it is loaded whole; sharded, or ``empty`` (a gang's mesh is not known yet), it is built on the
        meta device, and a sharded one is then filled with this rank's shards (:meth:`_materialise`)."""
        dtype = torch.bfloat16 if frozen and self.precision == "bf16-mixed" else torch.float32
        if self.mesh is None and not empty:
            model = self._from_pretrained(dtype).to(self.device)
            for p in model.parameters():     # own, resizable storage (from_pretrained may map the checkpoint file)
                p.data = p.data.clone()
        else:
            model = checkpoint.empty_causal_lm(self.model_dir, dtype, "TrainerEngine.model_dir")
        model.eval()             # no dropout: the same samples give the same gradient on every rank and run
        model.requires_grad_(not frozen)
        if not frozen and self.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(f"TrainerEngine.activation_checkpointing: {type(model).__name__} does not support "
                                 "gradient checkpointing; set activation_checkpointing=False")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.mesh is not None:
            self._fully_shard(model)
            self._materialise(model)
        return model

    def _from_pretrained(self, dtype):
        """The whole checkpoint loaded on CPU (weights it lacks drawn from the engine's seed)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return checkpoint.load_causal_lm(self.model_dir, dtype, "TrainerEngine.model_dir")

    def _materialise(self, model) -> None:
        """Storage on the engine's device for a model built on the meta device (sharded or not), filled from the
        checkpoint (:meth:`_fill`: a sharded rank reads its shards alone); the buffers keep the values their
        constructors computed (``to_empty`` would leave them uninitialised), and a parameter several modules share
        (a tied head) stays one (``to_empty`` gives each module a tensor of its own when leaving the meta device)."""
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        places: dict = {}
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
                places.setdefault(id(p), []).append((module, name))
        model.to_empty(device=self.device)
        for (first, name), *others in places.values():
            for module, other in others:
                setattr(module, other, getattr(first, name))
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
            self._fill(model)

    def _fill(self, model) -> None:
        """Copy the checkpoint's weights into ``model``'s parameters and persistent buffers, each rank reading only
        the part of each tensor it holds (:func:`local_index`) from the files (:func:`checkpoint.checkpoint_slices`):
        the same bytes as a whole load, so the same weights bit for bit. A checkpoint whose names or shapes are not
        the model's (one transformers converts while loading) is loaded whole instead, with a warning."""
        targets = checkpoint_tensors(model)
        params = {id(p) for p in model.parameters()}
        stored = checkpoint.checkpoint_shapes(self.model_dir)
        direct = all(stored.get(k) == tuple(t.shape) for k, t in targets.items() if id(t) in params)
        with checkpoint.checkpoint_slices(self.model_dir) as files:
            if not direct:
                import warnings
                warnings.warn(f"TrainerEngine: the parameters of {str(self.model_dir)!r} are not stored under the "
                              "model's names and shapes; every rank loads the whole checkpoint to take its shards",
                              stacklevel=2)
                files = checkpoint.hf_weights(self._from_pretrained(next(model.parameters()).dtype).state_dict(),
                                              self.tied)
            for key, t in targets.items():
                if key in files:                          # a buffer the checkpoint lacks keeps its constructor's value
                    local_part(t).copy_(files[key][local_index(t)])
