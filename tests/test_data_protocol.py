"""trellis.data.protocol: DataProto construction, indexing, keys, rows, padding, serialisation."""

from __future__ import annotations

import copy
import io
import pickle
import re

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from trellis.data.protocol import (
    AUTO_PADDING_ENV,
    AUTO_PADDING_KEY,
    DataProto,
    DataProtoItem,
    auto_padding,
    is_auto_padding_enabled,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from trellis.errors import DataProtoError, TrellisError


def make(n: int = 4, meta: dict | None = None) -> DataProto:
    """Row i: ids = [2i, 2i+1], score = i, uid = 'u<i>'."""
    return DataProto.from_dict(
        tensors={"ids": torch.arange(2 * n).view(n, 2), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
        meta_info={"temperature": 0.7} if meta is None else meta,
    )


def rows(data: DataProto) -> list[int]:
    """Which original rows ``data`` holds, read from the tensors and checked against the uids."""
    from_tensors = data.batch["score"].long().tolist()
    assert data.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in from_tensors]
    assert data.batch["ids"].tolist() == [[2 * i, 2 * i + 1] for i in from_tensors]
    return from_tensors


def raises(match: str):
    return pytest.raises(DataProtoError, match=re.escape(match))


class Sub(DataProto):
    """A subclass: operations and class constructors return it."""


# ---------------------------------------------------------------- construction


def test_from_dict_builds_the_three_parts():
    nested = [[1, 2], [3, 4], [5, 6]]  # equal-length lists stay one list per row, not a 2-D array
    data = DataProto.from_dict(
        tensors={"ids": torch.zeros(3, 5, dtype=torch.int64)},
        non_tensors={"tags": nested, "uid": np.array(["a", "b", "c"], dtype=object)},
        meta_info={"temperature": 1.0},
    )
    assert len(data) == 3
    assert isinstance(data.batch, TensorDict) and tuple(data.batch.batch_size) == (3,)
    assert data.batch["ids"].shape == (3, 5)
    assert data.non_tensor_batch["tags"].shape == (3,) and data.non_tensor_batch["tags"].dtype == object
    assert data.non_tensor_batch["tags"].tolist() == nested
    assert data.meta_info == {"temperature": 1.0}
    assert not data.auto_padding


def test_from_dict_tensors_with_different_batch_sizes_name_both():
    with raises("Tensor 'responses' has batch size (3,) but tensor 'prompts' has (4,)"):
        DataProto.from_dict({"prompts": torch.zeros(4, 2), "responses": torch.zeros(3, 2)})


def test_from_dict_non_tensor_rows_must_match_the_batch():
    with raises("Non-tensor 'uid' has 3 rows but the batch has 4."):
        DataProto.from_dict({"x": torch.zeros(4)}, {"uid": np.array(["a", "b", "c"], dtype=object)})
    with raises("Non-tensor 'b' has 2 rows but non-tensor 'a' has 3."):
        DataProto.from_dict(non_tensors={"a": [1, 2, 3], "b": [1, 2]})


def test_from_dict_rejects_values_of_the_wrong_type():
    with raises("Tensor 'x' must be a torch.Tensor, got list."):
        DataProto.from_dict({"x": [1, 2]})
    with raises("Non-tensor 'uid' must be a numpy array or a list (one row per sample), got str."):
        DataProto.from_dict(non_tensors={"uid": "abc"})
    with raises("num_batch_dims must be an int >= 1, got 0."):
        DataProto.from_dict({"x": torch.zeros(2)}, num_batch_dims=0)
    with raises("Tensor 'x' has shape (2,), fewer dims than num_batch_dims=2."):
        DataProto.from_dict({"x": torch.zeros(2)}, num_batch_dims=2)


def test_from_dict_with_two_batch_dims():
    data = DataProto.from_dict({"x": torch.zeros(2, 3, 4), "y": torch.ones(2, 3)}, num_batch_dims=2)
    assert tuple(data.batch.batch_size) == (2, 3) and len(data) == 2
    assert [tuple(part.batch.batch_size) for part in data.chunk(2)] == [(1, 3), (1, 3)]
    with raises("A DataProto with non-tensors needs exactly one batch dim, got batch size (2, 3)."):
        DataProto.from_dict({"x": torch.zeros(2, 3)}, {"u": [1, 2]}, num_batch_dims=2)


def test_from_single_dict_sorts_values_and_returns_the_subclass():
    data = Sub.from_single_dict(
        {"x": torch.arange(3), "uid": np.array(["a", "b", "c"], dtype=object)}, meta_info={"k": 1}
    )
    assert type(data) is Sub
    assert list(data.batch.keys()) == ["x"] and list(data.non_tensor_batch) == ["uid"]
    assert data.meta_info == {"k": 1}
    with raises("Value of 'temperature' is a float; from_single_dict takes torch.Tensor"):
        DataProto.from_single_dict({"x": torch.arange(3), "temperature": 0.5})
    assert DataProto.from_single_dict({"x": torch.arange(3)}, auto_padding=True).auto_padding


def test_constructor_checks_consistency():
    td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    with raises("Non-tensor 'uid' must be a numpy array, got list."):
        DataProto(batch=td, non_tensor_batch={"uid": ["a", "b", "c"]})
    with raises("DataProto.batch must be a TensorDict or None, got dict."):
        DataProto(batch={"x": torch.zeros(3)})
    with raises("Non-tensor 'flag' is a 0-d array; it needs one row per sample."):
        DataProto(non_tensor_batch={"flag": np.array(True)})
    with raises("Key 'x' is both a tensor and a non-tensor; rename one of them."):
        DataProto(batch=td, non_tensor_batch={"x": np.zeros(3)})
    with raises("DataProto.meta_info must be a dict, got list."):
        DataProto(batch=td, meta_info=[])
    with raises("DataProto.batch needs at least one batch dim (the samples), got batch size ()."):
        DataProto(batch=TensorDict({"x": torch.zeros(3)}, batch_size=[]))
    with_text = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
    with_text["note"] = NonTensorData("hi")
    with raises("Batch entry 'note' is a NonTensorData; the batch holds tensors only."):
        DataProto(batch=with_text)
    assert issubclass(DataProtoError, TrellisError) and issubclass(DataProtoError, ValueError)


def test_len_counts_rows():
    assert len(make(4)) == 4
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2
    assert len(DataProto()) == 0
    assert len(DataProto(batch=TensorDict({}, batch_size=[5]))) == 5


def test_repr_names_keys_and_shapes():
    assert repr(make(2)) == (
        "DataProto(len=2, batch={ids: (2, 2) int64, score: (2,) float32}, non_tensor_batch={uid: object}, "
        "meta_info keys=['temperature'])"
    )


# ---------------------------------------------------------------- indexing


def test_int_index_gives_one_item():
    data = make(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [4, 5] and item.batch["score"].item() == 2.0
    assert tuple(item.batch.batch_size) == ()
    assert item.non_tensor_batch == {"uid": "u2"}
    assert item.meta_info == {"temperature": 0.7}
    assert data[-1].non_tensor_batch["uid"] == "u3"
    assert data[np.int64(1)].non_tensor_batch["uid"] == "u1"
    assert data[torch.tensor(0)].non_tensor_batch["uid"] == "u0"
    assert [item.non_tensor_batch["uid"] for item in data] == ["u0", "u1", "u2", "u3"]


def test_int_index_out_of_range():
    with raises("Index 4 is out of range for a DataProto of 4 rows."):
        make(4)[4]
    with pytest.raises(IndexError):  # also what generic Python code catches
        make(4)[4]
    with raises("Index -5 is out of range for a DataProto of 4 rows."):
        make(4)[-5]


def test_slice_is_a_view():
    data = make(6)
    part = data[1:5:2]
    assert type(part) is DataProto and rows(part) == [1, 3]
    assert rows(data[:2]) == [0, 1] and rows(data[4:]) == [4, 5]
    assert part.meta_info == data.meta_info and part.meta_info is not data.meta_info
    view = data[2:4]
    assert view.batch["ids"].data_ptr() == data.batch["ids"][2].data_ptr()  # no copy
    assert rows(data[::-1]) == [5, 4, 3, 2, 1, 0]  # torch has no negative steps: gathered
    with raises("Bad slice slice(None, None, 0) for a DataProto: slice step cannot be zero."):
        data[::0]


@pytest.mark.parametrize(
    "index",
    [
        [3, 0, 3],
        np.array([3, 0, 3]),
        torch.tensor([3, 0, 3]),
        [-1, 0, -1],
        np.array([3, 0, 3], dtype=np.uint8),
    ],
    ids=["list", "ndarray", "tensor", "negative", "uint8"],
)
def test_int_array_index_gathers_rows(index):
    part = make(4)[index]
    assert type(part) is DataProto and rows(part) == [3, 0, 3]


def test_bool_mask_index():
    data = make(4)
    assert rows(data[np.array([True, False, True, False])]) == [0, 2]
    assert rows(data[torch.tensor([False, True, True, True])]) == [1, 2, 3]
    assert rows(data[[False, False, False, False]]) == []
    with raises("Boolean mask has 3 entries but the DataProto has 4 rows."):
        data[np.array([True, False, True])]


def test_empty_index_keeps_shapes():
    part = make(4)[[]]
    assert len(part) == 0 and part.batch["ids"].shape == (0, 2) and part.non_tensor_batch["uid"].shape == (0,)


def test_gathered_rows_are_copies():
    data = make(4)
    part = data[[0, 1]]
    part.batch["score"] += 100
    assert data.batch["score"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ([0, 7], "Index 7 is out of range for a DataProto of 4 rows."),
        (torch.tensor([-9]), "Index -9 is out of range for a DataProto of 4 rows."),
        (
            "uid",
            "Cannot index a DataProto with str ('uid'); use an int, a slice, a list/array/tensor of ints",
        ),
        (1.5, "Cannot index a DataProto with float (1.5)"),
        (True, "Cannot index a DataProto with bool (True)"),
        ((0, 1), "Cannot index a DataProto with tuple ((0, 1))"),
        ([[0, 1]], "A DataProto index must be 1-D, got shape (1, 2)."),
        ([0.0, 1.0], "A DataProto index must hold ints or bools, got dtype float64."),
        (torch.tensor([0.5]), "A DataProto index must hold ints or bools, got dtype float32."),
        ([[0], [1, 2]], "A DataProto index must be a flat list of ints, got [[0], [1, 2]]."),
    ],
)
def test_bad_indices(index, message):
    with raises(message):
        make(4)[index]


# ---------------------------------------------------------------- keys


def test_select_shares_tensors_and_copies_containers():
    data = make(4, meta={"temperature": 0.7, "step": 3})
    part = data.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["step"])
    assert list(part.batch.keys()) == ["ids"] and list(part.non_tensor_batch) == ["uid"]
    assert part.meta_info == {"step": 3}
    assert part.batch["ids"] is data.batch["ids"]  # shared, not copied
    everything = data.select()
    assert sorted(everything.batch.keys()) == ["ids", "score"] and everything.meta_info == data.meta_info
    everything.batch["extra"] = torch.zeros(4)  # a new container: the original is untouched
    assert sorted(data.batch.keys()) == ["ids", "score"]
    assert list(data.select(batch_keys="score").batch.keys()) == ["score"]  # one key as a str


