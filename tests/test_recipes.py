"""Real recipes, with their own defaults, under the shipped CPU rehearsal configs (FSDP1 and FSDP2, 2 gloo ranks).

The matrix: {our trainer, our SFT trainer, stock Trainer + FSDPQLoRACallback, trl's DPOTrainer + FSDPQLoRACallback}
x {FSDP1, FSDP2}, each with its config class's default arguments (trl: gradient checkpointing on, bf16=True; the
QLoRA recipe's uint8 4-bit storage), evaluation on, a checkpoint every 2 steps, and a resume; plus trl's own
`sft.py` and `dpo.py`, run unchanged from the installed trl package through `-m hf_fsdp_qlora.run`.

Each cell asserts: FSDP engaged; activation checkpointing applied exactly once (counted recomputations); the
saved adapter (final and checkpoint) equal bit for bit to the trained weights gathered independently (FSDP2
`full_tensor`, FSDP1 `summon_full_params`); checkpoints holding adapter + optimizer state; resume == uninterrupted.

Launches (each costs ~15 CPU s of launcher and imports before any work, ~6 forked from the tests' fork server): one
per FSDP version for the matrix (forked ranks), which then runs trl's dpo.py through the function behind
`-m hf_fsdp_qlora.run`; trl's sft.py under FSDP1 as users launch it (`accelerate launch ... -m hf_fsdp_qlora.run
sft.py`, the real launcher), under FSDP2 and the two resumes through the same `-m hf_fsdp_qlora.run` with forked
ranks (tests/fork_launch.py: accelerate's launch environment, the stack imported once). The real FSDP2 launches of
`-m hf_fsdp_qlora.run`: README's route 3 (trl's sft.py, tests/test_readme.py) and test_run_exits_zero_every_time's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import BIN, CONFIGS, SCRIPTS, _run, accelerate_launch, check, free_port, launch_via_run, read_results
from recipe_fixtures import TRL_MARKER, build_chat_dataset, build_preference_dataset, build_recipe_model

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.distributed

ROUTES = ("ours", "ours_sft", "callback", "dpo")
LN2_FP32 = float(torch.tensor(math.log(2), dtype=torch.float32))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_models")
    build_recipe_model(root / "recipe")
    return root


# trl's own scripts, unchanged: dpo.py runs at the end of the matrix launches, through the function behind
# `-m hf_fsdp_qlora.run` (one launch each fewer); sft.py as users launch it, under each FSDP version.
IN_MATRIX = {1: "dpo", 2: "dpo"}


@pytest.fixture(scope="module")
def trl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_data")
    return {"sft": build_chat_dataset(root / "chat"), "dpo": build_preference_dataset(root / "pref")}


def _split_at_marker(proc):
    """(the routes' output, the trl script's output) of a matrix launch, cut at the worker's TRL_MARKER line."""
    parts = [stream.split(TRL_MARKER) for stream in (proc.stdout, proc.stderr)]
    assert all(len(p) == 2 for p in parts), f"TRL_MARKER printed {[len(p) - 1 for p in parts]} times, not once"
    return parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]


@pytest.fixture(scope="module")
def matrices(models, trl_data, tmp_path_factory):
    """{version: (routes' out dir, trl script's output_dir, the launch)}; checked by the fixtures that read it, so
    a failure of the trl script fails its tests and leaves the routes' (results written before it) standing.
    Forked ranks (tests/fork_launch.py, accelerate's launch environment for the config): the real `accelerate
    launch` of each FSDP version is trl's sft.py's, in :func:`script_runs`."""
    done = {}
    for version, script in IN_MATRIX.items():
        root = tmp_path_factory.mktemp(f"recipes_fsdp{version}")
        out, trl_out = root / "run", root / f"{script}_fsdp{version}"
        done[version] = out, trl_out, accelerate_launch(
            f"cpu_fsdp{version}_rehearsal.yaml", "recipe_scenarios.py",
            "--models", str(models), "--out", str(out), "--fsdp-version", str(version),
            "--trl", script, *_script_args(models / "recipe", trl_data[script], trl_out), timeout=600,
        )  # fmt: skip
    return done


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def matrix(request, matrices):
    version = request.param
    out, _, proc = matrices[version]
    found = read_results(out)
    if sorted(found) != [0, 1]:  # the routes did not finish on both ranks
        check(proc)
        raise AssertionError(f"no results from both ranks: {sorted(found)}\n{proc.stderr[-6000:]}")
    return version, out, found[0], _split_at_marker(proc)[0]


def _expected_forwards(version, route):
    # Forward calls of each layer per step: 2 = forward + one recomputation (checkpointing applied once), 1 = off.
    # The FSDP2 configs ask for FSDP's own checkpointing; under FSDP1 (off in the config) the model's
    # (load_qlora_model) or trl's default gradient_checkpointing=True applies; a stock Trainer's default is off.
    return 1 if (version, route) == (1, "callback") else 2


