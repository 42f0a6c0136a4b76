"""Rule rewards, reward specs, user reward functions and the errors a failing one gives (unit tests, no Ray)."""

from __future__ import annotations

import pickle
import re
import textwrap
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from bidirl.rl import rewards as R

META = R.RewardInput("bidirl/test", "72", {"index": 3})

# text with no digit, sign, dot or comma: nothing in it reads as (part of) a number
PROSE = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="0123456789-.,٠١٢٣٤٥٦٧٨٩",
                                       exclude_categories=("Nd", "Cs")), max_size=30)


# --------------------------------------------------------------------------------------------------
# last_number
# --------------------------------------------------------------------------------------------------

@given(before=PROSE, after=PROSE, n=st.integers(-10**12, 10**12), earlier=st.integers(0, 10**6))
def test_the_last_number_is_found_whatever_surrounds_it(before, after, n, earlier):
    text = f"{earlier} {before} {n} {after}"
    assert R.last_number_in(text) == Decimal(n)
    assert R.last_number("d", text, str(n)) == 1.0
    assert R.last_number("d", text, str(n + 1)) == 0.0


@given(n=st.integers(1000, 10**15), cents=st.integers(0, 99))
def test_thousands_separators_and_decimals_read_as_one_number(n, cents):
    written = f"{n:,}.{cents:02d}"
    assert R.last_number_in(f"The total is ${written}.") == Decimal(f"{n}.{cents:02d}")
    assert R.last_number("d", f"so {written}", f"{n}.{cents:02d}") == 1.0


@given(x=st.decimals(min_value=-10**6, max_value=10**6, places=3, allow_nan=False, allow_infinity=False))
def test_numbers_compare_by_value_not_spelling(x):
    text = format(x, "f")
    assert R.last_number("d", f"answer: {text}0", text) == 1.0       # 2.5 == 2.50


def test_last_number_examples():
    assert R.last_number_in("no digits here") is None
    assert R.last_number("d", "no digits here", "3") == 0.0
    assert R.last_number_in("3 apples, then 4. End.") == 4
    assert R.last_number_in("#### 1,234") == 1234
    assert R.last_number_in("x=-5") == -5
    assert R.parse_number("$1,000") == 1000 and R.parse_number("12 apples") is None


def test_last_number_refuses_a_ground_truth_that_is_not_a_number():
    with pytest.raises(ValueError, match="not a number"):
        R.last_number("d", "42", "forty-two")
    assert "not a number" in R.ground_truth_problem("last_number", "forty-two")
    assert R.ground_truth_problem("last_number", "1,000") is None
    assert R.ground_truth_problem("exact", None) is not None


# --------------------------------------------------------------------------------------------------
# boxed
# --------------------------------------------------------------------------------------------------

def _balanced(depth: int = 3):
    """LaTeX-ish strings whose braces balance and that hold no backslash-boxed."""
    leaf = st.text(alphabet="abcxy0123456789+-=^_ \\frac", max_size=8).map(lambda s: s.replace("\\", ""))
    return st.recursive(leaf, lambda inner: st.tuples(inner, inner, inner).map(lambda t: f"{t[0]}{{{t[1]}}}{t[2]}"),
                        max_leaves=depth * 3)


@given(content=_balanced(), before=PROSE, after=PROSE)
def test_boxed_extracts_the_whole_balanced_content(content, before, after):
    assume("\\" not in before + after and "{" not in after and "}" not in after)
    assert R.extract_boxed(f"{before}\\boxed{{{content}}}{after}") == content


@given(first=_balanced(), second=_balanced())
def test_the_last_box_wins(first, second):
    assert R.extract_boxed(f"\\boxed{{{first}}} then \\boxed{{{second}}}") == second


@given(content=_balanced())
def test_an_unclosed_box_gives_nothing(content):
    assert R.extract_boxed(f"\\boxed{{{content}") is None


def test_boxed_examples():
    assert R.extract_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert R.extract_boxed(r"\fbox{7}") == "7"
    assert R.extract_boxed(r"answer \boxed 12$") == "12"
    assert R.extract_boxed("no box") is None
    assert R.boxed("d", r"thus $\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}") == 1.0
    assert R.boxed("d", r"\boxed{2.50}", "2.5") == 1.0
    assert R.boxed("d", r"\boxed{1,000}", "1000") == 1.0
    assert R.boxed("d", r"\boxed{3}", "4") == 0.0
    assert R.boxed("d", "3", "3") == 0.0                       # no box, no reward
    assert R.normalize_math_answer(r"\left( 1, 2 \right)") == "(1,2)"
    assert R.normalize_math_answer(r"\text{cm}") == "cm"


def test_exact_match_strips_whitespace_only():
    assert R.exact_match("d", " 19\n", "19") == 1.0
    assert R.exact_match("d", "19.0", "19") == 0.0
    assert R.exact_match("d", "7", 7) == 1.0