def test_select_deepcopy_copies_tensors():
    data = make(4)
    part = data.select(batch_keys=["score"], deepcopy=True)
    part.batch["score"] += 1
    part.non_tensor_batch["uid"][0] = "changed"
    assert data.batch["score"].tolist() == [0.0, 1.0, 2.0, 3.0] and data.non_tensor_batch["uid"][0] == "u0"


def test_select_missing_keys_list_what_is_there():
    data = make(4)
    with raises("No tensor key 'logits' in this DataProto. Available: 'ids', 'score'."):
        data.select(batch_keys=["ids", "logits"])
    with raises("No non-tensor key 'answer' in this DataProto. Available: 'uid'."):
        data.select(non_tensor_batch_keys=["answer"])
    with raises("No meta_info key 'seed' in this DataProto. Available: 'temperature'."):
        data.select(meta_info_keys=["seed"])
    with raises("Cannot select tensor 'ids': this DataProto has no batch."):
        DataProto.from_dict(non_tensors={"u": [1]}).select(batch_keys=["ids"])
    with raises("batch_keys must hold str keys, got 3 (int)."):
        data.select(batch_keys=[3])


def test_pop_removes_and_returns():
    data = make(4, meta={"temperature": 0.7, "step": 3})
    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["step"])
    assert list(popped.batch.keys()) == ["score"] and popped.batch["score"].tolist() == [0, 1, 2, 3]
    assert list(popped.non_tensor_batch) == ["uid"] and popped.meta_info == {"step": 3}
    assert list(data.batch.keys()) == ["ids"] and data.non_tensor_batch == {}
    assert data.meta_info == {"temperature": 0.7}
    only_columns = make(2).pop(non_tensor_batch_keys="uid")
    assert only_columns.batch is None and len(only_columns) == 2


