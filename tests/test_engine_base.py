"""TrainingEngine behaviour, exercised through the one-process ``single`` engine on the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trellis.algorithms.aggregation import agg_loss
from trellis.algorithms.policy_loss import compute_value_loss
from trellis.config.schema import ActorConfig, CriticConfig, ModelConfig, OptimConfig, RefConfig
from trellis.data.protocol import DataProto
from trellis.engine.base import EngineError
from trellis.engine.packing import VARLEN_SDPA
from trellis.engine.single import SingleEngine
from trellis.registries import get_policy_loss_fn, training_engines

PROMPT, RESPONSE = 7, 6


def make_batch(bs: int = 8, seed: int = 0, vocab: int = 300) -> DataProto:
    """Rows of a left-padded prompt (1..PROMPT tokens) + a right-padded response (1..RESPONSE tokens),
    with old log-probs and advantages for a PPO loss. Row 0 has a full prompt and response."""
    gen = torch.Generator().manual_seed(seed)
    length = PROMPT + RESPONSE
    prompt_lens = torch.randint(1, PROMPT + 1, (bs,), generator=gen)
    response_lens = torch.randint(1, RESPONSE + 1, (bs,), generator=gen)
    prompt_lens[0], response_lens[0] = PROMPT, RESPONSE
    cols = torch.arange(length)
    mask = ((cols >= PROMPT - prompt_lens[:, None]) & (cols < PROMPT + response_lens[:, None])).long()
    ids = torch.where(mask.bool(), torch.randint(4, vocab, (bs, length), generator=gen), 3)
    return batch_of(ids, mask, gen)


def batch_of(ids: torch.Tensor, mask: torch.Tensor, gen: torch.Generator, prompt: int = PROMPT) -> DataProto:
    """A training batch of rows ``ids`` (prompt columns first) with attention ``mask``: positions,
    responses, and random old log-probs, advantages, returns and values drawn from ``gen``."""
    bs, response = ids.shape[0], ids.shape[1] - prompt
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:].float(),
            "old_log_probs": -5.0 + 0.3 * torch.randn(bs, response, generator=gen),
            "advantages": torch.randn(bs, response, generator=gen),
            "returns": torch.randn(bs, response, generator=gen),
            "values": 0.1 * torch.randn(bs, response, generator=gen),
        }
    )


def policy_loss_fn(mode: str):
    """A PPO loss_fn (vanilla clipped loss, aggregated over the global batch)."""
    vanilla = get_policy_loss_fn("vanilla")

    def loss_fn(outputs, micro, info):
        b = micro.batch
        return vanilla(
            b["old_log_probs"],
            outputs["log_probs"],
            b["advantages"],
            b["response_mask"],
            mode,
            global_batch_info=info,
        )

    return loss_fn


def engine(path, role="actor", *, packed=False, mbs=2, dynamic=None, lr=1e-2, **model):
    """A float32 single engine; ``dynamic``: a token budget (use_dynamic_bsz)."""
    model_config = ModelConfig(
        path=path, dtype=model.pop("dtype", "float32"), use_remove_padding=packed, **model
    )
    batching = {"use_dynamic_bsz": dynamic is not None, "max_token_len_per_micro_batch": dynamic or 16384}
    if role == "ref":
        role_config = RefConfig(log_prob_micro_batch_size_per_device=mbs)
    elif role == "critic":
        role_config = CriticConfig(ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=lr), **batching)
    else:
        role_config = ActorConfig(ppo_micro_batch_size_per_device=mbs, optim=OptimConfig(lr=lr), **batching)
    return SingleEngine(model_config, role_config, role=role, device="cpu")


def grads(eng) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in eng.model.named_parameters() if p.grad is not None}


def assert_close_dicts(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


# ---------------------------------------------------------------- forward


def test_single_is_registered():
    assert training_engines.get("single") is SingleEngine


def test_forward_matches_per_row_reference(tiny_model_path):
    """log_probs[i, t] = log softmax(logits at L − T + t − 1)[response token t], each row run alone."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(4)
    out = engine(tiny_model_path, mbs=3).forward(batch, compute_entropy=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    b = batch.batch
    for i in range(4):
        real = b["input_ids"][i][b["attention_mask"][i].bool()]
        n_prompt = int(b["attention_mask"][i, :PROMPT].sum())
        n_response = len(real) - n_prompt
        with torch.no_grad():
            logp = torch.log_softmax(model(real[None]).logits[0], -1)
        expected = logp[n_prompt - 1 : -1].gather(-1, real[n_prompt:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)[n_prompt - 1 : -1]
        torch.testing.assert_close(out["log_probs"][i, :n_response], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(out["entropy"][i, :n_response], entropy, atol=1e-5, rtol=0)
    assert out["log_probs"].shape == out["entropy"].shape == (4, RESPONSE)


def test_packed_forward_equals_padded(tiny_model_path):
    batch = make_batch(8)
    padded = engine(tiny_model_path, mbs=3).forward(batch, compute_entropy=True)
    packed = engine(tiny_model_path, packed=True, mbs=3).forward(batch, compute_entropy=True)
    assert_close_dicts(padded, packed)
    # 0 where the predicting position is padding, in both
    predicting_pad = batch.batch["attention_mask"][:, PROMPT - 1 : -1] == 0
    assert predicting_pad.any()
    assert (packed["log_probs"][predicting_pad] == 0).all() and (
        padded["log_probs"][predicting_pad] == 0
    ).all()
    assert (padded["log_probs"][~predicting_pad] < 0).all()


def test_packed_varlen_sdpa_equals_padded(tiny_model_path):
    from trellis.engine.packing import VARLEN_SDPA

    batch = make_batch(6)
    padded = engine(tiny_model_path, mbs=6, attn_implementation=VARLEN_SDPA).forward(
        batch, compute_entropy=True
    )
    packed = engine(tiny_model_path, packed=True, mbs=3, attn_implementation=VARLEN_SDPA)
    assert_close_dicts(packed.forward(batch, compute_entropy=True), padded)
    assert_close_dicts(engine(tiny_model_path, mbs=6).forward(batch, compute_entropy=True), padded)


def test_dynamic_micro_batches_restore_order(tiny_model_path):
    batch = make_batch(8)
    fixed = engine(tiny_model_path, mbs=8).forward(batch)
    dynamic = engine(tiny_model_path, packed=True, dynamic=20).forward(batch)  # several groups, reordered
    assert_close_dicts(fixed, dynamic)


def test_temperature_divides_logits(tiny_model_path):
    eng = engine(tiny_model_path, mbs=8)
    batch = make_batch(4)
    cold = eng.forward(batch)["log_probs"]
    batch.meta_info["temperature"] = 0.5
    hot = eng.forward(batch)["log_probs"]
    mask = batch.batch["response_mask"].bool()
    assert not torch.allclose(cold[mask], hot[mask])
    # the same as doubling the logits: compare with the per-row reference on row 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch.batch["input_ids"][:1]).logits[0, PROMPT - 1 : -1] / 0.5
    expected = torch.log_softmax(logits, -1).gather(-1, batch.batch["responses"][0, :, None])[:, 0]
    torch.testing.assert_close(hot[0], expected, atol=1e-5, rtol=0)


def test_bfloat16_compute_runs_close_to_float32(tiny_model_path):
    batch = make_batch(4)
    full = engine(tiny_model_path, mbs=4).forward(batch)["log_probs"]
    for packed in (False, True):
        half = engine(tiny_model_path, packed=packed, mbs=4, dtype="bfloat16").forward(batch)["log_probs"]
        assert half.dtype == torch.float32
        torch.testing.assert_close(half, full, atol=0.1, rtol=0)


# ---------------------------------------------------------------- forward_backward


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_does_not_depend_on_the_split(tiny_model_path, mode):
    batch = make_batch(8)
    results = []
    for kwargs in ({"mbs": 8}, {"mbs": 3}, {"packed": True, "dynamic": 24}):
        eng = engine(tiny_model_path, **kwargs)
        metrics = eng.forward_backward(batch, policy_loss_fn(mode))
        results.append((metrics, grads(eng)))
    (whole, whole_grads), *others = results
    assert whole["loss"] != 0
    for metrics, split_grads in others:
        assert metrics["loss"] == pytest.approx(whole["loss"], abs=1e-6)
        assert metrics["actor/ppo_kl"] == pytest.approx(whole["actor/ppo_kl"], abs=1e-5)
        assert_close_dicts(whole_grads, split_grads)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("logits_to_keep", [True, False])
def test_gradient_matches_plain_autograd(tiny_model_path, packed, logits_to_keep):
    """The engine's chunked log-probs (gradient written into the logits) vs. log_softmax + gather,
    with the model computing logits only where needed or everywhere (models without logits_to_keep)."""
    from transformers import AutoModelForCausalLM

    batch = make_batch(5)
    b = batch.batch
    mask = b["response_mask"]

    def loss_fn(outputs, micro, info):
        return agg_loss(
            outputs["log_probs"] * micro.batch["advantages"],
            micro.batch["response_mask"],
            "token-mean",
            **info,
        ), {}

    eng = engine(tiny_model_path, packed=packed, mbs=2)
    eng._logits_to_keep = logits_to_keep
    eng.forward_backward(batch, loss_fn)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    log_probs = torch.log_softmax(logits[:, PROMPT - 1 : -1], -1).gather(-1, b["responses"][..., None])[
        ..., 0
    ]
    ((log_probs * b["advantages"] * mask).sum() / mask.sum()).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert_close_dicts(grads(eng), expected)


def test_loss_fn_sees_global_counts_and_micro_batches(tiny_model_path):
    batch = make_batch(5)
    seen = []

    def loss_fn(outputs, micro, info):
        seen.append((len(micro), dict(info), sorted(outputs)))
        assert outputs["log_probs"].requires_grad and micro.batch["input_ids"].device.type == "cpu"
        loss = agg_loss(outputs["log_probs"], micro.batch["response_mask"], "token-mean", **info)
        return loss, {"rows": float(len(micro))}

    metrics = engine(tiny_model_path, mbs=2).forward_backward(batch, loss_fn, compute_entropy=True)
    mask = batch.batch["response_mask"]
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": 5}
    assert seen == [
        (2, info, ["entropy", "log_probs"]),
        (2, info, ["entropy", "log_probs"]),
        (1, info, ["entropy", "log_probs"]),
    ]
    # the loss is the whole batch's; a metric is averaged weighted by response tokens
    whole = engine(tiny_model_path, mbs=8).forward(batch)["log_probs"]
    assert metrics["loss"] == pytest.approx(float((whole * mask).sum() / mask.sum()), abs=1e-6)
    weights = [float(mask[i : i + 2].sum()) for i in (0, 2, 4)]
    assert metrics["rows"] == pytest.approx((2 * weights[0] + 2 * weights[1] + weights[2]) / sum(weights))


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_path):
    batch = make_batch(4)
    plain = engine(tiny_model_path, mbs=2)
    checkpointed = engine(tiny_model_path, mbs=2, gradient_checkpointing=True)
    for eng in (plain, checkpointed):
        eng.forward_backward(batch, policy_loss_fn("token-mean"))
    assert_close_dicts(grads(plain), grads(checkpointed))


def test_loss_fn_errors(tiny_model_path):
    eng = engine(tiny_model_path, mbs=8)
    batch = make_batch(2)
    with pytest.raises(ValueError, match=r"must return \(loss, metrics\)"):
        eng.forward_backward(batch, lambda out, micro, info: out["log_probs"].sum())
    with pytest.raises(ValueError, match=r"0-d loss tensor.*shape \(2, 6\)"):
        eng.forward_backward(batch, lambda out, micro, info: (out["log_probs"], {}))
    with pytest.raises(ValueError, match="without gradient"):
        eng.forward_backward(batch, lambda out, micro, info: (torch.tensor(1.0), {}))


def test_batch_errors(tiny_model_path):
    eng = engine(tiny_model_path)
    batch = make_batch(2)
    with pytest.raises(ValueError, match=r"lacks \['response_mask'\]"):
        eng.forward_backward(
            batch.select(["input_ids", "attention_mask", "responses"]), policy_loss_fn("token-mean")
        )
    with pytest.raises(ValueError, match=r"lacks \['responses'\]"):
        eng.forward(batch.select(["input_ids", "attention_mask"]))
    too_long = DataProto.from_dict(
        {
            "input_ids": torch.ones(2, 4, dtype=torch.long),
            "attention_mask": torch.ones(2, 4),
            "responses": torch.ones(2, 4, dtype=torch.long),
        }
    )
    with pytest.raises(ValueError, match=r"prompt \(at least one token\) \+ response"):
        eng.forward(too_long)


# ---------------------------------------------------------------- critic and ref


def value_loss_fn(outputs, micro, info):
    """Clipped value loss (cliprange 0.5, token-mean) over the global batch."""
    b = micro.batch
    return compute_value_loss(
        outputs["values"],
        b["returns"],
        b["values"],
        b["response_mask"],
        0.5,
        "token-mean",
        global_batch_info=info,
    )


def test_critic_values_and_gradient_flow(tiny_model_path):

    critic = engine(tiny_model_path, role="critic", packed=True, mbs=3)
    batch = make_batch(5)
    values = critic.forward(batch)["values"]
    assert values.shape == (5, RESPONSE) and values.dtype == torch.float32
    padded = engine(tiny_model_path, role="critic", mbs=5).forward(batch)["values"]
    torch.testing.assert_close(values, padded, atol=1e-5, rtol=0)
    assert [name for name, _ in critic.model.named_parameters()][-2:] == ["score.weight", "score.bias"]

    metrics = critic.forward_backward(batch, value_loss_fn)
    assert metrics["loss"] > 0 and "critic/vf_clipfrac" in metrics
    g = grads(critic)
    assert g["score.weight"].abs().sum() > 0 and g["model.layers.0.mlp.up_proj.weight"].abs().sum() > 0
    before = critic.forward(batch)["values"]
    assert critic.optimizer_step()["stepped"]
    assert not torch.equal(before, critic.forward(batch)["values"])
    with pytest.raises(ValueError, match="critic has a value head"):
        critic.forward(batch, compute_entropy=True)


def test_ref_is_forward_only(tiny_model_path):
    ref = engine(tiny_model_path, role="ref", mbs=3)
    batch = make_batch(4)
    actor_out = engine(tiny_model_path, mbs=4).forward(batch)
    assert_close_dicts(ref.forward(batch), actor_out)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with pytest.raises(EngineError, match=r"'ref' engine runs forward passes only.*role='actor'"):
        ref.forward_backward(batch, policy_loss_fn("token-mean"))
    with pytest.raises(EngineError, match="no optimizer"):
        ref.optimizer_step()


# ---------------------------------------------------------------- optimizer, placement, state


def test_optimizer_step_skips_a_non_finite_gradient(tiny_model_path):
    eng = engine(tiny_model_path, mbs=8)
    batch = make_batch(4)
    eng.forward_backward(batch, policy_loss_fn("token-mean"))
    before = copy.deepcopy(eng.model.state_dict())
    next(eng.model.parameters()).grad[0, 0] = float("inf")
    result = eng.optimizer_step()
    assert result["stepped"] is False and result["grad_norm"] == float("inf")
    assert all(p.grad is None for p in eng.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())
    assert eng.optimizer.state == {} or all(not s for s in eng.optimizer.state.values())
    assert eng.global_step == 1
    # the next finite step updates
    eng.forward_backward(batch, policy_loss_fn("token-mean"))
    result = eng.optimizer_step()
    assert result["stepped"] is True and 0 < result["grad_norm"] < float("inf")
    assert not torch.equal(before["model.norm.weight"], eng.model.state_dict()["model.norm.weight"])


def test_gradient_is_clipped_to_grad_clip(tiny_model_path):
    eng = engine(tiny_model_path, mbs=8)
    eng.grad_clip = 1e-3
    eng.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
    result = eng.optimizer_step()
    assert result["grad_norm"] > 1e-3  # the norm before clipping; the gradient stepped on is clipped:
    clipped = torch.nn.utils.get_total_norm([p.grad for p in eng.model.parameters() if p.grad is not None])
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)


def test_a_tied_embedding_passes_back_its_rows_sparse_into_the_same_dense_gradient(tiny_model_path):
    batch = make_batch(8)
    sparse, dense = engine(tiny_model_path, mbs=3), engine(tiny_model_path, mbs=3)
    embedding = sparse.model.get_input_embeddings()
    assert sparse.sparse_embedding_grad is True and embedding.sparse is True
    assert embedding.weight is sparse.model.get_output_embeddings().weight  # the tiny model ties them
    dense.model.get_input_embeddings().sparse = False  # the plain path, for reference
    for eng in (sparse, dense):
        eng.forward_backward(batch, policy_loss_fn("token-mean"))
    grad = embedding.weight.grad
    assert grad.layout == torch.strided and grad.shape == embedding.weight.shape
    assert_close_dicts(grads(sparse), grads(dense), atol=1e-7)
    assert grad.abs().sum() > 0
    for eng in (sparse, dense):
        step = eng.optimizer_step()
        assert step["stepped"] and math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    after = {name: p.detach().clone() for name, p in sparse.model.named_parameters()}
    assert_close_dicts(after, {name: p.detach() for name, p in dense.model.named_parameters()}, atol=1e-6)


def test_embeddings_stay_dense_where_untied_frozen_or_a_critic(tiny_model_path, tmp_path):
    from trellis.recipes.tiny import save_tiny_model

    untied = save_tiny_model(tmp_path / "untied", tie_word_embeddings=False)
    for eng in (engine(untied), engine(tiny_model_path, role="ref"), engine(tiny_model_path, role="critic")):
        assert eng.sparse_embedding_grad is False
        assert eng.model.get_input_embeddings().sparse is False


def test_densify_grads_turns_a_sparse_gradient_dense_with_its_values():
    from trellis.engine.models import densify_grads

    model = torch.nn.Embedding(6, 3, sparse=True)
    model(torch.tensor([1, 4, 1])).sum().backward()
    assert model.weight.grad.is_sparse
    densify_grads(model)
    grad = model.weight.grad
    assert grad.layout == torch.strided
    assert grad[:, 0].tolist() == [0.0, 2.0, 0.0, 0.0, 1.0, 0.0]


def test_the_cpu_optimizer_is_fused_adamw(tiny_model_path):
    """On the CPU the engine steps torch's fused AdamW (one pass over each tensor, not one per op):
    its update equals a fused reference's on the same gradient, bit for bit."""
    eng = engine(tiny_model_path, mbs=8)
    assert eng.optimizer.param_groups[0]["fused"] is True
    eng.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
    params = [p for p in eng.model.parameters() if p.requires_grad]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy_, p in zip(copies, params, strict=True):
        copy_.grad = p.grad.clone()
    group = eng.optimizer.param_groups[0]
    reference = torch.optim.AdamW(
        copies, lr=group["lr"], betas=group["betas"], weight_decay=group["weight_decay"], fused=True
    )
    torch.nn.utils.clip_grad_norm_(copies, eng.grad_clip)  # as the engine clips before stepping
    eng.optimizer_step()
    reference.step()
    assert all(torch.equal(p, c) for p, c in zip(params, copies, strict=True))


def train_steps(eng, steps, seed0):
    losses = []
    for step in range(steps):
        eng.zero_grad()
        losses.append(
            eng.forward_backward(make_batch(6, seed=seed0 + step), policy_loss_fn("seq-mean-token-mean"))[
                "loss"
            ]
        )
        eng.optimizer_step()
    return losses


def test_state_dict_resume_is_bit_identical(tiny_model_path, tmp_path):
    """Save after 1 step (and a to('cpu') round trip), load into a fresh engine: the next 2 steps match."""

    def fresh():
        config = ActorConfig(ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-2, lr_warmup_steps=2))
        return SingleEngine(
            ModelConfig(path=tiny_model_path, dtype="float32"), config, total_steps=5, device="cpu"
        )

    uninterrupted = fresh()
    train_steps(uninterrupted, 1, seed0=0)
    uninterrupted.to("cpu")  # the offload path; on CPU a no-op move
    uninterrupted.to("cpu", model=True, optimizer=True, grad=False)
    torch.save(uninterrupted.state_dict(), tmp_path / "engine.pt")
    expected_losses = train_steps(uninterrupted, 2, seed0=1)

    resumed = fresh()
    resumed.load_state_dict(torch.load(tmp_path / "engine.pt", weights_only=False))
    assert resumed.global_step == 1
    assert train_steps(resumed, 2, seed0=1) == expected_losses
    for (name, a), (_, b) in zip(uninterrupted.iter_full_params(), resumed.iter_full_params(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.optimizer.param_groups[0]["lr"] == uninterrupted.optimizer.param_groups[0]["lr"]


def test_load_state_dict_errors(tiny_model_path):
    actor = engine(tiny_model_path)
    state = actor.state_dict()
    with pytest.raises(ValueError, match="role='actor', this one has role='critic'"):
        engine(tiny_model_path, role="critic").load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['optimizer'"):
        actor.load_state_dict({k: v for k, v in state.items() if k not in ("optimizer", "lr_scheduler")})


def test_to_errors_and_offload_checks(tiny_model_path):
    eng = engine(tiny_model_path)
    with pytest.raises(
        EngineError,
        match=r"parameters it updates, which are on cpu.*to\('meta', model=True, optimizer=True\)",
    ):
        eng.to("meta", model=False, optimizer=True)
    eng.to("cpu", model=False, optimizer=True)  # optimizer-only offload to the host is fine
    eng._model_device = torch.device("meta")  # as if offloaded away from the compute device
    with pytest.raises(EngineError, match=r"offloaded to meta; call engine.to\('cpu'\) first"):
        eng.forward(make_batch(2))


def test_iter_full_params_has_hugging_face_names(tiny_model_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    params = dict(engine(tiny_model_path).iter_full_params(dtype=torch.bfloat16))
    assert params.keys() == reference.keys()
    for name, tensor in params.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].to(torch.bfloat16)), (
            name
        )


def test_constructor_errors(tiny_model_path):
    with pytest.raises(ValueError, match="Unknown engine role 'policy'"):
        SingleEngine(ModelConfig(path=tiny_model_path), role="policy")
    with pytest.raises(ValueError, match=r"model.path is not set"):
        SingleEngine(ModelConfig(), device="cpu")
    with pytest.raises(ValueError, match="cosine' needs the number of optimizer steps: pass total_steps="):
        SingleEngine(
            ModelConfig(path=tiny_model_path),
            ActorConfig(optim=OptimConfig(lr_scheduler="cosine")),
            device="cpu",
        )
    with pytest.raises(ValueError, match=r"attn_implementation='flex_attention'.*use_remove_padding false"):
        SingleEngine(ModelConfig(path=tiny_model_path, attn_implementation="flex_attention"), device="cpu")


# ---------------------------------------------------------------- configuration


def checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on, in the transformers version at hand."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else model.is_gradient_checkpointing)


def test_missing_settings_take_the_schema_defaults(tiny_model_path):
    """A dict or None config falls back to the schema's declared defaults, never to others of its own."""
    actor = SingleEngine({"path": tiny_model_path}, None, device="cpu")
    model, role = ModelConfig(), ActorConfig()
    assert actor.use_remove_padding is model.use_remove_padding is True
    assert actor.dtype == torch.bfloat16 and model.dtype == "bfloat16"
    assert actor.attn_implementation == VARLEN_SDPA  # sdpa, packed: our per-sequence kernel
    assert checkpointing(actor.model) is model.gradient_checkpointing is False
    assert (actor.micro_batch_size, actor.max_tokens, actor.grad_clip) == (
        role.ppo_micro_batch_size_per_device,
        None,
        role.grad_clip,
    )
    group = actor.optimizer.param_groups[0]
    optim = OptimConfig()
    assert (group["lr"], group["betas"], group["weight_decay"]) == (
        optim.lr,
        tuple(optim.betas),
        optim.weight_decay,
    )
    # a critic given a dict without an optim section trains at the critic's own default lr (1e-5)
    critic = SingleEngine({"path": tiny_model_path}, {"grad_clip": 2.0}, role="critic", device="cpu")
    assert critic.optimizer.param_groups[0]["lr"] == CriticConfig().optim.lr == 1e-5
    assert critic.grad_clip == 2.0
    ref = SingleEngine({"path": tiny_model_path}, {}, role="ref", device="cpu")
    assert ref.micro_batch_size == RefConfig().log_prob_micro_batch_size_per_device


def test_every_model_and_role_setting_reaches_the_engine(tiny_model_path, monkeypatch):
    import transformers

    trusted = []
    from_pretrained = transformers.AutoConfig.from_pretrained

    def recording(path, **kwargs):
        trusted.append(kwargs.get("trust_remote_code"))
        return from_pretrained(path, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", recording)
    model = ModelConfig(
        path=tiny_model_path,
        dtype="float16",
        attn_implementation="eager",
        use_remove_padding=False,
        gradient_checkpointing=True,
        override_config={"attention_dropout": 0.25},
        trust_remote_code=True,
    )
    optim = OptimConfig(
        lr=3e-4,
        betas=[0.8, 0.9],
        weight_decay=0.2,
        lr_warmup_steps=2,
        lr_scheduler="cosine",
        min_lr_ratio=0.1,
    )
    actor = SingleEngine(
        model,
        ActorConfig(
            ppo_micro_batch_size_per_device=3,
            use_dynamic_bsz=True,
            max_token_len_per_micro_batch=100,
            grad_clip=0.5,
            optim=optim,
        ),
        total_steps=10,
        device="cpu",
    )
    assert trusted == [True]
    assert actor.dtype == torch.float16 and actor.use_remove_padding is False
    assert actor.attn_implementation == "trellis_eager" and checkpointing(actor.model)  # grouped heads
    assert actor.model.config.attention_dropout == 0.25
    assert (actor.micro_batch_size, actor.max_tokens, actor.grad_clip) == (3, 100, 0.5)
    group = actor.optimizer.param_groups[0]
    assert (group["initial_lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 0.2)
    schedule = actor.lr_scheduler.lr_lambdas[0]
    assert (schedule.warmup_steps, schedule.kind, schedule.min_lr_ratio) == (2, "cosine", 0.1)

    # the critic loads critic.model_path (model.path unset) and has batching and optim of its own
    critic = SingleEngine(
        ModelConfig(dtype="float32"),
        CriticConfig(
            model_path=tiny_model_path,
            ppo_micro_batch_size_per_device=5,
            use_dynamic_bsz=True,
            max_token_len_per_micro_batch=200,
            grad_clip=0.7,
            optim=OptimConfig(lr=2e-3),
        ),
        role="critic",
        device="cpu",
    )
    assert (critic.micro_batch_size, critic.max_tokens, critic.grad_clip) == (5, 200, 0.7)
    assert critic.optimizer.param_groups[0]["lr"] == 2e-3
    ref = SingleEngine(
        ModelConfig(path=tiny_model_path),
        RefConfig(log_prob_micro_batch_size_per_device=7),
        role="ref",
        device="cpu",
    )
    assert ref.micro_batch_size == 7


def test_a_cpu_phase_leaves_freed_memory_to_malloc_under_the_reuse_policy(tiny_model_path, monkeypatch):
    from trellis.device import get_device_backend
    from trellis.utils.memory import set_host_memory

    set_host_memory("reuse")  # put back by the conftest
    eng = engine(tiny_model_path)
    calls = []
    monkeypatch.setattr(get_device_backend("cpu"), "empty_cache", lambda: calls.append("empty_cache"))
    with eng.phase(optimizer=True):
        eng.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
        eng.optimizer_step()
    assert calls == []
    assert all(p.grad is None for p in eng.model.parameters())  # gradients still dropped on the CPU


def test_a_cpu_phase_gives_freed_memory_back_when_it_starts_and_ends(tiny_model_path, monkeypatch):
    from trellis.device import get_device_backend
    from trellis.utils.memory import set_host_memory

    set_host_memory("release")  # put back by the conftest
    eng = engine(tiny_model_path)
    calls = []
    monkeypatch.setattr(get_device_backend("cpu"), "empty_cache", lambda: calls.append("empty_cache"))
    with eng.phase(optimizer=True):
        assert calls == ["empty_cache"]  # what earlier stages freed
        with eng.phase():  # nested: only the outermost phase trims
            eng.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
        eng.optimizer_step()
        assert calls == ["empty_cache"]
    assert calls == ["empty_cache"] * 2  # what the phase freed
    with eng.phase():
        eng.forward(make_batch(4))
    assert calls == ["empty_cache"] * 4


# ---------------------------------------------------------------- shared CPU cores


def test_shared_cores_follow_the_ledger_at_every_layer_and_the_phase_marks_busy(tiny_model_path, tmp_path):
    from trellis.device.core_share import CoreShare

    owner = CoreShare.create([1, 1], directory=str(tmp_path))  # this process's one thread, one replica's
    replica = CoreShare.attach(owner.path, 1)  # the replica: idle, lending its thread
    eng = engine(tiny_model_path, mbs=4)  # one micro-batch of the 4 rows below
    eng.share_cores(owner)
    seen = []
    for layer in eng.model.model.layers:  # after the share's own hook: the threads this layer runs with
        layer.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    try:
        with eng.phase(optimizer=True):
            assert replica.others_busy() == [True]  # the phase marks the trainer busy
            eng.forward_backward(make_batch(4), policy_loss_fn("token-mean"))
            eng.optimizer_step()
        assert replica.others_busy() == [False]
        assert torch.get_num_threads() == 1  # between phases: the own share only
        assert seen == [2, 2]
        # the phase's entry, each of the 2 layers' forward and backward: all on the lent thread
        assert owner.take_counts() == (5, 5)
        seen.clear()
        with replica.busy(), eng.phase():  # the replica decodes: its thread is its own again
            eng.forward(make_batch(4))
        assert seen == [1, 1]
        assert owner.take_counts() == (3, 0)  # no backward in a forward pass
        eng.share_cores(None)  # hooks removed
        with eng.phase():
            eng.forward(make_batch(4))
        assert owner.take_counts() == (0, 0)
        assert replica.others_busy() == [False]
    finally:
        replica.close()
        owner.close()
