"""The single controller's data path: what a trainer call costs besides its workers' compute (paper §7.4's external
check; docs/architecture.md, "Execution settings of real jobs").

veRL runs RL as one driver process (the *single controller*) calling worker groups. Every trainer stage is one
call whose timer brackets the whole round trip — ``marked_timer("old_log_prob")`` around
``actor_rollout_wg.compute_log_prob(batch)`` and ``marked_timer("update_actor")`` around
``actor_rollout_wg.update_actor(batch)`` (``verl/trainer/ppo/ray_trainer.py`` fit loop, v0.6 lines 1124–1209; the
fully-async recipe's ``recipe/fully_async_policy/ray_trainer.py`` ``_process_batch_common``, lines 352–437):

* **dispatch.** ``dispatch_nd_compute_dataproto`` chunks the driver's whole batch into one piece per data rank and
  ``parallel_put`` puts each into Ray's object store (``verl/single_controller/base/decorator.py`` 211–261,
  ``verl/utils/ray_utils.py`` 48); ``DataProto.__getstate__`` serialises a piece as ``consolidate()`` plus
  ``torch.save`` of its TensorDict (``verl/protocol.py`` 388–409). Every worker then pulls its data rank's piece: the
  ``k`` GPUs of a Ulysses group each receive the same piece (``dispatch_nd_compute`` maps every worker to
  ``arg[dp_rank]``), so ``k`` copies of the batch leave the driver.
* **the batch is padded.** Generation pads every prompt to ``max_prompt_length`` and every response to
  ``max_response_length`` (vLLM rollout ``pad_2d_list_to_length``; the agent loop's ``_postprocess`` pads to the same
  lengths), so a sample's tensors have ``P + R`` positions whatever its real length, and the driver sends *every*
  tensor of the batch, not only those the stage reads (``update_policy`` selects its keys on the worker:
  ``verl/workers/actor/dp_actor.py`` 365–384).
* **collect.** The driver ``ray.get``s every worker's output (``verl/single_controller/ray/base.py`` 41–56: all
  ``k`` ranks of a group return it) and concatenates them.

So a call moves ``k · samples · bytes_per_sample(stage)`` through the driver's object-store path, independent of the
trainer's GPU count: a cost per step that does not shrink when the trainer grows. The tensors per sample at each call
(dtypes from veRL's code: token tensors int64, log-probs and advantages fp32) are :func:`sample_bytes`'s. The
*rate* of that path (serialisation, object store, the driver node's network, deserialisation: bytes per second
end to end) has no published figure for the measured jobs; it is the hardware preset's ``controller_data_rate``,
``None`` (not charged) unless fitted — ``bidirl.experiments.fidelity_external`` fits it together with ``train_mfu``
on the calibrating row's own stage times.
"""

from __future__ import annotations

from typing import Optional

from bidirl.perf.costs import cost_constant

#: bytes of one token-position entry of veRL's int64 token tensors (input_ids, attention_mask, position_ids, prompts,
#: responses, response_mask: ``torch.long`` in ``verl/workers/rollout/vllm_rollout`` and ``compute_response_mask``)
TOKEN_TENSOR_BYTES = cost_constant("TOKEN_TENSOR_BYTES", 8, "B", "torch.int64 token tensors of veRL's DataProto: "
                                   "verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py (torch.long), "
                                   "verl/trainer/ppo/ray_trainer.py compute_response_mask")
#: bytes of one response-position entry of veRL's fp32 per-token tensors (old_log_probs, entropys, token_level_scores,
#: token_level_rewards, advantages, returns, rollout_log_probs)
FLOAT_TENSOR_BYTES = cost_constant("FLOAT_TENSOR_BYTES", 4, "B", "torch.float32 per-token tensors of veRL: "
                                   "verl/workers/fsdp_workers.py compute_log_prob output (old_log_probs, entropys), "
                                   "verl/trainer/ppo/core_algos.py advantages/returns")
#: int64 tensors over prompt + response positions: input_ids, attention_mask, position_ids (generation output)
FULL_SEQUENCE_TENSORS = cost_constant("FULL_SEQUENCE_TENSORS", 3, "tensors", "veRL generation output keys input_ids, "
                                      "attention_mask, position_ids (verl/workers/rollout/vllm_rollout/"
                                      "vllm_rollout_spmd.py generate_sequences)")
#: int64 tensors over response positions: responses, response_mask
RESPONSE_TOKEN_TENSORS = cost_constant("RESPONSE_TOKEN_TENSORS", 2, "tensors", "veRL keys responses (generation "
                                       "output) and response_mask (ray_trainer.py compute_response_mask)")
