"""Issue 35, defects 1-3, each reproduced with a tiny model of the family built from its transformers 5.23 config:

1. a Conv1d (any 3-D weight) was taken for mixture-of-experts weights (LFM2, Falcon-H1, Qwen3-Next refused);
2. ``merge-adapters --dequantize nf4`` round-tripped every 3-D tensor (LFM2's conv weight) instead of what training
   quantized;
3. ``target_modules="all-linear"`` put LoRA on the routed experts of MoE families with dense MLPs or shared experts.

Single-process, real bitsandbytes 4-bit and real peft; no hub.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from dist_utils import CONFIGS

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)  # fmt: skip
_LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    # dense, with a short convolution / a Mamba mixer (a Conv1d: a 3-D weight that is no experts). Falcon-H1
    # also stands for Bamba, Mamba2, Jamba's mixer, GraniteMoeHybrid's: the same Mamba2 mixer with its Conv1d.
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "falcon_h1": dict(
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16
    ),  # fmt: skip
    # MoE with a linear-attention Conv1d and shared experts
    "qwen3_next": dict(**_LINEAR_ATTENTION, **_MOE, shared_expert_intermediate_size=32),
    "qwen3_5_moe_text": dict(**_LINEAR_ATTENTION, **_MOE, shared_expert_intermediate_size=32),
    # MoE with dense layers / shared experts
    "deepseek_v3": dict(
        **_MOE,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),  # fmt: skip
    "qwen3_moe_dense": dict(**_MOE, mlp_only_layers=[0]),
    # an MoE whose experts class is not in the table: refused by name
    "jamba": dict(
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
    ),  # fmt: skip
}


def tiny_family_config(family: str):
    """The family's config class, shrunk (only keys the class knows are set)."""
    from transformers import AutoConfig

    model_type = {"qwen3_moe_dense": "qwen3_moe"}.get(family, family)
    extra = FAMILIES[family]
    known = AutoConfig.for_model(model_type).to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in known}
    return AutoConfig.for_model(model_type, **kwargs, **extra)


def build_family(root: Path, family: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    path = root / family
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_family_config(family), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return lambda family: build_family(root, family)


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **kw})


def _conv_weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d)}


# ------------------------------------------------------------------------------------------------ defect 1


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1", "qwen3_next", "qwen3_5_moe_text"])
def test_a_conv1d_is_no_experts(families, family):
    """Before: UnsupportedSetupError "... holds mixture-of-experts weights as 3-D parameters ['weight']" at the
    Conv1d. Now the dense families load with no experts swapped, the MoE ones with their experts in 4 bits, and
    every Conv1d is still a 16-bit Conv1d."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    # q/v only: peft itself refuses LoRA on a Mamba mixer's out_proj ("incompatible with Mamba-based models").
    lora = _lora(target_modules=["q_proj", "v_proj"])
    model = load_qlora_model(str(families(family)), lora_config=lora, gradient_checkpointing=False)
    swapped = [n for n, m in model.named_modules() if isinstance(m, QuantizedExperts)]
    moe = family in ("qwen3_next", "qwen3_5_moe_text")
    assert (len(swapped) == 2) if moe else (swapped == []), swapped
    convs = _conv_weights(model)
    assert convs and all(w.dtype == torch.bfloat16 and w.dim() == 3 for w in convs.values())


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1", "qwen3_next"])
def test_doctor_plans_conv_families(families, family):
    """Before: LFM2 and Falcon-H1 gave `experts-not-quantizable` (their Conv1d read as experts). Now a plan, and the
    experts counted are the real ones only (Qwen3-Next: its 2 experts modules, quantizable)."""
    from hf_fsdp_qlora.doctor import diagnose
    from hf_fsdp_qlora.model_shapes import model_shape

    config = yaml.safe_load((CONFIGS / "fsdp2_qlora.yaml").read_text())
    d = diagnose(str(families(family)), accelerate_config=config, quantization="4bit", lora_r=4)
    assert "experts-not-quantizable" not in {f.id for f in d.findings}, [f.problem for f in d.errors]
    assert d.plan is not None
    shape = model_shape(families(family) / "config.json")
    assert [(e.family, e.quantizable) for e in shape.experts] == ([("Qwen3NextExperts", True)] * 2 if family ==
                                                                  "qwen3_next" else [])  # fmt: skip


def test_declared_experts_class_is_quantized_beside_conv1d(families):
    """Jamba's experts (JambaExperts: refused by class name before issue 48, declared through transformers'
    use_experts_implementation) load in 4 bits; its Mamba Conv1d is no expert and stays as it was."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    model = load_qlora_model(str(families("jamba")), lora_config=_lora(lora_dropout=0.0))
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantizedExperts)]
    assert quantized == ["base_model.model.model.layers.1.feed_forward.experts"], quantized
    assert _conv_weights(model) and all(w.dim() == 3 and w.is_floating_point() for w in _conv_weights(model).values())


