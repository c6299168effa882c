"""Offload (``offload.param`` / ``offload.optimizer``): what each knob moves, when, and that training
is unchanged.

On a CPU compute device the host is the device, so nothing really moves; these tests pin what can be
seen there: the knobs reach the engine, each phase asks for exactly the moves its knobs call for,
an update phase drops the gradients, losses and weights are bit-identical with and without offload,
the workers run every stage inside a phase, combinations that cannot work fail naming the key, and
``fsdp`` installs FSDP's CPU offload (two gloo processes). The bytes that move are measured on CUDA
through the device backend's memory accounting (skipped without a GPU).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from _spawn import init_gloo, load_results, run_ranks
from test_engine_base import make_batch, policy_loss_fn, value_loss_fn

from trellis.config import ConfigValueError, TrellisConfig
from trellis.config.schema import (
    ActorConfig,
    CriticConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefConfig,
)
from trellis.engine.base import EngineError
from trellis.engine.single import SingleEngine

KNOBS = [(False, False), (True, False), (False, True), (True, True)]
"""``(offload.param, offload.optimizer)``: every combination."""


def role_config(role, param=False, optimizer=False, *, mbs=2):
    offload = OffloadConfig(param=param, optimizer=optimizer)
    if role == "ref":
        return RefConfig(log_prob_micro_batch_size_per_device=mbs, offload=offload)
    section = CriticConfig if role == "critic" else ActorConfig
    return section(ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=1e-2), offload=offload)


def build(path, role="actor", param=False, optimizer=False, device="cpu", engine_cls=SingleEngine):
    model = ModelConfig(path=path, dtype="float32")
    return engine_cls(model, role_config(role, param, optimizer), role=role, device=device)


def update(engine, seed, rows=None):
    """One update phase (forward_backward + optimizer_step); returns the loss."""
    batch = make_batch(8, seed=seed) if rows is None else make_batch(8, seed=seed)[rows]
    loss_fn = value_loss_fn if engine.role == "critic" else policy_loss_fn("token-mean")
    with engine.phase(optimizer=True):
        engine.zero_grad()
        loss = engine.forward_backward(batch, loss_fn)["loss"]
        engine.optimizer_step()
    return loss


def optimizer_state(engine):
    return [
        (key, value.clone())
        for entry in engine.optimizer.state.values()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    ]


# ---------------------------------------------------------------- the knobs reach the engine


@pytest.mark.parametrize("role", ["actor", "critic", "ref"])
def test_the_offload_knobs_reach_every_role(tiny_model_path, role):
    optimizer = role != "ref"
    model = ModelConfig(path=tiny_model_path, dtype="float32")
    engine = SingleEngine(model, role_config(role, True, optimizer), role=role, device="cpu")
    assert (engine.offload_param, engine.offload_optimizer) == (True, optimizer)
    as_dict = {"offload": {"param": False, "optimizer": optimizer}}  # a plain dict config reads the same
    engine = SingleEngine(model, as_dict, role=role, device="cpu")
    assert (engine.offload_param, engine.offload_optimizer) == (False, optimizer)
    engine = SingleEngine(model, None, role=role, device="cpu")  # the schema's defaults: off
    assert (engine.offload_param, engine.offload_optimizer) == (False, False)


def test_ref_offload_optimizer_is_refused_with_the_fix(tiny_model_path):
    with pytest.raises(ConfigValueError) as caught:
        build(tiny_model_path, "ref", optimizer=True)
    assert str(caught.value) == (
        "Config key 'ref.offload.optimizer' must be false: the reference model is frozen and has no "
        "optimizer state to offload; got True. Set ref.offload.param=true to keep its weights in host "
        "memory between forward passes."
    )
    assert caught.value.key == "ref.offload.optimizer" and caught.value.value is True


def test_a_phase_that_steps_a_ref_engine_is_refused(tiny_model_path):
    ref = build(tiny_model_path, "ref", param=True)
    refused = r"phase\(optimizer=True\): this 'ref' engine runs forward passes"
    with pytest.raises(EngineError, match=refused), ref.phase(optimizer=True):
        pass


# ---------------------------------------------------------------- what each phase moves


@pytest.mark.parametrize(
    ("role", "param", "optimizer"),
    [("actor", *knobs) for knobs in KNOBS] + [("critic", True, True), ("ref", True, False)],
)
def test_each_phase_moves_exactly_what_its_knobs_offload(
    tiny_model_path, monkeypatch, role, param, optimizer
):
    """Every call of ``to`` (the engine's one way to move things), at construction and around each phase."""
    log: list[str] = []
    real_to = SingleEngine.to

    def to(self, device, *, model=True, optimizer=True, grad=True):
        log.append(f"{'params' if model else 'optimizer'}->{torch.device(device).type}")
        assert not (model and optimizer), "a phase moves the parameters and the optimizer state separately"
        real_to(self, device, model=model, optimizer=optimizer, grad=grad)

    monkeypatch.setattr(SingleEngine, "to", to)
    engine = build(tiny_model_path, role, param, optimizer)
    for name in ("forward", "forward_backward", "optimizer_step"):
        method = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _m=method, _n=name, **k: log.append(_n) or _m(*a, **k))

    put_away = ["optimizer->cpu"] * optimizer + ["params->cpu"] * param
    assert log == put_away  # the engine starts offloaded
    log.clear()
    with engine.phase():
        engine.forward(make_batch(4))
    assert log == ["params->cpu"] * param + ["forward"] + put_away
    log.clear()
    with engine.phase(), engine.phase():  # nested: the outer phase puts things away, once
        pass
    assert log == ["params->cpu"] * param * 2 + put_away
    if role == "ref":
        return
    log.clear()
    update(engine, seed=1)
    brought_in = ["params->cpu"] * param + ["optimizer->cpu"] * optimizer
    assert log == [*brought_in, "forward_backward", "optimizer_step", *put_away]


