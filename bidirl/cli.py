"""The ``bidirl`` command line: one small function per subcommand, registered in :data:`COMMANDS`.

``bidirl plan CONFIG [--json] [--html FILE]``  Algorithm 1's static planner (paper §4)
``bidirl simulate CONFIG --policy P [--steps N] [--seed S] [--json] [--trace FILE] [--html FILE]``
``bidirl run CONFIG [--address ADDR] [--emulate] [--data-file F] [--reward R] [--out DIR] [--json] [--trace FILE]``
    the job on Ray; metrics (JSONL, TensorBoard), trace and summary go to ``--out`` (default results/run-<time>)
``bidirl reproduce [--out DIR] [--only PANEL ...] [--quick]``   the paper's evaluation, claim by claim
``bidirl bench [--json] [--quick]``            the benchmarks registered under ``benchmarks/``
``bidirl profile CONFIG --out DIR [--grid small|full] [--seed S]``   measure the real engines' stage times
``bidirl calibrate RECORDS_DIR --out PRESET.yaml [--hardware NAME] [--holdout F] [--seed S]``   fit a preset
``bidirl calibrate --log FILE --config JOB --out PRESET.yaml [--what-if]``   fit a preset to a job's step log
``bidirl trace import FILE --format ray-timeline|verl-log|bidirl [--map MAP.yaml|auto] --out DIR [--config JOB --what-if]``,
``bidirl trace map suggest TIMELINE [--out MAP.yaml]``
    a run bidirl did not make, in bidirl's Gantt, idle per pool, per-step bubbles (and what-if)
``bidirl config from-verl INPUT... --hardware NAME [--model M] [--dataset D] [--out JOB.yaml] [--lenient] [--json]``
    a veRL trainer YAML, script or Hydra overrides as a bidirl job config, every key mapped or named not used

Human-readable tables by default; ``--json`` prints one JSON object on stdout (keys fixed by DESIGN.md).
Configuration problems print ``error: <message>`` on stderr and exit with status 2, never a traceback.
Run as ``bidirl ...`` once installed, or ``python -m bidirl.cli ...`` / ``python -m bidirl ...``.

Adding a subcommand: write ``_args_<name>(parser)`` and ``_run_<name>(args) -> int`` and add a
:class:`Command` to :data:`COMMANDS`.

Benchmarks: every module ``benchmarks/bench_*.py`` of a source checkout defines
``BENCHMARKS = {name: fn}`` where ``fn(quick: bool) -> {figure: (value, unit)}``; ``bidirl bench`` calls
each ``fn`` ``--repeats`` times and reports the median of every figure as ``<name>.<figure>``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bidirl.errors import BidirlError


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True):
    """Send everything written to file descriptor 1 to stderr while the block runs (``--json`` commands).

    Ray's raylet and log monitor print warnings to the driver's stdout, and processes started in the block
    inherit the redirection, so a ``--json`` command's stdout holds its JSON object and nothing else.
    """
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class CommandError(BidirlError):
    """A problem the user can fix (printed as ``error: ...``, exit status 2)."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------

def _args_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config path or an example name (e.g. a6000-default)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--html", metavar="FILE", help="also write the sweep figure (plotly HTML) to FILE")
    p.add_argument("--rows", type=int, default=40, metavar="N",
                   help="show at most N sweep rows in the table (the best by pipeline rate; default 40)")


def _fmt(v, digits: int = 4) -> str:
    return "inf" if v == float("inf") else f"{v:.{digits}g}"