# ------------------------------------------------------------------------------------------------ defect 3


def _lora_homes(model) -> tuple[set[str], list[str]]:
    """(modules holding a LoRA on a linear layer, peft ParamWrappers), by base-model name."""
    linear, wrappers = set(), []
    for name, module in model.get_base_model().named_modules():
        if type(module).__name__ == "ParamWrapper":
            wrappers.append(name)
        elif hasattr(module, "lora_A") and isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
            linear.add(name)
    return linear, wrappers


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe_dense", "qwen3_next"])
@pytest.mark.parametrize("quantize_experts", [True, False])
def test_all_linear_means_the_linear_layers(families, family, quantize_experts):
    """Before: peft's v4->v5 conversion mapped the dense MLP's / shared experts' gate_proj, up_proj, down_proj onto
    the routed experts' fused parameters, and the default LoraConfig (dropout 0.05) failed with "lora.ParamWrapper
    does not work with lora_dropout != 0". Now LoRA sits on exactly the nn.Linear layers (the output head aside),
    peft's own all-linear rule on the 16-bit model, and on no expert parameter."""
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora import load_qlora_model

    path = families(family)
    model = load_qlora_model(str(path), lora_config=_lora(lora_dropout=0.05), quantize_experts=quantize_experts,
                             gradient_checkpointing=False)  # fmt: skip
    linear, wrappers = _lora_homes(model)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    head = base.get_output_embeddings()
    expected = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    assert wrappers == []
    assert linear == expected, (sorted(linear - expected), sorted(expected - linear))
    assert any(".shared_expert" in n or ".mlp.gate_proj" in n for n in expected)  # the case that went wrong
    assert isinstance(model.base_model, BaseTuner)


