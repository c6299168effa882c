"""Prompt datasets for RL: read parquet / jsonl, apply the chat template, batch into DataProto.

A row holds a prompt (a list of chat messages, or plain text) plus whatever the reward needs:
``data_source``, ``reward_model: {ground_truth: ...}``, ``extra_info: {...}``, and optionally
``agent_name``. Every column other than the prompt is carried through, per sample, to the
reward functions and agent loops as a non-tensor column of the batch.

Prompts are tokenized once, when the dataset is built, so that over-long prompts can be
filtered or reported up front and ``__getitem__`` is cheap.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from trellis.errors import DatasetError

logger = logging.getLogger(__name__)

SUPPORTED_FORMATS = (".parquet", ".jsonl", ".json")
TRUNCATION_MODES = ("error", "left", "right")


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a parquet or jsonl file (local path or any fsspec URL) as dicts.

    Raises:
        DatasetError: missing file, unsupported extension, or a line that is not a JSON object.
    """
    import fsspec

    extension = os.path.splitext(path.split("?")[0])[1].lower()
    if extension not in SUPPORTED_FORMATS:
        raise DatasetError(
            f"Dataset file {path!r} has extension {extension or '(none)'!r}; supported: "
            f"{', '.join(SUPPORTED_FORMATS)} (.json is read as JSON lines)."
        )
    try:
        opened = fsspec.open(path, "rb")
        with opened as handle:
            if extension == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                try:
                    rows: list[dict[str, Any]] = pq.read_table(handle).to_pylist()
                except pa.ArrowException as exc:
                    raise DatasetError(
                        f"Dataset file {path!r} is not a readable parquet file: {exc}"
                    ) from exc
                return rows
            lines = handle.read().decode("utf-8").splitlines()
    except FileNotFoundError as exc:
        raise DatasetError(f"Dataset file {path!r} does not exist.") from exc
    rows = []
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: line {number + 1} is not valid JSON ({exc.msg}).") from exc
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {number + 1} is a {type(row).__name__}, not a JSON object.")
        rows.append(row)
    return rows


def _messages(
    prompt: Any, where: str, column: str, wrap_text: bool, allow_empty: bool = False
) -> list[dict[str, str]] | str:
    """Validate a prompt cell: a list of {role, content} messages, or a string; never an empty one
    (unless ``allow_empty``: the row's images or videos are the prompt)."""
    if isinstance(prompt, str):
        if not prompt.strip() and not allow_empty:
            raise DatasetError(f"{where}, column {column!r}: the prompt is empty; give every row a prompt.")
        return [{"role": "user", "content": prompt}] if wrap_text else prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DatasetError(
            f"{where}, column {column!r}: expected a non-empty list of chat messages "
            f"({{'role': ..., 'content': ...}}) or a string, got {type(prompt).__name__} {prompt!r:.80}."
        )
    for i, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}, column {column!r}: message {i} must be a dict with string 'role' and "
                f"'content', got {message!r:.80}."
            )
    if not allow_empty and not any(message["content"].strip() for message in prompt):
        raise DatasetError(
            f"{where}, column {column!r}: every message of the prompt is empty; give every row a prompt."
        )
    return [dict(message) for message in prompt]


class RLDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """Prompts for RL training, tokenized with the chat template, one dict per sample.

    Args:
        data_files: one path/URL or a list; parquet or jsonl, rows concatenated in order.
        tokenizer: a Hugging Face tokenizer (its chat template is applied to message lists).
        prompt_key: the column holding the prompt.
        max_prompt_length: the longest prompt, in tokens, after the chat template.
        filter_overlong_prompts: drop longer prompts (the count is logged) instead of truncating.
        truncation: for longer prompts when not filtering: ``error`` (raise, naming the row),
            ``left`` (keep the end) or ``right`` (keep the start).
        apply_chat_template: None = when the tokenizer has a chat template. Plain-text prompts
            are wrapped as one user message when it is applied, and used verbatim otherwise.
        chat_template_kwargs: extra arguments to ``apply_chat_template`` (e.g. ``enable_thinking``).
        return_raw_chat: also return the messages as ``raw_prompt`` (for agent loops and tools).
        max_samples: keep only the first N rows (None = all).
        processor: the model's multimodal processor (``hf_processor``); needed when rows have images
            or videos, which go through it with the chat template (:mod:`trellis.data.multimodal`).
        image_key / video_key: the columns holding each row's list of images / videos.
        image_max_pixels / image_min_pixels: resize images and video frames (aspect ratio kept) so that
            ``width * height`` lies within these (None = no limit).

    Each item is a dict: ``input_ids`` (1-D LongTensor, unpadded), ``raw_prompt_ids`` (list of
    ints), ``index`` (row number over all files), ``raw_prompt`` (if asked), and every other
    column of the row (``data_source``, ``reward_model``, ``extra_info``, ...). With a ``processor``,
    also ``multi_modal_data`` (``{"image": [...], "video": [...]}``, the loaded items) and
    ``multi_modal_inputs`` (the processor's tensors: ``pixel_values``, ``image_grid_thw``, ...), both
    empty for a row without items, in place of the image and video columns; the prompt ids hold one
    pad token per image token. Items are decoded when the dataset is built (to count the prompt's
    tokens) and again per item read, so memory holds the rows' encoded bytes, not pixels.

    Raises:
        DatasetError: a file is missing or malformed; a row lacks the prompt column or has a
            malformed prompt; a prompt is too long with ``truncation="error"``. Messages name
            the file, the row (0-based) and the column.
    """

    def __init__(
        self,
        data_files: str | Sequence[str],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = False,
        truncation: str = "error",
        apply_chat_template: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        return_raw_chat: bool = False,
        max_samples: int | None = None,
        processor: Any = None,
        image_key: str = "images",
        video_key: str = "videos",
        image_max_pixels: int | None = None,
        image_min_pixels: int | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r} is not one of {', '.join(TRUNCATION_MODES)}.")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length} must be at least 1.")
        self.data_files = [data_files] if isinstance(data_files, str) else list(data_files)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.return_raw_chat = return_raw_chat
        if apply_chat_template is None:
            apply_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.processor = processor
        self.image_key, self.video_key = image_key, video_key
        self.pixel_limits = {"max_pixels": image_max_pixels, "min_pixels": image_min_pixels}

        rows: list[dict[str, Any]] = []
        where: list[str] = []
        for path in self.data_files:
            file_rows = read_rows(path)
            rows.extend(file_rows)
            where.extend(f"{path}: row {i}" for i in range(len(file_rows)))
            if max_samples is not None and len(rows) >= max_samples:
                break
        if max_samples is not None:
            rows, where = rows[:max_samples], where[:max_samples]
        if not rows:
            raise DatasetError(f"No rows in {self.data_files}; check the files are not empty.")

        prompts = []
        for row, location in zip(rows, where, strict=True):
            if prompt_key not in row:
                raise DatasetError(
                    f"{location}: missing column {prompt_key!r} (columns: {', '.join(sorted(row))}). "
                    f"Set data.prompt_key to the column that holds the prompt."
                )
            pictures = any(_items(row.get(key)) for key in (image_key, video_key)) and processor is not None
            prompts.append(_messages(row[prompt_key], location, prompt_key, apply_chat_template, pictures))
        token_ids = self._tokenize(prompts)
        for i, (row, location) in enumerate(zip(rows, where, strict=True)):
            if self._has_items(row, location):  # the prompt with its images through the processor
                prompts[i], token_ids[i] = self._vision_prompt(row, prompts[i], location)

        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []
        self.filtered = 0
        for index, (row, location, prompt, ids) in enumerate(
            zip(rows, where, prompts, token_ids, strict=True)
        ):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.filtered += 1
                    continue
                if truncation == "error":
                    raise DatasetError(
                        f"{location}, column {prompt_key!r}: the prompt is {len(ids)} tokens, longer "
                        f"than max_prompt_length={max_prompt_length}. Raise max_prompt_length, set "
                        "filter_overlong_prompts, or truncation to 'left' or 'right'."
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            sample = {k: v for k, v in row.items() if k != prompt_key}
            sample["__where__"] = location
            sample["index"] = index
            if return_raw_chat:
                sample["raw_prompt"] = prompt
            self.rows.append(sample)
            self.prompt_ids.append(ids)
        if self.filtered:
            logger.warning(
                "Filtered %d of %d prompts longer than max_prompt_length=%d tokens.",
                self.filtered,
                len(rows),
                max_prompt_length,
            )
        if not self.rows:
            raise DatasetError(
                f"Every prompt in {self.data_files} is longer than max_prompt_length={max_prompt_length}."
            )

    def _has_items(self, row: dict[str, Any], location: str) -> bool:
        present = [key for key in (self.image_key, self.video_key) if _items(row.get(key))]
        if present and self.processor is None:
            raise DatasetError(
                f"{location}: column {present[0]!r} holds images or videos, but the model has no multimodal "
                "processor (model.path names a text-only model); use a vision-language model, or drop the "
                "column (data.image_key / data.video_key name the columns read)."
            )
        return bool(present)

    def _items(self, row: dict[str, Any], location: str) -> tuple[list[Any], list[Any]]:
        from trellis.data import multimodal

        images = [
            multimodal.load_image(
                item, where=f"{location}, column {self.image_key!r}, item {i}", **self.pixel_limits
            )
            for i, item in enumerate(_items(row.get(self.image_key)))
        ]
        videos = [
            multimodal.load_video(
                item, where=f"{location}, column {self.video_key!r}, item {i}", **self.pixel_limits
            )
            for i, item in enumerate(_items(row.get(self.video_key)))
        ]
        return images, videos

    def _vision_prompt(self, row: dict[str, Any], prompt: Any, location: str) -> tuple[Any, list[int]]:
        """The row's messages with content parts for its items, and their token ids."""
        from trellis.data import multimodal

        images, videos = self._items(row, location)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages = multimodal.vision_messages(
            messages, len(images), len(videos), where=f"{location}, column {self.prompt_key!r}"
        )
        ids, _ = multimodal.chat_ids(
            self.processor,
            messages,
            images=images,
            videos=videos,
            where=location,
            **self.chat_template_kwargs,
        )
        return messages, ids

    def _template(self) -> Any:
        """What renders chat messages: the processor's template when the tokenizer has none."""
        if self.processor is not None and not getattr(self.tokenizer, "chat_template", None):
            return self.processor
        return self.tokenizer

    def _tokenize(self, prompts: list[Any]) -> list[list[int]]:
        if self.apply_chat_template:
            template = self._template()
            texts = [
                template.apply_chat_template(
                    p, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
                )
                for p in prompts
            ]
        else:
            texts = [p if isinstance(p, str) else "\n".join(m["content"] for m in p) for p in prompts]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.prompt_ids[i]
        row = dict(self.rows[i])
        location = row.pop("__where__")
        if self.processor is not None:
            from trellis.data import multimodal

            images, videos = self._items(row, location) if self._has_items(row, location) else ([], [])
            row.pop(self.image_key, None)
            row.pop(self.video_key, None)
            row[multimodal.MULTI_MODAL_DATA] = {"image": images, "video": videos}
            row[multimodal.MULTI_MODAL_INPUTS] = multimodal.vision_inputs(
                self.processor, images, videos, where=location
            )
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "raw_prompt_ids": list(ids), **row}

    def split(self, num_splits: int) -> list[RLDataset]:
        """``num_splits`` contiguous shards whose sizes differ by at most one (e.g. per worker)."""
        if not isinstance(num_splits, int) or not 1 <= num_splits <= len(self):
            raise ValueError(
                f"num_splits={num_splits!r} must be an int between 1 and {len(self)} (the rows)."
            )
        bounds = np.linspace(0, len(self), num_splits + 1).round().astype(int)
        shards = []
        for start, stop in itertools.pairwise(bounds):
            shard = object.__new__(RLDataset)
            shard.__dict__.update(self.__dict__)
            shard.rows, shard.prompt_ids = self.rows[start:stop], self.prompt_ids[start:stop]
            shards.append(shard)
        return shards

    def collate_fn(self, samples: list[dict[str, Any]]) -> Any:
        """Batch ``samples`` into a DataProto, left-padding with the tokenizer's pad token."""
        return collate_fn(samples, pad_token_id=pad_id(self.tokenizer))


