"""The named registries: one per component kind, each bound to its entry-point group.

A third-party package adds a component by declaring an entry point, e.g. in its
``pyproject.toml``::

    [project.entry-points."trellis.advantage_estimators"]
    my_adv = "my_package.adv:my_advantage"

and users select it by name (``algorithm.adv_estimator=my_adv``). The core registers its own
built-ins the same way. Each registry checks what it loads against the protocol below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trellis.protocols import CallableProtocol, ClassProtocol
from trellis.registry import Registry

rollout_replicas: Registry[type] = Registry(
    "rollout replica",
    "trellis.rollout_replicas",
    ClassProtocol(
        "a RolloutReplica class with async init, generate, sleep, wake_up and update_weights",
        async_methods=("init", "generate", "sleep", "wake_up", "update_weights"),
    ),
)
agent_loops: Registry[type] = Registry(
    "agent loop",
    "trellis.agent_loops",
    ClassProtocol(
        "an AgentLoop class with 'async def run(self, sampling_params, **sample)'", async_methods=("run",)
    ),
)
tools: Registry[type] = Registry(
    "tool",
    "trellis.tools",
    ClassProtocol(
        "a BaseTool class with get_openai_tool_schema and async create, execute, calc_reward, release",
        methods=("get_openai_tool_schema",),
        async_methods=("create", "execute", "calc_reward", "release"),
    ),
)
reward_functions: Registry[Callable[..., Any]] = Registry(
    "reward function",
    "trellis.reward_functions",
    CallableProtocol(
        "score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict",
        keywords=("data_source", "solution_str", "ground_truth", "extra_info"),
    ),
)
reward_managers: Registry[type] = Registry(
    "reward manager",
    "trellis.reward_managers",
    ClassProtocol(
        "a reward-manager class whose instances are called with a DataProto", methods=("__call__",)
    ),
)
advantage_estimators: Registry[Callable[..., Any]] = Registry(
    "advantage estimator",
    "trellis.advantage_estimators",
    CallableProtocol(
        "fn(token_level_rewards, response_mask, *, index=None, config=None, **extra) "
        "-> (advantages, returns)",
        positional=("token_level_rewards", "response_mask"),
        keywords=("index", "config"),
    ),
)
policy_losses: Registry[Callable[..., Any]] = Registry(
    "policy loss",
    "trellis.policy_losses",
    CallableProtocol(
        "fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode='token-mean', "
        "config=None, rollout_is_weights=None) -> (loss, metrics)",
        positional=("old_log_prob", "log_prob", "advantages", "response_mask"),
        keywords=("loss_agg_mode", "config", "rollout_is_weights"),
    ),
)
device_backends: Registry[type] = Registry(
    "device backend",
    "trellis.device_backends",
    ClassProtocol(
        # The structural minimum that `trellis doctor` and selection rely on; the whole interface
        # (trellis.device.DeviceBackend) is checked by trellis.testing.DeviceBackendContract.
        "a DeviceBackend class (trellis.device.DeviceBackend) with name, priority, communication_backend, "
        "is_available(), device_count(), current_device(), set_device(i), synchronize(), empty_cache()",
        methods=(
            "is_available",
            "device_count",
            "current_device",
            "set_device",
            "synchronize",
            "empty_cache",
        ),
        attributes=("name", "priority", "communication_backend"),
    ),
)
checkpoint_engines: Registry[type] = Registry(
    "checkpoint engine",
    "trellis.checkpoint_engines",
    ClassProtocol(
        "a CheckpointEngine class with prepare, build_topology, init_process_group, finalize and "
        "async send_weights / receive_weights",
        methods=("prepare", "build_topology", "init_process_group", "finalize"),
        async_methods=("send_weights", "receive_weights"),
    ),
)
training_engines: Registry[type] = Registry(
    "training engine",
    "trellis.training_engines",
    ClassProtocol(
        "a TrainingEngine class with forward, forward_backward, optimizer_step, zero_grad, to, "
        "state_dict, load_state_dict and iter_full_params",
        methods=(
            "forward",
            "forward_backward",
            "optimizer_step",
            "zero_grad",
            "to",
            "state_dict",
            "load_state_dict",
            "iter_full_params",
        ),
    ),
)
trackers: Registry[type] = Registry(
    "tracker",
    "trellis.trackers",
    ClassProtocol("a Tracker class with log(metrics, step) and finish()", methods=("log", "finish")),
)

ALL: dict[str, Registry[Any]] = {
    "rollout_replicas": rollout_replicas,
    "agent_loops": agent_loops,
    "tools": tools,
    "reward_functions": reward_functions,
    "reward_managers": reward_managers,
    "advantage_estimators": advantage_estimators,
    "policy_losses": policy_losses,
    "device_backends": device_backends,
    "checkpoint_engines": checkpoint_engines,
    "training_engines": training_engines,
    "trackers": trackers,
}
"""Every registry by its short name (the entry-point group without the ``trellis.`` prefix)."""


def get_registry(name_or_group: str) -> Registry[Any]:
    """A registry by short name (``tools``) or entry-point group (``trellis.tools``).

    Raises:
        UnknownComponentError: no registry has that name.
    """
    from trellis.errors import UnknownComponentError

    short = name_or_group.removeprefix("trellis.")
    if short in ALL:
        return ALL[short]
    import difflib

    closest = difflib.get_close_matches(short, list(ALL), n=1, cutoff=0.0)
    raise UnknownComponentError(
        f"Unknown registry {name_or_group!r}. Registries: {', '.join(ALL)}. Closest match: {closest[0]!r}.",
        name=name_or_group,
        available=list(ALL),
        closest=closest[0],
    )


# ---------------------------------------------------------------- accessors RL users know


def get_rollout_replica_class(name: str) -> type:
    """The rollout replica class registered as ``name`` (or a ``module:Class`` reference)."""
    return rollout_replicas.get(name)


def get_adv_estimator_fn(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (or a ``module:fn`` reference)."""
    return advantage_estimators.get(name)


def register_adv_est(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_adv_est("my_adv")`` registers an advantage estimator in-process."""
    return advantage_estimators.register(name, replace=replace)


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    """The policy loss registered as ``name`` (or a ``module:fn`` reference)."""
    return policy_losses.get(name)


def register_policy_loss(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_policy_loss("my_loss")`` registers a policy loss in-process."""
    return policy_losses.register(name, replace=replace)


def register_reward_function(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_reward_function("my_score")`` registers a reward function in-process."""
    return reward_functions.register(name, replace=replace)


def register_tool(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_tool("my_tool")`` registers a tool class in-process."""
    return tools.register(name, replace=replace)