def test_pop_with_a_missing_key_removes_nothing():
    data = make(4)
    with raises("No non-tensor key 'answer' in this DataProto. Available: 'uid'."):
        data.pop(batch_keys=["score"], non_tensor_batch_keys=["answer"])
    assert sorted(data.batch.keys()) == ["ids", "score"] and list(data.non_tensor_batch) == ["uid"]


def test_pop_does_not_touch_a_shared_tensordict():
    td = TensorDict({"a": torch.zeros(2), "b": torch.ones(2)}, batch_size=[2])
    DataProto(batch=td).pop(batch_keys=["a"])
    assert sorted(td.keys()) == ["a", "b"]


def test_union_adds_keys_in_place():
    data = make(4)
    other = DataProto.from_dict(
        {"reward": torch.ones(4), "score": torch.arange(4, dtype=torch.float32)},  # equal 'score': fine
        {"answer": np.array(list("abcd"), dtype=object), "uid": data.non_tensor_batch["uid"].copy()},
        {"temperature": 0.7, "step": 1},
    )
    assert data.union(other) is data
    assert sorted(data.batch.keys()) == ["ids", "reward", "score"]
    assert list(data.non_tensor_batch) == ["uid", "answer"]
    assert data.meta_info == {"temperature": 0.7, "step": 1}
    assert rows(data) == [0, 1, 2, 3]