def format_plan(plan, rows: int = 40) -> str:
    """The human-readable envelope and sweep table of ``bidirl plan``."""
    from bidirl.results.metrics import RATE_UNIT
    cfg, env = plan.config, plan.envelope
    w = cfg.workload
    lines = [f"bidirl plan: {cfg.model} on {cfg.cluster.gpus} × {cfg.hardware} "
             f"({cfg.cluster.gpus_per_node} per node, placement {cfg.cluster.placement}); "
             f"{w.dataset}, {w.prompts_per_step} prompts × {w.group_size}, max response {w.max_response_len}",
             f"envelope {env.label} ({'fixed by cluster.partition' if plan.fixed else 'planner choice'})",
             f"  rollout pool  {env.rollout_gpus:>5} GPUs = {env.rollout_replicas} replicas × {env.rollout_layout} GPU"
             f"   M_r = {_fmt(env.rollout_time)} s   λ_r = {_fmt(env.rollout_rate)} {RATE_UNIT}",
             f"  trainer pool  {env.trainer_gpus:>5} GPUs = {env.trainer_replicas} replicas × {env.trainer_layout} GPU"
             f"   M_t = {_fmt(env.trainer_time)} s   λ_t = {_fmt(env.trainer_rate)} {RATE_UNIT}",
             f"  step end (in M_t; the sync in M_r too): optimizer {_fmt(env.optimizer_time)} s, weight sync "
             f"{_fmt(env.sync_time)} s",
             f"  pipeline rate λ_pipe = {_fmt(env.pipeline_rate)} {RATE_UNIT}", ""]
    sweep = plan.sweep
    shown = sweep
    if len(sweep) > rows:
        best = list(sweep["pipeline_rate"].nlargest(rows).index)
        chosen = list(sweep.index[sweep["chosen"]])
        if chosen and chosen[0] not in best:
            best = best[:-1] + chosen
        shown = sweep.loc[sorted(best)]
    table = shown[["label", "compatible", "rollout_replicas", "trainer_replicas", "rollout_time", "trainer_time",
                   "rollout_rate", "trainer_rate", "pipeline_rate", "chosen"]].copy()
    table["chosen"] = table["chosen"].map({True: "<==", False: ""})
    lines.append(f"sweep ({len(sweep)} candidates, {int(sweep['compatible'].sum())} compatible; times in s, "
                 f"rates in {RATE_UNIT}; splits as rollout GPUs-trainer GPUs):")
    lines.append(table.to_string(index=False, float_format=lambda v: _fmt(v)))
    if len(shown) < len(sweep):
        lines.append(f"… {len(sweep) - len(shown)} more candidates not shown (use --json for all)")
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    from bidirl.job.planner import plan as make_plan
    result = make_plan(args.config)
    if args.html:
        from bidirl.viz.plan import sweep_figure
        try:
            sweep_figure(result).write_html(args.html, include_plotlyjs=True)
        except OSError as exc:
            raise CommandError(f"cannot write {args.html}: {exc.strerror or exc}") from None
    moe = _moe_contrast(result)
    if args.json:
        out = result.to_dict()
        if moe is not None:
            out["moe_contrast"] = moe.to_dict()
        print(json.dumps(out))
    else:
        print(format_plan(result, rows=max(1, args.rows)))
        if moe is not None:
            print(format_moe_contrast(moe))
        if args.html:
            print(f"sweep figure written to {args.html}")
    return 0


def _moe_contrast(result):
    """The plan's MoE-vs-dense contrast (``bidirl.job.moe.contrast``) for an MoE model, else None."""
    if not result.config.model_spec.is_moe:
        return None
    from bidirl.job.moe import contrast
    return contrast(result.config, moe_plan=result)


def format_moe_contrast(c) -> str:
    """Why an MoE job's split differs from a dense job of the same active size (``bidirl plan``'s MoE section)."""
    moe, dense = c.moe_plan, c.dense_plan
    lines = ["", f"why this split, against the dense {dense.config.model} of about the same active size "
             f"(MoE {moe.choice}, trainer EP {moe.envelope.trainer_expert_parallel}; dense {dense.choice}):"]
    lines += [f"  - {reason}" for reason in c.reasons]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------

def _args_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="smaller problems and fewer repeats")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="calls per benchmark whose median is reported (default 5, 3 with --quick)")
    p.add_argument("--only", metavar="TEXT", default=None,
                   help="run only the benchmarks whose name contains TEXT")
    p.add_argument("--size", metavar="SIZE", default=None,
                   help="model size for benchmarks that take one (trainer_scale, gpu_path: tiny, small, 4b, 8b; "
                        "gpu_path's 4b / 8b need a CUDA GPU)")


