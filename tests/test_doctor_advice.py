"""The `memory-does-not-fit` advice follows the plan's largest terms: each lever it names, its bytes saved and the
order are checked against the doctor's own plan of the run with that one setting changed (planned here through the
public `diagnose`, independently of hf_fsdp_qlora/doctor/advice.py), on one run whose activations dominate and one
whose weights, gradients and optimizer states dominate. No byte figure is written down here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from hf_fsdp_qlora.doctor import diagnose
from hf_fsdp_qlora.doctor.memory import format_size, verdict
from hf_fsdp_qlora.doctor.terms import TERMS

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
GB = 2**30
ACTIVATION_TERMS = {"activations", "logits_loss"}
WEIGHT_TERMS = {row.name for row in TERMS if row.offloadable}  # weights, adapter, gradients, optimizer states
_ADVICE = re.compile(r"(\S+) -> (\S+) saves (\d+\.\d\d GiB) \((\d+\.\d\d GiB) per GPU: ([a-z ]+?)[,)]")
_TOGETHER = re.compile(r"the first (\d) together: (\d+\.\d\d GiB) per GPU \(([a-z ]+)\)")

# One run per kind: (model config, accelerate config, settings).
ACTIVATIONS = ("llama3_1_8b_config.json", "fsdp2_qlora",
               dict(quantization="4bit", num_gpus=1, seq_len=32768, batch_size=2, gpu_memory=16 * GB))  # fmt: skip
WEIGHTS = ("llamaguard3_1b_config.json", "fsdp2_qlora",
           dict(full_finetune=True, num_gpus=1, seq_len=4096, gpu_memory=24 * GB))  # fmt: skip


def _config(name: str, **fsdp_changes) -> dict:
    config = copy.deepcopy(yaml.safe_load((REPO / "accelerate_configs" / f"{name}.yaml").read_text()))
    config["fsdp_config"].update(fsdp_changes)
    return config


def _replanned(run, setting: str, value: str):
    """The doctor's plan of `run` with one setting changed as the advice names it (or None: not a lever here)."""
    model, config, settings = run
    fsdp, changed = {}, dict(settings)
    if setting == "fsdp_config.fsdp_offload_params":
        fsdp["fsdp_offload_params"] = value == "true"
    elif setting == "fsdp_config.fsdp_activation_checkpointing":
        fsdp["fsdp_activation_checkpointing"] = value == "true"
    elif setting.endswith(".activation_offloading"):
        changed["activation_offloading"] = value == "True"
    elif setting == "max_length":
        changed["seq_len"] = int(value)
    elif setting == "per_device_train_batch_size":
        changed["batch_size"] = int(value)
    elif setting == "num_processes":
        changed["num_gpus"] = int(value)
    elif setting == "load_qlora_model":
        changed["quantize_experts"] = value == "quantize_experts=True"
    elif setting == "FSDPQLoRATrainingArguments.loss_chunk_size":
        changed["loss_chunk_size"] = int(value)
    else:
        raise AssertionError(f"the advice names a setting this test does not know: {setting}")
    return fsdp, changed


def _plan(run, fsdp: dict, settings: dict):
    model, config, _ = run
    return diagnose(DATA / model, accelerate_config=_config(config, **fsdp), **settings).plan


def _finding(run):
    model, config, settings = run
    d = diagnose(DATA / model, accelerate_config=config, **settings)
    (finding,) = [f for f in d.findings if f.id == "memory-does-not-fit"]
    return d.plan, finding


def _share(plan, names: set[str]) -> int:
    return sum(t["bytes"] for t in plan.terms if t["name"] in names)


def _check_levers(run):
    """Every lever the advice names saves what the doctor's plan of the changed run says, largest first."""
    plan, finding = _finding(run)
    levers = _ADVICE.findall(finding.problem)
    assert levers, finding.problem
    saved = []
    for setting, value, saves, total, fits in levers:
        changed = _plan(run, *_replanned(run, setting, value))
        assert format_size(plan.total - changed.total) == saves, (setting, finding.problem)
        assert (
            format_size(changed.total) == total and verdict(changed.total, plan.gpu_memory).replace("_", " ") == fits
        )
        saved.append(plan.total - changed.total)
    assert saved == sorted(saved, reverse=True), finding.problem
    assert (finding.setting, finding.value.split(" (")[0]) == levers[0][:2]
    return plan, finding, levers


