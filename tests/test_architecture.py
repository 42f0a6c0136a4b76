"""The layout's promises (docs/architecture.md): a pure core, drivers that speak only the protocol, one
execution layer, names defined once, and a simulator whose event logs the refactors leave unchanged."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.core import protocol as P
from bidirl.job import config as cfgmod

ROOT = Path(__file__).resolve().parents[1]
#: coordinator attributes anyone outside the core may use: the protocol entry point and the read-only view
PUBLIC = {"handle", "view"}


def test_the_core_imports_the_standard_library_and_numpy_only():
    code = ("import sys, bidirl.core, bidirl.core.gates, bidirl.core.lease; "
            "print(' '.join(m for m in ('pandas', 'yaml', 'torch', 'ray', 'vllm', 'scipy', 'bidirl.job.config', "
            "'bidirl.results.trace', 'bidirl.sim', 'bidirl.perf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import bidirl.core loads {out.stdout.strip()}"


def test_the_emulated_workers_processes_import_no_driver_side():
    """Every emulated worker's process imports its actor's module: the driver's side (the pool driver, the event
    log and its pandas, the job's configuration) stays out of it: ≈ 0.5 s of CPU per worker started."""
    code = ("import sys, bidirl.cluster.emulated_workers; "
            "print(' '.join(m for m in ('pandas', 'yaml', 'torch', 'vllm', 'scipy', 'bidirl.cluster.pool', "
            "'bidirl.results.trace', 'bidirl.job.config', 'bidirl.sim') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import bidirl.cluster.emulated_workers loads {out.stdout.strip()}"


def _sources():
    """(name, python source) of every module of the drivers, widgets and notebooks' code cells."""
    for folder in ("bidirl/sim", "bidirl/cluster", "widgets"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        # IPython magics and shell escapes are not Python
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        yield str(path.relative_to(ROOT)), code


def test_drivers_widgets_and_notebooks_use_only_the_protocol_and_the_view():
    bad = []
    for name, source in _sources():
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "coordinator":
                use = parents.get(node)
                if not (isinstance(use, ast.Attribute) and use.attr in PUBLIC):
                    bad.append(f"{name}:{node.lineno}: {ast.unparse(use if use is not None else node)}")
    assert not bad, "coordinator state read outside the protocol:\n" + "\n".join(bad)


def test_the_cluster_never_imports_the_simulator():
    bad = []
    for path in sorted((ROOT / "bidirl/cluster").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.startswith("bidirl.sim")]
    assert not bad, bad


def test_shared_names_are_spelled_out_only_in_the_protocol():
    """Direction and worker names appear as string literals in the protocol only (the library uses its
    constants), so a rename is one edit."""
    literals = {P.ROLLOUT_ON_TRAINER_POOL, P.TRAINER_ON_ROLLOUT_POOL, P.PRIMARY_TRAINER, P.AUX_TRAINER}
    bad = []
    for path in sorted((ROOT / "bidirl").rglob("*.py")):
        if path.name == "protocol.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in literals and id(node) not in docstrings:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not bad, bad


def test_every_driver_handles_every_command():
    from bidirl.cluster.emulated import EmulatedDriver
    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.sim.driver import SimDriver
    for cls in (SimDriver, EmulatedDriver, EngineDriver):
        # RefreshWeights is sent only to a driver that refreshes auxiliary gangs (Driver.refreshes_aux_weights)
        sent = [c for c in P.COMMANDS if c is not P.RefreshWeights or cls.refreshes_aux_weights]
        missing = [c.__name__ for c in sent if not callable(getattr(cls, "do_" + c.__name__, None))]
        assert not missing, (cls.__name__, missing)
    # every driver that runs a job refreshes: the simulator, emulated workers and engine runs follow one rule
    assert SimDriver.refreshes_aux_weights and EmulatedDriver.refreshes_aux_weights and EngineDriver.refreshes_aux_weights


def test_a_driver_without_a_handler_fails_when_it_is_built():
    from bidirl.sim.driver import SimDriver

    class Incomplete(SimDriver):
        do_SyncWeights = None

    with pytest.raises(TypeError, match="Incomplete has no handler for SyncWeights"):
        Incomplete(cfgmod.load("tiny-cpu"), "bidirl", steps=1, seed=0)

    class NoRefresh(SimDriver):                # says it refreshes auxiliary gangs, cannot
        do_RefreshWeights = None

    with pytest.raises(TypeError, match="NoRefresh has no handler for RefreshWeights"):
        NoRefresh(cfgmod.load("tiny-cpu"), "bidirl", steps=1, seed=0)


CASES = json.loads((ROOT / "tests/data/sim_fingerprints.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['config']}-{c['policy']}-{i}" for i, c in enumerate(CASES)])
def test_simulator_event_logs_match_the_recorded_fingerprints(case):
    from bidirl.sim import simulate
    cfg = cfgmod.load(case["config"])
    if case["overrides"]:
        cfg = cfg.with_overrides(case["overrides"])
    res = simulate(cfg, case["policy"], steps=case["steps"], seed=case["seed"])
    assert res.log.fingerprint() == case["fingerprint"]


# ------------------------------------------------------------------------------------------------
# the package's layers (docs/architecture.md, "Layers"): no import points up, no import circle
# ------------------------------------------------------------------------------------------------

def _layer_order() -> list:
    """The layer names, lowest first, from the ``Layers:`` line of docs/architecture.md."""
    for line in (ROOT / "docs/architecture.md").read_text().splitlines():
        if line.startswith("Layers, lowest first:"):
            return [name.strip(" `.") for name in line.split(":", 1)[1].split("<")]
    raise AssertionError("docs/architecture.md has no 'Layers, lowest first:' line")


def _modules() -> dict:
    """dotted module name -> path of every module under bidirl/."""
    out = {}
    for path in sorted((ROOT / "bidirl").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(modules: dict) -> dict:
    """module -> the bidirl modules it imports anywhere in its source (function-level imports included: a
    circle hidden inside a function is still a circle). ``from pkg import name`` counts ``pkg.name`` when that
    is a module, else ``pkg``; the bare root package (``__version__``, lazy names only) is not counted."""
    graph = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod and t != "bidirl":
                    found.add(t)
        graph[mod] = found
    return graph


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return "front door" if len(parts) == 2 and parts[1] in ("cli", "__main__") else parts[1]


def test_every_module_belongs_to_a_layer_and_the_root_holds_only_the_front_door():
    order = _layer_order()
    strays = sorted(m for m in _modules() if m != "bidirl" and _layer(m) not in order)
    assert not strays, f"modules outside the layers of docs/architecture.md: {strays}"


def test_no_import_points_from_a_lower_layer_to_a_higher_one():
    order = _layer_order()
    rank = {name: i for i, name in enumerate(order)}
    up = [f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, targets in _imports(_modules()).items()
          for t in sorted(targets) if m != "bidirl" and rank[_layer(t)] > rank[_layer(m)]]
    assert not up, "imports against the layer order:\n" + "\n".join(up)


def test_there_is_no_import_circle():
    graph = _imports(_modules())
    state, circles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


# ------------------------------------------------------------------------------------------------
# the engines: the workers' side apart from the driver's side, and small classes (docs/architecture.md, "Engines")
# ------------------------------------------------------------------------------------------------

ENGINES = "bidirl.cluster.engines"
WORKERS = ENGINES + ".workers"
#: the driver's side of the package besides cluster/engines/: what a worker's process must never load
DRIVER_SIDE = ("bidirl.cluster.pool", "bidirl.cluster.slots", "bidirl.cluster.resume", "bidirl.cluster.kept_workers",
               "bidirl.cluster.emulated", "bidirl.job", "bidirl.results", "bidirl.sim", "bidirl.runtime")


def test_the_engines_workers_side_imports_nothing_of_the_drivers_side():
    """Every module under cluster/engines/workers/ runs inside a Ray worker's process: it imports (anywhere in its
    source, function-level imports included) neither the driver's side of cluster/engines/ nor the pool driver,
    the job or the results."""
    graph = _imports(_modules())
    bad = []
    for mod, targets in sorted(graph.items()):
        if not (mod == WORKERS or mod.startswith(WORKERS + ".")):
            continue
        for t in sorted(targets):
            driver_engine = t.startswith(ENGINES + ".") and not (t == WORKERS or t.startswith(WORKERS + "."))
            if driver_engine or t == ENGINES or any(t == d or t.startswith(d + ".") for d in DRIVER_SIDE):
                bad.append(f"{mod} imports {t}")
    assert not bad, "the workers' side imports the driver's side:\n" + "\n".join(bad)


def test_the_workers_side_check_sees_a_driver_import():
    """The check above fails on a worker module that imports the engine driver (it reads real import edges)."""
    modules = _modules()
    graph = _imports(modules)
    assert f"{WORKERS}.actors" in graph and graph[f"{WORKERS}.actors"], "the actors' imports were not read"
    assert any(t.startswith(WORKERS) for t in graph[f"{ENGINES}.placement"]), "the driver's imports were not read"


def _class_lengths(folder: Path) -> list:
    """(where, class name, lines) of every class under ``folder``."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((str(path.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1))
    return out


def test_no_class_in_the_engines_runs_over_400_lines():
    """A class in cluster/engines/ holds one concern; past 400 lines it holds several (issue 38). No class is exempt."""
    lengths = _class_lengths(ROOT / "bidirl/cluster/engines")
    assert {"TrainerEngine", "EngineDriver", "EngineBackend"} <= {name for _, name, _ in lengths}
    big = [f"{where}: {name} {n} lines" for where, name, n in lengths if n > 400]
    assert not big, "classes over 400 lines:\n" + "\n".join(big)


def _overridden(cls, base) -> list:
    """The methods ``cls`` defines that ``base`` (or a class above it) already has, dunders aside (a dataclass
    generates its own ``__init__``; ``__post_init__`` only takes the subclass's settings)."""
    return sorted(n for n, v in vars(cls).items() if callable(v) and not n.startswith("__") and hasattr(base, n))


def test_the_ray_drivers_plug_one_backend_into_the_pool_driver_and_override_none_of_its_methods():
    """The emulated and engine drivers add their settings and plug a WorkerBackend in (composition, issue 38): the
    pool driver owns the shared logic and calls the backend, no method of it is overridden."""
    from bidirl.cluster.backend import WorkerBackend
    from bidirl.cluster.emulated import EmulatedBackend, EmulatedDriver
    from bidirl.cluster.engines.backend import EngineBackend
    from bidirl.cluster.engines.driver import EngineDriver
    from bidirl.cluster.pool import PoolDriver
    for cls in (EmulatedDriver, EngineDriver):
        assert _overridden(cls, PoolDriver) == [], cls.__name__
    assert issubclass(EmulatedBackend, WorkerBackend) and issubclass(EngineBackend, WorkerBackend)
    assert not EngineBackend.__abstractmethods__ and not EmulatedBackend.__abstractmethods__

    class Overriding(EmulatedDriver):          # the check sees an override
        def worker_shape(self):
            return {}
    assert _overridden(Overriding, PoolDriver) == ["worker_shape"]
