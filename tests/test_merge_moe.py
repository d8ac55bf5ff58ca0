"""merge_adapters on mixture-of-experts bases and on adapters trained on 8-bit bases, against peft's own merge.

Expert LoRA is peft's `target_parameters` (a `ParamWrapper` per fused 3-D expert tensor, nested when a module has
two targets) beside attention LoRA (`target_modules`). The base is stored the two ways transformers 5 reads:
per expert (`experts.0.gate_proj.weight`, ...: what `save_pretrained` writes for Qwen3-MoE and Mixtral, and what
their Hub checkpoints hold) and fused (`experts.gate_up_proj`: gpt-oss, or `save_original_format=False`).

The oracle is `PeftModel.from_pretrained(base, adapter).merge_and_unload()`: on the float32 upcast of the bf16 base,
rounded once to bf16, it must equal ours bit for bit; on the bf16 base (peft rounds the update to bf16, then the
sum) within two bf16 roundings. Our output is compared after transformers loads it, so a wrong expert, slice or
on-disk name shows up as a wrong fused tensor.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from family_build import build
from safetensors import safe_open
from test_merge import make_adapter
from tiny_models import build_tiny_model, tiny_config

from hf_fsdp_qlora.cli.main import merge_adapters_main
from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.merge.pipeline import merge_adapters

warnings.filterwarnings(
    "ignore", message=".*(gemm_4bit|MatMul8bitLt|RoPE scaling|inputs will be cast|_pattern keys did not match).*"
)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _load(path, dtype=torch.bfloat16, **kwargs):
    """The base as transformers loads it: AutoModelForCausalLM, or the composite class of a checkpoint it does not
    map (Inkling 2's Inkling2ForConditionalGeneration)."""
    import transformers
    from transformers import AutoModelForCausalLM

    architecture = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    composite = architecture.endswith("ForConditionalGeneration") and architecture.startswith("Inkling2")
    cls = getattr(transformers, architecture) if composite else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype, **kwargs)


