"""A Llama of any shape, NF4-quantized layer by layer in memory, with LoRA: for shapes whose bf16 checkpoint would
not fit the disk (70B is 140 GB in bf16; the GPU machine has 64 GB of disk). Random weights, nothing downloaded.

Each decoder linear is drawn in bf16 on the device and quantized at once (bitsandbytes ``Params4bit``: NF4, double
quantization, bf16 storage, as :func:`hf_fsdp_qlora.load_qlora_model` makes them), so the peak is the 4-bit model
plus one bf16 weight. LoRA r on all linear layers in bf16, activation checkpointing as the loader sets it.
"""

from __future__ import annotations

import torch


def build_quantized_llama(shape: dict, device: str, lora_r: int, checkpointing: bool = True):
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    bf16 = torch.bfloat16
    config = LlamaConfig(**shape, max_position_embeddings=131072)
    config.dtype = bf16
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                weight = torch.randn(child.out_features, child.in_features, dtype=bf16, device=device) * 0.02
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=bf16,
                                      compress_statistics=True, quant_type="nf4", quant_storage=bf16, device="meta")  # fmt: skip
                q.weight = bnb.nn.Params4bit(weight.cpu() if device == "cpu" else weight, requires_grad=False,
                                             compress_statistics=True, quant_type="nf4", quant_storage=bf16).to(device)  # fmt: skip
                q.support_avx512bf16_for_cpu = False  # the CPU repack trap (see FACTS): one kernel path
                setattr(parent, name, q)
                del weight
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                value = torch.ones(p.shape, dtype=bf16, device=device) if p.dim() == 1 else (
                    torch.randn(p.shape, dtype=bf16, device=device) * 0.02)  # fmt: skip
                setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    with torch.device(device):  # its inv_freq buffer was made on meta with the rest
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if config.tie_word_embeddings:
        model.tie_weights()
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(device=device, dtype=bf16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model
