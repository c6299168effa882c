"""What the plugin says about SGLang without importing it: availability, doctor, imports, server flags."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import socket
import subprocess
import sys

import pytest
import torch
from trellis_sglang import engine as sglang_engine
from trellis_sglang.engine import free_port, load_sglang_api, server_cli_args
from trellis_sglang.replica import SGLangRolloutReplica

from trellis.cli import main

NOT_INSTALLED = "sglang is not installed: pip install 'sglang[all]>=0.5.3' (needs CUDA)"
NO_CUDA = "CUDA is not available: SGLang runs on NVIDIA/AMD GPUs only"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.fixture
def sglang_present(monkeypatch):
    """find_spec finds an "sglang" (nothing is imported), as on a machine where it is installed."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "sglang":
            return importlib.machinery.ModuleSpec("sglang", None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture
def sglang_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "sglang" else real(name, *a, **k)
    )


def test_unavailable_without_sglang(sglang_missing):
    assert SGLangRolloutReplica.unavailable_reason() == NOT_INSTALLED
    with pytest.raises(
        ImportError, match=r"rollout\.name=sglang cannot start: sglang is not installed: pip install"
    ):
        load_sglang_api()


def test_unavailable_without_cuda(sglang_present, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from trellis.registries import device_backends

    why = device_backends.get("cuda")().unavailable_reason()  # the core backend's words, in brackets
    assert why and SGLangRolloutReplica.unavailable_reason() == f"{NO_CUDA} ({why})"
    expected = f"cannot start: {NO_CUDA} ({why}). On a CPU machine use rollout.name=hf"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        load_sglang_api()


def test_available_with_sglang_and_cuda(sglang_present, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert SGLangRolloutReplica.unavailable_reason() is None
    if not HAS_SGLANG:
        assert "sglang" not in sys.modules  # asking imported nothing


@pytest.mark.skipif(HAS_SGLANG, reason="sglang is installed here")
def test_doctor_lists_sglang_as_unavailable_with_the_reason(capsys):
    main(["doctor"])
    out = capsys.readouterr().out
    rows = [line.split(None, 3) for line in out[out.index("Rollout replicas") :].splitlines()]
    assert ["sglang", "no", "trellis-sglang", NOT_INSTALLED] in rows
    assert ["hf", "yes", "trellis-rl"] in rows


def test_importing_and_resolving_the_replica_imports_neither_sglang_nor_torch():
    code = (
        "import sys\n"
        "import trellis_sglang.replica\n"
        "from trellis.registries import get_rollout_replica_class\n"
        "from trellis.config.schema import ModelConfig, RolloutConfig\n"
        "cls = get_rollout_replica_class('sglang')\n"
        "cls(0, RolloutConfig(engine_kwargs={'server': True}), ModelConfig(path='m'))\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch'))\n"
        "cls.unavailable_reason()\n"
        "after = sorted(m for m in sys.modules if m.split('.')[0] == 'sglang')\n"
        "print(cls.__qualname__, heavy, after)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SGLangRolloutReplica [] []"


def test_server_args_become_launch_server_flags():
    args = {
        "model_path": "/m",
        "tp_size": 2,
        "mem_fraction_static": 0.5,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": False,
        "random_seed": None,
        "cuda_graph_bs": [1, 2, 4],
        "json_model_override_args": {"rope_scaling": None},
    }
    assert server_cli_args(args) == [
        "--model-path", "/m",
        "--tp-size", "2",
        "--mem-fraction-static", "0.5",
        "--enable-memory-saver",
        "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"rope_scaling": null}',
    ]  # fmt: skip


def test_free_port_is_free_on_loopback():
    port = free_port()
    with socket.socket() as sock:
        sock.bind((sglang_engine.SERVER_HOST, port))  # would raise if something listened there
    assert 1024 <= port <= 65535
