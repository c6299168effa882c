"""``ulysses_sequence_parallel_size``: the fsdp engine splits each packed sequence over a group of ranks.

Four gloo processes on loopback build fsdp engines with SP=2 (2 data-parallel ranks x 2) and SP=4
(1 x 4); each data-parallel rank gets its share of the global batch, every rank of a
sequence-parallel group the same share. Log-probs, entropy, values, the loss, the gradient norm
and every parameter's gradient equal a one-process ``single`` engine on the whole batch to 1e-5 in
FP32: for packed batches of uneven lengths (with sequences shorter than the group), dynamic
micro-batches, a GQA model with fewer KV heads than ranks, and the critic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _spawn import init_gloo, load_results, run_ranks
from test_engine_base import make_batch, policy_loss_fn, value_loss_fn

from trellis.config import load_config
from trellis.config.base import ConfigValueError
from trellis.config.schema import ActorConfig, CriticConfig, ModelConfig, OptimConfig, RefConfig
from trellis.engine.single import SingleEngine

WORLD = 4
GLOBAL_BATCH = 8

# name -> (model: "tiny" (2 heads, 1 KV head) | "gqa" (4 heads, 1 KV head), role, sp, token budget or None)
CASES = {
    "sp2": ("tiny", "actor", 2, None),
    "sp2-dynamic": ("tiny", "actor", 2, 20),
    "sp2-critic": ("tiny", "critic", 2, None),
    "sp2-ref": ("tiny", "ref", 2, None),
    "sp4-gqa": ("gqa", "actor", 4, None),
    "sp2-gqa": ("gqa", "actor", 2, None),
}


def _build(engine_cls, paths, case, sp=None):
    model, role, size, budget = CASES[case]
    size = size if sp is None else sp
    if role == "ref":
        role_config = RefConfig(log_prob_micro_batch_size_per_device=2, ulysses_sequence_parallel_size=size)
    else:
        role_config = (CriticConfig if role == "critic" else ActorConfig)(
            ppo_micro_batch_size_per_device=2,
            use_dynamic_bsz=budget is not None,
            max_token_len_per_micro_batch=budget or 16384,
            optim=OptimConfig(lr=1e-2),
            ulysses_sequence_parallel_size=size,
        )
    config = ModelConfig(path=paths[model], dtype="float32", use_remove_padding=True)
    return engine_cls(config, role_config, role=role, device="cpu")


def _run(engine, case, rows):
    role = CASES[case][1]
    batch = make_batch(GLOBAL_BATCH, seed=0)[rows]
    outputs = engine.forward(batch, compute_entropy=role != "critic")
    if role == "ref":
        return {"outputs": outputs}
    loss_fn = value_loss_fn if role == "critic" else policy_loss_fn("token-mean")
    metrics = engine.forward_backward(batch, loss_fn, compute_entropy=role != "critic")
    # the whole gradient (gathered from the FSDP shards; every rank in the same order)
    grads = {
        name: engine._full(p.grad).clone()
        for name, p in engine.model.named_parameters()
        if p.grad is not None
    }
    step = engine.optimizer_step()
    return {"outputs": outputs, "metrics": metrics, "step": step, "grads": grads}


def _worker(rank: int, port: int, paths: dict, out_dir: str) -> None:
    from trellis.engine.fsdp import FSDPEngine

    with init_gloo(rank, port, WORLD, timeout_s=120):
        results = {}
        for case in CASES:
            engine = _build(FSDPEngine, paths, case)
            per_dp = GLOBAL_BATCH // engine.dp_size
            rows = list(range(engine.dp_rank * per_dp, (engine.dp_rank + 1) * per_dp))
            results[case] = {"dp": (engine.dp_rank, engine.dp_size), **_run(engine, case, rows)}
        for name, sp in (("bad-size", 3), ("bad-heads", 4)):  # 3 does not divide 4 ranks; 4 not 2 heads
            try:
                _build(FSDPEngine, paths, "sp2", sp=sp)
            except ConfigValueError as exc:
                results[name] = str(exc)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def paths(tiny_model_path, tmp_path_factory):
    from trellis.recipes.tiny import save_tiny_model

    gqa = save_tiny_model(
        tmp_path_factory.mktemp("gqa"), num_attention_heads=4, head_dim=16, num_key_value_heads=1
    )
    return {"tiny": tiny_model_path, "gqa": gqa}


@pytest.fixture(scope="module")
def sp_results(paths, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sp")
    run_ranks("test_engine_sequence_parallel", WORLD, paths, out_dir, timeout=300)
    return load_results(out_dir, WORLD)


def test_the_batch_has_sequences_shorter_than_the_group():
    lengths = make_batch(GLOBAL_BATCH, seed=0).batch["attention_mask"].sum(-1)
    assert int(lengths.min()) < 4 and len(set(lengths.tolist())) > 3  # uneven, some shorter than SP=4


@pytest.mark.distributed  # its fixture runs a gloo group of WORLD processes (~30 s)
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_matches_one_process(sp_results, paths, case):
    expected = _run(_build(SingleEngine, paths, case, sp=1), case, list(range(GLOBAL_BATCH)))
    sp = CASES[case][2]
    ranks = [results[case] for results in sp_results]
    assert [r["dp"] for r in ranks] == [(rank // sp, WORLD // sp) for rank in range(WORLD)]
    for r in ranks:
        dp_rank, dp_size = r["dp"]
        per_dp = GLOBAL_BATCH // dp_size
        rows = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
        for key, value in expected["outputs"].items():  # every rank of a group gathers its rows' outputs
            torch.testing.assert_close(r["outputs"][key], value[rows], atol=1e-5, rtol=0)
        if "metrics" not in expected:  # the reference: forward passes only
            continue
        assert r["metrics"].keys() == expected["metrics"].keys()
        for key, value in expected["metrics"].items():
            assert r["metrics"][key] == pytest.approx(value, abs=1e-5), key
        assert r["step"]["grad_norm"] == pytest.approx(expected["step"]["grad_norm"], abs=1e-5)
        assert r["grads"].keys() == expected["grads"].keys() and len(expected["grads"]) >= 10
        for name, tensor in expected["grads"].items():
            torch.testing.assert_close(r["grads"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.distributed  # read from the same gloo group's run as the test above
def test_a_size_that_does_not_divide_the_ranks_or_the_heads_is_refused(sp_results):
    for r in sp_results:
        assert "actor.ulysses_sequence_parallel_size" in r["bad-size"] and "4 ranks" in r["bad-size"]
        assert "2 attention heads" in r["bad-heads"] and "4" in r["bad-heads"], r["bad-heads"]


def test_sequence_parallel_needs_fsdp_packing_and_divisible_heads(tiny_model_path):
    config = ModelConfig(path=tiny_model_path, dtype="float32", use_remove_padding=True)
    with pytest.raises(ConfigValueError, match=r"actor\.ulysses_sequence_parallel_size.*engine 'single'"):
        SingleEngine(config, ActorConfig(ulysses_sequence_parallel_size=2), role="actor", device="cpu")
    from trellis.engine.offload import OffloadEngine

    with pytest.raises(ConfigValueError, match=r"critic\.ulysses_sequence_parallel_size.*engine 'offload'"):
        OffloadEngine(config, CriticConfig(ulysses_sequence_parallel_size=2), role="critic", device="cpu")


@pytest.mark.distributed  # sequence-parallel Ray workers (~30 s)
def test_the_tiny_preset_trains_with_sequence_parallel_ray_workers(tmp_path, ray_cluster):
    """``actor.ulysses_sequence_parallel_size=2`` on 2 Ray workers (one data-parallel rank whose
    sequences are split over both): the same rewards, step by step, as the one-process run."""
    import shutil

    from test_trainer import QUICK, run

    common = [*QUICK, "trainer.total_training_steps=4", "trainer.test_freq=4"]
    local = run(tmp_path, *common, name="local")
    split = run(
        tmp_path, *common, "trainer.executor=ray", "trainer.n_devices_per_node=2", "actor.engine=fsdp",
        "actor.ulysses_sequence_parallel_size=2", name="sp",
    )  # fmt: skip
    assert split.steps == 4
    rewards = [m["reward/mean"] for m in split.history]
    assert rewards == pytest.approx([m["reward/mean"] for m in local.history], abs=1e-6)

    def val(result):
        return [(step, metrics["val/reward/mean"]) for step, metrics in result.validation]

    assert val(split) == val(local) and val(local)[-1][1] > val(local)[0][1]  # it learned, and the same
    shutil.rmtree(tmp_path / "sp", ignore_errors=True)


def test_the_reference_follows_the_actors_size():
    config = load_config(None, ["actor.ulysses_sequence_parallel_size=2"])
    assert config.ref.ulysses_sequence_parallel_size == 2
    with pytest.raises(ConfigValueError, match=r"ref\.ulysses_sequence_parallel_size.*actor's workers"):
        load_config(None, ["actor.ulysses_sequence_parallel_size=2", "ref.ulysses_sequence_parallel_size=1"])
