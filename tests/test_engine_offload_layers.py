"""The ``offload`` engine: FP32 state on the host, decoder layers streamed through the device.

On the CPU the working copies are separate allocations from the masters, so the engine's own
accounting (resident bytes, which layers are resident) is real and asserted here; the CUDA test
checks the allocator's peak against a budget smaller than the FP32 training state.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_engine_base import make_batch, policy_loss_fn, value_loss_fn

from trellis.config.base import ConfigValueError
from trellis.config.schema import (
    ActorConfig,
    CriticConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefConfig,
)
from trellis.engine.offload import OffloadEngine, ParameterState
from trellis.engine.single import SingleEngine
from trellis.errors import EngineError
from trellis.registries import training_engines


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def build(
    cls, path, role="actor", *, packed=True, mbs=2, dynamic=None, lr=1e-2, resident=2, device="cpu", **model
):
    model_config = ModelConfig(
        path=path, dtype=model.pop("dtype", "float32"), use_remove_padding=packed, **model
    )
    batching = {"use_dynamic_bsz": dynamic is not None, "max_token_len_per_micro_batch": dynamic or 16384}
    offload = OffloadConfig(resident_layers=resident)
    if role == "ref":
        role_config = RefConfig(log_prob_micro_batch_size_per_device=mbs, offload=offload)
    elif role == "critic":
        role_config = CriticConfig(
            ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=lr), offload=offload, **batching
        )
    else:
        role_config = ActorConfig(
            ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=lr), offload=offload, **batching
        )
    return cls(model_config, role_config, role=role, device=device)


def run_steps(eng, steps, *, loss=None, bs=6, seed0=0):
    loss = loss or policy_loss_fn("seq-mean-token-mean")
    losses = []
    for step in range(steps):
        with eng.phase(optimizer=True):
            eng.zero_grad()
            losses.append(eng.forward_backward(make_batch(bs, seed=seed0 + step), loss)["loss"])
            eng.optimizer_step()
    return losses


def weights(eng):
    return {name: tensor.detach().clone() for name, tensor in eng.iter_full_params()}


def test_offload_is_registered():
    assert training_engines.get("offload") is OffloadEngine


def test_offload_runs_every_prompt_per_row(tiny_model_path):
    # backward reruns each layer's forward, which would extend a shared prompt's KV cache twice
    assert build(OffloadEngine, tiny_model_path).share_prompt is False


@pytest.mark.parametrize(
    ("packed", "mbs", "dynamic"),
    [(True, 2, None), (False, 3, None), (True, 2, 40)],
    ids=["packed", "padded", "dynamic"],
)
def test_fp32_losses_and_weights_equal_single_over_three_steps(tiny_model_path, packed, mbs, dynamic):
    single = build(SingleEngine, tiny_model_path, packed=packed, mbs=mbs, dynamic=dynamic)
    offload = build(OffloadEngine, tiny_model_path, packed=packed, mbs=mbs, dynamic=dynamic, resident=1)
    assert run_steps(offload, 3) == pytest.approx(run_steps(single, 3), abs=1e-6)
    mine, theirs = weights(offload), weights(single)
    assert list(mine) == list(theirs)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0, msg=name)
    with offload.phase(), single.phase():
        batch = make_batch(5, seed=9)
        torch.testing.assert_close(
            offload.forward(batch, compute_entropy=True),
            single.forward(batch, compute_entropy=True),
            atol=1e-6,
            rtol=0,
        )


def test_bf16_working_copies_stay_within_bf16_tolerance(tiny_model_path):
    single = build(SingleEngine, tiny_model_path, dtype="bfloat16", lr=1e-3)
    offload = build(OffloadEngine, tiny_model_path, dtype="bfloat16", lr=1e-3)
    state = next(iter(offload._states.values()))
    assert state.master.dtype == torch.float32 and state.host_copy.dtype == torch.bfloat16
    assert run_steps(offload, 3) == pytest.approx(run_steps(single, 3), abs=3e-2)
    mine, theirs = weights(offload), weights(single)
    for name in theirs:
        assert mine[name].dtype == torch.float32  # the masters travel, not the bf16 copies
        torch.testing.assert_close(mine[name], theirs[name], atol=2e-2, rtol=0, msg=name)


def test_critic_and_ref_run_offloaded(tiny_model_path):
    critic, single_critic = (
        build(cls, tiny_model_path, "critic", mbs=3) for cls in (OffloadEngine, SingleEngine)
    )
    assert run_steps(critic, 2, loss=value_loss_fn) == pytest.approx(
        run_steps(single_critic, 2, loss=value_loss_fn), abs=1e-6
    )
    ref = build(OffloadEngine, tiny_model_path, "ref")
    assert ref.optimizer is None and not any(state.trainable for state in ref._states.values())
    batch = make_batch(4, seed=3)
    expected = build(SingleEngine, tiny_model_path, "ref").forward(batch)["log_probs"]
    torch.testing.assert_close(ref.forward(batch)["log_probs"], expected, atol=1e-6, rtol=0)


def test_parameter_state_moves_the_working_copy_and_keeps_the_master():
    param = torch.nn.Parameter(torch.randn(4, 3))
    original = param.detach().clone()
    state = ParameterState("w", param, dtype=torch.bfloat16, pin=False, trainable=True)
    assert state.master.dtype == torch.float32 and torch.equal(state.master, original)
    assert param.data.dtype == torch.bfloat16 and param.data.data_ptr() == state.host_copy.data_ptr()
    copy = state.to(torch.device("cpu"))
    assert copy.data_ptr() != state.host_copy.data_ptr()  # a separate allocation, also on the CPU
    assert param.data.data_ptr() == copy.data_ptr() and state.device_copy is copy
    state.cpu()
    assert state.device_copy is None and param.data.data_ptr() == state.host_copy.data_ptr()
    assert state.grad is not None and state.master.grad is state.grad
    state.grad.add_(1.0)
    param.grad = torch.ones(4, 3, dtype=torch.bfloat16)
    state.zero_grad()
    assert float(state.grad.abs().sum()) == 0.0 and param.grad is None
    with torch.no_grad():
        state.master.add_(1.0)
    state.refresh()
    torch.testing.assert_close(state.host_copy.float(), original + 1.0, atol=1e-2, rtol=0)
    frozen = ParameterState(
        "f", torch.nn.Parameter(torch.ones(2)), dtype=torch.float32, pin=False, trainable=False
    )
    assert frozen.grad is None and frozen.host_copy is frozen.master


@pytest.mark.parametrize("resident", [1, 2])
def test_residency_and_peak_stay_within_the_budget(tiny_model_path, resident):
    """Resident bytes never exceed resident_layers layers + everything outside the layers (+ the
    gradients in flight), and where()/is_resident() answer during forward and backward."""
    eng = build(OffloadEngine, tiny_model_path, resident=resident, dtype="float32")
    n_layers = len(eng._layer_states)
    layer_bytes = max(sum(state.nbytes for state in layer) for layer in eng._layer_states)
    outer_bytes = sum(state.nbytes for state in eng._outer_states)
    seen: list[tuple[str, int, list[bool]]] = []
    layers = [module for module in eng.model.modules() if type(module).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == n_layers >= 2

    def record(index, phase):
        seen.append((phase, index, [eng.is_resident(i) for i in range(n_layers)]))
        assert eng.resident_bytes() <= resident * layer_bytes + outer_bytes + 2 * layer_bytes

    for index, layer in enumerate(layers):
        layer.self_attn.register_forward_hook(
            lambda *_, index=index: record(index, "backward" if torch.is_grad_enabled() else "forward")
        )
    eng.reset_peak_resident_bytes()
    run_steps(eng, 1)
    peak = eng.peak_resident_bytes
    assert outer_bytes < peak <= resident * layer_bytes + outer_bytes + layer_bytes  # + one layer's grads
    # the layer that computes is resident, and never more than `resident` layers are
    for _, index, flags in seen:
        assert flags[index] and sum(flags) <= resident
        assert eng.where(index) == torch.device("cpu")
    phases = [(phase, index) for phase, index, _ in seen]
    forward = [("forward", i) for i in range(n_layers)]
    backward = [("backward", i) for i in reversed(range(n_layers))]
    assert phases == (forward + backward) * 3  # 6 rows, micro-batches of 2: each forward, then recomputed
    # outside a phase nothing stays on the device, and the host holds the FP32 state
    assert eng.resident_bytes() == 0 and not any(eng.is_resident(i) for i in range(n_layers))
    host = eng.host_bytes()
    n_params = sum(state.master.numel() for state in eng._states.values())
    assert host["masters"] == host["grads"] == 4 * n_params and host["optimizer"] >= 8 * n_params
    assert eng.device_bytes()["optimizer"] == 0
    with pytest.raises(IndexError, match="out of range"):
        eng.where(n_layers)


@pytest.mark.parametrize("role", ["actor", "critic", "ref"])
def test_prefetch_runs_ahead_with_two_resident_layers(tiny_model_path, role):
    one, two = (build(OffloadEngine, tiny_model_path, role, resident=r) for r in (1, 2))
    assert (one.resident_layers, two.resident_layers) == (1, 2)
    for eng in (one, two):
        with eng.phase():
            eng.forward(make_batch(2))
    n_layers = len(one._layer_states)
    # one layer resident: each is fetched when the compute reaches it; two: the next is prefetched
    assert one._residency.waited == one._residency.fetches == n_layers
    assert two._residency.fetches == n_layers and two._residency.waited == 1


def test_checkpoint_of_offload_resumes_in_single_and_back(tiny_model_path):
    offload = build(OffloadEngine, tiny_model_path)
    run_steps(offload, 1)
    state = copy.deepcopy(offload.state_dict())  # the state shares memory with the engine
    assert state["engine"] == "offload"
    single = build(SingleEngine, tiny_model_path)
    moved = dict(state, engine="single")
    single.load_state_dict(copy.deepcopy(moved))  # optimizer loads alias the tensors they are given
    fresh = build(OffloadEngine, tiny_model_path)
    fresh.load_state_dict(state)
    a, b, c = run_steps(offload, 2, seed0=5), run_steps(fresh, 2, seed0=5), run_steps(single, 2, seed0=5)
    assert a == b
    assert a == pytest.approx(c, abs=1e-6)
    with pytest.raises(ValueError, match="missing"):
        fresh._load_model_state({})


def test_bad_settings_are_refused(tiny_model_path):
    with pytest.raises(ConfigValueError, match="resident_layers"):
        build(OffloadEngine, tiny_model_path, resident=0)
    with pytest.raises(EngineError, match="decoder layers"):

        class NoLayers(OffloadEngine):
            def _load_module(self, *args, **kwargs):
                module = super()._load_module(*args, **kwargs)
                module._no_split_modules = []
                return module

        build(NoLayers, tiny_model_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_memory_stays_under_a_budget_smaller_than_the_training_state(tiny_model_path):
    eng = build(OffloadEngine, tiny_model_path, device="cuda", dtype="bfloat16", resident=1, lr=1e-3)
    n_params = sum(state.master.numel() for state in eng._states.values())
    torch.cuda.reset_peak_memory_stats()
    run_steps(eng, 2)
    state_bytes = 16 * n_params  # FP32 weights, gradients and Adam moments
    assert torch.cuda.max_memory_allocated() < state_bytes / 2
    assert eng.where(0) == torch.device("cpu")


@pytest.mark.slow  # four tiny-preset runs (~25 s)
def test_the_tiny_preset_trains_offloaded_as_with_single(tmp_path):
    """``trellis train --preset tiny actor.engine=offload``: in float32 the per-step rewards are the
    ``single`` engine's exactly (weights reach the rollout through weight sync); with bfloat16 working
    copies the run learns and reaches the same validation reward by the preset's last step."""
    from test_trainer import QUICK, run

    def rewards(result):
        return [round(step["reward/mean"], 6) for step in result.history]

    def val(result):
        return [step["val/reward/mean"] for step in result.history if "val/reward/mean" in step]

    single = run(tmp_path, *QUICK, "trainer.total_training_steps=6", name="single")
    offload = run(tmp_path, *QUICK, "trainer.total_training_steps=6", "actor.engine=offload", name="offload")
    assert rewards(offload) == rewards(single) and len(rewards(single)) == 6
    # bf16 runs the preset's 12 steps: its rollout decodes in bf16, so which tokens are sampled depends on
    # the replica's numerics, and at step 6 the greedy validation still flips between 0 and 1 with them
    bf16 = run(
        tmp_path, *QUICK, "actor.engine=offload", "model.dtype=bfloat16", "ref.engine=offload", name="bf16"
    )  # fmt: skip
    assert val(single) == [1.0] and val(bf16)[-1] == 1.0 and len(val(bf16)) == 2
    trained = rewards(bf16)
    assert len(trained) == 12 and sum(trained[-4:]) > 1.2 * sum(trained[:4])  # it learns, not just ends well
    assert "timing/weight_sync" in bf16.history[-1]  # not the hybrid shortcut: the rollout gets the masters


