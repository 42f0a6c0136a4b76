"""Rule rewards and user reward functions, called the way veRL calls them.

GRPO (paper §2.1) needs every response scored by a program. A reward is named by one string, the config key
``rl.reward``:

* ``exact`` — 1 when the response equals the ground truth after stripping surrounding whitespace, else 0
  (the built-in arithmetic task's reward);
* ``last_number`` — 1 when the last number in the response equals the ground truth as a number, else 0
  (GSM8K's "flexible" rule: ``1,234``, ``-3`` and ``2.50`` are numbers; ``2.5`` equals ``2.50``);
* ``boxed`` — 1 when the content of the last ``\\boxed{...}`` in the response equals the ground truth after a
  light normalisation (:func:`normalize_math_answer`), else 0;
* ``module:function`` or ``path/to/file.py[:function]`` — a user function, ``compute_score`` by default,
  called as veRL calls it: ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)``. It may
  return a number or a dict with a ``"score"`` number (veRL's two forms), so an existing veRL reward file works
  unchanged.

Rewards run in the rollout actors (:mod:`bidirl.cluster.engines.workers.rollout`), which receive a :class:`Reward` —
the parsed spec, a file path made absolute where the run starts — and import the function there on first
use. A file therefore has to exist at the same absolute path on every node, as with veRL's
``custom_reward_function.path``; a module has to be importable on every node.

:func:`score_response` is the one place a reward is called: any exception, a return value that is not a
finite number, or a dict without ``"score"`` becomes a :class:`RewardError` naming the function, the group,
the response index and a snippet of the response — a batch is never scored 0 behind the user's back.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Optional

from bidirl.errors import BidirlError

#: the name veRL gives a reward file's function; a spec without ``:function`` uses it
DEFAULT_FUNCTION: str = "compute_score"
#: characters of a response quoted in a reward error
SNIPPET_CHARS: int = 80


class RewardError(BidirlError, RuntimeError):
    """A reward function failed on one response (raised, or returned something that is not a number).

    The message names the function, the group id, the response index and a snippet of the response. It is
    raised in the rollout actor; the engine driver reports it as a ``ClusterError`` and the run stops.
    """


@dataclass(frozen=True)
class RewardInput:
    """What a reward function knows about a prompt besides the response: veRL's ``data_source``,
    ``ground_truth`` (``reward_model.ground_truth``) and ``extra_info``."""
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# built-in rule rewards (veRL's compute_score signature)
# --------------------------------------------------------------------------------------------------

#: a number as written in text: optional minus, digits with optional thousands commas, optional decimals
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)|-?\.\d+")


def parse_number(text: Any) -> Optional[Decimal]:
    """``text`` as a number if the whole (stripped) string is one (:data:`NUMBER`, ``$`` and commas allowed),
    else ``None``. ``parse_number("1,234") == Decimal(1234)``."""
    s = str(text).strip().lstrip("$").strip()
    if not NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def last_number_in(text: str) -> Optional[Decimal]:
    """The last number written in ``text`` (:data:`NUMBER`), or ``None`` when it has none."""
    found = NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; ``\\boxed x``
    (no braces) gives the token after the space. ``None`` when there is none or its braces never close."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    if not starts:
        return None
    i = starts[-1].end()
    if text.startswith(" ", i) and not text[i:].lstrip().startswith("{"):
        m = re.match(r"\s+([^\s$]+)", text[i:])
        return m.group(1) if m else None
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


_LATEX_NOISE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\displaystyle", "^\\circ", "^{\\circ}")


def normalize_math_answer(answer: Any) -> str:
    """A light normalisation for comparing math answers: surrounding ``$`` removed, a ``\\boxed{}`` unwrapped,
    ``\\text{...}`` unwrapped, spacing and sizing commands and degree signs dropped, ``\\dfrac``/``\\tfrac`` →
    ``\\frac``, whitespace and a trailing period removed; a number is written canonically (``2.50`` → ``2.5``,
    ``1,000`` → ``1000``). For full equivalence (units, ``0.5`` vs ``\\frac12``) use veRL's math reward file
    as a ``file.py:function`` reward."""
    s = str(answer).strip()
    inner = extract_boxed(s)
    if inner is not None:
        s = inner
    s = s.strip().strip("$")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    number = parse_number(s)
    if number is not None:
        return _canonical_number(number)
    return s


def _canonical_number(x: Decimal) -> str:
    if x == x.to_integral_value():
        return str(int(x))
    return format(x.normalize(), "f")


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """1.0 iff the response equals the ground truth after stripping surrounding whitespace."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def last_number(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """1.0 iff the last number in the response equals the ground truth as a number (raises ``ValueError`` when
    the ground truth is not a number: a data problem, not a wrong answer)."""
    expected = parse_number(ground_truth)
    if expected is None:
        raise ValueError(f"ground truth {ground_truth!r} is not a number; the last_number reward compares numbers")
    found = last_number_in(solution_str)
    return 1.0 if found is not None and found == expected else 0.0


def boxed(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None) -> float:
    """1.0 iff the last ``\\boxed{}`` answer of the response equals the ground truth after
    :func:`normalize_math_answer`; 0.0 when the response has no complete ``\\boxed{}``."""
    found = extract_boxed(solution_str)
    if found is None:
        return 0.0
    return 1.0 if normalize_math_answer(found) == normalize_math_answer(ground_truth) else 0.0


#: ``rl.reward`` names of the built-in rule rewards
BUILTIN_REWARDS: dict = {"exact": exact_match, "last_number": last_number, "boxed": boxed}


def ground_truth_problem(reward_name: str, ground_truth: Any) -> Optional[str]:
    """Why a built-in reward cannot score against ``ground_truth`` (``None`` when it can): the run checks every
    prompt's ground truth before it starts, so a bad row is named at once, not at its first response."""
    if ground_truth is None:
        return "the ground truth is missing (null)"
    if reward_name == "last_number" and parse_number(ground_truth) is None:
        return f"ground truth {ground_truth!r} is not a number, which the last_number reward needs"
    return None