def load_benchmarks() -> dict:
    """``{name: fn}`` from every ``benchmarks/bench_*.py`` of the source checkout this package runs from."""
    root = Path(__file__).resolve().parent.parent
    folder = root / "benchmarks"
    if not (folder / "__init__.py").exists():
        raise CommandError("bidirl bench needs a source checkout: no benchmarks/ folder next to the bidirl "
                           "package; run it from a clone of the repository")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    pkg = importlib.import_module("benchmarks")
    if Path(pkg.__file__).resolve().parent != folder:
        raise CommandError(f"another module named 'benchmarks' ({pkg.__file__}) shadows the repository's "
                           "benchmarks/ folder; run from the repository root")
    registry: dict = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("bench_"):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        for name, fn in getattr(module, "BENCHMARKS", {}).items():
            if name in registry:
                raise CommandError(f"benchmark {name!r} is registered twice ({info.name})")
            registry[name] = fn
    return registry


def run_benchmarks(registry: dict, *, repeats: int, quick: bool, progress: bool = False,
                   size: Optional[str] = None) -> dict:
    """``{"<bench>.<figure>": {"value": median, "unit", "values": [...]}}`` over ``repeats`` calls each
    (``size`` goes to the benchmarks whose function takes a ``size`` argument)."""
    import inspect
    from tqdm.auto import tqdm
    samples: dict = {}
    units: dict = {}
    jobs = [(name, fn) for name, fn in registry.items() for _ in range(repeats)]
    for name, fn in tqdm(jobs, desc="bench", disable=not progress, file=sys.stderr):
        out = fn(quick, size=size) if size is not None and "size" in inspect.signature(fn).parameters else fn(quick)
        for figure, (value, unit) in out.items():
            key = f"{name}.{figure}"
            samples.setdefault(key, []).append(float(value))
            units[key] = str(unit)
    return {k: {"value": statistics.median(v), "unit": units[k], "values": v} for k, v in samples.items()}


def _run_bench(args: argparse.Namespace) -> int:
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1:
        raise CommandError("--repeats must be ≥ 1")
    registry = load_benchmarks()
    if args.only:
        registry = {k: v for k, v in registry.items() if args.only in k}
        if not registry:
            raise CommandError(f"no benchmark name contains {args.only!r}")
    with stdout_to_stderr(args.json):
        figures = run_benchmarks(registry, repeats=repeats, quick=args.quick, progress=not args.json,
                                 size=args.size)
    if args.json:
        print(json.dumps({"figures": figures, "repeats": repeats, "quick": bool(args.quick)}))
    else:
        width = max((len(k) for k in figures), default=10)
        print(f"{'figure':<{width}}  {'median':>12}  unit   ({repeats} repeats{', quick' if args.quick else ''})")
        for k, f in figures.items():
            print(f"{k:<{width}}  {f['value']:>12.4g}  {f['unit']}")
    return 0


# --------------------------------------------------------------------------------------------------
# simulate / run
# --------------------------------------------------------------------------------------------------

def _args_run_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config path or an example name (e.g. a6000-default)")
    p.add_argument("--policy", default=None, metavar="P",
                   help="bidirl, no-borrow, rot-only, tor-only, opportunistic (simulate also: verl-colocated, "
                        "verl-async, areal, roll); default: the config's scheduler.policy")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="training steps (default: workload.steps)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed (default: the config's seed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write the event log: Chrome/Perfetto trace for .json, else .parquet or .csv")
    p.add_argument("--html", metavar="FILE", default=None, help="write the Gantt timeline (plotly HTML)")


def _args_simulate(p: argparse.ArgumentParser) -> None:
    _args_run_common(p)


