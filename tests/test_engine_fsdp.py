"""FSDPEngine: two gloo processes on a split global batch against one ``single`` process on all of it.

Both runs must agree on the forward outputs, the loss, the gradient norm and every updated
weight (to 1e-5), for ``token-mean`` and ``seq-mean-token-mean`` aggregation with gradient
accumulation, for packed sequences with dynamic micro-batches on unevenly split shares (one
rank then runs zero-weight dummy micro-batches), and for a critic. The two processes also check
that a sharded ``state_dict`` saved and loaded into fresh engines resumes bit-identically, and
that only rank 0 reads the checkpoint: rank 1 builds its model on the meta device and ends with
exactly the weights and buffers a ``single`` engine loads (actor, critic, FSDP's CPU offload).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from unittest import mock

import pytest
import torch
from _spawn import init_gloo, load_results, run_ranks
from test_engine_base import make_batch, policy_loss_fn, value_loss_fn

from trellis.config.schema import ActorConfig, CriticConfig, ModelConfig, OffloadConfig, OptimConfig

WORLD = 2
GLOBAL_BATCH = 8

# name -> (role, loss mode, packed, token budget or None, rows of rank 0 (rank 1: the rest), model settings)
CASES = {
    "token-mean": ("actor", "token-mean", False, None, 4, {}),
    "seq-mean-token-mean": ("actor", "seq-mean-token-mean", False, None, 4, {}),
    "packed-dynamic-uneven": ("actor", "token-mean", True, 20, 6, {}),
    "critic": ("critic", "token-mean", True, None, 4, {}),
    "checkpointed": ("actor", "token-mean", True, None, 4, {"gradient_checkpointing": True}),
    "bfloat16": ("actor", "token-mean", True, None, 4, {"dtype": "bfloat16"}),
}
TOLERANCE = {"bfloat16": 5e-2}  # FSDP casts the weights, single autocasts the ops: close, not equal
LR = 1e-2

# name -> (case of CASES, offload.param and offload.optimizer): engines whose loaded state is compared
LOAD_CASES = {
    "actor": ("token-mean", False),
    "critic": ("critic", False),
    "actor-offload": ("token-mean", True),
    "critic-offload": ("critic", True),
}
ENGINES_PER_WORKER = len(CASES) + 2 + len(LOAD_CASES)  # the resume check builds two


def _build(engine_cls, path, case, offload=False, **kwargs):
    role, _, packed, budget, _, settings = CASES[case]
    model = ModelConfig(path=path, use_remove_padding=packed, **{"dtype": "float32", **settings})
    section = CriticConfig if role == "critic" else ActorConfig
    role_config = section(
        ppo_micro_batch_size_per_device=2,
        use_dynamic_bsz=budget is not None,
        max_token_len_per_micro_batch=budget or 16384,
        optim=OptimConfig(lr=LR),
        offload=OffloadConfig(param=offload, optimizer=offload),
    )
    return engine_cls(model, role_config, role=role, device="cpu", **kwargs)


def _assert_close_after_adam(actual, expected, tol, steps, msg):
    """``actual`` within ``tol`` of ``expected`` after ``steps`` AdamW steps at :data:`LR`, but for at most
    one element in a thousand, each within ``2 * LR * steps`` (or ``tol``, if larger). Adam's step is
    ``lr * m / (sqrt(v) + eps)``: where a gradient is near ``eps`` (1e-8), its rounding (the order the
    reductions sum in, which the CPU's vector width changes) moves the step by up to ``lr``; one element
    of 8192 did on an AVX2-only CPU. A wrong shard or a lost gradient moves whole rows."""
    diff = (actual - expected).abs()
    off = diff > tol
    count = int(off.sum())
    assert count <= max(1, expected.numel() // 1000), f"{msg}: {count} elements off by more than {tol}"
    assert float(diff.max()) <= max(tol, 2 * LR * steps), f"{msg}: off by {float(diff.max())}"


def _run_case(engine, case, rows):
    """One step on ``rows`` of the global batch: forward, forward_backward, optimizer_step, full params."""
    role, mode, *_ = CASES[case]
    batch = make_batch(GLOBAL_BATCH)[rows]
    outputs = engine.forward(batch)
    loss_fn = value_loss_fn if role == "critic" else policy_loss_fn(mode)
    metrics = engine.forward_backward(batch, loss_fn)
    step = engine.optimizer_step()
    params = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
    return {"outputs": outputs, "metrics": metrics, "step": step, "params": params}


def _steps(engine, rows, seeds, loss_fn=None):
    loss_fn = loss_fn or policy_loss_fn("seq-mean-token-mean")
    losses = []
    for seed in seeds:
        engine.zero_grad()
        batch = make_batch(GLOBAL_BATCH, seed=seed)[rows]
        with engine.phase(optimizer=True):
            losses.append(engine.forward_backward(batch, loss_fn)["loss"])
            engine.optimizer_step()
    return losses, {name: tensor.clone() for name, tensor in engine.iter_full_params()}


def _loaded_state(engine):
    """The engine's whole state as loaded: every state-dict entry, and every buffer (non-persistent too)."""
    state = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
    state.update({f"buffer:{name}": buf.detach().cpu().clone() for name, buf in engine.model.named_buffers()})
    return state


def _load_case(engine_cls, path, name, rows):
    """Build one of LOAD_CASES: its state as loaded, whether its embeddings are tied, then 2 steps."""
    case, offload = LOAD_CASES[name]
    engine = _build(engine_cls, path, case, offload=offload)
    model = engine.model
    tied = hasattr(model, "lm_head") and model.lm_head.weight is model.get_input_embeddings().weight
    loss_fn = value_loss_fn if CASES[case][0] == "critic" else None
    state = _loaded_state(engine)
    return {"state": state, "tied": tied, "steps": _steps(engine, rows, seeds=[0, 1], loss_fn=loss_fn)}


@contextlib.contextmanager
def _counting_from_pretrained():
    """Count ``PreTrainedModel.from_pretrained`` calls (every weight load of every model class)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"].__func__
    calls: list[str] = []

    def counted(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return original(cls, *args, **kwargs)

    with mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(counted)):
        yield calls


def _worker(rank: int, port: int, path: str, out_dir: str) -> None:
    """One rank of the two-process run; writes its results to ``out_dir/rank{rank}.pt``."""
    from trellis.engine.fsdp import FSDPEngine

    with init_gloo(rank, port, WORLD, timeout_s=90), _counting_from_pretrained() as loads:
        results = _rank_results(FSDPEngine, rank, path, out_dir)
        results["from_pretrained_calls"] = loads
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _rank_results(engine_cls, rank: int, path: str, out_dir: str) -> dict:
    results = {}
    for case, (*_, first_rows, _) in CASES.items():
        rows = list(range(first_rows)) if rank == 0 else list(range(first_rows, GLOBAL_BATCH))
        results[case] = _run_case(_build(engine_cls, path, case), case, rows)

    # resume: step, offload round trip, save this rank's shards; 2 more steps vs. a fresh engine
    rows = [rank * 4 + i for i in range(4)]
    engine = _build(engine_cls, path, "token-mean")
    _steps(engine, rows, seeds=[0])
    engine.to("cpu")
    state_file = Path(out_dir) / f"state{rank}.pt"
    torch.save(engine.state_dict(), state_file)
    expected = _steps(engine, rows, seeds=[1, 2])
    fresh = _build(engine_cls, path, "token-mean")
    fresh.load_state_dict(torch.load(state_file, weights_only=False))
    results["resume"] = {"expected": expected, "resumed": _steps(fresh, rows, seeds=[1, 2])}

    # loading: rank 0 reads the checkpoint, rank 1 receives its weights
    for name in LOAD_CASES:
        results[f"load/{name}"] = _load_case(engine_cls, path, name, rows)
    # rank 0 failing to read the weights: rank 1 must hear of it, not wait for them
    error = OSError("model.safetensors is unreadable")
    unreadable = mock.patch("trellis.engine.fsdp.load_model", side_effect=error)
    with unreadable, pytest.raises(Exception) as failed:
        _build(engine_cls, path, "token-mean")
    results["load/failure"] = f"{failed.type.__name__}: {failed.value}"
    return results


@pytest.fixture(scope="module")
def fsdp_results(tiny_model_path, tmp_path_factory):
    """Run the two ranks as fresh interpreters; their results, per rank."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    run_ranks("test_engine_fsdp", WORLD, tiny_model_path, out_dir, env={"HF_DATASETS_OFFLINE": "1"})
    return load_results(out_dir, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_matches_single(fsdp_results, tiny_model_path, case):
    from trellis.engine.single import SingleEngine

    expected = _run_case(_build(SingleEngine, tiny_model_path, case), case, list(range(GLOBAL_BATCH)))
    ranks = [results[case] for results in fsdp_results]
    tol = TOLERANCE.get(case, 1e-5)
    # forward: the ranks' shares, concatenated, are the whole batch's outputs
    for key, value in expected["outputs"].items():
        torch.testing.assert_close(torch.cat([r["outputs"][key] for r in ranks]), value, atol=tol, rtol=0)
    for r in ranks:  # every rank reports the global figures
        assert r["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], abs=tol)
        assert r["metrics"].keys() == expected["metrics"].keys()
        for key, value in expected["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, abs=tol), key
        assert r["step"]["grad_norm"] == pytest.approx(expected["step"]["grad_norm"], abs=tol)
        assert r["step"]["stepped"] and r["step"]["lr"] == expected["step"]["lr"]
        assert r["params"].keys() == expected["params"].keys()
        for name, tensor in expected["params"].items():
            _assert_close_after_adam(r["params"][name], tensor, tol, steps=1, msg=name)
    moved = [
        name
        for name, tensor in expected["params"].items()
        if not torch.equal(tensor, _initial(tiny_model_path, case)[name])
    ]
    assert len(moved) >= len(expected["params"]) - 1  # the step really changed the weights


def test_fsdp_resume_is_bit_identical(fsdp_results):
    for results in fsdp_results:
        (expected_losses, expected_params), (losses, params) = (
            results["resume"]["expected"],
            results["resume"]["resumed"],
        )
        assert losses == expected_losses
        for name, tensor in expected_params.items():
            assert torch.equal(params[name], tensor), name


_INITIAL: dict = {}


def _initial(path, case):
    role = CASES[case][0]
    if role not in _INITIAL:
        from trellis.engine.single import SingleEngine

        _INITIAL[role] = dict(_build(SingleEngine, path, case).iter_full_params())
    return _INITIAL[role]


def test_fsdp_only_rank0_reads_the_checkpoint(fsdp_results):
    rank0, rank1 = (results["from_pretrained_calls"] for results in fsdp_results)
    assert len(rank0) == ENGINES_PER_WORKER
    assert set(rank0) == {"LlamaForCausalLM", "LlamaForTokenClassification"}
    assert rank1 == []


def test_fsdp_load_failure_on_rank0_stops_every_rank(fsdp_results):
    assert [results["load/failure"] for results in fsdp_results] == [
        "OSError: model.safetensors is unreadable",
        "EngineError: fsdp rank 1: another rank of the process group failed to build the actor model; "
        "its error says why.",
    ]


@pytest.mark.parametrize("name", list(LOAD_CASES))
def test_fsdp_ranks_hold_rank0_weights(fsdp_results, tiny_model_path, name):
    """Every rank's parameters and buffers (rotary inv_freq, the critic's seeded value head) are
    exactly a single engine's; tied embeddings stay tied; 2 steps match the single engine's."""
    from trellis.engine.single import SingleEngine

    expected = _load_case(SingleEngine, tiny_model_path, name, list(range(GLOBAL_BATCH)))
    assert "buffer:model.rotary_emb.inv_freq" in expected["state"]
    assert ("score.weight" in expected["state"]) == (LOAD_CASES[name][0] == "critic")
    assert expected["tied"] == (LOAD_CASES[name][0] != "critic")
    expected_losses, expected_params = expected["steps"]
    for rank, results in enumerate(fsdp_results):
        loaded = results[f"load/{name}"]
        assert loaded["state"].keys() == expected["state"].keys()
        for key, tensor in expected["state"].items():
            assert torch.equal(loaded["state"][key], tensor), f"rank {rank}: {key}"
        assert loaded["tied"] == expected["tied"], f"rank {rank}"
        losses, params = loaded["steps"]
        assert losses == pytest.approx(expected_losses, abs=1e-5), f"rank {rank}"
        for key, tensor in expected_params.items():
            _assert_close_after_adam(params[key], tensor, 1e-5, steps=2, msg=f"rank {rank}: {key}")


@pytest.mark.parametrize("value_model", [False, True])
def test_build_meta_model_is_load_model_without_storage(tiny_model_path, value_model):
    from trellis.engine.models import build_meta_model, load_model

    config = ModelConfig(path=tiny_model_path, attn_implementation="eager")
    loaded = load_model(config, value_model=value_model)
    meta = build_meta_model(config, value_model=value_model)
    assert type(meta) is type(loaded)
    # eager on grouped heads loads as trellis_eager (trellis.engine.grouped_attention), in both
    assert meta.config._attn_implementation == loaded.config._attn_implementation == "trellis_eager"
    assert not meta.training and not loaded.training
    for (name, tensor), (meta_name, meta_tensor) in zip(
        [*loaded.named_parameters(), *loaded.named_buffers()],
        [*meta.named_parameters(), *meta.named_buffers()],
        strict=True,
    ):
        assert (meta_name, meta_tensor.shape, meta_tensor.dtype) == (name, tensor.shape, torch.float32)
        assert meta_tensor.is_meta, name
    if not value_model:
        assert meta.lm_head.weight is meta.get_input_embeddings().weight


def test_build_meta_model_refuses_a_critic_without_a_value_head_class(tmp_path):
    from transformers import CodeGenConfig

    from trellis.engine.models import build_meta_model

    CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"value head\) class for model type 'codegen', and transformers"):
        build_meta_model(ModelConfig(path=str(tmp_path)), value_model=True)
    assert type(build_meta_model(ModelConfig(path=str(tmp_path)))).__name__ == "CodeGenForCausalLM"


def test_fsdp_needs_torch_distributed(tiny_model_path):
    from trellis.engine.base import EngineError
    from trellis.engine.fsdp import FSDPEngine
    from trellis.registries import training_engines

    assert training_engines.get("fsdp") is FSDPEngine
    with pytest.raises(EngineError, match=r"call torch.distributed.init_process_group.*'single' engine"):
        _build(FSDPEngine, tiny_model_path, "token-mean")
