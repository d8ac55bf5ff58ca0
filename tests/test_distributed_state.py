"""The one reader of launch state (hf_fsdp_qlora.distributed), from the environment a launcher exports."""

import pytest

from hf_fsdp_qlora import distributed as d

LAUNCH_VARS = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_PARALLELISM_CONFIG", "LOCAL_RANK", "WORLD_SIZE",
               "RANK")  # fmt: skip


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("TRUE", True), ("false", False), ("", False)])
def test_fsdp_requested_accepts_both_spellings(env, value, expected):
    env.setenv("ACCELERATE_USE_FSDP", value)
    assert d.fsdp_requested_by_launch() is expected


def test_fsdp_version_and_parallelism(env):
    assert d.launch_fsdp_version() is None and not d.parallelism_config_requested()
    env.setenv("FSDP_VERSION", "2")
    env.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    assert d.launch_fsdp_version() == 2 and d.parallelism_config_requested()


def test_launcher_vs_multi_process(env):
    assert not d.started_by_launcher() and not d.multi_process_launch()
    env.setenv("LOCAL_RANK", "0")
    env.setenv("WORLD_SIZE", "1")
    assert d.started_by_launcher() and not d.multi_process_launch()  # one rank of torchrun: launched, not multi
    env.setenv("WORLD_SIZE", "2")
    assert d.multi_process_launch()


def test_rank_from_launcher_before_the_process_group(env):
    assert d.is_main_process() and d.rank() == 0
    env.setenv("RANK", "1")
    assert d.rank() == 1 and not d.is_main_process()
    assert not d.is_distributed()
