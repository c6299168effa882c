"""DataProto: the one container that travels between the stages of an RL step.

A :class:`DataProto` holds three things:

* ``batch``: a :class:`tensordict.TensorDict` of per-sample tensors, batch size ``(n,)``
  (or ``None``);
* ``non_tensor_batch``: ``{key: numpy array}``, one row per sample (usually ``dtype=object``
  holding strings, dicts, lists);
* ``meta_info``: a plain dict of batch-wide values (temperature, metrics, ...).

The API keeps the names and semantics users of verl know (``from_dict``, ``select``, ``pop``,
``union``, ``chunk``, ``concat``, ``repeat``, ``make_iterator``, ...). Every misuse raises
:class:`~trellis.errors.DataProtoError` naming the key and the sizes, type or index involved.

Speed: row operations work per tensor with ``index_select`` / ``torch.cat`` and numpy fancy
indexing, never per row in Python. An object built by an operation on a consistent object is
consistent by construction and is not re-checked; only the public constructors and in-place
mutations run :meth:`DataProto.check_consistency`.

Mutating operations (``pop``, ``union``, ``rename``, ``reorder``, ``to``) replace ``batch``,
``non_tensor_batch`` and ``meta_info`` with new containers instead of editing the old ones, so a
``TensorDict`` or dict shared with another object is never changed behind its back.

Auto-padding. :meth:`DataProto.chunk` needs ``len(data)`` to be a multiple of ``chunks``. With
auto-padding on, it first pads by repeating rows from the start (see
:func:`pad_dataproto_to_divisor`) so that every chunk has the same size; the
``pad_size = -len(data) % chunks`` padding rows sit at the end, so
``unpad_dataproto(DataProto.concat(outputs), pad_size)`` recovers one output row per input row.
Auto-padding is on for an object when ``data.auto_padding`` is set (stored in
``meta_info["_trellis_auto_padding"]``; ``from_dict(..., auto_padding=True)`` sets it), or
globally inside ``with auto_padding():``, or, outside any such block, when the environment
variable ``TRELLIS_AUTO_PADDING`` is ``1``/``true``/``yes``/``on``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from tensordict.utils import is_non_tensor

from trellis.errors import DataProtoError, DataProtoIndexError

__all__ = [
    "AUTO_PADDING_ENV",
    "AUTO_PADDING_KEY",
    "DataProto",
    "DataProtoItem",
    "auto_padding",
    "is_auto_padding_enabled",
    "pad_dataproto_to_divisor",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

AUTO_PADDING_KEY = "_trellis_auto_padding"
AUTO_PADDING_ENV = "TRELLIS_AUTO_PADDING"
_TRUE_WORDS = ("1", "true", "yes", "on")

# None: not inside an `auto_padding()` block, the environment variable decides.
_auto_padding_override: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "trellis_auto_padding", default=None
)


@contextlib.contextmanager
def auto_padding(enabled: bool = True) -> Iterator[None]:
    """Turn auto-padding on (or off) for every DataProto inside the ``with`` block.

    Inside the block this overrides ``TRELLIS_AUTO_PADDING``; an object whose own flag is set
    pads regardless. Safe across threads and asyncio tasks (a context variable).
    """
    if not isinstance(enabled, bool):
        raise DataProtoError(f"auto_padding(enabled) takes a bool, got {type(enabled).__name__}.")
    token = _auto_padding_override.set(enabled)
    try:
        yield
    finally:
        _auto_padding_override.reset(token)


def is_auto_padding_enabled() -> bool:
    """The global setting: the innermost ``auto_padding()`` block, else ``TRELLIS_AUTO_PADDING``."""
    override = _auto_padding_override.get()
    if override is not None:
        return override
    return os.environ.get(AUTO_PADDING_ENV, "").strip().lower() in _TRUE_WORDS


# ---------------------------------------------------------------- small helpers


def _type_name(value: Any) -> str:
    return type(value).__name__


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _keys_list(keys: str | Sequence[str] | None, what: str) -> list[str] | None:
    """None stays None; one str becomes a one-key list; anything else must be strings."""
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, Mapping) or not isinstance(keys, (Sequence, set, frozenset)):
        raise DataProtoError(f"{what} must be a str or a list of str, got {_type_name(keys)}.")
    out = list(keys)
    for key in out:
        if not isinstance(key, str):
            raise DataProtoError(f"{what} must hold str keys, got {key!r} ({_type_name(key)}).")
    return out


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataProtoError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


def _object_column(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array with one element per value; nested lists stay list elements.

    ``np.array(list_of_lists, dtype=object)`` would build a 2-D array instead.
    """
    return np.fromiter(values, dtype=object, count=len(values))


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality that copes with tensors, arrays, NaN and containers of them."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b)
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        return (
            isinstance(a, TensorDictBase)
            and isinstance(b, TensorDictBase)
            and a.batch_size == b.batch_size
            and set(a.keys()) == set(b.keys())
            and all(_values_equal(a.get(k), b.get(k)) for k in a.keys())  # noqa: SIM118 (a TensorDict)
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN == NaN here: a missing score is the same missing score
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    try:
        return bool(a == b)
    except Exception:
        return False


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True  # the same memory
    return bool(torch.equal(a, b.to(a.device)))


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    if a.dtype != object and b.dtype != object:
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # equal_nan on a dtype without NaN (strings, ints vs strings)
            return bool(np.array_equal(a, b))
    try:
        same = a == b
    except Exception:  # elements whose == is ambiguous (arrays): compare them one by one
        same = None
    if isinstance(same, np.ndarray) and same.dtype == bool and same.shape == a.shape:
        if same.all():
            return True
        # Only the mismatches need a second look (NaN, containers of arrays).
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        return all(_values_equal(flat_a[i], flat_b[i]) for i in np.flatnonzero(~same.reshape(-1)))
    return all(
        _values_equal(x, y) for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True)
    )


