"""merge_adapters against peft's own merge, on real peft adapters over tiny local models.

The oracle is `PeftModel.from_pretrained(16-bit base, adapter).merge_and_unload()`: our merged tensors must
equal its within one rounding of the output dtype, and the merged model's logits must equal the unmerged
peft model's. Every trainable adapter tensor is perturbed before saving (LoRA B starts at zero, and a
modules_to_save copy starts equal to the base), so a merge that drops any of them fails the comparison.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import build_tiny_model, tiny_config

from hf_fsdp_qlora import safetensors_io as _safetensors_io
from hf_fsdp_qlora.merge import _lora_math
from hf_fsdp_qlora.merge._lora_math import LoraFactors, TensorUpdate, apply_update, apply_update_into, collect_updates
from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.merge.pipeline import MergeUsageError, merge_adapters

warnings.filterwarnings(
    "ignore", message=".*(gemm_4bit|save_embedding_layers|tie_word_embeddings|ensure_weight_tying|fan_in_fan_out).*"
)
INPUT_IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64], [1, 2, 3, 4, 5, 6, 7, 8]])


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def bases(tmp_path_factory):
    """Tiny bf16 bases, built once: {name: path}."""
    root = tmp_path_factory.mktemp("bases")
    out = {arch: build_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "llama_tied")}
    out["llama_sharded"] = _build(root / "llama_sharded", tiny_config("llama"), max_shard_size="100KB")
    out["gpt2"] = _build(root / "gpt2", _gpt2_config())
    return out


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)


def _build(path: Path, config, max_shard_size="5GB", seed=0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    return path


def load_base(base, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=dtype)


def make_adapter(base: Path, out: Path, seed: int = 1, load=None, **lora_kwargs) -> Path:
    """A real peft adapter over `base` (loaded by `load`, default :func:`load_base`) whose every trainable tensor is
    non-trivial, saved to `out`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model((load or load_base)(base), LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out)
    return out


def peft_merged(base, adapter, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(base, dtype), adapter).merge_and_unload().state_dict()


def peft_logits(base, adapter) -> torch.Tensor:
    """Logits of the UNmerged peft model, in float32 over the (exactly upcast) bf16 base."""
    from peft import PeftModel

    with torch.no_grad():
        return PeftModel.from_pretrained(load_base(base, torch.float32), adapter).eval()(INPUT_IDS).logits


def our_logits(path) -> torch.Tensor:
    with torch.no_grad():
        return load_base(path, torch.float32).eval()(INPUT_IDS).logits


