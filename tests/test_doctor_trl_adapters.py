"""trl's SFTTrainer casts a quantized model's adapters to bfloat16 in ``__init__`` whatever ``--dtype`` says; under
trl's ``sft.py --dtype float32`` the doctor (run on the live model at launch, hf_fsdp_qlora.train.consistency) must
name that cast and a fix an unchanged script can take (trl's own ``--dtype``), not peft's
``autocast_adapter_dtype`` (which only ever upcasts to float32) and not a ``get_peft_model`` argument the script
cannot pass.

One process, the installed trl's SFTTrainer built from sft.py's own parser on the tiny Llama (NF4, uint8 storage).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def trl_model(shared_models, tmp_path_factory):
    """trl's SFTTrainer's model for `sft.py --use_peft --load_in_4bit --dtype float32` (after its __init__)."""
    from accelerate.state import AcceleratorState, GradientState
    from datasets import Dataset
    from trl import SFTTrainer, get_peft_config, get_quantization_config
    from trl.scripts.sft import make_parser

    model = build_tiny_model(shared_models / "llama", "llama")
    out = tmp_path_factory.mktemp("trl_f32")
    argv = ["--model_name_or_path", str(model), "--dataset_name", "unused", "--use_peft", "--load_in_4bit",
            "--dtype", "float32", "--output_dir", str(out), "--use_cpu", "True", "--report_to", "none"]  # fmt: skip
    _, args, model_args, _ = make_parser().parse_args_and_config(argv, fail_with_unknown_args=False)
    args.model_init_kwargs = {"dtype": model_args.dtype}  # what sft.py passes
    try:
        trainer = SFTTrainer(
            model=str(model), args=args, train_dataset=Dataset.from_dict({"text": ["t3 t4 t5"]}),
            quantization_config=get_quantization_config(model_args), peft_config=get_peft_config(model_args),
        )  # fmt: skip
        return trainer.model, args
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _adapter_finding(model, **settings):
    from hf_fsdp_qlora.doctor import diagnose

    found = [f for f in diagnose(model, **settings).findings if f.id.endswith("-adapters")]
    assert len(found) == 1, found
    return found[0]


def test_trl_casts_the_adapters_to_bf16_beside_a_float32_base(trl_model):
    """The premise, from the installed trl: bf16 LoRA beside the float32 non-quantized weights."""
    model, _ = trl_model
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    assert trainable == {torch.bfloat16} and torch.float32 in frozen


@pytest.mark.parametrize("config", ["fsdp2_qlora", "fsdp1_qlora"])
def test_ours_names_trls_cast_and_a_flag_the_script_takes(trl_model, config):
    """Our trainer: an info naming trl's cast and trl's --dtype; it trains them as float32 master weights."""
    from hf_fsdp_qlora.dtypes import training_dtype
    from hf_fsdp_qlora.train.precision import adapter_dtype_for

    model, args = trl_model
    finding = _adapter_finding(model, accelerate_config=config)
    assert finding.severity == "info", finding
    assert "autocast_adapter_dtype" not in finding.message, finding.message
    assert "trl's SFTTrainer" in finding.problem and "--dtype" in finding.setting, finding
    assert "float32" in finding.problem  # what it trains them as, which is what precision.py does:
    assert adapter_dtype_for(args, training_dtype(model)) == torch.float32


def test_stock_fsdp1_error_names_trls_cast_and_its_dtype_flag(trl_model):
    """The stock Trainer under FSDP1 fails on one unit of two dtypes: the fix is trl's --dtype bfloat16 (the base
    in the dtype trl casts the adapters to), which sft.py takes unchanged."""
    model, _ = trl_model
    finding = _adapter_finding(model, accelerate_config="fsdp1_qlora", trainer="transformers")
    assert finding.severity == "error", finding
    assert "autocast_adapter_dtype" not in finding.message, finding.message
    assert "trl's SFTTrainer" in finding.problem and finding.setting.startswith("--dtype"), finding
    assert finding.value.startswith("bfloat16"), finding