def _args_run(p: argparse.ArgumentParser) -> None:
    _args_run_common(p)
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="a Ray cluster address (default: start an embedded local Ray)")
    p.add_argument("--emulate", action="store_true",
                   help="model-timed workers instead of vLLM and torch (many virtual GPUs on one machine)")
    p.add_argument("--time-scale", type=float, default=20.0, metavar="X",
                   help="with --emulate: virtual seconds per wall second (default 20)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="engine runs: a local Hugging Face causal-LM folder (default: the built-in tiny model)")
    p.add_argument("--data-file", default=None, metavar="FILE",
                   help="engine runs: prompts from a .parquet (veRL's layout) or .jsonl (prompt, answer) file "
                        "(sets workload.data_file)")
    p.add_argument("--reward", default=None, metavar="SPEC",
                   help="engine runs: exact, last_number, boxed, module:function or path/to/file.py[:function] "
                        "(a veRL compute_score; sets rl.reward)")
    p.add_argument("--kv-cache-gib", type=float, default=None, metavar="GIB",
                   help="engine runs: the KV cache of each rollout GPU in GiB (sets cluster.rollout_kv_cache_gib; "
                        "default: the planner's memory model sizes it)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder: metrics.jsonl, tensorboard/, trace.json, events.parquet, summary.json "
                        "(default: results/run-<date>-<time>)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints at step boundaries into DIR (trainer weights and optimizer state, the "
                        "scheduler's state with every group in flight, the event log): DIR/step-NNNNNN")
    p.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                   help="with --checkpoint-dir: a checkpoint every N steps, and after the last (default 1)")
    p.add_argument("--keep", type=int, default=3, metavar="K",
                   help="with --checkpoint-dir: keep the last K checkpoints (default 3)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the newest good checkpoint in DIR (or from DIR if it is one step-* "
                        "checkpoint) with the same config, --policy and --seed; --steps may be raised to go on "
                        "further; checkpoints continue in DIR unless --checkpoint-dir names another folder")


def _write_outputs(result, args) -> None:
    try:
        if args.trace:
            result.log.save(args.trace)
        if args.html:
            from bidirl.viz.gantt import gantt_figure
            gantt_figure(result, title=f"{result.policy}").write_html(args.html, include_plotlyjs=True)
    except OSError as exc:
        raise CommandError(f"cannot write output: {exc.strerror or exc}") from None


def _print_result(result, args) -> int:
    _write_outputs(result, args)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary, default=float))
    else:
        from bidirl.results import metrics
        print(metrics.format_summary(summary))
        for what in ("trace", "html"):
            if getattr(args, what):
                print(f"{what} written to {getattr(args, what)}")
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    from bidirl.sim import simulate
    result = simulate(args.config, args.policy, steps=args.steps, seed=args.seed, progress=not args.json)
    return _print_result(result, args)


def _run_run(args: argparse.Namespace) -> int:
    from bidirl.cluster.run import run
    from bidirl.job import config as cfgmod
    from bidirl.results.tracking import default_out_dir
    overrides = {key: value for key, value in (("workload.data_file", args.data_file), ("rl.reward", args.reward),
                                               ("cluster.rollout_kv_cache_gib", args.kv_cache_gib))
                 if value is not None}
    cfg = cfgmod.load(args.config).with_overrides(overrides)
    if not args.emulate:
        cfgmod.check_engine_run(cfg)          # before the output folder is made (run() checks again)
    out = args.out or str(default_out_dir())
    for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--keep", args.keep)):
        if value < 1:
            raise CommandError(f"{flag} must be ≥ 1, got {value}")
    with stdout_to_stderr(args.json):
        result = run(cfg, args.policy, steps=args.steps, seed=args.seed, emulate=args.emulate,
                     address=args.address, time_scale=args.time_scale, model_dir=args.model_dir,
                     out_dir=out, progress=not args.json, checkpoint_dir=args.checkpoint_dir,
                     checkpoint_every=args.checkpoint_every, keep=args.keep, resume=args.resume)
    status = _print_result(result, args)
    if not args.json:
        summary = result.summary_dict
        if summary.get("resumed_from"):
            print(f"resumed after step {summary['resumed_from']['step']} from {summary['resumed_from']['checkpoint']}"
                  f": steps {summary['resumed_from']['step']}-{len(result.log.steps) - 1} ran in this process")
        for rec in summary.get("recoveries", ()):
            print(f"worker {rec['worker']} failed at t = {rec['t']:.1f} s and was restarted (restart "
                  f"{rec['restart']}): {rec['error']}")
        print(f"metrics, TensorBoard events, trace and summary written to {out}")
        if args.checkpoint_dir or args.resume:
            print(f"checkpoints in {args.checkpoint_dir or args.resume}")
    return status


# --------------------------------------------------------------------------------------------------
# reproduce
# --------------------------------------------------------------------------------------------------

def _args_reproduce(p: argparse.ArgumentParser) -> None:
    from bidirl.experiments import add_arguments
    add_arguments(p)


