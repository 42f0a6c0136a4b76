"""Experiment tracking: one row of metrics per training step, under veRL's names, in JSONL and TensorBoard.

:func:`step_metrics` turns a run's event log (and, for engine runs, the trainer's per-step statistics) into
one dict per step; it reads only :class:`~bidirl.results.trace.EventLog` tables and the ``train`` list of a run
summary, so a simulated, an emulated and a real run are tracked by the same code. Names follow veRL
(``verl/trainer/ppo/metric_utils.py`` and the fully-async recipe) where the meaning is the same:

=================================== ===========================================================================
``training/global_step``            step + 1 (veRL counts steps from 1; TensorBoard's step axis)
``timing_s/step``                   the step's wall time: from the end of the previous step to the end of this
                                    one's weight sync (``StepRecord.end − start``)
``timing_s/gen``                    how long the trainer waited for the step's batch (``StepRecord.wait``)
``timing_s/old_log_prob``, ``timing_s/ref``, ``timing_s/update_actor``
                                    the step's chunk times per stage, summed over its chunks (event log; chunks
                                    that ran side by side on two gangs both count)
``timing_s/param_sync``             the weight sync that ended the step (on the primary trainer's lane)
``perf/total_num_tokens``           prompt + response tokens the step consumed
``perf/time_per_step``              = ``timing_s/step``
``perf/throughput``                 tokens / (step time × GPUs of the job), veRL's per-GPU figure
``fully_async/trainer/idle_ratio``  ``timing_s/gen / timing_s/step`` (veRL's definition)
``fully_async/rollouter/idle_ratio`` share of the step during which no primary rollouter generated
``critic/score/mean|max|min``       the responses' rewards (engine runs)
``response_length/mean|max|min``    response tokens; ``response_length/clip_ratio``: share that hit
                                    ``workload.max_response_len``
``prompt_length/mean|max|min``      prompt tokens
``actor/pg_loss``                   the clipped policy-gradient loss (step-level token-mean normaliser)
``actor/kl_loss``                   k3 KL to the reference model (with ``rl.reference_model``), token mean
``actor/pg_clipfrac``               share of tokens whose ratio was clipped
``actor/grad_norm``, ``actor/lr``   the update's gradient norm and the learning rate
=================================== ===========================================================================

and bidirl's own: ``bidirl/throughput`` (tokens/s of the whole job, §7.1's quantity for one step),
``bidirl/idle_pool_union/<pool>`` (pool-union idle: share of the step in which no worker of the pool was busy,
as ``bidirl.results.metrics.idle`` — not the GPU-weighted idle of the run summary), ``bidirl/borrows/<direction>/admitted|rejected`` (the scheduler's decisions during
the step), ``bidirl/switch_s/<direction>/c_in|c_out`` (mean measured switch time of the switches that ended
during the step) and ``…/trainer_on_rollout_pool/c_grad`` (the step's gradient merge),
``bidirl/rollout_logprob_diff_max`` (vLLM vs trainer log-prob gap; with route replay on, the gap with it) and
``bidirl/rollout_logprob_diff_max_no_r3`` (the same samples' gap with the trainer routing by itself:
``rl.route_replay_compare``), ``bidirl/micro_batch_passes`` (with ``rl.max_tokens_per_micro_batch``: the
update's forward-and-backward passes, summed over the ranks of every gang that ran its chunks),
``bidirl/optimizer_updates`` (with ``rl.mini_batch_prompts``: the step's optimizer updates, one per mini-batch),
``bidirl/samples`` and ``bidirl/version``.
A key is left out of a row when the step has no value for it (no switch, no reference model, a simulated run).

A run's output folder (``bidirl run CONFIG --out DIR``) holds ``metrics.jsonl`` (one JSON object per step),
``tensorboard/`` (event files: ``tensorboard --logdir DIR``), ``trace.json`` (Chrome / Perfetto trace),
``events.parquet`` (the event log, ``EventLog.load``), ``config.yaml`` and, for a run that finished,
``summary.json``. Engine runs write each step's row while they run (:class:`LiveStepMetrics`), a step's row once
the next step has finished (when every span of its window has arrived), and the rest when the run ends,
also when it fails. :func:`load_metrics` reads ``metrics.jsonl`` back as a DataFrame for a notebook.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from bidirl.core import protocol as P
from bidirl.errors import BidirlError
from bidirl.results.metrics import ordered_steps, union_intervals
from bidirl.results.trace import EventLog

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
TRACE_FILE = "trace.json"
EVENTS_FILE = "events.parquet"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"

#: trainer stage -> veRL timing name
STAGE_TIMING = {"old_logprob": "timing_s/old_log_prob", "ref_logprob": "timing_s/ref",
                "actor_update": "timing_s/update_actor"}
#: veRL name -> key of an engine run's per-step train statistics (``summary()["train"]``)
TRAIN_METRICS = {
    "critic/score/mean": "reward", "critic/score/max": "reward_max", "critic/score/min": "reward_min",
    "response_length/mean": "response_length", "response_length/max": "response_length_max",
    "response_length/min": "response_length_min", "response_length/clip_ratio": "response_clip_ratio",
    "prompt_length/mean": "prompt_length", "prompt_length/max": "prompt_length_max",
    "prompt_length/min": "prompt_length_min",
    "actor/pg_loss": "pg_loss", "actor/pg_clipfrac": "clip_frac", "actor/grad_norm": "grad_norm",
    "bidirl/rollout_logprob_diff_max": "logprob_diff_max",
    "bidirl/rollout_logprob_diff_max_no_r3": "logprob_diff_max_no_r3",
    "bidirl/micro_batch_passes": "micro_batch_passes",
    "bidirl/optimizer_updates": "optimizer_updates",
}


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------

def step_metrics(result) -> list:
    """One dict per step of a :class:`~bidirl.results.run_result.RunResult` (simulated, emulated or measured); keys in
    the module docstring."""
    summary = result.summary()
    pools = [p for p, v in (summary.get("idle") or {}).items() if v is not None]
    return metrics_from_log(result.log, config=result.config, train=summary.get("train") or (), pools=pools)


def metrics_from_log(log: EventLog, *, config, train: Sequence[dict] = (), pools: Sequence[str] = P.POOLS,
                     steps: Optional[Iterable[int]] = None) -> list:
    """The rows of :func:`step_metrics` from an event log, the job's config and the per-step train statistics
    (``pools``: the pools that have GPUs; ``steps``: only these steps)."""
    table = ordered_steps(log.steps_df())
    if steps is not None:
        table = table[table["step"].isin(list(steps))]
    if not len(table):
        return []
    spans, decisions = log.spans_df(), log.decisions_df()
    starts, ends = table["start"].to_numpy(np.float64), table["end"].to_numpy(np.float64)
    durations = ends - starts
    index = {int(s): k for k, s in enumerate(table["step"])}
    rows = [{"step": int(s), "training/global_step": int(s) + 1} for s in table["step"]]

    def put(k: int, key: str, value) -> None:
        if value is not None and np.isfinite(value):
            rows[k][key] = float(value)

    gpus = config.cluster.gpus
    for k, rec in enumerate(table.itertuples(index=False)):
        d = durations[k]
        put(k, "timing_s/step", d)
        put(k, "timing_s/gen", rec.wait)
        put(k, "perf/total_num_tokens", rec.tokens)
        put(k, "perf/time_per_step", d)
        put(k, "bidirl/samples", rec.samples)
        put(k, "bidirl/version", rec.version)
        if d > 0:
            put(k, "perf/throughput", rec.tokens / (d * gpus))
            put(k, "bidirl/throughput", rec.tokens / d)
            put(k, "fully_async/trainer/idle_ratio", rec.wait / d)

    # time covered by busy spans within each step's window (union based)
    def covered(mask) -> np.ndarray:
        sel = spans[mask]
        return _covered(*union_intervals(sel["start"].to_numpy(), sel["end"].to_numpy()), starts, ends)

    with np.errstate(divide="ignore", invalid="ignore"):
        gen = covered((spans["pool"] == P.ROLLOUT_POOL) & (spans["role"] == P.PRIMARY) & (spans["kind"] == "generate"))
        for k in range(len(rows)):
            if durations[k] > 0 and P.ROLLOUT_POOL in pools:
                put(k, "fully_async/rollouter/idle_ratio", 1.0 - gen[k] / durations[k])
        for pool in pools:
            busy = covered(spans["pool"] == pool)
            for k in range(len(rows)):
                if durations[k] > 0:
                    put(k, f"bidirl/idle_pool_union/{pool}", 1.0 - busy[k] / durations[k])

    # per-step sums of chunk times per stage, the step's weight sync and gradient merge
    chunks = spans[spans["kind"] == "chunk"]
    stages = [d.get("stage") if isinstance(d, dict) else None for d in chunks["detail"]]
    for (step, stage), seconds in _sum_by(chunks["step"], stages, chunks["end"] - chunks["start"]).items():
        if step in index and stage in STAGE_TIMING:
            put(index[step], STAGE_TIMING[stage], seconds)
    syncs = spans[(spans["kind"] == "sync") & (spans["worker"] == P.PRIMARY_TRAINER)]
    for (step, _), seconds in _sum_by(syncs["step"], [None] * len(syncs), syncs["end"] - syncs["start"]).items():
        if step in index:
            put(index[step], "timing_s/param_sync", seconds)
    merges = spans[spans["kind"] == "grad_merge"]
    for (step, _), seconds in _sum_by(merges["step"], [None] * len(merges), merges["end"] - merges["start"]).items():
        if step in index:
            put(index[step], f"bidirl/switch_s/{P.TRAINER_ON_ROLLOUT_POOL}/c_grad", seconds)

    # decisions and switches: the step whose window holds the time (a decision) or the end (a switch)
    for direction in P.DIRECTIONS:
        picked = decisions[decisions["direction"] == direction]
        for admitted, label in ((True, "admitted"), (False, "rejected")):
            t = picked["t"][picked["admitted"] == admitted].to_numpy(np.float64)
            counts = np.bincount(_window_of(t, starts, ends), minlength=len(rows) + 1)[:len(rows)]
            for k in range(len(rows)):
                put(k, f"bidirl/borrows/{direction}/{label}", counts[k])
    switches = spans[spans["kind"].isin(["switch_in", "switch_out"])]
    if len(switches):
        directions = [d.get("direction") if isinstance(d, dict) else None for d in switches["detail"]]
        window = _window_of(switches["end"].to_numpy(np.float64), starts, ends)
        frame = pd.DataFrame({"k": window, "direction": directions, "kind": switches["kind"].to_numpy(),
                              "seconds": (switches["end"] - switches["start"]).to_numpy()})
        frame = frame[(frame["k"] < len(rows)) & frame["direction"].isin(P.DIRECTIONS)]
        for (k, direction, kind), seconds in frame.groupby(["k", "direction", "kind"])["seconds"].mean().items():
            put(int(k), f"bidirl/switch_s/{direction}/{'c_in' if kind == 'switch_in' else 'c_out'}", seconds)

    # the trainer's statistics (engine runs)
    by_step = {int(st["step"]): st for st in train if "step" in st}
    for k, row in enumerate(rows):
        st = by_step.get(row["step"])
        if st is None:
            continue
        for name, key in TRAIN_METRICS.items():
            value = st.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                put(k, name, value)
        if config.rl.reference_model and isinstance(st.get("kl"), (int, float)):
            put(k, "actor/kl_loss", st["kl"])
        put(k, "actor/lr", config.rl.lr)
    return rows


def _covered(us: np.ndarray, ue: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Length of the disjoint sorted intervals ``[us, ue]`` inside each window ``[a[k], b[k]]``."""
    if us.size == 0:
        return np.zeros(len(a))
    cum = np.concatenate([[0.0], np.cumsum(ue - us)])

    def upto(t: np.ndarray) -> np.ndarray:         # covered length of (-inf, t]
        i = np.searchsorted(us, t, side="right")   # intervals starting at or before t
        last = np.maximum(i - 1, 0)
        beyond = np.where(i > 0, np.maximum(0.0, ue[last] - t), 0.0)
        return cum[i] - beyond
    return upto(np.asarray(b, np.float64)) - upto(np.asarray(a, np.float64))


