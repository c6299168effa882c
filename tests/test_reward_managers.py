"""trellis.reward.managers: naive, batch and async managers on a hand-built DataProto."""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_reward_workers import (
    async_score,
    batch_score,
    length_score,
    pid_score,
    raising_score,
    sleepy_score,
)

from trellis import registries
from trellis.data.protocol import DataProto
from trellis.recipes.tiny import build_tiny_tokenizer
from trellis.reward.managers import AsyncRewardManager, BatchRewardManager, NaiveRewardManager


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def make_data(tokenizer, texts, truths, sources=None, width=None, extra_infos=None):
    """responses right-padded to ``width``, each ending in eos (a special token, skipped on decode)."""
    ids = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id] for t in texts]
    width = width or max(len(i) for i in ids) + 2
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, seq in enumerate(ids):
        responses[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    non_tensors = {
        "reward_model": [{"ground_truth": g} for g in truths],
        "data_source": sources or ["arithmetic"] * len(texts),
    }
    if extra_infos is not None:
        non_tensors["extra_info"] = extra_infos
    data = DataProto.from_dict({"responses": responses, "response_mask": mask}, non_tensors)
    return data, [len(seq) - 1 for seq in ids]


def test_naive_puts_each_score_on_the_last_valid_token(tokenizer):
    data, last = make_data(tokenizer, ["12 + 7 = 19. #### 19", "The answer is 5", "3 * 4 = 12"], [19, 6, 12])
    scores = NaiveRewardManager(tokenizer)(data)
    assert scores.dtype == torch.float32 and scores.shape == data.batch["responses"].shape
    expected = torch.zeros_like(scores)
    expected[0, last[0]] = 1.0
    expected[2, last[2]] = 1.0
    assert torch.equal(scores, expected)


def test_return_dict_carries_extra_fields_and_metrics(tokenizer):
    data, last = make_data(tokenizer, ["#### 19", "The answer is 5"], [19, 6])
    manager = NaiveRewardManager(tokenizer)
    out = manager(data, return_dict=True)
    assert out["reward_extra_info"] == {"parsed": [19, 5]}
    assert out["metrics"] == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    assert manager.last_metrics == out["metrics"]
    assert out["reward_tensor"][0, last[0]] == 1.0 and out["reward_tensor"].sum() == 1.0


def test_decoding_skips_special_tokens_and_padding(tokenizer):
    data, last = make_data(tokenizer, ["abc", "hello world"], ["", ""], width=20)
    out = NaiveRewardManager(tokenizer, compute_score=length_score)(data, return_dict=True)
    assert out["reward_tensor"][0, last[0]] == 3.0 and out["reward_tensor"][1, last[1]] == 11.0
    assert out["reward_extra_info"] == {"source": ["arithmetic", "arithmetic"]}


def test_attention_mask_over_responses_when_no_response_mask(tokenizer):
    data, last = make_data(tokenizer, ["#### 4", "#### 2 and more"], [4, 2])
    responses, mask = data.batch["responses"], data.batch["response_mask"]
    prompt = torch.ones((2, 3), dtype=torch.long)
    alt = DataProto.from_dict(
        {"responses": responses, "attention_mask": torch.cat([prompt, mask], dim=1)},
        dict(data.non_tensor_batch),
    )
    scores = NaiveRewardManager(tokenizer)(alt)
    assert scores[0, last[0]] == 1.0 and scores[1, last[1]] == 1.0 and scores.sum() == 2.0


def test_ground_truth_source_and_extra_info_reach_the_function(tokenizer):
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info=None, tag=None):
        seen.append((data_source, solution_str, ground_truth, extra_info, tag))
        return 0.5

    data, _ = make_data(tokenizer, ["hi"], ["gt"], sources=["src"], extra_infos=[{"index": 7}])
    NaiveRewardManager(tokenizer, compute_score=spy, reward_fn_key="data_source", tag="t")(data)
    assert seen == [("src", "hi", "gt", {"index": 7}, "t")]
    data.non_tensor_batch["ability"] = data.non_tensor_batch["data_source"].copy()
    data.non_tensor_batch["ability"][0] = "math"
    NaiveRewardManager(tokenizer, compute_score=spy, reward_fn_key="ability")(data)
    assert seen[-1][0] == "math"


def test_raising_scorer_counts_an_error_and_scores_zero(tokenizer, caplog):
    data, last = make_data(tokenizer, ["boom", "fine"], [0, 0])
    out = NaiveRewardManager(tokenizer, compute_score=raising_score)(data, return_dict=True)
    assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 0.0}
    assert out["reward_tensor"][0].sum() == 0.0 and out["reward_tensor"][1, last[1]] == 1.0
    assert "ZeroDivisionError: boom" in caplog.text


def test_configuration_errors_are_raised_not_counted(tokenizer):
    data, _ = make_data(tokenizer, ["x"], [0], sources=["nowhere"])
    with pytest.raises(LookupError, match=r"data_source 'nowhere'"):
        NaiveRewardManager(tokenizer)(data)