def _inkling2_composite(path: Path) -> Path:
    """A tiny Inkling 2 image-text checkpoint (``Inkling2ForConditionalGeneration``, which AutoModelForCausalLM does
    not map), the language model of the sweep's tiny `inkling2_text`, saved in the original format."""
    from family_build import tiny_config
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    text = tiny_config("inkling2_text")
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 8, "posemb_grid_size": 4, "projection_hidden_dim": 32,
              "text_hidden_size": text.hidden_size}  # fmt: skip
    torch.manual_seed(0)
    model = Inkling2ForConditionalGeneration(Inkling2Config(text_config=text.to_dict(), vision_config=vision))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def peft_merged(base, adapter, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    from peft import PeftModel

    return PeftModel.from_pretrained(_load(base, dtype), adapter).merge_and_unload().state_dict()


def _disk_keys(path: Path) -> set[str]:
    keys = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            keys |= set(fh.keys())
    return keys


def _make_adapter(base: Path, out: Path, **lora_kwargs) -> Path:
    """test_merge.make_adapter on the class `_load` picks (lora_dropout 0: peft refuses dropout on parameter targets)."""
    return make_adapter(base, out, load=_load, lora_dropout=0.0, **lora_kwargs)


def _assert_equals_peft(base: Path, adapter: Path, out: Path, must_change: list[str]) -> dict:
    ours = _load(out).state_dict()
    ref32, ref16, before = (
        peft_merged(base, adapter, torch.float32),
        peft_merged(base, adapter, torch.bfloat16),
        _load(base).state_dict(),
    )
    assert set(ours) == set(ref32)
    for key, tensor in ours.items():
        assert torch.equal(tensor, ref32[key].to(torch.bfloat16)), key
        # peft's bf16 merge rounds the update, then the sum: two roundings of bf16 at most.
        scale = ref32[key].abs() + (ref32[key] - before[key].float()).abs()
        assert bool(
            ((tensor.float() - ref16[key].float()).abs() <= 2 * torch.finfo(torch.bfloat16).eps * scale).all()
        ), key
    changed = {k for k in ours if not torch.equal(ours[k], before[k])}
    assert all(any(k.endswith(suffix) for k in changed) for suffix in must_change), (must_change, sorted(changed))
    return ours


# ---------------------------------------------------------------- MoE bases


@pytest.fixture(scope="module")
def moe_bases(tmp_path_factory):
    """{name: path}: Qwen3-MoE and Mixtral as save_pretrained writes them (per expert), Qwen3-MoE fused, gpt-oss, and
    Inkling 2 in its original format (each expert's gate and up rows interleaved in one `w13_weight`)."""
    root = tmp_path_factory.mktemp("moe_bases")
    out = {arch: build_tiny_model(root / arch, arch) for arch in ("qwen3_moe", "mixtral", "gpt_oss")}
    out["inkling2_text"] = build("inkling2_text", root / "inkling2_text")
    out["inkling2_composite"] = _inkling2_composite(root / "inkling2_composite")
    for name in ("inkling2_text", "inkling2_composite"):
        assert any(k.endswith("mlp.experts.w13_weight") for k in _disk_keys(out[name]))
    out["qwen3_moe_fused"] = root / "qwen3_moe_fused"
    _load(out["qwen3_moe"]).save_pretrained(out["qwen3_moe_fused"], save_original_format=False)
    return out


SCENARIOS = {
    # name: (base, LoraConfig kwargs, tensors that must change (suffixes, as transformers names them))
    "qwen3_moe_per_expert": (
        "qwen3_moe",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "target_parameters": EXPERTS},
        ["experts.gate_up_proj", "experts.down_proj", "q_proj.weight"],
    ),
    "qwen3_moe_fused_patterns": (
        "qwen3_moe_fused",
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "rank_pattern": {"gate_up_proj": 2},
            "alpha_pattern": {"layers.1.mlp.experts.down_proj": 32},
            "target_modules": ["o_proj"],
            "target_parameters": EXPERTS,
        },
        ["experts.gate_up_proj", "experts.down_proj", "o_proj.weight"],
    ),
    "mixtral_per_expert_one_target": (
        "mixtral",
        {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]},
        ["experts.gate_up_proj", "q_proj.weight"],
    ),
    "mixtral_per_expert_down_and_router": (  # the router is a 2-D parameter, stored as block_sparse_moe.gate
        "mixtral",
        {"r": 4, "target_modules": ["k_proj"], "target_parameters": ["mlp.gate.weight", "mlp.experts.down_proj"]},
        ["experts.down_proj", "mlp.gate.weight", "k_proj.weight"],
    ),
    "gpt_oss_transposed": (
        "gpt_oss",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": EXPERTS},
        ["experts.gate_up_proj", "experts.down_proj", "q_proj.weight"],
    ),
    "inkling2_interleaved": (  # transformers de-interleaves w13_weight into gate_up_proj on load
        "inkling2_text",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": EXPERTS},
        ["experts.gate_up_proj", "experts.down_proj", "q_proj.weight"],
    ),
    "inkling2_composite_interleaved": (  # the image-text class: its language model's experts, stored alike
        "inkling2_composite",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "target_parameters": EXPERTS},
        ["experts.gate_up_proj", "experts.down_proj", "q_proj.weight"],
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_expert_and_attention_lora_equal_peft_merge(moe_bases, tmp_path, name):
    base_name, kwargs, must_change = SCENARIOS[name]
    base = moe_bases[base_name]
    adapter = _make_adapter(base, tmp_path / "adapter", **kwargs)
    out = merge_adapters(base, adapter, tmp_path / "merged", max_shard_size="100KB", progress=False)
    # The output keeps the base's on-disk layout (per expert stays per expert), sharded like any merge.
    assert _disk_keys(out) == _disk_keys(base)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    _assert_equals_peft(base, adapter, out, must_change)


