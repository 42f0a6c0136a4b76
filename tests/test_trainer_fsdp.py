"""Sharded trainer gangs (FSDP2 over gloo on CPU, NCCL on a GPU) against the unsharded single-process trainer.

Integration tests (``-m integration``): each spawns a gang of two processes (one, on a GPU, for the NCCL test).
Every test trains on the same eight samples for three GRPO steps; a step's update chunks are cut unevenly (4, 3
and 1 samples, so a rank gets an empty share) and dealt to the ranks with ``rank_shares``; the primary's chunks
accumulate into the ranks' sharded ``p.grad`` (``accumulate=True``: FSDP2's reduce-scatter adds each chunk, the
primary gang's path), the middle chunk goes the auxiliary way (gathered unsharded with ``full_gradient``, added at
``apply`` as a full vector: so the gang sums the chunks in another order than the reference — 0, 2, then 1 — which
the gradient-norm bound covers: k = 3 chunks add ≤ (k − 1)·u relative, far below the reductions' λ·√n·u), and the
engine is offloaded and onloaded between steps, an accumulated gradient with it.

Every reference runs in a process of its own (``_in_own_process``), never in the pytest process: in-process vLLM
(``tests/test_engines.py``) binds torch's threads there, after which ``torch.set_num_threads(1)`` is refused and
the reference's reductions split over other threads than the gang's — its numbers would depend on which tests ran
before it (seen on an Intel AVX-512 machine: log-probs 1.72e-5 apart).

Tolerances (fp32), each derived from the arithmetic (``_fp32_bounds``), none from one machine's output:
- log-probs and gradient norms are compared with the unsharded trainer *on the gang's own weights* of that step,
  so the two differ by rounding alone (summation order and grouping of every reduction), not by the earlier steps'
  weight drift. Rounding model: an inner product of length n computed in fp32 has error ≤ λ·√n·u·Σ|x_i·y_i|
  (u = 2**-24) with probability ≥ 1 − 2·exp(−λ²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019); λ = 6
  (≤ 3e-8 per reduction). The relative errors of the reductions on a logit's path add to first order (RMS-normed
  residual blocks, gain ≈ 1), ρ = λ·u·Σ√n_i over that path; the two runs differ by ≤ 2ρ·Z for a logit of
  magnitude Z, and a log-prob (z_y − logsumexp z) by ≤ 2·2ρ·Z_max. A gradient's path is the forward, its
  transpose and the reduction over the batch's tokens; its norm sums N squares (λ·√N·u more).
- weights after one step from the gang's own state (its weights and AdamW moments, gathered whole each step),
  against the unsharded trainer's one step from that state: every weight within its own bound
  (``rounding.same_step``, none exempt; the derivation is ``rounding.adamw_step_gap``'s).
- weights, against the unsharded trainer's own steps from the start: not compared weight by weight — two runs whose
  arithmetic differs (a gang's shards against one process) hold weights a rounding apart after their first step,
  and the gradients of such weights differ by up to 4e4× the summation bound (measured on the tiny model), so no
  per-weight bound follows from the arithmetic there; the per-step comparison above holds every step instead.

bf16-mixed (bf16 compute, fp32 master weights and AdamW state): log-probs of the same weights within
0.05 + 2**-6·|log-prob| of fp32 — a bf16 value carries 8 significant bits, so one rounding of a log-prob near −10
is already 0.0625 (measured: 0.023 on the AVX2 machine, 0.062 on an AVX-512 CPU and on an H100) — and each step's
accumulated update W_t − W_0 points the fp32 update's way: cosine ≥ 0.98 (measured 0.992–0.999). AdamW turns
every gradient into steps of about lr per weight, so a per-weight bound would not tell bf16 rounding from a wrong
gradient; the direction does.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from bidirl.cluster.engines.workers.trainer import TrainerEngine, rank_shares
from bidirl.rl import grpo
from bidirl.rl.samples import Sample
from bidirl.rl.tasks import ArithmeticTask

import rounding
from gang_rendezvous import join_gang, spawn_gang

pytestmark = pytest.mark.integration

STEPS = 3
CHUNKS = ((0, 4), (4, 7), (7, 8))        # update chunks of a step: uneven, the last leaves a rank empty
AUX_CHUNK = 1                            # this chunk's gradient travels unsharded, as an auxiliary gang's does
LR = 1e-3
BF16_LOGPROB_TOL = 0.05
BF16_LOGPROB_RTOL = 2.0 ** -6
BF16_MIN_COSINE = 0.98


def _samples(model_dir):
    from bidirl.rl.tiny_model import load_tokenizer
    tok = load_tokenizer(model_dir)
    out = []
    for i, p in enumerate(ArithmeticTask(seed=0).prompts(8, start=700)):
        answer = p.answer if i % 3 else str(int(p.answer) + 1)
        out.append(Sample(i // 4, i % 4, tuple(tok(p.text)["input_ids"]),
                          tuple(tok(answer)["input_ids"] + [tok.eos_token_id]), (), float(i % 3 != 0), 0))
    return out


def _advantages(samples):
    return grpo.group_advantages([s.reward for s in samples], group_size=4).float()


def _call_and_save(_rank, fn, args, path):
    torch.save(fn(*args), path)


def _in_own_process(tmp_path, fn, *args):
    """``fn(*args)`` in a fresh spawned process: whatever earlier tests did to the pytest process (vLLM's thread
    binding, torch's thread count) cannot change a reference's numbers."""
    import torch.multiprocessing as mp
    path = tmp_path / f"{fn.__name__}.pt"
    mp.spawn(_call_and_save, args=(fn, args, str(path)), nprocs=1, join=True)
    return torch.load(path)


def _reference_run(model_dir, precision="fp32"):
    """The unsharded single-process trainer on the same steps: weights, grad norms and log-probs per step."""
    trainer = TrainerEngine(model_dir, lr=LR, seed=0, threads=1, precision=precision)
    samples = _samples(model_dir)
    adv = _advantages(samples)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    states, norms, logprobs = [], [], []
    for _ in range(STEPS):
        old = trainer.logprobs(samples)
        logprobs.append(old)
        grads = [trainer.chunk_gradients(samples[a:b], adv[a:b], old[a:b], normalizer=norm) for a, b in CHUNKS]
        norms.append(trainer.apply(grads)["grad_norm"])
        states.append(trainer.state_dict())
    return {"states": states, "norms": norms, "logprobs": logprobs, "threads": torch.get_num_threads()}


def _rounding_reference(model_dir, weights_per_step, moments_per_step=None):
    """The unsharded trainer's log-probs, gradient norm and largest |logit| on each step's given weights (one step
    of the gang: its log-probs are of the weights it held before that step's update). With the gang's AdamW state
    at each step's start (``moments_per_step``: ``{fqn: {"step", "exp_avg", "exp_avg_sq"}}``, empty before the
    first), also the weights its one step from that state reaches and each weight's bound (``rounding.adamw_step_gap``:
    the gradients differ by the reductions' 2·ρ_g·max|g|, ρ_g = λ·u·(2·path + √tokens) as in the gradient test of
    ``tests/test_engines.py``, plus the chunks' summation in another order, 2·γ₂·Σ|g_j|)."""
    from bidirl.rl import model_folder as checkpoint
    trainer = TrainerEngine(model_dir, lr=LR, seed=0, threads=1)
    samples = _samples(model_dir)
    adv = _advantages(samples)
    norm = grpo.loss_normalizer([s.response_len for s in samples])
    cfg = checkpoint.causal_lm_config(model_dir, "model_dir")
    rho = rounding.ROUNDING_LAMBDA * rounding.FP32_UNIT_ROUNDOFF * (
        2 * rounding.logit_path(cfg, max(len(s.prompt_ids) + s.response_len for s in samples))
        + math.sqrt(sum(len(s.prompt_ids) + s.response_len for s in samples)))
    params = list(trainer.model.named_parameters())
    out = {"logprobs": [], "norms": [], "max_logit": [], "states": [], "bounds": [], "threads": torch.get_num_threads()}
    for step, weights in enumerate(weights_per_step):
        trainer.load_state_dict(weights)
        if moments_per_step is not None:
            trainer.optimizer.state.clear()
            for name, p in params:
                m = moments_per_step[step].get(name)
                if m is not None:
                    trainer.optimizer.state[p] = {k: v.clone() for k, v in m.items()}
        old = trainer.logprobs(samples)
        grads = [trainer.chunk_gradients(samples[a:b], adv[a:b], old[a:b], normalizer=norm) for a, b in CHUNKS]
        out["logprobs"].append(old)
        before = [trainer.optimizer.state.get(p, {}) for _, p in params]
        out["norms"].append(trainer.apply(grads)["grad_norm"])
        with torch.no_grad():
            logits = [trainer.model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits for s in samples]
            out["max_logit"].append(max(float(z.abs().max()) for z in logits))
        if moments_per_step is None:
            continue
        flats = [g.flat for g in grads]
        total = sum(flats[1:], flats[0].clone())
        delta = rounding.summation_gap(flats) + 2 * rho * float(total.abs().max())
        bound, offset = {}, 0
        for (name, p), state in zip(params, before):
            n = p.numel()
            zero = torch.zeros(n)
            m = state.get("exp_avg", zero).reshape(-1)
            v = state.get("exp_avg_sq", zero).reshape(-1)
            bound[checkpoint.hf_name(name)] = rounding.adamw_step_gap(
                total[offset:offset + n], delta[offset:offset + n], m, v, int(state.get("step", 0)) + 1,
                p.detach().reshape(-1), LR, trainer.betas, max_grad_norm=trainer.max_grad_norm).view(p.shape)
            offset += n
        out["states"].append(trainer.state_dict())
        out["bounds"].append(bound)
    return out


def _fp32_bounds(model_dir, samples, max_logit: float) -> tuple:
    """(log-prob tolerance, gradient-norm relative tolerance) for two fp32 runs that differ in rounding only
    (the derivation is in the module docstring)."""
    from bidirl.rl import model_folder as checkpoint
    cfg = checkpoint.causal_lm_config(model_dir, "model_dir")
    t = max(len(s.prompt_ids) + s.response_len for s in samples)
    tokens = sum(len(s.prompt_ids) + s.response_len for s in samples)
    path = rounding.logit_path(cfg, t)
    logprob_tol = rounding.logprob_tolerance(cfg, t, max_logit)
    n_params = sum(p.numel() for p in TrainerEngine(model_dir).params)
    # + (chunks − 1): the gang adds the step's chunks in another order than the reference (module docstring)
    grad_rho = rounding.ROUNDING_LAMBDA * rounding.FP32_UNIT_ROUNDOFF * (2 * path + math.sqrt(tokens)
                                                                        + math.sqrt(n_params)) \
        + (len(CHUNKS) - 1) * rounding.FP32_UNIT_ROUNDOFF
    return logprob_tol, 2 * grad_rho


def _full_moments(trainer) -> dict:
    """The gang's AdamW state, gathered whole onto rank 0 (``{fqn: {"step", "exp_avg", "exp_avg_sq"}}``; a
    collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    if not trainer.optimizer.state:
        return {}
    state = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: {n: t.detach().clone() for n, t in v.items()} for k, v in state.get("state", {}).items()}


def _gang_worker(rank, world, addr, model_dir, out_dir, replicas, precision, device="cpu", checkpointing=None):
    """One rank of a gang: the reference run's steps, each chunk dealt over the gang's ranks."""
    trainer = TrainerEngine(model_dir, lr=LR, seed=0, threads=1, precision=precision, device=device,
                            activation_checkpointing=checkpointing)
    join_gang(rank, world, addr, device=trainer.device)    # the engine takes the group joined here
    trainer.init_process_group(rank, world, addr, replicas=replicas)
    try:
        samples = _samples(model_dir)
        adv = _advantages(samples)
        norm = grpo.loss_normalizer([s.response_len for s in samples])
        out = {"states": [], "norms": [], "logprobs": [], "switch": [], "local_numel": trainer.local_numel,
               "numel": trainer.numel, "dtypes": {}}
        for step in range(STEPS):
            out.setdefault("moments", []).append(_full_moments(trainer))   # the state this step starts from
            grads, step_lps = [], {}
            for c, (a, b) in enumerate(CHUNKS):
                idx = list(range(a, b))
                shares = rank_shares(idx, -(-len(idx) // world), world)
                mine = shares[rank]
                old = trainer.logprobs([samples[k] for k in mine])      # every rank, as the driver calls them
                step_lps.update(dict(zip(mine, old)))
                share = ([samples[k] for k in mine], adv[mine] if mine else [], old)
                if c != AUX_CHUNK:
                    g = trainer.chunk_gradients(*share, normalizer=norm, accumulate=True, chunk_id=c)
                    assert g.flat is None
                    grads.append(g)
                    if step == 0 and c == 0:           # a hot switch while the step's gradient is accumulating
                        trainer.offload()
                        trainer.onload()
                    continue
                g = trainer.chunk_gradients(*share, normalizer=norm)
                if c == AUX_CHUNK:
                    full = trainer.full_gradient(g.flat)
                    assert full.numel() == trainer.numel
                    assert torch.equal(trainer.local_gradient(full), g.flat)
                    grads.append(full)
                else:
                    grads.append(g)
            out["logprobs"].append(step_lps)
            out["norms"].append(trainer.apply(grads)["grad_norm"])
            out["states"].append(trainer.state_dict())
            if step == 0:
                nbytes = trainer.state_bytes()
                t_off = trainer.offload()
                freed = trainer.resident_bytes() == 0
                if device != "cpu":
                    out["offloaded_device_bytes"] = torch.cuda.memory_allocated()
                t_on = trainer.onload()
                out["switch"] = {"offload": t_off, "onload": t_on, "bytes": nbytes, "freed": freed,
                                 "device_bytes": torch.cuda.memory_allocated() if device != "cpu" else None}
        state = trainer.optimizer.state[trainer.params[0]]
        out["dtypes"] = {"param": str(trainer.params[0].dtype), "exp_avg": str(state["exp_avg"].dtype),
                         "sharded": type(trainer.params[0]).__name__}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        trainer.destroy_process_group()


def _run_gang(model_dir, tmp_path, replicas, precision="fp32", world=2, device="cpu", checkpointing=None):
    spawn_gang(_gang_worker, world, str(model_dir), str(tmp_path), replicas, precision, device, checkpointing)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _bf16_logprob_diff(logprobs: dict, reference: dict) -> float:
    """The largest |Δ| of bf16 log-probs from the fp32 ones, after checking each is within the bf16 tolerance."""
    for k, lp in logprobs.items():
        torch.testing.assert_close(lp.cpu(), reference[k], atol=BF16_LOGPROB_TOL, rtol=BF16_LOGPROB_RTOL)
    return max(float((lp.cpu() - reference[k]).abs().max()) for k, lp in logprobs.items())


def _max_weight_diff(a: dict, b: dict, keys=None) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in (a if keys is None else keys))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    ref = _in_own_process(tmp_path_factory.mktemp("reference"), _reference_run, str(model_dir))
    assert ref["threads"] == 1, "the reference must run on one thread, as each rank of the gang does"
    return ref


@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp-1x2", "hsdp-2x1"])
def test_fsdp2_gang_matches_the_unsharded_trainer_after_three_steps(model_dir, tmp_path, reference, replicas):
    # the FSDP gang also recomputes its blocks in the backward pass (activation checkpointing, the GPU default):
    # the same operations on the same inputs again, so the rounding bounds below hold unchanged
    ranks = _run_gang(model_dir, tmp_path, replicas, checkpointing=replicas == 1)
    r0 = ranks[0]
    assert r0["dtypes"] == {"param": "torch.float32", "exp_avg": "torch.float32", "sharded": "DTensor"}
    if replicas == 1:         # sharded over both ranks: each holds about half of every parameter
        assert all(r["local_numel"] < 0.6 * r["numel"] for r in ranks)
    else:                     # one rank per replica: replicated
        assert all(r["local_numel"] == r["numel"] for r in ranks)
    assert all(r["states"][0] == {} for r in ranks[1:]), "only rank 0 receives the gathered weights"
    start = TrainerEngine(model_dir).state_dict()
    # the gang's log-probs and norm of step t are of the weights it held before step t's update
    redo = _in_own_process(tmp_path, _rounding_reference, str(model_dir), [start] + r0["states"][:-1], r0["moments"])
    assert redo["threads"] == 1
    samples = _samples(model_dir)
    for step in range(STEPS):
        logprob_tol, norm_rtol = _fp32_bounds(model_dir, samples, redo["max_logit"][step])
        for r in ranks:
            assert r["norms"][step] == pytest.approx(redo["norms"][step], rel=norm_rtol)
            for k, lp in r["logprobs"][step].items():
                torch.testing.assert_close(lp, redo["logprobs"][step][k], atol=logprob_tol, rtol=0)
        covered = set().union(*(r["logprobs"][step] for r in ranks))
        assert covered == set(range(8))
        # one step from the gang's own state (weights and AdamW moments): every weight within its bound
        gap = rounding.same_step(r0["states"][step], redo["states"][step], redo["bounds"][step])
        assert gap.ok and gap.compared == r0["numel"], (step, str(gap))
    # the weights moved, and a step's offload freed the rank's (sharded) state and onload restored it exactly
    assert _max_weight_diff(r0["states"][-1], start) > 1e-4
    for r in ranks:
        sw = r["switch"]
        assert sw["freed"] and sw["bytes"] >= 3 * 4 * r["local_numel"] and sw["offload"] >= 0 and sw["onload"] >= 0


def test_bf16_mixed_gang_keeps_fp32_master_weights_and_tracks_fp32(model_dir, tmp_path, reference):
    ranks = _run_gang(model_dir, tmp_path, replicas=1, precision="bf16-mixed")
    r0 = ranks[0]
    assert r0["dtypes"] == {"param": "torch.float32", "exp_avg": "torch.float32", "sharded": "DTensor"}
    assert all(v.dtype == torch.float32 for v in r0["states"][-1].values())
    assert max(_bf16_logprob_diff(r["logprobs"][0], reference["logprobs"][0]) for r in ranks) > 0  # bf16 ran
    start = TrainerEngine(model_dir).state_dict()
    for step in range(STEPS):
        mixed, exact = (torch.cat([(s[k] - start[k]).reshape(-1) for k in start])
                        for s in (r0["states"][step], reference["states"][step]))
        cosine = float(mixed @ exact / (mixed.norm() * exact.norm()))
        assert cosine >= BF16_MIN_COSINE, (step, cosine)


def test_gathered_weights_carry_the_checkpoint_names(model_dir, tmp_path, reference):
    from bidirl.rl import model_folder as checkpoint
    state = reference["states"][0]
    assert "lm_head.weight" in state                         # the tied head travels with the weights
    checkpoint.check_weights(state, checkpoint.checkpoint_shapes(model_dir), tied=True, where="test")
    assert math.isclose(sum(v.numel() for k, v in state.items() if k != "lm_head.weight"),
                        TrainerEngine(model_dir).numel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the NCCL, bf16 path of the trainer)")
def test_a_one_gpu_nccl_gang_in_bf16_tracks_the_cpu_fp32_trainer(model_dir, tmp_path, reference):
    """The trainer's GPU path: FSDP2 over NCCL on one GPU, bf16-mixed by default on CUDA, against the CPU fp32
    reference — fp32 master weights, log-probs within the bf16 tolerance, each step's update pointing the fp32
    update's way, and an offload that gives the GPU memory back."""
    ranks = _run_gang(model_dir, tmp_path, replicas=1, precision="auto", world=1, device="cuda")
    r0 = ranks[0]
    assert r0["dtypes"] == {"param": "torch.float32", "exp_avg": "torch.float32", "sharded": "DTensor"}
    assert _bf16_logprob_diff(r0["logprobs"][0], reference["logprobs"][0]) > 0
    start = TrainerEngine(model_dir).state_dict()
    for step in range(STEPS):
        mixed, exact = (torch.cat([(s[k].cpu() - start[k]).reshape(-1) for k in start])
                        for s in (r0["states"][step], reference["states"][step]))
        assert float(mixed @ exact / (mixed.norm() * exact.norm())) >= BF16_MIN_COSINE, step
    sw = r0["switch"]
    assert sw["freed"] and r0["offloaded_device_bytes"] <= sw["device_bytes"] - sw["bytes"] // 2