#: int64 tensors over prompt positions: prompts
PROMPT_TOKEN_TENSORS = cost_constant("PROMPT_TOKEN_TENSORS", 1, "tensors", "veRL generation output key prompts "
                                     "(vllm_rollout_spmd.py generate_sequences)")
#: fp32 response tensors a log-prob call returns: old_log_probs and entropys (compute_log_prob(calculate_entropy=True))
LOGPROB_OUTPUT_TENSORS = cost_constant("LOGPROB_OUTPUT_TENSORS", 2, "tensors", "verl/workers/fsdp_workers.py "
                                       "compute_log_prob: DataProto.from_dict(tensors={'old_log_probs', 'entropys'})")
#: fp32 response tensors a reference policy's log-prob call returns: ref_log_prob
REF_LOGPROB_OUTPUT_TENSORS = cost_constant("REF_LOGPROB_OUTPUT_TENSORS", 1, "tensors", "verl/workers/fsdp_workers.py "
                                           "compute_ref_log_prob: DataProto.from_dict(tensors={'ref_log_prob'})")
#: fp32 response tensors the driver adds before the update: old_log_probs, token_level_scores, token_level_rewards,
#: advantages, returns (each its own key of the consolidated TensorDict)
UPDATE_INPUT_TENSORS = cost_constant("UPDATE_INPUT_TENSORS", 5, "tensors", "verl/trainer/ppo/ray_trainer.py fit loop: "
                                     "batch.union(old_log_prob); token_level_scores, token_level_rewards; "
                                     "compute_advantage sets advantages and returns")


def sample_bytes(stage: str, prompt_positions: int, response_positions: int, *, rollout_log_probs: bool = False,
                 reference_log_probs: bool = False) -> int:
    """Bytes per sample that one call of ``stage`` moves through the driver (sent and collected), with every sample
    padded to ``prompt_positions + response_positions``. ``rollout_log_probs``: the rollout returned its
    log-probs (fully-async bypass: one more fp32 response tensor in the batch); ``reference_log_probs``: the
    batch carries a reference policy's log-probs (before the update)."""
    p, r = int(prompt_positions), int(response_positions)
    if p < 0 or r <= 0:
        raise ValueError(f"sample_bytes: positions must be prompt >= 0, response > 0 (got {p}, {r})")
    generated = (TOKEN_TENSOR_BYTES * (FULL_SEQUENCE_TENSORS * (p + r) + RESPONSE_TOKEN_TENSORS * r
                                       + PROMPT_TOKEN_TENSORS * p)
                 + FLOAT_TENSOR_BYTES * r * int(bool(rollout_log_probs)))
    if stage == "actor_update":
        extra = UPDATE_INPUT_TENSORS + int(bool(reference_log_probs))
        return int(generated + FLOAT_TENSOR_BYTES * r * extra)
    if stage in ("old_logprob", "ref_logprob"):
        returned = LOGPROB_OUTPUT_TENSORS if stage == "old_logprob" else REF_LOGPROB_OUTPUT_TENSORS
        return int(generated + FLOAT_TENSOR_BYTES * r * returned)
    raise ValueError(f"sample_bytes: unknown trainer stage {stage!r} (use actor_update, old_logprob or ref_logprob)")


def call_bytes(stage: str, samples: int, sequence_parallel: int, prompt_positions: int, response_positions: int,
               **kw) -> float:
    """Bytes one call of ``stage`` over ``samples`` samples moves through the driver: every GPU of a
    ``sequence_parallel``-GPU Ulysses group receives (and returns) its data rank's piece (module doc)."""
    return float(max(1, int(sequence_parallel)) * int(samples)
                 * sample_bytes(stage, prompt_positions, response_positions, **kw))


def job_call_bytes(stage: str, samples: int, cfg) -> float:
    """:func:`call_bytes` of one call of ``stage`` over ``samples`` samples of job ``cfg`` (its Ulysses degree, its
    padded lengths ``max_prompt_len + max_response_len``, the rollout's log-probs in the batch when the job bypasses
    the old-log-prob recompute, a reference model's log-probs when it has one)."""
    r, w = cfg.rl, cfg.workload
    return call_bytes(stage, samples, r.sequence_parallel, w.max_prompt_len, w.max_response_len,
                      rollout_log_probs=not r.recompute_old_logprob,
                      reference_log_probs=bool(getattr(r, "reference_model", False)))


def call_seconds(stage: str, samples: int, cfg, rate: Optional[float] = None) -> float:
    """Seconds of the driver's data path for one call of ``stage`` over ``samples`` samples of job ``cfg`` at
    ``rate`` B/s (default the hardware preset's ``controller_data_rate``; 0 when it is ``None``)."""
    rate = cfg.hardware_spec.controller_data_rate if rate is None else rate
    if rate is None or samples <= 0:
        return 0.0
    return job_call_bytes(stage, samples, cfg) / float(rate)