def _window_of(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the step window ``(start, end]`` (the first step: ``[start, end]``) holding each time; the
    number of steps for a time outside every window."""
    k = np.searchsorted(ends, t, side="left")
    inside = k < len(ends)
    kk = np.minimum(k, len(ends) - 1)
    inside &= (t > starts[kk]) | ((kk == 0) & (t >= starts[0]))
    return np.where(inside, k, len(ends)).astype(np.int64)


def _sum_by(steps, keys, seconds) -> dict:
    out: dict = {}
    for step, key, s in zip(steps, keys, seconds):
        out[(int(step), key)] = out.get((int(step), key), 0.0) + float(s)
    return out


# --------------------------------------------------------------------------------------------------
# writers and readers
# --------------------------------------------------------------------------------------------------

def _clean(row: dict) -> dict:
    return {k: v for k, v in row.items() if not (isinstance(v, float) and not math.isfinite(v))}


def write_jsonl(rows: Iterable[dict], path: Union[str, Path], append: bool = False) -> Path:
    """Write (or append) one JSON object per row."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a" if append else "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(_clean(row), allow_nan=False) + "\n")
    return out


def write_tensorboard(rows: Iterable[dict], logdir: Union[str, Path], writer=None) -> Path:
    """Write every number of every row as a TensorBoard scalar at step ``training/global_step``
    (``torch.utils.tensorboard.SummaryWriter``; pass an open ``writer`` to add to its file)."""
    own = writer is None
    if own:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(log_dir=str(logdir))
    try:
        for row in rows:
            global_step = int(row.get("training/global_step", row.get("step", 0) + 1))
            for tag, value in _clean(row).items():
                if tag != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(tag, float(value), global_step)
        writer.flush()
    finally:
        if own:
            writer.close()
    return Path(logdir)


def read_tensorboard(logdir: Union[str, Path]) -> pd.DataFrame:
    """Scalars of a TensorBoard folder as a long DataFrame (``tag, step, value``), e.g. to check what a run
    wrote."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    rows = [(tag, ev.step, ev.value) for tag in acc.Tags()["scalars"] for ev in acc.Scalars(tag)]
    return pd.DataFrame(rows, columns=["tag", "step", "value"])


def load_metrics(run_dir: Union[str, Path]) -> pd.DataFrame:
    """A run's ``metrics.jsonl`` as a DataFrame indexed by ``step`` (NaN where a step has no value)."""
    path = Path(run_dir)
    path = path / METRICS_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} at {str(path)!r}; pass the folder given to bidirl run --out")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    frame = pd.DataFrame(rows)
    return frame.set_index("step").sort_index() if "step" in frame else frame


