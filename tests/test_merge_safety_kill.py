"""Issue 13 item 3: kill -9 at several points of a merge of a ~300 MB model.

After every kill the output folder holds the old merge or the new one, complete (content digest of every
file), and a plain re-run finishes cleanly and leaves no leftovers. The kill points are chosen
deterministically: the command runs in a child process whose functions at that point are wrapped (from
the test's side, nothing in the library) to SIGKILL the process itself.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import FORK_LAUNCH, _run

from hf_fsdp_qlora.merge.pipeline import merge_adapters

HIDDEN, INTER, LAYERS, VOCAB = 1024, 2816, 9, 16384  # ~147M bf16 parameters: about 295 MB
R = 8


def _build_base(path: Path) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (INTER, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    # Three shards of about 100 MB, with an index, as save_pretrained writes them.
    shards, current, size, weight_map = [], {}, 0, {}
    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if current and size + tensor.nbytes > 100_000_000:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + tensor.nbytes
    shards.append(current)
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.nbytes for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "dtype": "bfloat16", "rms_norm_eps": 1e-5,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


def _build_adapter(path: Path, seed: int) -> None:
    """A peft-format LoRA adapter on q_proj and v_proj of every layer."""
    from safetensors.torch import save_file

    path.mkdir()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for name in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(R, HIDDEN, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, R, generator=gen) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": R, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The base, two adapters, and the digests of the old merge (adapter 1) and the new one (adapter 2)."""
    root = tmp_path_factory.mktemp("kill")
    _build_base(root / "base")
    _build_adapter(root / "ad1", seed=1)
    _build_adapter(root / "ad2", seed=2)
    old = merge_adapters(root / "base", root / "ad1", root / "old-ref", max_shard_size="100MB", progress=False)
    new = merge_adapters(root / "base", root / "ad2", root / "new-ref", max_shard_size="100MB", progress=False)
    assert sum(p.stat().st_size for p in new.iterdir()) > 250e6
    return root, digest(old), digest(new)


_DRIVER = r"""
import os, signal, sys
import hf_fsdp_qlora.merge.output_dir as od
import hf_fsdp_qlora.safetensors_io as io
from hf_fsdp_qlora.cli.main import merge_adapters_main

point = sys.argv[1]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

def after(n, fn):
    calls = []
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            die()
        return result
    return wrapped

if point == "writing":  # inside the first shard, after a few computed tensors
    io.ShardWriter.write_tensor = after(5, io.ShardWriter.write_tensor)
elif point == "between_shards":  # the first shard closed and fsynced, the second one begun
    io.ShardWriter.close = after(1, io.ShardWriter.close)
elif point == "before_swap":  # every file written and marked, nothing swapped yet
    od._exchange = lambda a, b: die()
elif point == "after_swap":  # the new folder in place, the old one not yet deleted
    od._exchange = after(1, od._exchange)
elif point == "between_renames":  # a filesystem without RENAME_EXCHANGE: output moved aside, new not in place
    od._exchange = lambda a, b: False
    real_rename = os.rename
    def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in os.fspath(dst):
            die()
    os.rename = rename
sys.exit(merge_adapters_main(sys.argv[2:]))
"""


@pytest.mark.parametrize("point", ["writing", "between_shards", "before_swap", "after_swap", "between_renames"])
def test_kill_leaves_old_or_new_complete_and_rerun_is_clean(big, point, tmp_path):
    root, old, new = big
    out = tmp_path / "merged"
    shutil.copytree(root / "old-ref", out)  # the earlier merge that --force replaces
    argv = ["--base", str(root / "base"), "--adapter", str(root / "ad2"), "--output", str(out)]
    argv += ["--max-shard-size", "100MB", "--force", "--no-progress"]
    # The driver runs as the one rank of a tests/fork_launch.py launch, forked from the fork server (torch already
    # imported: ~2 CPU-s of imports spared per kill); its SIGKILL is real, and the launcher reports it as 128 + 9.
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    proc = _run([sys.executable, str(FORK_LAUNCH), "--nproc", "1", "--master-port", "1", str(driver), point, *argv],
                300, None)  # fmt: skip
    assert proc.returncode == 137 and "rank 0 exited with status 137" in proc.stderr, proc.stderr[-2000:]
    driver.unlink()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "merged")
    assert leftovers, "the kill left nothing behind, so it did not happen mid-run"
    if point == "between_renames":
        # Without an atomic exchange the old output lies aside, complete, until the next run puts it back.
        assert not out.exists()
        (aside,) = [tmp_path / name for name in leftovers if ".old-" in name]
        assert digest(aside) == old
        from hf_fsdp_qlora.merge.output_dir import AtomicOutputDir

        AtomicOutputDir(out, "merge-adapters")  # what every run does first
        assert digest(out) == old
    elif point == "after_swap":
        # The swapped-in folder may still hold the writer's lock file (a kill in the instant before it is
        # removed); --force and loaders ignore it, and the next run removes it.
        got = digest(out)
        got.pop(".hf-fsdp-qlora-writing.lock", None)
        assert got == new
    else:
        assert digest(out) == old
    # a plain re-run finishes the job and leaves nothing else behind
    merge_adapters(root / "base", root / "ad2", out, max_shard_size="100MB", force=True, progress=False)
    assert digest(out) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