# --------------------------------------------------------------------------------------------------
# specs and user functions
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,kind,target,function", [
    ("exact", "builtin", "exact", "exact"),
    ("last_number", "builtin", "last_number", "last_number"),
    ("boxed", "builtin", "boxed", "boxed"),
    ("rewards/gsm8k.py", "file", "rewards/gsm8k.py", "compute_score"),
    ("rewards/gsm8k.py:score", "file", "rewards/gsm8k.py", "score"),
    ("my_pkg.rewards:score", "module", "my_pkg.rewards", "score"),
])
def test_reward_specs_parse(text, kind, target, function):
    assert R.parse_reward_spec(text) == R.RewardSpec(kind, target, function)


@pytest.mark.parametrize("text,message", [
    ("exat", "did you mean 'exact'"),
    ("my_module", "not a built-in reward"),
    ("my_module:", "not a Python function name"),
    ("file.py:1x", "not a Python function name"),
    ("not a module:f", "neither a module name"),
    ("", "expected a reward name"),
])
def test_bad_reward_specs_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        R.parse_reward_spec(text)


def _write(tmp_path, name, body) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_verl_reward_file_is_called_with_verls_arguments(tmp_path, monkeypatch):
    _write(tmp_path, "my_reward.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str == ground_truth) + extra_info["index"], "acc": 1}
    """)
    monkeypatch.chdir(tmp_path)
    reward = R.Reward.from_spec("my_reward.py")                  # relative to the current directory
    assert reward.spec.target == str(tmp_path / "my_reward.py") and reward.name == "my_reward.py:compute_score"
    assert R.score_response(reward, META, "72", 0, 0) == 4.0
    assert R.score_response(pickle.loads(pickle.dumps(reward)), META, "7", 0, 1) == 3.0


def test_a_module_function_is_imported_by_name(tmp_path, monkeypatch):
    _write(tmp_path, "bidirl_test_reward_mod.py", """
        def score(data_source, solution_str, ground_truth, **kwargs):
            return len(solution_str)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = R.Reward.from_spec("bidirl_test_reward_mod:score")
    assert R.score_response(reward, META, "abc", 1, 0) == 3.0


@pytest.mark.parametrize("body,spec,message", [
    ("def other(data_source, solution_str, ground_truth, extra_info): return 1", "r.py",
     r"r.py:compute_score: the module has no function 'compute_score' \(its functions: other\)"),
    ("def compute_score(text): return 1", "r.py", "does not take veRL's keyword arguments"),
    ("import not_a_module_anywhere", "r.py", "importing reward file .* raised ModuleNotFoundError"),
])
def test_a_bad_reward_file_is_named_before_the_run(tmp_path, monkeypatch, body, spec, message):
    _write(tmp_path, "r.py", body)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        R.Reward.from_spec(spec)


def test_a_missing_reward_file_or_module_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        R.Reward.from_spec(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="cannot import reward module 'no_such_module_here'"):
        R.Reward.from_spec("no_such_module_here:score")


@pytest.mark.parametrize("value,score", [(1, 1.0), (True, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5),
                                         (np.int64(2), 2.0), ({"score": 0.75, "acc": True}, 0.75)])
def test_numbers_and_verls_dicts_are_scores(value, score):
    assert R.as_score(value) == score


@pytest.mark.parametrize("value,message", [
    ("1.0", r"returned '1.0' \(str\), not a number"),
    (None, "returned None"),
    ({"acc": 1}, "without a 'score' key"),
    ({"score": "high"}, "not a number"),
    (float("nan"), "not a finite number"),
    (float("inf"), "not a finite number"),
])
def test_a_reward_that_returns_no_number_is_an_error_naming_the_sample(value, message):
    def reward(meta, text):
        return value
    with pytest.raises(R.RewardError) as info:
        R.score_response(reward, META, "the answer\nis 72", 12, 3)
    text = str(info.value)
    assert "reward function" in text and "group 12, response 3" in text and "'the answer\\nis 72'" in text
    assert "data_source 'bidirl/test'" in text
    assert len(text.splitlines()) == 1
    assert re.search(message, text), text


def test_a_reward_that_raises_is_an_error_naming_function_and_sample(tmp_path):
    path = _write(tmp_path, "bad.py", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1 / 0
    """)
    reward = R.Reward.from_spec(path)
    long_response = "x" * 500
    with pytest.raises(R.RewardError, match=r"reward function bad.py:compute_score failed on group 5, response 2 "
                                            r".*raised ZeroDivisionError: division by zero") as info:
        R.score_response(reward, META, long_response, 5, 2)
    assert "x" * R.SNIPPET_CHARS + "…" in str(info.value) and "x" * 100 not in str(info.value)
    assert isinstance(pickle.loads(pickle.dumps(info.value)), R.RewardError)    # crosses Ray as itself
