"""Prompt datasets from local files, and which prompt each rollout group gets.

Two layouts are read (``workload.data_file``), told apart by their columns:

* **veRL's preprocessed layout** (``.parquet``, as written by veRL's ``examples/data_preprocess`` scripts, or
  ``.jsonl`` with the same fields): ``prompt`` — a list of chat messages ``[{"role": ..., "content": ...}]``
  (a plain string is accepted too), ``data_source`` (a string), ``reward_model`` — ``{"style": "rule",
  "ground_truth": ...}`` — and optionally ``extra_info`` (a dict). Other columns (``ability``, ...) are kept
  out of the way.
* **plain layout** (``.jsonl`` or ``.parquet``): ``prompt`` (a string, or chat messages) and ``answer`` (the
  ground truth); optional ``data_source`` (default: the file's name without its suffix) and ``extra_info``.

Parquet is read with pyarrow; JSONL line by line with :mod:`json`, so a line that is not JSON is named by its
line number. Every row is checked when the file is loaded: a malformed one raises :class:`DatasetError`
naming the file, the row (0-based; JSONL also gives the line), the column, what was expected and what was
found — nothing is skipped or defaulted silently.

**Prompt token ids.** A string prompt is tokenized as it is (``tokenizer(text)``, the tokenizer's own special
tokens included), as the built-in task always was. Chat messages go through the tokenizer's chat template when
it has one — ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` then
``tokenizer(text, add_special_tokens=False)``, as veRL's ``RLHFDataset`` does — and otherwise through the
**plain concatenation** :func:`plain_chat_text`: the messages' contents joined by :data:`PLAIN_CHAT_SEPARATOR`
(roles dropped), tokenized like a string prompt.

**Which prompt a group gets** (:class:`GroupPrompts`): group ``g`` takes row ``g mod workload.prompt_pool`` when
a pool is set (the first ``prompt_pool`` rows are the training set), else row ``g mod len(dataset)``: a run is
deterministic and cycles over the file in order. Without a file the source is the built-in arithmetic task
(``bidirl.rl.tasks.ArithmeticTask``), whose problem ``g`` (or ``g mod prompt_pool``) a group gets, as before.
The rows a run can use are tokenized once, when the run is set up, so the longest prompt is known before any
engine starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from bidirl.errors import ConfigError
from bidirl.rl.rewards import RewardInput

#: file suffixes ``workload.data_file`` may have
DATA_SUFFIXES: tuple = (".parquet", ".jsonl")
#: what joins the contents of chat messages for a tokenizer without a chat template
PLAIN_CHAT_SEPARATOR: str = "\n"
#: the ``data_source`` of the built-in arithmetic task's prompts
ARITHMETIC_SOURCE: str = "bidirl/arithmetic"


class DatasetError(ConfigError):
    """A data file cannot be used: missing, unreadable, or a malformed row. Reported against the config key
    ``workload.data_file``; ``path``, ``row`` (0-based), ``line`` (JSONL, 1-based) and ``column`` say where."""

    def __init__(self, path: Union[str, Path], problem: str, fix: str = "", *, row: Optional[int] = None,
                 column: Optional[str] = None, line: Optional[int] = None):
        self.path, self.row, self.column, self.line = str(path), row, column, line
        where = str(path)
        if row is not None:
            where += f", row {row}" + (f" (line {line})" if line is not None else "")
        if column is not None:
            where += f", column {column!r}"
        super().__init__("workload.data_file", f"{where}: {problem}", fix)


@dataclass(frozen=True)
class PromptRow:
    """One prompt: ``prompt`` is a string or a tuple of chat messages (dicts with ``role`` and ``content``);
    ``ground_truth``, ``data_source`` and ``extra_info`` go to the reward function."""
    index: int
    prompt: Union[str, tuple]
    ground_truth: Any
    data_source: str
    extra_info: dict = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def reward_input(self) -> RewardInput:
        return RewardInput(self.data_source, self.ground_truth, dict(self.extra_info))


@dataclass(frozen=True)
class PromptDataset:
    """The rows of a data file, in file order; ``layout`` is ``verl`` or ``plain``; ``lines`` (JSONL) the line
    of each row."""
    path: str
    layout: str
    rows: tuple
    lines: Optional[tuple] = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def size(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> PromptRow:
        return self.rows[index]

    def error(self, index: int, column: Optional[str], problem: str, fix: str) -> DatasetError:
        """A :class:`DatasetError` about row ``index`` (with its line, for JSONL)."""
        return DatasetError(self.path, problem, fix, row=index, column=column,
                            line=self.lines[index] if self.lines else None)


# --------------------------------------------------------------------------------------------------
# reading and checking
# --------------------------------------------------------------------------------------------------

def load_dataset(path: Union[str, Path]) -> PromptDataset:
    """Read and check a prompt file (``.parquet`` or ``.jsonl``; layouts in the module docstring)."""
    p = Path(path).expanduser()
    if p.suffix not in DATA_SUFFIXES:
        raise DatasetError(p, f"unsupported file type {p.suffix or '(no suffix)'!r}",
                           f"use a {' or '.join(DATA_SUFFIXES)} file")
    if not p.is_file():
        raise DatasetError(p, f"no such file (looked at {p.resolve()})",
                           "give an absolute path, or one relative to the directory you run bidirl from")
    records, lines = _read_parquet(p) if p.suffix == ".parquet" else _read_jsonl(p)
    if not records:
        raise DatasetError(p, "the file holds no rows", "add prompts to it")
    columns = set().union(*(r.keys() for r in records))
    if "reward_model" in columns:
        layout = "verl"
    elif "answer" in columns:
        layout = "plain"
    else:
        raise DatasetError(p, f"no ground-truth column (columns: {sorted(columns)})",
                           "use veRL's layout (prompt, data_source, reward_model: {style: rule, ground_truth}) or "
                           "the plain one (prompt, answer)")
    rows = tuple(_check_row(p, layout, i, rec, lines[i] if lines else None) for i, rec in enumerate(records))
    return PromptDataset(str(p), layout, rows, tuple(lines) if lines else None)


def _read_parquet(path: Path) -> tuple:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DatasetError(path, f"cannot be read as Parquet ({type(exc).__name__}: {exc})",
                           "write it with pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    return table.to_pylist(), None


def _read_jsonl(path: Path) -> tuple:
    records, lines = [], []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetError(path, f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})",
                                   "write one JSON object per line", row=len(records), line=number) from None
            if not isinstance(rec, dict):
                raise DatasetError(path, f"expected a JSON object, got {type(rec).__name__}",
                                   "write one JSON object per line", row=len(records), line=number)
            records.append(rec)
            lines.append(number)
    return records, lines


def _check_row(path: Path, layout: str, i: int, rec: dict, line: Optional[int]) -> PromptRow:
    def fail(column, problem, fix):
        raise DatasetError(path, problem, fix, row=i, column=column, line=line)

    prompt = _check_prompt(rec.get("prompt", _MISSING), fail)
    if layout == "verl":
        rm = rec.get("reward_model", _MISSING)
        if not isinstance(rm, dict):
            fail("reward_model", f"expected a dict {{'style': 'rule', 'ground_truth': ...}}, got {_shown(rm)}",
                 "write reward_model as veRL's preprocessing scripts do")
        style = rm.get("style")
        if style not in (None, "rule"):
            fail("reward_model", f"style is {style!r}; only rule rewards are scored here",
                 "set style: rule and score with rl.reward (a built-in or a compute_score function)")
        truth = rm.get("ground_truth")
        if truth is None:
            fail("reward_model", "has no ground_truth", "add reward_model.ground_truth")
        source = rec.get("data_source", _MISSING)
        if not isinstance(source, str) or not source:
            fail("data_source", f"expected a non-empty string, got {_shown(source)}",
                 "name the data set (veRL's reward functions dispatch on it)")
    else:
        truth = rec.get("answer", _MISSING)
        if truth is None or truth is _MISSING or isinstance(truth, (dict, list)):
            fail("answer", f"expected the ground truth (a string or a number), got {_shown(truth)}",
                 "give every row an answer")
        source = rec.get("data_source", path.stem)
        if not isinstance(source, str) or not source:
            fail("data_source", f"expected a non-empty string, got {_shown(source)}",
                 "drop the column or name the data set")
    extra = rec.get("extra_info")
    if extra is None:
        extra = {}
    elif not isinstance(extra, dict):
        fail("extra_info", f"expected a dict, got {_shown(extra)}", "write extra_info as a mapping or leave it out")
    return PromptRow(i, prompt, truth, source, dict(extra))


_MISSING = object()


def _shown(value) -> str:
    if value is _MISSING:
        return "nothing (the column is missing)"
    text = repr(value)
    return (text if len(text) <= 60 else text[:60] + "…") + f" ({type(value).__name__})"


def _check_prompt(prompt, fail) -> Union[str, tuple]:
    expected = "a non-empty string or a list of chat messages [{'role': ..., 'content': ...}]"
    if isinstance(prompt, str):
        if not prompt.strip():
            fail("prompt", f"expected {expected}, got an empty string", "give every row a prompt")
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        fail("prompt", f"expected {expected}, got {_shown(prompt)}", "give every row a prompt")
    messages = []
    for k, m in enumerate(prompt):
        if not isinstance(m, dict):
            fail("prompt", f"message {k}: expected a dict with 'role' and 'content', got {_shown(m)}",
                 "write each message as {'role': 'user', 'content': '...'}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            fail("prompt", f"message {k}: expected 'role' to be a string such as 'user', got {_shown(role)}",
                 "give every message a role")
        if not isinstance(content, str):
            fail("prompt", f"message {k}: expected 'content' to be a string, got {_shown(content)}",
                 "write text content (multi-modal content lists are not supported)")
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        fail("prompt", "every message is empty", "give every row a prompt")
    return tuple(messages)


# --------------------------------------------------------------------------------------------------
# prompt token ids
# --------------------------------------------------------------------------------------------------

def plain_chat_text(messages: Sequence[dict]) -> str:
    """Chat messages as one string for a tokenizer without a chat template: their contents, in order, joined by
    :data:`PLAIN_CHAT_SEPARATOR` (roles dropped)."""
    return PLAIN_CHAT_SEPARATOR.join(m["content"] for m in messages)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_token_ids(prompts: Sequence[Union[str, tuple]], tokenizer) -> list:
    """Token ids of each prompt (module docstring: strings as they are, chat messages through the chat
    template or :func:`plain_chat_text`). Tokenizes in batches."""
    chat_template = has_chat_template(tokenizer)
    raw, templated = {}, {}
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raw[k] = prompt
        elif chat_template:
            templated[k] = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        else:
            raw[k] = plain_chat_text(prompt)
    out: list = [None] * len(prompts)
    for texts, special in ((raw, True), (templated, False)):
        if texts:
            ids = tokenizer(list(texts.values()), add_special_tokens=special)["input_ids"]
            for k, row_ids in zip(texts, ids):
                out[k] = tuple(int(t) for t in row_ids)
    return out


def model_max_positions(model_dir: Union[str, Path]) -> Optional[int]:
    """``max_position_embeddings`` of a checkpoint's ``config.json`` (``None`` when it does not say)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