# --------------------------------------------------------------------------------------------------
# specs: which function ``rl.reward`` names
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RewardSpec:
    """A parsed ``rl.reward``: ``kind`` is ``builtin``, ``module`` or ``file``; ``target`` the built-in name,
    the module name or the file path; ``function`` the function's name (built-ins: the built-in name)."""
    kind: str
    target: str
    function: str

    @property
    def name(self) -> str:
        """Its name in errors and logs: ``last_number``, ``my_rewards:score``, ``reward.py:compute_score``."""
        if self.kind == "builtin":
            return self.target
        target = Path(self.target).name if self.kind == "file" else self.target
        return f"{target}:{self.function}"


#: what ``rl.reward`` may say (the fix of every spec error)
SPEC_FORMS: str = ("write one of " + ", ".join(BUILTIN_REWARDS)
                   + ", 'module:function' or 'path/to/file.py[:function]' (default function compute_score)")


def parse_reward_spec(text: Any) -> RewardSpec:
    """Parse ``rl.reward`` (no file system access, no import); raises ``ValueError`` saying what is wrong
    (:data:`SPEC_FORMS` says what to write)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a reward name, got {text!r}")
    s = text.strip()
    if s in BUILTIN_REWARDS:
        return RewardSpec("builtin", s, s)
    if ":" in s:
        target, _, function = (part.strip() for part in s.rpartition(":"))
        if not function.isidentifier():
            raise ValueError(f"{s!r}: {function!r} after the colon is not a Python function name")
    else:
        target, function = s, ""
    if target.endswith(".py"):
        return RewardSpec("file", target, function or DEFAULT_FUNCTION)
    if not function:
        close = difflib.get_close_matches(s, list(BUILTIN_REWARDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"{s!r} is not a built-in reward{hint}")
    if not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"{s!r}: {target!r} is neither a module name (dotted identifiers) nor a .py file")
    return RewardSpec("module", target, function)


@functools.lru_cache(maxsize=None)
def load_reward_function(spec: RewardSpec) -> Callable:
    """The function ``spec`` names, imported in this process (cached). Raises ``ValueError`` naming the spec
    when the file or module is missing, fails to import, lacks the function, or the function does not take
    veRL's arguments."""
    if spec.kind == "builtin":
        return BUILTIN_REWARDS[spec.target]
    if spec.kind == "file":
        path = Path(spec.target)
        if not path.is_file():
            raise ValueError(f"reward file {spec.target!r} does not exist (on every node the run uses, at this "
                             "absolute path)")
        name = "bidirl_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, str(path))
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException as exc:
                del sys.modules[name]
                raise ValueError(f"importing reward file {spec.target!r} raised {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(spec.target)
        except Exception as exc:
            raise ValueError(f"cannot import reward module {spec.target!r} ({type(exc).__name__}: {exc}); it must "
                             "be importable on every node (installed, or on PYTHONPATH)") from exc
    fn = getattr(module, spec.function, None)
    if fn is None or not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"{spec.name}: the module has no function {spec.function!r}"
                         + (f" (its functions: {', '.join(names)})" if names else ""))
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth=None, extra_info={})
    except TypeError as exc:
        raise ValueError(f"{spec.name} does not take veRL's keyword arguments (data_source, solution_str, "
                         f"ground_truth, extra_info): {exc}") from None
    except ValueError:          # a builtin or C function without a signature: let the call decide
        pass
    return fn


