"""Prompt files (veRL's parquet layout, plain JSONL), their errors, prompt token ids and the group → prompt map,
and the shipped sample file (unit tests, no Ray)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from bidirl.job import config as cfgmod
from bidirl.rl import data as D
from bidirl.rl import word_problems as W
from bidirl.rl.tasks import ArithmeticTask
from bidirl.rl.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / W.SAMPLE_PATH

VERL_ROW = {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}],
            "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train", "index": 0}}


def parquet(tmp_path, rows, name="train.parquet") -> Path:
    return W.write_parquet(rows, tmp_path / name)


def jsonl(tmp_path, lines, name="train.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# --------------------------------------------------------------------------------------------------
# the two layouts
# --------------------------------------------------------------------------------------------------

def test_verl_parquet_rows_are_read_in_file_order(tmp_path):
    rows = [dict(VERL_ROW, extra_info={"split": "train", "index": i},
                 reward_model={"style": "rule", "ground_truth": str(i)}) for i in range(5)]
    ds = D.load_dataset(parquet(tmp_path, rows))
    assert ds.layout == "verl" and len(ds) == 5
    r = ds.row(3)
    assert r.prompt == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="})
    assert (r.ground_truth, r.data_source, r.extra_info) == ("3", "openai/gsm8k", {"split": "train", "index": 3})
    assert r.is_chat and r.reward_input().ground_truth == "3"


def test_a_dataframe_written_by_pandas_reads_the_same(tmp_path):
    path = tmp_path / "df.parquet"
    pd.DataFrame([VERL_ROW, VERL_ROW]).to_parquet(path)
    assert D.load_dataset(path).row(1).prompt == D.load_dataset(parquet(tmp_path, [VERL_ROW])).row(0).prompt


def test_plain_jsonl_rows(tmp_path):
    path = jsonl(tmp_path, [{"prompt": "2+2=", "answer": 4}, "",
                            {"prompt": "3+3=", "answer": "6", "data_source": "mine"},
                            {"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "extra_info": None}])
    ds = D.load_dataset(path)
    assert ds.layout == "plain" and len(ds) == 3
    assert ds.row(0).prompt == "2+2=" and ds.row(0).ground_truth == 4 and ds.row(0).data_source == "train"
    assert ds.row(1).data_source == "mine" and ds.row(2).is_chat and ds.row(2).extra_info == {}


def test_verl_layout_in_jsonl_is_read_too(tmp_path):
    assert D.load_dataset(jsonl(tmp_path, [VERL_ROW])).layout == "verl"


# --------------------------------------------------------------------------------------------------
# every malformed-row error names file, row and column
# --------------------------------------------------------------------------------------------------

def _bad(**changes):
    row = json.loads(json.dumps(VERL_ROW))
    for key, value in changes.items():
        if value is KeyError:
            row.pop(key)
        else:
            row[key] = value
    return row


@pytest.mark.parametrize("row,column,message", [
    (_bad(prompt=KeyError), "prompt", "got nothing \\(the column is missing\\)"),
    (_bad(prompt=""), "prompt", "got an empty string"),
    (_bad(prompt=[]), "prompt", "expected a non-empty string or a list of chat messages"),
    (_bad(prompt=[{"role": "user"}]), "prompt", "message 0: expected 'content' to be a string, got None"),
    (_bad(prompt=[{"content": "hi"}]), "prompt", "message 0: expected 'role' to be a string"),
    (_bad(prompt=["hi"]), "prompt", "message 0: expected a dict with 'role' and 'content'"),
    (_bad(prompt=[{"role": "user", "content": [{"type": "image"}]}]), "prompt", "multi-modal"),
    (_bad(prompt=[{"role": "user", "content": "  "}]), "prompt", "every message is empty"),
    (_bad(reward_model=None), "reward_model", "expected a dict"),
    (_bad(reward_model={"style": "rule"}), "reward_model", "has no ground_truth"),
    (_bad(reward_model={"style": "model", "ground_truth": "1"}), "reward_model", "only rule rewards"),
    (_bad(data_source=None), "data_source", "expected a non-empty string"),
    (_bad(data_source=KeyError), "data_source", "the column is missing"),
    (_bad(extra_info="x"), "extra_info", "expected a dict"),
])
def test_a_malformed_verl_row_is_named(tmp_path, row, column, message):
    path = jsonl(tmp_path, [VERL_ROW, VERL_ROW, row])
    with pytest.raises(D.DatasetError) as info:
        D.load_dataset(path)
    e = info.value
    assert (e.path, e.row, e.line, e.column) == (str(path), 2, 3, column), str(e)
    assert e.field == "workload.data_file" and e.fix
    assert f"{path}, row 2 (line 3), column {column!r}: " in str(e)
    assert re.search(message, str(e)), str(e)


def test_a_malformed_parquet_row_is_named(tmp_path):
    rows = [VERL_ROW, dict(VERL_ROW, reward_model={"style": "rule", "ground_truth": None})]
    with pytest.raises(D.DatasetError, match=r"train.parquet, row 1, column 'reward_model': has no ground_truth"):
        D.load_dataset(parquet(tmp_path, rows))


@pytest.mark.parametrize("line,message", [
    ({"prompt": "1+1=", "answer": None}, "column 'answer': expected the ground"),
    ({"prompt": "1+1="}, "column 'answer': expected the ground truth .* got nothing"),
    ({"prompt": "1+1=", "answer": [1]}, "column 'answer'"),
    ({"prompt": 5, "answer": "1"}, "column 'prompt'"),
    ({"prompt": "1+1=", "answer": "2", "data_source": 3}, "column 'data_source'"),
])
def test_a_malformed_plain_row_is_named(tmp_path, line, message):
    with pytest.raises(D.DatasetError, match=r"row 1 \(line 2\), " + message):
        D.load_dataset(jsonl(tmp_path, [{"prompt": "1+1=", "answer": "2"}, line]))


def test_a_line_that_is_not_json_is_named_by_its_line(tmp_path):
    path = jsonl(tmp_path, [{"prompt": "a", "answer": "1"}, "", "{not json", {"prompt": "b", "answer": "2"}])
    with pytest.raises(D.DatasetError, match=r"line 3 is not valid JSON") as info:
        D.load_dataset(path)
    assert info.value.line == 3 and info.value.row == 1
    with pytest.raises(D.DatasetError, match=r"row 0 \(line 1\): expected a JSON object, got list"):
        D.load_dataset(jsonl(tmp_path, [[1, 2]], name="list.jsonl"))


@pytest.mark.parametrize("make,message", [
    (lambda p: p / "missing.parquet", "no such file"),
    (lambda p: (p / "x.csv").write_text("a") and p / "x.csv", "unsupported file type '.csv'"),
    (lambda p: (p / "empty.jsonl").write_text("\n") and p / "empty.jsonl", "holds no rows"),
    (lambda p: (p / "bad.parquet").write_text("nope") and p / "bad.parquet", "cannot be read as Parquet"),
    (lambda p: jsonl(p, [{"prompt": "a", "label": "1"}]), "no ground-truth column"),
])
def test_file_level_problems_are_named(tmp_path, make, message):
    with pytest.raises(D.DatasetError, match=message):
        D.load_dataset(make(tmp_path))


# --------------------------------------------------------------------------------------------------
# prompt token ids
# --------------------------------------------------------------------------------------------------

def test_string_prompts_tokenize_as_the_built_in_task_always_did(tokenizer):
    assert D.prompt_token_ids(["12+7="], tokenizer) == [tuple(tokenizer("12+7=")["input_ids"])]


def test_chat_prompts_without_a_template_are_the_contents_joined(tokenizer):
    messages = ({"role": "system", "content": "1"}, {"role": "user", "content": "2+3="})
    assert not D.has_chat_template(tokenizer)
    assert D.plain_chat_text(messages) == "1" + D.PLAIN_CHAT_SEPARATOR + "2+3="
    assert D.prompt_token_ids([messages], tokenizer) == [tuple(tokenizer("1\n2+3=")["input_ids"])]


def test_chat_prompts_go_through_the_chat_template(tokenizer):
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m.content }}={% endfor %}"
                         "{% if add_generation_prompt %}-{% endif %}")
    messages = ({"role": "user", "content": "1+2"},)
    assert D.prompt_token_ids([messages, "3"], tok) == [tuple(tok("1+2=-", add_special_tokens=False)["input_ids"]),
                                                       tuple(tok("3")["input_ids"])]


# --------------------------------------------------------------------------------------------------
# group -> prompt
# --------------------------------------------------------------------------------------------------

def _dataset(tmp_path, n):
    return D.load_dataset(jsonl(tmp_path, [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]))


def test_group_g_takes_row_g_mod_the_file_or_the_pool(tmp_path, tokenizer):
    ds = _dataset(tmp_path, 5)
    every = D.GroupPrompts.build(ds, tokenizer, max_response_len=4)
    assert [every.row_index(g) for g in range(12)] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    pool = D.GroupPrompts.build(ds, tokenizer, prompt_pool=3, max_response_len=4)
    assert [pool.row_index(g) for g in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert pool.prompt_ids(4) == tuple(tokenizer("1+1=")["input_ids"]) and pool.reward_input(4).ground_truth == "2"
    assert every.max_prompt_len == 4


def test_the_built_in_task_is_the_source_without_a_file(tokenizer):
    task = ArithmeticTask(seed=0)
    prompts = D.GroupPrompts.build(task, tokenizer, prompt_pool=16, max_response_len=16, max_positions=64)
    assert prompts.prompt_ids(17) == tuple(tokenizer(task.problem(1).text)["input_ids"])
    assert prompts.reward_input(17) == D.RewardInput(D.ARITHMETIC_SOURCE, task.problem(1).answer,
                                                     {"index": 1, "a": task.problem(1).a, "op": "+",
                                                      "b": task.problem(1).b})
    assert prompts.max_prompt_len == task.max_prompt_chars() + 2


def test_a_pool_larger_than_the_file_is_refused(tmp_path, tokenizer):
    with pytest.raises(cfgmod.ConfigError) as info:
        D.GroupPrompts.build(_dataset(tmp_path, 5), tokenizer, prompt_pool=8, max_response_len=4)
    assert info.value.field == "workload.prompt_pool" and "at most 5" in info.value.fix


def test_prompts_that_do_not_fit_the_model_name_the_longest_row(tmp_path, tokenizer):
    ds = D.load_dataset(jsonl(tmp_path, [{"prompt": "1=", "answer": "1"}, {"prompt": "123456789=", "answer": "1"}]))
    with pytest.raises(cfgmod.ConfigError) as info:
        D.GroupPrompts.build(ds, tokenizer, max_response_len=60, max_positions=64)
    assert info.value.field == "workload.max_response_len"
    assert "row 1) has 10 tokens" in str(info.value) and "at most 54" in info.value.fix


def test_ground_truths_a_built_in_reward_cannot_score_are_named_before_the_run(tmp_path, tokenizer):
    ds = D.load_dataset(jsonl(tmp_path, [{"prompt": "1=", "answer": "1"}, {"prompt": "2=", "answer": "two"}]))
    prompts = D.GroupPrompts.build(ds, tokenizer, max_response_len=4)
    prompts.check_ground_truths("exact")
    with pytest.raises(D.DatasetError, match=r"row 1 \(line 2\), column 'answer': ground truth 'two' is not a number"):
        prompts.check_ground_truths("last_number")


# --------------------------------------------------------------------------------------------------
# the shipped sample
# --------------------------------------------------------------------------------------------------

def test_the_shipped_sample_is_what_the_generator_makes():
    shipped = pd.read_parquet(SAMPLE)
    made = pd.DataFrame(W.word_problems(W.SAMPLE_ROWS, W.SAMPLE_SEED))
    assert shipped.to_json(orient="records") == made.to_json(orient="records"), (
        f"regenerate it: python -m bidirl.rl.word_problems {W.SAMPLE_PATH}")


def test_the_sample_is_in_verls_layout_and_fits_the_tiny_model(tokenizer):
    ds = D.load_dataset(SAMPLE)
    assert ds.layout == "verl" and len(ds) == W.SAMPLE_ROWS
    assert {r.data_source for r in ds.rows} == {W.DATA_SOURCE}
    assert all(len(r.prompt[0]["content"]) <= W.MAX_QUESTION_CHARS for r in ds.rows)
    prompts = D.GroupPrompts.build(ds, tokenizer, max_response_len=16, max_positions=64)
    prompts.check_ground_truths("last_number")
    for r in ds.rows:                     # every answer is the expression's value
        assert str(eval(r.extra_info["expression"])) == r.ground_truth  # noqa: S307 - digits and one operator


def test_word_problems_are_deterministic_and_prefix_stable():
    assert W.word_problems(10, seed=3) == W.word_problems(10, seed=3)
    assert W.word_problems(20, seed=3)[:10] == W.word_problems(10, seed=3)
    assert W.word_problems(10, seed=3) != W.word_problems(10, seed=4)
    row = W.word_problem(0, instruction="Answer with a number.")
    assert row["prompt"][0]["content"].endswith(" Answer with a number.")
    with pytest.raises(ValueError, match="max_operand"):
        W.word_problem(0, max_operand=99)