# --------------------------------------------------------------------------------------------------
# group -> prompt
# --------------------------------------------------------------------------------------------------

@dataclass
class GroupPrompts:
    """The prompt of every rollout group, as token ids, and what its reward function gets (module docstring).

    Build it with :meth:`build`; ``source`` is a :class:`PromptDataset` or an ``ArithmeticTask``.
    """
    source: Any
    tokenizer: Any
    prompt_pool: Optional[int] = None
    max_prompt_len: int = 0
    _ids: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, source, tokenizer, *, prompt_pool: Optional[int] = None, max_response_len: int,
              max_positions: Optional[int] = None, max_prompt_len: Optional[int] = None) -> "GroupPrompts":
        """Check the pool against the source, tokenize the rows a run can use and check that the longest prompt
        plus ``max_response_len`` fits the model's ``max_positions`` (raises ``DatasetError`` /
        ``ConfigError`` naming the key and the row). With ``max_prompt_len`` (``workload.max_prompt_len``) every
        prompt must fit it and the engines are sized for it, not for the longest prompt."""
        self = cls(source, tokenizer, prompt_pool)
        size = getattr(source, "size", None)
        if size is None:                        # the arithmetic task: an endless stream of short problems
            self.max_prompt_len = source.max_prompt_chars() + 2
            longest = None
        else:
            if prompt_pool is not None and prompt_pool > size:
                raise ConfigError("workload.prompt_pool", f"is {prompt_pool} but {source.path} holds {size} rows",
                                  f"use at most {size}, or leave it empty to cycle over every row")
            used = range(min(size, prompt_pool or size))
            ids = prompt_token_ids([source.row(i).prompt for i in used], tokenizer)
            for i, row_ids in zip(used, ids):
                if not row_ids:
                    raise source.error(i, "prompt", "the prompt tokenizes to no tokens", "give the row a prompt")
                self._ids[i] = row_ids
            longest = max(self._ids, key=lambda i: len(self._ids[i]))     # the first of the longest
            self.max_prompt_len = len(self._ids[longest])
        if max_prompt_len is not None:
            if self.max_prompt_len > max_prompt_len:
                where = (f"{source.path}, row {longest}, has a prompt of {self.max_prompt_len} tokens"
                         if longest is not None else f"the arithmetic task's prompts have up to {self.max_prompt_len} "
                                                     "tokens")
                raise ConfigError("workload.max_prompt_len", f"is {max_prompt_len} but {where}",
                                  f"raise it to at least {self.max_prompt_len}, leave it empty (the longest prompt), "
                                  "or drop overlong prompts from the data file")
            self.max_prompt_len, longest = int(max_prompt_len), None
        if max_positions is not None and self.max_prompt_len + max_response_len > max_positions:
            where = (f"the longest prompt ({source.path}, row {longest}) has {self.max_prompt_len} tokens"
                     if longest is not None else f"workload.max_prompt_len is {max_prompt_len}"
                     if max_prompt_len is not None else f"prompts have up to {self.max_prompt_len} tokens")
            raise ConfigError("workload.max_response_len",
                              f"{where}; with max_response_len {max_response_len} that exceeds the model's "
                              f"{max_positions} positions",
                              f"lower max_response_len to at most {max_positions - self.max_prompt_len}"
                              + (", or drop overlong prompts from the data file" if longest is not None else ""))
        return self

    def row_index(self, group_id: int) -> int:
        """The row (or task problem) group ``group_id`` gets."""
        g = int(group_id)
        i = g % self.prompt_pool if self.prompt_pool else g
        size = getattr(self.source, "size", None)
        return i % size if size else i

    def row(self, group_id: int) -> PromptRow:
        return self.source.row(self.row_index(group_id))

    def prompt_ids(self, group_id: int) -> tuple:
        i = self.row_index(group_id)
        ids = self._ids.get(i)
        if ids is None:
            ids = tuple(prompt_token_ids([self.source.row(i).prompt], self.tokenizer)[0])
            if getattr(self.source, "size", None) is not None:
                self._ids[i] = ids
        return ids

    def reward_input(self, group_id: int) -> RewardInput:
        return self.row(group_id).reward_input()

    def check_ground_truths(self, reward_name: str) -> None:
        """For a built-in reward: every usable row's ground truth can be scored (raises ``DatasetError``)."""
        from bidirl.rl.rewards import ground_truth_problem
        size = getattr(self.source, "size", None)
        if size is None:
            return
        for i in range(min(size, self.prompt_pool or size)):
            problem = ground_truth_problem(reward_name, self.source.row(i).ground_truth)
            if problem is not None:
                column = "reward_model" if self.source.layout == "verl" else "answer"
                raise self.source.error(i, column, problem, f"fix the row, or choose another rl.reward than "
                                        f"{reward_name}")