def test_union_into_an_empty_dataproto_adopts_the_other():
    data = DataProto().union(make(3))
    assert rows(data) == [0, 1, 2] and data.meta_info == {"temperature": 0.7}


def test_union_equal_object_columns_with_nan_and_lists():
    left = DataProto.from_dict(non_tensors={"x": [float("nan"), [1, 2], {"a": np.arange(2)}]})
    right = DataProto.from_dict(non_tensors={"x": [float("nan"), [1, 2], {"a": np.arange(2)}]})
    assert left.union(right).non_tensor_batch["x"][1] == [1, 2]


def test_union_conflicts_name_the_key():
    with raises("Cannot union: tensor 'score' is present in both with different values."):
        make(4).union(DataProto.from_dict({"score": torch.zeros(4)}))
    with raises(
        "Cannot union: non-tensor 'uid' is present in both with different values (shapes (4,) and (4,))."
    ):
        make(4).union(DataProto.from_dict(non_tensors={"uid": ["a", "b", "c", "d"]}))
    with raises("Cannot union: meta_info 'temperature' is 0.7 in self but 1.0 in other."):
        make(4).union(DataProto(meta_info={"temperature": 1.0}))
    with raises("Cannot union: self has 4 rows but other has 3 rows (key 'reward')."):
        make(4).union(DataProto.from_dict({"reward": torch.zeros(3)}))
    with raises("union takes a DataProto, got dict."):
        make(4).union({})


def test_union_helpers_return_new_containers():
    a = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    b = TensorDict({"y": torch.ones(2)}, batch_size=[2])
    assert sorted(union_tensor_dict(a, b).keys()) == ["x", "y"] and list(a.keys()) == ["x"]
    with raises("Cannot union tensors: batch sizes differ, (2,) and (3,)."):
        union_tensor_dict(a, TensorDict({}, batch_size=[3]))
    left = {"u": np.array(["a"], dtype=object)}
    assert list(union_numpy_dict(left, {"v": np.zeros(1)})) == ["u", "v"] and list(left) == ["u"]