def test_activation_dominated_run_is_advised_activation_levers():
    plan, finding, levers = _check_levers(ACTIVATIONS)
    assert _share(plan, ACTIVATION_TERMS) > _share(plan, WEIGHT_TERMS)  # the setup is what its name says
    settings = [setting for setting, *_ in levers]
    assert finding.setting in ("max_length", "per_device_train_batch_size",
                               "FSDPQLoRATrainingArguments.activation_offloading")  # fmt: skip
    assert "fsdp_config.fsdp_offload_params" not in settings[:2], finding.problem
    # Each activation lever this run has (checkpointing is already on in fsdp2_qlora) is weighed.
    assert {"max_length", "per_device_train_batch_size", "FSDPQLoRATrainingArguments.activation_offloading"} <= set(
        settings
    ), finding.problem
    # The shorter sequence is the longest length whose plan fits (doctor --longest's search), not a guess.
    assert finding.setting == "max_length", finding.problem
    length = int(finding.value.split(" (")[0])
    assert verdict(_plan(ACTIVATIONS, {}, {**ACTIVATIONS[2], "seq_len": length}).total, plan.gpu_memory) == "fits"
    assert verdict(_plan(ACTIVATIONS, {}, {**ACTIVATIONS[2], "seq_len": length + 1}).total, plan.gpu_memory) != "fits"


def test_levers_that_fit_only_together_are_planned_as_one_run():
    """No single lever fits (the weights run on 6 GB): the advice gives the first levers that fit together, planned
    here as one run."""
    run = (WEIGHTS[0], WEIGHTS[1], {**WEIGHTS[2], "gpu_memory": 6 * GB})
    plan, finding, levers = _check_levers(run)
    count, together, fits = _TOGETHER.search(finding.problem).groups()
    fsdp, changed = {}, dict(run[2])
    for setting, value, *_ in levers[: int(count)]:
        more_fsdp, more = _replanned(run, setting, value)
        fsdp.update(more_fsdp)
        changed.update({k: v for k, v in more.items() if v != run[2].get(k)})
    combined = _plan(run, fsdp, changed)
    assert format_size(combined.total) == together and fits == "fits" == verdict(combined.total, plan.gpu_memory)


def test_weight_dominated_run_is_advised_parameter_offload_or_more_gpus():
    plan, finding, levers = _check_levers(WEIGHTS)
    assert _share(plan, WEIGHT_TERMS) > _share(plan, ACTIVATION_TERMS)
    assert [setting for setting, *_ in levers[:2]] == ["fsdp_config.fsdp_offload_params", "num_processes"]
    assert finding.setting == "fsdp_config.fsdp_offload_params" and finding.value == "true"
    assert "together" not in finding.problem  # parameter offload fits alone


@pytest.mark.parametrize("run", [ACTIVATIONS, WEIGHTS], ids=["activations", "weights"])
def test_the_advice_applied_fits_or_shrinks(run):
    """The finding's own setting, applied, gives the total the advice quotes for it."""
    plan, finding = _finding(run)
    fsdp, changed = _replanned(run, finding.setting, finding.value.split(" (")[0])
    after = _plan(run, fsdp, changed)
    assert after.total < plan.total
    assert f"saves {format_size(plan.total - after.total)}" in finding.problem


def _jetmoe(tmp_path):
    """A small JetMoE (its transformers class: supports_gradient_checkpointing=False) as a config.json."""
    import json

    from transformers import JetMoeConfig

    config = JetMoeConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, kv_channels=128,
                          intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                          max_position_embeddings=65536)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path / "config.json"


def test_no_checkpointing_advice_a_family_cannot_take(tmp_path):
    """JetMoE without FSDP: the Trainer's activation checkpointing raises for it (checked here), so neither
    activation-checkpointing-off nor a lever advises it; the run is told it does not fit, with the other levers.
    Under FSDP, FSDP's checkpointing (torch's checkpoint wrapper on each layer) works for it - the same gradients,
    checked here - and stays advised."""
    import copy

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import JetMoeConfig, JetMoeForCausalLM

    small = JetMoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, kv_channels=8,
                         intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    model = JetMoeForCausalLM(small).train()
    with pytest.raises(ValueError, match="does not support activation checkpointing"):
        copy.deepcopy(model).gradient_checkpointing_enable()
    wrapped = copy.deepcopy(model)
    for i, layer in enumerate(wrapped.model.layers):  # what accelerate's FSDP activation checkpointing applies
        wrapped.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (model, wrapped):
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in wrapped.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0)

    config = _jetmoe(tmp_path)
    plain = diagnose(config, quantization="4bit", seq_len=32768, gpu_memory=16 * GB, num_gpus=1)
    ids = {f.id: f for f in plain.findings}
    assert plain.shape.checkpointing is False and plain.plan.checkpointing == "none"
    assert "activation-checkpointing-off" not in ids, ids
    advice = ids["memory-does-not-fit"]
    assert "activation_checkpointing" not in advice.problem and "activation_checkpointing" not in advice.setting
    fsdp = diagnose(config, accelerate_config=_config("fsdp2_qlora", fsdp_activation_checkpointing=False),
                    quantization="4bit", seq_len=32768, gpu_memory=16 * GB, num_gpus=1)  # fmt: skip
    off = [f for f in fsdp.findings if f.id == "activation-checkpointing-off"]
    assert [f.setting for f in off] == ["fsdp_config.fsdp_activation_checkpointing"], fsdp.findings
