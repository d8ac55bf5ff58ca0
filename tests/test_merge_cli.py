"""The `merge-adapters` / `hf-fsdp-qlora merge` and `convert` commands: exit statuses, messages, no tracebacks.

Most cases run the console scripts' functions (`cli_main`, `merge_adapters_main`) in-process (fast); two
run the installed console script in a subprocess, as a user would, to check the real exit status and that stderr carries no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_merge import _fsdp_checkpoint, make_adapter, peft_merged, read_output
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.main import main as cli_main
from hf_fsdp_qlora.cli.main import merge_adapters_main

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = build_tiny_model(root / "base", "llama")
    adapter = make_adapter(
        base, root / "adapter", r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    return base, adapter


def test_help_is_instant_and_explains_options():
    code = (
        "import sys, contextlib, io\n"
        "from hf_fsdp_qlora.cli.main import merge_adapters_main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "    merge_adapters_main(['--help'])\n"
        "print(buf.getvalue()); print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False).stdout
    assert "NO_TORCH" in out
    for text in ("--max-shard-size", "5GB", "--dequantize", "--untie-embeddings", "example:", "merge-adapters --base"):
        assert text in out


def test_umbrella_merge_command(setup, tmp_path, capsys):
    base, adapter = setup
    rc = cli_main(
        ["merge", "--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "m"), "--no-progress"]
    )
    assert rc == 0 and "merged model written" in capsys.readouterr().out
    ours, ref = read_output(tmp_path / "m"), peft_merged(base, adapter)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--max-shard-size", "huge"], 2, "--max-shard-size"),
        (["--device", "tpu"], 2, "--device"),
        (["--output", "EXISTING"], 2, "--force"),
    ],
)
def test_cli_usage_errors(setup, tmp_path, capsys, extra, code, message):
    base, adapter = setup
    (tmp_path / "EXISTING").mkdir()
    argv = ["--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "out"), "--no-progress"]
    argv += [str(tmp_path / e) if e == "EXISTING" else e for e in extra]
    assert merge_adapters_main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("merge-adapters: error:") and message in err


def test_cli_interrupt_leaves_nothing(setup, tmp_path, monkeypatch, capsys):
    import hf_fsdp_qlora.safetensors_io as io

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(io.ShardWriter, "copy_bytes", interrupted)
    base, adapter = setup
    argv = ["--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "out"), "--no-progress"]
    assert merge_adapters_main(argv) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _console(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "merge-adapters"), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_console_script_corrupted_base_exits_1_without_traceback(setup, tmp_path):
    import shutil

    base, adapter = setup
    bad = Path(shutil.copytree(base, tmp_path / "bad"))
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:8] + b"{garbage" + data[16:])
    proc = _console("--base", str(bad), "--adapter", str(adapter), "--output", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "not a valid safetensors file" in proc.stderr
    assert "save or download it again" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_console_script_cuda_without_cuda_exits_2(setup, tmp_path):
    base, adapter = setup
    proc = _console(
        "--base", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "out"), "--device", "cuda"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no CUDA device" in proc.stderr and "--device cpu" in proc.stderr


# ---------------------------------------------------------------- convert


def test_convert_fsdp_checkpoint_to_peft_adapter(setup, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = setup
    ckpt = tmp_path / "checkpoint-7"
    _fsdp_checkpoint(base, adapter, ckpt, adapter_only=False)
    assert cli_main(["convert", str(ckpt), "--output", str(tmp_path / "converted")]) == 0
    assert "adapter with" in capsys.readouterr().out
    converted = tmp_path / "converted"
    assert json.loads((converted / "adapter_config.json").read_text())["r"] == 4
    # peft loads it, and merging it gives what merging the original adapter gives
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), converted)
    got, ref = model.merge_and_unload().state_dict(), peft_merged(base, adapter)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in got)

    assert cli_main(["convert", str(ckpt), "--output", str(converted)]) == 2  # exists, no --force
    assert cli_main(["convert", str(tmp_path), "--output", str(tmp_path / "x")]) == 2  # not a checkpoint
    (ckpt / "adapter_config.json").unlink()
    assert cli_main(["convert", str(ckpt), "--output", str(tmp_path / "y")]) == 1
    assert "--adapter-config" in capsys.readouterr().err
    argv = [str(ckpt), "--output", str(tmp_path / "y"), "--adapter-config", str(adapter / "adapter_config.json")]
    rc = cli_main(["convert", *argv])
    assert rc == 0


def test_convert_terminated_mid_write_leaves_nothing(setup, tmp_path):
    # The real `convert`, stopped by SIGTERM after its first output file: exit 143, one line, and neither the
    # output nor a partial folder beside it remains (AtomicOutputDir cleans up on the _Terminated exception).
    base, adapter = setup
    ckpt = tmp_path / "run" / "checkpoint-2"
    _fsdp_checkpoint(base, adapter, ckpt, adapter_only=False)
    out = tmp_path / "run" / "converted"
    code = (
        "import os, signal, sys\n"
        "import hf_fsdp_qlora.merge.adapter_io as io\n"
        "def write_then_die(adapter, folder):\n"
        "    (folder / 'adapter_config.json').write_text('{}')\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "io.write_adapter_files = write_then_die\n"
        "from hf_fsdp_qlora.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "convert", str(ckpt), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "hf-fsdp-qlora convert: terminated; no output was written"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-2"]
