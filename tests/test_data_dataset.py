"""trellis.data.dataset: reading, chat templating, filtering/truncation, collation, resumable order."""

from __future__ import annotations

import copy
import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import trellis.data.protocol  # noqa: F401 - before the loader forks workers, as in a training run
from trellis.data.dataset import PromptLoader, ResumableSampler, RLDataset, collate_fn, read_rows
from trellis.errors import DatasetError


@pytest.fixture(scope="module")
def tokenizer():
    from trellis.recipes.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "data_source": "arith",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"split": "train", "tags": ["add", str(i)]},
        }
        for i in range(start, start + n)
    ]


def write_jsonl(path, data) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


def write_parquet(path, data) -> str:
    pq.write_table(pa.Table.from_pylist(data), path)
    return str(path)


def test_reads_parquet_and_jsonl_and_applies_the_chat_template(tmp_path, tokenizer):
    files = [
        write_parquet(tmp_path / "a.parquet", rows(3)),
        write_jsonl(tmp_path / "b.jsonl", rows(2, start=3)),
    ]
    dataset = RLDataset(files, tokenizer, max_prompt_length=64, return_raw_chat=True)
    assert len(dataset) == 5
    item = dataset[4]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 4 + 4?"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(item["input_ids"]) == expected
    assert item["input_ids"].dtype == torch.long and item["raw_prompt_ids"] == item["input_ids"].tolist()
    assert item["raw_prompt"] == [{"role": "user", "content": "What is 4 + 4?"}]
    assert item["reward_model"] == {"ground_truth": "8", "style": "rule"}
    assert item["extra_info"] == {"split": "train", "tags": ["add", "4"]}
    assert (item["data_source"], item["index"]) == ("arith", 4)
    assert "prompt" not in item
    # the parquet rows carry nested fields through unchanged
    assert dataset[1]["extra_info"] == {"split": "train", "tags": ["add", "1"]}


def test_any_fsspec_url(tmp_path, tokenizer):
    import fsspec

    with fsspec.open("memory://trellis-test/data.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows(2)))
    dataset = RLDataset("memory://trellis-test/data.jsonl", tokenizer)
    assert [dataset[i]["reward_model"]["ground_truth"] for i in range(2)] == ["0", "2"]


def test_plain_text_prompts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2 + 2 =", "data_source": "x"}])
    templated = RLDataset(path, tokenizer)
    assert (
        tokenizer.decode(templated[0]["input_ids"])
        == "<|im_start|>user\n2 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    )
    raw = RLDataset(path, tokenizer, apply_chat_template=False)
    assert tokenizer.decode(raw[0]["input_ids"]) == "2 + 2 ="


def test_overlong_prompts_filtered_truncated_or_rejected(tmp_path, tokenizer, caplog):
    data = rows(3)
    data[1]["prompt"][0]["content"] = "word " * 200
    path = write_jsonl(tmp_path / "long.jsonl", data)
    short_len = len(RLDataset(path, tokenizer, max_samples=1)[0]["input_ids"])

    with caplog.at_level(logging.WARNING, logger="trellis.data.dataset"):
        filtered = RLDataset(path, tokenizer, max_prompt_length=short_len, filter_overlong_prompts=True)
    assert len(filtered) == 2 and filtered.filtered == 1
    assert [filtered[i]["index"] for i in range(2)] == [0, 2]
    assert "Filtered 1 of 3 prompts longer than max_prompt_length=" in caplog.text

    full = tokenizer.apply_chat_template(data[1]["prompt"], add_generation_prompt=True, tokenize=False)
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    left = RLDataset(path, tokenizer, max_prompt_length=short_len, truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=short_len, truncation="right")
    assert left[1]["raw_prompt_ids"] == full_ids[-short_len:]
    assert right[1]["raw_prompt_ids"] == full_ids[:short_len]

    with pytest.raises(DatasetError) as info:
        RLDataset(path, tokenizer, max_prompt_length=short_len)
    assert str(info.value).startswith(
        f"{path}: row 1, column 'prompt': the prompt is {len(full_ids)} tokens, longer than "
        f"max_prompt_length={short_len}."
    )


def test_malformed_rows_name_file_row_and_column(tmp_path, tokenizer):
    data = rows(3)
    del data[2]["prompt"]
    path = write_jsonl(tmp_path / "missing.jsonl", data)
    with pytest.raises(
        DatasetError,
        match=r"missing\.jsonl: row 2: missing column 'prompt' \(columns: "
        r"data_source, extra_info, reward_model\)",
    ):
        RLDataset(path, tokenizer)

    data = rows(2)
    data[1]["prompt"] = [{"role": "user"}]
    path = write_jsonl(tmp_path / "bad.jsonl", data)
    with pytest.raises(DatasetError, match=r"bad\.jsonl: row 1, column 'prompt': message 0 must be a dict"):
        RLDataset(path, tokenizer)

    data[1]["prompt"] = 17
    path = write_jsonl(tmp_path / "num.jsonl", data)
    with pytest.raises(DatasetError, match=r"num\.jsonl: row 1, column 'prompt': expected a non-empty list"):
        RLDataset(path, tokenizer)

    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl: line 2 is not valid JSON"):
        read_rows(str(tmp_path / "broken.jsonl"))
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DatasetError, match=r"list\.jsonl: line 1 is a list, not a JSON object"):
        read_rows(str(tmp_path / "list.jsonl"))
    with pytest.raises(DatasetError, match=r"nope\.parquet' does not exist"):
        read_rows(str(tmp_path / "nope.parquet"))
    with pytest.raises(DatasetError, match=r"extension '\.csv'; supported: \.parquet, \.jsonl, \.json"):
        read_rows(str(tmp_path / "data.csv"))


def test_bad_arguments(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    with pytest.raises(ValueError, match=r"truncation='middle' is not one of error, left, right"):
        RLDataset(path, tokenizer, truncation="middle")
    dataset = RLDataset(path, tokenizer)
    with pytest.raises(ValueError, match=r"num_splits=5 must be an int between 1 and 4"):
        dataset.split(5)


def test_split_into_near_equal_contiguous_shards(tmp_path, tokenizer):
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows(10)), tokenizer)
    shards = dataset.split(3)
    assert [len(s) for s in shards] == [3, 4, 3]
    assert [s[i]["index"] for s in shards for i in range(len(s))] == list(range(10))
    assert len(dataset) == 10  # the original is untouched


