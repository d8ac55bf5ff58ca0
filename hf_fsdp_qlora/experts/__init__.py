"""Mixture-of-experts weights: where each family keeps its fused experts, their 4-bit storage and compute, their
streamed loading, and LoRA on them. Below loading/, merge/, doctor/ and train/, which all use it; none of them is
imported here.

The modules, each importing only those above it in this list (tests/test_layout.py checks the order):

* ``layouts``: where each family keeps its fused expert weights (names, shapes, gate, call);
* ``routers``: the linear layers that score the experts (never LoRA targets of "all-linear");
* ``files``: where a checkpoint's files hold the fused expert parameters (whole or per expert);
* ``detect``: whether a config builds fused experts, read on meta;
* ``lora_rows``: one routed expert's LoRA rows, for the per-expert loop;
* ``grouped``: grouped compute (one dequantization and one grouped matmul per projection);
* ``quantized``: the 4-bit experts module (:class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts`) and the swap;
* ``placement``: loading onto a GPU without the 16-bit experts landing there whole;
* ``stream``: the experts read from the safetensors shards into 4 bits one layer at a time;
* ``script_stream``: the same stream for unchanged scripts' ``from_pretrained`` under ``-m hf_fsdp_qlora.run``;
* ``targets``: "all-linear" on a mixture of experts spelled out as its linear layers;
* ``stock_reload``: adapters saved in a form stock peft reloads as trained;
* ``lora``: LoRA on 4-bit experts in peft's own format (``target_parameters``).
"""

# Registers expert LoRA's peft hook with the 4-bit experts module (quantized.ON_BUILD) before anything can build
# one: importing any module of experts/ runs this first (a process that only calls quantize_experts gets peft's
# loaders adapting 4-bit experts, as docs/moe.md says). lora imports only modules above it in the list.
from . import lora  # noqa: F401
