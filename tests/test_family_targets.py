"""The rules behind four families the sweep (tests/test_families.py) builds since issue 48, on small modules:

- ``all-linear`` leaves out linear layers no gradient reaches (a module whose forward runs under ``torch.no_grad``,
  as DeepSeek-V3.2's and GLM-MoE-DSA's sparse-attention indexers do) and linear layers sharing one weight (Zamba's
  tied attention block), also when an MoE model's all-linear was resolved to a list of names first;
- the loader's input-gradient hook leaves the embedding output changeable in place (BLT adds to it).
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
    "a leaf Variable that requires grad is being used in an in-place operation". Ours hands on a tracked copy, and
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
        if in_place:
            hidden += 1.0
        else:
            hidden = hidden + 1.0
        probe(hidden).sum().backward()
        grads.append(probe.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    model.disable_input_require_grads()  # transformers' switch removes our hook too (train/accelerator_setup.py)
    assert not model.get_input_embeddings()(ids).requires_grad
