"""CheckpointManager: layout, round trips, pruning, resume modes, corrupt checkpoints, fsspec, ranks,
saving in parts (shards written by their own processes, kills at every storage operation); and the
RNG capture/restore of trellis.checkpoint.rng."""

from __future__ import annotations

import json
import random
import threading
import uuid

import numpy as np
import pytest
import torch

from trellis.checkpoint import CheckpointManager
from trellis.checkpoint.rng import capture_rng_state, restore_rng_state
from trellis.checkpoint.training import MANIFEST, POINTER, load_rank_file, verify_checkpoint
from trellis.errors import CheckpointError


def states(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {
        "actor": {"model": {"w": torch.randn(4, 3, generator=gen)}, "global_step": step},
        "trainer": {"step": step, "tracker_run_id": "run-1", "sampler": {"epoch": 0, "position": step}},
    }


def assert_states_equal(a, b):
    assert a.keys() == b.keys()
    assert torch.equal(a["actor"]["model"]["w"], b["actor"]["model"]["w"])
    assert a["trainer"] == b["trainer"] and a["actor"]["global_step"] == b["actor"]["global_step"]


# ---------------------------------------------------------------- save, layout, load


def test_save_layout_and_round_trip(tmp_path, tiny_model_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.latest() is None
    path = manager.save(3, states(3), hf_files=tiny_model_path)
    assert path == str(tmp_path / "ckpt" / "global_step_3")
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3", POINTER]
    assert (root / POINTER).read_text() == "3\n"
    folder = root / "global_step_3"
    assert sorted(p.name for p in folder.iterdir()) == ["hf", MANIFEST, "rank_0.pt"]
    hf = sorted(p.name for p in (folder / "hf").iterdir())
    assert "config.json" in hf and "tokenizer.json" in hf and not any(n.endswith(".safetensors") for n in hf)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (manifest["format"], manifest["step"], manifest["world_size"]) == ("trellis-checkpoint", 3, 1)
    assert set(manifest["files"]) == {"rank_0.pt", *(f"hf/{n}" for n in hf)}
    assert manifest["files"]["rank_0.pt"]["size"] == (folder / "rank_0.pt").stat().st_size
    assert manager.latest() == path
    assert_states_equal(manager.load(path), states(3))


def test_engine_state_resumes_bit_identically(tmp_path, tiny_model_path):
    """Optimizer and lr-schedule state survive torch.load(weights_only=True); training continues exactly."""
    from trellis.config.schema import ActorConfig, ModelConfig, OptimConfig
    from trellis.data.protocol import DataProto
    from trellis.engine.single import SingleEngine

    def build():
        optim = OptimConfig(lr=1e-2, lr_scheduler="cosine", lr_warmup_steps=1)
        return SingleEngine(
            ModelConfig(path=tiny_model_path, dtype="float32"),
            ActorConfig(ppo_micro_batch_size_per_device=2, optim=optim),
            total_steps=4,
            device="cpu",
        )

    ids = torch.randint(4, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 5:]}
    )
    batch.batch["response_mask"] = torch.ones(2, 3)

    def step(engine):
        engine.zero_grad()
        engine.forward_backward(batch, lambda out, micro, info: (-out["log_probs"].mean(), {}))
        return engine.optimizer_step()

    manager = CheckpointManager(tmp_path)
    first = build()
    step(first)
    path = manager.save(1, {"actor": first.state_dict(), "rng": capture_rng_state()})
    expected = [step(first)["lr"], step(first)["lr"]]

    second = build()
    loaded = manager.load(path)
    second.load_state_dict(loaded["actor"])
    restore_rng_state(loaded["rng"])
    assert [step(second)["lr"], step(second)["lr"]] == expected
    assert second.global_step == first.global_step == 3
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_keep_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in range(1, 6):
        manager.save(step, states(step))
    assert manager.steps() == [4, 5]
    assert manager.latest() == str(tmp_path / "global_step_5")
    keep_all = CheckpointManager(tmp_path / "all")
    for step in range(1, 4):
        keep_all.save(step, states(step))
    assert keep_all.steps() == [1, 2, 3]