def _run_reproduce(args: argparse.Namespace) -> int:
    from bidirl.experiments import run_args
    return int(run_args(args) or 0)

# --------------------------------------------------------------------------------------------------
# profile / calibrate (appendix "Stage-Time Models": calibrate τ, α, r from profiling runs)
# --------------------------------------------------------------------------------------------------

def _args_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config path or an example name (e.g. tiny-cpu): model, hardware, group size")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write meta.json, rollout.csv, trainer.csv to")
    p.add_argument("--grid", choices=("small", "full"), default="small",
                   help="small: 12 points, CI-sized; full: 96 points, a few minutes on two cores (default small)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of prompts and point order (default 0)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="a local Hugging Face causal-LM folder of the config's model (default: the built-in tiny model)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads of both engines (default 1, as the Ray workers run on CPU)")


def _run_profile(args: argparse.Namespace) -> int:
    from bidirl.calibrate.profile import profile
    if args.seed < 0:
        raise CommandError("--seed must be ≥ 0")
    if args.threads < 1:
        raise CommandError("--threads must be ≥ 1")
    try:
        prof = profile(args.config, grid=args.grid, seed=args.seed, model_dir=args.model_dir, out=args.out,
                       threads=args.threads, progress=True)
    except BidirlError:
        raise
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    grid = prof.meta["grid"]
    print(f"profile written to {args.out}: {len(prof.rollout)} rollout and {len(prof.trainer)} trainer records "
          f"({prof.rollout['point'].nunique()} grid points × {grid['repeats']} repetitions, {grid['name']} grid) "
          f"of {prof.model} on {prof.hardware} in {prof.meta['seconds']:.0f} s")
    return 0


def _args_calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", metavar="RECORDS_DIR", nargs="?", default=None,
                   help="a folder written by `bidirl profile` (or give --log and --config)")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="instead of profiling records: a job's per-step metrics log with veRL's keys (.jsonl, .csv "
                        "or veRL console lines; e.g. a run's metrics.jsonl)")
    p.add_argument("--config", default=None, metavar="JOB",
                   help="with --log: the logged job as a bidirl config (model, hardware, GPUs, cluster.partition, "
                        "batch)")
    p.add_argument("--colocated", action="store_true",
                   help="with --log: rollout and trainer shared all GPUs (veRL's default trainer)")
    p.add_argument("--knobs", default=None, metavar="K1,K2",
                   help="with --log: the hardware knobs to fit (default: bidirl.calibrate.from_log.DEFAULT_KNOBS, the "
                        "trainer's and the decoder's efficiency)")
    p.add_argument("--skip", type=int, default=1, metavar="N",
                   help="with --log: warm-up steps left out of the fit (default 1)")
    p.add_argument("--what-if", action="store_true",
                   help="with --log: then plan and simulate the job with the fitted preset — BiDiRL's gain and split")
    p.add_argument("--out", required=True, metavar="PRESET.yaml",
                   help="the calibrated hardware preset to write (named after the file; put it in "
                        "data/presets/hardware/ to use it by name in a config)")
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help="the hardware preset to start from (default: the one the profile names)")
    p.add_argument("--holdout", type=float, default=0.25, metavar="F",
                   help="share of the grid points held out of the fit to measure errors on (default 0.25)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the fit / held-out split (default 0)")
    p.add_argument("--statistic", choices=("min", "median"), default="min",
                   help="a grid point's time from its repetitions: the fastest (default; slower ones measure "
                        "interference from other work) or the median")
    p.add_argument("--knobs-only", action="store_true",
                   help="fit the hardware knobs only; write no per-model stage_params (with RECORDS_DIR or --log)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _run_calibrate_log(args: argparse.Namespace) -> int:
    from bidirl.calibrate import from_log as job_log
    if args.config is None:
        raise CommandError("--log needs --config: the logged job as a bidirl config (model, hardware, GPUs, "
                           "cluster.partition, prompts per step, group size)")
    try:
        knobs = (list(job_log.DEFAULT_KNOBS) if args.knobs is None
                 else [k.strip() for k in args.knobs.split(",") if k])
        cal = job_log.calibrate_from_log(args.log, args.config, knobs=knobs,
                                         hardware=args.hardware, colocated=args.colocated, holdout=args.holdout,
                                         seed=args.seed, skip=args.skip, model_params=not args.knobs_only)
        job_log.write_preset(cal, args.out)
        outcome = job_log.what_if(args.config, args.out, colocated=args.colocated, log=args.log) \
            if args.what_if else None
    except BidirlError:                            # reported by main() with its fix
        raise
    except ValueError as exc:                      # bad arguments
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({**cal.summary(), "preset": str(args.out), "what_if": outcome}, default=float))
        return 0
    print(job_log.format_log_calibration(cal))
    print(f"\npreset written to {args.out}; use it with `hardware: {args.out}` in the job config")
    if outcome:
        print(f"\nwhat if (simulated with the fitted preset): the planner picks {outcome['planner_choice']}")
        for name, tp in outcome["throughput"].items():
            print(f"  {name:<40} {tp:10.1f} tokens/s   ×{outcome['gain'][name]:.2f}")
        if outcome["measured"]:
            print(f"  {'measured (the log, median step)':<40} {outcome['measured']:10.1f} tokens/s")
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    from bidirl.calibrate.from_records import calibrate_profile, format_calibration, write_preset
    if not Path(args.out).name.endswith(".yaml"):
        raise CommandError(f"--out {args.out!r} must be a .yaml file named after the preset (e.g. cpu-calibrated.yaml)")
    if (args.records is None) == (args.log is None):
        raise CommandError("give either RECORDS_DIR (a `bidirl profile` folder) or --log FILE --config JOB")
    if args.log is not None:
        return _run_calibrate_log(args)
    try:
        cal = calibrate_profile(args.records, hardware=args.hardware, holdout=args.holdout, seed=args.seed,
                                overrides=not args.knobs_only, statistic=args.statistic)
        write_preset(cal, args.out)
    except BidirlError:                            # reported by main() with its fix
        raise
    except ValueError as exc:                      # bad arguments
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({**cal.summary(), "preset": str(args.out)}, default=float))
    else:
        print(format_calibration(cal))
        print(f"\npreset written to {args.out}")
    return 0