def default_out_dir(root: Union[str, Path] = "results") -> Path:
    """``results/run-YYYYmmdd-HHMMSS`` (``-2``, ``-3``, … when it exists)."""
    stem = Path(root) / datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    out, n = stem, 1
    while out.exists():
        n += 1
        out = stem.with_name(f"{stem.name}-{n}")
    return out


class OutputError(BidirlError, OSError):
    """A run's output folder cannot be written."""


def check_out_dir(out_dir: Union[str, Path]) -> Path:
    """``out_dir`` as a path, refused (:class:`OutputError`) when it is a file or already holds a run's metrics,
    so two runs are never mixed in one folder and the problem shows before a run starts."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise OutputError(f"the output folder {str(path)!r} is a file; choose another --out")
    if (path / METRICS_FILE).exists() or (path / TENSORBOARD_DIR).exists():
        raise OutputError(f"the output folder {str(path)!r} already holds a run's metrics; choose a new --out or "
                          "remove the old run")
    return path


class RunOutput:
    """A run's output folder (module docstring): ``add_rows`` appends metric rows to ``metrics.jsonl`` and
    TensorBoard as they come; ``finish`` writes the trace, the event log and the summary and closes."""

    def __init__(self, out_dir: Union[str, Path], config=None):
        self.dir = check_out_dir(out_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if config is not None:
                (self.dir / CONFIG_FILE).write_text(config.to_yaml())
            (self.dir / METRICS_FILE).write_text("")
        except OSError as exc:
            raise OutputError(f"cannot write the run's outputs to {str(self.dir)!r}: {exc.strerror or exc}") from None
        self._writer = None

    def add_rows(self, rows: Sequence[dict]) -> None:
        if not rows:
            return
        write_jsonl(rows, self.dir / METRICS_FILE, append=True)
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=str(self.dir / TENSORBOARD_DIR))
        write_tensorboard(rows, self.dir / TENSORBOARD_DIR, writer=self._writer)

    def finish(self, log: EventLog, summary: Optional[dict] = None) -> Path:
        try:
            log.save(self.dir / TRACE_FILE)
            log.save(self.dir / EVENTS_FILE)
            if summary is not None:
                (self.dir / SUMMARY_FILE).write_text(json.dumps(summary, default=_jsonable, indent=1))
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        return self.dir


def _jsonable(value: Any):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def write_run(result, out_dir: Union[str, Path]) -> Path:
    """Write a finished :class:`~bidirl.results.run_result.RunResult`'s output folder at once (a simulation, say;
    the Ray drivers write theirs while they run, ``bidirl.cluster.pool.StepMetricsOutput``)."""
    output = RunOutput(out_dir, result.config)
    output.add_rows(step_metrics(result))
    return output.finish(result.log, result.summary())


class LiveStepMetrics:
    """Writes each step's row while a run goes on (module docstring). Call :meth:`step_done` after every
    ``StepDone`` and :meth:`close` when the run ends (however it ends)."""

    def __init__(self, output: RunOutput, config, pools: Sequence[str]):
        self.output, self.config, self.pools = output, config, list(pools)
        self.marks: list = []          # (spans, decisions) appended when step k finished
        self.written = 0               # rows written (steps 0 .. written-1)

    def step_done(self, log: EventLog, train: Sequence[dict]) -> None:
        self.marks.append((len(log.spans), len(log.decisions)))
        self._write(log, train, upto=len(log.steps) - 1)

    def close(self, log: EventLog, train: Sequence[dict], summary: Optional[dict] = None) -> Path:
        try:
            self._write(log, train, upto=len(log.steps))
        finally:
            out = self.output.finish(log, summary)
        return out

    def _write(self, log: EventLog, train, upto: int) -> None:
        """Rows of steps ``written .. upto-1``. A span or decision of step k's window arrives after step k-2
        finished, so the log is cut there (a long run's rows cost the same at every step)."""
        if upto <= self.written:
            return
        first = self.written
        spans_from, decisions_from = self.marks[first - 2] if first >= 2 else (0, 0)
        window = EventLog(spans=log.spans[spans_from:], steps=log.steps, decisions=log.decisions[decisions_from:])
        rows = metrics_from_log(window, config=self.config, train=train, pools=self.pools,
                                steps=range(first, upto))
        self.output.add_rows(rows)
        self.written = upto
