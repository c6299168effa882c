"""The fused RMSNorm (``trellis.engine.fused``, ``model.fused_kernels: [rms_norm]``): the same numbers as
Hugging Face's RMSNorm modules with fewer saved bytes, swapped into Llama / Qwen2 / Qwen3 and engines."""

from __future__ import annotations

import copy
import importlib.util
import textwrap

import pytest
import torch

from trellis.config.schema import ActorConfig, ModelConfig, OptimConfig
from trellis.data.protocol import DataProto
from trellis.engine import fused
from trellis.engine.fused import (
    FusedRMSNorm,
    RMSNormFunction,
    apply_fused_kernels,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)
from trellis.engine.single import SingleEngine

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="the Triton kernels need CUDA and triton"
)


def setup_module() -> None:
    torch.set_num_threads(1)


def hf_norm_classes() -> dict[str, type]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm, "qwen3": Qwen3RMSNorm}


def hf_norm(kind: str, hidden: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A Hugging Face RMSNorm whose weight is not all ones (so that it matters)."""
    norm = hf_norm_classes()[kind](hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def assert_same_gradients(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Each parameter's gradient equal to 1e-6 of its largest entry (float32 sums of ~50-sized terms)."""
    got_params = dict(got.named_parameters())
    for name, param in want.named_parameters():
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(got_params[name].grad, param.grad, atol=1e-6 * scale, rtol=0, msg=name)


def forward_backward(fn, x: torch.Tensor, weight: torch.Tensor, seed: int = 1):
    """``(y, grad_x, grad_weight)`` of ``fn(x)`` for a random upstream gradient."""
    x = x.detach().requires_grad_(True)
    y = fn(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device, y.dtype)
    grad_x, grad_weight = torch.autograd.grad(y, (x, weight), upstream)
    return y, grad_x, grad_weight


# ---------------------------------------------------------------- the function


@pytest.mark.parametrize("shape", [(3, 5, 16), (2, 3, 4, 8), (8,)])
def test_gradcheck_in_float64(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=gen).requires_grad_(True)
    weight = (1 + 0.3 * torch.randn(shape[-1], dtype=torch.float64, generator=gen)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, weight))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("shape", [(4, 7, 48), (2, 6, 3, 16)], ids=["hidden", "heads"])
def test_float32_equals_hugging_face_forward_and_backward(kind, shape):
    """(batch, seq, hidden) as the layer norms see it, (batch, seq, heads, head_dim) as Qwen3's q/k norms."""
    norm = hf_norm(kind, shape[-1])
    x = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(2))
    want = forward_backward(norm, x, norm.weight)
    got = forward_backward(lambda x: rms_norm(x, norm.weight, norm.variance_epsilon), x, norm.weight)
    for name, a, b in zip(("y", "grad_x", "grad_weight"), got, want, strict=True):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_input_follows_hugging_face(weight_dtype):
    """A bfloat16 input (autocast) with float32 master weights, or a bfloat16 model: the same output dtype
    and numbers as the eager module (it rounds the normalised rows to bfloat16 where Hugging Face does)."""
    norm = hf_norm("llama", 64, dtype=weight_dtype)
    x = (3 * torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(3))).bfloat16()
    want = forward_backward(norm, x, norm.weight)
    got = forward_backward(lambda x: rms_norm(x, norm.weight, norm.variance_epsilon), x, norm.weight)
    for name, a, b in zip(("y", "grad_x", "grad_weight"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=name)  # bfloat16's tolerance: rtol 1.6e-2


def test_backward_returns_none_for_eps_and_skips_unneeded_gradients():
    x = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(8))
    y = rms_norm(x, weight, 1e-6)
    grads = y.grad_fn.apply(torch.ones_like(y))  # what RMSNormFunction.backward returns
    assert len(grads) == 3 and grads[2] is None
    assert grads[0].shape == x.shape and grads[1].shape == weight.shape
    frozen = rms_norm(x, weight.detach(), 1e-6)
    assert frozen.grad_fn.apply(torch.ones_like(frozen))[1] is None


