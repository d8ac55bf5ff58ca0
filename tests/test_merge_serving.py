"""merge-adapters' export for serving (docs/serving.md): what vLLM needs beside the merge, and what it will refuse.

The rules are those of vLLM 0.32's loader (hf_fsdp_qlora/merge/serving.py says where each comes from); that vLLM
loads what the merge writes, token for token, is `make test-serving`'s (tests/serving/test_vllm.py).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from test_merge import make_adapter
from tiny_models import build_tiny_model

from hf_fsdp_qlora.cli.main import merge_adapters_main
from hf_fsdp_qlora.merge.serving import adapter_notes, max_lora_rank, model_notes


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A tiny Llama whose folder has no tokenizer and whose config.json does not say its dtype, and an adapter."""
    root = tmp_path_factory.mktemp("serving_export")
    full = build_tiny_model(root / "full", "llama")
    base = root / "base"
    base.mkdir()
    for src in full.iterdir():
        if not src.name.startswith("tokenizer") and src.name != "special_tokens_map.json":
            shutil.copy2(src, base / src.name)
    config = json.loads((base / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (base / "config.json").write_text(json.dumps(config))
    adapter = make_adapter(base, root / "adapter", r=4, target_modules=["q_proj", "v_proj"])
    return full, base, adapter


def _merge(base, adapter, out, *extra) -> int:
    return merge_adapters_main(["--base", str(base), "--adapter", str(adapter), "--output", str(out),
                                "--no-progress", *extra])  # fmt: skip


def test_merge_without_tokenizer_warns_and_tokenizer_option_fixes_it(bare, tmp_path, caplog):
    full, base, adapter = bare
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
        assert _merge(base, adapter, tmp_path / "bare") == 0
    assert "no tokenizer files" in caplog.text and "--tokenizer PATH" in caplog.text
    assert "--enable-lora --max-lora-rank 8" in caplog.text  # r=4: vLLM accepts 1, 8, 16, ...
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
        assert _merge(base, adapter, tmp_path / "served", "--tokenizer", str(full)) == 0
    assert "no tokenizer files" not in caplog.text
    assert (tmp_path / "served" / "tokenizer.json").read_bytes() == (full / "tokenizer.json").read_bytes()
    # the folder given replaces the base's tokenizer whole: no file of another tokenizer is left beside it
    (base / "tokenizer.model").write_bytes(b"another tokenizer")
    try:
        assert _merge(base, adapter, tmp_path / "replaced", "--tokenizer", str(full)) == 0
    finally:
        (base / "tokenizer.model").unlink()
    assert not (tmp_path / "replaced" / "tokenizer.model").exists()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "served").convert_tokens_to_ids("t7") == 7


def test_tokenizer_option_without_tokenizer_is_a_usage_error(bare, tmp_path, capsys):
    _, base, adapter = bare
    assert _merge(base, adapter, tmp_path / "out", "--tokenizer", str(base)) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_config_says_the_dtype_written(bare, tmp_path):
    """vLLM's `--dtype auto` serves config.json's dtype: the merge says it also when it keeps the base's."""
    _, base, adapter = bare
    assert _merge(base, adapter, tmp_path / "kept") == 0
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["dtype"] == "bfloat16"
    assert _merge(base, adapter, tmp_path / "fp32", "--dtype", "float32") == 0
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"


def test_model_notes_name_what_vllm_refuses(bare, tmp_path):
    full, _, _ = bare
    notes = " ".join(model_notes(full))  # the suite's tiny Llama: head size 16
    assert "head size 16" in notes and "GPU" in notes and "tokenizer" not in notes
    config = json.loads((full / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32, architectures=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    notes = model_notes(tmp_path)
    assert len(notes) == 2 and "no tokenizer files" in notes[0] and "`architectures`" in notes[1]


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"r": 4}, 8),
        ({"r": 8}, 8),
        ({"r": 16, "rank_pattern": {"q_proj": 24}}, 32),
        ({"r": 300}, 320),
        ({"r": 1024}, None),
    ],
)
def test_max_lora_rank(config, expected):
    assert max_lora_rank(config) == expected


@pytest.mark.parametrize(
    "config, refused",
    [
        ({"r": 8, "use_dora": True}, "DoRA"),
        ({"r": 8, "modules_to_save": ["embed_tokens", "lm_head"]}, "modules_to_save ['embed_tokens', 'lm_head']"),
        ({"r": 8, "bias": "lora_only"}, "LoRA biases"),
        ({"r": 8, "init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"r": 2048}, "a rank above 512"),
    ],
)
def test_adapter_notes_name_what_vllm_refuses(config, refused):
    (note,) = adapter_notes(config, {"architectures": ["LlamaForCausalLM"]})
    assert "vLLM will refuse this adapter" in note and refused in note and "merged model" in note


def test_adapter_notes_for_expert_lora():
    both = {"r": 4, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    qwen = " ".join(adapter_notes(both, {"architectures": ["Qwen3MoeForCausalLM"]}))
    assert "GPU only" in qwen and "is_3d_lora_weight=True" in qwen and "enable_mixed_moe_lora_format" in qwen
    gpt_oss = " ".join(adapter_notes(both, {"architectures": ["GptOssForCausalLM"]}))
    assert "GPU only" in gpt_oss and "as is" in gpt_oss and "is_3d_lora_weight" not in gpt_oss
    down_only = {"r": 4, "target_parameters": ["mlp.experts.down_proj"]}
    notes = " ".join(adapter_notes(down_only, {"architectures": ["MixtralForCausalLM"]}))
    assert "gate_up_proj + down_proj" in notes and "refuse" in notes


def test_adapter_notes_plain_lora_only_say_the_rank():
    assert adapter_notes({"r": 16, "target_modules": ["q_proj"]}, {}) == [
        "to serve the adapter itself in vLLM: --enable-lora --max-lora-rank 16"
    ]