def test_missing_columns_are_named(tokenizer):
    data, _ = make_data(tokenizer, ["x"], [0])
    data.non_tensor_batch.pop("reward_model")
    with pytest.raises(ValueError, match=r"non_tensor_batch\['reward_model'\]"):
        NaiveRewardManager(tokenizer)(data)
    data, _ = make_data(tokenizer, ["x"], [0])
    with pytest.raises(ValueError, match=r"No column 'ability' \(data.reward_fn_key\)"):
        NaiveRewardManager(tokenizer, reward_fn_key="ability")(data)
    with pytest.raises(ValueError, match=r"timeout_seconds must be > 0 or None \(no limit\), got 0"):
        NaiveRewardManager(tokenizer, timeout_seconds=0)


def test_naive_runs_async_scorers_with_a_timeout(tokenizer):
    data, last = make_data(tokenizer, ["ok", "sleep"], ["ok", "x"])
    out = NaiveRewardManager(tokenizer, compute_score=async_score, timeout_seconds=0.2)(
        data, return_dict=True
    )
    assert out["reward_tensor"][0, last[0]] == 1.0
    assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 1.0}


def _hanging_score(data_source, solution_str, ground_truth, extra_info=None):
    """Hangs on 'sleep', even through `except Exception` (a plain scorer that would hang the run)."""
    if solution_str == "sleep":
        try:
            time.sleep(30)
        except Exception:
            time.sleep(30)
    return 1.0


@pytest.mark.parametrize("where", ["main thread", "worker thread"])
def test_naive_enforces_the_timeout_on_plain_scorers(tokenizer, where):
    import threading

    data, last = make_data(tokenizer, ["ok", "sleep", "ok"], ["ok", "x", "ok"])
    manager = NaiveRewardManager(tokenizer, compute_score=_hanging_score, timeout_seconds=0.3)
    box = {}

    def score():
        start = time.perf_counter()
        box["out"] = manager(data, return_dict=True)
        box["seconds"] = time.perf_counter() - start

    if where == "main thread":
        score()
    else:  # e.g. a Ray actor's thread: the call is abandoned in a thread of its own
        thread = threading.Thread(target=score)
        thread.start()
        thread.join(10)
    out = box["out"]
    assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    assert out["reward_tensor"][0, last[0]] == 1.0 and out["reward_tensor"][2, last[2]] == 1.0
    assert out["reward_tensor"][1].abs().sum() == 0.0  # the overrun scores 0
    assert box["seconds"] < 3.0  # one 0.3 s limit, not the 30 s sleep


def test_batch_manager_enforces_the_timeout_on_the_whole_call(tokenizer):
    def slow_batch(data_sources, solution_strs, ground_truths, extra_infos):
        time.sleep(30)

    data, _ = make_data(tokenizer, ["a", "b"], ["a", "b"])
    start = time.perf_counter()
    out = BatchRewardManager(tokenizer, compute_score=slow_batch, timeout_seconds=0.3)(data, return_dict=True)
    assert time.perf_counter() - start < 3.0
    assert out["metrics"] == {"reward/errors": 2.0, "reward/timeouts": 2.0}


def test_batch_manager_calls_once_with_lists(tokenizer):
    data, last = make_data(tokenizer, ["a", "b", "c"], ["a", "x", "c"])
    calls = []

    def counted(**columns):
        calls.append(columns)
        return batch_score(**columns, bonus=0.5)

    counted.__signature__ = __import__("inspect").signature(batch_score)
    out = BatchRewardManager(tokenizer, compute_score=counted)(data, return_dict=True)
    assert len(calls) == 1 and calls[0]["solution_strs"] == ["a", "b", "c"]
    assert calls[0]["data_sources"] == ["arithmetic"] * 3 and calls[0]["extra_infos"] == [None] * 3
    assert [out["reward_tensor"][i, last[i]].item() for i in range(3)] == [1.5, 0.5, 1.5]
    assert out["reward_extra_info"] == {"n": [3, 3, 3]}


def test_batch_manager_reference_kwargs_and_per_sample_fallback(tokenizer):
    data, last = make_data(tokenizer, ["#### 1", "#### 2"], [1, 3])
    ref = BatchRewardManager(tokenizer, compute_score="test_reward_workers:batch_score", bonus=1.0)
    assert ref(data)[0, last[0]] == 1.0  # no exact match, plus the bonus
    ref_data, _ = make_data(tokenizer, ["#### 1"], ["#### 1"])
    assert ref(ref_data)[0, last[0]] == 2.0
    named = BatchRewardManager(tokenizer, compute_score="gsm8k")(data)  # a per-sample function
    assert named[0, last[0]] == 1.0 and named.sum() == 1.0
    default = BatchRewardManager(tokenizer)(data, return_dict=True)
    assert default["reward_extra_info"] == {"parsed": [1, 2]}


def test_batch_manager_failure_zeroes_the_batch(tokenizer):
    def bad(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]  # one result for two samples

    data, _ = make_data(tokenizer, ["a", "b"], ["a", "b"])
    out = BatchRewardManager(tokenizer, compute_score=bad)(data, return_dict=True)
    assert out["reward_tensor"].sum() == 0.0 and out["metrics"]["reward/errors"] == 2.0