def saved_tensors(fn, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors autograd saves for backward while ``fn(x)`` runs (one entry per save)."""
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(x)
    return saved


def activation_bytes(saved: list[torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of the distinct saved tensors that are not parameters (a tensor saved twice counts once)."""
    seen = {p.data_ptr() for p in params}
    total = 0
    for tensor in saved:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize(("dtype", "eager_ratio"), [(torch.float32, 2), (torch.bfloat16, 3)])
def test_saves_only_the_input_and_rstd(dtype, eager_ratio):
    norm = hf_norm("llama", 64)
    x = torch.randn(4, 16, 64).to(dtype).requires_grad_(True)
    ours = saved_tensors(lambda x: rms_norm(x, norm.weight, 1e-5), x)
    eager = saved_tensors(norm, x)

    assert [t.shape for t in ours] == [x.shape, norm.weight.shape, (4, 16, 1)]
    assert ours[0] is x and ours[1] is norm.weight and ours[2].dtype == torch.float32
    rows = 4 * 16
    ours_bytes, eager_bytes = activation_bytes(ours, [norm.weight]), activation_bytes(eager, [norm.weight])
    assert ours_bytes == x.numel() * x.element_size() + 4 * rows
    # eager: the input (a float32 copy of a bfloat16 one), rstd and the normalised rows
    assert eager_bytes == eager_ratio * x.numel() * x.element_size() + 4 * rows
    assert len(ours) < len(eager)


# ---------------------------------------------------------------- swapping the modules in


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama / Qwen2 / Qwen3 causal LM (hidden 32, vocab 128), norm weights off ones."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "attn_implementation": "eager",
    }
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    torch.manual_seed(seed)
    model = model_class(config_class(**common, **extra)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize(("kind", "expected"), [("llama", 5), ("qwen2", 5), ("qwen3", 9)])
def test_apply_swaps_every_rms_norm_and_keeps_logits_and_gradients(kind, expected):
    """2 layers × (input + post-attention norm) + the final norm; Qwen3 adds q_norm and k_norm per layer."""
    model = tiny_model(kind)
    swapped = copy.deepcopy(model)
    keys = list(model.state_dict())
    hf_classes = tuple(hf_norm_classes().values())
    norm_weights = {name: m.weight for name, m in swapped.named_modules() if isinstance(m, hf_classes)}

    assert apply_fused_kernels(swapped, ["rms_norm"]) == {"rms_norm": expected}

    norms = {name: m for name, m in swapped.named_modules() if isinstance(m, FusedRMSNorm)}
    assert norms.keys() == norm_weights.keys() and len(norms) == expected
    assert all(norms[name].weight is weight for name, weight in norm_weights.items())  # the same tensors
    assert all(m.variance_epsilon == 1e-5 for m in norms.values())
    assert not [m for m in swapped.modules() if isinstance(m, hf_classes)]
    assert list(swapped.state_dict()) == keys

    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    want, got = model(ids).logits, swapped(ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert_same_gradients(swapped, model)


def test_apply_keeps_eps_stored_as_eps():
    class OtherNorm(hf_norm_classes()["llama"]):  # a recognised class that stores ``eps``
        def __init__(self):
            super().__init__(8)
            del self.variance_epsilon
            self.eps = 1e-3

    parent = torch.nn.Sequential(OtherNorm())
    assert apply_fused_kernels(parent, ["rms_norm"]) == {"rms_norm": 1}
    assert isinstance(parent[0], FusedRMSNorm) and parent[0].variance_epsilon == 1e-3


def test_nothing_asked_changes_nothing():
    model = tiny_model("llama")
    assert apply_fused_kernels(model, []) == {}
    assert not [m for m in model.modules() if isinstance(m, FusedRMSNorm)]


def test_bad_names_are_refused_with_the_choices():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"unknown kernel 'layer_norm'; choose from \['rms_norm'\]"):
        apply_fused_kernels(model, ["rms_norm", "layer_norm"])
    with pytest.raises(
        ValueError, match=r"must be a list of kernel names, e.g. \[rms_norm\]; got 'rms_norm'"
    ):
        apply_fused_kernels(model, "rms_norm")
    assert not [m for m in model.modules() if isinstance(m, FusedRMSNorm)]  # refused before any swap


def test_a_model_without_a_supported_rms_norm_is_refused():
    class TinyGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)

    with pytest.raises(ValueError, match=r"no RMSNorm it replaces in TinyGPT; it supports \['LlamaRMSNorm'"):
        apply_fused_kernels(TinyGPT(), ["rms_norm"])


def test_the_cpu_path_never_imports_triton(python):
    code = textwrap.dedent(
        """
        import sys, torch
        from trellis.engine.fused import FusedRMSNorm
        norm = FusedRMSNorm(torch.nn.Parameter(torch.ones(8)), 1e-6)
        norm(torch.randn(2, 8, requires_grad=True)).sum().backward()
        print(sorted(m for m in sys.modules if m.startswith("triton") or m.endswith("triton_rms_norm")))
        """
    )
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------- in an engine

PROMPT, RESPONSE = 5, 4


def batch(bs: int = 4) -> DataProto:
    """Left-padded prompts + right-padded responses, a loss mask on the responses."""
    gen = torch.Generator().manual_seed(6)
    length = PROMPT + RESPONSE
    ids = torch.randint(4, 300, (bs, length), generator=gen)
    mask = torch.ones(bs, length, dtype=torch.long)
    mask[1, :2] = 0  # a shorter prompt
    mask[2, -1] = 0  # a shorter response
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "responses": ids[:, PROMPT:],
            "response_mask": mask[:, PROMPT:].float(),
        }
    )


def engine(path: str, kernels: list[str], dtype: str = "float32") -> SingleEngine:
    model = ModelConfig(path=path, dtype=dtype, use_remove_padding=False, fused_kernels=kernels)
    actor = ActorConfig(ppo_micro_batch_size_per_device=2, optim=OptimConfig(lr=1e-2))
    return SingleEngine(model, actor, role="actor", device="cpu")


