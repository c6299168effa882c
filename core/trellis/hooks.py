"""Lifecycle hooks (pluggy, project name ``trellis``).

Hooks observe and extend a run; registries provide its named parts. A hook module is a plain
module of functions marked with :data:`hookimpl`, named after the specs below::

    from trellis.hooks import hookimpl

    @hookimpl
    def trellis_step_end(step, metrics):
        print(step, metrics["reward/mean"])

It is loaded from the entry-point group ``trellis.hooks`` of any installed distribution::

    [project.entry-points."trellis.hooks"]
    my_hooks = "my_package.hooks"

A hook implementation may take any subset of a spec's arguments, by name. Hooks are called
on the driver process (the single controller), in registration order, last registered first.
"""

from __future__ import annotations

import warnings
from typing import Any

import pluggy

PROJECT = "trellis"
GROUP = "trellis.hooks"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class TrellisHookSpecs:
    """The lifecycle events of a run. Each docstring is the whole contract of its hook."""

    @hookspec
    def trellis_config_loaded(self, config: Any) -> None:
        """The merged configuration of a run is ready, before anything is built from it.

        ``config`` is the run's :class:`trellis.config.TrellisConfig` (typed dataclasses, with
        derived defaults filled in). Implementations may read it; changing it here is allowed
        and affects the run.
        """

    @hookspec
    def trellis_train_start(self, config: Any, run_dir: str) -> None:
        """Workers, datasets and replicas are built; the first step is about to run.

        ``run_dir`` is the directory the run writes its outputs to.
        """

    @hookspec
    def trellis_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """Training step ``step`` (1-based) finished; ``metrics`` maps metric names to numbers.

        Called after the trackers logged the same metrics. Must not modify ``metrics``.
        """

    @hookspec
    def trellis_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        """Validation after training step ``step`` finished (step 0: before training)."""

    @hookspec
    def trellis_checkpoint_saved(self, step: int, path: str) -> None:
        """A training checkpoint of step ``step`` was written completely to directory ``path``."""

    @hookspec
    def trellis_train_end(self, step: int, metrics: dict[str, float], run_dir: str) -> None:
        """The run ended after ``step`` steps; ``metrics`` are those of the last step.

        Called once, also when the run stops early (``step`` then tells where).
        """


class HookLoadError:
    """A hook module that failed to load: kept for ``trellis plugins check``."""

    def __init__(self, entry_point: str, distribution: str, error: BaseException):
        self.entry_point = entry_point
        self.distribution = distribution
        self.error = error

    def __str__(self) -> str:
        return (
            f"hook module '{self.entry_point}' from distribution '{self.distribution}' failed to "
            f"load: {type(self.error).__name__}: {self.error}"
        )


class TrellisPluginManager(pluggy.PluginManager):
    """A pluggy manager with the Trellis hookspecs; ``load_errors`` lists hook modules that failed."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(TrellisHookSpecs)
        self.load_errors: list[HookLoadError] = []


def new_plugin_manager(*, load_entry_points: bool = True) -> TrellisPluginManager:
    """A fresh manager with the Trellis hookspecs, hook modules loaded from ``trellis.hooks``.

    A hook module that fails to import is skipped with a warning (never breaking the run or
    other hook modules) and recorded in ``manager.load_errors``.
    """
    from trellis.registry import entry_points_of

    pm = TrellisPluginManager()
    if load_entry_points:
        for name, eps in sorted(entry_points_of(GROUP).items()):
            for ep in eps:
                dist = ep.dist.metadata["Name"] if ep.dist is not None else "(unknown)"
                try:
                    pm.register(ep.load(), name=f"{dist}:{name}")
                except Exception as exc:
                    error = HookLoadError(f"{name} = {ep.value}", dist, exc)
                    pm.load_errors.append(error)
                    warnings.warn(f"Skipping {error}. Fix or uninstall '{dist}'.", stacklevel=2)
    return pm


_manager: TrellisPluginManager | None = None


def get_plugin_manager() -> TrellisPluginManager:
    """The process-wide plugin manager, loading hook modules on first use.

    Call hooks as ``get_plugin_manager().hook.trellis_step_end(step=3, metrics={...})``
    (pluggy requires keyword arguments).
    """
    global _manager
    if _manager is None:
        _manager = new_plugin_manager()
    return _manager
