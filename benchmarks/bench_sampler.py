"""Position-keyed sampling (partial rollout, paper §2.2 / §3.2): the vectorised sampler against the previous one.

Issue #24, part 5. :class:`PreviousPositionKeyedSampler` below is the previous release's implementation, kept
here only for comparison: one ``torch.Generator`` per row per decode step (mt19937 on CPU), a Python loop over
the rows and a device sync per row. The library's :class:`~bidirl.cluster.engines.workers.sampler.PositionKeyedSampler`
draws counter-based noise for the whole batch in one vectorised pass. Figures (``bidirl bench --only sampler``;
medians over the calls ``--repeats`` makes):

* ``decode_tokens_per_s_{previous,new,per_row_new_noise}`` (benchmark ``sampler_decode``) — tokens per second
  of one CPU rollouter (the built-in tiny model, in-process vLLM) generating the same requests with the same
  seeds (``GROUPS`` groups × ``GROUP_SIZE`` responses × ``TOKENS`` tokens, EOS ignored; the wall time of
  ``RolloutEngine.generate``: one prefill step, the rest decode steps) under each sampler. The engine is
  started once per process and its logits processor is switched between runs
  (``implementations()["switched"]``); one call makes ``ROUNDS`` rounds of one run per sampler, in an order
  that rotates, and reports the rounds' medians (the speedup: the median of each round's paired ratio, runs
  seconds apart seeing the same load on a shared machine). The engine runs on one torch thread, unbound
  (``torch_threads``; as the cluster's rollouter actors run with ``num_cpus=1``), and
  ``decode_tokens_per_cpu_s_*`` divides by the process's CPU time instead of the wall time: what the work
  costs, whatever else the machine runs. ``per_row_new_noise`` is the previous loop drawing the new noise per
  row — a plain reference of the new draw — which separates the cost of the loop from the cost of the
  generator;
* ``same_tokens_new_vs_per_row_reference`` — 1 when the vectorised sampler generated exactly the per-row
  reference's tokens in every run (the engine-level form of ``tests/test_sampler.py``), else 0;
* ``previous_vs_new_equal_token_fraction`` — the fraction of positions where the previous and the new sampler
  chose the same token: the streams differ by design (different noise), this says by how much;
* ``apply_us_{previous,new}`` (benchmark ``sampler_apply``) — one ``apply`` on [``ROWS``, ``VOCAB``] fp32
  logits (Qwen2/3's vocabulary), all rows seeded, µs per call, on one torch thread (``torch_threads``: on a
  shared machine a second thread makes every parallel op wait for a descheduled peer; vLLM's CPU backend keeps
  the threads it bound once an engine started in the process, hence this benchmark runs before
  ``sampler_decode``); ``apply_us_*_tiny_vocab`` the same at the tiny model's vocabulary, where the per-row
  overhead is all there is; ``apply_us_*_cuda`` the full vocabulary on the GPU when there is one.
"""

from __future__ import annotations

import functools
import statistics
import time
from types import SimpleNamespace

ROWS, VOCAB = 256, 151936
GROUPS, GROUP_SIZE, TOKENS = 32, 8, 32          # 256 responses: vLLM's default max_num_seqs, one batch
QUICK_GROUPS, QUICK_TOKENS = 8, 16
ROUNDS = 3                                      # decode runs per sampler in one call (1 with --quick)


