"""trellis.reward.resolve: reward.function as a name, a reference, a file, a callable or null."""

from __future__ import annotations

import functools

import pytest

from trellis import registries
from trellis.errors import ProtocolMismatchError, UnknownComponentError
from trellis.reward import builtin, resolve_reward_function


def call(fn, solution, truth, data_source="t", extra_info=None):
    return fn(data_source=data_source, solution_str=solution, ground_truth=truth, extra_info=extra_info)


def test_none_is_the_data_source_dispatcher():
    fn = resolve_reward_function(None)
    assert fn is builtin.default_compute_score
    assert call(fn, "#### 5", "5", data_source="gsm8k") == 1.0


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("gsm8k", builtin.gsm8k_score),
        ("math", builtin.math_score),
        ("exact_match", builtin.exact_match_score),
        ("arithmetic", builtin.arithmetic_score),
        ("format", builtin.format_score),
    ],
)
def test_builtin_names_round_trip_through_the_registry(name, target):
    assert name in registries.reward_functions.names()
    assert registries.reward_functions.get(name) is target
    assert resolve_reward_function(name) is target


def test_kwargs_are_bound():
    fn = resolve_reward_function("gsm8k", method="flexible")
    assert isinstance(fn, functools.partial) and fn.keywords == {"method": "flexible"}
    assert call(fn, "it is 5", "5") == 1.0
    assert call(resolve_reward_function("gsm8k"), "it is 5", "5") == 0.0
    assert call(resolve_reward_function(None, method="flexible"), "it is 5", "5", data_source="gsm8k") == 1.0


def test_module_reference_and_file_reference(tmp_path, monkeypatch):
    assert resolve_reward_function("trellis.reward.builtin:math_score") is builtin.math_score
    (tmp_path / "my_reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str == ground_truth) + bonus\n"
    )
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward_function("./my_reward.py:score", bonus=0.5)
    assert call(fn, "a", "a") == 1.5 and call(fn, "a", "b") == 0.5


def test_callable_passes_through():
    def mine(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    assert resolve_reward_function(mine) is mine
    assert call(resolve_reward_function(lambda **kw: kw["ground_truth"]), "x", 3) == 3


def test_bad_names_and_values_are_explained():
    with pytest.raises(
        UnknownComponentError, match=r"Unknown reward function 'gsm9k'.*Closest match: 'gsm8k'"
    ):
        resolve_reward_function("gsm9k")
    with pytest.raises(ProtocolMismatchError, match=r"does not fit the reward function protocol"):
        resolve_reward_function("trellis.reward.builtin:normalize_number")
    with pytest.raises(TypeError, match=r"got int 3"):
        resolve_reward_function(3)


def test_in_process_registration_resolves_by_name():
    @registries.register_reward_function("test_reward_resolve_const")
    def const(data_source, solution_str, ground_truth, extra_info=None):
        return 0.75

    try:
        assert call(resolve_reward_function("test_reward_resolve_const"), "x", "y") == 0.75
    finally:
        registries.reward_functions.unregister("test_reward_resolve_const")
