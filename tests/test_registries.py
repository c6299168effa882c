"""trellis.registries: the named registries, resolved through the fixture plugins' entry points."""

from __future__ import annotations

import json

import pytest
import torch

from trellis import registries
from trellis.errors import (
    DuplicateComponentError,
    PluginLoadError,
    ProtocolMismatchError,
    UnknownComponentError,
)
from trellis.registries import get_adv_estimator_fn, get_registry

DESIGN_TABLE = [
    "rollout_replicas",
    "agent_loops",
    "tools",
    "reward_functions",
    "reward_managers",
    "advantage_estimators",
    "policy_losses",
    "device_backends",
    "checkpoint_engines",
    "training_engines",
    "trackers",
    "replay_pools",
]


def test_one_registry_per_kind_bound_to_its_group():
    assert list(registries.ALL) == DESIGN_TABLE
    for short, registry in registries.ALL.items():
        assert registry.group == f"trellis.{short}"
        assert getattr(registries, short) is registry
        assert get_registry(short) is registry and get_registry(f"trellis.{short}") is registry


def test_unknown_registry_names_the_closest():
    with pytest.raises(
        UnknownComponentError,
        match=r"Unknown registry 'tool'\. Registries: rollout_replicas,.*"
        r"Closest match: 'tools'\.",
    ):
        get_registry("tool")


def test_discovery_lists_fixture_names_with_their_providers():
    adv = registries.advantage_estimators
    assert {"fixture_returns", "fixture_broken", "fixture_misfit"} <= set(adv.names())
    rows = {(e.name, e.provider, e.version, e.target) for e in adv.entries()}
    assert (
        "fixture_returns",
        "trellis-fixture-good",
        "0.1.0",
        "trellis_fixture_good.adv:reward_to_go",
    ) in rows
    assert (
        "fixture_broken",
        "trellis-fixture-broken",
        "0.2.0",
        "trellis_fixture_broken.needs_missing:advantage",
    ) in rows
    # the colliding name is listed once per provider
    exact = [e.provider for e in registries.reward_functions.entries() if e.name == "fixture_exact"]
    assert exact == ["trellis-fixture-broken", "trellis-fixture-good"]


def test_core_builtins_come_through_the_same_entry_points():
    (entry,) = [e for e in registries.trackers.entries() if e.name == "jsonl"]
    assert (entry.provider, entry.target) == ("trellis-rl", "trellis.trackers.jsonl:JsonlTracker")
    from trellis.trackers.jsonl import JsonlTracker

    assert registries.trackers.get("jsonl") is JsonlTracker


def test_loaded_component_computes(tmp_path):
    fn = get_adv_estimator_fn("fixture_returns")
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    advantages, returns = fn(rewards, mask, index=None, config=None)
    assert torch.equal(advantages, torch.tensor([[1.0, 1.0, 1.0, 0.0], [3.0, 2.0, 0.0, 0.0]]))
    assert torch.equal(returns, advantages)
    assert [e.loaded for e in registries.advantage_estimators.entries() if e.name == "fixture_returns"] == [
        True
    ]


