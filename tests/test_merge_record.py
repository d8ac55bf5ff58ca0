"""Issue 49, row 7: `merge-adapters --dequantize nf4` of an adapter trained on a base that transformers loaded in NF4
WITHOUT double quant (`BitsAndBytesConfig`'s and trl's `--load_in_4bit` default), not by `load_qlora_model`.

Before: no quantization record travelled with such an adapter and the merge assumed double quant: ~90% of the merged
elements of a float32 tiny Llama differed from the weights training saw plus peft's update (8.3% of a bf16 `q_proj`
in the issue). Now our callback keeps the live model's record and every save writes it; an adapter without one
is refused by a 4-bit merge unless `--double-quant` / `--no-double-quant` says which round trip training saw.

One process, a stock `transformers.Trainer` with `FSDPQLoRACallback` (FSDP is not the point: the record and the
merge are; the FSDP saves of trl's sft.py carry the record too, tests/test_recipes.py), float32 so the merge is
compared with peft's own merge element for element.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.main import main as cli_main
from hf_fsdp_qlora.quant_record import RECORD_NAME

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(16-bit base, run folder, {name: the dequantized 4-bit weight training saw}) of 2 steps of a stock Trainer
    with our callback on a base loaded with from_pretrained(quantization_config=nf4, no double quant)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRACallback

    root = tmp_path_factory.mktemp("merge_record")
    base = build_tiny_model(root / "llama", "llama", dtype=torch.float32)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                               bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=quant)
    seen = {  # read before any forward (a CPU forward may repack the 4-bit weights in place)
        f"{name}.weight": bnb_f.dequantize_4bit(module.weight.data, module.weight.quant_state).clone()
        for name, module in model.named_modules()
        if isinstance(module, bnb.nn.Linear4bit)
    }
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    ids = torch.randint(3, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(str(root / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             save_steps=1, report_to="none", use_cpu=True)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FSDPQLoRACallback()])
    trainer.train()
    trainer.save_model(str(root / "out"))
    return base, root / "out", seen


def _oracle(base, adapter, seen):
    """peft's own merge of `adapter` into the weights training saw."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(seen, strict=False)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def _merge(base, adapter, out, *flags):
    argv = ["merge", "--base", str(base), "--adapter", str(adapter), "--output", str(out), "--no-progress"]
    return cli_main([*argv, "--dequantize", "nf4", *flags])


def _differing(ours: dict, ref: dict) -> dict:
    """{name: fraction of elements that differ} of the merged linear weights."""
    return {k: (ours[k] != ref[k]).float().mean().item() for k in ours if k.endswith("_proj.weight")}


def test_every_save_carries_the_live_models_record(run):
    """Before: the final save and the checkpoints of a base loaded by transformers had no record."""
    _, out, seen = run
    for folder in (out, out / "checkpoint-1", out / "checkpoint-2"):
        record = json.loads((folder / RECORD_NAME).read_text())
        assert (record["bits"], record["quant_type"], record["double_quant"], record["blocksize"]) == (
            4, "nf4", False, 64
        ), folder  # fmt: skip
        assert record["linear"] == sorted(seen) and record["experts"] == [], folder  # lm_head stays 16-bit


def test_dequantize_nf4_equals_peft_merge_on_the_weights_training_saw(run, tmp_path, capsys):
    """Before: 0.9 of the merged q_proj elements differed (double quant assumed); now 0, by the record alone."""
    base, out, seen = run
    ref = _oracle(base, out, seen)
    assert _merge(base, out, tmp_path / "merged") == 0
    ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
    differing = _differing(ours, ref)
    assert len(differing) == 14 and all(v == 0 for v in differing.values()), differing
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    # A checkpoint's adapter too (its own record).
    ref1 = _oracle(base, out / "checkpoint-1", seen)
    assert _merge(base, out / "checkpoint-1", tmp_path / "merged1") == 0
    ours1 = load_file(str(tmp_path / "merged1" / "model.safetensors"))
    assert all(torch.equal(ours1[k], ref1[k]) for k in ref1)
    # Flags that contradict the record are refused, naming it.
    capsys.readouterr()
    assert _merge(base, out, tmp_path / "bad", "--double-quant") == 2
    assert f"--double-quant contradicts {out / RECORD_NAME}" in capsys.readouterr().err


