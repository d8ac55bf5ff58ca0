"""`hf-fsdp-qlora doctor` / `check_setup`: every check fails and passes where it should, the memory plan matches
what a real run holds, the verdicts match the shipped 70B and Llama Guard configs, bad input exits 2 without a
traceback - and the doctor's verdict agrees with reality: one 2-rank launch runs each configuration on real FSDP
(CPU, gloo) and every configuration the doctor fails really fails, every one it passes really trains.
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from dist_utils import BIN, CONFIGS, check, read_results, torchrun
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.main import main as cli_main
from hf_fsdp_qlora.doctor import diagnose, parse_gpu_memory

DATA = Path(__file__).resolve().parent / "data"
LLAMA3_70B = DATA / "llama3_70b_config.json"
LLAMA2_70B = DATA / "llama2_70b_config.json"
GUARD_1B = DATA / "llamaguard3_1b_config.json"
GB = 2**30


def _yaml(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def _cfg(name: str, **changes) -> dict:
    """A shipped config with top-level and fsdp_config (``fsdp_*``) keys changed."""
    config = copy.deepcopy(_yaml(name))
    for key, value in changes.items():
        (config["fsdp_config"] if key.startswith("fsdp_") else config)[key] = value
    return config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor_models")
    build_tiny_model(root / "llama", "llama")
    return root


def _ids(model, config, severity=None, **settings) -> set[str]:
    findings = diagnose(str(model), accelerate_config=config, **settings).findings
    return {f.id for f in findings if severity is None or f.severity == severity}


Q4 = {"quantization": "4bit", "lora_r": 4}
STOCK = dict(Q4, trainer="transformers", adapter_dtype="bfloat16")
PLAIN = dict(Q4, trainer="accelerate", adapter_dtype="bfloat16")
F1Q, F2Q = _yaml("fsdp1_qlora"), _yaml("fsdp2_qlora")
# (check id, its severity, failing config, failing settings, passing config, passing settings)
CHECKS = [
    # A stock Trainer cannot flatten uint8-stored weights under FSDP1 (error); ours views them as bf16 (info, below).
    ("fsdp1-integer-storage", "error", F1Q, dict(STOCK, quant_storage="uint8"), F1Q, STOCK),
    # A stock Trainer leaves uint8-stored weights unsharded (warning); ours views them as bf16 (info, below).
    ("fsdp2-integer-storage", "warning", F2Q, dict(STOCK, quant_storage="uint8"), F2Q, STOCK),
    ("8bit-under-fsdp", "error", F2Q, {"quantization": "8bit", "trainer": "transformers"}, F2Q,
     {"quantization": "8bit"}),
    ("storage-vs-param-dtype", "error", _cfg("fsdp2_qlora", mixed_precision="fp16"), STOCK,
     _cfg("fsdp2_qlora", mixed_precision="fp16"), Q4),
    # Ours fixes FSDP's param dtype, but fp16 autocast and a grad scaler over bf16 weights remain: refused.
    ("mixed-precision-vs-storage", "error", _cfg("fsdp2_qlora", mixed_precision="fp16"), Q4, F2Q, Q4),
    ("storage-vs-compute-dtype", "warning", F2Q, dict(STOCK, compute_dtype="float32"), F2Q, STOCK),
    ("fsdp1-fp32-adapters", "error", F1Q, dict(Q4, trainer="transformers"), F2Q, dict(Q4, trainer="transformers")),
    ("fsdp1-fp32-norms", "error", F1Q, dict(PLAIN, norm_dtype="float32"), F1Q, PLAIN),
    ("fsdp1-use-orig-params", "error", _cfg("fsdp1_qlora", fsdp_use_orig_params=False), PLAIN,
     _cfg("fsdp1_qlora", fsdp_use_orig_params=False), STOCK),
    ("device-map-under-fsdp", "error", _yaml("fsdp2_qlora_offload"), dict(Q4, device_map="auto"),
     _yaml("fsdp2_qlora_offload"), Q4),
    ("activation-checkpointing-twice", "error", F2Q, dict(STOCK, gradient_checkpointing=True), F2Q, STOCK),
    ("cpu-ram-efficient-loading-without-sync", "error", _cfg("fsdp1_qlora", fsdp_sync_module_states=False), Q4,
     F1Q, Q4),
    ("cpu-rehearsal-needs-gpu", "error", _cfg("cpu_fsdp1_rehearsal", fsdp_sync_module_states=True), Q4,
     _yaml("cpu_fsdp1_rehearsal"), Q4),
    ("wrap-class-missing", "error", _cfg("fsdp2_qlora", fsdp_transformer_layer_cls_to_wrap="GPT2Block"), Q4,
     _cfg("fsdp2_qlora", fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer"), Q4),
    ("no-auto-wrap", "error", _cfg("fsdp2_qlora", fsdp_auto_wrap_policy="NO_WRAP"), Q4, F2Q, Q4),
    ("padding-to-max-length", "warning", F2Q, dict(Q4, padding="max_length"), F2Q,
     dict(Q4, padding="max_length", packing=True)),
    ("optimizer-in-checkpoint", "info", F2Q, dict(Q4, save_steps=100), F2Q,
     dict(Q4, save_steps=100, save_only_model=True)),
]  # fmt: skip


@pytest.mark.parametrize("check_id,severity,fail_cfg,failing,pass_cfg,passing", CHECKS, ids=[c[0] for c in CHECKS])
def test_check_fails_and_passes(tiny, check_id, severity, fail_cfg, failing, pass_cfg, passing):
    assert check_id in _ids(tiny / "llama", fail_cfg, severity, **failing)
    assert check_id not in _ids(tiny / "llama", pass_cfg, severity, **passing)


def test_our_trainer_turns_dtype_errors_into_infos(tiny):
    """What hf_fsdp_qlora fixes before wrapping is reported, not refused; what it cannot fix stays an error."""
    fsdp1 = _cfg("fsdp1_qlora", fsdp_use_orig_params=False)
    infos = _ids(tiny / "llama", fsdp1, "info", **Q4, adapter_dtype="float32", norm_dtype="float32")
    assert {"fsdp1-fp32-adapters", "fsdp1-fp32-norms", "fsdp1-use-orig-params"} <= infos
    assert not _ids(tiny / "llama", fsdp1, "error", **Q4, adapter_dtype="float32", norm_dtype="float32")
    assert "fsdp1-integer-storage" in _ids(tiny / "llama", fsdp1, "info", **Q4, quant_storage="uint8")
    assert not _ids(tiny / "llama", fsdp1, "error", **Q4, quant_storage="uint8")


def test_live_model_and_plugin(tiny):
    """What the trainer runs before wrapping: facts read from the loaded model and the live plugin."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def plugin(version, **kw):
        return SimpleNamespace(fsdp_version=version, auto_wrap_policy=None, transformer_cls_names_to_wrap=None,
                               cpu_offload=None, mixed_precision_policy=None, use_orig_params=True, **kw)  # fmt: skip

    for storage in (torch.uint8, torch.bfloat16):
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=storage
        )
        base = AutoModelForCausalLM.from_pretrained(tiny / "llama", quantization_config=quant, dtype=torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))  # fp32 adapters (peft default)
        found = {f.id: f.severity for f in diagnose(model, fsdp_plugin=plugin(1)).findings}
        if storage == torch.uint8:
            assert found["fsdp1-integer-storage"] == "info"  # our trainer views the bytes as bf16
        else:
            assert found == {"fsdp1-fp32-adapters": "info"}, found