def test_rename_tensor_and_non_tensor_keys():
    data = make(2)
    assert data.rename(["ids", "uid"], ["input_ids", "sample_id"]) is data
    assert sorted(data.batch.keys()) == ["input_ids", "score"] and list(data.non_tensor_batch) == [
        "sample_id"
    ]
    data.rename("input_ids", "score_tmp").rename(["score", "score_tmp"], ["score_tmp", "score"])  # a swap
    assert data.batch["score"].shape == (2, 2) and data.batch["score_tmp"].shape == (2,)


def test_rename_errors():
    data = make(2)
    with raises(
        "Cannot rename 'logits': no such tensor or non-tensor key. Available: 'ids', 'score', 'uid'."
    ):
        data.rename("logits", "x")
    with raises("Cannot rename to 'score': that key already exists."):
        data.rename("ids", "score")
    with raises("rename needs as many new keys as old ones, got 2 old (['ids', 'uid']) and 1 new (['x'])."):
        data.rename(["ids", "uid"], ["x"])


# ---------------------------------------------------------------- rows


def test_reorder_in_place():
    data = make(4)
    assert data.reorder(torch.tensor([3, 1, 0, 2])) is data
    assert rows(data) == [3, 1, 0, 2]
    with raises("Index 9 is out of range for a DataProto of 4 rows."):
        data.reorder([9, 0, 1, 2])


def test_to_moves_the_batch_and_returns_self():
    data = make(2)
    assert data.to("cpu") is data and data.batch.device == torch.device("cpu")
    assert DataProto.from_dict(non_tensors={"u": [1]}).to("cpu").batch is None


def test_chunk_equal_parts_are_views():
    data = make(6)
    parts = data.chunk(3)
    assert [rows(part) for part in parts] == [[0, 1], [2, 3], [4, 5]]
    assert parts[1].batch["ids"].data_ptr() == data.batch["ids"][2].data_ptr()
    assert all(part.meta_info == {"temperature": 0.7} for part in parts)
    assert [len(part) for part in DataProto().chunk(2)] == [0, 0]
    only_columns = DataProto.from_dict(non_tensors={"u": [1, 2, 3, 4]}).chunk(2)
    assert [part.non_tensor_batch["u"].tolist() for part in only_columns] == [[1, 2], [3, 4]]


def test_chunk_not_divisible_names_the_sizes():
    with raises("Cannot chunk 10 rows into 4 equal chunks (10 % 4 = 2). Use a divisor of 10, use split()"):
        make(10).chunk(4)
    with raises("chunks must be an int >= 1, got 0."):
        make(10).chunk(0)