def _args_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("import", "map"),
                   help="import FILE: read a foreign trace into bidirl's views; map suggest FILE: draft a map for "
                        "a Ray timeline of a framework bidirl has no map for")
    p.add_argument("file", metavar="FILE", help="a Ray timeline (JSON), a veRL step log, or a bidirl run / event log "
                                                "(after `map`: suggest)")
    p.add_argument("map_file", metavar="TIMELINE", nargs="?", default=None,
                   help="map suggest: the Ray timeline to draft a map from")
    p.add_argument("--format", default=None, choices=("ray-timeline", "verl-log", "bidirl"),
                   help="import: what FILE is")
    p.add_argument("--map", default=None, metavar="MAP.yaml",
                   help="ray-timeline: which method is which span, on which pool — a YAML file, a shipped map "
                        "(verl-colocated, verl-fully-async, openrlhf, bidirl), or auto (chosen from the span names, "
                        "and said why)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="import: folder for the event log, trace.json, idle.csv, bubbles.csv, unmapped.csv and the "
                        "figures; map suggest: the YAML file to write (default: print it)")
    p.add_argument("--config", default=None, metavar="JOB",
                   help="with --what-if: the job as a bidirl config (model, hardware, GPUs, split, batch)")
    p.add_argument("--what-if", action="store_true",
                   help="fit a preset to the imported run and simulate the job under no-borrow and BiDiRL")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="the scheduling policy the run was recorded under, where the file does not say")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _run_trace(args: argparse.Namespace) -> int:
    if args.action == "map":
        if args.file != "suggest" or args.map_file is None:
            raise CommandError("usage: bidirl trace map suggest TIMELINE [--out MAP.yaml]")
        from bidirl.ingest.suggest import suggest_map
        text = suggest_map(args.map_file)
        if args.out:
            try:
                Path(args.out).write_text(text)
            except OSError as exc:
                raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
            print(f"starter map written to {args.out}: check every rule against the framework's source, then "
                  f"`bidirl trace import {args.map_file} --format ray-timeline --map {args.out} --out DIR`")
        else:
            print(text, end="")
        return 0
    if args.format is None or args.out is None or args.map_file is not None:
        raise CommandError("usage: bidirl trace import FILE --format ray-timeline|verl-log|bidirl --out DIR")
    from bidirl.ingest import load_foreign
    from bidirl.ingest.bubbles import bubble_breakdown, parts, pool_idle
    from bidirl.results.metrics import IDLE_LABEL, OVERALL, POOL_UNION_LABEL
    from bidirl.viz.imported import write_import
    if args.what_if and args.config is None:
        raise CommandError("--what-if needs --config: the imported job as a bidirl config")
    run = load_foreign(args.file, args.format, args.map, progress=not args.json, policy=args.policy)
    try:
        paths = write_import(run, args.out)
    except OSError as exc:
        raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    outcome = None
    if args.what_if:
        from bidirl.ingest.whatif import imported_what_if
        outcome = imported_what_if(run, args.config)
        (Path(args.out) / "what_if.json").write_text(json.dumps(outcome, indent=1, default=float) + "\n")
    idle, bubbles = pool_idle(run), bubble_breakdown(run)
    if args.json:
        print(json.dumps({**run.summary(), "idle": idle.to_dict(orient="records"),
                          "bubbles": bubbles.to_dict(orient="records"), "what_if": outcome, "files": paths},
                         default=float))
        return 0
    print(f"{run.provenance_text} ({run.format}, map {run.map_name}; recorded under {run.policy}): "
          f"{len(run.log.spans)} spans on {len(run.workers)} lanes, {len(run.log.steps)} steps")
    for note in run.notes:
        print(f"note: {note}")
    if len(run.unmapped):
        print("unmapped (not drawn, not counted as busy):")
        for name, count in zip(run.unmapped["name"], run.unmapped["count"]):
            print(f"  {count:>7} × {name}")
    print(f"\n{IDLE_LABEL}, over the steps:")
    for r in idle.itertuples(index=False):
        union = ("" if r.pool == OVERALL else
                 f"; {POOL_UNION_LABEL}: {100 * r.pool_union_idle_fraction:.1f} %")
        print(f"  {r.pool:<13} {100 * r.idle_fraction:5.1f} %  ({r.idle_gpu_s:,.1f} of {r.gpus * r.window_s:,.1f} "
              f"GPU-s on {r.gpus:g} GPUs{union})")
    if len(bubbles):
        total = float(bubbles["step_s"].sum())
        print(f"\nwhere the {len(bubbles)} steps' {total:,.3f} s went:")
        shown = [p for p in parts(bubbles) if bubbles[p].sum() > 0]
        for part in shown:
            mark = "  (GPUs idle)" if part in run.gpu_idle_categories else ""
            print(f"  {part:<38} {bubbles[part].sum():12,.3f} s  {100 * bubbles[part].sum() / total:5.1f} %{mark}")
        absent = [p for p in parts(bubbles) if p not in shown]
        if absent:
            print(f"  0 s: {', '.join(absent)}")
    if outcome:
        w = outcome["what_if"]
        print(f"\nwhat if (simulated with a preset fitted to this run): the planner picks {w['planner_choice']}")
        for name, tp in w["throughput"].items():
            print(f"  {name:<44} {tp:10.1f} tokens/s   ×{w['gain'][name]:.2f}")
        print("  assuming, for the simulated trainer:")
        for a in outcome["assumptions"]:
            value = "" if a["key"] == "basis" else f" = {a['value']!r}"
            print(f"    {a['key']}{value}: {a['as_simulated']}")
    print(f"\nwritten to {args.out}")
    return 0


