"""A lean decoding step for Llama-family models: the ``hf`` replica's continuous decoder without the
``transformers`` forward around each token.

A decoding step of a small model is mostly Python and allocation: the ``transformers`` forward
builds a 4-D mask, rotary tables, output records and a ``DynamicCache`` that concatenates (copies)
every layer's keys and values to append one column. :class:`LeanDecoder` computes the same step
from the model's own modules and parameters (read at each step, so weight updates apply) with
one scaled-dot-product attention per layer over :class:`KVBuffers`: per-layer key and value
buffers with room for the running rows' remaining tokens, written in place.

On the CPU it multiplies the rows by copies of the large weights in a layout the GEMM reads faster
(``engine_kwargs.weight_layout``, :data:`WEIGHT_LAYOUTS`), taken once per decoder, i.e. once per
continuous session (a weight update always ends a session), for one more copy of those weights in
memory while the session runs:

- ``packed``: oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``), multiplied by
  ``torch.ops.mkldnn._linear_pointwise``, the pair ``torch.compile`` uses for CPU linears. A plain
  ``F.linear`` re-packs the weight on every call; at the 4-64 rows of a decoding step that packing
  is a large share of the call (SmolLM2's 49k x 576 output layer: 54 -> 93 GFLOP/s at 32 rows in
  fp32). The projections that read the same input are joined into one packed weight (a layer's
  ``q/k/v_proj``, and its ``gate/up_proj``), as vLLM's fused linears are: four multiplies a layer
  instead of seven, the small ``k/v`` weights packed with ``q``'s. Where torch was built without
  oneDNN, :func:`packed_layout_available` says so.
- ``transposed``: ``x @ Wᵀ`` with ``Wᵀ`` a contiguous ``(in, out)`` copy, which some CPUs' MKL GEMM
  runs faster than ``F.linear`` on the ``(out, in)`` one (docs/performance.md).
- ``plain``: no copy.

Which models (:func:`lean_unsupported` says why one is not): ``LlamaForCausalLM``-shaped decoders
(``model.model.layers`` of ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` with SiLU,
RMS norms; biases are used where present, so Qwen2 qualifies), rotary embeddings whose inverse
frequencies are fixed (``default``, ``linear``, ``llama3``) with no attention scaling, and a
``pretraining_tp`` of 1. Prefill passes keep the ``transformers`` forward: its cache is copied
into :class:`KVBuffers` once per admission.

Equal to the ``transformers`` step to float rounding (the tests compare logits and the
continuous decoder's tokens and log-probs); ``rollout.engine_kwargs.decode_step: hf`` turns it off.
A lean step calls the input embedding module but no other module's ``forward``: hooks a user put on
the model or its layers run on prefills only (``decode_step: hf`` runs them on every step).
"""

from __future__ import annotations

import functools
from typing import Any

MODEL_TYPES = ("llama", "qwen2")
"""``config.model_type`` values whose decoder layer :class:`LeanDecoder` reproduces."""
FIXED_ROPE = ("default", "linear", "llama3")
"""Rotary types whose inverse frequencies do not change with the sequence (a buffer of the model)."""
GROWTH = 64
"""Columns added when a buffer is full (a row resumed with more tokens than planned; rare)."""
WEIGHT_LAYOUTS = ("plain", "transposed", "packed")
"""The layouts a :class:`LeanDecoder` multiplies the large weights in (see the module docstring)."""
TRANSPOSE_MIN_ELEMENTS = 1 << 16
"""Smallest weight a transposed copy is kept of: smaller ones gain nothing on their layout."""
PACK_MIN_ELEMENTS = 1 << 17
"""Smallest weight a packed copy is kept of (joined weights: their sum): oneDNN's call costs ~15 µs more
than ``F.linear``'s, which a smaller weight's multiply does not win back (fp32, one thread)."""
PACK_ROWS_HINT = 32
"""The row count oneDNN packs for; the packed weight serves any number of rows (4-64 measured alike)."""
PACKED_DTYPES = ("float32", "bfloat16")
"""Weight dtypes packed where this CPU's oneDNN packs them (:func:`packed_dtypes`): float32 on every x86
CPU, bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; oneDNN refuses bf16 on AVX2 alone."""
TRANSPOSE_MIN_ROWS = 4
"""Fewest rows multiplied through a transposed copy: one to three rows run a GEMV, at least as fast on
the original layout. A packed copy serves any number of rows: at one to three rows it is as fast as
``F.linear`` or up to 5x faster (SmolLM2's output layer, fp32, three rows)."""