# --------------------------------------------------------------------------------------------------
# the previous release's implementation (for comparison only; not the library's)
# --------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def implementations() -> dict:
    """``{"previous", "new", "per_row_new_noise"}`` → logits processor class, and ``"switched"``: the benchmark
    engine's processor. Defined on first use: vLLM is imported only when this benchmark runs."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor

    from bidirl.cluster.engines.workers import sampler as keyed
    from bidirl.cluster.engines.workers.sampler import (PositionKeyedSampler, apply_batch_update,
                                                        position_seed)

    def previous_gumbel_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
        """The previous release's noise of one position: a ``torch.Generator`` seeded by the position key."""
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(position_seed(seed, position))
        u = torch.rand(vocab, generator=gen, dtype=torch.float32, device=device).clamp_(1e-20, 1.0 - 1e-7)
        return -torch.log(-torch.log(u))

    class PreviousPositionKeyedSampler(LogitsProcessor):
        """The previous release's ``PositionKeyedSampler``: a Python loop over the rows, a generator and a
        device sync (``int(argmax)``) for each."""

        noise = staticmethod(previous_gumbel_noise)
        validate_params = PositionKeyedSampler.validate_params

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.device = device
            self.rows: dict = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            if not batch_update:
                return
            apply_batch_update(self.rows, batch_update, lambda *row: row)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            vocab = logits.shape[-1]
            for row, (seed, temperature, prompt_len, output_ids) in self.rows.items():
                if row >= logits.shape[0]:
                    continue
                position = prompt_len + len(output_ids)
                scores = logits[row] / temperature + self.noise(seed, position, vocab, logits.device)
                token = int(torch.argmax(scores))
                logits[row].fill_(float("-inf"))
                logits[row, token] = 0.0
            return logits

    class PerRowNewNoiseSampler(PreviousPositionKeyedSampler):
        """The previous per-row loop drawing the library's new noise: a plain reference of the vectorised draw."""

        noise = staticmethod(keyed.gumbel_noise)

    impls = {"previous": PreviousPositionKeyedSampler, "new": PositionKeyedSampler,
             "per_row_new_noise": PerRowNewNoiseSampler}

    class SwitchedSampler(LogitsProcessor):
        """The benchmark engine's logits processor: the implementation named by the class's ``mode``.

        A mode change takes effect at the next call with a fresh processor; the benchmark changes it only
        between ``generate`` calls, when vLLM's batch is empty.
        """

        mode = "new"
        validate_params = PositionKeyedSampler.validate_params

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self._args = (vllm_config, device, is_pin_memory)
            self._mode, self._impl = None, None

        def is_argmax_invariant(self) -> bool:
            return False

        def _current(self) -> LogitsProcessor:
            if self._mode != type(self).mode:
                self._mode, self._impl = type(self).mode, impls[type(self).mode](*self._args)
            return self._impl

        def update_state(self, batch_update) -> None:
            self._current().update_state(batch_update)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return self._current().apply(logits)

    return {**impls, "switched": SwitchedSampler}


MODES = ("previous", "new", "per_row_new_noise")


# --------------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------------

_STATE: dict = {"engine": None, "calls": 0, "warm": set()}


def _engine():
    """One tiny-model rollouter per process whose sampler the benchmark switches (started on first use), on one
    torch thread without vLLM's CPU binding — as the cluster's rollouter actors (``num_cpus=1``) run — unless
    ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise."""
    if _STATE["engine"] is None:
        import os
        from unittest import mock

        import torch

        from bidirl.cluster.engines.workers import sampler as keyed
        from bidirl.cluster.engines.workers.rollout import RolloutEngine
        from bidirl.rl.bootstrap import ensure_tiny_model
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        if env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
            torch.set_num_threads(1)
        # the engine installs the sampler module's PositionKeyedSampler: the switched one, for this engine only
        with mock.patch.object(keyed, "PositionKeyedSampler", implementations()["switched"]), \
                mock.patch.dict(os.environ, env):
            _STATE["engine"] = RolloutEngine(ensure_tiny_model(), seed=0, max_model_len=64,
                                             max_num_seqs=GROUPS * GROUP_SIZE)
        _STATE["threads"] = torch.get_num_threads()
    return _STATE["engine"]


def _requests(engine, groups: int, tokens: int):
    from bidirl.cluster.engines.workers.rollout import GroupRequest
    from bidirl.rl.tasks import ArithmeticTask
    prompts = ArithmeticTask(seed=0).prompts(groups, start=0)
    return [GroupRequest(i, tuple(engine.tokenizer(p.text)["input_ids"]), GROUP_SIZE, tokens, ignore_eos=True)
            for i, p in enumerate(prompts)]