def test_memory_plan_matches_a_loaded_model(tiny):
    """The plan's quantized base, quantization constants, other weights and LoRA equal a real 4-bit model's bytes."""
    import torch

    from hf_fsdp_qlora import load_qlora_model

    model = load_qlora_model(str(tiny / "llama"), lora_config=None, gradient_checkpointing=False)
    real = dict.fromkeys(("params_quantized", "quant_state", "params_other", "params_trainable"), 0)
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and not hasattr(module, "base_layer"):
            qs = module.weight.quant_state
            real["quant_state"] += sum(t.numel() * t.element_size() for t in
                                       (qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code))  # fmt: skip
    quantized = {
        id(m.weight) for m in model.modules() if type(m).__name__ == "Linear4bit" and not hasattr(m, "base_layer")
    }
    for p in model.parameters():
        key = "params_trainable" if p.requires_grad else "params_quantized" if id(p) in quantized else "params_other"
        real[key] += p.numel() * p.element_size()
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # fp32 master weights
    d = diagnose(str(tiny / "llama"), accelerate_config=_yaml("fsdp2_qlora"), num_gpus=1, quantization="4bit")
    assert {k: d.plan.shard[k] for k in real} == real
    assert _weight_terms(d) == real  # each term function on its own


def _weight_terms(diagnosis) -> dict[str, int]:
    """The weight terms of the plan's table (hf_fsdp_qlora.doctor.terms), each called on its own, by the measured
    key they stand for."""
    from hf_fsdp_qlora.doctor import terms
    from hf_fsdp_qlora.doctor.plan_context import plan_context

    ctx = plan_context(diagnosis.shape, diagnosis.setup)
    return {key: int(term(ctx).bytes) for key, term in (
        ("params_quantized", terms.base_quantized), ("quant_state", terms.base_quant_state),
        ("params_other", terms.base_other), ("params_trainable", terms.adapter))}  # fmt: skip


def test_lora_count_matches_peft(tiny):
    """Our LoRA parameter count (peft's all-linear rule, without building peft layers) equals peft's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.doctor import model_shape

    for targets in ("all-linear", ["q_proj", "v_proj"]):
        model = AutoModelForCausalLM.from_pretrained(tiny / "llama")
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
        expected = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert model_shape(tiny / "llama", targets).lora_params(8) == expected


def test_llama3_70b_qlora_2xa100_verdict_matches_shipped_config():
    """llama3_70b_2xa100_80gb.yaml: QLoRA of Llama 3 70B fits on 2x A100 80GB at batch 1 and 2048-4096 tokens,
    with the config's activation checkpointing; without it, it does not."""
    started = time.perf_counter()
    for seq in (2048, 4096):
        d = diagnose(LLAMA3_70B, accelerate_config="llama3_70b_2xa100_80gb", quantization="4bit", seq_len=seq,
                     gpu_memory=parse_gpu_memory("80GB"))  # fmt: skip
        assert d.plan.verdict == "fits" and not d.errors, [f.message for f in d.errors]
        # 70B in NF4 + double quant, bf16 embeddings and head: about 40 GB, about 20 GB per GPU (the config's text).
        base = d.plan.parts["base_quantized"] + d.plan.parts["base_other"] + d.plan.parts["base_quant_state"]
        assert 18 * GB < base < 22 * GB
    assert time.perf_counter() - started < 20
    d = diagnose(LLAMA3_70B, accelerate_config=_cfg("llama3_70b_2xa100_80gb", fsdp_activation_checkpointing=False),
                 quantization="4bit", seq_len=4096, gpu_memory=80 * GB)  # fmt: skip
    assert "activation-checkpointing-off" in {f.id for f in d.errors}
    assert d.plan.verdict == "does_not_fit"
    # load_qlora_model enables checkpointing on the model itself (its default): that counts too.
    d = diagnose(LLAMA3_70B, accelerate_config=_cfg("llama3_70b_2xa100_80gb", fsdp_activation_checkpointing=False),
                 quantization="4bit", seq_len=4096, gpu_memory=80 * GB, model_checkpointing=True)  # fmt: skip
    assert d.plan.verdict == "fits" and not d.errors


def test_llamaguard_1b_full_finetune_1x24gb_verdict_matches_shipped_config():
    """llamaguard3_1b_1x24gb.yaml: a full fine-tune fits one 24 GB GPU with its CPU offload; without it, fp32
    weights, gradients and AdamW states alone are about 24 GB and it does not."""
    d = diagnose(GUARD_1B, accelerate_config="llamaguard3_1b_1x24gb", full_finetune=True, seq_len=4096,
                 gpu_memory=24 * GB)  # fmt: skip
    assert d.plan.verdict == "fits" and not d.errors
    assert 1.4e9 < d.shape.total_params < 1.6e9
    persistent = d.plan.host["offloaded"]
    assert 21 * GB < persistent < 25 * GB  # 16 bytes per parameter, moved to host RAM
    no_offload = diagnose(GUARD_1B, accelerate_config=_cfg("llamaguard3_1b_1x24gb", fsdp_offload_params=False),
                          full_finetune=True, seq_len=4096, gpu_memory=24 * GB)  # fmt: skip
    assert no_offload.plan.verdict == "does_not_fit"
    assert {f.id for f in no_offload.errors} == {"memory-does-not-fit"}
    assert no_offload.errors[0].setting == "fsdp_config.fsdp_offload_params"