@pytest.mark.parametrize(("param", "optimizer"), KNOBS)
def test_an_update_phase_drops_the_gradients_when_offloading_or_on_cpu(tiny_model_path, param, optimizer):
    engine = build(tiny_model_path, "actor", param, optimizer)
    with engine.phase(optimizer=True):
        engine.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
        grads = engine.device_bytes()["grads"]
        assert grads == engine.device_bytes()["params"] > 0
        engine.optimizer_step()
    kept = [p.grad is not None for p in engine.model.parameters()]
    # on a CPU compute device always (their memory serves generation), elsewhere when offloading
    assert not any(kept) and engine.device_bytes()["grads"] == 0


def test_device_bytes_counts_params_grads_and_optimizer_state(tiny_model_path):
    engine = build(tiny_model_path, "actor")
    params = list(engine.model.parameters())
    param_bytes = sum(p.numel() * 4 for p in params)  # float32 weights
    assert engine.device_bytes() == {"params": param_bytes, "grads": 0, "optimizer": 0}
    update(engine, seed=0)
    with engine.phase(optimizer=True):  # leaving an update phase on the CPU drops the gradients
        engine.forward_backward(make_batch(8), policy_loss_fn("token-mean"))
        # AdamW: exp_avg and exp_avg_sq like each parameter, and a float32 step count per parameter
        assert engine.device_bytes() == {
            "params": param_bytes,
            "grads": param_bytes,
            "optimizer": 2 * param_bytes + 4 * len(params),
        }
    ref = build(tiny_model_path, "ref", param=True)
    assert ref.device_bytes() == {"params": param_bytes, "grads": 0, "optimizer": 0}


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize(("param", "optimizer"), KNOBS[1:])
def test_training_is_bit_identical_with_and_without_offload(tiny_model_path, tmp_path, param, optimizer):
    """Two updates and a forward pass; then a fresh offloaded engine resumes from a save to the same step."""
    plain, offloaded = build(tiny_model_path), build(tiny_model_path, "actor", param, optimizer)
    results = []
    for engine in (plain, offloaded):
        losses = [update(engine, seed) for seed in (0, 1)]
        with engine.phase():
            log_probs = engine.forward(make_batch(8, seed=2), compute_entropy=True)
        params = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
        results.append((losses, log_probs, params, optimizer_state(engine)))
    (losses, log_probs, params, state), (losses_off, log_probs_off, params_off, state_off) = results
    assert losses_off == losses
    assert all(torch.equal(log_probs_off[key], log_probs[key]) for key in ("log_probs", "entropy"))
    assert params_off.keys() == params.keys()
    assert all(torch.equal(params_off[name], params[name]) for name in params), "weights differ"
    assert [key for key, _ in state_off] == [key for key, _ in state]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(state_off, state, strict=True))

    torch.save(offloaded.state_dict(), tmp_path / "engine.pt")
    resumed = build(tiny_model_path, "actor", param, optimizer)
    resumed.load_state_dict(torch.load(tmp_path / "engine.pt", weights_only=False))
    assert update(resumed, seed=3) == update(plain, seed=3)


