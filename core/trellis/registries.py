"""The named registries: one per component kind, each bound to its entry-point group.

A third-party package adds a component by declaring an entry point, e.g. in its
``pyproject.toml``::

    [project.entry-points."trellis.advantage_estimators"]
    my_adv = "my_package.adv:my_advantage"

and users select it by name (``algorithm.adv_estimator=my_adv``). The core registers its own
built-ins the same way. Each registry checks what it loads against the protocol below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from trellis.protocols import CallableProtocol, ClassProtocol
from trellis.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])

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
        "fn(token_level_rewards, response_mask, *, index=None, config=None, **needs) "
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
        "config=None, rollout_is_weights=None, global_batch_info=None, **needs) -> (loss, metrics)",
        positional=("old_log_prob", "log_prob", "advantages", "response_mask"),
        keywords=("loss_agg_mode", "config", "rollout_is_weights", "global_batch_info"),
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
        "a TrainingEngine class with forward, forward_backward, optimizer_step, zero_grad, to, phase, "
        "state_dict, load_state_dict and iter_full_params",
        methods=(
            "forward",
            "forward_backward",
            "optimizer_step",
            "zero_grad",
            "to",
            "phase",
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

replay_pools: Registry[type] = Registry(
    "replay pool",
    "trellis.replay_pools",
    ClassProtocol(
        "a ReplayPool class (trellis.replay.ReplayPool) with add, sample, drop_stale, save, load, __len__ "
        "and capacity",
        methods=("add", "sample", "drop_stale", "save", "load", "__len__"),
        attributes=("capacity",),
    ),
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
    "replay_pools": replay_pools,
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


def register_adv_est(name: str, *, requires: Iterable[str] = (), replace: bool = False) -> Callable[[F], F]:
    """Decorator: ``@register_adv_est("my_adv", requires=("values",))`` registers an advantage
    estimator in-process, declaring what it needs (names in :data:`NEEDS`; see :func:`requires`)."""
    return _register_with_needs(advantage_estimators, name, requires, replace)


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    """The policy loss registered as ``name`` (or a ``module:fn`` reference)."""
    return policy_losses.get(name)


def register_policy_loss(
    name: str, *, requires: Iterable[str] = (), replace: bool = False
) -> Callable[[F], F]:
    """Decorator: ``@register_policy_loss("my_loss", requires=("ref_log_prob",))`` registers a policy
    loss in-process, declaring what it needs (names in :data:`NEEDS`; see :func:`requires`)."""
    return _register_with_needs(policy_losses, name, requires, replace)


def _register_with_needs(
    registry: Registry[Callable[..., Any]], name: str, needs: Iterable[str], replace: bool
) -> Callable[[F], F]:
    declare = requires(*needs)

    def decorate(fn: F) -> F:
        registry.register(name, declare(fn), replace=replace)
        return fn

    return decorate


# ---------------------------------------------------------------- what a component needs

NEEDS: dict[str, str] = {
    "values": "the critic's value of each response token, values= (bs, T); the run trains a critic",
    "groups": "several responses to each prompt, compared through index= (the prompt uid); rollout.n >= 2",
    "reward_baselines": "the reward of a greedy response to each sample's prompt, reward_baselines= (bs,); "
    "the trainer generates and scores it every step",
    "ref_log_prob": "the reference policy's log-prob of each response token, ref_log_prob= (bs, T); the run "
    "keeps a reference model",
    "old_log_probs": "the log-probs of the policy before the update, old_log_probs= (bs, T), from their own "
    "forward pass even when the update is on-policy",
    "rollout_log_probs": "the rollout replica's log-prob of each sampled token, rollout_log_probs= (bs, T); "
    "rollout.calculate_log_probs must be true",
}
"""What an advantage estimator or a policy loss may declare it needs, and what the run then provides.

Every need except ``groups`` is also a keyword argument the component is called with, and only the
components that declare it get it: an estimator is called with exactly the inputs it declares."""


def requires(*needs: str) -> Callable[[F], F]:
    """Decorator: declare what an estimator or policy loss needs, as its ``requires`` attribute.

    This is the entry-point form of ``register_adv_est(name, requires=...)``: a function published
    through ``trellis.advantage_estimators`` carries its needs with it::

        @requires("values")
        def my_estimator(token_level_rewards, response_mask, *, index=None, config=None, values=None): ...

    Raises:
        ValueError: a name that is not in :data:`NEEDS`.
    """
    declared = _check_needs(needs, "requires()")

    def declare(fn: F) -> F:
        setattr(fn, "requires", declared)  # noqa: B010 - mypy: a function has no declared attribute
        return fn

    return declare


def needs_of(component: Any, kind: str = "component") -> frozenset[str]:
    """The needs ``component`` declares (its ``requires`` attribute; none when absent).

    Raises:
        ValueError: ``requires`` is not a collection of names in :data:`NEEDS` (the message names the
            component, the bad name and the known ones).
    """
    declared = getattr(component, "requires", ())
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        raise ValueError(
            f"The {kind} {_name_of(component)} declares requires={declared!r}; it must be a tuple of names "
            f"among {sorted(NEEDS)}, e.g. ('values',)."
        )
    return _check_needs(tuple(declared), f"the {kind} {_name_of(component)}")


def _check_needs(needs: tuple[Any, ...], who: str) -> frozenset[str]:
    for need in needs:
        if need not in NEEDS:
            import difflib

            close = difflib.get_close_matches(str(need), list(NEEDS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{who} names the unknown need {need!r}; needs: {', '.join(NEEDS)}.{hint}")
    return frozenset(needs)


def _name_of(component: Any) -> str:
    return f"{getattr(component, '__module__', '?')}:{getattr(component, '__qualname__', repr(component))}"


def register_reward_function(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_reward_function("my_score")`` registers a reward function in-process."""
    return reward_functions.register(name, replace=replace)


def register_tool(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator: ``@register_tool("my_tool")`` registers a tool class in-process."""
    return tools.register(name, replace=replace)