def _decode(quick: bool) -> dict:
    """Decode figures of one call: ``ROUNDS`` rounds, each one run per sampler in a rotated order; rates are
    the medians over the rounds and the speedup the median of the rounds' paired ratios (runs seconds apart
    see the same load on a shared machine)."""
    engine = _engine()
    switched = implementations()["switched"]
    reqs = _requests(engine, QUICK_GROUPS if quick else GROUPS, QUICK_TOKENS if quick else TOKENS)
    rates, cpu_rates, tokens = {m: [] for m in MODES}, {m: [] for m in MODES}, {m: [] for m in MODES}
    try:
        for _ in range(1 if quick else ROUNDS):
            shift = _STATE["calls"] % len(MODES)
            _STATE["calls"] += 1
            for mode in MODES[shift:] + MODES[:shift]:
                switched.mode = mode
                if mode not in _STATE["warm"]:            # a mode's first run allocates and sets up: not counted
                    engine.generate(reqs)
                    _STATE["warm"].add(mode)
                wall, cpu = time.perf_counter(), time.process_time()
                out = engine.generate(reqs)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                tokens[mode].append([list(ids) for g in out for ids in g.payload.token_ids])
                n = sum(map(len, tokens[mode][-1]))
                rates[mode].append(n / wall)
                cpu_rates[mode].append(n / cpu)
    finally:
        switched.mode = "new"
    pairs = [(a, b) for x, y in zip(tokens["previous"][0], tokens["new"][0]) for a, b in zip(x, y)]
    return {"torch_threads": (_STATE["threads"], "threads"),
            **{f"decode_tokens_per_s_{m}": (statistics.median(rates[m]), "tokens/s") for m in MODES},
            "decode_speedup_new_over_previous": (_paired(rates), "x"),
            **{f"decode_tokens_per_cpu_s_{m}": (statistics.median(cpu_rates[m]), "tokens/s") for m in MODES},
            "decode_cpu_speedup_new_over_previous": (_paired(cpu_rates), "x"),
            "same_tokens_new_vs_per_row_reference": (float(tokens["new"] == tokens["per_row_new_noise"]), "bool"),
            "previous_vs_new_equal_token_fraction": (sum(a == b for a, b in pairs) / len(pairs), "fraction")}


def _paired(rates: dict) -> float:
    """The median over rounds of new / previous (the two runs of a round are seconds apart)."""
    return statistics.median(n / p for n, p in zip(rates["new"], rates["previous"]))


def _apply_us(vocab: int, calls: int, device: str = "cpu") -> dict:
    """Median µs per ``apply`` of the previous and the new sampler on the same [ROWS, vocab] seeded logits
    (calls interleaved; a fresh copy of the logits before each call, not timed; the first call not counted; on
    CUDA the device is synchronised before and after each timed call)."""
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate

    from bidirl.cluster.engines.workers.sampler import SEED_KEY, TEMPERATURE_KEY

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base = (torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0)) * 3.0).to(dev)
    added = [(r, SimpleNamespace(extra_args={SEED_KEY: 1000 + r, TEMPERATURE_KEY: 1.0}), [0] * 100, [0] * (r % 64))
             for r in range(ROWS)]
    procs = {}
    for mode in ("previous", "new"):
        procs[mode] = implementations()[mode](None, dev, dev.type == "cuda")
        procs[mode].update_state(BatchUpdate(ROWS, removed=[], added=added, moved=[]))
    logits, times = base.clone(), {m: [] for m in procs}
    for _ in range(calls + 1):
        for mode, proc in procs.items():
            logits.copy_(base)
            sync()
            t = time.perf_counter()
            proc.apply(logits)
            sync()
            times[mode].append(time.perf_counter() - t)
    return {m: statistics.median(ts[1:]) * 1e6 for m, ts in times.items()}


def bench_sampler_apply(quick: bool) -> dict:
    import torch

    from bidirl.rl.tiny_model import TinyConfig
    threads = torch.get_num_threads()
    torch.set_num_threads(1)         # vLLM's CPU backend ignores this once an engine of this process bound them
    out = {"torch_threads": (torch.get_num_threads(), "threads")}
    cases = [("cpu", VOCAB, "", 1 if quick else 3), ("cpu", TinyConfig.vocab_size, "_tiny_vocab", 20)]
    if torch.cuda.is_available():
        cases.append(("cuda", VOCAB, "_cuda", 5 if quick else 20))
    try:
        for device, vocab, suffix, calls in cases:
            us = _apply_us(vocab, calls, device)
            out.update({f"apply_us_{m}{suffix}": (v, "us") for m, v in us.items()})
            out[f"apply_speedup{suffix}"] = (us["previous"] / us["new"], "x")
    finally:
        torch.set_num_threads(threads)
    return out


def bench_sampler_decode(quick: bool) -> dict:
    return _decode(quick)


# registered in this order: `--only sampler` runs every apply repeat before the decode starts an engine
BENCHMARKS = {"sampler_apply": bench_sampler_apply, "sampler_decode": bench_sampler_decode}

if __name__ == "__main__":
    for bench in BENCHMARKS.values():
        for name, (value, unit) in bench(quick=True).items():
            print(f"{name:45s} {value:12.4g} {unit}")