def read_output(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 - safe_open is not iterable
    return tensors


def assert_within_one_rounding(ours: torch.Tensor, ref: torch.Tensor, key: str, delta: torch.Tensor | None = None):
    """|ours - ref| <= one unit in the last place of the output dtype (eps * |x| bounds it).

    `delta`: the reference rounded the update itself first (peft's Embedding merge), which adds one
    rounding of |delta|.
    """
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
    diff = (ours.float() - ref.float()).abs()
    scale = torch.maximum(ours.float().abs(), ref.float().abs()) + (0 if delta is None else delta.abs())
    ulp = torch.finfo(ref.dtype).eps * scale
    assert bool((diff <= ulp).all()), f"{key}: max diff {diff.max():.3g} exceeds one rounding of {ref.dtype}"


def assert_no_peft_artifacts(out: Path) -> None:
    names = {p.name for p in out.iterdir()}
    assert not names & {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"}, names
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    keys = read_output(out)
    assert not [k for k in keys if "lora_" in k or "base_layer" in k or "modules_to_save" in k]


# ---------------------------------------------------------------- exactness against peft

SCENARIOS = {
    "llama_all_linear": ("llama", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    "qwen2_lora_bias": (
        "qwen2",
        {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj"], "lora_bias": True, "bias": "all"},
    ),
    "qwen2_bias_lora_only": ("qwen2", {"r": 4, "target_modules": ["q_proj", "v_proj"], "bias": "lora_only"}),
    "rslora_rank_alpha_patterns": (
        "llama",
        {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "rank_pattern": {"v_proj": 8, "layers.1.mlp.down_proj": 2},
            "alpha_pattern": {"q_proj": 32, "model.layers.0.mlp.down_proj": 3},
        },
    ),
    "modules_to_save": ("llama", {"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head", "o_proj"]}),
    "embeddings_targeted": ("llama", {"r": 4, "target_modules": ["embed_tokens", "lm_head", "q_proj"]}),
    "dora": ("llama", {"r": 4, "target_modules": ["q_proj", "v_proj", "gate_proj"], "use_dora": True}),
    "sharded_base": ("llama_sharded", {"r": 4, "target_modules": ["q_proj", "up_proj"]}),
    "gpt2_fan_in_fan_out": ("gpt2", {"r": 4, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}),
}


@pytest.fixture(scope="module")
def merged_scenarios(bases, tmp_path_factory):
    """Each scenario merged once in bf16 (vs peft) and once in float32 (vs the unmerged logits)."""
    root = tmp_path_factory.mktemp("scenarios")
    done = {}
    for name, (base_name, kwargs) in SCENARIOS.items():
        base = bases[base_name]
        adapter = make_adapter(base, root / f"{name}-adapter", **kwargs)
        out16 = merge_adapters(base, adapter, root / f"{name}-bf16", max_shard_size="60KB", progress=False)
        out32 = merge_adapters(base, adapter, root / f"{name}-fp32", dtype="float32", progress=False)
        done[name] = (base, adapter, out16, out32)
    return done


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tensors_equal_peft_merge_within_one_rounding(merged_scenarios, name):
    """Against peft's merge on the 16-bit base, and on the same base upcast to float32 then rounded once.

    peft merges an Embedding LoRA as `weight += delta.to(bf16)`, rounding twice; ours rounds once, so for
    those tensors the 16-bit oracle is allowed two roundings and the float32 one pins the exact value.
    """
    base, adapter, out16, _ = merged_scenarios[name]
    ours, ref16, ref32 = read_output(out16), peft_merged(base, adapter), peft_merged(base, adapter, torch.float32)
    tied_away = {k for k in ref16 if k not in ours and k == "lm_head.weight"}  # tied: stored once, like the base
    assert set(ours) == set(ref16) - tied_away
    double_rounded = {f"{m}.weight" for m in _embedding_lora_modules(adapter)}
    changed = 0
    for key, tensor in ours.items():
        assert_within_one_rounding(tensor, ref32[key].to(tensor.dtype), key)
        assert torch.equal(tensor, ref32[key].to(tensor.dtype)), key
        delta = ref32[key] - load_base_tensor(base, key).float() if key in double_rounded else None
        assert_within_one_rounding(tensor, ref16[key], key, delta)
        changed += not torch.equal(tensor, load_base_tensor(base, key))
    assert changed > 0, "the adapter changed nothing: the test could not fail"


@pytest.mark.parametrize("layout", ["linear", "fan_in_fan_out", "embedding"])
def test_blockwise_update_equals_whole_tensor_update(monkeypatch, layout):
    """The CPU path that updates a weight a block of rows at a time (the merge's fast path) computes what the
    whole-tensor update computes, across block edges and a short last block, for both factor layouts."""
    torch.manual_seed(0)
    rows, cols, rank = 37, 24, 4
    weight = torch.randn(rows, cols).to(torch.bfloat16)
    transposed = layout != "linear"  # W is (in, out) for fan_in_fan_out, (num_embeddings, dim) for embeddings
    a = torch.randn(rank, rows if transposed else cols)
    b = torch.randn(cols if transposed else rows, rank)
    factors = LoraFactors(a, b, 0.7, layout == "embedding", layout == "fan_in_fan_out", None, "m")
    update = TensorUpdate(lora=factors)
    cpu = torch.device("cpu")
    whole = apply_update(weight, update, cpu)
    monkeypatch.setattr(_lora_math, "_BLOCK_ELEMENTS", 5 * cols)  # 7 blocks of 5 rows, then one of 2

    def no_fallback(*args, **kwargs):
        raise AssertionError("the blockwise path fell back to the whole-tensor update")

    monkeypatch.setattr(_lora_math, "apply_update", no_fallback)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((rows, cols), float("nan"), dtype=dtype)  # a row left unwritten stays NaN
        apply_update_into(out, weight, update, cpu)
        assert not out.isnan().any()
        if dtype == torch.float32:  # a block's matmul may round differently from the whole one's
            torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
        else:
            assert_within_one_rounding(out, whole.to(dtype), f"{layout} {dtype}")
    assert (whole - weight.float()).abs().min() > 0, "the update changed nothing: the test could not fail"


def _embedding_lora_modules(adapter: Path) -> set[str]:
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as fh:
        return {
            k.removeprefix("base_model.model.").removesuffix(".lora_embedding_A")
            for k in fh.keys()  # noqa: SIM118 - safe_open is not iterable
            if k.endswith("lora_embedding_A")
        }


def load_base_tensor(base: Path, key: str) -> torch.Tensor:
    for file in base.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            if key in fh.keys():  # noqa: SIM118 - safe_open has no __contains__
                return fh.get_tensor(key)
    raise KeyError(key)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_merged_logits_equal_unmerged_peft(merged_scenarios, name):
    base, adapter, _, out32 = merged_scenarios[name]
    torch.testing.assert_close(our_logits(out32), peft_logits(base, adapter), rtol=1e-4, atol=1e-4)
    assert_no_peft_artifacts(out32)


def test_sharded_in_and_out_with_index(merged_scenarios):
    base, _, out16, _ = merged_scenarios["sharded_base"]
    assert len(list(base.glob("*.safetensors"))) >= 3
    shards = sorted(out16.glob("model-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((out16 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_output(out16).values())
    for shard in shards:
        assert shard.stat().st_size <= 60_000 + 4096 or len(_safetensors_io.read_header(shard)[0]) == 1


def test_side_files_copied_and_model_loads(merged_scenarios):
    from transformers import AutoTokenizer

    base, _, out16, _ = merged_scenarios["llama_all_linear"]
    assert (out16 / "generation_config.json").read_text() == (base / "generation_config.json").read_text()
    assert AutoTokenizer.from_pretrained(out16)("t5 t6").input_ids == [5, 6]
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((merged_scenarios["llama_all_linear"][3] / "config.json").read_text())["dtype"] == "float32"
    assert not [p for p in out16.parent.iterdir() if ".partial-" in p.name]


# ---------------------------------------------------------------- tied embeddings


def test_tied_shared_update_stays_tied_and_single_copy(bases, tmp_path):
    """A LoRA on both sides of the tie that is one update (lm_head's factors are the embedding's, transposed).

    That is what LoraConfig(ensure_weight_tying=True) is for; with peft 0.21.2 + transformers 5.23 the two
    sides come out as independent factors (seen here), so the shared factors are written into the file.
    """
    from safetensors.torch import load_file, save_file

    base = bases["llama_tied"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["embed_tokens", "lm_head", "q_proj"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    pre = "base_model.model."
    tensors[f"{pre}lm_head.lora_A.weight"] = tensors[f"{pre}model.embed_tokens.lora_embedding_B"].T.contiguous()
    tensors[f"{pre}lm_head.lora_B.weight"] = tensors[f"{pre}model.embed_tokens.lora_embedding_A"].T.contiguous()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))

    out = merge_adapters(base, adapter, tmp_path / "out", dtype="float32", progress=False)
    keys = read_output(out)
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    torch.testing.assert_close(our_logits(out), peft_logits(base, adapter), rtol=1e-4, atol=1e-4)


def test_tied_modules_to_save_stays_tied(bases, tmp_path):
    base = bases["llama_tied"]
    adapter = make_adapter(
        base,
        tmp_path / "a",
        r=4,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens"],
        ensure_weight_tying=True,
    )
    out = merge_adapters(base, adapter, tmp_path / "out", dtype="float32", progress=False)
    assert "lm_head.weight" not in read_output(out)
    torch.testing.assert_close(our_logits(out), peft_logits(base, adapter), rtol=1e-4, atol=1e-4)


def test_tied_one_sided_update_fails_or_unties(bases, tmp_path):
    base = bases["llama_tied"]
    # Independent LoRAs on the two sides of the tie. (ensure_weight_tying=True also gives independent factors
    # in training with peft 0.21.2, but PeftModel.from_pretrained then ties them, overwriting one side with
    # the other: the reloaded peft model is not the trained one, so it cannot be the oracle here.)
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["embed_tokens", "lm_head", "q_proj"])
    with pytest.raises(MergeError, match="`untie_embeddings=True`") as err:
        merge_adapters(base, adapter, tmp_path / "out", progress=False)
    assert "ensure_weight_tying" in str(err.value)
    assert not (tmp_path / "out").exists()
    out = merge_adapters(base, adapter, tmp_path / "out", dtype="float32", untie_embeddings=True, progress=False)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(read_output(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    torch.testing.assert_close(our_logits(out), peft_logits(base, adapter), rtol=1e-4, atol=1e-4)


def test_tied_embedding_only_lora_unties(bases, tmp_path):
    """LoRA on embed_tokens alone: in training lm_head used the plain tied weight, so only untying is exact."""
    base = bases["llama_tied"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["embed_tokens"])
    with pytest.raises(MergeError, match="lm_head.weight did not see"):
        merge_adapters(base, adapter, tmp_path / "out", progress=False)
    out = merge_adapters(base, adapter, tmp_path / "out", dtype="float32", untie_embeddings=True, progress=False)
    torch.testing.assert_close(our_logits(out), peft_logits(base, adapter), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- 4-bit round trip


def test_dequantize_nf4_matches_bnb_weights_training_saw(bases, tmp_path):
    """Oracle: load the base in 4 bit like QLoRA, dequantize every Linear4bit BEFORE any forward (a CPU
    forward may repack the weights in place), put those values in a 16-bit model, merge that with peft."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "down_proj"])
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    from transformers import AutoModelForCausalLM

    q_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, quantization_config=quant)
    dequantized = {
        f"{name}.weight": bnb_f.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
        for name, mod in q_model.named_modules()
        if isinstance(mod, bnb.nn.Linear4bit)
    }
    assert len(dequantized) == 14  # 7 Linear per layer; lm_head stays 16-bit
    ref_model = load_base(base)
    ref_model.load_state_dict(dequantized, strict=False)
    ref = PeftModel.from_pretrained(ref_model, adapter).merge_and_unload().state_dict()

    out = merge_adapters(base, adapter, tmp_path / "out", dequantize="nf4", double_quant=True, progress=False)
    ours = read_output(out)
    for key, tensor in ours.items():
        assert_within_one_rounding(tensor, ref[key], key)
    untargeted = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(ours[untargeted], dequantized[untargeted])
    assert not torch.equal(ours[untargeted], load_base_tensor(base, untargeted))
    assert torch.equal(ours["lm_head.weight"], load_base_tensor(base, "lm_head.weight"))


# ---------------------------------------------------------------- adapter sources


def test_bin_adapter_and_trainer_checkpoint(bases, tmp_path):
    from peft import PeftModel

    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"])
    expected = read_output(merge_adapters(base, adapter, tmp_path / "ref", progress=False))

    model = PeftModel.from_pretrained(load_base(base), adapter)
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    ckpt = tmp_path / "run" / "checkpoint-20"
    model.save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text("{}")
    torch.save({"state": {}}, ckpt / "optimizer.pt")
    (tmp_path / "run" / "checkpoint-5").mkdir()

    for source in (tmp_path / "bin", ckpt):
        got = read_output(merge_adapters(base, source, tmp_path / f"out-{source.name}", progress=False))
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    with pytest.raises(MergeError, match="checkpoint-20"):  # the run folder: names the latest checkpoint
        merge_adapters(base, tmp_path / "run", tmp_path / "out-run", progress=False)


def _fsdp_checkpoint(base, adapter, ckpt: Path, adapter_only: bool) -> None:
    """What accelerate's SHARDED_STATE_DICT save writes: dcp.save({"model": state_dict}) in pytorch_model_fsdp_0."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel, get_peft_model_state_dict

    model = PeftModel.from_pretrained(load_base(base), adapter, is_trainable=True)
    state = get_peft_model_state_dict(model) if adapter_only else model.state_dict()
    dcp.save({"model": state}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    (ckpt / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())


@pytest.mark.parametrize("adapter_only", [False, True], ids=["full_model_state", "adapter_only"])
def test_fsdp_sharded_checkpoint(bases, tmp_path, adapter_only):
    base = bases["qwen2"]
    adapter = make_adapter(
        base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["o_proj"], bias="lora_only"
    )
    expected = read_output(merge_adapters(base, adapter, tmp_path / "ref", progress=False))
    ckpt = tmp_path / "checkpoint-10"
    _fsdp_checkpoint(base, adapter, ckpt, adapter_only)
    got = read_output(merge_adapters(base, ckpt, tmp_path / "out", progress=False))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


# ---------------------------------------------------------------- errors


def test_adapter_for_another_model(bases, tmp_path):
    from transformers import AutoModelForCausalLM

    base = bases["llama"]
    wide_cfg, deep_cfg = tiny_config("llama"), tiny_config("llama", num_layers=3)
    wide_cfg.intermediate_size = 96
    wide = _build(tmp_path / "wide", wide_cfg)
    deep = _build(tmp_path / "deep", deep_cfg)
    assert AutoModelForCausalLM  # built from config above: no hub
    shape_adapter = make_adapter(wide, tmp_path / "a1", r=4, target_modules=["gate_proj"])
    with pytest.raises(MergeError, match=r"implies shape \(96, 64\).*has shape \(128, 64\).*different model"):
        merge_adapters(base, shape_adapter, tmp_path / "o1", progress=False)
    deep_adapter = make_adapter(deep, tmp_path / "a2", r=4, target_modules=["q_proj"])
    with pytest.raises(MergeError, match=r"does not have, e\.g\. \['model\.layers\.2\.self_attn\.q_proj\.weight'\]"):
        merge_adapters(base, deep_adapter, tmp_path / "o2", progress=False)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_base_name_mismatch_warns(bases, tmp_path):
    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "some-org/Other-Model-7B"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="some-org/Other-Model-7B"):
        merge_adapters(base, adapter, tmp_path / "out", progress=False)


def test_corrupted_and_truncated_base(bases, tmp_path):
    import shutil

    adapter = make_adapter(bases["llama"], tmp_path / "a", r=4, target_modules=["q_proj"])
    bad = Path(shutil.copytree(bases["llama"], tmp_path / "bad"))
    raw = bytearray((bad / "model.safetensors").read_bytes())
    (bad / "model.safetensors").write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(MergeError, match="not a valid safetensors file.*header length"):
        merge_adapters(bad, adapter, tmp_path / "o1", progress=False)
    (bad / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(MergeError, match="truncated or corrupted"):
        merge_adapters(bad, adapter, tmp_path / "o2", progress=False)
    (adapter / "adapter_model.safetensors").write_bytes(b"{not safetensors")
    with pytest.raises(MergeError, match="adapter_model.safetensors is not a valid safetensors"):
        merge_adapters(bases["llama"], adapter, tmp_path / "o3", progress=False)


def test_empty_and_meta_adapter_tensors_are_errors(bases, tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(MergeError, match="meta device"):
        collect_updates({"r": 4}, {"base_model.model.x.lora_A.weight": torch.empty(4, 8, device="meta")})
    with pytest.raises(MergeError, match="empty"):
        collect_updates({"r": 4}, {"base_model.model.x.lora_A.weight": torch.empty(0, 8)})
    with pytest.raises(MergeError, match="target_parameters"):
        collect_updates({"r": 4, "target_parameters": ["experts.down_proj"]}, {})
    adapter = make_adapter(bases["llama"], tmp_path / "a", r=4, target_modules=["q_proj"])
    save_file({}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(MergeError, match="empty adapter"):
        merge_adapters(bases["llama"], adapter, tmp_path / "out", progress=False)


def test_usage_errors(bases, tmp_path):
    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    (tmp_path / "exists").mkdir()
    cases = [
        ({"output": tmp_path / "exists"}, "`force=True`"),
        ({"output": base / "merged"}, "lies inside `base`"),
        ({"dtype": "int8"}, "`dtype` int8"),
        ({"max_shard_size": "lots"}, "5GB"),
        ({"adapter": tmp_path / "missing"}, "does not exist"),
        ({"dequantize": "int4"}, "nf4"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "no CUDA device"))
    for override, message in cases:
        kwargs = {"base": base, "adapter": adapter, "output": tmp_path / "out", "progress": False} | override
        with pytest.raises(MergeUsageError, match=message) as err:
            merge_adapters(**kwargs)
        assert err.value.exit_code == 2


# ---------------------------------------------------------------- safe output


def test_disk_full_leaves_nothing(bases, tmp_path, monkeypatch):
    base = bases["llama_sharded"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    calls = {"n": 0}
    real = _safetensors_io.ShardWriter.copy_bytes

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 5:  # in the second shard or later
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, *args)

    monkeypatch.setattr(_safetensors_io.ShardWriter, "copy_bytes", failing)
    with pytest.raises(MergeError, match="no space left on the device.*Free disk space") as err:
        merge_adapters(base, adapter, tmp_path / "out", max_shard_size="50KB", progress=False)
    assert err.value.exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]

    monkeypatch.undo()
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(MergeError, match=r"needs 0\.\d+ GB, 0\.00 GB are free"):
        merge_adapters(base, adapter, tmp_path / "out", progress=False)


def test_force_keeps_old_output_until_new_one_is_complete(bases, tmp_path, monkeypatch):
    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    other = make_adapter(base, tmp_path / "b", seed=7, r=4, target_modules=["v_proj"])
    out = tmp_path / "out"
    merge_adapters(base, other, out, progress=False)  # an earlier output of this tool: --force may replace it
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(self, name, tensor):
        raise KeyboardInterrupt

    monkeypatch.setattr(_safetensors_io.ShardWriter, "write_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge_adapters(base, adapter, out, force=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]

    monkeypatch.undo()
    merge_adapters(base, adapter, out, force=True, progress=False)
    ours, ref = read_output(out), peft_merged(base, adapter)
    assert all(torch.equal(ours[k], ref[k]) for k in ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


def test_leftover_of_killed_run_is_removed(bases, tmp_path):
    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    # A killed run's folder: its lock file is there but nobody holds the lock any more.
    stale = tmp_path / ".out.partial-otherhost-123-abcd"
    stale.mkdir()
    (stale / ".hf-fsdp-qlora-writing.lock").write_text("otherhost pid 123\n")
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    merge_adapters(base, adapter, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "out"]


def test_progress_bar_per_shard(bases, tmp_path, capsys):
    base = bases["llama_sharded"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    merge_adapters(base, adapter, tmp_path / "out", max_shard_size="100KB", progress=True)
    err = capsys.readouterr().err
    n = len(list((tmp_path / "out").glob("model-*.safetensors")))
    assert n >= 2 and all(f"model-{i:05d}-of-{n:05d}.safetensors" in err for i in range(1, n + 1))


def test_slow_disk_keeps_every_tensor_intact(bases, tmp_path, monkeypatch):
    """Writes run on a background thread while the next tensor is computed into a rotating buffer; with a
    slow disk, a buffer reused too early would corrupt a queued tensor."""
    import time

    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["down_proj", "gate_proj", "k_proj", "o_proj"])
    expected = read_output(merge_adapters(base, adapter, tmp_path / "fast", progress=False))
    real_write, real_copy = _safetensors_io.ShardWriter.write_tensor, _safetensors_io.ShardWriter.copy_bytes

    def slow_write(self, *args):
        time.sleep(0.01)
        return real_write(self, *args)

    def slow_copy(self, *args):
        time.sleep(0.01)
        return real_copy(self, *args)

    monkeypatch.setattr(_safetensors_io.ShardWriter, "write_tensor", slow_write)
    monkeypatch.setattr(_safetensors_io.ShardWriter, "copy_bytes", slow_copy)
    got = read_output(merge_adapters(base, adapter, tmp_path / "slow", progress=False))
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []


def test_early_writeback_keeps_every_tensor_intact(bases, tmp_path, monkeypatch):
    """The writer asks the kernel to write back (and drop) each written stretch early; with a tiny stretch,
    every shard gets many such calls, over contiguous ranges, and the output stays byte for byte the same."""
    base = bases["llama_sharded"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "up_proj"])
    expected = read_output(merge_adapters(base, adapter, tmp_path / "default", progress=False))
    calls, real_fadvise = [], os.posix_fadvise

    def spy(fd, offset, length, advice):
        calls.append((os.fstat(fd).st_ino, offset, length, advice))  # fd numbers are reused across shards
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(_safetensors_io, "_FLUSH_EVERY", 4096)
    monkeypatch.setattr(os, "posix_fadvise", spy)
    out = merge_adapters(base, adapter, tmp_path / "early", max_shard_size="60KB", progress=False)
    got = read_output(out)
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []
    shards = len(list(out.glob("*.safetensors")))
    assert shards > 1 and len(calls) > 2 * shards, (shards, len(calls))
    assert {advice for *_, advice in calls} == {os.POSIX_FADV_DONTNEED}
    ends: dict[int, int] = {}
    for inode, offset, length, _ in calls:  # each call starts where the previous one on that file ended
        assert length >= 4096 and ends.get(inode, offset) == offset
        ends[inode] = offset + length


_FSDP2_SAVE = """
import sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from peft import PeftModel
from transformers import AutoModelForCausalLM

base, adapter, out = sys.argv[1:4]
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter, is_trainable=True)
for layer in model.base_model.model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2 did not engage"
state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
dcp.save({"model": state}, checkpoint_id=out)  # what accelerate's SHARDED_STATE_DICT save does
dist.barrier()
dist.destroy_process_group()
# gloo's teardown at interpreter exit sometimes aborts ("terminate called without an active exception") even
# after destroy_process_group (dist_utils.exit_worker): end here, with the checkpoint written.
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)
"""


@pytest.mark.distributed
def test_real_fsdp2_sharded_checkpoint_on_gloo(bases, tmp_path):
    """Two ranks shard the LoRA model with FSDP2 (DTensor) and save it with torch.distributed.checkpoint."""
    from dist_utils import check, torchrun

    base = bases["llama"]
    adapter = make_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    expected = read_output(merge_adapters(base, adapter, tmp_path / "ref", progress=False))
    script = tmp_path / "fsdp2_save.py"
    script.write_text(_FSDP2_SAVE)
    ckpt = tmp_path / "checkpoint-3"
    check(torchrun(str(script), str(base), str(adapter), str(ckpt / "pytorch_model_fsdp_0"), timeout=240))
    assert len(list((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    (ckpt / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    got = read_output(merge_adapters(base, ckpt, tmp_path / "out", progress=False))
    assert got.keys() == expected.keys() and [k for k in got if not torch.equal(got[k], expected[k])] == []