def test_stock_peft_moves_linear_targets_onto_experts(families):
    """Canary (hf_fsdp_qlora._compat: peft_v5_moe_target_remap): stock peft, given the dense layers' linear names,
    moves them onto the routed experts' fused parameters. When this fails, peft stopped doing so: drop
    keep_linear_targets."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(families("deepseek_v3"), dtype=torch.bfloat16)
    config = LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_a_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    assert {"gate_up_proj", "down_proj"} <= set(config.target_parameters)
    wrapped = [n for n, m in peft_model.named_modules() if type(m).__name__ == "ParamWrapper"]
    dense = [n for n, m in peft_model.named_modules() if n.endswith("layers.0.mlp.gate_proj") and hasattr(m, "lora_A")]
    assert wrapped and not dense  # the routed experts got the LoRA, the dense layer-0 MLP none


# ------------------------------------------------------------------------------------------------ defect 2


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1"])
def test_merge_round_trips_what_training_quantized(families, family, tmp_path):
    """Before: `merge-adapters --dequantize nf4` wrote every 3-D float tensor as its NF4 round trip (LFM2's
    conv.conv.weight changed in 126 of 192 elements). Now the adapter carries the loader's record (peft's
    save_pretrained and our FSDP save path both write it), the merge round-trips exactly the recorded tensors, and
    without a record (stock peft) it falls back to transformers' rule: the Conv1d weights stay byte-identical."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.merge import merge_adapters
    from hf_fsdp_qlora.quant_record import RECORD_NAME, read_record
    from hf_fsdp_qlora.train.checkpoint import save_adapter

    base = families(family)
    model = load_qlora_model(str(base), lora_config=_lora(target_modules=["q_proj", "v_proj"]),
                             gradient_checkpointing=False)  # fmt: skip
    with torch.no_grad():  # a non-zero update, so the merge changes the targeted weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "peft")
    save_adapter(model, tmp_path / "ours", is_main_process=True)
    record = read_record(tmp_path / "peft")
    assert record == read_record(tmp_path / "ours") is not None
    # Oracle for the record: bitsandbytes quantized every nn.Linear but the output head (transformers' rule).
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    head = dense.get_output_embeddings()
    linear = {f"{n}.weight" for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    assert (record.bits, record.quant_type, record.double_quant, record.blocksize) == (4, "nf4", True, 64)
    assert set(record.linear) == linear and record.experts == []

    source = _tensors(base)
    convs = [k for k in source if k in {f"{n}.weight" for n in _conv_weights(dense)}]
    assert convs
    for adapter in ("peft", "ours", "stock"):
        if adapter == "stock":  # the same adapter as stock peft writes it: no record
            (tmp_path / "peft" / RECORD_NAME).unlink()
            adapter = "peft"
        dq = {"double_quant": True} if not (tmp_path / adapter / RECORD_NAME).exists() else {}
        out = merge_adapters(base, tmp_path / adapter, tmp_path / f"merged_{adapter}", dequantize="nf4",
                             progress=False, force=True, **dq)  # fmt: skip
        merged = _tensors(out)
        for key in convs:  # never quantized in training: byte for byte
            assert torch.equal(merged[key].view(torch.uint8), source[key].view(torch.uint8)), key
        changed = {k for k in source if not torch.equal(merged[k], source[k])}
        assert changed == linear, (sorted(changed - linear), sorted(linear - changed))


def test_merge_follows_the_record_of_an_moe(families, tmp_path):
    """Qwen3-Next (experts in 4 bits, a linear-attention Conv1d): the record names the experts' fused weights, the
    merge with it equals the merge by transformers' rule and the experts table (same bytes), and a `dequantize`
    other than the recorded quant type is refused by name."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.errors import MergeUsageError
    from hf_fsdp_qlora.merge import merge_adapters
    from hf_fsdp_qlora.quant_record import RECORD_NAME, read_record

    base = families("qwen3_next")
    model = load_qlora_model(str(base), lora_config=_lora(target_modules=["q_proj"]), gradient_checkpointing=False)
    model.save_pretrained(tmp_path / "adapter")
    record = read_record(tmp_path / "adapter")
    assert record.experts == [
        f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")
    ]
    with pytest.raises(MergeUsageError, match=r"records a nf4 base .*dequantize='nf4'"):
        merge_adapters(base, tmp_path / "adapter", tmp_path / "fp4", dequantize="fp4", progress=False)
    recorded = _tensors(merge_adapters(base, tmp_path / "adapter", tmp_path / "a", dequantize="nf4", progress=False))
    (tmp_path / "adapter" / RECORD_NAME).unlink()
    by_rule = _tensors(merge_adapters(base, tmp_path / "adapter", tmp_path / "b", dequantize="nf4",
                                      double_quant=True, progress=False))  # fmt: skip
    source = _tensors(base)
    assert recorded.keys() == by_rule.keys() == source.keys()
    assert all(torch.equal(recorded[k], by_rule[k]) for k in source)
    conv = [k for k in source if k.endswith("conv1d.weight")]
    assert conv and all(torch.equal(recorded[k], source[k]) for k in conv)
    assert any("experts" in k and not torch.equal(recorded[k], source[k]) for k in source)


def test_trainer_checkpoint_and_final_save_carry_the_record(families, tmp_path):
    """One training step without FSDP (Trainer saves through peft's save_pretrained): its checkpoint and its final
    save both hold the record, equal to the model's. (Under FSDP our save_adapter writes it: the merge test above.)"""
    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
    from hf_fsdp_qlora.quant_record import RECORD_ATTR, read_record

    model = load_qlora_model(str(families("lfm2")), lora_config=_lora(target_modules=["q_proj"]),
                             gradient_checkpointing=False)  # fmt: skip
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    args = FSDPQLoRATrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, save_strategy="steps",
                                      save_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True)  # fmt: skip
    trainer = FSDPQLoRATrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    expected = getattr(model, RECORD_ATTR)
    assert expected.linear
    assert read_record(tmp_path / "out" / "checkpoint-1") == read_record(tmp_path / "final") == expected


def test_convert_keeps_the_record(families, tmp_path):
    """`hf-fsdp-qlora convert` writes adapters with write_adapter_files: the record goes along, unchanged."""
    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.merge.adapter_io import load_adapter, write_adapter_files
    from hf_fsdp_qlora.quant_record import read_record

    model = load_qlora_model(str(families("lfm2")), lora_config=_lora(target_modules=["q_proj"]),
                             gradient_checkpointing=False)  # fmt: skip
    model.save_pretrained(tmp_path / "adapter")
    write_adapter_files(load_adapter(tmp_path / "adapter"), tmp_path / "converted")
    assert read_record(tmp_path / "converted") == read_record(tmp_path / "adapter") is not None
