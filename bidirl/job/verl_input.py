"""Reading a veRL trainer configuration the way Hydra composes it (input of ``bidirl config from-verl``).

veRL (volcengine/verl) configures a run with Hydra: a trainer YAML (``verl/trainer/config/ppo_trainer.yaml`` and
the recipes' files that extend it) plus command-line overrides, as its example scripts write them::

    python3 -m verl.trainer.main_ppo data.train_batch_size=1024 actor_rollout_ref.rollout.n=5 ...

This module turns such input — a YAML file, a file holding a shell script or override lines, or single
``key=value`` arguments — into an ordered list of :class:`Override` records, and composes them into one flat
``{dotted key: value}`` mapping with Hydra's rules for the override prefixes
(hydra.cc, "Override grammar / basic"):

- ``key=value`` changes a key the config has; a key it does not have is refused ("use +key=value to add it");
- ``+key=value`` adds a key the config does not have; one it has is refused;
- ``++key=value`` sets a key whether or not it exists;
- ``~key`` / ``~key=value`` deletes a key (with a value, only if the key holds that value);
- overrides apply in order, and a later one of the same key wins (hydra issue #3283: "Command-line overrides are
  ordered").

Which keys "the config has" is the caller's knowledge (``bidirl.job.from_verl`` holds veRL's key table); this
module only parses and composes. Nothing here reads the environment: a shell variable left in a value
(``$HOME``, ``${MODEL_PATH}``) stays text, and the mapping refuses it where it needs the value.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

import yaml

from bidirl.errors import ConfigError

Op = Literal["set", "add", "force", "delete", "file"]

#: a Hydra key: dot-separated identifiers (veRL's keys use nothing else)
KEY_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*\Z")
_INT = re.compile(r"[+-]?\d+\Z")
_FLOAT = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?\Z|[+-]?(?:inf|nan)\Z", re.IGNORECASE)
#: shell words that end a command's arguments
_COMMAND_END = {"$@", "\"$@\"", "|", "||", "&&", ";", "&", ">", ">>", "2>&1", "1>&2"}

#: veRL entry modules and the trainer each runs (volcengine/verl @ b178a3cd, verl-project/verl-recipe @ 48ea0a79)
ENTRY_POINTS: dict = {
    "verl.trainer.main_ppo": "colocated",
    "recipe.dapo.main_dapo": "colocated",
    "verl.experimental.fully_async_policy.fully_async_main": "fully-async",
    "recipe.fully_async_policy.fully_async_main": "fully-async",
}


@dataclass(frozen=True)
class Override:
    """One ``key=value`` as written (``op``: set, add ``+``, force ``++``, delete ``~``, or a YAML file's key)."""
    op: Op
    key: str
    value: Any = None
    has_value: bool = True
    where: str = "argument"

    @property
    def text(self) -> str:
        prefix = {"set": "", "add": "+", "force": "++", "delete": "~", "file": ""}[self.op]
        return f"{prefix}{self.key}" + (f"={self.value!r}" if self.has_value else "")


@dataclass(frozen=True)
class VerlInput:
    """What was read: the entry module named by a script (``None`` if none) and the overrides in order."""
    overrides: tuple
    entry: Optional[str] = None
    sources: tuple = ()


@dataclass
class Composed:
    """The composed configuration: explicit values, where each came from, and the keys deleted with ``~``."""
    values: dict = field(default_factory=dict)
    where: dict = field(default_factory=dict)
    deleted: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------------

def parse_value(text: str, where: str = "") -> Any:
    """A Hydra override value: ``null``, booleans (any case), integers, floats (``1e-6`` too), quoted strings,
    ``[...]`` lists and ``{...}`` dicts; anything else is a plain string."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    low = s.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    if s[:1] in "[{":
        try:
            return yaml.safe_load(s)
        except yaml.YAMLError:
            raise ConfigError(where, f"value {s!r} is not a valid list or dict",
                              "write a list as [a,b] and a dict as {k: v}, quoting strings that hold commas") from None
    return s


def check_key(key: str, where: str) -> str:
    if not KEY_PATTERN.match(key):
        raise ConfigError(where, f"key {key!r} is not a dotted path of names",
                          "write keys as section.name (letters, digits, _ and single dots), e.g. "
                          "actor_rollout_ref.rollout.n")
    return key


def parse_override(text: str, where: str = "argument") -> Override:
    """One Hydra override (``key=value``, ``+key=value``, ``++key=value``, ``~key``, ``~key=value``)."""
    raw = text.strip()
    if raw.startswith("++"):
        op, body = "force", raw[2:]
    elif raw.startswith("+"):
        op, body = "add", raw[1:]
    elif raw.startswith("~"):
        op, body = "delete", raw[1:]
    else:
        op, body = "set", raw
    key, eq, value = body.partition("=")
    if not eq and op != "delete":
        raise ConfigError(where, f"{raw!r} is not an override",
                          "write key=value (or +key=value to add a key, ~key to delete one)")
    check_key(key.strip(), f"{where}: {raw!r}")
    if op == "delete" and not eq:
        return Override("delete", key.strip(), None, False, where)
    return Override(op, key.strip(), parse_value(value, f"{where}: {key.strip()}"), True, where)


def flatten(data: Any, prefix: str = "", where: str = "") -> dict:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; an empty mapping and a list are leaves."""
    out: dict = {}
    if isinstance(data, dict) and data:
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            check_key(key, where or key)
            out.update(flatten(v, key, where))
    else:
        out[prefix] = data
    return out


# --------------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------------

def _logical_lines(text: str) -> list:
    """Shell logical lines: backslash-newline continuations joined, each line split into words (comments
    dropped), with the line number it starts on."""
    lines, start, buf = [], 1, []
    for number, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = number
        if line.rstrip().endswith("\\"):
            buf.append(line.rstrip()[:-1])
            continue
        buf.append(line)
        joined = " ".join(buf)
        buf = []
        try:
            words = shlex.split(joined, comments=True)
        except ValueError as exc:
            raise ConfigError(f"line {start}", f"cannot split it into shell words ({exc})",
                              "close the quote that is left open") from None
        if words:
            lines.append((start, words))
    if buf:
        lines.append((start, shlex.split(" ".join(buf), comments=True)))
    return lines


def read_script(text: str, name: str) -> VerlInput:
    """Overrides from a veRL shell script's ``python -m MODULE key=value ...`` command (a ``ray job submit ... --
    python3 -m ...`` line too), or, in a file without such a command, from every line (``key=value`` words)."""
    lines = _logical_lines(text)
    for start, words in lines:
        if "-m" in words[:-1] and any(Path(w).name.startswith("python") for w in words):
            i = words.index("-m")
            entry, args = words[i + 1], []
            for w in words[i + 2:]:
                if w in _COMMAND_END:
                    break
                args.append(w)
            return VerlInput(tuple(parse_override(a, f"{name}:{start}") for a in args), entry, (name,))
    overrides = [parse_override(w, f"{name}:{start}") for start, words in lines for w in words]
    return VerlInput(tuple(overrides), None, (name,))


def read_yaml(text: str, name: str) -> VerlInput:
    """A veRL trainer YAML (nested sections) as one override per leaf key."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, f"is not valid YAML ({exc})", "fix the syntax at the line shown") from None
    if not isinstance(data, dict):
        raise ConfigError(name, f"must hold a mapping of sections, not {type(data).__name__}",
                          "start the file with veRL's sections, e.g. 'data:' and 'actor_rollout_ref:'")
    flat = flatten(data, "", name)
    return VerlInput(tuple(Override("file", k, v, True, name) for k, v in flat.items()), None, (name,))


def read_inputs(items: Sequence[str]) -> VerlInput:
    """Every input in order: a ``.yaml``/``.yml`` file (a veRL trainer YAML), any other existing file (a shell
    script or override lines), or one override (``key=value``, ``+key=value``, ``~key`` ...)."""
    if not items:
        raise ConfigError("", "no veRL configuration given",
                          "pass a veRL trainer YAML, a veRL shell script, or key=value overrides")
    overrides: list = []
    entry, sources = None, []
    for item in items:
        path = Path(item)
        looks_like_override = "=" in item or item.startswith(("+", "~"))
        if not looks_like_override and not path.is_file():
            raise ConfigError("", f"{item!r} is neither a file nor a key=value override",
                              "give an existing veRL YAML or script path, or an override such as "
                              "actor_rollout_ref.rollout.n=8")
        if looks_like_override and not path.is_file():
            overrides.append(parse_override(item))
            sources.append("argument")
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("", f"cannot read {item}: {exc}", "give a readable text file") from None
        got = read_yaml(text, item) if path.suffix in (".yaml", ".yml") else read_script(text, item)
        if got.entry is not None:
            if entry is not None and got.entry != entry:
                raise ConfigError(item, f"runs {got.entry}, but an earlier input runs {entry}",
                                  "convert one veRL command at a time")
            entry = got.entry
        overrides.extend(got.overrides)
        sources.extend(got.sources)
    return VerlInput(tuple(overrides), entry, tuple(sources))


# --------------------------------------------------------------------------------------------------
# composition (Hydra's rules for the prefixes)
# --------------------------------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b))
        except (TypeError, ValueError):
            return False
    return a == b


def compose(overrides: Sequence[Override], *, exists: Callable[[str], bool], declared: Callable[[str], bool],
            open_child: Callable[[str], bool], default: Callable[[str], Any],
            suggest: Callable[[str], str], lenient: bool = False, version: str = "") -> Composed:
    """Apply ``overrides`` in order. ``exists(key)``: the key is one of veRL's config or lies in a section that
    takes any child; ``declared(key)``: the key is one of veRL's own (so ``+`` cannot add it); ``open_child(key)``:
    it lies in a section veRL leaves empty for the user (``override_config``: a plain ``key=value`` cannot reach
    it, ``+`` adds it, a YAML file may hold it); ``default(key)``: its value in veRL's config; ``suggest(key)``: a
    "did you mean" sentence for an unknown key. ``lenient``: a key unknown to this veRL ``version``, or added with
    ``+`` where this version already declares it, is taken with a warning instead of refused (scripts written for
    another veRL release)."""
    out = Composed()
    for o in overrides:
        present = o.key in out.values or (declared(o.key) and o.key not in out.deleted)
        if o.op in ("set", "file"):
            known = exists(o.key) and (o.op == "file" or not open_child(o.key))
            if not (known or o.key in out.values):
                if lenient:
                    out.warnings.append(f"{o.key} ({o.where}) is not a key of veRL's trainer config at {version}: "
                                        f"{suggest(o.key)}taken as written")
                else:
                    add = "+" if o.op == "set" else ""
                    raise ConfigError(o.key, f"is not a key of veRL's trainer config at {version} ({o.where})",
                                      f"{suggest(o.key)}Hydra refuses to set a key the config does not have: check "
                                      f"the spelling{', or add a new key with ' + add + o.key + '=...' if add else ''}"
                                      "; for a script of another veRL release, convert with --lenient")
        elif o.op == "add":
            if present and lenient:
                out.warnings.append(f"+{o.key} ({o.where}): veRL at {version} already declares it (Hydra of this "
                                    "release would refuse to add it); taken as a change of its value")
            elif present:
                raise ConfigError(o.key, f"is already in veRL's config at {version}; Hydra refuses to add it again "
                                  f"({o.where})", f"write {o.key}=... to change it (or ++{o.key}=... to set it "
                                  "either way); for a script of another veRL release, convert with --lenient")
        elif o.op == "delete":
            if not (present or exists(o.key)):
                raise ConfigError(o.key, f"does not exist, so Hydra cannot delete it ({o.where})",
                                  f"{suggest(o.key)}drop the ~{o.key} override")
            if o.has_value:
                current = out.values[o.key] if o.key in out.values else default(o.key)
                if not _same(current, o.value):
                    raise ConfigError(o.key, f"holds {current!r}, not {o.value!r}: Hydra deletes a key with "
                                      f"~key=value only when the value matches ({o.where})",
                                      f"write ~{o.key} to delete it whatever it holds")
            out.values.pop(o.key, None)
            out.where.pop(o.key, None)
            out.deleted[o.key] = o.where
            continue
        values = flatten(o.value, o.key, o.where) if isinstance(o.value, dict) and o.value else {o.key: o.value}
        for k, v in values.items():
            out.values[k] = v
            out.where[k] = o.where
            out.deleted.pop(k, None)
    return out
