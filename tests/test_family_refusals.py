"""What the family sweep (tests/test_families.py) found beyond the review's seven, where a refusal by name is the
fix: asked-for checkpointing on a class that cannot checkpoint, LoRA named on a layer its forward never runs, and an
encoder family configured as an encoder. Tiny models from tests/family_build.py; the loader and the doctor agree."""

from __future__ import annotations

import pytest
import torch
from family_build import build
from peft import LoraConfig

from hf_fsdp_qlora.doctor.checks import diagnose
from hf_fsdp_qlora.errors import SetupInputError, UnsupportedSetupError
from hf_fsdp_qlora.loading.qlora import load_qlora_model


def _lora(targets):
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def xlnet(tmp_path_factory):
    return build("xlnet", tmp_path_factory.mktemp("xlnet") / "base")


def test_checkpointing_asked_for_on_xlnet_is_refused_by_name_by_loader_and_doctor(xlnet, monkeypatch):
    """transformers raises a raw "does not support activation checkpointing" there; we refuse first, naming it."""
    import transformers

    read = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: read.append(a) or pytest.fail("weights read before the refusal"),
    )
    with pytest.raises(
        UnsupportedSetupError, match=r"XLNetLMHeadModel \(model type 'xlnet'\).*gradient_checkpointing"
    ):
        load_qlora_model(xlnet, gradient_checkpointing=True, lora_config=_lora("all-linear"))
    monkeypatch.undo()
    for asked in ({"gradient_checkpointing": True}, {"model_checkpointing": True}):
        errors = [f for f in diagnose(str(xlnet), quantization="4bit", seq_len=128, **asked).errors]
        assert [f.id for f in errors] == ["checkpointing-unsupported"] and "'xlnet'" in errors[0].message, errors
    assert not diagnose(str(xlnet), quantization="4bit", seq_len=128).errors  # not asked for: plans (no limit: -1)


def test_checkpointing_left_default_loads_xlnet_without_it(xlnet):
    model = load_qlora_model(xlnet, dtype=torch.bfloat16, lora_config=_lora("all-linear"))
    assert not model.base_model.model.is_activation_checkpointing


def test_lora_named_on_mambas_dt_proj_is_refused(tmp_path):
    """Mamba's forward reads dt_proj.weight directly: a LoRA there would never train (all-linear leaves it out)."""
    path = build("mamba", tmp_path / "base")
    with pytest.raises(UnsupportedSetupError, match=r"\['dt_proj'\] of this 'mamba' model.*reads dt_proj.weight"):
        load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora(["in_proj", "dt_proj"]))
    model = load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora("all-linear"))
    names = [n for n, _ in model.named_modules()]
    assert not any("dt_proj.lora_" in n for n in names) and any("x_proj.lora_A" in n for n in names)
    dt_proj = model.base_model.model.backbone.layers[0].mixer.dt_proj
    assert type(dt_proj) is torch.nn.Linear  # kept 16-bit: its weight is read as is


def test_encoder_family_is_refused_by_name_by_loader_and_doctor(tmp_path):
    path = build("roberta", tmp_path / "base")
    with pytest.raises(UnsupportedSetupError, match=r"'roberta' model .*no causal-LM head.*is_decoder"):
        load_qlora_model(path, lora_config=_lora("all-linear"))
    with pytest.raises(SetupInputError, match=r"'roberta' model .*no causal-LM head.*is_decoder"):
        diagnose(str(path), quantization="4bit")
