"""`make test-gguf` (opt-in): the GGUFs export-gguf writes, run by llama.cpp itself (llama-cpp-python built from the
sdist whose converters wrote them), give the same greedy tokens as transformers / peft: the base, our merge, the
base + the LoRA adapter GGUF, and merged Mixtral (expert LoRA merged). Qwen3-MoE is not here: its converter reads
only BPE tokenizers llama.cpp knows by hash, and no tokenizer built locally is one of those.

Skipped where llama_cpp is not importable: `make test-gguf` builds it once into .llama-cpp/ (~35 min on 2 cores).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed here: run `make test-gguf`")

from gguf_fixtures import ALL_PROJECTIONS, build_sp_model, fetch_sdist, trained_adapter

from hf_fsdp_qlora.merge.gguf import export_gguf, unpack_llama_cpp
from hf_fsdp_qlora.merge.pipeline import merge_adapters

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPT = [1, 17, 42, 5, 99, 23, 64, 8]
NEW_TOKENS = 16
# name: (arch, config changes, LoraConfig kwargs)
MODELS = {
    "llama": ("llama", {}, {"target_modules": ALL_PROJECTIONS}),
    "mixtral": ("mixtral", {}, {"target_modules": ["q_proj", "v_proj"], "target_parameters": EXPERTS}),
    "mixtral_attention": ("mixtral", {}, {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
}
FIGURES = {}


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    sdist, why = fetch_sdist()
    if sdist is None:
        pytest.skip(f"no llama.cpp converter: {why}")
    return unpack_llama_cpp(sdist, tmp_path_factory.mktemp("llama_cpp"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (base, adapter, merged) folders; B initialised at random too, so the adapter changes the tokens."""
    root = tmp_path_factory.mktemp("gguf_tokens")
    out = {}
    for name, (arch, changes, lora) in MODELS.items():
        base = build_sp_model(root / name, arch, **changes)
        adapter = trained_adapter(base, root / f"{name}_lora", init_lora_weights=False, **lora)
        out[name] = (base, adapter, merge_adapters(base, adapter, root / f"{name}_merged", progress=False))
    return out


def hf_greedy(model_dir, adapter=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids, tokens = torch.tensor([PROMPT]), []
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].numpy()
        # Greedy by hand, as for llama.cpp: generate() adds logits processors (min_new_tokens masks EOS).
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(input_ids=ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logits


def cpp_greedy(gguf, lora=None):
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        lora_path=str(lora) if lora else None,
        n_ctx=64,
        n_threads=1,
        logits_all=True,
        verbose=False,
    )
    llm.eval(PROMPT)
    logits = np.array(llm.scores[len(PROMPT) - 1])
    tokens = []
    for _ in range(NEW_TOKENS):  # greedy by hand: argmax of llama.cpp's own logits, no sampler settings involved
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens, logits


def _record(name, hf, cpp):
    gap = np.sort(hf[1])[-2:]
    FIGURES[name] = {
        "equal": hf[0] == cpp[0],
        "max_logit_diff": float(np.abs(hf[1] - cpp[1]).max()),
        "top2_gap": float(gap[1] - gap[0]),
        "hf": hf[0],
        "llama.cpp": cpp[0],
    }
    print(name, json.dumps({k: v for k, v in FIGURES[name].items() if k not in ("hf", "llama.cpp")}))


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_merged_gguf_generates_as_transformers(converter, built, tmp_path, name):
    base, _, merged = built[name]
    gguf = export_gguf(merged, tmp_path / "merged.gguf", llama_cpp=converter)
    assert gguf.notes == []
    hf, cpp = hf_greedy(merged), cpp_greedy(gguf.path)
    _record(f"{name} merged", hf, cpp)
    assert cpp[0] == hf[0]
    assert hf[0] != hf_greedy(base)[0], "the adapter did not change the tokens: the check would not see a lost merge"


@pytest.mark.parametrize("name", ["llama", "mixtral_attention"])
def test_base_and_adapter_gguf_generate_as_peft(converter, built, tmp_path, name):
    base, adapter, _ = built[name]
    base_gguf = export_gguf(base, tmp_path / "base.gguf", llama_cpp=converter).path
    lora_gguf = export_gguf(base, tmp_path / "lora.gguf", llama_cpp=converter, adapter=adapter).path
    hf_base, cpp_base = hf_greedy(base), cpp_greedy(base_gguf)
    _record(f"{name} base", hf_base, cpp_base)
    hf_lora, cpp_lora = hf_greedy(base, adapter), cpp_greedy(base_gguf, lora_gguf)
    _record(f"{name} base + LoRA GGUF", hf_lora, cpp_lora)
    assert cpp_base[0] == hf_base[0] and cpp_lora[0] == hf_lora[0]
    assert hf_lora[0] != hf_base[0]