def _items(cell: Any) -> list[Any]:
    """A row's image or video cell as a list: None / NaN / empty mean none; one item becomes a list."""
    if cell is None or (isinstance(cell, float) and cell != cell):
        return []
    if isinstance(cell, list | tuple):
        return list(cell)
    if isinstance(cell, np.ndarray) and cell.dtype == object:
        return list(cell)
    return [cell]


def pad_id(tokenizer: Any) -> int:
    """The id prompts and responses are padded with: the tokenizer's pad token, else its eos token.

    Raises:
        ValueError: the tokenizer has neither.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("The tokenizer has neither a pad nor an eos token; set tokenizer.pad_token.")
    return int(pad)


def collate_fn(samples: Sequence[dict[str, Any]], pad_token_id: int = 0) -> Any:
    """Batch dataset items into a ``DataProto``.

    Tensors: ``input_ids`` left-padded with ``pad_token_id`` to the longest prompt,
    ``attention_mask`` (1 on real tokens), ``position_ids`` (0 at the first real token,
    counting up; 0 on padding) — all ``(bs, max_len)`` int64. Every other key becomes a
    non-tensor column (a numpy object array of length ``bs``).
    """
    from trellis.data.protocol import DataProto

    if not samples:
        raise ValueError("collate_fn got no samples; a batch needs at least one.")
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    width = int(lengths.max())
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
        if len(ids):
            input_ids[row, width - len(ids) :] = ids
    attention_mask = (torch.arange(width) >= (width - lengths)[:, None]).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    columns: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    for key in samples[0]:
        if key == "input_ids":
            continue
        column = np.empty(len(samples), dtype=object)
        for row, sample in enumerate(samples):
            if key not in sample:
                raise ValueError(f"Sample {row} of the batch has no {key!r}, which sample 0 has.")
            column[row] = sample[key]
        columns[key] = column
    return DataProto.from_single_dict(columns)


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Indices over ``data_len`` rows, epoch after epoch, whose position is checkpoint state.

    With ``shuffle`` the order of epoch ``e`` is a permutation drawn from ``seed + e``, so it
    does not depend on how many epochs ran in this process. ``state_dict()`` records the epoch
    and how many indices of it were consumed; a sampler that loads it continues exactly there.
    One ``iter()`` yields the rest of the current epoch, then moves to the next.
    """

    def __init__(self, data_len: int, *, shuffle: bool = True, seed: int = 0):
        if data_len < 1:
            raise ValueError(f"data_len={data_len} must be at least 1.")
        self.data_len, self.shuffle, self.seed = data_len, shuffle, seed
        self.epoch, self.position = 0, 0

    def order(self, epoch: int) -> list[int]:
        """The full index order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.data_len))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.data_len, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        while self.position < self.data_len:
            index = order[self.position]
            self.position += 1
            yield index
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return self.data_len

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "data_len": self.data_len,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. Raises ValueError if it was saved for other data or settings."""
        for key in ("data_len", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"Sampler state was saved with {key}={state.get(key)!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same data and settings."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class PromptLoader:
    """Batches of prompts as ``DataProto``, resumable from a checkpoint.

    Iterating yields the remaining batches of the current epoch. ``drop_last`` drops the
    final short batch of an epoch (RL steps want a fixed number of prompts).
    ``state_dict()`` / ``load_state_dict()`` carry the sampler position, so a resumed run
    sees the same next batch as the uninterrupted run would have.

    With ``num_workers`` > 0 (``data.dataloader_num_workers``), that many worker processes of a
    ``torch.utils.data.DataLoader`` read the rows (``dataset[i]``) and collate each batch, a few
    batches ahead; the batches and their order are the same as with 0 (rows read here, when asked
    for). The position still counts only the batches handed out, so resuming is unchanged. The
    workers of an epoch start with its first batch and stop with its last (or when iteration is
    abandoned); they take their seeds from the loader's seed, never from the global RNG.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate: Any = None,
        num_workers: int = 0,
    ):
        if batch_size < 1 or (drop_last and batch_size > len(dataset)):
            raise ValueError(
                f"batch_size={batch_size} must be between 1 and the dataset size {len(dataset)} "
                "(with drop_last, a larger batch would never be produced)."
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers={num_workers!r} must be an int >= 0 (0 = read rows in this process)."
            )
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_workers = num_workers
        self.sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed)
        self.collate = collate or getattr(dataset, "collate_fn", collate_fn)

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        order = sampler.order(sampler.epoch)
        starts = range(sampler.position, sampler.data_len, self.batch_size)
        batches = [order[start : start + self.batch_size] for start in starts]
        if batches and len(batches[-1]) < self.batch_size and self.drop_last:
            batches.pop()
        if self.num_workers and batches:
            import trellis.data.protocol  # noqa: F401 - imported once here, not in every forked worker

            loaded: Iterator[Any] = iter(
                torch.utils.data.DataLoader(
                    self.dataset,
                    batch_sampler=batches,
                    num_workers=self.num_workers,
                    collate_fn=self.collate,
                    # the workers' seeds: from this generator, so the global RNG is left as it was
                    generator=torch.Generator().manual_seed(sampler.seed + sampler.epoch),
                )
            )
        else:
            loaded = (self.collate([self.dataset[i] for i in indices]) for indices in batches)
        for indices, batch in zip(batches, loaded, strict=True):
            sampler.position += len(indices)
            yield batch
        sampler.epoch, sampler.position = sampler.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("batch_size") != self.batch_size:
            raise ValueError(
                f"Loader state was saved with batch_size={state.get('batch_size')!r}, this loader has "
                f"{self.batch_size}; resume with the same data.train_batch_size."
            )
        self.sampler.load_state_dict(state["sampler"])