def _map_batch(batch: TensorDictBase, fn: Any, rows: int) -> TensorDictBase:
    """A new TensorDict with ``fn(tensor)`` for every leaf; first batch dim becomes ``rows``."""
    batch_size = torch.Size([rows, *batch.batch_size[1:]])
    if type(batch) is not TensorDict:
        mapped = batch.apply(fn, batch_size=batch_size)
        assert mapped is not None  # apply() returns None only when told to work in place
        return mapped
    source: dict[str, Any] = {}
    for key, value in batch.items():
        source[key] = _map_batch(value, fn, rows) if isinstance(value, TensorDictBase) else fn(value)
    return TensorDict(source, batch_size=batch_size, device=batch.device)


def _select_tensors(batch: TensorDictBase, keys: Sequence[Any]) -> TensorDictBase:
    """``batch.select(*keys)``, about three times faster for top-level keys of a plain TensorDict.

    The fast path builds the result the way ``TensorDict.select`` does internally; anything it
    does not cover (nested keys, dim names, shared or memory-mapped storage, a missing key, a
    tensordict version without these internals) takes the public ``select``.
    """
    if type(batch) is TensorDict:
        entries = getattr(batch, "_tensordict", None)
        plain = not (
            getattr(batch, "_td_dim_names", True) is not None
            or getattr(batch, "_is_memmap", True)
            or getattr(batch, "_is_shared", True)
        )
        if entries is not None and plain:
            try:
                source = {key: entries[key] for key in keys}
            except (KeyError, TypeError):
                pass
            else:
                return TensorDict._new_unsafe(source=source, batch_size=batch.batch_size, device=batch.device)
    return batch.select(*keys)


def _index_on(index: np.ndarray) -> Any:
    """``index`` as an int64 tensor on whichever device asks for it, converted once per device."""
    cpu = torch.from_numpy(index)
    per_device: dict[torch.device, torch.Tensor] = {cpu.device: cpu}

    def on(device: torch.device) -> torch.Tensor:
        found = per_device.get(device)
        if found is None:
            found = per_device[device] = cpu.to(device, non_blocking=True)
        return found

    return on


def _gather_batch(batch: TensorDictBase, index: np.ndarray) -> TensorDictBase:
    # index_select is about twice as fast as advanced indexing (what `td[index]` does).
    on = _index_on(index)
    return _map_batch(batch, lambda t: t.index_select(0, on(t.device)), len(index))


def _cat_batches(batches: Sequence[TensorDictBase]) -> TensorDictBase:
    """Concatenate along dim 0, per key; errors name the key and the shapes."""
    first = batches[0]
    rows = sum(b.batch_size[0] for b in batches)
    batch_size = torch.Size([rows, *first.batch_size[1:]])
    source: dict[str, torch.Tensor | TensorDictBase] = {}
    for key, value in first.items():
        values = [value, *(b.get(key) for b in batches[1:])]
        if isinstance(value, TensorDictBase):
            source[key] = _cat_batches(values)
            continue
        try:
            source[key] = torch.cat(values, dim=0)
        except (RuntimeError, TypeError) as exc:
            shapes = ", ".join(
                f"part {i}: {tuple(v.shape)} {v.dtype} on {v.device}" for i, v in enumerate(values)
            )
            raise DataProtoError(f"Cannot concat tensor {key!r}: {shapes} ({exc}).") from None
    return TensorDict(source, batch_size=batch_size, device=first.device)


def union_tensor_dict(tensors1: TensorDictBase, tensors2: TensorDictBase) -> TensorDictBase:
    """A new TensorDict with the entries of both; neither input is changed.

    Raises:
        DataProtoError: the batch sizes differ, or a key holds different tensors in the two.
    """
    if tensors1.batch_size != tensors2.batch_size:
        raise DataProtoError(
            f"Cannot union tensors: batch sizes differ, {tuple(tensors1.batch_size)} and "
            f"{tuple(tensors2.batch_size)}."
        )
    result = tensors1.copy()
    for key, value in tensors2.items():
        if key in tensors1.keys():  # noqa: SIM118 (TensorDict has no `in`)
            if not _values_equal(tensors1.get(key), value):
                raise DataProtoError(
                    f"Cannot union: tensor {key!r} is present in both with different values. "
                    "Rename one of them, or pop it from one side first."
                )
            continue
        result.set(key, value)
    return result