def test_chunk_with_auto_padding_pads_at_the_end():
    data = make(10)
    data.auto_padding = True
    assert data.meta_info[AUTO_PADDING_KEY] is True and data.is_padding_enabled()
    parts = data.chunk(4)  # 10 rows + 2 padding rows (0, 1) = 4 chunks of 3
    assert [rows(part) for part in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    restored = unpad_dataproto(DataProto.concat(parts), pad_size=-len(data) % 4)
    assert rows(restored) == list(range(10))


def test_auto_padding_globally(monkeypatch):
    monkeypatch.delenv(AUTO_PADDING_ENV, raising=False)
    assert not is_auto_padding_enabled()
    with auto_padding():
        assert is_auto_padding_enabled()
        assert [len(part) for part in make(3).chunk(2)] == [2, 2]
        with auto_padding(False):
            assert not make(3).is_padding_enabled()
    assert not is_auto_padding_enabled()
    monkeypatch.setenv(AUTO_PADDING_ENV, "true")
    assert [rows(part) for part in make(3).chunk(2)] == [[0, 1], [2, 0]]
    with auto_padding(False), raises("Cannot chunk 3 rows into 2 equal chunks"):
        make(3).chunk(2)
    with raises("auto_padding(enabled) takes a bool, got str."), auto_padding("yes"):
        pass


def test_from_dict_auto_padding_sets_the_flag():
    data = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    assert data.auto_padding and [len(part) for part in data.chunk(2)] == [3, 3]
    with raises("DataProto.auto_padding takes a bool, got int."):
        data.auto_padding = 1


def test_split_last_part_may_be_shorter():
    assert [rows(part) for part in make(5).split(2)] == [[0, 1], [2, 3], [4]]
    assert [len(part) for part in make(4).split(4)] == [4]
    assert make(0).split(3) == []
    with raises("split_size must be an int >= 1, got -1."):
        make(4).split(-1)


def test_concat_rows_and_meta():
    parts = [
        make(4, meta={"temperature": 0.7, "metrics": {"loss": 1.0, "kl": 0.1}})[i : i + 2] for i in (0, 2)
    ]
    parts[1].meta_info["metrics"] = {"loss": 2.0}
    parts[1].meta_info["only_here"] = "x"
    merged = DataProto.concat(parts)
    assert type(merged) is DataProto and rows(merged) == [0, 1, 2, 3]
    assert merged.meta_info == {
        "temperature": 0.7,
        "metrics": {"loss": [1.0, 2.0], "kl": [0.1]},
        "only_here": "x",
    }
    assert Sub.concat(parts).__class__ is Sub


def test_concat_only_non_tensors():
    parts = [DataProto.from_dict(non_tensors={"u": [1, 2]}), DataProto.from_dict(non_tensors={"u": [3]})]
    merged = DataProto.concat(parts)
    assert merged.batch is None and merged.non_tensor_batch["u"].tolist() == [1, 2, 3]


def test_concat_errors():
    with raises("DataProto.concat: meta_info 'temperature' is 0.7 in part 0 but 1.0 in part 1;"):
        DataProto.concat([make(2), make(2, meta={"temperature": 1.0})])
    with raises("DataProto.concat needs a non-empty list of DataProtos."):
        DataProto.concat([])
    with raises("DataProto.concat: part 1 is a dict, not a DataProto."):
        DataProto.concat([make(2), {}])
    with raises("DataProto.concat: part 1 has no tensor key 'score', part 0 has it."):
        DataProto.concat([make(2), make(2).select(batch_keys=["ids"])])
    with raises("DataProto.concat: part 1 has non-tensor key 'extra', part 0 does not."):
        extra = make(2)
        extra.non_tensor_batch["extra"] = np.zeros(2)
        DataProto.concat([make(2), extra])
    with raises("DataProto.concat: part 1 has no tensors but part 0 does."):
        DataProto.concat([make(2), DataProto.from_dict(non_tensors={"uid": ["a"]})])
    with raises(
        "Cannot concat tensor 'x': part 0: (2, 3) torch.float32 on cpu, part 1: (2, 4) torch.float32 on cpu"
    ):
        DataProto.concat(
            [DataProto.from_dict({"x": torch.zeros(2, 3)}), DataProto.from_dict({"x": torch.zeros(2, 4)})]
        )
    with raises("DataProto.concat: meta_info 'metrics' of part 0 is a list, not a dict"):
        DataProto.concat([make(2, meta={"metrics": [1.0]})])


def test_repeat_interleave_and_tile():
    data = make(2)
    assert rows(data.repeat(repeat_times=3)) == [0, 0, 0, 1, 1, 1]  # aabb
    assert rows(data.repeat(repeat_times=2, interleave=False)) == [0, 1, 0, 1]  # abab
    assert rows(data.repeat()) == [0, 0, 1, 1]
    with raises("repeat_times must be an int >= 1, got 0."):
        data.repeat(0)


def test_sample_level_repeat():
    data = make(3)
    assert rows(data.sample_level_repeat([2, 0, 3])) == [0, 0, 2, 2, 2]
    assert rows(data.sample_level_repeat(torch.tensor([1, 1, 1]))) == [0, 1, 2]
    with raises("sample_level_repeat needs one count per row: got counts of shape (2,) for 3 rows."):
        data.sample_level_repeat([1, 2])
    with raises("sample_level_repeat counts must be non-negative ints, got [1, -1, 2]."):
        data.sample_level_repeat([1, -1, 2])
    with raises("sample_level_repeat takes a list/array/tensor of counts, got int."):
        data.sample_level_repeat(2)


def test_pad_wraps_around():
    data = make(3)
    padded, pad_size = pad_dataproto_to_divisor(data, 8)
    assert pad_size == 5 and rows(padded) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert padded.meta_info == data.meta_info
    assert rows(unpad_dataproto(padded, pad_size)) == [0, 1, 2]
    same, none = pad_dataproto_to_divisor(make(4), 2)
    assert none == 0 and len(same) == 4
    assert unpad_dataproto(data, 0) is data


def test_pad_and_unpad_errors():
    with raises("divisor must be an int >= 1, got 0."):
        pad_dataproto_to_divisor(make(3), 0)
    with raises("Cannot unpad 4 rows from a DataProto of 3 rows."):
        unpad_dataproto(make(3), 4)
    with raises("pad_size must be an int >= 0, got -1."):
        unpad_dataproto(make(3), -1)


# ---------------------------------------------------------------- serialisation


def assert_same(a: DataProto, b: DataProto) -> None:
    assert type(a) is type(b)
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert tuple(a.batch.batch_size) == tuple(b.batch.batch_size)
        assert sorted(a.batch.keys()) == sorted(b.batch.keys())
        for key in a.batch.keys():  # noqa: SIM118 (TensorDict has no `in`)
            assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key])
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert (
            value.dtype == b.non_tensor_batch[key].dtype
            and value.tolist() == b.non_tensor_batch[key].tolist()
        )
    assert a.meta_info == b.meta_info