def test_memory_checks_on_large_models():
    """Loading, checkpoint timeout and evaluation batch, each failing and passing."""
    llama2 = {"quantization": "4bit", "gpu_memory": 24 * GB, "seq_len": 2048}
    assert "load-does-not-fit" in {
        f.id for f in diagnose(LLAMA2_70B, accelerate_config="fsdp2_qlora", **llama2).errors
    }
    assert "load-does-not-fit" not in {
        f.id
        for f in diagnose(LLAMA2_70B, accelerate_config="fsdp2_qlora", **{**llama2, "gpu_memory": 80 * GB}).findings
    }
    full = {"full_finetune": True, "save_steps": 100, "gpu_memory": 80 * GB, "num_gpus": 16}
    timeout = {f.id: f for f in diagnose(LLAMA3_70B, accelerate_config="fsdp1_qlora", **full).findings}
    assert timeout["checkpoint-timeout"].severity == "error"
    assert "ddp_timeout" in timeout["checkpoint-timeout"].setting
    assert "checkpoint-timeout" not in {
        f.id for f in diagnose(LLAMA3_70B, accelerate_config="fsdp1_qlora", **full, timeout_minutes=600).findings
    }
    qlora = {"quantization": "4bit", "seq_len": 4096, "gpu_memory": 80 * GB}
    assert "eval-batch-too-large" in {
        f.id
        for f in diagnose(LLAMA3_70B, accelerate_config="llama3_70b_2xa100_80gb", eval_batch_size=16, **qlora).errors
    }
    assert not diagnose(LLAMA3_70B, accelerate_config="llama3_70b_2xa100_80gb", eval_batch_size=1, **qlora).errors


# --- the command line ------------------------------------------------------------------------------------------


def _cli(capsys, *args):
    code = cli_main(["doctor", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_and_exit_codes(capsys):
    code, out, _ = _cli(capsys, "--accelerate-config", "llama3_70b_2xa100_80gb", "--model", LLAMA3_70B,
                        "--load-in-4bit", "--seq-len", 4096, "--gpu-memory", "80GB", "--json")  # fmt: skip
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["exit_code"] == 0 and doc["schema_version"] == 1
    assert set(doc) == {"schema_version", "ok", "exit_code", "counts", "setup", "findings", "memory"}
    assert doc["setup"]["fsdp"]["version"] == 2 and doc["setup"]["num_gpus"] == 2
    memory = doc["memory"]
    assert memory["verdict"] == "fits" and memory["per_gpu"]["total"] == sum(
        v for k, v in memory["per_gpu"].items() if k != "total"
    )
    assert set(memory["activations"]) == {"checkpointing", "with_checkpointing", "without_checkpointing"}
    for finding in doc["findings"]:
        assert set(finding) == {"id", "severity", "problem", "setting", "value"}
    code, out, _ = _cli(capsys, "--accelerate-config", "fsdp2_qlora", "--model", LLAMA3_70B, "--load-in-8bit",
                        "--trainer", "transformers")  # fmt: skip
    assert code == 1 and "8bit-under-fsdp" in out and "ERROR" in out
    code, out, _ = _cli(capsys, "--accelerate-config", "fsdp2_qlora", "--model", LLAMA3_70B, "--load-in-8bit")
    assert code == 0 and "8bit-under-fsdp" in out and "LoRA on 8-bit" in out


@pytest.mark.parametrize(
    "case,expect",
    [
        ("not_accelerate", "is not an accelerate config"),
        ("unknown_key", "unknown key `fsdp_confg`"),
        ("unknown_fsdp_key", "unknown fsdp_config key `fsdp_offload_parms`"),
        ("bad_yaml", "is not valid YAML"),
        ("no_config_json", "has no config.json"),
        ("missing_model", "does not exist"),
        ("unknown_name", "neither a file nor a shipped config"),
    ],
)
def test_cli_bad_input_exits_2(tmp_path, capsys, case, expect):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_yaml("fsdp2_qlora")))
    model = LLAMA3_70B
    if case == "not_accelerate":
        config.write_text(yaml.safe_dump({"model": "llama", "lr": 1e-4}))
    elif case == "unknown_key":
        config.write_text(yaml.safe_dump({**_yaml("fsdp2_qlora"), "fsdp_confg": {}}))
    elif case == "unknown_fsdp_key":
        config.write_text(yaml.safe_dump(_cfg("fsdp2_qlora", fsdp_offload_parms=True)))
    elif case == "bad_yaml":
        config.write_text("distributed_type: FSDP\n  fsdp_config: [\n")
    elif case == "no_config_json":
        model = tmp_path
    elif case == "missing_model":
        model = tmp_path / "nope"
    elif case == "unknown_name":
        config = "fsdp3_qlora"
    code, _, err = _cli(capsys, "--accelerate-config", config, "--model", model, "--load-in-4bit")
    assert code == 2 and expect in err, err
    assert "Traceback" not in err