def test_collate_left_pads_and_carries_non_tensors(tmp_path, tokenizer):
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows(2)), tokenizer)
    samples = [dataset[0], {**dataset[1], "input_ids": dataset[1]["input_ids"][:-2]}]
    batch = dataset.collate_fn(samples)
    n0, n1 = len(samples[0]["input_ids"]), len(samples[1]["input_ids"])
    pad = tokenizer.pad_token_id
    assert batch.batch["input_ids"].shape == (2, n0)
    assert batch.batch["input_ids"][0].tolist() == samples[0]["input_ids"].tolist()
    assert batch.batch["input_ids"][1].tolist() == [pad, pad, *samples[1]["input_ids"].tolist()]
    assert batch.batch["attention_mask"][1].tolist() == [0, 0] + [1] * n1
    assert batch.batch["position_ids"][1].tolist() == [0, 0, *range(n1)]
    assert batch.batch["position_ids"][0].tolist() == list(range(n0))
    assert batch.non_tensor_batch["reward_model"].tolist() == [
        {"ground_truth": "0", "style": "rule"},
        {"ground_truth": "2", "style": "rule"},
    ]
    assert batch.non_tensor_batch["raw_prompt_ids"][1] == samples[1]["raw_prompt_ids"]
    assert batch.non_tensor_batch["index"].tolist() == [0, 1]

    with pytest.raises(
        ValueError, match=r"Sample 1 of the batch has no 'raw_prompt_ids', which sample 0 has"
    ):
        collate_fn([dataset[0], {"input_ids": [1, 2]}])


def test_sampler_order_is_seeded_per_epoch_and_resumable():
    sampler = ResumableSampler(6, shuffle=True, seed=3)
    first = list(sampler)
    second = list(sampler)
    assert sorted(first) == list(range(6)) and first != second  # a new permutation per epoch
    assert ResumableSampler(6, seed=3).order(1) == second

    stopped = ResumableSampler(6, seed=3)
    iterator = iter(stopped)
    taken = [next(iterator) for _ in range(4)]
    resumed = ResumableSampler(6, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(stopped.state_dict())))
    assert taken + list(resumed) == first
    assert list(ResumableSampler(4, shuffle=False)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"saved with seed=3 but this sampler has seed=4"):
        ResumableSampler(6, seed=4).load_state_dict(stopped.state_dict())