def test_critic_and_ref_give_the_same_outputs_offloaded(tiny_model_path):
    batch = make_batch(8, seed=4)
    for role in ("critic", "ref"):
        plain, offloaded = build(tiny_model_path, role), build(tiny_model_path, role, param=True)
        if role == "critic":
            assert update(offloaded, seed=0) == update(plain, seed=0)
        outputs = []
        for engine in (plain, offloaded):
            with engine.phase():
                outputs.append(engine.forward(batch))
        key = "values" if role == "critic" else "log_probs"
        assert torch.equal(outputs[0][key], outputs[1][key]), role


# ---------------------------------------------------------------- the workers


def test_the_workers_run_every_stage_inside_a_phase(tiny_model_path, monkeypatch):
    """compute_log_prob, compute_ref_log_prob, compute_values: a forward phase each; updates: one
    phase with the optimizer around every forward_backward and optimizer_step."""
    from trellis.registries import get_policy_loss_fn
    from trellis.trainer.workers import ActorRolloutRefWorker, CriticWorker

    config = TrellisConfig()
    config.actor.ppo_mini_batch_size = config.critic.ppo_mini_batch_size = 1
    config.rollout.n = 4  # 8 rows: mini-batches of 4, two optimizer steps per update
    log: list[str] = []

    def watch(engine):
        real_phase = engine.phase

        @contextlib.contextmanager
        def phase(*, optimizer=False):
            log.append(f"{engine.role} phase(optimizer={optimizer}) {{")
            with real_phase(optimizer=optimizer):
                yield
            log.append("}")

        monkeypatch.setattr(engine, "phase", phase)
        for name in ("forward", "forward_backward", "optimizer_step"):
            method = getattr(engine, name)
            monkeypatch.setattr(
                engine, name, lambda *a, _m=method, _n=name, **k: log.append(_n) or _m(*a, **k)
            )
        return engine

    policy = ActorRolloutRefWorker(config)
    policy.actor = watch(build(tiny_model_path, "actor", True, True))
    policy.ref = watch(build(tiny_model_path, "ref", param=True))
    policy.policy_loss = get_policy_loss_fn("vanilla")
    critic = CriticWorker(config)
    critic.critic = watch(build(tiny_model_path, "critic", True, True))

    policy.compute_log_prob(make_batch(8))
    policy.compute_ref_log_prob(make_batch(8))
    critic.compute_values(make_batch(8))
    assert log == [
        *("actor phase(optimizer=False) {", "forward", "}"),
        *("ref phase(optimizer=False) {", "forward", "}"),
        *("critic phase(optimizer=False) {", "forward", "}"),
    ]
    log.clear()
    policy.update_actor(make_batch(8))
    critic.update_critic(make_batch(8))
    steps = ["forward_backward", "optimizer_step"] * 2
    assert log == [
        "actor phase(optimizer=True) {",
        *steps,
        "}",
        "critic phase(optimizer=True) {",
        *steps,
        "}",
    ]


# ---------------------------------------------------------------- fsdp (two gloo processes)

WORLD = 2
FSDP_CASES = {"plain": (False, False), "cpu_offload": (True, True), "optimizer": (False, True)}


def _fsdp_run(engine, rank):
    rows = [rank * 4 + i for i in range(4)]
    losses = [update(engine, seed, rows) for seed in (0, 1)]
    with engine.phase():
        log_probs = engine.forward(make_batch(8, seed=2)[rows])["log_probs"]
    params = {name: tensor.clone() for name, tensor in engine.iter_full_params()}
    return {"losses": losses, "log_probs": log_probs, "params": params}


def _offload_flags(engine):
    """FSDP's own record of whether each parameter is offloaded (private: torch has no public getter)."""
    from torch.distributed.fsdp import FSDPModule

    return [
        fsdp_param.offload_to_cpu
        for module in engine.model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    ]