def test_async_manager_times_out_kills_and_replaces_the_pool(tokenizer):
    data, last = make_data(tokenizer, ["7", "sleep", "8"], ["7", "0", "9"])
    with AsyncRewardManager(
        tokenizer, compute_score=sleepy_score, timeout_seconds=0.5, num_workers=2
    ) as manager:
        start = time.monotonic()
        out = manager(data, return_dict=True)
        assert time.monotonic() - start < 20
        assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 1.0}
        assert out["reward_tensor"][0, last[0]] == 1.0 and out["reward_tensor"].sum() == 1.0
        assert manager._pool is None  # killed; the next call starts a fresh one
        again = manager(make_data(tokenizer, ["5"], ["5"])[0], return_dict=True)
        assert again["metrics"] == {"reward/errors": 0.0, "reward/timeouts": 0.0}
        assert again["reward_tensor"].sum() == 1.0
        pool = manager._pool
        processes = list(pool._processes.values())
        assert processes and all(p.is_alive() for p in processes)
    assert manager._pool is None
    for process in processes:
        process.join(timeout=5)
        assert not process.is_alive()


def test_calls_broken_by_another_timeout_are_retried_on_the_new_pool(tokenizer):
    # one worker sleeps forever; the other runs "slow" (0.3 s) twice, the second still running
    # when the first call's timeout (0.5 s) kills the pool: it is retried, not lost
    data, last = make_data(tokenizer, ["sleep", "slow 1", "slow 2"], ["0", "slow 1", "slow 2"])
    with AsyncRewardManager(tokenizer, compute_score=sleepy_score, timeout_seconds=0.5, num_workers=2) as m:
        out = m(data, return_dict=True)
    assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    assert out["reward_tensor"][1, last[1]] == 1.0 and out["reward_tensor"][2, last[2]] == 1.0


def test_async_manager_runs_in_worker_processes_and_counts_errors(tokenizer):
    data, last = make_data(tokenizer, ["boom", "fine", "x"], [0, 0, 0])
    with AsyncRewardManager(tokenizer, compute_score=raising_score, num_workers=1) as manager:
        out = manager(data, return_dict=True)
        assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 0.0}
        assert out["reward_tensor"][1, last[1]] == 1.0 and out["reward_tensor"].sum() == 2.0
    with AsyncRewardManager(tokenizer, compute_score=pid_score) as manager:
        out = manager(data, return_dict=True)
        assert set(out["reward_extra_info"]["pid"]) != {os.getpid()}


def test_async_manager_resolves_names_in_workers_and_raises_config_errors(tokenizer):
    data, _ = make_data(tokenizer, ["it is 5", "#### 6"], [5, 6], sources=["gsm8k", "gsm8k"])
    with AsyncRewardManager(tokenizer, method="flexible") as manager:  # default dispatcher + kwargs
        assert manager(data).sum() == 2.0
        bad, _ = make_data(tokenizer, ["x"], [0], sources=["nowhere"])
        with pytest.raises(LookupError, match=r"data_source 'nowhere'"):
            manager(bad)


def test_async_manager_async_scorer_runs_on_the_loop(tokenizer):
    data, last = make_data(tokenizer, ["ok", "sleep", "ok"], ["ok", "x", "no"])
    manager = AsyncRewardManager(tokenizer, compute_score=async_score, timeout_seconds=0.3)
    start = time.monotonic()
    out = manager(data, return_dict=True)
    assert time.monotonic() - start < 3
    assert out["metrics"] == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    assert out["reward_tensor"][0, last[0]] == 1.0 and out["reward_tensor"].sum() == 1.0
    assert manager._pool is None  # no processes for async scorers


def test_async_manager_rejects_unpicklable_functions(tokenizer):
    with pytest.raises(ValueError, match=r"cannot be sent to worker processes.*module level"):
        AsyncRewardManager(tokenizer, compute_score=lambda **kw: 1.0)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("naive", NaiveRewardManager), ("batch", BatchRewardManager), ("async", AsyncRewardManager)],
)
def test_managers_round_trip_through_the_registry(name, cls, tokenizer):
    assert registries.reward_managers.get(name) is cls
    data, last = make_data(tokenizer, ["#### 3"], [3])
    with contextlib_closing(registries.reward_managers.get(name)(tokenizer)) as manager:
        assert manager(data)[0, last[0]] == 1.0


def contextlib_closing(manager):
    import contextlib

    return contextlib.closing(manager) if hasattr(manager, "close") else contextlib.nullcontext(manager)


def test_managers_work_when_called_from_inside_an_event_loop(tokenizer):
    import asyncio

    data, last = make_data(tokenizer, ["ok", "no"], ["ok", "x"])

    async def trainer_step():
        naive = NaiveRewardManager(tokenizer, compute_score=async_score)(data)
        with AsyncRewardManager(tokenizer, compute_score=sleepy_score) as manager:
            pooled = manager(data)
        return naive, pooled

    naive, pooled = asyncio.run(trainer_step())
    assert naive[0, last[0]] == 1.0 and naive.sum() == 1.0
    assert torch.equal(naive, pooled)
