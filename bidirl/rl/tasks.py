"""A built-in verifiable task: integer arithmetic with an exact-match reward.

GRPO-style RL (paper §2.1) needs prompts whose responses a program can score. This task asks for the
result of one integer operation, e.g. the prompt ``"12+7="`` expects the response ``"19"``; the reward is
1 when the decoded response equals the answer exactly (after stripping surrounding whitespace) and 0
otherwise, so a rollout group's rewards are in {0, 1} and its advantages are well defined (``grpo.py``).

Engine runs without a data file train on this task: group ``g`` gets :meth:`ArithmeticTask.row` ``g`` (or
``g mod workload.prompt_pool``), scored by ``rl.reward`` (default ``exact``, the same rule as :meth:`reward`;
``bidirl.rl.rewards``).

Problem ``i`` of a task is drawn from its own random stream ``numpy.random.default_rng([seed, i])``: the
generator is deterministic, random-access (a rollout group ``g`` can always be mapped back to problem
``g``) and independent of how many problems were asked for before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: the characters prompts and answers are written with (the tiny model's tokenizer covers exactly these)
ALPHABET: str = "0123456789+-*="

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    """One prompt of the task: ``text`` is what the model sees, ``answer`` the exact expected response."""
    index: int
    text: str
    answer: str
    a: int
    op: str
    b: int


@dataclass(frozen=True)
class ArithmeticTask:
    """``a <op> b =`` with ``a, b`` uniform in ``[0, max_operand]`` and ``op`` uniform over ``ops``.

    ``seed`` fixes the whole problem sequence. Subtraction may give negative answers (``"3-7="`` → ``"-4"``).
    """
    seed: int = 0
    max_operand: int = 19
    ops: str = "+"

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"ArithmeticTask.seed must be a non-negative integer, got {self.seed!r}")
        if isinstance(self.max_operand, bool) or not isinstance(self.max_operand, (int, np.integer)) \
                or self.max_operand < 1:
            raise ValueError(f"ArithmeticTask.max_operand must be an integer ≥ 1, got {self.max_operand!r}")
        if not self.ops or any(op not in _OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithmeticTask.ops must be distinct characters from {''.join(_OPS)!r}, "
                             f"got {self.ops!r}")

    def problem(self, index: int) -> Problem:
        """Problem number ``index`` (≥ 0), the same for every call and every process."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise ValueError(f"problem index must be a non-negative integer, got {index!r}")
        rng = np.random.default_rng([int(self.seed), int(index)])
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
        op = self.ops[int(rng.integers(0, len(self.ops)))]
        return Problem(int(index), f"{a}{op}{b}=", str(_OPS[op](a, b)), a, op, b)

    def row(self, index: int):
        """Problem ``index`` as a ``bidirl.rl.data.PromptRow`` (the prompt text, the answer as ground truth,
        ``data_source`` ``bidirl/arithmetic``, the operands in ``extra_info``): what an engine run's groups get."""
        from bidirl.rl.data import ARITHMETIC_SOURCE, PromptRow
        p = self.problem(index)
        return PromptRow(p.index, p.text, p.answer, ARITHMETIC_SOURCE,
                         {"index": p.index, "a": p.a, "op": p.op, "b": p.b})

    def prompts(self, n: int, start: int = 0) -> list:
        """Problems ``start .. start + n - 1`` (deterministic for the task's seed)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"number of prompts n must be a non-negative integer, got {n!r}")
        return [self.problem(start + i) for i in range(int(n))]

    @staticmethod
    def reward(answer: str, response: str) -> float:
        """Exact-match reward in {0, 1}: ``1.0`` iff ``response.strip() == answer``."""
        return 1.0 if response.strip() == str(answer).strip() else 0.0

    def rewards(self, answers: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """Vectorised :meth:`reward` over paired answers and responses (float64 array of 0/1)."""
        if len(answers) != len(responses):
            raise ValueError(f"got {len(answers)} answers but {len(responses)} responses; pass one answer "
                             "per response (repeat a group's answer group_size times)")
        return np.array([self.reward(a, r) for a, r in zip(answers, responses)], dtype=np.float64)

    def max_answer_chars(self) -> int:
        """The longest answer any problem of this task can have (bounds the response length)."""
        m = self.max_operand
        candidates = [str(_OPS[op](a, b)) for op in self.ops for a in (0, m) for b in (0, m)]
        return max(len(c) for c in candidates)

    def max_prompt_chars(self) -> int:
        return 2 * len(str(self.max_operand)) + 2