@pytest.mark.parametrize("route", ROUTES)
def test_route_trains_saves_and_resumes(matrix, route):
    version, out, found, _ = matrix
    r = found[route]
    engaged = r["engaged"]
    assert (
        (engaged["flat_params"] > 0) if version == 1 else (engaged["fsdp2_modules"] > 0 and engaged["dtensor_params"])
    )
    if route == "ours":  # bf16=True, LoRA dropout 0.1, checkpointing: float32 master weights under FSDP1 and FSDP2
        assert r["trainable_dtypes"] == ["torch.float32"]
    assert r["adopted"] == "FSDPSaveMixin"  # the callback route got the same implementation as our trainers
    assert r["forwards_per_step"] == [_expected_forwards(version, route)] * 4
    if version == 2:  # FSDP's own checkpointing kept; the Trainer's and the model's turned off
        assert not r["model_checkpointing"] and not r["args_checkpointing"]
    assert sorted(r["losses"]) == ["1", "2", "3", "4"] and sorted(r["eval_losses"]) == ["2", "4"]
    for saved in ("final", "checkpoint"):
        s = r[saved]
        assert s["saved_keys"] == s["gathered_keys"] > 0 and not s["missing_from_saved"] and not s["unequal"], s
        assert s["lora_b_nonzero"] == s["saved_keys"] // 2  # every LoRA B moved away from its zero init
    assert {"adapter_model.safetensors", "optimizer_gathered.pt", "scheduler.pt"} <= set(r["checkpoint_files"])
    assert ".incomplete-checkpoints" not in r["output_entries"]
    assert r["resume_equal"], "resumed run's adapter differs from the uninterrupted run's"
    assert {k: v for k, v in r["resumed_losses"].items() if int(k) > 2} == {
        k: v for k, v in r["losses"].items() if int(k) > 2
    }


def test_dpo_first_loss_is_ln2(matrix):
    """Reference log-probs = the policy's with the adapter disabled: the first DPO loss is -log(sigmoid(0))."""
    _, _, found, _ = matrix
    assert found["dpo"]["losses"]["1"] == LN2_FP32


def test_engaged_and_checkpointing_lines_printed(matrix):
    version, _, _, text = matrix
    assert f"hf_fsdp_qlora: FSDP{version} engaged on 2 rank(s)" in text
    assert "hf_fsdp_qlora: activation checkpointing:" in text
    # INFO lines come from the main process only: once per trainer built (4 routes x 2 runs).
    assert text.count(f"FSDP{version} engaged on 2 rank(s)") == 8


# trl's own scripts, unchanged, from the installed package.
def _trl_script(name):
    import importlib

    return str(Path(importlib.import_module(f"trl.scripts.{name}").__file__))


def _launch_script(config, script, *args, timeout=420, fork=False):
    """`accelerate launch --config_file CONFIG -m hf_fsdp_qlora.run trl/scripts/SCRIPT.py ARGS`, as users launch it;
    `fork`: the same module and arguments run by ranks forked with that launch's environment (tests/fork_launch.py)."""
    return launch_via_run(config, _trl_script(script), *args, timeout=timeout, fork=fork)


def _script_args(model, data, out, *extra):
    return [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
        "--use_peft", "--load_in_4bit", "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--eval_strategy", "steps", "--eval_steps", "2", "--save_steps", "2",
        "--logging_steps", "1", "--report_to", "none", "--learning_rate", "1e-3", *extra,
    ]  # fmt: skip


def _adapter(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "adapter_model.safetensors"))


def _log(folder):
    return json.loads((Path(folder) / "trainer_state.json").read_text())["log_history"]


@pytest.fixture(scope="module")
def script_runs(models, trl_data, matrices, tmp_path_factory):
    """{(script, version): (output_dir, what the launch printed)}, resumes under (script, version, "resumed")."""
    root = tmp_path_factory.mktemp("trl_scripts")
    runs = {}
    for version, script in IN_MATRIX.items():
        _, out, proc = matrices[version]
        check(proc)
        runs[(script, version)] = (out, _split_at_marker(proc)[1])
    # sft.py under FSDP1 as users launch it (the real launcher); under FSDP2 with forked ranks: README's CPU form of
    # route 3 (tests/test_readme.py) is the real `accelerate launch ... -m hf_fsdp_qlora.run sft.py` under FSDP2.
    for script, version in (("sft", 1), ("sft", 2)):
        out = root / f"{script}_fsdp{version}"
        args = _script_args(models / "recipe", trl_data[script], out)
        proc = _launch_script(f"cpu_fsdp{version}_rehearsal.yaml", script, *args, fork=version == 2)
        check(proc)
        runs[(script, version)] = (out, proc.stdout + proc.stderr)
    # Resume, as a user would after a crash: the same command with --resume_from_checkpoint (forked ranks: the
    # launcher itself is proven by the launches above).
    for script, version in (("sft", 2), ("dpo", 1)):
        out = runs[(script, version)][0]
        resumed = root / f"{script}_fsdp{version}_resumed"
        args = _script_args(
            models / "recipe", trl_data[script], resumed, "--resume_from_checkpoint", str(out / "checkpoint-2")
        )
        proc = _launch_script(f"cpu_fsdp{version}_rehearsal.yaml", script, *args, fork=True)
        check(proc)
        runs[(script, version, "resumed")] = (resumed, proc.stdout + proc.stderr)
    return runs


