"""The demo's task generator, its reward, the ``demo`` preset and the runner (on the tiny model: the
SmolLM2 run itself is ``nox -s demo``)."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from trellis.config import load_config
from trellis.reward.builtin import default_compute_score
from trellis.trainer import demo
from trellis.trainer.demo import DATA_SOURCE, INSTRUCTION, heldout_accuracy, make_problem, make_problems


@pytest.fixture
def demo_cache(tmp_path, monkeypatch, tiny_model_path):
    """The demo preset writing into ``tmp_path`` and using the tiny model instead of SmolLM2."""
    monkeypatch.setenv("TRELLIS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("trellis.utils.demo_model.smollm2_path", lambda: tiny_model_path)
    return tmp_path


def test_problems_are_deterministic_and_seeded():
    assert make_problems(64, 32, seed=3) == make_problems(64, 32, seed=3)
    assert make_problems(64, 32, seed=3) != make_problems(64, 32, seed=4)
    train, heldout = make_problems()
    assert (len(train), len(heldout)) == (1024, 200)


def test_heldout_sums_are_distinct_and_never_trained_on():
    train, heldout = make_problems(2000, 300, seed=1)
    held = [p.key for p in heldout]
    assert len(set(held)) == 300
    assert not set(held) & {p.key for p in train}
    assert not {p.question for p in heldout} & {p.question for p in train}
    assert {p.kind for p in train} == {p.kind for p in heldout} == {"add", "sub", "mul"}
    with pytest.raises(ValueError, match="n_heldout must be between 0 and 449"):
        make_problems(10, 450)


def test_answers_are_right_and_questions_state_the_operands():
    ops = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
    train, heldout = make_problems(300, 100, seed=2)
    for p in train + heldout:
        assert p.answer == ops[p.kind](p.a, p.b) >= 0
        assert [int(n) for n in re.findall(r"\d+", p.question)] == [p.a, p.b]
        assert p.question.endswith(INSTRUCTION)
    assert len(demo.all_keys()) == len(set(demo.all_keys())) == 400 + 435 + 64
    with pytest.raises(ValueError, match="Unknown kind of problem 'div'"):
        make_problem("div", 6, 3, random.Random(0))


def test_rows_have_what_the_reward_manager_reads():
    problem = make_problem("add", 7, 5, random.Random(0))
    row = problem.row()
    assert row["prompt"] == [{"role": "user", "content": problem.question}]
    assert row["data_source"] == DATA_SOURCE == "arithmetic"
    assert row["reward_model"] == {"ground_truth": "12"}
    json.dumps(row)  # written as JSON lines


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("12", 1.0),
        ("7 + 5 = 12.", 1.0),
        ("Mia has 7 + 5 = 12 marbles.", 1.0),
        ("13", 0.0),
        ("Mia has 7 marbles and gets 5 more, so Mia has 7 +", 0.0),  # cut off before the answer
        ("twelve", 0.0),
        ("", 0.0),
    ],
)
def test_reward_scores_the_final_integer(response, score):
    result = default_compute_score(DATA_SOURCE, response, "12")
    assert result["score"] == score


def test_preset_loads_into_a_valid_config(demo_cache, tiny_model_path):
    from trellis.trainer.presets import preset_overrides

    config = load_config(None, preset_overrides("demo"))
    assert config.model.path == tiny_model_path
    assert config.trainer.test_freq == config.trainer.total_training_steps > 0
    assert config.trainer.val_before_train and config.trainer.save_freq <= 0
    assert config.rollout.val_kwargs.do_sample is False  # held-out accuracy is greedy
    (val,) = config.data.val_files
    assert str(demo_cache / "cache") in val
    with open(val, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [p.row() for p in make_problems()[1]]


def test_heldout_accuracy_reads_the_first_and_last_validation():
    validation = [(0, {"val/pass@1": 0.2}), (5, {"val/pass@1": 0.3}), (10, {"val/pass@1": 0.45})]
    assert heldout_accuracy(validation) == (0.2, 0.45)
    with pytest.raises(ValueError, match="Need validations before and after training, got 1"):
        heldout_accuracy(validation[:1])


def test_main_trains_and_reports_on_the_tiny_model(demo_cache, capsys):
    overrides = [
        "data.max_prompt_length=512",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={demo_cache / 'run'}",
    ]
    assert demo.main(overrides) == 0
    out = capsys.readouterr().out
    before = float(re.search(r"before training: +([\d.]+)%", out).group(1))
    after = float(re.search(r"after 2 GRPO steps: +([\d.]+)%", out).group(1))
    gain = float(re.search(r"gain: ([+-][\d.]+) points", out).group(1))
    assert 0 <= before <= 100 and 0 <= after <= 100 and gain == pytest.approx(after - before, abs=0.1)
    assert "Held-out accuracy (200 problems), greedy:" in out
    curve = re.search(r"Reward curve: (.+)", out).group(1)
    assert curve == str(demo_cache / "run" / "reward_curve.png") and os.path.getsize(curve) > 0
    assert re.search(r"Wall time: \d+ min \d\d s", out)


def test_format_summary():
    text = demo.format_summary(
        {"before": 0.125, "after": 0.4, "heldout": 200, "steps": 30, "seconds": 605.2,
         "reward_curve": "/r/reward_curve.png", "run_dir": "/r"}
    )  # fmt: skip
    assert text.splitlines() == [
        "Held-out accuracy (200 problems), greedy:",
        "  before training:  12.5%",
        "  after 30 GRPO steps:  40.0%",
        "  gain: +27.5 points",
        "Wall time: 10 min 05 s",
        "Reward curve: /r/reward_curve.png",
        "Run directory: /r",
    ]
