"""docs/hyperparameters.md quotes the installed defaults it builds on (trl's configs, our default LoRA): they
cannot drift from the code."""

from __future__ import annotations

from dist_utils import REPO

PAGE = REPO / "docs" / "hyperparameters.md"


def test_quoted_defaults_are_the_installed_ones():
    from trl import DPOConfig, GRPOConfig, ModelConfig, SFTConfig

    from hf_fsdp_qlora.loading.qlora import default_lora_config

    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    fields = {name: field.default for name, field in SFTConfig.__dataclass_fields__.items()}
    assert fields["learning_rate"] == 2e-5 and "`SFTConfig` default: 2e-5" in text
    dpo = DPOConfig.__dataclass_fields__
    assert (dpo["learning_rate"].default, dpo["beta"].default) == (1e-6, 0.1) and "defaults: 1e-6, 0.1" in text
    assert GRPOConfig.__dataclass_fields__["learning_rate"].default == 1e-6
    assert "`GRPOConfig` default for a full run: 1e-6" in text
    model = {name: field.default for name, field in ModelConfig.__dataclass_fields__.items()}
    assert (model["lora_r"], model["lora_alpha"], model["lora_dropout"]) == (16, 32, 0.05)
    assert "(`lora_r` 16, `lora_alpha` 32, `lora_dropout` 0.05" in text
    ours = default_lora_config()
    assert (ours.r, ours.target_modules) == (16, "all-linear") and "default LoRA is r 16 on every linear layer" in text