@pytest.mark.parametrize("script,version", [("sft", 1), ("sft", 2), ("dpo", 1), ("dpo", 2)])
def test_trl_script_unchanged_through_run(script_runs, models, script, version):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, text = script_runs[(script, version)]
    assert f"hf_fsdp_qlora: FSDP{version} engaged on 2 rank(s)" in text
    assert "hf_fsdp_qlora: activation checkpointing: " in text  # trl's gradient_checkpointing=True, applied once
    final, last = _adapter(out), _adapter(out / "checkpoint-4")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    assert all(v.abs().sum() > 0 for k, v in final.items() if "lora_B" in k)
    # float32 master weights (issue 34) under trl's defaults (bf16, gradient checkpointing, LoRA dropout): saved in
    # fp32, and steps 3-4 at lr 1e-3 move nearly every lora_A element (16-bit adapters round most such steps away)
    # (with trl's uint8 storage and fp32 model dtype; the update against stock peft: tests/test_precision_trl.py)
    assert {str(v.dtype) for v in final.values()} == {"torch.float32"}
    middle = _adapter(out / "checkpoint-2")
    lora_a = [k for k in final if "lora_A" in k]
    moved = sum(int((final[k] != middle[k]).sum()) for k in lora_a) / sum(final[k].numel() for k in lora_a)
    assert lora_a and moved >= 0.99, moved
    assert (out / "checkpoint-2" / "optimizer_gathered.pt").is_file()
    assert not (out / ".incomplete-checkpoints").exists()
    # The adapter loads into the base as peft loads any adapter, every key used.
    base = AutoModelForCausalLM.from_pretrained(models / "recipe", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out))
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert {k.removeprefix("base_model.model.") for k in final} <= {
        k.removeprefix("base_model.model.") for k in loaded
    }
    if script == "dpo":
        assert _log(out / "checkpoint-4")[0]["loss"] == LN2_FP32
    _check_quant_record(models / "recipe", out, final, text)