def _fsdp_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    """One rank of the two-process run; writes its results to ``out_dir/rank{rank}.pt``."""
    from trellis.engine.fsdp import FSDPEngine

    with init_gloo(rank, port, WORLD, timeout_s=90):
        results: dict = {}
        for case, (param, optimizer) in FSDP_CASES.items():
            engine = build(path, "actor", param, optimizer, engine_cls=FSDPEngine)
            results[case] = _fsdp_run(engine, rank)
            results[case]["offload_flags"] = _offload_flags(engine)
            results[case]["grads_after"] = [p.grad is None for p in engine.model.parameters()]
            if case == "cpu_offload":
                engine.to("cpu")  # already there: nothing to do
                try:
                    engine.to("meta")
                except EngineError as exc:
                    results[case]["to_error"] = str(exc)
        for param in (False, True):
            ref = build(path, "ref", param=param, engine_cls=FSDPEngine)
            with ref.phase():
                results[f"ref_{param}"] = ref.forward(make_batch(8, seed=5)[[rank * 4 + i for i in range(4)]])
            results[f"ref_{param}_flags"] = _offload_flags(ref)
        try:
            build(path, "critic", param=True, engine_cls=FSDPEngine)
        except ConfigValueError as exc:
            results["param_alone"] = str(exc)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def fsdp_results(tiny_model_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp_offload")
    run_ranks("test_engine_offload", WORLD, tiny_model_path, out_dir, func="_fsdp_worker")
    return load_results(out_dir, WORLD)


def test_fsdp_offload_param_installs_fsdps_cpu_offload(fsdp_results):
    for results in fsdp_results:
        assert results["plain"]["offload_flags"] and not any(results["plain"]["offload_flags"])
        assert not any(results["optimizer"]["offload_flags"])  # optimizer alone: the engine's phases
        assert results["cpu_offload"]["offload_flags"] and all(results["cpu_offload"]["offload_flags"])
        assert not any(results["ref_False_flags"]) and all(results["ref_True_flags"])
        assert results["cpu_offload"]["to_error"].startswith(
            "FSDPEngine.to('meta'): with actor.offload.param=true FSDP keeps the parameters and optimizer "
            "state in host memory"
        )
        for case in FSDP_CASES:  # on the CPU (gloo) every update phase drops the gradients when it ends
            assert all(results[case]["grads_after"]), case


@pytest.mark.parametrize("case", ["cpu_offload", "optimizer"])
def test_fsdp_training_is_bit_identical_with_and_without_offload(fsdp_results, case):
    for results in fsdp_results:
        plain, offloaded = results["plain"], results[case]
        assert offloaded["losses"] == plain["losses"]
        assert torch.equal(offloaded["log_probs"], plain["log_probs"])
        assert all(torch.equal(offloaded["params"][name], tensor) for name, tensor in plain["params"].items())
        assert torch.equal(results["ref_True"]["log_probs"], results["ref_False"]["log_probs"])


def test_fsdp_offload_param_without_optimizer_is_refused_with_the_fix(fsdp_results):
    assert fsdp_results[0]["param_alone"] == (
        "Config key 'critic.offload.optimizer' must be true when critic.offload.param is true with the fsdp "
        "engine: FSDP's CPU offload keeps the optimizer state in host memory beside the parameters and "
        "steps it there; got False (bool). Set critic.offload.optimizer=true as well, or "
        "critic.offload.param=false to offload the optimizer state alone."
    )


# ---------------------------------------------------------------- CUDA: the bytes that move

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _allocated() -> int:
    from trellis.device import get_device_backend

    backend = get_device_backend("cuda")
    backend.synchronize()
    return backend.memory_allocated()


def _on(tensors, device_type):
    return all(tensor.device.type == device_type for tensor in tensors)


def _moments(engine):
    return [
        value for entry in engine.optimizer.state.values() for key, value in entry.items() if key != "step"
    ]


SLACK = 64 * 2**10
"""Bytes of allocator rounding (512 B per tensor) and buffers; the tiny model's weights are ~390 KiB."""


@pytest.fixture
def steady_cuda(tiny_model_path):
    """Warm the kernels' workspaces (cuBLAS keeps one in the caching allocator) and hold off the
    garbage collector, so ``memory_allocated`` changes only by what the engine moves."""
    import gc

    update(build(tiny_model_path, device="cuda"), seed=0)
    gc.collect()
    torch.cuda.empty_cache()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@cuda
@pytest.mark.parametrize(("param", "optimizer"), KNOBS)
def test_cuda_each_phase_brings_in_and_puts_back_the_offloaded_bytes(
    tiny_model_path, steady_cuda, param, optimizer
):
    """``memory_allocated`` (the device backend's accounting) and each tensor's device, before, inside
    and after each phase."""
    empty = _allocated()
    engine = build(tiny_model_path, "actor", param, optimizer, device="cuda")
    params = list(engine.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    steps = 4 * len(params)  # AdamW's step counts: on the host unless fused or capturable, and never moved
    home = "cpu" if param else "cuda"

    at_rest = _allocated() - empty
    assert _on(params, home) and at_rest == pytest.approx(0 if param else weights, abs=SLACK)
    with engine.phase():
        assert _on(params, "cuda") and _allocated() - empty == pytest.approx(weights, abs=SLACK)
        engine.forward(make_batch(4))
    assert _on(params, home) and _allocated() - empty == pytest.approx(at_rest, abs=SLACK)

    with engine.phase(optimizer=True):
        engine.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
        engine.optimizer_step()
        assert _on(params, "cuda") and _on(_moments(engine), "cuda")
        # weights + gradients + AdamW's two moments, all on the device during the update
        assert _allocated() - empty == pytest.approx(4 * weights, abs=SLACK)
        inside = {"params": weights, "grads": weights, "optimizer": 2 * weights}
        assert engine.device_bytes() == pytest.approx(inside, abs=steps)
    kept = {
        "params": 0 if param else weights,
        "grads": 0 if param or optimizer else weights,  # offloading drops them after the update
        "optimizer": 0 if optimizer else 2 * weights,
    }
    assert _on(params, home) and _on(_moments(engine), "cpu" if optimizer else "cuda")
    assert engine.device_bytes() == pytest.approx(kept, abs=steps)
    assert _allocated() - empty == pytest.approx(sum(kept.values()), abs=SLACK)


@cuda
@pytest.mark.parametrize(("param", "optimizer"), KNOBS[1:])
def test_cuda_training_matches_without_offload(tiny_model_path, param, optimizer):
    plain = build(tiny_model_path, device="cuda")
    offloaded = build(tiny_model_path, "actor", param, optimizer, device="cuda")
    # the same kernels on the same device; only atomics (embedding backward) may reorder sums
    assert update(offloaded, 0) == pytest.approx(update(plain, 0), rel=1e-6)
    assert update(offloaded, 1) == pytest.approx(update(plain, 1), rel=1e-6)
    full = dict(plain.iter_full_params())
    for name, tensor in offloaded.iter_full_params():
        torch.testing.assert_close(tensor.to(full[name].device), full[name], rtol=1e-6, atol=1e-6)


def _cuda_fsdp_worker(rank: int, port: int, path: str, out_dir: str) -> None:
    """A one-process NCCL world (``rank`` 0): FSDP's CPU offload on a real accelerator."""
    import gc

    import torch.distributed as dist

    from trellis.engine.fsdp import FSDPEngine

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        results = {}
        for case, (param, optimizer) in FSDP_CASES.items():
            gc.collect()
            torch.cuda.empty_cache()
            empty = _allocated()
            engine = build(path, "actor", param, optimizer, device="cuda", engine_cls=FSDPEngine)
            at_rest = _allocated() - empty
            local = [p.to_local() for p in engine.model.parameters()]
            results[case] = {
                **_fsdp_run(engine, 0),
                "at_rest": at_rest,
                "param_bytes": sum(t.numel() * t.element_size() for t in local),
                "param_devices": sorted({t.device.type for t in local}),
                "state_devices": sorted(
                    {
                        v.to_local().device.type
                        for s in engine.optimizer.state.values()
                        for k, v in s.items()
                        if k != "step"
                    }
                ),
                "device_bytes": engine.device_bytes(),
            }
            del engine, local
        torch.save(results, Path(out_dir) / "rank0.pt")
    finally:
        dist.destroy_process_group()


@cuda
def test_cuda_fsdp_cpu_offload_keeps_the_shards_on_the_host(tiny_model_path, tmp_path):
    run_ranks("test_engine_offload", 1, tiny_model_path, tmp_path, func="_cuda_fsdp_worker")
    results = torch.load(tmp_path / "rank0.pt", weights_only=False)
    plain, streamed, optimizer = results["plain"], results["cpu_offload"], results["optimizer"]
    assert plain["param_devices"] == ["cuda"] and streamed["param_devices"] == ["cpu"]
    assert plain["state_devices"] == ["cuda"] and streamed["state_devices"] == ["cpu"]
    assert optimizer["param_devices"] == ["cuda"] and optimizer["state_devices"] == ["cpu"]
    assert streamed["device_bytes"] == {"params": 0, "grads": 0, "optimizer": 0}
    assert streamed["at_rest"] < plain["param_bytes"] <= plain["at_rest"]
    assert optimizer["device_bytes"]["optimizer"] == 0 and plain["device_bytes"]["optimizer"] > 0
    # FSDP's CPU offload runs AdamW on the CPU, the plain engine on the GPU: equal to rounding
    for case in (streamed, optimizer):
        assert case["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        for name, tensor in plain["params"].items():
            torch.testing.assert_close(case["params"][name].cpu(), tensor.cpu(), rtol=1e-5, atol=1e-5)
