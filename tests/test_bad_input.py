"""Bad input: a clear error that names the problem and the fix, raised before any collective, on every
rank - no rank left waiting in a collective because another raised."""

import pytest
import torch
from dist_utils import accelerate_launch
from tiny_models import build_tiny_model

from hf_fsdp_qlora import UnsupportedSetupError, load_qlora_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama")


@pytest.fixture(scope="module")
def not_causal(tmp_path_factory):
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("m") / "bert"
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(cfg).save_pretrained(path)
    return path


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_qlora_model(str(tmp_path / "nope"))


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_qlora_model(str(tmp_path))


def test_not_a_causal_lm(not_causal):
    with pytest.raises(UnsupportedSetupError, match="no causal-LM head"):
        load_qlora_model(str(not_causal))


def test_encoder_lm_head_is_not_a_causal_lm(tmp_path):
    """A BERT saved with its "causal" head class but not configured as a decoder attends both ways: the loader
    refuses it with the same rule as the doctor (hf_fsdp_qlora.causal_lm)."""
    from transformers import BertConfig

    from hf_fsdp_qlora.model_shapes import SetupInputError, load_model_config

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    cfg.architectures = ["BertLMHeadModel"]
    cfg.save_pretrained(tmp_path / "bert_lm_head")
    with pytest.raises(UnsupportedSetupError, match="'bert' model \\(BertLMHeadModel\\), which has no causal-LM head"):
        load_qlora_model(str(tmp_path / "bert_lm_head"))
    with pytest.raises(SetupInputError, match="no causal-LM head"):
        load_model_config(tmp_path / "bert_lm_head")


def test_lora_targets_match_nothing(llama):
    from peft import LoraConfig

    with pytest.raises(UnsupportedSetupError, match=r"match no layer.*q_proj"):
        load_qlora_model(str(llama), lora_config=LoraConfig(r=4, target_modules=["no_such_proj"]))


def test_8bit_kwargs_refused(llama):
    with pytest.raises(UnsupportedSetupError, match="load_in_8bit"):
        load_qlora_model(str(llama), load_in_8bit=True)


def test_loader_one_dtype(llama):
    """Storage = compute = every frozen parameter = the chosen dtype (norms not upcast); the trainable adapters are
    float32 master weights by default (as stock peft) and the chosen dtype with adapter_dtype= (the opt-out)."""
    model = load_qlora_model(str(llama), dtype=torch.float16)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.float16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    q = model.base_model.model.config.quantization_config
    assert q.bnb_4bit_quant_storage == torch.float16 and q.bnb_4bit_compute_dtype == torch.float16
    assert any("lora_A" in n and p.requires_grad for n, p in model.named_parameters())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    pure = load_qlora_model(str(llama), dtype=torch.float16, adapter_dtype=torch.float16)
    assert {p.dtype for p in pure.parameters()} == {torch.float16}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case,expect",
    [("missing", "does not exist"), ("targets", "match no layer"), ("8bit", "DoRA (use_dora=True) on an 8-bit base")],
)
def test_every_rank_exits(case, expect, llama, tmp_path):
    path = str(tmp_path / "nope") if case == "missing" else str(llama)
    proc = accelerate_launch("cpu_fsdp2_rehearsal.yaml", "bad_input.py", case, path, timeout=120)
    assert proc.returncode != 0
    # Both ranks report the error themselves (not a rank killed while waiting in a collective).
    assert proc.stderr.count(expect) >= 2, proc.stderr[-4000:]
    assert "Connection reset" not in proc.stderr and "Connection closed" not in proc.stderr
