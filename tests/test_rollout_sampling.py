"""SamplingParams validation and TokenOutput defaults."""

from __future__ import annotations

import re

import pytest

from trellis.rollout import SamplingParams, TokenOutput


def test_defaults_and_normalisation():
    sp = SamplingParams(stop_token_ids=[3, 4], stop="END")
    assert sp.stop_token_ids == (3, 4) and sp.stop == ("END",)
    assert not sp.greedy and not sp.wants_logprobs
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(logprobs=0).wants_logprobs and SamplingParams(logprobs=True).wants_logprobs
    hash(sp)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0 (0 = greedy), got -0.5"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be a number >= 0, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be in (0, 1] (1 = off), got 0.0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": 0}, "top_k must be -1 (off) or a positive integer, got 0"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1, got 2.5"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids must be non-negative integers, got (1, -3)"),
        ({"stop": ["ok", ""]}, "stop must hold non-empty strings"),
        ({"seed": "x"}, "seed must be an integer or None, got 'x'"),
        ({"logprobs": -1}, "logprobs must be a bool or an integer >= 0, got -1"),
    ],
)
def test_bad_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_token_output_defaults():
    out = TokenOutput([1, 2])
    assert out.log_probs is None and out.stop_reason == "length" and out.num_preempted is None
