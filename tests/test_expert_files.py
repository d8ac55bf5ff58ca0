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


def test_reordered_expert_tensors_map_both_ways_and_through_lora_factors():
    """A fused tensor stored in another order (Inkling 2's interleaved gate/up rows, a transposed one): the stored
    tensor read in the model's order is what transformers' own operation gives, written back it is the stored one,
    and an update given as low-rank factors, moved to the stored order on its factors, is the stored order of the
    update (so the merge writes the base's own layout)."""
    from transformers.core_model_loading import Chunk, Interleave, MergeModulelist, Transpose

    from hf_fsdp_qlora.experts.orders import reorder_of

    generator = torch.Generator().manual_seed(0)
    cases = [
        ([Interleave(dim=1)], (3, 8, 6), (3, 8, 6)),  # Inkling 2's w13_weight: rows
        ([Interleave(dim=2)], (3, 8, 6), (3, 8, 6)),  # columns
        ([Interleave(dim=0)], (8, 6), (8, 6)),  # a 2-D weight's rows
        ([Transpose(1, 2)], (3, 6, 8), (3, 8, 6)),  # stored [experts, in, out]
        ([Interleave(dim=2), Transpose(1, 2)], (3, 6, 8), (3, 8, 6)),
    ]
    for ops, disk_shape, model_shape in cases:
        reorder = reorder_of(ops, disk_shape, model_shape)
        assert reorder is not None, ops
        stored = torch.randn(disk_shape, generator=generator)
        expected = stored
        for op in ops:
            expected = next(iter(op.convert({"k": expected}, source_patterns=["k"], target_patterns=["k"]).values()))
        assert torch.equal(reorder.to_model(stored), expected) and not torch.equal(
            expected.reshape(-1), stored.reshape(-1)
        )
        assert torch.equal(reorder.to_disk(expected), stored)
        left = torch.randn((*model_shape[:-1], 2), generator=generator)
        right = torch.randn((*model_shape[:-2], 2, model_shape[-1]), generator=generator)
        disk_left, disk_right = reorder.factors_to_disk(left, right)
        torch.testing.assert_close(disk_left @ disk_right, reorder.to_disk(left @ right))
    # Not a reordering of each expert's matrix: left to the per-expert mapping (or refused)
    assert reorder_of([Interleave(dim=0)], (4, 8, 6), (4, 8, 6)) is None  # across experts
    assert reorder_of([Chunk(dim=0)], (8, 6), (4, 6)) is None
    assert reorder_of([MergeModulelist(dim=0)], (8, 6), (1, 8, 6)) is None
    assert reorder_of([Transpose(1, 2, check_dims=True)], (3, 8, 6), (3, 8, 6)).ops == ()  # already the model's shape