def test_without_a_record_a_4bit_merge_asks_which_round_trip(run, tmp_path, capsys):
    """Before: an adapter without a record was merged onto the double-quant round trip, silently."""
    base, out, seen = run
    stock = tmp_path / "stock"  # as stock peft saves it: no record
    stock.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / name, stock / name)
    ref = _oracle(base, stock, seen)
    capsys.readouterr()
    assert _merge(base, stock, tmp_path / "refused") == 2
    err = capsys.readouterr().err
    assert RECORD_NAME in err and "--no-double-quant" in err and "--double-quant" in err, err
    assert not (tmp_path / "refused").exists()
    assert _merge(base, stock, tmp_path / "nodq", "--no-double-quant") == 0
    ours = load_file(str(tmp_path / "nodq" / "model.safetensors"))
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert _merge(base, stock, tmp_path / "dq", "--double-quant") == 0  # the other round trip: not training's
    wrong = _differing(load_file(str(tmp_path / "dq" / "model.safetensors")), ref)
    assert min(wrong.values()) > 0.5, wrong


def test_a_prequantized_base_named_by_the_adapter_tells_the_settings(run, tmp_path, capsys):
    """No record, but adapter_config.json names a local pre-quantized checkpoint (nf4, no double quant): its
    quantization_config decides (the merge equals the one with --no-double-quant), and contradicting it is refused."""
    from tiny_models import build_prequantized

    base, out, _ = run
    prequantized = build_prequantized(tmp_path / "bnb4", "nf4", False, source=base)
    stock = tmp_path / "stock"
    stock.mkdir()
    shutil.copy(out / "adapter_model.safetensors", stock / "adapter_model.safetensors")
    config = json.loads((out / "adapter_config.json").read_text())
    (stock / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(prequantized)}))
    assert _merge(base, stock, tmp_path / "told") == 0
    assert _merge(base, stock, tmp_path / "by_hand", "--no-double-quant") == 0
    told, by_hand = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("told", "by_hand"))
    assert told.keys() == by_hand.keys() and all(torch.equal(told[k], by_hand[k]) for k in told)
    capsys.readouterr()
    assert _merge(base, stock, tmp_path / "bad", "--double-quant") == 2
    assert f"quantization_config of {prequantized / 'config.json'}" in capsys.readouterr().err
    argv = ["merge", "--base", str(base), "--adapter", str(stock), "--output", str(tmp_path / "fp4"), "--no-progress"]
    assert cli_main([*argv, "--dequantize", "fp4"]) == 2
    assert "quantizes nf4. Pass --dequantize nf4" in capsys.readouterr().err


@pytest.mark.parametrize("experts_double_quant", [False, True])
def test_the_live_record_names_the_4bit_experts_or_none(tmp_path, experts_double_quant):
    """A transformers-loaded MoE whose experts we packed in 4 bits (trl's route streams them): the record names the
    experts where their settings are the linear layers'; where they differ no record can say both, so none is kept
    (a 4-bit merge then asks for the setting instead of following half of it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_fsdp_qlora.experts.quantized import quantize_experts
    from hf_fsdp_qlora.quant_record import RECORD_ATTR, keep_live_record

    base = build_tiny_model(tmp_path / "moe", "qwen3_moe")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                               bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=quant)
    quantize_experts(model, quant_type="nf4", double_quant=experts_double_quant, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    record = keep_live_record(model)
    if experts_double_quant:
        assert record is None and getattr(model, RECORD_ATTR, None) is None
        return
    assert (record.bits, record.quant_type, record.double_quant, record.blocksize) == (4, "nf4", False, 64)
    assert record.experts == [
        f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")
    ]
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / RECORD_NAME).read_text())["experts"] == record.experts