# --------------------------------------------------------------------------------------------------
# config from-verl
# --------------------------------------------------------------------------------------------------

def _args_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("from-verl",), help="from-verl: convert a veRL job's configuration")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="in order: a veRL trainer YAML (.yaml/.yml), a veRL shell script or file of overrides (its "
                        "`python3 -m verl.trainer.main_ppo key=value ...` command), or single Hydra overrides "
                        "(key=value, +key=value, ++key=value, ~key); later ones win")
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help="the hardware preset (or preset file) the job runs on; a veRL config does not say")
    p.add_argument("--model", default=None, metavar="PRESET",
                   help="the model preset, in place of the one matched from actor_rollout_ref.model.path")
    p.add_argument("--dataset", default=None, metavar="PRESET",
                   help="the workload preset, in place of the one matched from data.train_files")
    p.add_argument("--out", default=None, metavar="JOB.yaml", help="write the bidirl config to this file")
    p.add_argument("--lenient", action="store_true",
                   help="name keys that veRL's config (at the release bidirl follows) does not have as not used, "
                        "with a warning, instead of refusing them as Hydra would (scripts of other veRL releases)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the config and tables")


def format_conversion(conv, summary: dict) -> str:
    """The human-readable account of ``bidirl config from-verl``: the config, then every key's fate."""
    lines = [conv.to_yaml().rstrip(), "", f"mapped ({summary['counts']['mapped']} keys of the input, "
             f"{summary['counts']['defaults_used']} veRL defaults):"]
    for row in conv.mapped:
        origin = "" if row["origin"] == "input" else f" [{row['origin']}]"
        target = ", ".join(row["bidirl"]) or "checked"
        lines.append(f"  {row['key']} = {row['value']!r}{origin} → {target}: {row['how']}")
    lines.append(f"not used ({len(conv.not_used)}):")
    for row in conv.not_used:
        flag = " [step time depends on it; not modelled]" if row["timing"] else ""
        lines.append(f"  {row['key']} = {row['value']!r}{flag}: {row['reason']}")
    if conv.derived:
        lines.append("set without a veRL key:")
        lines += [f"  {d['bidirl']} = {d['value']!r}: {d['from']}" for d in conv.derived]
    for w in conv.warnings:
        lines.append(f"warning: {w}")
    for m in conv.missing:
        lines.append(f"missing: {m['key']}: {m['problem']} — {m['fix']}")
    lines.append("the config loads and validates" if summary["loads"]
                 else f"the config does not load yet: {summary['load_error']}")
    return "\n".join(lines)