def test_engine_with_fused_rms_norm_gives_the_same_log_probs_and_gradients(tiny_model_path):
    """model.fused_kernels: [rms_norm] swaps the tiny Llama's 5 norms; float32 log-probs and gradients
    equal an engine without it."""
    plain, fast = engine(tiny_model_path, []), engine(tiny_model_path, ["rms_norm"])
    assert plain.fused_kernels == {} and fast.fused_kernels == {"rms_norm": 5}
    assert sum(isinstance(m, FusedRMSNorm) for m in fast.model.modules()) == 5

    data = batch()
    want, got = plain.forward(data)["log_probs"], fast.forward(data)["log_probs"]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)

    def loss_fn(outputs, micro, info):
        return (outputs["log_probs"] * micro.batch["response_mask"]).sum(), {}

    plain.forward_backward(data, loss_fn)
    fast.forward_backward(data, loss_fn)
    assert_same_gradients(fast.model, plain.model)


def test_bfloat16_engine_with_fused_rms_norm_follows_the_eager_bfloat16_engine(tiny_model_path):
    """Under bfloat16 autocast the fused norm rounds where the eager one does: the log-probs agree far
    closer than bfloat16 and float32 do (~1e-3 apart here)."""
    data = batch()
    plain = engine(tiny_model_path, [], "bfloat16").forward(data)["log_probs"]
    fast = engine(tiny_model_path, ["rms_norm"], "bfloat16").forward(data)["log_probs"]
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- the Triton kernels


@needs_cuda_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 37, 576), (2, 9, 4, 64), (3, 1000)])
def test_triton_kernels_equal_the_torch_path(dtype, shape):
    """The CUDA kernels against the torch code on the same CUDA tensors, forward and backward."""
    from trellis.engine import triton_rms_norm

    gen = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype).cuda()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).cuda()
    assert fused._backend(x, weight) is triton_rms_norm

    y, rstd = triton_rms_norm.forward(x, weight, 1e-5)
    want_y, want_rstd = rms_norm_forward(x, weight, 1e-5)
    assert y.dtype == want_y.dtype == torch.float32 and rstd.shape == want_rstd.shape
    upstream = torch.randn(y.shape, generator=gen).cuda()
    grad_x, grad_weight = triton_rms_norm.backward(upstream, x, weight, rstd)
    want_x, want_weight = rms_norm_backward(upstream, x, weight, want_rstd)
    assert grad_x.dtype == dtype and grad_weight.dtype == torch.float32
    # bfloat16: rstd may differ in its last bit (tl.rsqrt), flipping the rounding of a normalised value
    # to bfloat16 now and then: one bfloat16 ulp in y, and in grad_weight's sums over the rows
    close = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-5, "rtol": 1.6e-2}
    torch.testing.assert_close(rstd, want_rstd, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, want_y, **close)
    torch.testing.assert_close(grad_x, want_x, **close)
    sums = {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 1.6e-2}
    torch.testing.assert_close(grad_weight, want_weight, **sums)


@needs_cuda_triton
def test_triton_function_backward_through_autograd():
    """RMSNormFunction on CUDA (Triton) against the eager Hugging Face module, a non-contiguous gradient
    (q_norm's output is transposed) included."""
    norm = hf_norm("qwen3", 64).cuda()
    x = torch.randn(2, 5, 3, 64, device="cuda")
    want = forward_backward(lambda x: norm(x).transpose(1, 2), x, norm.weight)
    got = forward_backward(
        lambda x: RMSNormFunction.apply(x, norm.weight, 1e-5).transpose(1, 2), x, norm.weight
    )
    for name, a, b in zip(("y", "grad_x", "grad_weight"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_kernels_in_the_interpreter(python):
    """Without a GPU: the kernels under TRITON_INTERPRET=1 on CPU tensors against the torch path. The
    interpreter truncates float32 → bfloat16 (a GPU rounds to nearest), so bfloat16 is checked to 2 ulps."""
    code = textwrap.dedent(
        """
        import torch
        from trellis.engine import triton_rms_norm as kernels
        from trellis.engine.fused import rms_norm_backward, rms_norm_forward
        gen = torch.Generator().manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)):
            for shape in ((3, 5, 48), (7, 100), (2, 3, 2, 16)):
                x = (3 * torch.randn(shape, generator=gen)).to(dtype)
                w = 1 + 0.3 * torch.randn(shape[-1], generator=gen)
                y, rstd = kernels.forward(x, w, 1e-5)
                want_y, want_rstd = rms_norm_forward(x, w, 1e-5)
                dy = torch.randn(y.shape, generator=gen)
                gx, gw = kernels.backward(dy, x, w, rstd)
                want_x, want_w = rms_norm_backward(dy, x, w, want_rstd)
                torch.testing.assert_close(rstd, want_rstd, atol=1e-6, rtol=1e-5)
                for a, b in ((y, want_y), (gx, want_x)):
                    assert a.dtype == b.dtype
                    torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=0)
                torch.testing.assert_close(gw, want_w, atol=tol * 10 * want_w.abs().max().item(), rtol=0)
        print("ok")
        """
    )
    result = python(code, env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