# projections of one input that the ``packed`` layout joins into one weight: one multiply, split after
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def _packable(weights: list[Any]) -> bool:
    """Whether ``weights`` (one, or several joined) get a packed copy: on the CPU, one dtype of
    :data:`PACKED_DTYPES`, :data:`PACK_MIN_ELEMENTS` in all."""
    dtypes = {str(w.dtype).removeprefix("torch.") for w in weights}
    return (
        sum(w.numel() for w in weights) >= PACK_MIN_ELEMENTS
        and all(w.device.type == "cpu" for w in weights)
        and len(dtypes) == 1
        and dtypes <= set(packed_dtypes())
    )


@functools.cache
def packed_dtypes() -> tuple[str, ...]:
    """The dtypes of :data:`PACKED_DTYPES` this CPU's oneDNN packs: each tried once on a small weight.

    oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on a CPU with AVX2
    alone (an AMD EPYC of that kind here), where such weights keep their original layout instead."""
    import torch

    if not packed_layout_available():
        return ()
    usable = []
    for name in PACKED_DTYPES:
        weight = torch.zeros(16, 16, dtype=getattr(torch, name))
        try:
            torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        except RuntimeError:
            continue
        usable.append(name)
    return tuple(usable)


def packed_layout_available() -> bool:
    """Whether this torch can pack weights for oneDNN (built with it, and the two ops present)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - resolving the op is the check
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def attention_upcast(x: Any) -> Any:
    """The dtype a decoding step's attention runs in instead of ``x``'s, or None for ``x``'s own.

    On the CPU, float32 for bf16 / fp16 activations: torch's CPU attention kernel took 7.3 ms in bf16
    and 3.2 ms on float32 copies of the same inputs (64 rows, 9 heads over 3, one query over 92 keys;
    the copies included), and the float32 result is the closer one to a float64 reference. Elsewhere
    (CUDA's half-precision kernels) None.
    """
    import torch

    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return None


def lean_unsupported(model: Any) -> str | None:
    """Why :class:`LeanDecoder` cannot decode ``model`` (a sentence), or None when it can."""
    import torch

    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {MODEL_TYPES}"
    inner: Any = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    rotary = getattr(inner, "rotary_emb", None)
    if layers is None or rotary is None or getattr(model, "lm_head", None) is None:
        return "it is not laid out as model.layers + model.rotary_emb + lm_head"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp is {config.pretraining_tp}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act is {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in FIXED_ROPE or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return f"rope_type {rope_type!r} (supported: {FIXED_ROPE}, without attention scaling)"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            return "a layer without self_attn.{q,k,v,o}_proj and mlp"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer whose mlp is not gate_proj / up_proj / down_proj"
        projections = [getattr(attn, n) for n in names] + [
            getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
        ]
        wrapped = next((p for p in projections if not isinstance(p, torch.nn.Linear)), None)
        if wrapped is not None:  # a LoRA layer's forward adds its adapters to the base weight's product
            kind = f"{type(wrapped).__module__}.{type(wrapped).__qualname__}"
            return f"a projection is a {kind}, not a torch.nn.Linear (adapters?)"
        if getattr(attn, "sliding_window", None):
            return "a sliding-window attention layer"
    return None


class KVBuffers:
    """Each layer's keys and values of the running rows, ``(rows, kv_heads, capacity, head_dim)``, of
    which the first :attr:`width` columns hold tokens (left-padded: every row's last token in column
    ``width - 1``); a step writes column ``width`` in place. After a :meth:`retire` they are views of
    the buffers first allocated (fewer rows, from a later column), never reallocated for it.

    Args:
        pairs: per layer ``(keys, values)`` of ``width`` columns (copied in).
        capacity: columns to allocate (at least ``width``): the width the rows can reach.
    """

    def __init__(self, pairs: list[tuple[Any, Any]], capacity: int) -> None:
        width = int(pairs[0][0].shape[2])
        capacity = max(int(capacity), width + 1)
        self.layers: list[tuple[Any, Any]] = []
        for keys, values in pairs:
            shape = (keys.shape[0], keys.shape[1], capacity, keys.shape[3])
            k, v = keys.new_empty(shape), values.new_empty(shape)
            k[:, :, :width] = keys
            v[:, :, :width] = values
            self.layers.append((k, v))
        self.width = width

    @property
    def capacity(self) -> int:
        return int(self.layers[0][0].shape[2])

    def pairs(self) -> list[tuple[Any, Any]]:
        """Per layer the used ``(keys, values)``: views of the buffers."""
        w = self.width
        return [(k[:, :, :w], v[:, :, :w]) for k, v in self.layers]

    def retire(self, keep: list[int], lead: int) -> list[int]:
        """Keep only rows ``keep`` (indices, ascending), from column ``lead`` on, in place: each row
        that stays past the new last row moves into a leaving row's slot (one copy of those rows' used
        columns), and the buffers become views of the first ``len(keep)`` rows from column ``lead``.
        Nothing else is copied, so a retirement costs the rows moved, not the whole cache.

        Returns the old index of the row now in each position (``keep`` reordered); the caller reorders
        its per-row state the same way.
        """
        import torch

        n, kept = len(keep), set(keep)
        holes = [i for i in range(n) if i not in kept]  # leaving rows inside the new first n
        movers = [i for i in keep if i >= n]  # staying rows beyond them: as many as holes
        order = list(range(n))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        layers = []
        for keys, values in self.layers:
            if holes:
                dst = torch.tensor(holes, dtype=torch.long, device=keys.device)
                src = torch.tensor(movers, dtype=torch.long, device=keys.device)
                for buffer in (keys, values):
                    used = buffer[:, :, : self.width]
                    used.index_copy_(0, dst, used.index_select(0, src))
            layers.append((keys[:n, :, lead:], values[:n, :, lead:]))
        self.layers = layers
        self.width -= lead
        return order

    def make_room(self) -> None:
        """Grow by :data:`GROWTH` columns when the next step's column is past the end."""
        if self.width >= self.capacity:
            fresh = KVBuffers(self.pairs(), self.width + GROWTH)
            self.layers = fresh.layers


