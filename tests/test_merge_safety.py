"""Issue 13: `merge-adapters` and `convert` never destroy user data, and every bad input is a clear error.

Each destructive attempt runs the real command (its console script's function, in-process) in a folder
holding a base, an adapter, an FSDP checkpoint and unrelated files, and the content digest of that whole
folder must be the same afterwards: exit 2, one line on stderr, nothing touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_merge import _fsdp_checkpoint, make_adapter, peft_merged, read_output
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.main import main as cli_main
from hf_fsdp_qlora.cli.main import merge_adapters_main
from hf_fsdp_qlora.merge import merge_adapters


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256 of the content, or the target of a symlink}, for everything under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """real/{base, ad, checkpoint-3, notes.txt, data/}, alias -> real, and a marked earlier output."""
    root = tmp_path_factory.mktemp("safety")
    real = root / "real"
    base = build_tiny_model(real / "base", "llama")
    adapter = make_adapter(base, real / "ad", r=4, target_modules=["q_proj", "v_proj"])
    _fsdp_checkpoint(base, adapter, real / "checkpoint-3", adapter_only=False)
    (real / "checkpoint-3" / "optimizer.pt").write_bytes(b"optimizer state")
    (real / "notes.txt").write_text("unrelated")
    (real / "data").mkdir()
    (real / "data" / "train.jsonl").write_text('{"text": "t3 t4"}\n')
    (root / "alias").symlink_to(real)
    for folder, name in (("work", "train.py"), ("home", ".bashrc")):  # the user's current and home folders
        (root / folder).mkdir()
        (root / folder / name).write_text("# user file")
    return root


def _merge(world: Path, *args: str) -> list[str]:
    real = world / "real"
    return ["--base", str(real / "base"), "--adapter", str(real / "ad"), "--no-progress", *args]


def _refused(capsys, world: Path, rc: int, *messages: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for message in messages:
        assert message in lines[0], lines[0]
    return lines[0]


DESTRUCTIVE = {
    # name: (argv builder given the world root, expected message parts)
    "output_dotdot_base": (
        lambda w: _merge(w, "--output", str(w / "real" / "data" / ".." / "base"), "--force"),
        ["is --base"],
    ),
    "alias_contains_base_and_adapter": (
        lambda w: [
            "--base",
            str(w / "alias" / "base"),
            "--adapter",
            str(w / "alias" / "ad"),
            "--output",
            str(w / "real"),
            "--force",
            "--no-progress",
        ],
        ["contains --base"],
    ),
    "alias_is_adapter": (lambda w: _merge(w, "--output", str(w / "alias" / "ad"), "--force"), ["is --adapter"]),
    "inside_adapter": (lambda w: _merge(w, "--output", str(w / "real" / "ad" / "merged")), ["lies inside --adapter"]),
    "adapter_file_folder": (
        lambda w: [
            "--base",
            str(w / "real" / "base"),
            "--adapter",
            str(w / "real" / "ad" / "adapter_model.safetensors"),
            "--output",
            str(w / "alias" / "ad"),
            "--force",
            "--no-progress",
        ],
        ["contains --adapter"],
    ),
    "empty_output": (lambda w: _merge(w, "--output", "", "--force"), ["--output is empty"]),
    "dot_output": (lambda w: _merge(w, "--output", ".", "--force"), ["is the current folder"]),
    "parent_of_cwd": (lambda w: _merge(w, "--output", "..", "--force"), ["contains the current folder"]),
    "home": (lambda w: _merge(w, "--output", "~", "--force"), ["is your home folder"]),
    "root": (lambda w: _merge(w, "--output", "/", "--force"), ["is a filesystem root"]),
    "unmarked_folder": (
        lambda w: _merge(w, "--output", str(w / "real" / "data"), "--force"),
        ["was not written by merge-adapters", "train.jsonl"],
    ),
    "a_file": (lambda w: _merge(w, "--output", str(w / "real" / "notes.txt"), "--force"), ["is a file"]),
    "exists_without_force": (lambda w: _merge(w, "--output", str(w / "real" / "data")), ["already exists"]),
}


@pytest.mark.parametrize("case", sorted(DESTRUCTIVE))
def test_merge_refuses_and_touches_nothing(world, case, capsys, monkeypatch):
    # cwd and HOME are inside the world, so "" / "." / ".." / "~" would reach its files if they were accepted.
    monkeypatch.chdir(world / "work")
    monkeypatch.setenv("HOME", str(world / "home"))
    build, messages = DESTRUCTIVE[case]
    before = tree_digest(world)
    rc = merge_adapters_main(build(world))
    print(case, _refused(capsys, world, rc, *messages))
    assert tree_digest(world) == before


@pytest.mark.parametrize(
    "output, message",
    [
        ("{ckpt}", "is CHECKPOINT"),
        ("{ckpt}/pytorch_model_fsdp_0", "lies inside CHECKPOINT"),
        ("{real}", "contains CHECKPOINT"),
        ("{alias}/checkpoint-3/../checkpoint-3", "is CHECKPOINT"),
        ("{real}/data", "was not written by"),
    ],
)
def test_convert_refuses_and_touches_nothing(world, output, message, capsys):
    real = world / "real"
    out = output.format(ckpt=real / "checkpoint-3", real=real, alias=world / "alias")
    before = tree_digest(world)
    rc = cli_main(["convert", str(real / "checkpoint-3"), "--output", out, "--force"])
    print(output, _refused(capsys, world, rc, message))
    assert tree_digest(world) == before


def test_force_replaces_only_an_earlier_output_that_holds_nothing_else(world, tmp_path, capsys):
    real = world / "real"
    out = tmp_path / "merged"
    assert merge_adapters_main(_merge(world, "--output", str(out))) == 0
    marker = json.loads((out / ".hf-fsdp-qlora-output.json").read_text())
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {".hf-fsdp-qlora-output.json"}
    assert merge_adapters_main(_merge(world, "--output", str(out), "--force")) == 0  # our own output: replaced
    (out / "my-eval-results.txt").write_text("keep me")
    before = tree_digest(tmp_path)
    rc = merge_adapters_main(_merge(world, "--output", str(out), "--force"))
    _refused(capsys, world, rc, "also holds my-eval-results.txt")
    assert tree_digest(tmp_path) == before
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose
    assert merge_adapters_main(_merge(world, "--output", str(tmp_path / "empty"), "--force")) == 0
    ours, ref = read_output(tmp_path / "empty"), peft_merged(real / "base", real / "ad")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    # convert's output is marked too, and --force replaces it
    conv = tmp_path / "converted"
    assert cli_main(["convert", str(real / "checkpoint-3"), "--output", str(conv)]) == 0
    assert cli_main(["convert", str(real / "checkpoint-3"), "--output", str(conv), "--force"]) == 0
    assert (conv / ".hf-fsdp-qlora-output.json").is_file()


def test_leftovers_cleaned_before_the_free_space_check(world, tmp_path, monkeypatch):
    """A killed run's leftover is removed before free space is measured, so it cannot block the re-run."""
    import hf_fsdp_qlora.merge.pipeline as merge_mod

    stale = tmp_path / ".out.partial-otherhost-99-dead"
    stale.mkdir()
    (stale / ".hf-fsdp-qlora-writing.lock").write_text("otherhost pid 99\n")
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    seen = []
    real_usage = shutil.disk_usage

    def usage(path):
        seen.append(stale.exists())
        return real_usage(path)

    monkeypatch.setattr(merge_mod.shutil, "disk_usage", usage)
    merge_adapters(world / "real" / "base", world / "real" / "ad", tmp_path / "out", progress=False)
    assert seen == [False] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_live_run_elsewhere_is_never_deleted(world, tmp_path):
    """Another run (any host) holds the lock on its folder: a second run refuses instead of deleting it."""
    live = tmp_path / ".out.partial-otherhost-1-live"
    live.mkdir()
    fd = os.open(live / ".hf-fsdp-qlora-writing.lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"otherhost pid 1\n")
    # Another process holds the lock, as a run on another host would.
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl,os,sys,time; fd=os.open(sys.argv[1], os.O_RDWR); "
                "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
            ),
            str(live / ".hf-fsdp-qlora-writing.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_digest(tmp_path)
        from hf_fsdp_qlora.errors import MergeError

        with pytest.raises(MergeError, match=r"another run is writing .* \(otherhost pid 1\)"):
            merge_adapters(world / "real" / "base", world / "real" / "ad", tmp_path / "out", progress=False)
        assert tree_digest(tmp_path) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)
        os.close(fd)
    # its holder gone, the same folder is a leftover and the next run removes it
    merge_adapters(world / "real" / "base", world / "real" / "ad", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------- item 4/5: bad inputs name the real cause


def _copy_base(world: Path, dest: Path) -> Path:
    return Path(shutil.copytree(world / "real" / "base", dest))


def _index(base: Path, weight_map) -> Path:
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return base


def _keys(base: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(base / "model.safetensors"), "pt") as fh:
        return list(fh.keys())


def _truncated_bin_adapter(world, tmp):
    from safetensors.torch import load_file

    ad = Path(shutil.copytree(world / "real" / "ad", tmp / "ad_bin"))
    torch.save(load_file(str(ad / "adapter_model.safetensors")), ad / "adapter_model.bin")
    (ad / "adapter_model.safetensors").unlink()
    data = (ad / "adapter_model.bin").read_bytes()
    (ad / "adapter_model.bin").write_bytes(data[: len(data) - 5000])
    return ["--adapter", str(ad)]


def _four_bit_base(world, tmp):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(world / "real" / "base", quantization_config=q, dtype=torch.bfloat16)
    model.save_pretrained(tmp / "base4")
    config = json.loads((tmp / "base4" / "config.json").read_text())
    del config["quantization_config"]  # e.g. edited by hand, or lost when copying the config from the 16-bit base
    (tmp / "base4" / "config.json").write_text(json.dumps(config))
    return ["--base", str(tmp / "base4")]


def _adapter_config_list(world, tmp):
    ad = Path(shutil.copytree(world / "real" / "ad", tmp / "ad_list"))
    (ad / "adapter_config.json").write_text("[1, 2]")
    return ["--adapter", str(ad)]


def _empty_fsdp_checkpoint(world, tmp):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ckpt = tmp / "checkpoint-9"
    state = load_file(str(world / "real" / "base" / "model.safetensors"))  # a full fine-tune: no LoRA at all
    dcp.save({"model": state}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    shutil.copy(world / "real" / "ad" / "adapter_config.json", ckpt)
    return ckpt


def _mistral_adapter(world, tmp):
    from test_merge import _build
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    mistral = _build(tmp / "mistral", cfg)
    make_adapter(mistral, tmp / "ad_mistral", r=4, target_modules=["q_proj", "v_proj"])
    return ["--adapter", str(tmp / "ad_mistral")]


BAD_INPUTS = {
    # name: (argv parts built from (world, tmp), exit code, message parts)
    "truncated_bin_adapter": (_truncated_bin_adapter, 1, ["adapter_model.bin", "truncated or corrupted"]),
    "index_lists_missing_tensor": (
        lambda w, t: ["--base", str(_index(_copy_base(w, t / "b"), {**dict.fromkeys(_keys(t / "b"), "model.safetensors"),
                                                                    "ghost.weight": "model.safetensors"}))],
        1, ["lists tensors its shards do not hold (e.g. ['ghost.weight'])"],
    ),
    "index_lacks_an_entry": (
        lambda w, t: ["--base", str(_index(_copy_base(w, t / "b"), dict.fromkeys(_keys(t / "b")[1:], "model.safetensors")))],
        1, ["hold tensors", "does not list (e.g. ["],
    ),
    "empty_weight_map": (
        lambda w, t: ["--base", str(_index(_copy_base(w, t / "b"), {}))], 1, ["lists no tensors (empty weight_map)"]
    ),
    "weight_map_not_object": (
        lambda w, t: ["--base", str(_index(_copy_base(w, t / "b"), ["model.safetensors"]))], 2,
        ["weight_map is not an object"],
    ),
    "four_bit_base_without_quantization_config": (
        _four_bit_base, 1, ["holds bitsandbytes-quantized weights", "not a 16-bit base"]
    ),
    "adapter_config_not_object": (_adapter_config_list, 2, ["holds a JSON list, not an object"]),
    "mistral_adapter_on_llama_base": (_mistral_adapter, 1, ["a mistral model", "is a llama model", "--allow-other-base"]),
    **{
        f"quant_blocksize_{n}": (
            lambda w, t, n=n: ["--dequantize", "nf4", "--quant-blocksize", str(n)], 2, [f"--quant-blocksize {n} is not"]
        )
        for n in (0, 7, -1, 100000)
    },
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_line(world, case, tmp_path, capsys):
    build, code, messages = BAD_INPUTS[case]
    real = world / "real"
    extra = build(world, tmp_path)
    argv = ["--base", str(real / "base"), "--adapter", str(real / "ad"), "--output", str(tmp_path / "out")]
    argv += ["--no-progress", *extra]  # later options win
    before = tree_digest(world)
    capsys.readouterr()
    rc = merge_adapters_main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    print(case, rc, lines[-1] if lines else "")
    assert rc == code and len(lines) == 1 and "Traceback" not in err, err
    for message in messages:
        assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and tree_digest(world) == before
    if case == "mistral_adapter_on_llama_base":  # the user says so: merged
        assert merge_adapters_main([*argv, "--allow-other-base"]) == 0


def test_distcp_without_config_advice_works_for_merge_and_convert(world, tmp_path, capsys):
    real = world / "real"
    ckpt = Path(shutil.copytree(real / "checkpoint-3", tmp_path / "checkpoint-3"))
    (ckpt / "adapter_config.json").unlink()
    argv = ["--base", str(real / "base"), "--adapter", str(ckpt), "--output", str(tmp_path / "out"), "--no-progress"]
    assert merge_adapters_main(argv) == 1
    err = capsys.readouterr().err
    print(err.strip())
    assert "--adapter-config" in err and "merge-adapters and hf-fsdp-qlora convert both take it" in err
    # the option the advice names exists, for both commands
    assert merge_adapters_main([*argv, "--adapter-config", str(real / "ad" / "adapter_config.json")]) == 0
    conv = [
        str(ckpt),
        "--output",
        str(tmp_path / "conv"),
        "--adapter-config",
        str(real / "ad" / "adapter_config.json"),
    ]
    assert cli_main(["convert", *conv]) == 0


def test_convert_of_a_checkpoint_without_adapter_does_not_say_run_convert(world, tmp_path, capsys):
    ckpt = _empty_fsdp_checkpoint(world, tmp_path)
    assert cli_main(["convert", str(ckpt), "--output", str(tmp_path / "conv")]) == 1
    err = capsys.readouterr().err.strip()
    print(err)
    assert "holds no adapter tensors" in err and "hf-fsdp-qlora convert CHECKPOINT" not in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "conv").exists()


def test_two_runs_in_one_process_never_delete_each_other(tmp_path):
    """The lock is per open file: a second run for the same output, even in this process, sees the first."""
    from hf_fsdp_qlora.merge.output_dir import AtomicOutputDir
    from hf_fsdp_qlora.errors import MergeError

    with AtomicOutputDir(tmp_path / "out", "merge-adapters") as tmp:
        (tmp / "model.safetensors").write_text("first run's work")
        with pytest.raises(MergeError, match="another run is writing"):
            AtomicOutputDir(tmp_path / "out", "merge-adapters")
        assert (tmp / "model.safetensors").read_text() == "first run's work"
    assert (tmp_path / "out" / "model.safetensors").read_text() == "first run's work"
    assert json.loads((tmp_path / "out" / ".hf-fsdp-qlora-output.json").read_text())["files"] == ["model.safetensors"]
