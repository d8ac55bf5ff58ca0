"""Everything we write gets the permissions the user's umask gives (issue 39): safetensors 0.8's ``save_file``
creates its files 0600 whatever the umask, so on a shared cluster the group could not read an adapter, a checkpoint's
adapter or a merged model beside 0644 files. Checked under umask 022 and 002, against what ``open()`` gives."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from tiny_models import build_tiny_model


@pytest.fixture(params=[0o022, 0o002], ids=["umask022", "umask002"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _expected(tmp_path) -> int:
    """The oracle: what a plain open() gives a new file under the current umask."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    return _mode(probe)


def test_adapter_and_full_model_files_follow_the_umask(umask, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.train.checkpoint import save_adapter, save_full_model

    expected = _expected(tmp_path)
    assert expected == 0o666 & ~umask
    path = build_tiny_model(tmp_path / "llama", "llama")
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    save_adapter(model, tmp_path / "adapter", is_main_process=True)
    written = sorted((tmp_path / "adapter").iterdir())
    assert any(p.name == "adapter_model.safetensors" for p in written), written
    assert {p.name: _mode(p) for p in written} == {p.name: expected for p in written}
    full = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    save_full_model(full, tmp_path / "full", is_main_process=True)
    shards = sorted((tmp_path / "full").glob("*.safetensors"))
    assert shards and {p.name: _mode(p) for p in shards} == {p.name: expected for p in shards}


def test_merge_output_folder_and_shard_writer_follow_the_umask(umask, tmp_path):
    from safetensors.torch import save_file

    from hf_fsdp_qlora.merge.output_dir import AtomicOutputDir
    from hf_fsdp_qlora.safetensors_io import ShardWriter

    expected = _expected(tmp_path)
    with AtomicOutputDir(tmp_path / "merged", "test") as folder:  # committed on leaving
        save_file({"a": torch.ones(2)}, str(folder / "adapter_model.safetensors"))  # 0600 as written
        writer = ShardWriter(folder / "model.safetensors", [("b", "F32", (2,))], {"format": "pt"})
        writer.write_tensor("b", torch.ones(2))
        writer.close()
    files = sorted(p for p in (tmp_path / "merged").iterdir() if p.is_file())
    assert len(files) >= 2 and {p.name: _mode(p) for p in files} == {p.name: expected for p in files}