@pytest.mark.parametrize("protocol", [4, 5])
def test_pickle_round_trip(protocol):
    data = Sub.from_dict(
        {
            "ids": torch.arange(12).view(4, 3),
            "half": torch.arange(4, dtype=torch.bfloat16),
            "transposed": torch.arange(8.0).view(2, 4).t(),  # non-contiguous
            "flags": torch.tensor([True, False, True, True]),
        },
        {"extra": [{"a": [1, 2]}, "s", 3, None]},
        {"temperature": 0.7, "metrics": {"loss": 1.0}},
    )
    restored = pickle.loads(pickle.dumps(data, protocol=protocol))
    assert_same(data, restored)
    restored.batch["ids"] += 1  # writable memory of its own
    assert data.batch["ids"][0, 0].item() == 0


def test_pickle_keeps_requires_grad():
    data = DataProto.from_dict({"w": torch.ones(2, requires_grad=True)})
    assert pickle.loads(pickle.dumps(data)).batch["w"].requires_grad


def test_pickle_is_compact():
    data = DataProto.from_dict({"ids": torch.arange(1000 * 128, dtype=torch.int64).view(1000, 128)})
    raw = 1000 * 128 * 8
    size = len(pickle.dumps(data))
    assert size < 1.1 * raw
    buffer = io.BytesIO()
    torch.save({"ids": data.batch["ids"]}, buffer)
    assert size <= len(buffer.getvalue())
    # A view carries only its own rows, not the storage it points into.
    assert len(pickle.dumps(data[:10])) < 1.1 * 10 * 128 * 8 + 2000
    assert len(pickle.dumps(data.chunk(10)[3])) < 1.1 * raw / 10


def test_save_and_load_from_disk(tmp_path):
    data = make(5, meta={"temperature": 0.7, "tags": ["a", "b"]})
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert_same(data, loaded)
    (tmp_path / "other.pkl").write_bytes(pickle.dumps({"not": "a DataProto"}))
    with raises("holds a dict, not a DataProto."):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_tensordict_round_trip_keeps_nested_values():
    nested = [{"a": [1, {"b": 2}]}, [[1, 2], [3]], "text"]
    data = DataProto.from_dict(
        {"ids": torch.arange(6).view(3, 2)},
        {"extra": nested, "same": ["x", "x", "x"]},  # identical values stay a column
        {"temperature": 0.7, "tags": ["a", "b"]},
    )
    td = data.to_tensordict()
    assert isinstance(td, TensorDict) and tuple(td.batch_size) == (3,)
    assert isinstance(td.get("extra"), NonTensorStack) and td.get("extra").tolist() == nested
    assert isinstance(td.get("temperature"), NonTensorData)
    back = Sub.from_tensordict(td)
    assert type(back) is Sub
    assert_same(Sub.from_dict(data.batch.to_dict(), data.non_tensor_batch, data.meta_info), back)
    assert list(data.batch.keys()) == ["ids"]  # to_tensordict did not write into the batch


