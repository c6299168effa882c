"""Scoring functions for tests/test_reward_managers.py, in a module that imports nothing heavy: the
async manager's worker processes import it, and importing torch there would cost seconds per pool."""

from __future__ import annotations

import asyncio
import os
import time


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str)), "source": data_source}


def sleepy_score(data_source, solution_str, ground_truth, extra_info=None):
    if "sleep" in solution_str:
        time.sleep(30)
    if "slow" in solution_str:
        time.sleep(0.3)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def raising_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ZeroDivisionError("boom")
    return 1.0


def pid_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "pid": os.getpid()}


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(5 if "sleep" in solution_str else 0)
    return float(solution_str == ground_truth)


def batch_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [
        {"score": float(s == g) + bonus, "n": len(solution_strs)}
        for s, g in zip(solution_strs, ground_truths, strict=False)
    ]


def test_the_scorers_themselves():
    call = dict(data_source="d", ground_truth="7", extra_info=None)
    assert length_score(solution_str="abc", **call) == {"score": 3.0, "source": "d"}
    assert sleepy_score(solution_str=" 7", **call) == 1.0
    assert raising_score(solution_str="fine", **call) == 1.0
    assert pid_score(solution_str="", **call)["pid"] == os.getpid()
    assert asyncio.run(async_score(solution_str="7", **call)) == 1.0
    assert batch_score(["d"], ["7"], ["7"], [None]) == [{"score": 1.0, "n": 1}]
