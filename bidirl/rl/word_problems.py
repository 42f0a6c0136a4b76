"""Arithmetic word problems in veRL's preprocessed layout: the project's sample prompt file.

``data/datasets/arithmetic_word/train.parquet`` is written by this module (``python -m
bidirl.rl.word_problems data/datasets/arithmetic_word/train.parquet``), never by hand, and a test checks that
the shipped file equals what :func:`word_problems` makes. Each row is what veRL's ``examples/data_preprocess``
scripts write (e.g. ``gsm8k.py``):

``data_source``  ``"bidirl/arithmetic_word"``
``prompt``       ``[{"role": "user", "content": "Ann has 12 pens and gets 7 more. How many?"}]``
``ability``      ``"math"``
``reward_model`` ``{"style": "rule", "ground_truth": "19"}``
``extra_info``   ``{"split": "train", "index": 0, "question": ..., "expression": "12+7"}``

Problem ``i`` is drawn from its own stream ``numpy.random.default_rng([seed, i])`` (as ``ArithmeticTask``
does), so a file is deterministic and a longer file starts with the rows of a shorter one. Questions are
at most :data:`MAX_QUESTION_CHARS` characters, so they fit the built-in tiny model's 64 positions together
with tiny-cpu's 16 response tokens. ``instruction`` (e.g. veRL's GSM8K ``'Let\\'s think step by step and
output the final answer after "####".'``) is appended to every question when given. The answers suit
``rl.reward: last_number`` (and ``exact`` for a model that answers with the number alone).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

DATA_SOURCE: str = "bidirl/arithmetic_word"
#: the longest question any template writes with operands up to 20
MAX_QUESTION_CHARS: int = 48
#: the shipped sample: its path in a source checkout, and how it was made
SAMPLE_PATH: str = "data/datasets/arithmetic_word/train.parquet"
SAMPLE_ROWS: int = 128
SAMPLE_SEED: int = 0

#: (template, operation): ``{a}`` and ``{b}`` are the operands, the answer is ``a op b``
TEMPLATES: tuple = (
    ("Ann has {a} pens and gets {b} more. How many?", "+"),
    ("A jar holds {a} nuts; {b} are added. Total?", "+"),
    ("Bo had {a} cards and lost {b}. How many left?", "-"),
    ("{a} birds sat on a wire; {b} flew off. How many?", "-"),
    ("{a} bags hold {b} apples each. How many apples?", "*"),
    ("Each of {a} boxes has {b} eggs. How many eggs?", "*"),
)

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def word_problem(index: int, seed: int = SAMPLE_SEED, max_operand: int = 20, instruction: str = "",
                 split: str = "train") -> dict:
    """Row ``index`` in veRL's layout (module docstring). Subtraction keeps answers ≥ 0; multiplication uses
    operands from 2 to 12."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")
    if isinstance(max_operand, bool) or not isinstance(max_operand, (int, np.integer)) or not 1 <= max_operand <= 20:
        raise ValueError(f"max_operand must be an integer in [1, 20] (questions stay short), got {max_operand!r}")
    rng = np.random.default_rng([int(seed), int(index)])
    template, op = TEMPLATES[int(rng.integers(0, len(TEMPLATES)))]
    low, top = (2, max(2, min(max_operand, 12))) if op == "*" else (1, max_operand)
    a, b = (int(x) for x in rng.integers(low, top + 1, size=2))
    if op == "-" and b > a:
        a, b = b, a
    question = template.format(a=a, b=b)
    content = f"{question} {instruction}".strip() if instruction else question
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(_OPS[op](a, b))},
            "extra_info": {"split": split, "index": int(index), "question": question, "expression": f"{a}{op}{b}"}}


def word_problems(n: int, seed: int = SAMPLE_SEED, max_operand: int = 20, instruction: str = "",
                  split: str = "train") -> list:
    """Rows ``0 .. n-1`` (:func:`word_problem`)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return [word_problem(i, seed, max_operand, instruction, split) for i in range(int(n))]


def write_parquet(rows: Sequence[dict], path: Union[str, Path]) -> Path:
    """Write rows to a Parquet file (pyarrow infers veRL's nested types: a list of structs, structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), out)
    return out


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bidirl.rl.word_problems", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=SAMPLE_PATH, help=f"Parquet file to write (default {SAMPLE_PATH})")
    parser.add_argument("--rows", type=int, default=SAMPLE_ROWS, help=f"number of problems (default {SAMPLE_ROWS})")
    parser.add_argument("--seed", type=int, default=SAMPLE_SEED, help=f"seed (default {SAMPLE_SEED})")
    parser.add_argument("--max-operand", type=int, default=20, help="largest operand, at most 20 (default 20)")
    parser.add_argument("--instruction", default="", help="text appended to every question (default none)")
    parser.add_argument("--split", default="train", help="extra_info.split (default train)")
    args = parser.parse_args(argv)
    rows = word_problems(args.rows, args.seed, args.max_operand, args.instruction, args.split)
    print(f"wrote {len(rows)} rows to {write_parquet(rows, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