def test_tensordict_round_trip_without_tensors_and_errors():
    data = DataProto.from_dict(non_tensors={"u": [1, 2]}, meta_info={"k": "v"})
    back = DataProto.from_tensordict(data.to_tensordict(), meta_info={"k": "w"})
    assert (
        back.batch is None and back.non_tensor_batch["u"].tolist() == [1, 2] and back.meta_info == {"k": "w"}
    )
    with raises("Cannot convert to a TensorDict: meta_info key 'u' is also a column name."):
        DataProto.from_dict(non_tensors={"u": [1, 2]}, meta_info={"u": 1}).to_tensordict()
    with raises("from_tensordict takes a TensorDict, got dict."):
        DataProto.from_tensordict({"x": torch.zeros(2)})


def test_copy_and_deepcopy():
    data = make(2)
    shallow = copy.copy(data)
    assert shallow.batch["ids"] is data.batch["ids"] and shallow.batch is not data.batch
    deep = copy.deepcopy(data)
    deep.batch["ids"] += 10
    assert data.batch["ids"].tolist() == [[0, 1], [2, 3]]


# ---------------------------------------------------------------- make_iterator


def batches_of(iterator) -> list[list[int]]:
    return [rows(mini) for mini in iterator]


def test_make_iterator_in_order():
    data = make(5)
    minis = list(data.make_iterator(mini_batch_size=2, epochs=2))
    assert [rows(mini) for mini in minis] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    assert all(mini.meta_info == data.meta_info for mini in minis)
    minis[0].batch["score"] += 100  # mini-batches are copies
    assert data.batch["score"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert batches_of(data.make_iterator(2, 1, dataloader_kwargs={"drop_last": True})) == [[0, 1], [2, 3]]
    assert batches_of(data.make_iterator(2, 0)) == []


def test_make_iterator_is_deterministic_under_a_seed():
    data = make(16)
    shuffle = {"shuffle": True}
    first = batches_of(data.make_iterator(4, epochs=2, seed=7, dataloader_kwargs=shuffle))
    again = batches_of(data.make_iterator(4, epochs=2, seed=7, dataloader_kwargs=shuffle))
    other = batches_of(data.make_iterator(4, epochs=2, seed=8, dataloader_kwargs=shuffle))
    assert first == again
    assert first != other
    assert first[:4] != first[4:]  # each epoch draws a new order
    assert sorted(row for mini in first[:4] for row in mini) == list(
        range(16)
    )  # an epoch sees every row once
    torch.manual_seed(0)
    unseeded = batches_of(data.make_iterator(4, 1, dataloader_kwargs=shuffle))
    torch.manual_seed(0)
    assert batches_of(data.make_iterator(4, 1, dataloader_kwargs=shuffle)) == unseeded


def test_make_iterator_errors_at_the_call():
    with raises(
        "make_iterator: unsupported dataloader_kwargs ['num_workers']; supported: 'shuffle', 'drop_last'."
    ):
        make(4).make_iterator(2, 1, dataloader_kwargs={"num_workers": 2})
    with raises("mini_batch_size must be an int >= 1, got 0."):
        make(4).make_iterator(0, 1)
    with raises("epochs must be an int >= 0, got -1."):
        make(4).make_iterator(2, -1)


def test_tensors_is_the_batch_or_a_clear_error():
    from trellis.errors import DataProtoError

    data = DataProto.from_dict({"x": torch.ones(2, 3)}, {"uid": ["a", "b"]})
    assert data.tensors is data.batch
    message = r"holds no tensors \(batch is None; non-tensor keys: \['uid'\]\)"
    with pytest.raises(DataProtoError, match=message):
        DataProto.from_dict(non_tensors={"uid": ["a", "b"]}).tensors  # noqa: B018
