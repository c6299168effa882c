"""Trackers backed by optional packages: ``tensorboard``, ``wandb`` and ``mlflow``.

Each imports its package only when constructed (i.e. when selected in ``trainer.trackers``), and
says how to install it when it is missing: ``pip install 'trellis-rl[tensorboard]'`` (or
``[wandb]``, ``[mlflow]``).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import time
from typing import Any

from trellis.config.base import schema_default
from trellis.config.schema import TrainerConfig
from trellis.trackers.base import Tracker
from trellis.utils.settings import setting


def _require(module: str, extra: str, package: str | None = None) -> Any:
    """Import ``module``; when that fails, say which ``package`` (default: ``extra``) to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"The {extra!r} tracker needs the {package or extra!r} package: "
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
        # torch's writer; it needs the tensorboard package (its protobufs), hence the extra
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

    It talks to MLflow through an ``MlflowClient`` and the run's id, not MLflow's fluent API:
    the fluent API keeps its active run per thread (a ``log`` from another thread would start a
    second run) and its tracking URI process-wide, and refuses to start while the caller has a
    run of its own active.

    Options:
        tracking_uri: where MLflow records (default: ``MLFLOW_TRACKING_URI``, else MLflow's own
            default, ``sqlite:///mlflow.db`` in the working directory since MLflow 3; a
            ``file://`` store needs ``MLFLOW_ALLOW_FILE_STORE=true`` there).
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
        self.metric = _require("mlflow.entities", "mlflow").Metric
        self.client = self.mlflow.MlflowClient(tracking_uri=tracking_uri)
        project, name = _run_name(config)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run = self.client.create_run(experiment_id, run_name=name)
        self.run_id = self.run.info.run_id

    def log(self, metrics: dict[str, Any], step: int) -> None:
        timestamp = int(time.time() * 1000)
        batch = [
            self.metric(key=_mlflow_name(key), value=value, timestamp=timestamp, step=step)
            for key, value in _numbers(metrics).items()
        ]
        for start in range(0, len(batch), _MLFLOW_BATCH):  # MLflow takes at most 1000 a call
            self.client.log_batch(self.run_id, metrics=batch[start : start + _MLFLOW_BATCH])

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """A table artifact ``val_generations/step_<step>.json`` (MLflow's table layout: ``columns``
        and ``data`` rows). ``log_table`` needs pandas, which ``mlflow-skinny`` lacks; without it the
        same layout is written with ``log_dict``."""
        columns = ["prompt", "response", "score"]
        artifact = f"val_generations/step_{step}.json"
        try:
            importlib.import_module("pandas")
        except ImportError:
            rows = [[s.get(c) for c in columns] for s in samples]
            self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, artifact)
        else:
            data = {c: [s.get(c) for s in samples] for c in columns}
            self.client.log_table(self.run_id, data=data, artifact_file=artifact)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


_MLFLOW_BATCH = 1000


def _mlflow_name(key: str) -> str:
    """``key`` as a name MLflow accepts: ``@`` -> ``_at_`` (``val/pass@1`` -> ``val/pass_at_1``),
    any other character but letters, digits, ``_ - . /`` and spaces -> ``_`` (MLflow refuses
    them; ``:`` too, which MLflow takes except on Windows, so a run's names are the same
    everywhere), and no empty, ``.`` or ``..`` path segments (MLflow refuses names that a path
    normalisation would change)."""
    name = re.sub(r"[^\w.\- /]", "_", key.replace("@", "_at_"))
    parts = ["_" if part in (".", "..") else part for part in name.split("/") if part]
    return "/".join(parts) or "_"


def _markdown(samples: list[dict[str, Any]]) -> str:
    """Samples as a Markdown table (pipes and newlines escaped)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    rows = ["| prompt | response | score |", "|---|---|---|"]
    rows += [
        f"| {cell(s.get('prompt'))} | {cell(s.get('response'))} | {cell(s.get('score'))} |" for s in samples
    ]
    return "\n".join(rows)