def test_lora_trains_offloaded_as_with_single(tiny_model_path):
    """model.lora with engine offload: only the adapters get masters with gradients and optimizer
    state; losses and merged weights equal the single engine's."""
    from trellis.config.schema import LoraConfig

    lora = LoraConfig(rank=2, alpha=4.0)
    single = build(SingleEngine, tiny_model_path, lora=lora)
    offload = build(OffloadEngine, tiny_model_path, lora=lora)
    trainable = [state.name for state in offload._states.values() if state.trainable]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(offload.optimizer.param_groups[0]["params"]) == len(trainable)
    assert run_steps(offload, 3) == pytest.approx(run_steps(single, 3), abs=1e-6)
    mine, theirs = weights(offload), weights(single)
    assert list(mine) == list(theirs) and not any("lora" in name for name in mine)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0, msg=name)
    assert set(offload.state_dict()["model"]) == set(single.state_dict()["model"])


def test_the_stream_path_gives_the_same_numbers(tiny_model_path):
    """The accelerator path (copies on a side stream ordered by events, gradients staged and landed
    later) taken on the CPU, where the streams run in order: still single's numbers, and gradients
    do wait in flight and count as device bytes until they land."""

    class StreamsOnCPU(OffloadEngine):
        streams_on_cpu = True

    single = build(SingleEngine, tiny_model_path)
    offload = build(StreamsOnCPU, tiny_model_path, resident=2)
    assert offload._residency.asynchronous and offload._grad_stream is not None
    in_flight: list[tuple[int, int]] = []
    layer_done = offload._layer_done

    def record(index):
        in_flight.append((len(offload._pending), offload.device_bytes()["grads"]))
        layer_done(index)

    offload._layer_done = record
    assert run_steps(offload, 3) == pytest.approx(run_steps(single, 3), abs=1e-6)
    assert max(count for count, _ in in_flight) > 0 and max(nbytes for _, nbytes in in_flight) > 0
    assert offload._pending == [] and offload.device_bytes()["grads"] == 0
    mine, theirs = weights(offload), weights(single)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0, msg=name)


def test_export_of_an_offload_checkpoint_is_the_trained_model(tiny_model_path, tmp_path):
    """A training checkpoint of the offload engine exports like single's: a Hugging Face folder whose
    weights are the FP32 masters (not the bf16 working copies)."""
    from transformers import AutoModelForCausalLM

    from trellis.checkpoint import CheckpointManager, export_to_hf

    eng = build(OffloadEngine, tiny_model_path, dtype="bfloat16", lr=1e-3)
    run_steps(eng, 2)
    hf_files = {
        path.name: path.read_bytes()
        for path in Path(tiny_model_path).glob("*.json")
        if not path.name.endswith(".index.json")
    }
    ckpt = CheckpointManager(tmp_path / "ckpt").save(2, {"actor": eng.state_dict()}, hf_files=hf_files)
    export_to_hf(ckpt, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    masters = weights(eng)
    assert exported.keys() == masters.keys()
    for name, tensor in masters.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(exported[name], tensor), name
