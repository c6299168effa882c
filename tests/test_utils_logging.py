"""trellis.utils.logging: the rank of this process, rank-0 printing, rank-prefixed logging."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from trellis.utils.logging import get_rank, log_with_rank, print_rank_0


@pytest.mark.parametrize(
    ("rank_env", "rank", "printed"), [(None, 0, "hello\n"), ("0", 0, "hello\n"), ("3", 3, "")]
)
def test_rank_from_environment(monkeypatch, capsys, rank_env, rank, printed):
    if rank_env is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank_env)
    assert get_rank() == rank
    print_rank_0("hello")
    assert capsys.readouterr().out == printed


def test_bad_rank_variable(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match=r"Environment variable RANK='zero' is not an integer"):
        get_rank()


def test_process_group_rank_wins_over_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "5")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert get_rank() == 0
        print_rank_0({"step": 1})
    finally:
        dist.destroy_process_group()
    assert capsys.readouterr().out == "{'step': 1}\n"
    assert get_rank() == 5  # the group is gone: the environment again


def test_log_with_rank(caplog):
    logger = logging.getLogger("trellis.test_utils_logging")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        log_with_rank("loaded 3 shards", 2, logger)
        log_with_rank("only rank 0 says this", 2, logger, log_only_rank_0=True)
        log_with_rank("rank 0 does", 0, logger, level=logging.WARNING, log_only_rank_0=True)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "[Rank 2] loaded 3 shards"),
        (logging.WARNING, "[Rank 0] rank 0 does"),
    ]