class LeanDecoder:
    """One decoding step of a model :func:`lean_unsupported` accepts; see the module docstring.

    Args:
        model: the causal LM (its parameters are read at every step, but for the weight copies).
        layout: one of :data:`WEIGHT_LAYOUTS` (CPU layouts but ``plain``): ``transposed`` copies the
            weights of at least :data:`TRANSPOSE_MIN_ELEMENTS`, ``packed`` those of at least
            :data:`PACK_MIN_ELEMENTS` in :data:`PACKED_DTYPES`, each layer's :data:`QKV` and
            :data:`GATE_UP` joined. The copies are taken here: build a new decoder after the weights
            change. :attr:`weight_copies` counts them (a joined copy once), :attr:`joined_copies` the
            joined ones.

    Raises:
        ValueError: a model :func:`lean_unsupported` refuses, an unknown layout, or ``packed`` where
            :func:`packed_layout_available` is false.
    """

    def __init__(self, model: Any, layout: str = "plain") -> None:
        import torch

        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot decode this model: {reason}.")
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"LeanDecoder layout must be one of {WEIGHT_LAYOUTS}, got {layout!r}.")
        if layout == "packed" and not packed_layout_available():
            raise ValueError(
                "LeanDecoder layout 'packed' needs torch built with oneDNN (torch.backends.mkldnn); "
                "use 'plain' or 'transposed'."
            )
        self.model = model
        self.inner = model.model
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.layout = layout
        self._copies: dict[int, Any] = {}  # id(weight) -> its copy in ``layout``
        # (id(parent module), first projection's name) -> (packed joined weight, joined bias, out sizes)
        self._joined: dict[tuple[int, str], tuple[Any, Any, list[int]]] = {}
        with torch.no_grad():
            joined: set[int] = set()  # id(weight) of the projections multiplied through a joined copy
            if layout == "packed":
                for layer in self.inner.layers:
                    for parent, names in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
                        joined |= self._join(parent, names)
            for module in model.modules():
                if not isinstance(module, torch.nn.Linear) or id(module.weight) in joined:
                    continue
                weight = module.weight.detach()
                if layout == "transposed" and weight.numel() >= TRANSPOSE_MIN_ELEMENTS:
                    self._copies[id(module.weight)] = weight.t().contiguous()
                if layout == "packed" and _packable([weight]):
                    self._copies[id(module.weight)] = torch.ops.mkldnn._reorder_linear_weight(
                        weight, PACK_ROWS_HINT
                    )
        self.weight_copies = len(self._copies) + len(self._joined)
        self.joined_copies = len(self._joined)

    def _join(self, parent: Any, names: tuple[str, ...]) -> set[int]:
        """Pack the weights of ``parent``'s projections ``names`` (one input) as one, stacked by output;
        ``id`` of each weight joined (none when :func:`_packable` refuses them together)."""
        import torch

        modules = [getattr(parent, n) for n in names]
        weights = [m.weight.detach() for m in modules]
        if not _packable(weights):
            return set()
        sizes = [int(w.shape[0]) for w in weights]
        bias = None
        if any(m.bias is not None for m in modules):  # a missing bias joins as zeros
            bias = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(n)
                              for m, w, n in zip(modules, weights, sizes, strict=True)])  # fmt: skip
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), PACK_ROWS_HINT)
        self._joined[(id(parent), names[0])] = (packed, bias, sizes)
        return {id(m.weight) for m in modules}

    # ------------------------------------------------------------------ pieces

    def _linear(self, x: Any, module: Any) -> Any:
        import torch
        import torch.nn.functional as F

        copy = self._copies.get(id(module.weight))
        flat = x.reshape(-1, x.shape[-1])
        if copy is None or (self.layout == "transposed" and flat.shape[0] < TRANSPOSE_MIN_ROWS):
            return F.linear(x, module.weight, module.bias)
        if self.layout == "packed":
            return self._packed(x, copy, module.bias)
        if module.bias is None:
            out = torch.mm(flat, copy)
        else:
            out = torch.addmm(module.bias, flat, copy)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _project(self, x: Any, parent: Any, names: tuple[str, ...]) -> list[Any]:
        """``parent``'s projections ``names`` of ``x``: one multiply by their joined copy where there is
        one (its output split back), else one each."""

        joined = self._joined.get((id(parent), names[0]))
        if joined is None:
            return [self._linear(x, getattr(parent, n)) for n in names]
        packed, bias, sizes = joined
        return list(self._packed(x, packed, bias).split(sizes, dim=-1))

    @staticmethod
    def _packed(x: Any, packed: Any, bias: Any) -> Any:
        """``x`` (any leading shape) times the weight oneDNN packed as ``packed``, plus ``bias``."""
        import torch

        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def _norm(x: Any, norm: Any) -> Any:
        """``transformers``' RMS norm: in fp32, scaled by the weight in the input's dtype."""
        import torch
        import torch.nn.functional as F

        if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    def _rotary(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        """``cos`` and ``sin`` for each row's position, ``(rows, 1, 1, head_dim)``."""
        import torch

        inv_freq = self.inner.rotary_emb.inv_freq
        freqs = positions[:, None].to(torch.float32) * inv_freq[None, :].to(torch.float32)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, None, :], emb.sin().to(dtype)[:, None, None, :]

    @staticmethod
    def _rotate(x: Any, cos: Any, sin: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    # ------------------------------------------------------------------ the step

    def step(self, tokens: Any, positions: Any, mask: Any, kv: KVBuffers) -> Any:
        """The next-token logits ``(rows, vocab)`` of every running row.

        Args:
            tokens: ``(rows,)`` each row's last token.
            positions: ``(rows,)`` its position id.
            mask: ``(rows, kv.width + 1)``, nonzero on real tokens (the new column included).
            kv: the rows' cache; this step's keys and values land in column ``kv.width``, which
                then grows by one.
        """
        import torch
        import torch.nn.functional as F

        kv.make_room()
        rows, col = tokens.shape[0], kv.width
        attend = mask.to(torch.bool)[:, None, None, :]
        x = self.inner.embed_tokens(tokens)[:, None, :]
        cos, sin = self._rotary(positions, x.dtype)
        upcast = attention_upcast(x)
        h_, kvh, d = self.heads, self.kv_heads, self.head_dim
        for layer, (keys, values) in zip(self.inner.layers, kv.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            h = self._norm(x, layer.input_layernorm)
            q, k, v = self._project(h, attn, QKV)
            q = q.view(rows, 1, h_, d).transpose(1, 2)
            keys[:, :, col : col + 1] = self._rotate(k.view(rows, 1, kvh, d).transpose(1, 2), cos, sin)
            values[:, :, col : col + 1] = v.view(rows, 1, kvh, d).transpose(1, 2)
            q, k, v = self._rotate(q, cos, sin), keys[:, :, : col + 1], values[:, :, : col + 1]
            if upcast is not None:
                q, k, v = q.to(upcast), k.to(upcast), v.to(upcast)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attend, scale=attn.scaling, enable_gqa=kvh != h_
            ).to(x.dtype)
            x = x + self._linear(out.transpose(1, 2).reshape(rows, 1, h_ * d), attn.o_proj)
            h = self._norm(x, layer.post_attention_layernorm)
            gate, up = self._project(h, mlp, GATE_UP)
            gated = F.silu(gate) * up
            x = x + self._linear(gated, mlp.down_proj)
        kv.width = col + 1
        return self._linear(self._norm(x[:, -1, :], self.inner.norm), self.model.lm_head)