def test_resaving_an_earlier_step_replaces_it_and_keeps_later_folders(tmp_path):
    """A run resumed from step 1 (resume_path) saves step 2 again: the folders of the old run after
    the latest step are neither counted nor deleted, until the new run replaces them."""
    for step in (1, 2, 3):
        CheckpointManager(tmp_path).save(step, states(step))
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    changed = states(2)
    changed["trainer"]["tracker_run_id"] = "run-2"
    manager.save(2, changed)
    assert manager.latest() == str(tmp_path / "global_step_2")
    assert manager.load(manager.latest())["trainer"]["tracker_run_id"] == "run-2"
    assert manager.steps() == [1, 2, 3]
    manager.save(3, states(3))
    assert manager.steps() == [2, 3]
    assert manager.load(str(tmp_path / "global_step_2"))["trainer"]["tracker_run_id"] == "run-2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_save_after_an_interrupted_publish(tmp_path):
    """Killed between the rename and the pointer: the folder exists, the pointer names the step before."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, states(1))
    manager.save(2, states(2))
    (tmp_path / POINTER).write_text("1\n")
    assert manager.latest() == str(tmp_path / "global_step_1")
    manager.save(2, states(2))
    assert manager.latest() == str(tmp_path / "global_step_2")
    assert_states_equal(manager.load(manager.latest()), states(2))


def test_stale_temporary_folders_are_ignored_then_removed(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, states(1))
    stale = tmp_path / ".tmp_global_step_2"
    stale.mkdir()
    (stale / "rank_0.pt").write_bytes(b"half a file")
    (tmp_path / f"{POINTER}.abc.partial").write_text("2\n")
    assert manager.latest() == str(tmp_path / "global_step_1")
    assert manager.steps() == [1]
    assert_states_equal(manager.load(manager.latest()), states(1))
    manager.save(2, states(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_2", POINTER]


def test_states_that_weights_only_load_refuses_are_rejected_on_save(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"states\['trainer'\]\['noise'\].*numpy.ndarray"):
        manager.save(1, {"trainer": {"noise": np.zeros(3)}})
    with pytest.raises(CheckpointError, match=r"states\['trainer'\]\['lr'\].*numpy.float64"):
        manager.save(1, {"trainer": {"lr": np.float64(0.1)}})
    assert manager.latest() is None
    assert not (tmp_path / "global_step_1").exists()


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep=0"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, 2\)"):
        CheckpointManager(tmp_path, rank=2, world_size=2, barrier=lambda: None)
    with pytest.raises(ValueError, match="needs barrier="):
        CheckpointManager(tmp_path, world_size=2)
    with pytest.raises(ValueError, match="step=-1"):
        CheckpointManager(tmp_path).save(-1, {})
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        CheckpointManager(tmp_path).save(1, {}, hf_files=tmp_path)


def test_from_config(tmp_path):
    from trellis.config.schema import TrainerConfig

    manager = CheckpointManager.from_config(TrainerConfig(run_dir=str(tmp_path), max_actor_ckpt_to_keep=3))
    assert (manager.root, manager.max_to_keep) == (f"{tmp_path}/checkpoints", 3)


# ---------------------------------------------------------------- resume modes


def test_resolve_resume(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    assert manager.resolve_resume("auto") is None
    for step in (1, 2):
        manager.save(step, states(step))
    latest = str(tmp_path / "run" / "global_step_2")
    assert manager.resolve_resume("auto") == latest
    assert manager.resolve_resume("disable") is None
    first = str(tmp_path / "run" / "global_step_1")
    assert manager.resolve_resume("resume_path", first) == first
    assert manager.resolve_resume("resume_path", tmp_path / "run") == latest  # a root: its latest
    with pytest.raises(ValueError, match="needs resume_from_path"):
        manager.resolve_resume("resume_path")
    with pytest.raises(
        ValueError, match=r"resume_mode='latest' is not one of \['auto', 'disable', 'resume_path'\]"
    ):
        manager.resolve_resume("latest")
    with pytest.raises(CheckpointError, match="global_step_7' does not exist"):
        manager.resolve_resume("resume_path", tmp_path / "run" / "global_step_7")


# ---------------------------------------------------------------- corrupt and incomplete checkpoints


@pytest.fixture
def saved(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, states(1))
    return manager, tmp_path / "global_step_1"


def test_truncated_rank_file(saved):
    manager, folder = saved
    data = (folder / "rank_0.pt").read_bytes()
    (folder / "rank_0.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{folder}/rank_0.pt' is \d+ bytes.*truncated"):
        manager.load(folder)
    with pytest.raises(CheckpointError, match=rf"pointer .*{POINTER}' names step 1, but.*truncated"):
        manager.latest()


def test_missing_manifest(saved):
    manager, folder = saved
    (folder / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=rf"Checkpoint '{folder}' is incomplete: it has no {MANIFEST}"):
        manager.load(folder)
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.resolve_resume("auto")


def test_tampered_content_fails_its_checksum(saved):
    manager, folder = saved
    data = bytearray((folder / "rank_0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    (folder / "rank_0.pt").write_bytes(bytes(data))
    verify_checkpoint(folder)  # sizes alone do not see it
    with pytest.raises(CheckpointError, match=rf"{folder}/rank_0.pt' is corrupt: its sha256"):
        manager.load(folder)
    with pytest.raises(CheckpointError, match="is corrupt"):
        verify_checkpoint(folder, checksums=True)


def test_tampered_manifest(saved):
    manager, folder = saved
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["rank_0.pt"]["sha256"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is corrupt"):
        manager.load(folder)
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"its {MANIFEST} is unreadable"):
        manager.load(folder)


def test_world_size_mismatch(saved):
    _, folder = saved
    two = CheckpointManager(folder.parent, rank=1, world_size=2, barrier=lambda: None)
    with pytest.raises(CheckpointError, match=rf"'{folder}' was saved by 1 ranks, but 2 are loading it"):
        two.load(folder)
    with pytest.raises(CheckpointError, match="saved by 1 ranks"):
        two.latest()


def test_pointer_naming_a_missing_or_bad_folder(saved):
    manager, folder = saved
    (folder.parent / POINTER).write_text("5\n")
    with pytest.raises(
        CheckpointError, match=r"names step 5, but: Checkpoint '.*global_step_5' does not exist"
    ):
        manager.latest()
    (folder.parent / POINTER).write_text("garbage")
    with pytest.raises(CheckpointError, match=r"holds 'garbage', not a step number"):
        manager.resolve_resume("auto")


def test_missing_rank_file(tmp_path):
    """A rank that never wrote its file: the save fails, nothing is published."""
    manager = CheckpointManager(tmp_path, rank=0, world_size=2, barrier=lambda: None)
    with pytest.raises(CheckpointError, match=r"rank 1 did not write rank_1\.pt"):
        manager.save(1, states(1))
    assert manager.latest() is None and manager.steps() == []


# ---------------------------------------------------------------- fsspec, ranks


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_root(tmp_path, scheme, tiny_model_path):
    import fsspec

    root = f"memory://ckpt-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}/ckpt"
    try:
        manager = CheckpointManager(root, max_to_keep=2)
        for step in range(1, 4):
            manager.save(step, states(step), hf_files=tiny_model_path if step == 3 else None)
        assert manager.steps() == [2, 3]
        assert manager.latest() == f"{root}/global_step_3"
        assert_states_equal(manager.load(manager.latest()), states(3))
        assert manager.resolve_resume("resume_path", f"{root}/global_step_2") == f"{root}/global_step_2"
        fs, path = fsspec.core.url_to_fs(root)
        assert fs.cat_file(f"{path}/{POINTER}") == b"3\n"
        assert fs.exists(f"{path}/global_step_3/hf/config.json")
        fs.pipe_file(f"{path}/global_step_3/rank_0.pt", b"truncated")
        with pytest.raises(CheckpointError, match=f"{root}/global_step_3/rank_0.pt' is 9 bytes"):
            manager.latest()
    finally:
        if scheme == "memory":
            fsspec.filesystem("memory").rm(root.removeprefix("memory:/"), recursive=True)


def in_two_ranks(barrier: threading.Barrier, work) -> None:
    """Run ``work(rank)`` for ranks 0 and 1 in threads sharing ``barrier``; a failing rank aborts the
    barrier (so its peer does not wait) and the test fails with what it raised."""
    errors: list[BaseException] = []

    def run(rank):
        try:
            work(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_ranks_write_their_own_files(tmp_path):
    """Two ranks (threads sharing a barrier) save together; each loads its own states back."""
    barrier = threading.Barrier(2, timeout=30)
    managers = [
        CheckpointManager(tmp_path, max_to_keep=1, rank=rank, world_size=2, barrier=barrier.wait)
        for rank in (0, 1)
    ]

    def work(rank):
        for step in (1, 2):
            managers[rank].save(step, states(10 * step + rank))

    in_two_ranks(barrier, work)
    folder = tmp_path / "global_step_2"
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "rank_0.pt", "rank_1.pt"]
    assert managers[0].steps() == [2]
    for rank in (0, 1):
        assert managers[rank].latest() == str(folder)
        assert_states_equal(managers[rank].load(folder), states(20 + rank))


# ---------------------------------------------------------------- saving in parts


def shard(step: int, part: str, rank: int) -> dict:
    gen = torch.Generator().manual_seed(100 * step + 10 * rank + len(part))
    return {part: {"model": {"w": torch.randn(3, 2, generator=gen)}, "global_step": step}, "rng": {"n": rank}}


def save_in_parts(manager, step: int, parts: dict, hf_files=None) -> tuple[str, list[dict]]:
    """One save in parts, as the trainer makes it: begin, every rank of every part, publish."""
    manager.begin(step)
    entries = [
        manager.save_shard(step, part, rank, shard(step, part, rank))
        for part, ranks in parts.items()
        for rank in range(ranks)
    ]
    return manager.publish(step, parts, hf_files=hf_files), entries


def assert_shard_equal(a, b):
    assert a.keys() == b.keys() and a["rng"] == b["rng"]
    (part,) = [key for key in a if key != "rng"]
    assert torch.equal(a[part]["model"]["w"], b[part]["model"]["w"])
    assert a[part]["global_step"] == b[part]["global_step"]


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_save_in_parts_layout_manifest_and_round_trip(tmp_path, tiny_model_path, scheme):
    import hashlib

    import fsspec

    root = str(tmp_path / "ckpt") if scheme == "local" else f"memory://parts-{uuid.uuid4().hex}"
    fs, base = fsspec.core.url_to_fs(root)
    parts = {"actor": 2, "critic": 2, "trainer": 1}
    try:
        manager = CheckpointManager(root, parts={"actor": 2, "critic": 2})
        assert manager.begin(3) == f"{root}/.tmp_global_step_3"
        entries = [manager.save_shard(3, "actor", rank, shard(3, "actor", rank)) for rank in (1, 0)]
        entries += [manager.save_shard(3, p, r, shard(3, p, r)) for p, r in [("critic", 0), ("critic", 1)]]
        entries.append(manager.save_shard(3, "trainer", 0, shard(3, "trainer", 0)))
        path = manager.publish(3, parts, hf_files=tiny_model_path)
        assert path == f"{root}/global_step_3" and manager.latest() == path
        names = sorted(p.removeprefix(f"{base}/global_step_3/") for p in fs.find(f"{base}/global_step_3"))
        hf = sorted(n for n in names if n.startswith("hf/"))
        assert "hf/config.json" in hf and not any(n.endswith(".safetensors") for n in hf)
        shards = [
            "actor/rank_0.pt",
            "actor/rank_1.pt",
            "critic/rank_0.pt",
            "critic/rank_1.pt",
            "trainer/rank_0.pt",
        ]
        assert names == sorted([*shards, *hf, MANIFEST])  # the sidecars are gone
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)) == ["global_step_3", POINTER]
        manifest = json.loads(fs.cat_file(f"{base}/global_step_3/{MANIFEST}"))
        assert (manifest["format"], manifest["version"], manifest["step"]) == ("trellis-checkpoint", 2, 3)
        assert manifest["parts"] == parts and "world_size" not in manifest
        assert sorted(manifest["files"]) == sorted([*shards, *hf])
        for rel in shards:
            data = fs.cat_file(f"{base}/global_step_3/{rel}")
            assert manifest["files"][rel] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        # what save_shard returned is the manifest's entry, and no tensor
        assert sorted(entries, key=lambda e: e["file"]) == [
            {"file": rel, **manifest["files"][rel]} for rel in shards
        ]
        for part, ranks in parts.items():
            for rank in range(ranks):
                assert_shard_equal(load_rank_file(path, rank, part=part), shard(3, part, rank))
        verify_checkpoint(path, parts=parts, checksums=True)
        with pytest.raises(
            CheckpointError, match=r"saved in parts \['actor', 'critic', 'trainer'\]: name the part"
        ):
            manager.load(path)
        with pytest.raises(
            CheckpointError, match=r"has no part 'ref'; it holds \['actor', 'critic', 'trainer'\]"
        ):
            load_rank_file(path, 0, part="ref")
        with pytest.raises(
            CheckpointError, match=r"has no file for rank 2 of part 'actor': it was saved by 2 ranks"
        ):
            load_rank_file(path, 2, part="actor")
    finally:
        if scheme == "memory":
            fs.rm(base, recursive=True)


def test_parts_keep_last_k_and_resume_checks_the_ranks(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2, parts={"actor": 2})
    for step in (1, 2, 3):
        save_in_parts(manager, step, {"actor": 2, "trainer": 1})
    assert manager.steps() == [2, 3]
    latest = str(tmp_path / "global_step_3")
    assert manager.resolve_resume("auto") == latest
    assert manager.resolve_resume("resume_path", tmp_path) == latest
    three = CheckpointManager(tmp_path, parts={"actor": 3})
    with pytest.raises(CheckpointError, match=r"part 'actor' was saved by 2 ranks, but 3 are loading it"):
        three.latest()
    with pytest.raises(CheckpointError, match=r"part 'actor' was saved by 2 ranks, but 3 are loading it"):
        three.resolve_resume("resume_path", tmp_path / "global_step_2")
    with pytest.raises(CheckpointError, match=r"has no part 'critic' \(it holds \['actor', 'trainer'\]\)"):
        CheckpointManager(tmp_path, parts={"actor": 2, "critic": 2}).latest()


def test_a_missing_shard_names_the_part_and_rank_and_publishes_nothing_until_it_comes(tmp_path):
    manager = CheckpointManager(tmp_path)
    save_in_parts(manager, 1, {"actor": 2, "trainer": 1})
    manager.begin(2)
    manager.save_shard(2, "actor", 0, shard(2, "actor", 0))
    manager.save_shard(2, "trainer", 0, shard(2, "trainer", 0))
    with pytest.raises(
        CheckpointError,
        match=r"step_2': rank 1 of part 'actor' did not write its shard actor/rank_1\.pt; every rank",
    ):
        manager.publish(2, {"actor": 2, "trainer": 1})
    assert manager.latest() == str(tmp_path / "global_step_1") and manager.steps() == [1]
    # the late shard arrives: the same save publishes
    manager.save_shard(2, "actor", 1, shard(2, "actor", 1))
    assert (
        manager.publish(2, {"actor": 2, "trainer": 1}) == manager.latest() == str(tmp_path / "global_step_2")
    )
    assert_shard_equal(load_rank_file(manager.latest(), 1, part="actor"), shard(2, "actor", 1))
    # a shard the parts do not count is refused too
    manager.begin(3)
    for rank in range(3):
        manager.save_shard(3, "actor", rank, shard(3, "actor", rank))
    manager.save_shard(3, "critic", 0, shard(3, "critic", 0))
    with pytest.raises(
        CheckpointError, match=r"shards \['actor/rank_2\.pt', 'critic/rank_0\.pt'\] were written, but parts="
    ):
        manager.publish(3, {"actor": 2})
    assert manager.steps() == [1, 2]


def test_bad_parts_name_the_value(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.begin(1)
    for bad in ("hf", "", ".hidden", "a/b", "../up", 3):
        with pytest.raises(ValueError, match=rf"part name {bad!r} is not allowed"):
            manager.save_shard(1, bad, 0, {})
    with pytest.raises(ValueError, match=r"save_shard: rank=-1 must be an int >= 0"):
        manager.save_shard(1, "actor", -1, {})
    with pytest.raises(ValueError, match=r"part 'actor' has ranks=0; it must be an int >= 1"):
        manager.publish(1, {"actor": 0})
    with pytest.raises(ValueError, match=r"parts=\{\} must be a non-empty mapping"):
        CheckpointManager(tmp_path, parts={})
    with pytest.raises(ValueError, match=r"CheckpointManager.begin: step=-2 must be an int >= 0"):
        manager.begin(-2)
    with pytest.raises(CheckpointError, match=r"states\['actor'\]\['lr'\].*numpy.float64"):
        manager.save_shard(1, "actor", 0, {"actor": {"lr": np.float64(0.1)}})


class Killed(BaseException):
    """Stands for a SIGKILL: not an Exception, so nothing on the way catches it."""


MUTATIONS = ("makedirs", "write_stream", "replace_file", "rename", "remove")


def test_a_save_killed_at_any_storage_operation_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """Kill the save of step 2 at its n-th storage operation, for every n: the latest checkpoint is
    always step 1 or step 2, complete (checksums) and with the states saved at that step; the next
    save of step 2 succeeds and leaves nothing stale."""
    from trellis.checkpoint.training import Store

    parts = {"actor": 2, "trainer": 1}
    count = {"n": 0, "kill_at": None}

    def counted(name):
        original = getattr(Store, name)

        def operation(self, *args, **kwargs):
            count["n"] += 1
            if count["n"] == count["kill_at"]:
                raise Killed(f"{name}{args}")
            return original(self, *args, **kwargs)

        return operation

    for name in MUTATIONS:
        monkeypatch.setattr(Store, name, counted(name))
    clean = tmp_path / "clean"
    save_in_parts(CheckpointManager(clean, max_to_keep=1), 1, parts)
    count["n"] = 0
    save_in_parts(CheckpointManager(clean, max_to_keep=1), 2, parts)
    operations = count["n"]
    assert operations >= 10
    outcomes = set()
    for kill_at in range(1, operations + 1):
        root = tmp_path / f"kill{kill_at}"
        count.update(n=0, kill_at=None)
        save_in_parts(CheckpointManager(root, max_to_keep=1), 1, parts)
        count.update(n=0, kill_at=kill_at)
        with pytest.raises(Killed):
            save_in_parts(CheckpointManager(root, max_to_keep=1), 2, parts)
        count["kill_at"] = None
        manager = CheckpointManager(root, max_to_keep=1, parts={"actor": 2})
        latest = manager.latest()
        step = int(latest.rsplit("_", 1)[1])
        outcomes.add(step)
        verify_checkpoint(latest, parts=parts, checksums=True)
        for part, ranks in parts.items():
            for rank in range(ranks):
                assert_shard_equal(load_rank_file(latest, rank, part=part), shard(step, part, rank))
        save_in_parts(manager, 2, parts)
        assert sorted(p.name for p in root.iterdir()) == ["global_step_2", POINTER], kill_at
    assert outcomes == {1, 2}  # kills before the pointer moved keep step 1, later ones step 2


def test_a_checkpoint_without_parts_reads_as_every_part(tmp_path):
    """A checkpoint of save() (and of a Trellis before parts): each rank's file holds every state, and
    a part's shard of rank R is that file; its world size is every part's number of ranks."""
    barrier = threading.Barrier(2, timeout=30)

    def work(rank):
        manager = CheckpointManager(tmp_path, rank=rank, world_size=2, barrier=barrier.wait)
        manager.save(4, {**states(40 + rank), "critic": {"model": {}, "global_step": rank}})

    in_two_ranks(barrier, work)
    folder = tmp_path / "global_step_4"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (manifest["version"], manifest["world_size"]) == (1, 2) and "parts" not in manifest
    assert CheckpointManager(tmp_path, parts={"actor": 2, "critic": 2}).latest() == str(folder)
    for rank in (0, 1):
        for part in ("actor", "critic", "trainer", None):
            loaded = load_rank_file(folder, rank, part=part)
            assert loaded["critic"]["global_step"] == rank
            assert torch.equal(loaded["actor"]["model"]["w"], states(40 + rank)["actor"]["model"]["w"])
    with pytest.raises(CheckpointError, match=r"part 'actor' was saved by 2 ranks, but 1 are loading it"):
        CheckpointManager(tmp_path, parts={"actor": 1}).latest()


# ---------------------------------------------------------------- rng


def draws():
    return random.random(), float(np.random.rand()), np.random.normal(), torch.rand(3).tolist()


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = capture_rng_state()
    expected = draws()
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"rng": state})
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    restore_rng_state(manager.load(manager.latest())["rng"])
    assert draws() == expected
    assert state["device"] is None  # the cpu backend: its generator is torch's


def test_rng_restore_rejects_other_devices_and_leaves_state_alone():
    state = capture_rng_state()
    random.seed(5)
    before = random.getstate()
    with pytest.raises(ValueError, match="random state of 'cuda' devices, but this process runs on 'cpu'"):
        restore_rng_state(
            {**state, "device": {"type": "cuda", "states": [torch.zeros(16, dtype=torch.uint8)]}}
        )
    assert random.getstate() == before
    with pytest.raises(ValueError, match="capture_rng_state"):
        restore_rng_state({"python": state["python"]})


def test_rng_covers_the_device_backend_generators(monkeypatch):
    """On an accelerator the backend's generators (one per visible device) are saved and restored."""
    import trellis.device

    class FakeModule:
        def __init__(self):
            self.states = [torch.full((8,), 1, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)]

        def device_count(self):
            return 2

        def get_rng_state_all(self):
            return [state.clone() for state in self.states]

        def set_rng_state_all(self, states):
            self.states = [state.clone() for state in states]

    class FakeBackend:
        device_type, visible_devices_env = "fakedev", "FAKE_VISIBLE_DEVICES"
        torch_module = FakeModule()

    monkeypatch.setattr(trellis.device, "get_device_backend", lambda: FakeBackend)
    state = capture_rng_state()
    assert state["device"]["type"] == "fakedev"
    assert [s.tolist() for s in state["device"]["states"]] == [[1] * 8, [2] * 8]
    FakeBackend.torch_module.states = [torch.zeros(8, dtype=torch.uint8)] * 2
    restore_rng_state(state)
    assert [s.tolist() for s in FakeBackend.torch_module.states] == [[1] * 8, [2] * 8]
    four = {**state, "device": {"type": "fakedev", "states": state["device"]["states"] * 2}}
    with pytest.raises(ValueError, match="random states of 4 fakedev devices, but this process sees 2"):
        restore_rng_state(four)
