"""Trackers backed by optional packages: ``tensorboard``, ``wandb`` and ``mlflow``.

Each imports its package only when constructed (i.e. when selected in ``trainer.trackers``), and
says how to install it when it is missing: ``pip install 'trellis-rl[tensorboard]'`` (or
``[wandb]``, ``[mlflow]``).
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any

from trellis.config.base import schema_default
from trellis.config.schema import TrainerConfig
from trellis.trackers.base import Tracker
from trellis.utils.settings import setting


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"The {extra!r} tracker needs the {module.split('.')[0]!r} package: "
            f"pip install 'trellis-rl[{extra}]' (or remove {extra} from trainer.trackers). ({exc})"
        ) from None


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics (other values are for the jsonl log)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool | str) or value is None:
            continue
        if not isinstance(value, int | float):
            try:
                value = float(value)  # numpy / 0-d tensors
            except (TypeError, ValueError):
                continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def _run_name(config: dict[str, Any] | None) -> tuple[str, str]:
    """``(trainer.project_name, trainer.experiment_name)`` of a plain config dict (missing: the defaults)."""
    trainer = (config or {}).get("trainer", {}) or {}

    def name(key: str) -> str:
        return str(setting(trainer, key, schema_default(TrainerConfig, key)))

    return name("project_name"), name("experiment_name")


class TensorboardTracker(Tracker):
    """Scalars into ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``).

    Options:
        log_dir: where to write instead.
    """

    def __init__(
        self,
        run_dir: str,
        config: dict[str, Any] | None = None,
        *,
        log_dir: str | None = None,
        **options: Any,
    ):
        super().__init__(run_dir, config)
        tensorboard = _require("torch.utils.tensorboard", "tensorboard")
        self.log_dir = log_dir or os.path.join(run_dir, "tensorboard")
        self.writer = tensorboard.SummaryWriter(log_dir=self.log_dir)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """One Markdown table under the text tag ``val/generations``."""
        self.writer.add_text("val/generations", _markdown(samples), global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run named ``trainer.experiment_name`` in project ``trainer.project_name``.

    Options are passed to ``wandb.init`` (e.g. ``entity``, ``mode: offline``).
    """

    def __init__(self, run_dir: str, config: dict[str, Any] | None = None, **options: Any):
        super().__init__(run_dir, config)
        self.wandb = _require("wandb", "wandb")
        project, name = _run_name(config)
        options.setdefault("project", project)
        options.setdefault("name", name)
        options.setdefault("dir", run_dir)
        self.run = self.wandb.init(config=config, **options)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """A ``val/generations`` table (columns prompt, response, score)."""
        columns = ["prompt", "response", "score"]
        table = self.wandb.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
        self.run.log({"val/generations": table}, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``trainer.project_name``, named ``trainer.experiment_name``.

    Options:
        tracking_uri: where MLflow records (default: its own default, or ``MLFLOW_TRACKING_URI``).
    """

    def __init__(
        self,
        run_dir: str,
        config: dict[str, Any] | None = None,
        *,
        tracking_uri: str | None = None,
        **options: Any,
    ):
        super().__init__(run_dir, config)
        self.mlflow = _require("mlflow", "mlflow")
        if tracking_uri:
            self.mlflow.set_tracking_uri(tracking_uri)
        project, name = _run_name(config)
        self.mlflow.set_experiment(project)
        self.run = self.mlflow.start_run(run_name=name)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        # MLflow metric names may not contain some characters used here ("@"); replace them
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in _numbers(metrics).items()}, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """A table artifact ``val_generations/step_<step>.json``."""
        columns = ["prompt", "response", "score"]
        data = {c: [s.get(c) for s in samples] for c in columns}
        self.mlflow.log_table(data=data, artifact_file=f"val_generations/step_{step}.json")

    def finish(self) -> None:
        self.mlflow.end_run()


def _markdown(samples: list[dict[str, Any]]) -> str:
    """Samples as a Markdown table (pipes and newlines escaped)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    rows = ["| prompt | response | score |", "|---|---|---|"]
    rows += [
        f"| {cell(s.get('prompt'))} | {cell(s.get('response'))} | {cell(s.get('score'))} |" for s in samples
    ]
    return "\n".join(rows)
