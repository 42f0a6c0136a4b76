"""veRL step logs as they exist (issue: your run, as it really ran): the console format with ANSI colours, Ray
prefixes, a Hydra config dump, tqdm bars, validation-only lines, a resumed run's repeated steps and a line cut by
the end of the file; the older ``timing/*`` keys; and every second of a step in a named category.

The fixtures in ``data/logs/verl-console/`` were written for these tests, each number chosen so the expected
categories are exact sums of the logged values (every value has at most three decimals, as veRL prints them)."""

import math
from pathlib import Path

import pytest

from bidirl.calibrate.step_log import LogError, job_gpus, read_step_log
from bidirl.cli import main
from bidirl.ingest import load_foreign
from bidirl.ingest import step_breakdown as sb
from bidirl.ingest.bubbles import bubble_breakdown, parts, pool_idle

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "data" / "logs" / "verl-console"
COLOCATED, OLD = LOGS / "colocated-2025.log", LOGS / "ppo-2024.log"


def test_the_console_log_reads_past_its_noise_keeps_validation_apart_and_the_last_of_a_repeated_step():
    frame = read_step_log(COLOCATED)
    assert frame["training/global_step"].tolist() == [1, 2, 3, 4]
    # step 3 was logged before the crash (step 42 s) and again after the resume (36 s): the last line is kept
    assert frame.attrs["repeated_steps"] == [3]
    assert frame.loc[frame["training/global_step"] == 3, "timing_s/step"].item() == 36.0
    # step 4's line starts after a tqdm redraw (carriage returns) on the same physical line
    assert frame.attrs["lines"] == [12, 14, 19, 20]
    assert [r["_line"] for r in frame.attrs["validation_rows"]] == [10, 21]
    assert frame.attrs["cut_line"] == 22
    notes = " ".join(frame.attrs["notes"])
    assert "line 22, the last metric line, is cut short" in notes and "step(s) 3 logged more than once" in notes
    assert "validation-only line(s)" in notes and "lines 10, 21" in notes


def test_the_old_key_names_and_a_validation_line_before_the_first_step():
    frame = read_step_log(OLD)
    assert frame["training/global_step"].tolist() == [0, 1, 2]          # step:0 twice: validation, then training
    assert "timing_s/update_critic" in frame.columns and not any(c.startswith("timing/") for c in frame.columns)
    assert "read as complete" in " ".join(frame.attrs["notes"])         # no final newline, but every key there
    assert job_gpus(OLD)[0] == 2.0 and job_gpus(COLOCATED)[0] == 4.0


def test_every_second_of_a_colocated_step_is_in_a_named_category():
    run = load_foreign(COLOCATED, "verl-log")
    b = bubble_breakdown(run).set_index("step")
    # step 1: gen 20 = generate_sequences 15 + reshard 2 + 3 untimed; reward 1 + adv 0.5 driver CPU; old log-probs 5,
    # actor update 10; 37 − 36.5 = 0.5 s nothing logged. Every number is a multiple of 0.5 s: the float sums are exact
    one = b.loc[1]
    assert (one[sb.GENERATION], one[sb.SWITCH], one[sb.GEN_REST]) == (15.0, 2.0, 3.0)
    assert (one[sb.DRIVER], one[sb.IDLE], one["old log-probs"], one["actor update"]) == (1.5, 0.5, 5.0, 10.0)
    # step 2 holds validation (30 s) and a checkpoint (12 s): shown apart, not idle
    two = b.loc[2]
    assert (two[sb.VALIDATION], two[sb.CHECKPOINT], two[sb.IDLE]) == (30.0, 12.0, 0.5)
    for step, row in b.iterrows():
        assert row[parts(b.reset_index())].sum() == row["step_s"], step
    # GPU-weighted idle: (driver 1.5 + nothing logged 0.5) × 4 steps over 37 + 77 + 36 + 36 = 186 s, on 4 GPUs
    idle = pool_idle(run).set_index("pool")
    assert idle.loc["overall", "idle_fraction"] == pytest.approx(8 / 186, rel=1e-12)
    assert idle.loc["overall", "idle_gpu_s"] == pytest.approx(4 * 8, rel=1e-12)
    assert run.pool_gpus["rollout_pool"] == 4.0 and run.policy == "veRL RayPPOTrainer (synchronous; colocated hybrid engine)"
    assert len(run.validation_rows) == 2


def test_the_old_format_has_no_step_time_and_says_the_breakdown_is_of_its_stages():
    run = load_foreign(OLD, "verl-log")
    b = bubble_breakdown(run)
    # step 0: gen 10 + ref 2 + values 1.5 + adv 0.25 + critic 4 + actor 5 = 22.75; step 1 generates 9 s (21.75);
    # step 2 generates 11 s and validates 6 s (29.75). Multiples of 0.25: the float sums are exact
    assert b["step_s"].tolist() == [22.75, 21.75, 29.75]
    assert b[sb.IDLE].tolist() == [0.0, 0.0, 0.0] and b[sb.VALIDATION].tolist() == [0.0, 0.0, 6.0]
    assert b["critic update"].tolist() == [4.0] * 3 and b[sb.DRIVER].tolist() == [0.25] * 3
    assert any("no timing_s/step" in n for n in run.notes)


def test_a_malformed_metric_line_is_named_by_its_line_number(tmp_path):
    text = COLOCATED.read_bytes().decode()
    lines = text.split("\n")
    lines[13] = lines[13].replace(" - timing_s/reward:1.000", " - timing_s/reward 1.000")       # no colon
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(lines))
    with pytest.raises(LogError, match=r"bad\.log, line 14: 'timing_s/reward 1\.000' is not a key:value pair"):
        read_step_log(bad)


def test_nested_keys_larger_than_gen_are_a_named_error(tmp_path):
    log = tmp_path / "nested.log"
    log.write_text("step:1 - timing_s/gen:10.000 - timing_s/generate_sequences:9.000 - timing_s/reshard:2.000 - "
                   "timing_s/step:12.000\n")
    with pytest.raises(LogError, match=r"nested\.log, line 1: timing_s/generate_sequences \+ timing_s/reshard"):
        load_foreign(log, "verl-log")


def test_rounding_within_a_millisecond_per_value_is_not_an_error_and_the_parts_still_sum():
    """veRL prints 3 decimals: each value within 0.5 ms of the truth, so n values may exceed the step by n·0.5 ms."""
    parts_, step_s, _ = sb.step_categories({"timing_s/gen": 1.0005, "timing_s/update_actor": 1.0,
                                            "timing_s/step": 2.0}, "row 0")
    assert math.isclose(sum(parts_.values()), step_s, abs_tol=1e-12) and parts_[sb.IDLE] == 0.0
    with pytest.raises(LogError, match="more than timing_s/step"):
        sb.step_categories({"timing_s/gen": 1.01, "timing_s/update_actor": 1.0, "timing_s/step": 2.0}, "row 0")


def test_the_cli_prints_the_categories_and_gpu_weighted_idle(tmp_path, capsys):
    assert main(["trace", "import", str(COLOCATED), "--format", "verl-log", "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"imported from {COLOCATED}")
    assert "validation" in text and "checkpointing" in text and "driver CPU" in text
    assert "  overall         4.3 %" in text           # 8 / 186 = 4.30 %
    assert "measured (real engines)" not in text
