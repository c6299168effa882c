"""Vision-language batches on the ``fsdp`` engine: two gloo ranks on the CPU train the tiny Qwen2-VL on
their halves of a batch with images (padded and packed) and match the ``single`` engine on the whole
batch: log-probs, loss and the weights after one optimizer step (vision tower included)."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from _spawn import init_gloo, load_results, run_ranks

WORLD = 2


def _engine(engine_cls, path: str, packed: bool):
    from trellis.config.schema import ActorConfig, ModelConfig, OptimConfig

    model = ModelConfig(path=path, dtype="float32", use_remove_padding=packed)
    actor = ActorConfig(ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-2))
    return engine_cls(model, actor, role="actor", device="cpu", total_steps=1)


def _loss(outputs, micro, info):
    from trellis.algorithms.aggregation import agg_loss

    mask = micro.tensors["response_mask"].float()
    loss = agg_loss(-outputs["log_probs"], mask, "token-mean", **info)
    return loss, {}


def _step(engine, batch) -> dict:
    with engine.phase(optimizer=True):
        outputs = engine.forward(batch)
        metrics = engine.forward_backward(batch, _loss)
        step = engine.optimizer_step()
        params = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
    return {
        "log_probs": outputs["log_probs"],
        "loss": metrics["loss"],
        "grad_norm": step["grad_norm"],
        "params": params,
    }


def _initial(path: str) -> dict:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()


def _worker(rank: int, port: int, model_path: str, batch_path: str, out_dir: str) -> None:
    from trellis.engine.fsdp import FSDPEngine

    batch = torch.load(batch_path, weights_only=False)
    share = batch[list(range(rank, len(batch), WORLD))]
    results = {}
    with init_gloo(rank, port, WORLD, timeout_s=120):
        for packed in (False, True):
            results[packed] = _step(_engine(FSDPEngine, model_path, packed), share)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _png(color, size) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trellis.config import load_config
    from trellis.data.dataset import RLDataset
    from trellis.recipes.tiny_vl import save_tiny_vl_model
    from trellis.rollout.agent_loop import AgentLoopManager
    from trellis.rollout.hf import HFRolloutReplica
    from trellis.utils.tokenizer import hf_processor, hf_tokenizer

    root = tmp_path_factory.mktemp("vl_fsdp")
    path = save_tiny_vl_model(root / "model")
    tokenizer, processor = hf_tokenizer(path), hf_processor(path)
    rows = [
        {
            "prompt": [{"role": "user", "content": "<image>" * (1 + i % 2) + "How many?"}],
            "images": [{"bytes": _png((40 * i, 0, 0), (56 + 28 * (i % 3), 56)), "path": None}] * (1 + i % 2),
        }
        for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "data.parquet")
    data = RLDataset(str(root / "data.parquet"), tokenizer, processor=processor, max_prompt_length=128)
    config = load_config(None, [f"model.path={path}", "model.dtype=float32", "data.max_response_length=6"])
    replica = HFRolloutReplica(0, config.rollout, config.model)
    asyncio.run(replica.init("colocated", tokenizer=tokenizer))
    batch = AgentLoopManager(config.rollout, [replica], tokenizer).generate_sequences(
        data.collate_fn([data[i] for i in range(4)])
    )
    torch.save(batch, root / "batch.pt")
    run_ranks("test_multimodal_fsdp", WORLD, path, str(root / "batch.pt"), str(root))
    return path, batch, load_results(root, WORLD)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_fsdp_trains_on_images_as_the_single_engine_does(setup, packed):
    from trellis.engine.single import SingleEngine

    path, batch, ranks = setup
    expected = _step(_engine(SingleEngine, path, packed), batch)
    got = torch.empty_like(expected["log_probs"])
    for rank, result in enumerate(ranks):
        got[rank::WORLD] = result[packed]["log_probs"]
    torch.testing.assert_close(got, expected["log_probs"], atol=1e-5, rtol=0)
    for result in ranks:
        r = result[packed]
        assert r["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert r["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-4)
        # Adam's first step (lr 1e-2) divides each gradient by its own size: the reduction order's fp32
        # rounding on a near-zero gradient moves a weight by up to 1.3e-5 (seen)
        for name, tensor in expected["params"].items():
            torch.testing.assert_close(r["params"][name], tensor, atol=5e-5, rtol=0, msg=name)
    tower = [name for name in expected["params"] if name.startswith("model.visual.")]
    initial = _initial(path)
    assert tower and all(not torch.equal(expected["params"][name], initial[name]) for name in tower)