def test_loader_resumes_with_the_same_next_batch(tmp_path, tokenizer):
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows(10)), tokenizer)
    uninterrupted = PromptLoader(dataset, batch_size=4, seed=7)
    assert len(uninterrupted) == 2
    epoch0 = [b.non_tensor_batch["index"].tolist() for b in uninterrupted]
    epoch1 = [b.non_tensor_batch["index"].tolist() for b in uninterrupted]
    assert [len(b) for b in epoch0] == [4, 4] and epoch0 != epoch1

    run = PromptLoader(dataset, batch_size=4, seed=7)
    next(iter(run))  # one step, then "killed"
    state = json.loads(json.dumps(run.state_dict()))
    resumed = PromptLoader(dataset, batch_size=4, seed=7)
    resumed.load_state_dict(state)
    assert [b.non_tensor_batch["index"].tolist() for b in resumed] == epoch0[1:]
    assert [b.non_tensor_batch["index"].tolist() for b in resumed] == epoch1

    with pytest.raises(ValueError, match=r"saved with batch_size=4, this loader has 5"):
        PromptLoader(dataset, batch_size=5, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size=11 must be between 1 and the dataset size 10"):
        PromptLoader(dataset, batch_size=11)
    keep_last = PromptLoader(dataset, batch_size=4, shuffle=False, drop_last=False)
    assert [len(b) for b in keep_last] == [4, 4, 2] and len(keep_last) == 3


def test_prompt_key_names_the_prompt_column(tmp_path, tokenizer):
    data = [{"question": [{"role": "user", "content": "What is 5 + 5?"}], "data_source": "arith"}]
    dataset = RLDataset(write_jsonl(tmp_path / "q.jsonl", data), tokenizer, prompt_key="question")
    expected = tokenizer.apply_chat_template(data[0]["question"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(dataset[0]["input_ids"]) == expected
    assert "question" not in dataset[0] and dataset[0]["data_source"] == "arith"


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_jsonl(tmp_path / "d.jsonl", rows(1))
    dataset = RLDataset(path, templated, chat_template_kwargs={"greeting": "Hello! "})
    assert templated.decode(dataset[0]["input_ids"]) == "Hello! What is 0 + 0?"


class WorkerRecordingDataset(RLDataset):
    """Rows that say which process (and DataLoader worker) read them."""

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {**super().__getitem__(i), "pid": os.getpid(), "worker": -1 if info is None else info.id}


def batches_of(loader, epochs=1):
    return [batch for _ in range(epochs) for batch in loader]


def test_worker_processes_give_the_same_batches_and_resume(tmp_path, tokenizer):
    dataset = WorkerRecordingDataset(write_jsonl(tmp_path / "d.jsonl", rows(10)), tokenizer)
    rng = torch.get_rng_state()
    in_process = batches_of(PromptLoader(dataset, batch_size=3, seed=5), epochs=2)
    workers = batches_of(PromptLoader(dataset, batch_size=3, seed=5, num_workers=2), epochs=2)
    assert torch.equal(torch.get_rng_state(), rng)  # worker seeds come from the loader, not the global RNG
    assert len(in_process) == len(workers) == 6
    for a, b in zip(in_process, workers, strict=True):
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert torch.equal(a.batch[key], b.batch[key]), key
        for key in ("index", "raw_prompt_ids", "reward_model", "extra_info"):
            assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert [b.non_tensor_batch["index"].tolist() for b in in_process[:3]] != [
        b.non_tensor_batch["index"].tolist() for b in batches_of(PromptLoader(dataset, batch_size=3, seed=6))
    ]  # the seed orders the epoch
    # rows were read in this process without workers, and in two other processes with them
    assert {pid for b in in_process for pid in b.non_tensor_batch["pid"]} == {os.getpid()}
    assert {w for b in in_process for w in b.non_tensor_batch["worker"]} == {-1}
    assert os.getpid() not in {pid for b in workers for pid in b.non_tensor_batch["pid"]}
    assert {w for b in workers for w in b.non_tensor_batch["worker"]} == {0, 1}

    # stopped after one batch (the workers had read ahead): resumes with the next, in either mode
    run = PromptLoader(dataset, batch_size=3, seed=5, num_workers=2)
    next(iter(run))
    state = json.loads(json.dumps(run.state_dict()))
    assert state["sampler"]["position"] == 3
    for num_workers in (0, 2):
        resumed = PromptLoader(dataset, batch_size=3, seed=5, num_workers=num_workers)
        resumed.load_state_dict(state)
        indices = [b.non_tensor_batch["index"].tolist() for b in batches_of(resumed)]
        assert indices == [b.non_tensor_batch["index"].tolist() for b in in_process[1:3]]
    with pytest.raises(ValueError, match=r"num_workers=-1 must be an int >= 0"):
        PromptLoader(dataset, batch_size=3, num_workers=-1)
