"""The fused RMSNorm (``model.fused_kernels: [rms_norm]``) next to Hugging Face's eager module, in one run.

    python benchmarks/rms_norm.py [--rows 16384] [--hidden 576] [--repeats 10] [--devices cpu,cuda]

An input of ``--rows`` rows (default 8 × 2048 tokens) of ``--hidden`` values (default 576,
SmolLM2-135M's hidden size), float32 and bfloat16, normalised with a float32 weight (the engines
keep float32 master weights; a bfloat16 input is what autocast feeds a norm after a matmul).
Each call is forward, then ``torch.autograd.grad`` of the output with a random upstream gradient
for both the input and the weight. Sides:

- eager: ``transformers``' ``LlamaRMSNorm`` (Qwen2's and Qwen3's are the same code). The baseline.
- fused: ``trellis.engine.fused.rms_norm``: the torch code on CPU, the Triton kernels on CUDA when
  triton imports (the ``backend`` column says which ran).

Figures: the median wall time of ``--repeats`` calls per side (sides alternating, after one
warm-up call each; CUDA timings synchronise), and the bytes autograd saves for backward, counted
through ``torch.autograd.graph.saved_tensors_hooks``: distinct tensors, parameters left out (the
weight is saved on both sides and costs nothing extra). Ratios are fused / eager. Target: fused
no slower than eager with fewer saved bytes. torch's default threads. This is a measurement,
never a pass/fail test. :func:`measure` is the importable part (``benchmarks/offload.py`` uses it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from trellis.engine import fused

MIB = 2**20
HIDDEN = 576
"""SmolLM2-135M's hidden size."""
EPS = 1e-5


def _saved_bytes(call: Callable[[], Any], params: list[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves while ``call()`` runs its forward."""
    seen = {p.data_ptr() for p in params}
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call()
    return total


def _timed(call: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def backend_name(device: torch.device) -> str:
    """What the fused side runs on ``device``: ``"triton"`` or ``"torch"``."""
    probe = torch.zeros(1, 8, device=device)
    return "triton" if fused._backend(probe, probe[0]) is not None else "torch"


def measure(
    rows: int, hidden: int = HIDDEN, dtype: torch.dtype | str = torch.float32, repeats: int = 10,
    device: str = "cpu",
) -> dict[str, Any]:  # fmt: skip
    """Forward + backward of the fused RMSNorm and the eager ``LlamaRMSNorm`` on the same input.

    Args:
        rows: rows of the input ``(rows, hidden)`` (tokens: batch × sequence).
        hidden: the normalised dim.
        dtype: the input's dtype (a ``torch.dtype`` or its name); the weight is float32.
        repeats: timed calls per side (the median is kept).
        device: where to run (``"cpu"``, ``"cuda"``).

    Returns:
        ``{"device", "dtype", "backend", "eager_s", "fused_s", "time_ratio", "eager_saved_bytes",
        "fused_saved_bytes", "saved_ratio"}``: median seconds per call, saved bytes, fused / eager.
    """
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    where = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    eager = LlamaRMSNorm(hidden, eps=EPS).to(where)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    weight = eager.weight
    x = torch.randn(rows, hidden, generator=gen).to(where, dtype).requires_grad_(True)
    upstream = torch.randn(rows, hidden, generator=gen).to(where, torch.promote_types(dtype, weight.dtype))
    sides: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager": eager,
        "fused": lambda x: fused.rms_norm(x, weight, EPS),
    }

    def step(side: str) -> None:
        torch.autograd.grad(sides[side](x), (x, weight), upstream)

    saved = {side: _saved_bytes(lambda side=side: sides[side](x), [weight]) for side in sides}
    for side in sides:
        step(side)  # warm-up
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            times[side].append(_timed(lambda side=side: step(side), where))
    eager_s, fused_s = (statistics.median(times[side]) for side in sides)
    return {
        "device": where.type,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend_name(where),
        "eager_s": round(eager_s, 5),
        "fused_s": round(fused_s, 5),
        "time_ratio": round(fused_s / eager_s, 3),
        "eager_saved_bytes": saved["eager"],
        "fused_saved_bytes": saved["fused"],
        "saved_ratio": round(saved["fused"] / saved["eager"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8 * 2048, help="rows (tokens) of the input")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per side")
    parser.add_argument("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped without one")
    args = parser.parse_args()
    devices = [name.strip() for name in args.devices.split(",") if name.strip()]

    print(
        f"Fused RMSNorm vs eager LlamaRMSNorm, forward + backward of a ({args.rows}, {args.hidden}) input, "
        f"float32 weight, median of {args.repeats}. (python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    header = f"{'device':<6} {'dtype':<9} {'backend':<7} {'eager ms':>9} {'fused ms':>9} {'time':>7}  "
    header += f"{'eager saved':>11} {'fused saved':>11} {'saved':>7}"
    print(header)
    print("-" * len(header))
    for device in devices:
        if device.startswith("cuda") and not torch.cuda.is_available():
            print(f"{device:<6} skipped: no CUDA device")
            continue
        for dtype in (torch.float32, torch.bfloat16):
            r = measure(args.rows, args.hidden, dtype, args.repeats, device=device)
            print(
                f"{r['device']:<6} {r['dtype']:<9} {r['backend']:<7} {r['eager_s'] * 1e3:>9.2f} "
                f"{r['fused_s'] * 1e3:>9.2f} {r['time_ratio']:>6.2f}x  "
                f"{r['eager_saved_bytes'] / MIB:>7.1f} MiB {r['fused_saved_bytes'] / MIB:>7.1f} MiB "
                f"{r['saved_ratio']:>6.2f}x"
            )


if __name__ == "__main__":
    main()
