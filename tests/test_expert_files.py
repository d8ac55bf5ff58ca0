"""Experts a base stores per expert in its original format, found with transformers' conversion mapping: a converter
source written as a regex (Kimi-Linear's ``\\.experts.*.w1.weight``) is read as transformers reads it (its ``*`` is
``.*``), not as a glob; merge-adapters raised "cannot tell which expert the base's tensor ... holds" on Kimi-Linear
and DeepSeek-V4 bases saved by ``save_pretrained``. The oracle: transformers' own ``from_pretrained`` of the base.

Single-process, a tiny model built from the family's config; no hub.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from family_build import build
from safetensors.torch import load_file


def test_experts_stored_per_expert_under_a_regex_source_map_to_the_loaded_tensors(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.experts.files import expert_file_slices
    from hf_fsdp_qlora.merge._base_model import meta_model

    path = build("kimi_linear", tmp_path / "m")
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert any(".block_sparse_moe.experts.1.w3.weight" in k for k in tensors)  # the original per-expert format
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    params = sorted(k for k in loaded if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
    assert params
    entries = {k: SimpleNamespace(shape=tuple(v.shape)) for k, v in tensors.items()}
    slices = expert_file_slices(meta_model(path), params, entries)
    for key in params:
        rebuilt = torch.zeros_like(loaded[key])
        for piece in slices[key]:
            target = rebuilt[piece.expert]
            if piece.dim is not None:
                target = target.narrow(piece.dim, piece.start, piece.stop - piece.start)
            target.copy_(tensors[piece.disk_key])
        assert torch.equal(rebuilt, loaded[key]), key
