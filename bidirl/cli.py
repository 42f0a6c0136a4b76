"""The ``bidirl`` command line: one small function per subcommand, registered in :data:`COMMANDS`.

``bidirl plan CONFIG [--json] [--html FILE]``  Algorithm 1's static planner (paper §4)
``bidirl bench [--json] [--quick]``            the benchmarks registered under ``benchmarks/``

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
import importlib
import json
import pkgutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from bidirl.config import ConfigError


class CommandError(Exception):
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
    cfg, env = plan.config, plan.envelope
    w = cfg.workload
    lines = [f"bidirl plan: {cfg.model} on {cfg.cluster.gpus} × {cfg.hardware} "
             f"({cfg.cluster.gpus_per_node} per node, placement {cfg.cluster.placement}); "
             f"{w.dataset}, {w.prompts_per_step} prompts × {w.group_size}, max response {w.max_response_len}",
             f"envelope {env.label} ({'fixed by cluster.partition' if plan.fixed else 'planner choice'})",
             f"  rollout pool  {env.rollout_gpus:>5} GPUs = {env.rollout_replicas} replicas × {env.rollout_layout} GPU"
             f"   M_r = {_fmt(env.rollout_time)} s   λ_r = {_fmt(env.rollout_rate)} groups/s",
             f"  trainer pool  {env.trainer_gpus:>5} GPUs = {env.trainer_replicas} replicas × {env.trainer_layout} GPU"
             f"   M_t = {_fmt(env.trainer_time)} s   λ_t = {_fmt(env.trainer_rate)} groups/s",
             f"  pipeline rate λ_pipe = {_fmt(env.pipeline_rate)} prompt groups/s", ""]
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
                 "rates in prompt groups/s):")
    lines.append(table.to_string(index=False, float_format=lambda v: _fmt(v)))
    if len(shown) < len(sweep):
        lines.append(f"… {len(sweep) - len(shown)} more candidates not shown (use --json for all)")
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    from bidirl.planner import plan as make_plan
    result = make_plan(args.config)
    if args.html:
        from bidirl.viz_plan import sweep_figure
        try:
            sweep_figure(result).write_html(args.html, include_plotlyjs=True)
        except OSError as exc:
            raise CommandError(f"cannot write {args.html}: {exc.strerror or exc}") from None
    if args.json:
        print(result.to_json())
    else:
        print(format_plan(result, rows=max(1, args.rows)))
        if args.html:
            print(f"sweep figure written to {args.html}")
    return 0


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


def run_benchmarks(registry: dict, *, repeats: int, quick: bool, progress: bool = False) -> dict:
    """``{"<bench>.<figure>": {"value": median, "unit", "values": [...]}}`` over ``repeats`` calls each."""
    from tqdm.auto import tqdm
    samples: dict = {}
    units: dict = {}
    jobs = [(name, fn) for name, fn in registry.items() for _ in range(repeats)]
    for name, fn in tqdm(jobs, desc="bench", disable=not progress, file=sys.stderr):
        out = fn(quick)
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
    figures = run_benchmarks(registry, repeats=repeats, quick=args.quick, progress=not args.json)
    if args.json:
        print(json.dumps({"figures": figures, "repeats": repeats, "quick": bool(args.quick)}))
    else:
        width = max((len(k) for k in figures), default=10)
        print(f"{'figure':<{width}}  {'median':>12}  unit   ({repeats} repeats{', quick' if args.quick else ''})")
        for k, f in figures.items():
            print(f"{k:<{width}}  {f['value']:>12.4g}  {f['unit']}")
    return 0


# --------------------------------------------------------------------------------------------------

COMMANDS: dict = {
    "plan": Command("static partition planner (paper §4, Algorithm 1)", _args_plan, _run_plan),
    "bench": Command("run the registered benchmarks and report medians", _args_bench, _run_bench),
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
    except (ConfigError, CommandError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
