"""Real engines under the coordinator: vLLM rollout replicas and torch trainer gangs on Ray.

``driver`` (:class:`EngineDriver`), ``actors`` (the Ray actors), ``rollout`` (the interruptible vLLM
engine), ``trainer`` (the torch GRPO trainer), ``sampler`` (position-keyed sampling). Imported lazily: this
package's modules need Ray, vLLM and torch.
"""