@dataclass(frozen=True)
class Reward:
    """A reward function by spec, callable as ``reward(meta: RewardInput, response: str)``; pickles as its spec
    and imports the function in the process that calls it (a Ray worker). Build it with :meth:`from_spec`."""
    spec: RewardSpec

    @classmethod
    def from_spec(cls, text: str, check: bool = True) -> "Reward":
        """Parse ``text`` (``rl.reward``), make a file path absolute (relative to the current directory) and,
        with ``check``, import the function here so a bad spec fails before the run starts. Raises
        ``ValueError``."""
        spec = parse_reward_spec(text)
        if spec.kind == "file":
            spec = RewardSpec("file", str(Path(spec.target).expanduser().resolve()), spec.function)
        reward = cls(spec)
        if check:
            load_reward_function(spec)
        return reward

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def builtin(self) -> Optional[str]:
        """The built-in reward's name, or ``None`` for a user function."""
        return self.spec.target if self.spec.kind == "builtin" else None

    def __call__(self, meta: RewardInput, response: str) -> Any:
        fn = load_reward_function(self.spec)
        if not isinstance(meta, RewardInput):
            raise TypeError(f"expected the group's RewardInput as meta, got {type(meta).__name__}")
        return fn(data_source=meta.data_source, solution_str=response, ground_truth=meta.ground_truth,
                  extra_info=meta.extra_info)


def as_score(value: Any) -> float:
    """A reward function's return value as a float: a finite number (bool and numpy scalars included) or a
    dict with a ``"score"`` number (veRL). Raises ``ValueError`` otherwise."""
    raw = value
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (keys: {sorted(map(str, value))}); veRL's "
                             "dict form needs {'score': number, ...}")
        value = value["score"]
    try:
        import numpy as np
        numeric = isinstance(value, (int, float, np.integer, np.floating, np.bool_))
    except ImportError:         # pragma: no cover - numpy is a dependency
        numeric = isinstance(value, (int, float))
    if not numeric:
        raise ValueError(f"returned {raw!r} ({type(value).__name__}), not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return score


def snippet(text: str, limit: int = SNIPPET_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks the cut), for error messages."""
    return text if len(text) <= limit else text[:limit] + "…"


def score_response(reward_fn: Callable, meta: Any, response: str, group_id: int, index: int) -> float:
    """``reward_fn(meta, response)`` as a float (:func:`as_score`); any failure becomes a :class:`RewardError`
    naming the function, the group, the response index and a snippet of the response."""
    try:
        value = reward_fn(meta, response)
    except Exception as exc:
        raise _reward_error(reward_fn, meta, response, group_id, index, f"raised {type(exc).__name__}: {exc}") \
            from exc
    try:
        return as_score(value)
    except ValueError as exc:
        raise _reward_error(reward_fn, meta, response, group_id, index, str(exc)) from None


def _reward_error(reward_fn, meta, response: str, group_id: int, index: int, cause: str) -> RewardError:
    name = getattr(reward_fn, "name", None) or getattr(reward_fn, "__qualname__", None) or repr(reward_fn)
    what = (f"data_source {meta.data_source!r}, ground truth {snippet(repr(meta.ground_truth), 40)}, "
            if isinstance(meta, RewardInput) else "")
    message = (f"reward function {name} failed on group {group_id}, response {index} ({what}response "
               f"{snippet(response)!r}): {cause}")
    return RewardError(" ".join(message.splitlines()))
