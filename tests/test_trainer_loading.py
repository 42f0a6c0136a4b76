"""Sharded loading: a rank of a gang reads only its shards from the checkpoint, and holds the same weights as a whole
load sharded afterwards — bit for bit (the same bytes read from the file, fp32: equality is exact, no tolerance).

The gang tests (``-m integration``) spawn gloo gangs on CPU; in each process one engine loads the model whole and is
then sharded (``gang=False``, the unsharded engine's path) and one is built on the meta device and reads its shards
(``gang=True``, what the engine driver starts for a gang of several ranks). Both models: the built-in tiny Qwen2
(tied head: one parameter for the embedding and the head) and the tiny Llama (untied head). The reference model
(``kl_coef > 0``) is loaded the same way, and :meth:`TrainerEngine.reset` reads the shards again after the weights
changed. Three ranks shard the tiny model's rows unevenly (32 vocabulary rows: 11, 11 and 10).

Threads: a trainer in a Ray actor sets torch's thread count to the whole CPUs Ray granted it, as Ray sets OpenMP's;
and it runs at the driver's priority, not below it (``bidirl.cluster.slots.workers_at_driver_priority``).
"""

from __future__ import annotations

import os

import pytest
import torch

from bidirl.cluster.engines.workers.trainer import TrainerEngine

from gang_rendezvous import join_gang, spawn_gang


@pytest.fixture(scope="module")
def llama_dir(model_dir):
    from bidirl.rl.bootstrap import ensure_tiny_model
    from bidirl.rl.tiny_model import TINY_LLAMA
    return ensure_tiny_model(cache_dir=model_dir.parent, cfg=TINY_LLAMA)


def _locals(model) -> dict:
    """This rank's part of every parameter and buffer of ``model`` (plain CPU tensors, by module name)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        out[name] = local.detach().clone()
    return out


def _samples(model_dir):
    from bidirl.rl.samples import Sample
    from bidirl.rl.tiny_model import load_tokenizer
    tok = load_tokenizer(model_dir)
    return [Sample(0, i, tuple(tok(f"{i}+{i}=")["input_ids"]), tuple(tok(str(2 * i))["input_ids"]), (), 1.0, 0)
            for i in range(1, 4)]


def _loading_worker(rank, world, addr, model_dir, out_dir):
    engines = {gang: TrainerEngine(model_dir, seed=0, threads=1, kl_coef=0.1, gang=gang, activation_checkpointing=True)
               for gang in (False, True)}
    join_gang(rank, world, addr)                # both engines take the group joined here
    for engine in engines.values():
        engine.init_process_group(rank, world, addr)
    out = {}
    for gang, e in engines.items():
        m = e.model
        # the log-probs run the gang's all-gathers: the weights FSDP2 gathers are the ones read, not a copy of them
        out[gang] = {"model": _locals(m), "reference": _locals(e.reference_model()),
                     "tied": m.get_output_embeddings().weight is m.get_input_embeddings().weight,
                     "local_numel": e.local_numel, "logprobs": e.logprobs(_samples(model_dir))}
    e = engines[True]                      # the weights move, then reset reads the shards again
    with torch.no_grad():
        for p in e.params:
            p.to_local().add_(1.0)
    e.reset()
    out["reset"] = _locals(e.model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    engines[False].destroy_process_group()


def _gang(model_dir, tmp_path, world):
    spawn_gang(_loading_worker, world, str(model_dir), str(tmp_path))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.integration
@pytest.mark.parametrize("which,world", [("qwen2", 2), ("llama", 2), ("qwen2", 3)],
                         ids=["tied-qwen2-2-ranks", "untied-llama-2-ranks", "tied-qwen2-3-uneven-ranks"])
def test_a_ranks_shards_read_from_the_files_equal_the_whole_load_sharded(model_dir, llama_dir, tmp_path, which,
                                                                         world):
    folder = model_dir if which == "qwen2" else llama_dir
    ranks = _gang(folder, tmp_path, world)
    whole = TrainerEngine(folder, seed=0, threads=1).model
    for j, r in enumerate(ranks):
        full, sharded = r[False], r[True]
        _assert_identical(sharded["model"], full["model"])           # parameters and buffers (RoPE's inv_freq)
        _assert_identical(sharded["reference"], full["reference"])
        _assert_identical(r["reset"], full["model"])
        assert all(torch.equal(a, b) for a, b in zip(sharded["logprobs"], full["logprobs"], strict=True))
        assert sharded["tied"] == full["tied"] == (which == "qwen2")
        # rank j holds rows [j·c, min(N, (j + 1)·c)) of each parameter of N rows, c = ⌈N / world⌉ (torch.chunk)
        rows = [(p.shape[0], p.numel() // p.shape[0]) for p in whole.parameters()]
        mine = sum(max(0, min(n, (j + 1) * -(-n // world)) - j * -(-n // world)) * cols for n, cols in rows)
        assert sharded["local_numel"] == full["local_numel"] == mine
    # the shards are the whole model's rows (3 ranks of 32 vocabulary rows: 11, 11, 10)
    embed = "model.embed_tokens.weight"
    torch.testing.assert_close(torch.cat([r[True]["model"][embed] for r in ranks]), whole.get_parameter(embed),
                               rtol=0, atol=0)
    assert [r[True]["model"][embed].shape[0] for r in ranks] == ([16, 16] if world == 2 else [11, 11, 10])


def test_an_engine_built_for_a_gang_that_works_alone_loads_the_whole_model(model_dir):
    alone = TrainerEngine(model_dir, seed=0, threads=1, gang=True)
    assert all(p.is_meta for p in alone.model.parameters())         # nothing read yet
    whole = TrainerEngine(model_dir, seed=0, threads=1)
    _assert_identical(alone.state_dict(), whole.state_dict())
    _assert_identical(dict(alone.model.named_buffers()), dict(whole.model.named_buffers()))
    assert not alone.sharded and alone.model.lm_head.weight is alone.model.model.embed_tokens.weight
    assert alone.optimizer.param_groups[0]["params"][0] is alone.params[0] and not alone.params[0].is_meta
    with pytest.raises(ValueError, match="TrainerEngine.gang"):
        TrainerEngine(model_dir, gang="yes")


@pytest.mark.integration
def test_an_actors_torch_threads_are_the_whole_cpus_ray_granted_it(ray_session):
    ray = ray_session

    @ray.remote
    class Probe:
        def threads(self):
            from bidirl.cluster.engines.workers.trainer import TrainerEngine
            return TrainerEngine.host_threads("cuda"), int(os.environ["OMP_NUM_THREADS"])

    for cpus, whole in ((2.5, 2), (0.05, 1)):          # ⌊granted⌋, at least one: what Ray gives OpenMP
        probe = Probe.options(num_cpus=cpus).remote()
        assert ray.get(probe.threads.remote(), timeout=120) == (whole, whole)
        ray.kill(probe)


@pytest.mark.integration
def test_the_sessions_workers_run_at_the_drivers_priority(ray_session):
    """The session's Ray is started as the library starts an embedded one: its workers at the driver's niceness
    (Ray's own default is 15, at which the engines starve beside any other busy process)."""
    ray = ray_session

    @ray.remote
    def niceness():
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=120) == os.nice(0)