def _check_quant_record(base, out, final, text):
    """trl's --load_in_4bit (nf4, no double quant, loaded by transformers): every save under FSDP carries the record
    read off the live model (issue 49, row 7: none before, and `--dequantize nf4` assumed double quant), and the
    merge by it equals the merge with that setting given by hand (its exactness against peft's own merge:
    tests/test_merge_record.py)."""
    from safetensors.torch import load_file

    from hf_fsdp_qlora.cli.main import main as cli_main
    from hf_fsdp_qlora.quant_record import RECORD_NAME, read_record

    linear = {f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    for folder in (out, out / "checkpoint-2", out / "checkpoint-4"):
        record = read_record(folder)
        assert record is not None, (folder, text[-2000:])
        assert (record.bits, record.quant_type, record.double_quant, record.blocksize) == (4, "nf4", False, 64)
        assert set(record.linear) == linear and record.experts == [], record.linear
    assert any(".q_proj.lora_" in k for k in final)  # peft's Llama default targets: a round-tripped layer
    stock = out.parent / f"{out.name}_stock_adapter"  # the same adapter without the record
    stock.mkdir(exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (stock / name).write_bytes((out / name).read_bytes())
    assert not (stock / RECORD_NAME).exists()
    merged = {}
    for name, adapter, flags in (("recorded", out, []), ("by_hand", stock, ["--no-double-quant"])):
        merged_dir = out.parent / f"{out.name}_{name}"
        argv = ["merge", "--base", str(base), "--adapter", str(adapter), "--output", str(merged_dir)]
        assert cli_main([*argv, "--dequantize", "nf4", "--no-progress", "--force", *flags]) == 0
        merged[name] = load_file(str(merged_dir / "model.safetensors"))
    a, b = merged["recorded"], merged["by_hand"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("script,version", [("sft", 2), ("dpo", 1)])
def test_trl_script_resume_equals_uninterrupted(script_runs, script, version):
    out, _ = script_runs[(script, version)]
    resumed, _ = script_runs[(script, version, "resumed")]
    a, b = _adapter(out), _adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda log: {e["step"]: e["loss"] for e in log if "loss" in e}  # noqa: E731
    assert losses(_log(out / "checkpoint-4")) == losses(_log(resumed / "checkpoint-4"))


def test_run_usage_errors():
    for args, needle in (
        ([], "usage: python -m hf_fsdp_qlora.run"),
        (["no_such.py"], "no such script"),
        (["-m"], "-m needs"),
    ):
        proc = _run([str(BIN / "python"), "-m", "hf_fsdp_qlora.run", *args], 60, None)
        assert proc.returncode == 2 and needle in proc.stderr, (proc.returncode, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr


def test_run_passes_the_scripts_exit_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('ran', sys.argv[1:])\nsys.exit(3)\n")
    proc = _run([str(BIN / "python"), "-m", "hf_fsdp_qlora.run", str(script), "--x", "1"], 60, None)
    assert proc.returncode == 3 and "ran ['--x', '1']" in proc.stdout


def test_bare_import_rehearses_fsdp(tmp_path):
    """`import hf_fsdp_qlora` alone, then a stock accelerate script, under the CPU FSDP2 config: FSDP engages.
    Launched with forked ranks (the environment `accelerate launch` gives them, tests/test_fork_launch.py): the
    claim is the import's, the real launcher's is test_run_exits_zero_every_time's and the trl scripts'."""
    script = tmp_path / "bare.py"
    script.write_text(
        "import json, sys, torch\n"
        "import hf_fsdp_qlora  # noqa: F401\n"
        "from accelerate import Accelerator\n"
        "acc = Accelerator()\n"
        "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))\n"
        "from torch.distributed.fsdp import FSDPModule\n"
        "found = {'type': str(acc.state.distributed_type), 'fsdp2': sum(isinstance(m, FSDPModule) for m in model.modules())}\n"
        "open(sys.argv[1] + f'/rank{acc.process_index}.json', 'w').write(json.dumps(found))\n"
        "acc.wait_for_everyone()\n"
        "acc.end_training()\n"
        "import os; os._exit(0)  # skip gloo's teardown at exit, which sometimes aborts\n"
    )
    check(accelerate_launch("cpu_fsdp2_rehearsal.yaml", str(script), str(tmp_path), timeout=180, fork=True))
    results = read_results(tmp_path)
    assert sorted(results) == [0, 1]
    assert all(r["type"] == "DistributedType.FSDP" and r["fsdp2"] > 0 for r in results.values())


# At interpreter teardown (module globals cleared) this aborts its process, as gloo's teardown sometimes does
# ("terminate called without an active exception", SIGABRT): deterministic where gloo's abort is not.
TEARDOWN_CANARY = """import os


class AbortAtTeardown:
    # os.write and os.abort bound now: the teardown may have cleared this module's `os` by the time this runs
    def __del__(self, write=os.write, abort=os.abort):
        write(2, b"teardown_canary: the interpreter's teardown ran; aborting\\n")
        abort()


KEPT_UNTIL_TEARDOWN = AbortAtTeardown()
"""


def test_run_exits_zero_every_time(tmp_path):
    """A gloo script that ends without destroying its process group aborted at exit about one run in four
    ("terminate called without an active exception", in the interpreter's teardown); through
    `-m hf_fsdp_qlora.run` it exits 0 every time, because the process ends without that teardown
    (hf_fsdp_qlora/train/finish.py). Proven deterministically: the script also imports a module whose teardown
    aborts every time (the oracle: run plainly, the process dies by SIGABRT), and the real `accelerate launch` of
    it, with its process group left alive on 2 ranks, exits 0."""
    (tmp_path / "teardown_canary.py").write_text(TEARDOWN_CANARY)
    plain = _run([str(BIN / "python"), "-c", "import teardown_canary"], 60, {"PYTHONPATH": str(tmp_path)})
    assert plain.returncode == -6 and "teardown_canary: the interpreter's teardown ran" in plain.stderr, (
        plain.returncode,
        plain.stderr[-2000:],
    )
    script = tmp_path / "no_teardown.py"
    script.write_text(
        "import teardown_canary  # noqa: F401\n"
        "import torch\n"
        "from accelerate import Accelerator\n"
        "acc = Accelerator()\n"
        "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))\n"
        "acc.backward(model(torch.randn(4, 8)).sum())\n"
        "opt.step()\n"
        "print('fsdp2' if acc.is_fsdp2 else str(acc.state.distributed_type))\n"
    )
    cmd = [
        str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / "cpu_fsdp2_rehearsal.yaml"),
        "--main_process_port", str(free_port()), "-m", "hf_fsdp_qlora.run", str(script),
    ]  # fmt: skip
    proc = _run(cmd, 180, None)
    assert proc.returncode == 0 and proc.stdout.count("fsdp2") == 2, (proc.returncode, proc.stderr[-2000:])
    assert "teardown_canary" not in proc.stderr