@pytest.mark.parametrize("name", ["qwen3_moe", "inkling2_text"])
def test_merged_logits_equal_unmerged_peft_and_cli(moe_bases, tmp_path, capsys, name):
    """Through the command (progress bars on), in float32: the merged model computes what the adapter did."""
    from peft import PeftModel

    base = moe_bases[name]
    adapter = _make_adapter(base, tmp_path / "adapter", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    out = tmp_path / "merged"
    argv = ["--base", str(base), "--adapter", str(adapter), "--output", str(out), "--dtype", "float32"]
    assert merge_adapters_main(argv) == 0
    assert "model.safetensors" in capsys.readouterr().err  # the per-shard progress bar
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
    with torch.no_grad():
        ours = _load(out, torch.float32).eval()(ids).logits
        ref = PeftModel.from_pretrained(_load(base, torch.float32), adapter).eval()(ids).logits
        plain = _load(base, torch.float32).eval()(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(plain, ref, rtol=1e-4, atol=1e-4)  # the adapter matters: the test could fail


# ---------------------------------------------------------------- bad input: clear error, nothing written


def _other_qwen3_moe(path: Path, **changes) -> Path:
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen3_moe")
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def test_bad_expert_adapters_fail_before_writing(moe_bases, tmp_path):
    base = moe_bases["qwen3_moe"]
    adapter = _make_adapter(base, tmp_path / "adapter", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    llama = build_tiny_model(tmp_path / "llama", "llama")
    cases = [
        # target_parameters that match nothing in the base
        (llama, adapter, "target_parameters=.* match no parameter of the base"),
        # the experts have other shapes (expert width 32, not 64)
        (_other_qwen3_moe(tmp_path / "narrow", moe_intermediate_size=32), adapter, "do not fit .*experts"),
        # another number of experts
        (_other_qwen3_moe(tmp_path / "four", num_experts=4), adapter, "do not fit .*experts"),
    ]
    wrong_rank = tmp_path / "wrong_rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"down_proj": 2}}))
    cases.append((base, wrong_rank, "do not fit .*down_proj.*rank_pattern"))
    for i, (to_base, to_adapter, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(MergeError, match=message):
            merge_adapters(to_base, to_adapter, out, progress=False)
        assert not out.exists() and not list(tmp_path.glob(f".out{i}*"))


# ---------------------------------------------------------------- --dequantize nf4 on experts


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_fused", "gpt_oss", "inkling2_text", "inkling2_composite"])
def test_dequantize_nf4_round_trips_experts_as_load_qlora_model(moe_bases, tmp_path, name):
    """Each expert's matrix is round-tripped as `quantize_experts` (load_qlora_model) quantizes it, also where the
    base stores gate and up of an expert apart; the expert LoRA is added on top of that round trip."""
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper

    from hf_fsdp_qlora.experts.quantized import QuantizedExperts, quantize_experts

    base = moe_bases[name]
    adapter = _make_adapter(
        base, tmp_path / "adapter", r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]
    )
    out = merge_adapters(base, adapter, tmp_path / "merged", dequantize="nf4", double_quant=True, progress=False)
    ours, stored = _load(out).state_dict(), _load(base).state_dict()
    trained = _load(base)
    quantize_experts(trained, quant_type="nf4", double_quant=True, dtype=torch.bfloat16)
    peft32 = PeftModel.from_pretrained(_load(base, torch.float32), adapter)
    deltas = {
        f"{n.removeprefix('base_model.model.').replace('.base_layer', '')}.{m.parameter_name}": m.get_delta_weight(
            "default"
        )
        for n, m in peft32.named_modules()
        if isinstance(m, ParamWrapper)
    }
    layers = [(n, m) for n, m in trained.named_modules() if isinstance(m, QuantizedExperts)]
    assert len(layers) == len(deltas) >= 2
    eps = torch.finfo(torch.bfloat16).eps
    for module_name, module in layers:
        for param in ("gate_up_proj", "down_proj"):
            key = f"{module_name}.{param}"
            seen = torch.stack([module.dequantize_expert(param, e) for e in range(module.num_experts)])
            assert not torch.equal(seen, stored[key])
            if key in deltas:  # the update added in float32 to the round trip, rounded once
                expected = seen.float() + deltas[key]
                assert bool(((ours[key].float() - expected).abs() <= eps * expected.abs()).all()), key
            else:
                assert torch.equal(ours[key], seen), key
    kept = merge_adapters(
        base, adapter, tmp_path / "kept", dequantize="nf4", double_quant=True, dequantize_experts=False, progress=False
    )
    kept = _load(kept).state_dict()
    gate_up = [k for k in kept if k.endswith("gate_up_proj")]
    assert gate_up and all(torch.equal(kept[k], stored[k]) for k in gate_up)


# ---------------------------------------------------------------- adapters trained on an 8-bit base


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    """A tiny Llama loaded with load_in_8bit (bitsandbytes' CPU backend), LoRA trained 2 steps with stock peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig

    root = tmp_path_factory.mktemp("int8")
    base = build_tiny_model(root / "llama", "llama")
    model = _load(base, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 256, (2, 16))
    for _ in range(2):
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.save_pretrained(root / "adapter")
    return base, root / "adapter"


def test_adapter_from_8bit_base_merges_equal_peft(int8_run, tmp_path):
    base, adapter = int8_run
    out = merge_adapters(base, adapter, tmp_path / "merged", progress=False)
    _assert_equals_peft(base, adapter, out, ["q_proj.weight", "v_proj.weight", "up_proj.weight"])


def test_dequantize_int8_merges_onto_the_weights_training_saw(int8_run, tmp_path):
    """`dequantize="int8"`: every 8-bit Linear is the LLM.int8 round trip training used (the loaded model's own
    int8 codes and row scales, dequantized), plus the update; the rest (embeddings, norms, lm_head) as stored."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import int8_vectorwise_dequant
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    base, adapter = int8_run
    model8 = _load(base, quantization_config=BitsAndBytesConfig(load_in_8bit=True))  # no forward ran on it
    out = merge_adapters(base, adapter, tmp_path / "merged", dequantize="int8", dtype="float32", progress=False)
    ours, stored = _load(out, torch.float32).state_dict(), _load(base).state_dict()
    peft16 = PeftModel.from_pretrained(_load(base, torch.float32), adapter)
    deltas = {
        f"{name.removeprefix('base_model.model.')}.weight": module.get_delta_weight("default")
        for name, module in peft16.named_modules()
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {})
    }
    int8 = {f"{n}.weight": m for n, m in model8.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
    assert len(int8) == 14 and len(deltas) == 6
    for key, tensor in ours.items():
        if key in int8:
            weight = int8_vectorwise_dequant(int8[key].weight.data, int8[key].weight.SCB)
            expected = weight + deltas[key] if key in deltas else weight
            torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=key)
            assert not torch.equal(tensor, stored[key].float()), key
        else:
            assert torch.equal(tensor, stored[key].float()), key


def test_fused_expert_update_blockwise_equals_whole_tensor():
    """The CPU path (expert by expert, a block of rows at a time) computes what the whole-tensor path (CUDA) does."""
    from hf_fsdp_qlora.merge._lora_math import LoraFactors, TensorUpdate, apply_update, apply_update_into

    torch.manual_seed(0)
    weight = torch.randn(8, 96, 48).to(torch.bfloat16)
    update = TensorUpdate(lora=LoraFactors(torch.randn(8, 4, 48), torch.randn(8, 96, 4), 0.5, False, False, None, "m"))
    whole = apply_update(weight, update, torch.device("cpu"))
    blockwise = apply_update_into(torch.empty(8, 96, 48), weight, update, torch.device("cpu"))
    torch.testing.assert_close(blockwise, whole, rtol=1e-6, atol=1e-6)
    expected = weight.float() + 0.5 * torch.stack([b @ a for a, b in zip(update.lora.a, update.lora.b)])
    torch.testing.assert_close(whole, expected, rtol=1e-6, atol=1e-6)


def test_dbrx_expert_rows_merge_from_their_own_factors():
    """DBRX's 2-D expert stacks (``mlp.w1`` / ``v1`` / ``w2``, ``[E * ffn, hidden]``): each file tensor's update is
    batched factors (``[E, ffn, r]`` / ``[E, r, cols]``, expert e's rows from its own, 1/E of the arithmetic), and it
    equals bit for bit the one block-diagonal product (``[E * ffn, E * r] @ [E * r, cols]``) the merge did before,
    on the CPU path (a block of rows at a time) and the whole-tensor path; the shape check reads it as the 2-D tensor."""
    from hf_fsdp_qlora.experts.dbrx import block_factors
    from hf_fsdp_qlora.experts.files import ExpertSlice
    from hf_fsdp_qlora.merge._lora_math import LoraFactors, TensorUpdate, apply_update, apply_update_into, check_shape

    experts, ffn, hidden, rank = 4, 24, 16, 3
    torch.manual_seed(0)
    rows = [(e * ffn, (e + 1) * ffn) for e in range(experts)]
    gate_up = [
        ExpertSlice(f"mlp.{n}", e, 0, s, s + ffn, rows[e]) for n, s in (("w1", 0), ("v1", ffn)) for e in [2, 0, 3, 1]
    ]
    down = [ExpertSlice("mlp.w2", e, rows=rows[e], transposed=True) for e in range(experts)]
    found = dict(block_factors(gate_up, torch.randn(experts, 2 * ffn, rank), torch.randn(experts, rank, hidden)))
    found |= dict(block_factors(down, torch.randn(experts, hidden, rank), torch.randn(experts, rank, ffn)))
    weight, cpu = torch.randn(experts * ffn, hidden).to(torch.bfloat16), torch.device("cpu")
    for key, (a, b) in found.items():
        assert (tuple(a.shape), tuple(b.shape)) == ((experts, rank, hidden), (experts, ffn, rank)), key
        new = TensorUpdate(lora=LoraFactors(a, b, 0.5, False, False, None, key), sources=["A", "B"])
        old = TensorUpdate(lora=LoraFactors(torch.cat(list(a)), torch.block_diag(*b), 0.5, False, False, None, key))
        expected = apply_update(weight, old, cpu).clone()
        assert torch.equal(apply_update(weight, new, cpu), expected), key
        assert torch.equal(apply_update_into(torch.empty(weight.shape), weight, new, cpu), expected), key
        check_shape(key, new, tuple(weight.shape), None)
        with pytest.raises(MergeError, match=r"implies shape \(96, 16\)"):
            check_shape(key, new, (experts * ffn, hidden + 1), None)


def test_dbrx_merge_benchmark_small(capsys):
    """benchmarks/dbrx_merge.py in a small shape: both forms write bit-identical tensors, and the old one's FLOPs are
    E times the new one's."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import dbrx_merge

    argv = ["--experts", "4", "--ffn", "32", "--hidden", "16", "--rank", "2", "--repeat", "1", "--json"]
    assert dbrx_merge.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bit_equal"] and result["old_gflop"] == pytest.approx(4 * result["new_gflop"])
    # released DBRX (40 layers, E=16, ffn 10752, hidden 6144) at r=2: 3 products of 2 * E*ffn * r * hidden per layer
    assert result["released_new_tflop"] == pytest.approx(40 * 3 * 2 * 16 * 10752 * 2 * 6144 / 1e12)
    assert result["released_old_tflop"] == pytest.approx(16 * result["released_new_tflop"])