def test_listing_imports_nothing_and_get_imports_only_what_is_asked(python):
    done = python(
        "import sys, json\n"
        "from trellis import registries\n"
        "names = registries.advantage_estimators.names()\n"
        "before = [m for m in sys.modules if m.startswith('trellis_fixture') or m == 'torch']\n"
        "registries.reward_functions.entries()\n"
        "fn = registries.advantage_estimators.get('fixture_returns')\n"
        "after = sorted(m for m in sys.modules if m.startswith('trellis_fixture'))\n"
        "print(json.dumps({'names': names, 'before': before, 'after': after}))\n"
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "fixture_returns" in out["names"]
    assert out["before"] == []
    assert out["after"] == ["trellis_fixture_good", "trellis_fixture_good.adv"]


def test_names_resolve_in_a_fresh_subprocess(python):
    done = python(
        "from trellis.registries import get_adv_estimator_fn, reward_functions\n"
        "import torch\n"
        "fn = get_adv_estimator_fn('fixture_returns')\n"
        "adv, _ = fn(torch.ones(1, 3), torch.ones(1, 3))\n"
        "print(fn.__module__, adv.tolist())\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trellis_fixture_good.adv [[3.0, 2.0, 1.0]]"


def test_broken_plugin_fails_only_its_own_name():
    adv = registries.advantage_estimators
    with pytest.raises(PluginLoadError) as info:
        adv.get("fixture_broken")
    message = str(info.value)
    assert message.startswith(
        "Advantage estimator 'fixture_broken' could not be loaded from distribution "
        "'trellis-fixture-broken 0.2.0' (entry point 'fixture_broken = "
        "trellis_fixture_broken.needs_missing:advantage' in group 'trellis.advantage_estimators'): "
        "ModuleNotFoundError: No module named 'trellis_fixture_missing_dependency'."
    )
    assert "fix or uninstall 'trellis-fixture-broken'" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    # ...while every other name of the same registry, and of the same distribution's other
    # groups, still works.
    assert adv.get("fixture_returns").__name__ == "reward_to_go"
    assert "fixture_broken" in adv.names()


def test_two_distributions_providing_one_name():
    with pytest.raises(DuplicateComponentError) as info:
        registries.reward_functions.get("fixture_exact")
    message = str(info.value)
    assert message.startswith("Reward function 'fixture_exact' is provided by more than one distribution: ")
    assert (
        "distribution 'trellis-fixture-broken 0.2.0' (entry point 'fixture_exact = "
        "trellis_fixture_broken.rewards:exact_match'" in message
    )
    assert (
        "distribution 'trellis-fixture-good 0.1.0' (entry point 'fixture_exact = "
        "trellis_fixture_good.rewards:exact_match'" in message
    )
    assert "Uninstall one of them" in message


def test_in_process_replace_settles_a_collision():
    reward_functions = registries.reward_functions
    with pytest.raises(
        DuplicateComponentError, match=r"already registered by distribution 'trellis-fixture-"
    ):
        reward_functions.register("fixture_exact", lambda **kw: 0.0)
    from trellis_fixture_good.rewards import exact_match

    try:
        reward_functions.register("fixture_exact", exact_match, replace=True)
        score = reward_functions.get("fixture_exact")
        assert score(data_source="t", solution_str=" 42 ", ground_truth=42) == 1.0
        providers = [e.provider for e in reward_functions.entries() if e.name == "fixture_exact"]
        assert providers == ["(in-process)", "trellis-fixture-broken", "trellis-fixture-good"]
    finally:
        reward_functions.unregister("fixture_exact")
    with pytest.raises(DuplicateComponentError):
        reward_functions.get("fixture_exact")


def test_plugin_component_that_does_not_fit_its_protocol():
    with pytest.raises(ProtocolMismatchError) as info:
        get_adv_estimator_fn("fixture_misfit")
    message = str(info.value)
    assert message.startswith(
        "Advantage estimator 'fixture_misfit' (trellis_fixture_broken.misfit:one_argument from "
        "trellis-fixture-broken) does not fit the advantage estimator protocol: its signature "
        "one_argument(token_level_rewards) cannot be called that way"
    )
    assert message.endswith(
        "Expected fn(token_level_rewards, response_mask, *, index=None, config=None, **needs) "
        "-> (advantages, returns)."
    )
    with pytest.raises(ProtocolMismatchError) as info:
        registries.tools.get("fixture_halftool")
    assert (
        "does not fit the tool protocol: method 'create' is missing; method 'execute' must be "
        "'async def'; method 'calc_reward' is missing; method 'release' is missing."
    ) in str(info.value)


def test_unknown_name_in_a_named_registry():
    with pytest.raises(UnknownComponentError) as info:
        get_adv_estimator_fn("fixture_retruns")
    message = str(info.value)
    assert message.startswith("Unknown advantage estimator 'fixture_retruns'. Available: ")
    available = message.split("Available: ")[1].split(". Closest")[0].split(", ")
    assert available == sorted(available) and {"fixture_broken", "fixture_returns"} <= set(available)
    assert "Closest match: 'fixture_returns'." in message


def test_accessor_decorators_register_in_process():
    @registries.register_policy_loss("test_vanilla")
    def vanilla(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
        global_batch_info=None,
    ):
        """-A * ratio, token mean."""
        ratio = torch.exp(log_prob - old_log_prob)
        loss = -(advantages * ratio * response_mask).sum() / response_mask.sum()
        return loss, {}

    @registries.register_adv_est("test_constant")
    def constant(token_level_rewards, response_mask, *, index=None, config=None, **extra):
        """All-ones advantages."""
        return response_mask, response_mask

    try:
        assert registries.get_policy_loss_fn("test_vanilla") is vanilla
        assert get_adv_estimator_fn("test_constant") is constant
        loss, _ = vanilla(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
        assert loss.item() == -1.0
        with pytest.raises(ProtocolMismatchError):
            registries.register_policy_loss("test_short")(lambda old_log_prob, log_prob: 0)
    finally:
        registries.policy_losses.unregister("test_vanilla")
        registries.advantage_estimators.unregister("test_constant")


def test_components_declare_what_they_need():
    @registries.register_adv_est("test_needs_values", requires=("values", "groups"))
    def with_values(token_level_rewards, response_mask, *, index=None, config=None, values=None):
        return values, values

    try:
        fn = get_adv_estimator_fn("test_needs_values")
        assert fn is with_values and registries.needs_of(fn) == {"values", "groups"}
    finally:
        registries.advantage_estimators.unregister("test_needs_values")

    @registries.requires("ref_log_prob")  # the entry-point form: an attribute the function carries
    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None, global_batch_info=None, ref_log_prob=None):  # fmt: skip
        return log_prob.sum(), {}

    assert loss.requires == frozenset({"ref_log_prob"}) and registries.needs_of(loss) == {"ref_log_prob"}
    assert registries.needs_of(lambda: None) == frozenset()  # declares nothing
    assert registries.needs_of(get_adv_estimator_fn("gae")) == {"values"}
    assert registries.needs_of(get_adv_estimator_fn("remax")) == {"reward_baselines"}
    with pytest.raises(
        ValueError, match=r"names the unknown need 'value'; needs: values, .* Did you mean 'values'\?"
    ):
        registries.requires("value")
    with pytest.raises(ValueError, match=r"names the unknown need 'critic'"):
        registries.register_adv_est("test_bad_need", requires=("critic",))
    assert "test_bad_need" not in registries.advantage_estimators

    def odd():
        pass

    odd.requires = "values"  # a string, not a tuple of names
    with pytest.raises(ValueError, match=r"declares requires='values'; it must be a tuple of names"):
        registries.needs_of(odd, "advantage estimator")


def test_rollout_replica_accessor_resolves_references(tmp_path, monkeypatch):
    (tmp_path / "replica.py").write_text(
        "class EchoReplica:\n"
        "    '''Echoes the prompt.'''\n"
        "    async def init(self, *a, **k): ...\n"
        "    async def generate(self, prompt_ids, sampling_params, request_id): return prompt_ids\n"
        "    async def sleep(self): ...\n"
        "    async def wake_up(self): ...\n"
        "    async def update_weights(self, named_tensors): ...\n"
    )
    monkeypatch.chdir(tmp_path)
    cls = registries.get_rollout_replica_class("replica.py:EchoReplica")
    assert cls.__name__ == "EchoReplica"
    with pytest.raises(UnknownComponentError, match=r"Unknown rollout replica 'tensorrt'\. Available: "):
        registries.get_rollout_replica_class("tensorrt")