def union_numpy_dict(arrays1: dict[str, np.ndarray], arrays2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A new dict with the columns of both; neither input is changed.

    Raises:
        DataProtoError: a key holds different arrays (values or shapes) in the two.
    """
    result = dict(arrays1)
    for key, value in arrays2.items():
        if key in arrays1:
            if not _values_equal(arrays1[key], value):
                raise DataProtoError(
                    f"Cannot union: non-tensor {key!r} is present in both with different values "
                    f"(shapes {arrays1[key].shape} and {value.shape}). Rename one of them, or pop it "
                    "from one side first."
                )
            continue
        result[key] = value
    return result


# ---------------------------------------------------------------- pickling of tensors


# (dtype name, shape, device, requires_grad, the elements' bytes as a uint8 array)
_PackedTensor = tuple[str, tuple[int, ...], str, bool, np.ndarray]


def _pack_tensor(tensor: torch.Tensor) -> _PackedTensor:
    """(dtype, shape, device, requires_grad, bytes as uint8 ndarray) of exactly the tensor's elements.

    A view (a chunk, a slice) holds only its own elements, not the whole storage it points into,
    as plain pickling of a view would.
    """
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg()  # no-ops unless a lazy complex view
    nbytes = data.numel() * data.element_size()
    if not data.is_contiguous() or data.storage_offset() != 0 or data.untyped_storage().nbytes() != nbytes:
        data = data.clone(memory_format=torch.contiguous_format)  # exactly its own elements
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return (
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
        str(tensor.device),
        tensor.requires_grad,
        raw,
    )


def _unpack_tensor(packed: _PackedTensor) -> torch.Tensor:
    dtype_name, shape, device, requires_grad, raw = packed
    if not raw.flags.writeable:  # an out-of-band read-only buffer: torch needs writable memory
        raw = raw.copy()
    tensor = torch.from_numpy(raw).view(getattr(torch, dtype_name)).reshape(shape)
    if device != "cpu":
        tensor = tensor.to(device)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _pack_batch(batch: TensorDictBase) -> Any:
    if type(batch) is not TensorDict:
        return ("object", batch)  # another TensorDictBase: its own pickling
    entries = [
        (key, "td", _pack_batch(value))
        if isinstance(value, TensorDictBase)
        else (key, "t", _pack_tensor(cast(torch.Tensor, value)))  # a plain TensorDict's leaves
        for key, value in batch.items()
    ]
    device = None if batch.device is None else str(batch.device)
    return ("td", tuple(batch.batch_size), device, entries)


def _unpack_batch(packed: Any) -> TensorDictBase:
    if packed[0] == "object":
        return cast(TensorDictBase, packed[1])
    _, batch_size, device, entries = packed
    source = {
        key: _unpack_batch(value) if kind == "td" else _unpack_tensor(value) for key, kind, value in entries
    }
    return TensorDict(source, batch_size=batch_size, device=device)


# ---------------------------------------------------------------- the item


@dataclass
class DataProtoItem:
    """One row of a :class:`DataProto`: ``data[i]``.

    ``batch`` is a TensorDict with batch size ``()`` (or None), ``non_tensor_batch`` maps each
    column to its value in this row, ``meta_info`` is the batch-wide dict.
    """

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- DataProto


class DataProto:
    """Per-sample tensors, per-sample non-tensors and batch-wide metadata, kept consistent.

    Args:
        batch: a TensorDict whose first batch dim counts samples, or None.
        non_tensor_batch: ``{key: numpy array}``, each with one row per sample.
        meta_info: batch-wide values.

    Raises:
        DataProtoError: the three parts disagree (see :meth:`check_consistency`).
    """

    def __init__(
        self,
        batch: TensorDictBase | None = None,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ):
        self.batch = batch
        self.non_tensor_batch = {} if non_tensor_batch is None else non_tensor_batch
        self.meta_info = {} if meta_info is None else meta_info
        self.check_consistency()

    @classmethod
    def _unchecked(
        cls, batch: TensorDictBase | None, non_tensor_batch: dict[str, np.ndarray], meta_info: dict[str, Any]
    ) -> DataProto:
        # For results built from a consistent object: consistent by construction, no re-check.
        self = cls.__new__(cls)
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info
        return self

    @property
    def tensors(self) -> TensorDictBase:
        """The per-sample tensors (``batch``), for code that needs them.

        Raises:
            DataProtoError: this DataProto holds no tensors (``batch`` is None).
        """
        if self.batch is None:
            raise DataProtoError(
                f"This DataProto holds no tensors (batch is None; non-tensor keys: "
                f"{sorted(self.non_tensor_batch)}); build it with tensors= to use them."
            )
        return self.batch

    def _derive(self, batch: TensorDictBase | None, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return type(self)._unchecked(batch, non_tensor_batch, dict(self.meta_info))

    # -- construction

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor | TensorDictBase] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from ``{key: tensor}``, ``{key: array or list}`` and a meta dict.

        The first ``num_batch_dims`` dims of every tensor are the batch dims and must agree.
        Non-tensor lists and tuples become 1-D object arrays (one element per sample, nested
        lists kept as elements). More than one batch dim is only allowed without non-tensors.

        Raises:
            DataProtoError: a value of the wrong type, a tensor with too few dims, or batch
                sizes that disagree (the message names both keys and sizes).
        """
        num_batch_dims = _positive_int(num_batch_dims, "num_batch_dims")
        tensors = dict(tensors or {})
        batch_size: torch.Size | None = None
        pivot = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, (torch.Tensor, TensorDictBase)):
                raise DataProtoError(
                    f"Tensor {key!r} must be a torch.Tensor, got {_type_name(tensor)}. Pass numpy arrays "
                    "and lists as non_tensors."
                )
            if tensor.dim() < num_batch_dims:
                raise DataProtoError(
                    f"Tensor {key!r} has shape {tuple(tensor.shape)}, fewer dims than "
                    f"num_batch_dims={num_batch_dims}."
                )
            current = tensor.shape[:num_batch_dims]
            if batch_size is None:
                batch_size, pivot = current, key
            elif current != batch_size:
                raise DataProtoError(
                    f"Tensor {key!r} has batch size {tuple(current)} but tensor {pivot!r} has "
                    f"{tuple(batch_size)} (num_batch_dims={num_batch_dims}); every tensor must share "
                    "its batch dims."
                )
        columns: dict[str, np.ndarray] = {}
        for key, value in (non_tensors or {}).items():
            if isinstance(value, np.ndarray):
                columns[key] = value
            elif isinstance(value, (list, tuple)):
                columns[key] = _object_column(value)
            else:
                raise DataProtoError(
                    f"Non-tensor {key!r} must be a numpy array or a list (one row per sample), got "
                    f"{_type_name(value)}. Batch-wide values belong in meta_info."
                )
        meta = dict(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        batch = TensorDict(tensors, batch_size=batch_size) if tensors else None
        return cls(batch=batch, non_tensor_batch=columns, meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict: tensors go to ``batch``, numpy arrays to ``non_tensor_batch``.

        Raises:
            DataProtoError: a value is neither (the message names the key and its type).
        """
        tensors: dict[str, torch.Tensor] = {}
        non_tensors: dict[str, np.ndarray] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            else:
                raise DataProtoError(
                    f"Value of {key!r} is a {_type_name(value)}; from_single_dict takes torch.Tensor "
                    "(into batch) or numpy.ndarray (into non_tensor_batch). Wrap lists with "
                    "np.array(values, dtype=object); put batch-wide values in meta_info."
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: TensorDictBase,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a TensorDict as :meth:`to_tensordict` writes it.

        Tensors go to ``batch``; a ``NonTensorStack`` (one value per row) to
        ``non_tensor_batch`` as a 1-D object array; a ``NonTensorData`` (one value for all rows)
        to ``meta_info``. ``meta_info`` given here wins over entries of the TensorDict.
        """
        if not isinstance(tensor_dict, TensorDictBase):
            raise DataProtoError(f"from_tensordict takes a TensorDict, got {_type_name(tensor_dict)}.")
        tensors: dict[str, Any] = {}  # from_dict checks each value
        non_tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {}
        for key, value in tensor_dict.items():
            if isinstance(value, NonTensorStack):
                non_tensors[key] = _object_column(value.tolist())
            elif is_non_tensor(value):
                meta[key] = value.data
            else:
                tensors[key] = value
        meta.update(meta_info or {})
        return cls.from_dict(
            tensors, non_tensors, meta, num_batch_dims=num_batch_dims, auto_padding=auto_padding
        )

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors as they are, each non-tensor column as a ``NonTensorStack``,
        each meta_info entry as a ``NonTensorData``. :meth:`from_tensordict` reverses it.

        Raises:
            DataProtoError: a meta_info key is also a column name.
        """
        n = len(self)
        result = TensorDict({}, batch_size=[n]) if self.batch is None else self.batch.copy()
        for key, column in self.non_tensor_batch.items():
            result.set(key, NonTensorStack(*[NonTensorData(data=v) for v in column], batch_size=[n]))
        for key, value in self.meta_info.items():
            if key in result.keys():  # noqa: SIM118 (TensorDict has no `in`)
                raise DataProtoError(
                    f"Cannot convert to a TensorDict: meta_info key {key!r} is also a column name."
                )
            # NonTensorData is a tensorclass, which tensordict's annotations of set() leave out
            result.set(key, NonTensorData(data=value, batch_size=result.batch_size))  # type: ignore[arg-type]
        return result

    # -- consistency

    def check_consistency(self) -> None:
        """Check types and that every column has one row per sample.

        Raises:
            DataProtoError: naming the key and both sizes, or the wrong type.
        """
        batch = self.batch
        if batch is not None:
            if not isinstance(batch, TensorDictBase):
                raise DataProtoError(
                    f"DataProto.batch must be a TensorDict or None, got {_type_name(batch)}."
                )
            if batch.batch_dims < 1:
                raise DataProtoError(
                    "DataProto.batch needs at least one batch dim (the samples), got batch size "
                    f"{tuple(batch.batch_size)}."
                )
            _check_tensors_only(batch, ())
        if not isinstance(self.non_tensor_batch, dict):
            raise DataProtoError(
                f"DataProto.non_tensor_batch must be a dict, got {_type_name(self.non_tensor_batch)}."
            )
        if not isinstance(self.meta_info, dict):
            raise DataProtoError(f"DataProto.meta_info must be a dict, got {_type_name(self.meta_info)}.")
        rows, rows_of = None, None
        if batch is not None:
            rows, rows_of = batch.batch_size[0], "the batch"
            if self.non_tensor_batch and batch.batch_dims != 1:
                raise DataProtoError(
                    f"A DataProto with non-tensors needs exactly one batch dim, got batch size "
                    f"{tuple(batch.batch_size)}."
                )
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoError(
                    f"Non-tensor {key!r} must be a numpy array, got {_type_name(value)}. Wrap it with "
                    "np.array(values, dtype=object), or build with DataProto.from_dict."
                )
            if value.ndim == 0:
                raise DataProtoError(
                    f"Non-tensor {key!r} is a 0-d array; it needs one row per sample. Batch-wide values "
                    "belong in meta_info."
                )
            if rows is None:
                rows, rows_of = value.shape[0], f"non-tensor {key!r}"
            elif value.shape[0] != rows:
                raise DataProtoError(
                    f"Non-tensor {key!r} has {value.shape[0]} rows but {rows_of} has {rows}."
                )
            if batch is not None and key in batch.keys():  # noqa: SIM118 (TensorDict has no `in`)
                raise DataProtoError(f"Key {key!r} is both a tensor and a non-tensor; rename one of them.")

    # -- size and indexing

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    @overload
    def __getitem__(self, item: int | np.integer[Any]) -> DataProtoItem: ...

    @overload
    def __getitem__(self, item: slice | list[int] | list[bool] | range) -> DataProto: ...

    @overload
    def __getitem__(self, item: np.ndarray | torch.Tensor) -> DataProtoItem | DataProto: ...

    def __getitem__(self, item: Any) -> DataProtoItem | DataProto:
        """``data[i]`` is one :class:`DataProtoItem`; a slice, a list/array/tensor of ints or a
        boolean mask gives a DataProto of those rows (a slice shares memory, the others copy).

        Raises:
            DataProtoError: an index out of range, a mask of the wrong length, or another type.
        """
        if isinstance(item, slice):
            return self._slice(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            return self._item(int(item))
        if isinstance(item, (torch.Tensor, np.ndarray)) and item.ndim == 0 and _is_int_dtype(item.dtype):
            return self._item(int(item.item()))
        return self._take(self._as_index(item))

    def _item(self, i: int) -> DataProtoItem:
        n = len(self)
        if not -n <= i < n:
            raise DataProtoIndexError(f"Index {i} is out of range for a DataProto of {n} rows.")
        i %= n
        batch = None if self.batch is None else self.batch[i]
        return DataProtoItem(
            batch=batch,
            non_tensor_batch={key: value[i] for key, value in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def _slice(self, item: slice) -> DataProto:
        try:
            start, stop, step = item.indices(len(self))
        except (ValueError, TypeError) as exc:
            raise DataProtoError(f"Bad slice {item!r} for a DataProto: {exc}.") from None
        if step < 0:  # torch has no negative strides: gather instead
            return self._take(np.arange(start, stop, step, dtype=np.int64))
        item = slice(start, stop, step)
        batch = None if self.batch is None else self.batch[item]
        return self._derive(batch, {key: value[item] for key, value in self.non_tensor_batch.items()})

    def _as_index(self, item: Any) -> np.ndarray:
        """Row indices as a non-negative int64 array; booleans are a mask over the rows."""
        if isinstance(item, torch.Tensor):
            array = item.detach().cpu().numpy()
        elif isinstance(item, np.ndarray):
            array = item
        elif isinstance(item, (list, range)):
            try:
                array = np.asarray(item)
            except ValueError:
                raise DataProtoError(
                    f"A DataProto index must be a flat list of ints, got {_short(item)}."
                ) from None
            if array.size == 0:
                array = array.astype(np.int64)
        else:
            raise DataProtoError(
                f"Cannot index a DataProto with {_type_name(item)} ({_short(item)}); use an int, a slice, "
                "a list/array/tensor of ints, or a boolean mask."
            )
        n = len(self)
        if array.ndim != 1:
            raise DataProtoError(f"A DataProto index must be 1-D, got shape {array.shape}.")
        if array.dtype == np.bool_:
            if array.shape[0] != n:
                raise DataProtoError(
                    f"Boolean mask has {array.shape[0]} entries but the DataProto has {n} rows."
                )
            return np.flatnonzero(array)
        if array.dtype.kind not in "iu":
            raise DataProtoError(f"A DataProto index must hold ints or bools, got dtype {array.dtype}.")
        if array.size:
            low, high = array.min(), array.max()
            if low < -n or high >= n:
                bad = array[(array < -n) | (array >= n)][0]
                raise DataProtoIndexError(f"Index {int(bad)} is out of range for a DataProto of {n} rows.")
            if low < 0:
                array = np.where(array < 0, array + n, array)
        return array.astype(np.int64, copy=False)

    def _take(self, index: np.ndarray) -> DataProto:
        """Rows ``index`` (validated, non-negative int64), copied."""
        batch = None if self.batch is None else _gather_batch(self.batch, index)
        return self._derive(batch, {key: value[index] for key, value in self.non_tensor_batch.items()})

    # -- keys

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only these keys (None: all of that part). Tensors are shared unless
        ``deepcopy``.

        Raises:
            DataProtoError: a key that is not there (the message lists the available ones).
        """
        if batch_keys is None:
            batch = None if self.batch is None else self.batch.copy()
        else:
            batch = self._select_batch(batch_keys)
        if non_tensor_batch_keys is None:
            columns = dict(self.non_tensor_batch)
        else:
            columns = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non-tensor")
        if meta_info_keys is None:
            meta = dict(self.meta_info)
        else:
            meta = self._pick(self.meta_info, meta_info_keys, "meta_info")
        result = type(self)._unchecked(batch, columns, meta)
        return copy.deepcopy(result) if deepcopy else result

    def _select_batch(self, keys: Sequence[str]) -> TensorDictBase | None:
        if isinstance(keys, str):
            keys = (keys,)
        if self.batch is None:
            names = _keys_list(keys, "batch_keys")
            if names:
                raise DataProtoError(f"Cannot select tensor {names[0]!r}: this DataProto has no batch.")
            return None
        try:
            return _select_tensors(self.batch, keys)
        except (KeyError, TypeError, RuntimeError):
            self._missing(_keys_list(keys, "batch_keys") or [], list(self.batch.keys()), "tensor")
            raise

    @staticmethod
    def _pick(source: dict[str, Any], keys: Sequence[str], what: str) -> dict[str, Any]:
        if isinstance(keys, str):
            keys = (keys,)
        try:
            return {key: source[key] for key in keys}
        except (KeyError, TypeError):
            DataProto._missing(_keys_list(keys, f"{what} keys") or [], list(source), what)
            raise

    @staticmethod
    def _missing(keys: list[str], available: list[str], what: str) -> None:
        for key in keys:
            if key not in available:
                listing = ", ".join(repr(k) for k in available) or "none"
                raise DataProtoError(f"No {what} key {key!r} in this DataProto. Available: {listing}.")

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove these keys from this object and return them as a DataProto (None: none).

        Nothing is removed when any key is missing.

        Raises:
            DataProtoError: a key that is not there.
        """
        batch_keys = _keys_list(batch_keys, "batch_keys") or []
        column_keys = _keys_list(non_tensor_batch_keys, "non_tensor_batch_keys") or []
        meta_keys = _keys_list(meta_info_keys, "meta_info_keys") or []
        popped_batch = self._select_batch(batch_keys) if batch_keys else None
        popped_columns = self._pick(self.non_tensor_batch, column_keys, "non-tensor")
        popped_meta = self._pick(self.meta_info, meta_keys, "meta_info")
        if batch_keys and self.batch is not None:  # (batch_keys without a batch raised above)
            self.batch = self.batch.exclude(*batch_keys)
        if column_keys:
            self.non_tensor_batch = {
                k: v for k, v in self.non_tensor_batch.items() if k not in popped_columns
            }
        if meta_keys:
            self.meta_info = {k: v for k, v in self.meta_info.items() if k not in popped_meta}
        return type(self)._unchecked(popped_batch, popped_columns, popped_meta)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor or non-tensor keys in place; returns self.

        Raises:
            DataProtoError: the lists differ in length, a key is missing, or a new name is taken.
        """
        old = _keys_list(old_keys, "old_keys") or []
        new = _keys_list(new_keys, "new_keys") or []
        if len(old) != len(new):
            raise DataProtoError(
                f"rename needs as many new keys as old ones, got {len(old)} old ({old}) and "
                f"{len(new)} new ({new})."
            )
        if len(set(new)) != len(new):
            raise DataProtoError(f"rename: new keys repeat a name: {new}.")
        batch_keys = set() if self.batch is None else set(self.batch.keys())
        all_keys = batch_keys | set(self.non_tensor_batch)
        for o in old:
            if o not in all_keys:
                listing = ", ".join(repr(k) for k in sorted(all_keys)) or "none"
                raise DataProtoError(
                    f"Cannot rename {o!r}: no such tensor or non-tensor key. Available: {listing}."
                )
        remaining = all_keys - set(old)
        for n in new:
            if n in remaining:
                raise DataProtoError(f"Cannot rename to {n!r}: that key already exists.")
        mapping = dict(zip(old, new, strict=True))
        if self.batch is not None and any(o in batch_keys for o in old):
            # A new TensorDict, not rename_key_: the old one may be shared, and swaps just work.
            batch = self.batch
            source = {mapping.get(key, key): value for key, value in batch.items()}
            self.batch = TensorDict(source, batch_size=batch.batch_size, device=batch.device)
        if any(o in self.non_tensor_batch for o in old):
            self.non_tensor_batch = {mapping.get(k, k): v for k, v in self.non_tensor_batch.items()}
        self.check_consistency()
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add the keys of ``other`` to this object in place; returns self.

        A key present in both must hold equal values (tensors, arrays, meta values).

        Raises:
            DataProtoError: the row counts differ, or a key holds different values.
        """
        if not isinstance(other, DataProto):
            raise DataProtoError(f"union takes a DataProto, got {_type_name(other)}.")
        mine, theirs = self._has_rows(), other._has_rows()
        if mine and theirs and len(self) != len(other):
            key = next(iter(other.non_tensor_batch), None)
            if other.batch is not None:
                key = next(iter(other.batch.keys()), key)
            raise DataProtoError(
                f"Cannot union: self has {len(self)} rows but other has {len(other)} rows (key {key!r})."
            )
        batch = self.batch
        if other.batch is not None:
            batch = other.batch.copy() if batch is None else union_tensor_dict(batch, other.batch)
        columns = union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        meta = dict(self.meta_info)
        for key, value in other.meta_info.items():
            if key in meta and not _values_equal(meta[key], value):
                raise DataProtoError(
                    f"Cannot union: meta_info {key!r} is {_short(meta[key])} in self but {_short(value)} "
                    "in other."
                )
            meta.setdefault(key, value)
        self.batch, self.non_tensor_batch, self.meta_info = batch, columns, meta
        self.check_consistency()
        return self

    def _has_rows(self) -> bool:
        return self.batch is not None or bool(self.non_tensor_batch)

    # -- rows

    def reorder(self, indices: Any) -> DataProto:
        """Put the rows in the order ``indices`` (a permutation, list/array/tensor) in place;
        returns self."""
        index = self._as_index(indices)
        reordered = self._take(index)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def to(self, device: str | torch.device) -> DataProto:
        """Move the batch to ``device``; returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` parts of equal size (views, no copy).

        With auto-padding on (see the module docs), a length that is not a multiple of
        ``chunks`` is first padded by ``-len(self) % chunks`` rows repeated from the start.

        Raises:
            DataProtoError: the length is not a multiple of ``chunks`` and auto-padding is off.
        """
        chunks = _positive_int(chunks, "chunks")
        data, n = self, len(self)
        if n % chunks:
            if not self.is_padding_enabled():
                raise DataProtoError(
                    f"Cannot chunk {n} rows into {chunks} equal chunks ({n} % {chunks} = {n % chunks}). "
                    f"Use a divisor of {n}, use split(), or turn on auto-padding "
                    f"(data.auto_padding = True, `with auto_padding():` or {AUTO_PADDING_ENV}=1)."
                )
            data, _ = pad_dataproto_to_divisor(self, chunks)
            n = len(data)
        return data._split_sizes([n // chunks] * chunks, chunks=chunks)

    def split(self, split_size: int) -> list[DataProto]:
        """Parts of ``split_size`` rows (views, no copy); the last one may be shorter."""
        split_size = _positive_int(split_size, "split_size")
        n = len(self)
        sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
        return self._split_sizes(sizes, split_size=split_size)

    def _split_sizes(
        self, sizes: list[int], chunks: int | None = None, split_size: int | None = None
    ) -> list[DataProto]:
        if not sizes:
            return []
        batches: Sequence[TensorDictBase | None]
        if self.batch is None:
            batches = [None] * len(sizes)
        elif chunks is not None and sizes[0]:
            batches = self.batch.chunk(chunks, dim=0)  # the fastest TensorDict split, for equal parts
        elif split_size is not None:
            batches = self.batch.split(split_size, dim=0)
        else:
            batches = self.batch.split(sizes, dim=0)
        parts = []
        start = 0
        columns = self.non_tensor_batch
        for size, batch in zip(sizes, batches, strict=True):
            stop = start + size
            parts.append(self._derive(batch, {key: value[start:stop] for key, value in columns.items()}))
            start = stop
        return parts

    @classmethod
    def concat(cls, data: Sequence[DataProto]) -> DataProto:
        """Concatenate rows of several DataProtos (copies).

        meta_info: each part's ``metrics`` dict is gathered into ``{name: [value per part]}``;
        any other key must be equal in every part that has it; a key found in some parts only
        is kept.

        Raises:
            DataProtoError: no parts, parts with different keys, tensors whose trailing shapes
                differ, or a meta_info key with different values.
        """
        parts = list(data) if not isinstance(data, DataProto) else None
        if not parts:
            raise DataProtoError("DataProto.concat needs a non-empty list of DataProtos.")
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise DataProtoError(f"DataProto.concat: part {i} is a {_type_name(part)}, not a DataProto.")
        first = parts[0]
        batch = _concat_batches(parts)
        columns = {}
        first_keys = first.non_tensor_batch.keys()
        for i, part in enumerate(parts[1:], start=1):
            if part.non_tensor_batch.keys() != first_keys:
                _key_mismatch("non-tensor", first_keys, part.non_tensor_batch.keys(), i)
        for key in first_keys:
            columns[key] = np.concatenate([part.non_tensor_batch[key] for part in parts])
        return cls._unchecked(batch, columns, _merge_meta(parts))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` when ``interleave``, else ``abab`` (copies)."""
        times = _positive_int(repeat_times, "repeat_times")
        n = len(self)
        if interleave:
            batch = None
            if self.batch is not None:
                batch = _map_batch(self.batch, lambda t: t.repeat_interleave(times, dim=0), n * times)
            columns = {key: np.repeat(value, times, axis=0) for key, value in self.non_tensor_batch.items()}
        else:
            batch = None
            if self.batch is not None:
                batch = _map_batch(self.batch, lambda t: t.repeat(times, *([1] * (t.dim() - 1))), n * times)
            columns = {
                key: np.tile(value, (times,) + (1,) * (value.ndim - 1))
                for key, value in self.non_tensor_batch.items()
            }
        return self._derive(batch, columns)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (copies); 0 drops the row.

        Raises:
            DataProtoError: the counts are not one non-negative int per row.
        """
        if isinstance(repeat_times, torch.Tensor):
            counts = repeat_times.detach().cpu().numpy()
        elif isinstance(repeat_times, (np.ndarray, list, tuple, range)):
            counts = np.asarray(repeat_times)
        else:
            raise DataProtoError(
                f"sample_level_repeat takes a list/array/tensor of counts, got {_type_name(repeat_times)}."
            )
        n = len(self)
        if counts.ndim != 1 or counts.shape[0] != n:
            raise DataProtoError(
                f"sample_level_repeat needs one count per row: got counts of shape {counts.shape} "
                f"for {n} rows."
            )
        if n and (counts.dtype.kind not in "iu" or counts.min() < 0):
            raise DataProtoError(
                f"sample_level_repeat counts must be non-negative ints, got {counts.tolist()[:10]}."
            )
        return self._take(np.repeat(np.arange(n, dtype=np.int64), counts.astype(np.int64, copy=False)))

    # -- auto-padding

    @property
    def auto_padding(self) -> bool:
        """This object's own auto-padding flag (``meta_info["_trellis_auto_padding"]``)."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False))

    @auto_padding.setter
    def auto_padding(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise DataProtoError(f"DataProto.auto_padding takes a bool, got {type(enabled).__name__}.")
        self.meta_info[AUTO_PADDING_KEY] = enabled

    def is_padding_enabled(self) -> bool:
        """True when this object's flag is set or auto-padding is on globally."""
        return self.auto_padding or is_auto_padding_enabled()

    # -- iteration

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows (copies), ``epochs`` times over.

        ``dataloader_kwargs`` takes ``shuffle`` (default False) and ``drop_last`` (default
        False; else the last mini-batch of an epoch may be shorter). Shuffling draws one
        permutation per epoch from a generator seeded with ``seed``: the same seed gives the
        same mini-batches. ``seed=None`` draws the seed from torch's global RNG.
        Each mini-batch carries a copy of ``meta_info``.

        Raises:
            DataProtoError: a bad size, epoch count or dataloader option (raised at the call).
        """
        mini_batch_size = _positive_int(mini_batch_size, "mini_batch_size")
        epochs = _positive_int(epochs, "epochs", minimum=0)
        options = dict(dataloader_kwargs or {})
        unknown = sorted(set(options) - {"shuffle", "drop_last"})
        if unknown:
            raise DataProtoError(
                f"make_iterator: unsupported dataloader_kwargs {unknown}; supported: 'shuffle', 'drop_last'."
            )
        shuffle, drop_last = bool(options.get("shuffle", False)), bool(options.get("drop_last", False))
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator().manual_seed(int(seed))
        n = len(self)
        stop = n - n % mini_batch_size if drop_last else n

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator).numpy() if shuffle else np.arange(n)
                for start in range(0, stop, mini_batch_size):
                    yield self._take(order[start : start + mini_batch_size])

        return batches()

    # -- devices, copies, pickling, disk

    def __copy__(self) -> DataProto:
        batch = None if self.batch is None else self.batch.copy()
        return type(self)._unchecked(batch, dict(self.non_tensor_batch), dict(self.meta_info))

    def __deepcopy__(self, memo: dict[int, Any]) -> DataProto:
        batch = None if self.batch is None else self.batch.clone()
        return type(self)._unchecked(
            batch, copy.deepcopy(self.non_tensor_batch, memo), copy.deepcopy(self.meta_info, memo)
        )

    def __getstate__(self) -> dict[str, Any]:
        # Tensors travel as their raw bytes (numpy uint8 arrays, which pickle protocol 5 and
        # Ray pass out-of-band); a view carries only its own elements.
        state = dict(self.__dict__)
        state["batch"] = None if self.batch is None else _pack_batch(self.batch)
        state["_trellis_pickle"] = 1
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.pop("_trellis_pickle", None)
        packed = state.pop("batch", None)
        self.__dict__.update(state)
        self.batch = None if packed is None else _unpack_batch(packed)

    def save_to_disk(self, path: str | os.PathLike[str]) -> None:
        """Write this object to ``path`` (pickle, compact tensors)."""
        with open(path, "wb") as f:
            pickle.dump(self, f, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def load_from_disk(cls, path: str | os.PathLike[str]) -> DataProto:
        """Read an object written by :meth:`save_to_disk`. Pickle runs code: load only files you trust.

        Raises:
            DataProtoError: the file holds something other than a ``cls``.
        """
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, cls):
            raise DataProtoError(f"{os.fspath(path)!r} holds a {_type_name(data)}, not a {cls.__name__}.")
        data.check_consistency()
        return data

    def __repr__(self) -> str:
        tensors = (
            "None"
            if self.batch is None
            else "{"
            + ", ".join(
                f"{key}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
                for key, value in self.batch.items(include_nested=True, leaves_only=True)
            )
            + "}"
        )
        columns = (
            "{" + ", ".join(f"{key}: {value.dtype}" for key, value in self.non_tensor_batch.items()) + "}"
        )
        return (
            f"{type(self).__name__}(len={len(self)}, batch={tensors}, non_tensor_batch={columns}, "
            f"meta_info keys={list(self.meta_info)})"
        )


# ---------------------------------------------------------------- module functions


def _is_int_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return np.dtype(dtype).kind in "iu"


def _check_tensors_only(batch: TensorDictBase, prefix: tuple[str, ...]) -> None:
    # items(leaves_only=True) skips non-tensor entries, so walk the nesting by hand.
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, TensorDictBase) and not is_non_tensor(value):
            _check_tensors_only(value, (*prefix, key))
            continue
        name = key if not prefix else (*prefix, key)
        raise DataProtoError(
            f"Batch entry {name!r} is a {_type_name(value)}; the batch holds tensors only. "
            "Put per-sample values in non_tensor_batch, batch-wide ones in meta_info."
        )


def _key_mismatch(what: str, first: Any, other: Any, index: int) -> None:
    missing = sorted(set(first) - set(other))
    extra = sorted(set(other) - set(first))
    if missing:
        raise DataProtoError(
            f"DataProto.concat: part {index} has no {what} key {missing[0]!r}, part 0 has it."
        )
    raise DataProtoError(f"DataProto.concat: part {index} has {what} key {extra[0]!r}, part 0 does not.")


def _concat_batches(parts: list[DataProto]) -> TensorDictBase | None:
    batches = [part.batch for part in parts]
    present = [batch for batch in batches if batch is not None]
    if not present:
        return None
    if len(present) < len(batches):
        i = next(j for j, b in enumerate(batches) if b is None)
        other = next(j for j, b in enumerate(batches) if b is not None)
        raise DataProtoError(f"DataProto.concat: part {i} has no tensors but part {other} does.")
    first_keys = set(present[0].keys())
    for i, batch in enumerate(present[1:], start=1):
        keys = batch.keys()
        if len(keys) != len(first_keys) or any(key not in first_keys for key in keys):
            _key_mismatch("tensor", first_keys, set(keys), i)
    return _cat_batches(present)


def _merge_meta(parts: Sequence[DataProto]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    where: dict[str, int] = {}
    metrics: dict[str, list[Any]] | None = None
    for i, part in enumerate(parts):
        for key, value in part.meta_info.items():
            if key == "metrics":
                if not isinstance(value, Mapping):
                    raise DataProtoError(
                        f"DataProto.concat: meta_info 'metrics' of part {i} is a {_type_name(value)}, "
                        "not a dict of metric name -> value."
                    )
                metrics = {} if metrics is None else metrics
                for name, metric in value.items():
                    metrics.setdefault(name, []).append(metric)
            elif key not in merged:
                merged[key], where[key] = value, i
            elif not _values_equal(merged[key], value):
                raise DataProtoError(
                    f"DataProto.concat: meta_info {key!r} is {_short(merged[key])} in part {where[key]} but "
                    f"{_short(value)} in part {i}; parts must agree on every meta_info key but 'metrics'."
                )
    if metrics is not None:
        merged["metrics"] = metrics
    return merged


def pad_dataproto_to_divisor(data: DataProto, divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` to a multiple of ``divisor`` rows by repeating rows from the start.

    The padding wraps around when it is longer than ``data``: 3 rows padded to 8 are rows
    ``0, 1, 2, 0, 1, 2, 0, 1``. Returns ``(padded, pad_size)``; ``data`` itself when no padding
    is needed.

    Raises:
        DataProtoError: ``divisor`` is not a positive int, or ``data`` is empty but needs rows.
    """
    if not isinstance(data, DataProto):
        raise DataProtoError(f"pad_dataproto_to_divisor takes a DataProto, got {_type_name(data)}.")
    divisor = _positive_int(divisor, "divisor")
    n = len(data)
    pad_size = -n % divisor
    if pad_size == 0:
        return data, 0
    padding = data._take(np.arange(pad_size, dtype=np.int64) % n)
    batch = None if data.batch is None or padding.batch is None else _cat_batches([data.batch, padding.batch])
    columns = {
        key: np.concatenate([value, padding.non_tensor_batch[key]])
        for key, value in data.non_tensor_batch.items()
    }
    return data._derive(batch, columns), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (a view); ``data`` itself when ``pad_size`` is 0.

    Raises:
        DataProtoError: ``pad_size`` is negative or larger than ``len(data)``.
    """
    pad_size = _positive_int(pad_size, "pad_size", minimum=0)
    n = len(data)
    if pad_size > n:
        raise DataProtoError(f"Cannot unpad {pad_size} rows from a DataProto of {n} rows.")
    return data if pad_size == 0 else data[: n - pad_size]