def _run_config(args: argparse.Namespace) -> int:
    from bidirl.job.from_verl import convert
    conv = convert(args.inputs, hardware=args.hardware, model=args.model, dataset=args.dataset,
                   lenient=args.lenient)
    summary = conv.summary()
    if args.out:
        try:
            Path(args.out).write_text(conv.to_yaml())
        except OSError as exc:
            raise CommandError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({**summary, "out": args.out}, default=str))
        return 0
    print(format_conversion(conv, summary))
    if args.out:
        print(f"\nconfig written to {args.out}")
    return 0


# --------------------------------------------------------------------------------------------------

COMMANDS: dict = {
    "plan": Command("static partition planner (paper §4, Algorithm 1)", _args_plan, _run_plan),
    "simulate": Command("simulate a job under a policy (discrete-event, paper §5)", _args_simulate, _run_simulate),
    "run": Command("run a job on Ray: engine workers, or --emulate for model-timed workers", _args_run, _run_run),
    "reproduce": Command("reproduce the paper's evaluation and check each claim", _args_reproduce, _run_reproduce),
    "bench": Command("run the registered benchmarks and report medians", _args_bench, _run_bench),
    "profile": Command("measure the real engines' stage times on a grid of batch, prompt and response sizes",
                       _args_profile, _run_profile),
    "calibrate": Command("fit a hardware preset to profiled stage times and report held-out errors",
                         _args_calibrate, _run_calibrate),
    "trace": Command("import a Ray timeline, veRL step log or bidirl trace into bidirl's views", _args_trace,
                     _run_trace),
    "config": Command("convert a veRL job's configuration into a bidirl job config", _args_config, _run_config),
}


def build_parser(commands: Optional[dict] = None) -> argparse.ArgumentParser:
    commands = COMMANDS if commands is None else commands
    parser = argparse.ArgumentParser(prog="bidirl", description="BiDiRL: bidirectional resource scheduling "
                                     "for disaggregated, asynchronous RL post-training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Optional[list] = None) -> int:
    """Entry point of the ``bidirl`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BidirlError as exc:                     # every user-facing error (bidirl/errors.py)
        message = str(exc)
        if exc.fix and exc.fix not in message:
            message += f" — {exc.fix}"
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
