"""The rules behind four families the sweep (tests/test_families.py) builds since issue 48, on small modules:

- ``all-linear`` leaves out linear layers no gradient reaches (a module whose forward runs under ``torch.no_grad``,
  as DeepSeek-V3.2's and GLM-MoE-DSA's sparse-attention indexers do) and linear layers sharing one weight (Zamba's
  tied attention block), also when an MoE model's all-linear was resolved to a list of names first;
- the loader's input-gradient hook leaves the embedding output changeable in place (BLT adds to it);
- merge-adapters folds the same LoRA on a tied layer's two places into its one stored weight, and refuses different ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_fsdp_qlora.loading.family_targets import lora_config_for_family


class _Indexer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wk = nn.Linear(8, 8, bias=False)

    @torch.no_grad()
    def forward(self, x):
        return self.wk(x).topk(2, dim=-1).indices


class _Block(nn.Module):
    def __init__(self, shared: nn.Linear):
        super().__init__()
        self.q_proj = nn.Linear(8, 8, bias=False)
        self.indexer = _Indexer()
        self.shared = nn.Linear(8, 8, bias=False)
        self.shared.weight = shared.weight  # tied, as transformers ties Zamba's shared block: one weight, two layers

    def forward(self, x):
        picked = self.indexer(x)
        return self.shared(self.q_proj(x)).gather(-1, picked).sum()


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(model_type="toy")
        first = _Block(nn.Linear(8, 8, bias=False))
        self.layers = nn.ModuleList([first, _Block(first.shared)])

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


@pytest.mark.parametrize("resolved", [False, True], ids=["all-linear", "resolved-list"])
def test_all_linear_leaves_out_no_grad_and_tied_layers(resolved):
    """Before: the indexer and the tied layers got LoRA; the indexer's never had a gradient, and the tied layers'
    two LoRAs could not be merged into the one stored weight (Zamba: "changes 7 tensor(s) the base does not have")."""
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear")
    if resolved:  # lora_config_for_experts's form on an MoE model: the linear layers by name, marked
        config.target_modules = ["q_proj", "wk", "shared"]
        config.hf_fsdp_qlora_linear_targets = True
    model = get_peft_model(_Toy(), lora_config_for_family(_Toy(), config))
    adapted = sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A"))
    assert adapted == ["layers.0.q_proj", "layers.1.q_proj"]
    model(torch.randn(3, 8)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_explicit_targets_are_left_as_given():
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["wk"])
    assert lora_config_for_family(_Toy(), config).exclude_modules is None


def test_input_grad_hook_lets_the_model_add_to_the_embedding_output_in_place():
    """BLT and GIT add to the embedding output in place. transformers' hook made it a leaf that requires grad:
    "a leaf Variable that requires grad is being used in an in-place operation". Ours hands on a tracked tensor, and
    the gradient still reaches a trainable layer after it, equal to the one without the in-place add."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_fsdp_qlora.loading._adapter_steps import freeze_for_kbit_training

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    freeze_for_kbit_training(model, gradient_checkpointing=True)
    probe = nn.Linear(16, 1)
    ids = torch.tensor([[1, 2, 3]])
    grads = []
    for in_place in (False, True):
        probe.zero_grad()
        hidden = model.get_input_embeddings()(ids)
        assert hidden.requires_grad and not hidden.is_leaf
        assert torch.equal(hidden, model.get_input_embeddings().weight[ids])  # the embedding's values, unchanged
        if in_place:
            hidden += 1.0
        else:
            hidden = hidden + 1.0
        probe(hidden).sum().backward()
        grads.append(probe.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    model.disable_input_require_grads()  # transformers' switch removes our hook too (train/accelerator_setup.py)
    assert not model.get_input_embeddings()(ids).requires_grad


def test_merge_folds_lora_on_a_tied_layer_or_refuses_it(tmp_path):
    """Zamba ties one attention block across its hybrid layers (stored once, under layers.2). LoRA named on it
    explicitly gives each place its own adapter: merge-adapters said "the adapter changes 7 tensor(s) the base does
    not have". Now: different LoRAs are refused naming the tie; the same LoRA on both places (what one module under
    two names trains) is merged once, equal to peft's merge of the adapter with only the stored place's LoRA."""
    from family_build import build
    from family_sweep import _move_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.errors import MergeError
    from hf_fsdp_qlora.loading.qlora import load_qlora_model
    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    base = build("zamba", tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = load_qlora_model(base, dtype=torch.bfloat16, lora_config=lora)
    _move_adapter(model)
    model.save_pretrained(tmp_path / "two")
    with pytest.raises(MergeError, match=r"ties model\.layers\.7\.shared_transf\.self_attn\.q_proj\.weight"):
        merge_adapters(base, tmp_path / "two", tmp_path / "out_two", progress=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if "layers.7.shared_transf" in name and "lora_" in name:
                param.copy_(params[name.replace("layers.7.", "layers.2.")])
    model.save_pretrained(tmp_path / "same")
    out = merge_adapters(base, tmp_path / "same", tmp_path / "out_same", progress=False)
    with torch.no_grad():
        for name, param in params.items():
            if "layers.7.shared_transf" in name and "lora_B" in name:
                param.zero_()
    model.save_pretrained(tmp_path / "once")
    key = "model.layers.2.shared_transf.self_attn.q_proj.weight"
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()[key]
    float_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ref = PeftModel.from_pretrained(float_base, tmp_path / "once").merge_and_unload().state_dict()[key]
    start = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()[key]
    assert not torch.equal(ref, start)
    eps = torch.finfo(torch.bfloat16).eps
    assert bool(((ours - ref).abs() <= 2 * eps * (ref.abs() + (ref - start).abs()) + 1e-30).all())