def test_console_script_no_traceback(tmp_path):
    """The installed `hf-fsdp-qlora doctor`: bad usage exits 2 with one line, a good run prints the table."""
    cli = str(BIN / "hf-fsdp-qlora")
    proc = subprocess.run([cli, "doctor", "--accelerate-config", str(tmp_path), "--model", str(GUARD_1B)],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hf-fsdp-qlora doctor: error:")


def test_check_setup_is_public():
    import hf_fsdp_qlora

    findings = hf_fsdp_qlora.check_setup(LLAMA3_70B, accelerate_config="fsdp1_qlora", quantization="4bit",
                                         quant_storage="uint8", trainer="transformers")  # fmt: skip
    assert findings[0].severity == "error" and findings[0].id == "fsdp1-integer-storage"
    assert "bnb_4bit_quant_storage" in findings[0].message and "torch.bfloat16" in findings[0].message
    with pytest.raises(TypeError, match="unknown settings"):
        hf_fsdp_qlora.check_setup(LLAMA3_70B, accelerate_config="fsdp1_qlora", batchsize=2)


# --- the doctor against reality: one 2-rank launch on CPU ------------------------------------------------------

BF16 = {"quantization": "4bit", "quant_storage": "bfloat16", "adapter_dtype": "bfloat16"}
F1, F2 = _yaml("cpu_fsdp1_rehearsal"), _yaml("cpu_fsdp2_rehearsal")


def _rehearsal(name, **changes):
    return _cfg(f"cpu_{name}_rehearsal", **changes)


# name: (accelerate config, model spec, trainer, training, expected error id or None, text of the real failure)
SCENARIOS = {
    "f1_uint8_stock": (F1, dict(BF16, quant_storage="uint8"), "transformers", {}, "fsdp1-integer-storage",
                       "Cannot flatten integer dtype tensors"),
    "f1_uint8_ours": (F1, dict(BF16, quant_storage="uint8"), "hf_fsdp_qlora", {}, None, None),
    "f2_8bit_ours": (F2, {"quantization": "8bit"}, "hf_fsdp_qlora", {}, None, None),  # converted: trains
    "f1_fp32lora_stock": (F1, dict(BF16, adapter_dtype="float32"), "transformers", {}, "fsdp1-fp32-adapters",
                          "expected m1 and m2 to have the same dtype"),
    "f1_kbitprep_stock": (F1, dict(BF16, kbit_prep=True), "transformers", {}, "fsdp1-fp32-norms",
                          "Must flatten tensors with uniform dtype"),
    "f1_origfalse_accel": (_rehearsal("fsdp1", fsdp_use_orig_params=False), BF16, "accelerate", {},
                           "fsdp1-use-orig-params", "Must flatten tensors with uniform `requires_grad`"),
    "f2_fp16mp_stock": (_rehearsal("fsdp2", mixed_precision="fp16"), BF16, "transformers", {},
                        "storage-vs-param-dtype", None),  # trains, on corrupted weights: the logits show it
    "f2_fp16mp_ours": (_rehearsal("fsdp2", mixed_precision="fp16"), BF16, "hf_fsdp_qlora", {},
                       "mixed-precision-vs-storage", "[mixed-precision-vs-storage]"),
    "f2_devmap_stock": (F2, dict(BF16, device_map="multi-device"), "transformers", {}, "device-map-under-fsdp",
                        "loaded with `device_map='auto'` in any distributed mode"),
    "f2_ac_twice_stock": (F2, BF16, "transformers", {"activation_checkpointing": True},
                          "activation-checkpointing-twice", "can't both be set to True"),
    "f2_ac_twice_ours": (F2, BF16, "hf_fsdp_qlora", {"activation_checkpointing": True}, None, None),
    "f2_wrapclass_stock": (_rehearsal("fsdp2", fsdp_transformer_layer_cls_to_wrap="GPT2Block"), BF16, "transformers",
                           {}, "wrap-class-missing", "Could not find the transformer layer class GPT2Block"),
    "f2_nowrap_ac_stock": (_rehearsal("fsdp2", fsdp_auto_wrap_policy="NO_WRAP"), BF16, "transformers", {},
                          "no-auto-wrap", "'NoneType' object is not callable"),
    "f2_cpuram_nosync": (_rehearsal("fsdp2", fsdp_cpu_ram_efficient_loading=True), BF16, "hf_fsdp_qlora", {},
                         "cpu-ram-efficient-loading-without-sync", "set `--fsdp_sync_module_states` to `True`"),
    "f1_sync_on_cpu": (_rehearsal("fsdp1", fsdp_sync_module_states=True), BF16, "hf_fsdp_qlora", {},
                       "cpu-rehearsal-needs-gpu", "There are currently no available devices found"),
    "p1_ours": (F1, BF16, "hf_fsdp_qlora", {}, None, None),
    "p2_sync_cpuram_on_cpu": (_rehearsal("fsdp2", fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states=True),
                              BF16, "hf_fsdp_qlora", {}, None, None),
    "p2_ours": (F2, BF16, "hf_fsdp_qlora", {}, None, None),
    "p1_fp32lora_kbit_origfalse_ours": (_rehearsal("fsdp1", fsdp_use_orig_params=False),
                                        dict(BF16, adapter_dtype="float32", kbit_prep=True), "hf_fsdp_qlora", {},
                                        None, None),
    "p1_origfalse_stock": (_rehearsal("fsdp1", fsdp_use_orig_params=False), BF16, "transformers", {}, None, None),
    "p2_uint8_ours": (F2, dict(BF16, quant_storage="uint8"), "hf_fsdp_qlora", {}, None, None),
    "p2_fp32storage_bf16mp_ours": (_rehearsal("fsdp2", mixed_precision="bf16"), dict(BF16, quant_storage="float32"),
                                   "hf_fsdp_qlora", {}, None, None),
    "p2_fp32lora_stock": (F2, dict(BF16, adapter_dtype="float32"), "transformers", {}, None, None),
    "p1_bf16mp_stock": (_rehearsal("fsdp1", mixed_precision="bf16"), BF16, "transformers", {}, None, None),
    "p2_full_bf16mp_stock": (_rehearsal("fsdp2", mixed_precision="bf16"), {"full_finetune": True}, "transformers",
                             {}, None, None),
}  # fmt: skip
MEASURED = ("p1_ours", "p2_ours", "p1_bf16mp_stock", "p2_full_bf16mp_stock", "p2_uint8_ours")


def _doctor_settings(spec: dict, trainer: str, training: dict) -> dict:
    # The spec's adapter_dtype is the dtype the model is built with; our trainer casts the adapters to its own
    # adapter_dtype argument (float32 master weights unless the scenario's training opts out), which the doctor's
    # --adapter-dtype means with --trainer hf_fsdp_qlora.
    adapter = training.get("adapter_dtype") if trainer == "hf_fsdp_qlora" else spec.get("adapter_dtype")
    return {
        "quantization": spec.get("quantization"), "full_finetune": spec.get("full_finetune", False),
        "quant_storage": spec.get("quant_storage"), "adapter_dtype": adapter,
        "norm_dtype": "float32" if spec.get("kbit_prep") else None, "device_map": spec.get("device_map"),
        "trainer": trainer, "gradient_checkpointing": training.get("activation_checkpointing", False), "lora_r": 4,
    }  # fmt: skip


@pytest.fixture(scope="module")
def rehearsal(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor_rehearsal")
    scenarios = [
        {"name": name, "accelerate_config": cfg, "model": spec, "trainer": trainer, "training": training,
             "measure": name in MEASURED}
        for name, (cfg, spec, trainer, training, _, _) in SCENARIOS.items()
    ]  # fmt: skip
    (out / "scenarios.json").write_text(json.dumps(scenarios))
    proc = torchrun("doctor_scenarios.py", "--out", str(out / "run"), "--models", str(tiny),
                    "--scenarios", str(out / "scenarios.json"), timeout=600)  # fmt: skip
    check(proc)
    results = read_results(out / "run")
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_doctor_agrees_with_reality(tiny, rehearsal, name):
    config, spec, trainer, training, expected_error, real_text = SCENARIOS[name]
    diagnosis = diagnose(str(tiny / "llama"), accelerate_config=config, **_doctor_settings(spec, trainer, training))
    errors = {f.id for f in diagnosis.errors}
    for rank in (0, 1):
        real = rehearsal[rank][name]
        # Silent corruption: the run "trains", but its step-0 logits are far from the unsharded model's.
        failed = not real["ok"] or real["logits_rel_err"] > 0.1
        assert failed == bool(errors), (errors, real.get("error"), real.get("logits_rel_err"))
        if expected_error is None:
            assert real["distributed_type"] == "DistributedType.FSDP"
            engagement = real["engagement"]
            assert engagement["flat_params"] > 0 or engagement["fsdp2_modules"] > 0, engagement
            continue
        assert expected_error in errors
        if real_text is not None:
            assert real_text in real["error"], real["error"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", MEASURED)
def test_memory_plan_matches_rehearsal_per_rank(tiny, rehearsal, name):
    """Local shards of parameters, gradients and optimizer state per rank after one step, within 10%."""
    config, spec, trainer, training, _, _ = SCENARIOS[name]
    plan = diagnose(str(tiny / "llama"), accelerate_config=config, **_doctor_settings(spec, trainer, training)).plan
    for rank in (0, 1):
        measured = rehearsal[rank][name]["measured"]
        for key, estimate in plan.shard.items():
            assert estimate == pytest.approx(measured[key], rel=0.10, abs=64), (key, estimate, measured[key])


def test_ours_shards_integer_storage_under_fsdp2_is_info(tiny):
    assert "fsdp2-integer-storage" in _ids(tiny / "llama", F2Q, "info", **Q4, quant_storage="uint8")
    assert "fsdp2-integer-storage" not in _ids(tiny / "llama", F2Q, "warning", **Q4, quant_storage="uint8")


# --- issue 13 item 5: values no run can have are one-line usage errors; impossible setups are findings ----------


@pytest.mark.parametrize(
    "option, value, expect",
    [
        ("--write-speed", "0", "--write-speed 0.0: must be positive"),
        ("--write-speed", "-3", "--write-speed -3.0: must be positive"),
        ("--lora-r", "0", "--lora-r 0: must be at least 1"),
        ("--lora-r", "-4", "--lora-r -4: must be at least 1"),
        ("--seq-len", "0", "--seq-len 0: must be at least 1"),
        ("--batch-size", "0", "--batch-size 0: must be at least 1"),
        ("--eval-batch-size", "0", "--eval-batch-size 0: must be at least 1"),
        ("--num-gpus", "0", "--num-gpus 0: must be at least 1"),
        ("--lora-dropout", "2", "--lora-dropout 2.0: a dropout probability"),
        ("--lora-dropout", "-0.1", "--lora-dropout -0.1: a dropout probability"),
        ("--gpu-memory", "0GB", "--gpu-memory 0GiB: must be positive"),
        ("--gpu-memory=-8GB", None, "--gpu-memory -8GiB: must be positive"),
        ("--timeout-minutes", "0", "--timeout-minutes 0.0: must be positive"),
        ("--save-steps", "-1", "--save-steps -1: must not be negative"),
    ],
)
def test_cli_values_no_run_can_have_exit_2_in_one_line(capsys, option, value, expect):
    args = [option] if value is None else [option, value]
    code, out, err = _cli(capsys, "--accelerate-config", "fsdp2_qlora", "--model", LLAMA3_70B, "--load-in-4bit",
                          "--gpu-memory", "80GB", *args)  # fmt: skip
    print(option, value, "->", code, err.strip())
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("hf-fsdp-qlora doctor: error:") and expect in err, err


def test_seq_len_above_max_positions_is_a_finding(tiny, tmp_path):
    from transformers import GPT2Config

    llama = Path(tiny) / "llama"
    max_pos = json.loads((llama / "config.json").read_text())["max_position_embeddings"]
    rope = diagnose(llama, accelerate_config="fsdp2_qlora", quantization="4bit", seq_len=max_pos + 1)
    found = {f.id: f for f in rope.findings}
    assert found["seq-len-above-max-positions"].severity == "warning"
    ok = diagnose(llama, accelerate_config="fsdp2_qlora", quantization="4bit", seq_len=max_pos)
    assert "seq-len-above-max-positions" not in {f.id for f in ok.findings}
    GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, vocab_size=256).save_pretrained(tmp_path / "gpt2")
    learned = diagnose(tmp_path / "gpt2", accelerate_config="fsdp2_qlora", quantization="4bit", seq_len=128)
    assert {f.id: f.severity for f in learned.findings}["seq-len-above-max-positions"] == "error"
    assert learned.exit_code == 1


@pytest.mark.parametrize("architectures", [None, ["BertLMHeadModel"], ["BertForMaskedLM"]])
def test_bert_style_model_is_not_ready_to_launch(tmp_path, capsys, architectures):
    from transformers import BertConfig

    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config.architectures = architectures
    config.save_pretrained(tmp_path)
    if architectures is None:  # save_pretrained may fill it in: make sure the config has none
        data = json.loads((tmp_path / "config.json").read_text())
        data.pop("architectures", None)
        (tmp_path / "config.json").write_text(json.dumps(data))
    code, out, err = _cli(capsys, "--accelerate-config", "fsdp2_qlora", "--model", tmp_path, "--load-in-4bit")
    assert code == 2 and "ready to launch" not in out and "no causal-LM head" in err, (out, err)


# --- issue 27 item 6: mixture-of-experts plans; issue 28 item 4: the 8-bit plan ----------------------------------

QWEN3_30B = DATA / "qwen3_30b_a3b_config.json"
QWEN3_235B = DATA / "qwen3_235b_a22b_config.json"
MIXTRAL = DATA / "mixtral_8x7b_config.json"
LLAMA31_70B = DATA / "llama3_1_70b_config.json"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from tiny_models import MOE_ARCHS

    root = tmp_path_factory.mktemp("doctor_moe")
    return {arch: build_tiny_model(root / arch, arch) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_plan_matches_a_loaded_model(tiny_moe, arch):
    """The plan's weight bytes of a tiny MoE model - 4-bit linear layers and experts (packed bytes, absmax, nested
    absmax, offsets, code tables), 16-bit router, norms, embeddings and gpt-oss' expert biases, LoRA - equal the
    bytes load_qlora_model really holds (oracle)."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    model = load_qlora_model(str(tiny_moe[arch]), gradient_checkpointing=False)
    real = dict.fromkeys(("params_quantized", "quant_state", "params_other", "params_trainable"), 0)
    packed = set()
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and not hasattr(module, "base_layer"):
            qs = module.weight.quant_state
            real["quant_state"] += sum(t.numel() * t.element_size() for t in
                                       (qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code))  # fmt: skip
            packed.add(id(module.weight))
        if isinstance(module, QuantizedExperts):
            real["quant_state"] += sum(b.numel() * b.element_size() for b in module.buffers())
            packed |= {id(p) for n, p in module.named_parameters() if n.endswith("_4bit")}
    assert any(isinstance(m, QuantizedExperts) for m in model.modules())
    for p in model.parameters():
        key = "params_trainable" if p.requires_grad else "params_quantized" if id(p) in packed else "params_other"
        real[key] += p.numel() * p.element_size()
    d = diagnose(str(tiny_moe[arch]), accelerate_config=_yaml("fsdp2_qlora"), num_gpus=1, quantization="4bit")
    plan = d.plan
    assert {k: plan.shard[k] for k in real} == real
    assert _weight_terms(d) == real  # each term function on its own
    # Kept 16-bit (a stock load_in_4bit): the experts move from the packed bytes into the 16-bit weights.
    stock = diagnose(str(tiny_moe[arch]), accelerate_config=_yaml("fsdp2_qlora"), num_gpus=1, quantization="4bit",
                     quantize_experts=False).plan  # fmt: skip
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_4bit"))
    assert stock.shard["params_quantized"] < plan.shard["params_quantized"]
    assert stock.parameters["experts_bytes"] == stock.parameters["experts_bytes_16bit"] > 2 * experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_moe_parameter_counts_match_transformers(arch, tmp_path):
    """Total, expert and active parameters from the shapes equal transformers' own meta-device model of the config
    (dense first layers and shared experts included)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp_qlora.doctor import model_shape

    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
             "num_experts_per_tok": 2, "num_hidden_layers": 3}  # fmt: skip
    extra = {
        "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "mlp_only_layers": [0], "intermediate_size": 96},
        "mixtral": {"num_local_experts": 4, "intermediate_size": 48},
        "gpt_oss": {"num_local_experts": 4, "intermediate_size": 48, "head_dim": 16},
        "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 40},
        "deepseek_v3": {"n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 32,
                        "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                        "qk_nope_head_dim": 8, "v_head_dim": 8, "n_group": 1, "topk_group": 1,
                        "num_key_value_heads": 4},
    }[arch]  # fmt: skip
    config = AutoConfig.for_model(arch, **{**small, **extra})
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        oracle = AutoModelForCausalLM.from_config(config)
    shape = model_shape(tmp_path)
    assert shape.total_params == sum(p.numel() for p in oracle.parameters())
    expert_params = [p for n, p in oracle.named_parameters() if ".experts." in n and "shared" not in n]
    assert shape.expert_params == sum(p.numel() for p in expert_params) > 0
    per_layer = sum(p.numel() for p in expert_params) // len(shape.moe_layers)
    k, e = shape.experts_per_token, shape.experts[0].num_experts
    assert shape.active_params == shape.total_params - len(shape.moe_layers) * per_layer * (e - k) // e
    assert len(shape.moe_layers) == (2 if arch in ("qwen3_moe", "deepseek_v3") else 3)


@pytest.mark.parametrize(
    "config, gpus, gpu_memory, fits_with_16bit_experts",
    [(QWEN3_30B, 2, 24, False), (QWEN3_30B, 1, 80, True), (MIXTRAL, 2, 24, False), (QWEN3_235B, 8, 80, True)],
)
def test_moe_plans_of_published_models(config, gpus, gpu_memory, fits_with_16bit_experts):
    """The named plans from the published config.json files: 4-bit experts fit; the stock load's 16-bit experts
    need about 4x their bytes. The published figures: Qwen3-30B-A3B's experts 28.99B parameters, 57.98 GB in bf16,
    14.96 GB in NF4 with double quant; Mixtral-8x7B's 45.10B, 90.19 GB -> 23.26 GB."""
    d = diagnose(config, accelerate_config="fsdp2_qlora", quantization="4bit", num_gpus=gpus,
                 gpu_memory=gpu_memory * GB)  # fmt: skip
    params = d.plan.parameters
    assert d.plan.verdict == "fits", d.plan.total / GB
    stock = diagnose(config, accelerate_config="fsdp2_qlora", quantization="4bit", num_gpus=gpus,
                     gpu_memory=gpu_memory * GB, quantize_experts=False)  # fmt: skip
    assert stock.plan.total == params["total_with_16bit_experts"] > d.plan.total
    assert (stock.plan.verdict == "fits") == fits_with_16bit_experts
    assert 3.8 < params["experts_bytes_16bit"] / params["experts_bytes"] < 3.9
    published = {QWEN3_30B: (28.99e9, 57.98e9, 14.96e9, 3.3e9), MIXTRAL: (45.10e9, 90.19e9, 23.26e9, 12.9e9),
                 QWEN3_235B: (227.1e9, 454.2e9, 117.1e9, 22.2e9)}[config]  # fmt: skip
    got = (params["experts"], params["experts_bytes_16bit"], params["experts_bytes"], params["active"])
    assert got == pytest.approx(published, rel=0.02)  # the model cards round: "3.3B activated"
    # load_qlora_model streams the experts from the files into 4 bits one layer at a time (onto each GPU); with
    # 16-bit experts (or a stock load) every GPU holds them all 16-bit while loading.
    assert d.plan.load_peak_per_gpu < params["experts_bytes_16bit"] < stock.plan.load_peak_per_gpu
    # Host RAM per process: the whole 4-bit model, one layer's 16-bit experts and their packed bytes, 1 GiB of runtime
    # (before streaming: every 16-bit expert, 54 GiB for Qwen3-30B-A3B).
    shard, layer = d.plan.shard, d.shape.per_layer("experts")
    whole = gpus * shard["params_quantized"] + shard["quant_state"] + gpus * shard["params_other"]
    assert d.plan.host["loading"] == pytest.approx(whole + 2 * layer + layer / 2 + GB, rel=1e-3)
    assert d.plan.host["loading"] * 2.9 < params["experts_bytes_16bit"] and "loading" not in stock.plan.host


def test_qwen3_30b_a3b_loads_and_fits_2x24gb():
    """Issue 27: Qwen3-30B-A3B QLoRA on 2x24 GB is planned to load and train. The load peak is the 4-bit model whole
    (packed bytes, constants, 16-bit rest: the plan's per-GPU shards x 2) + one 16-bit weight + one layer's packed
    experts (stacked) + 1 GiB; a stock loader (16-bit experts on the GPU until packed) still does not fit."""
    d = diagnose(QWEN3_30B, accelerate_config="fsdp2_qlora", quantization="4bit", gpu_memory=24 * GB, num_gpus=2)
    assert d.plan.verdict == "fits" and d.plan.total < 16 * GB
    assert not d.errors
    shard, shape = d.plan.shard, d.shape
    whole = 2 * shard["params_quantized"] + shard["quant_state"] + 2 * shard["params_other"]
    one_weight = 2 * max([lin.numel for lin in shape.linears] + [e.expert_numel(n) for e in shape.experts
                                                                for n in e.weights])  # fmt: skip
    layer = max(sum(e.num_experts * e.expert_numel(n) // 2 for n in e.weights) for e in shape.experts)
    assert d.plan.load_peak_per_gpu == pytest.approx(whole + one_weight + layer + GB, abs=4)
    assert 17 * GB < d.plan.load_peak_per_gpu < 0.75 * 24 * GB
    stock = diagnose(QWEN3_30B, accelerate_config="fsdp2_qlora", quantization="4bit", gpu_memory=24 * GB, num_gpus=2,
                     trainer="transformers")  # fmt: skip
    assert "load-does-not-fit" in {f.id for f in stock.errors}
    assert "experts arrive in 16 bits" in next(f for f in stock.errors if f.id == "load-does-not-fit").problem


def test_8bit_plan_llama31_70b_2x80gb():
    """LoRA on an 8-bit Llama-3.1-70B on 2x80 GB: 1 byte per linear weight sharded 1/2, fp32 row scales whole on
    each GPU, 16-bit embeddings and head: fits; the stock load_in_8bit route stays refused."""
    settings = {"quantization": "8bit", "seq_len": 4096, "gpu_memory": 80 * GB}
    d = diagnose(LLAMA31_70B, accelerate_config="llama3_70b_2xa100_80gb", **settings)
    linear = sum(lin.numel for lin in d.shape.linears if lin.quantized)
    rows = sum(lin.out_features for lin in d.shape.linears if lin.quantized)
    assert d.plan.parts["base_quantized"] == linear // 2 and d.plan.parts["base_quant_state"] == 4 * rows
    assert 68e9 < linear < 69e9
    assert d.plan.verdict == "fits" and not d.errors
    assert {f.id: f.severity for f in d.findings}["8bit-under-fsdp"] == "info"
    four = diagnose(LLAMA31_70B, accelerate_config="llama3_70b_2xa100_80gb", **{**settings, "quantization": "4bit"})
    assert four.plan.total < d.plan.total < 0.9 * 80 * GB
    stock = diagnose(LLAMA31_70B, accelerate_config="llama3_70b_2xa100_80gb", trainer="transformers", **settings)
    assert "8bit-under-fsdp" in {f.id for f in stock.errors}


def test_8bit_setups_we_cannot_support(tiny, tiny_moe, tmp_path):
    """8 bits through our loader, our trainers (which convert a stock load_in_8bit model) or a checkpoint saved
    after 8-bit loading is a plan; Int8Params under a stock Trainer and 8 bits on an MoE model are errors."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    assert _ids(tiny / "llama", F2Q, "info", quantization="8bit") >= {"8bit-under-fsdp"}
    stock = AutoModelForCausalLM.from_pretrained(tiny / "llama", quantization_config=BitsAndBytesConfig(
        load_in_8bit=True))  # fmt: skip
    # our trainers and callback convert a stock load_in_8bit model (Int8Params) before wrapping: a plan
    found = {f.id: f for f in diagnose(stock, accelerate_config=F2Q).findings}
    assert found["8bit-under-fsdp"].severity == "info" and "bits=8" in found["8bit-under-fsdp"].message
    # a stock Trainer wraps the Int8Params as they are: refused, naming our route
    found = {f.id: f for f in diagnose(stock, accelerate_config=F2Q, trainer="transformers").findings}
    assert found["8bit-under-fsdp"].severity == "error" and "Int8Params" in found["8bit-under-fsdp"].problem
    assert "bits=8" in found["8bit-under-fsdp"].message
    # a checkpoint saved after 8-bit loading loads with load_qlora_model(path, bits=8): a plan too
    checkpoint = json.loads((tiny / "llama" / "config.json").read_text())
    checkpoint["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (tmp_path / "config.json").write_text(json.dumps(checkpoint))
    pre = diagnose(tmp_path, accelerate_config=F2Q)
    assert pre.setup.quantization == "8bit" and not pre.errors, pre.errors
    moe = diagnose(tiny_moe["qwen3_moe"], accelerate_config=F2Q, quantization="8bit")
    assert {f.id for f in moe.errors} == {"8bit-moe-experts"}
    assert "Qwen3MoeExperts" in moe.errors[0].problem
    assert not diagnose(tiny_moe["qwen3_moe"], accelerate_config=F2Q, quantization="4bit").errors


@pytest.mark.parametrize("compute", ["grouped", "loop"])
def test_moe_plan_counts_the_expert_weights_autograd_keeps(tiny_moe, compute):
    """Grouped (a weight's routed experts dequantized at once) or one expert at a time (the loop), autograd keeps
    every routed expert's 16-bit weight for the input gradient until backward: the plan's saved expert bytes equal
    what autograd really saves (saved-tensor hooks), and hold the grouped workspace."""
    import torch

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.doctor import model_shape
    from hf_fsdp_qlora.doctor.experts_plan import expert_bytes
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    model = load_qlora_model(str(tiny_moe["qwen3_moe"]), gradient_checkpointing=False)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    experts.compute = compute
    tokens, k, hidden = 64, model.config.num_experts_per_tok, model.config.hidden_size
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    index = torch.stack([torch.randperm(experts.num_experts, generator=torch.Generator().manual_seed(i))[:k]
                         for i in range(tokens)])  # fmt: skip
    weights = {tuple(experts.dequantize_expert(n, 0).shape) for n in experts.layout.weights}
    weights |= {s[::-1] for s in weights}  # F.linear saves the weight, `x @ w` its transpose
    saved = {}

    def keep(tensor):
        saved[tensor.data_ptr()] = tensor  # by storage: a tensor saved twice is held once
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        experts(x, index, torch.rand(tokens, k, dtype=torch.bfloat16))
    # The loop saves each expert's weight, grouped each weight's stack of routed experts ([k, *weight]; its 2-D
    # activations can share a weight's shape: 128 routed rows here).
    dim = 3 if compute == "grouped" else 2
    kept = sum(
        t.numel() * t.element_size() for t in saved.values() if t.dim() == dim and tuple(t.shape[-2:]) in weights
    )
    shape = model_shape(tiny_moe["qwen3_moe"])
    planned = expert_bytes(shape, quantized=True, double_quant=True, tokens=tokens)
    assert kept == planned.saved_numel * 2 > 0
    assert 0 < planned.grouped_numel < planned.saved_numel


def _tiny_dbrx(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    attention = {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}  # DBRX's defaults fail in transformers 5.23
    config = AutoConfig.for_model("dbrx", d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=256,
                                  attn_config=attention,
                                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def test_dbrx_experts_are_planned_and_loaded_4bit(tmp_path):
    """DBRX's experts (w1/v1/w2 of every expert stacked as 2-D matrices one module deeper) were refused; now the
    loader fuses them into transformers' layout (hf_fsdp_qlora/experts/dbrx.py) and packs them: the doctor plans
    them 4-bit, the packed bytes the loader holds (the oracle) within its plan."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts, packed_expert_bytes

    _tiny_dbrx(tmp_path)
    d = diagnose(tmp_path, accelerate_config=F2Q, quantization="4bit")
    assert not d.errors, [f.problem for f in d.errors]
    planned = d.plan.parameters
    model = load_qlora_model(str(tmp_path))
    families = {m.family for m in model.modules() if isinstance(m, QuantizedExperts)}
    assert families == {"DbrxFusedExperts"}
    assert 0 < packed_expert_bytes(model)[1] <= planned["experts_bytes"] < planned["experts_bytes_16bit"] / 3


def test_moe_family_we_cannot_quantize_is_an_error(tmp_path, monkeypatch):
    """An experts class that neither declares a layout through transformers' use_experts_implementation nor has a
    named entry (DBRX's own DbrxExperts, with the loader's fusing switched off): load_qlora_model refuses it (the
    real loader, the oracle) naming the module path and the tensors, and the doctor says so with the fix; with
    --no-quantize-experts it plans them 16-bit."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts import dbrx as dbrx_experts
    from hf_fsdp_qlora.errors import UnsupportedSetupError

    _tiny_dbrx(tmp_path)
    monkeypatch.setattr(dbrx_experts, "fuse_dbrx_experts", lambda model, copy_weights=True: [])
    with pytest.raises(UnsupportedSetupError, match=r"DbrxExperts at 'transformer\.blocks\.0\.ffn\.experts'"
                       r" .*mlp\.w1 \[128, 64\].*quantize_experts=False"):  # fmt: skip
        load_qlora_model(str(tmp_path))
    d = diagnose(tmp_path, accelerate_config=F2Q, quantization="4bit")
    assert {f.id for f in d.errors} == {"experts-not-quantizable"}
    assert "DbrxExperts" in d.errors[0].problem and "quantize_experts=False" in d.errors[0].message
    assert d.plan.parameters["experts_bytes"] == d.plan.parameters["experts_bytes_16bit"]
    assert not diagnose(tmp_path, accelerate_config=F2Q, quantization="4bit", quantize_experts=False).errors


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_count_and_refusals_match_peft(tiny_moe, arch):
    """LoRA on the experts (peft's target_parameters, trl's --lora_target_parameters): the planned trainable count
    equals peft's own on the 16-bit model (gpt-oss' transposed experts included); a dropout is refused and a name
    that matches nothing warned about, each with peft's own text (peft raises / warns it: the oracle)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.doctor import model_shape

    def peft_model(**kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_moe[arch])
        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], **kw))

    expected = sum(p.numel() for p in peft_model(target_parameters=EXPERT_TARGETS, lora_dropout=0.0).parameters()
                   if p.requires_grad)  # fmt: skip
    shape = model_shape(tiny_moe[arch], ["q_proj"])
    assert shape.lora_params(4) + shape.expert_lora_params(4, EXPERT_TARGETS) == expected
    settings = {"quantization": "4bit", "lora_r": 4, "lora_target_modules": ["q_proj"]}
    plain = diagnose(tiny_moe[arch], accelerate_config=F2Q, num_gpus=1, **settings).plan
    adapted = diagnose(tiny_moe[arch], accelerate_config=F2Q, num_gpus=1, lora_dropout=0.0,
                       lora_target_parameters=EXPERT_TARGETS, **settings)  # fmt: skip
    assert not adapted.errors
    assert adapted.plan.shard["params_trainable"] - plain.shard["params_trainable"] == 4 * (
        expected - shape.lora_params(4)
    )  # fmt: skip  (float32 master weights: 4 bytes each)
    with pytest.raises(ValueError) as real:
        peft_model(target_parameters=EXPERT_TARGETS, lora_dropout=0.05)
    found = diagnose(tiny_moe[arch], accelerate_config=F2Q, lora_target_parameters=EXPERT_TARGETS, **settings)
    assert {f.id for f in found.errors} == {"expert-lora-dropout"} and str(real.value) in found.errors[0].problem
    # A name that matches no expert weight: peft only warns, and trains without LoRA on the experts.
    with pytest.warns(RuntimeWarning) as real:
        peft_model(target_parameters=["mlp.experts.up_proj"], lora_dropout=0.0)
    found = {f.id: f for f in diagnose(tiny_moe[arch], accelerate_config=F2Q, lora_dropout=0.0,
                                       lora_target_parameters=["mlp.experts.up_proj"], **settings).findings}  # fmt: skip
    warned = [str(w.message) for w in real if "target_parameters" in str(w.message)]
    assert found["expert-lora-no-match"].severity == "warning" and "mlp.experts.up_proj" in warned[0]
    stable = warned[0].split("]", 1)[-1].split("}", 1)[-1]  # peft shows the targets as a list or a set
    assert stable == " were set but no parameter was matched." and stable in found["expert-lora-no-match"].problem
