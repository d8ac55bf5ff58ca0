"""Low CPU-RAM loading (load_qlora_model(low_cpu_ram=True)): rank 0 reads the checkpoint, the others receive.

One 2-rank launch (accelerate + the shipped CPU FSDP2 config) of the trainer scenarios with the low-RAM
loader. Every rank ends with the same packed bytes and quant states, FSDP2 engages and shards every 4-bit
weight, and the first-step logits equal a normal single-process load's bit for bit.
"""

from __future__ import annotations

import sys

import pytest

from dist_utils import SCRIPTS, assert_first_logits_equal, packed_digests
from tiny_models import build_tiny_model

sys.path.insert(0, str(SCRIPTS))

pytestmark = pytest.mark.distributed

# lw: rank 0 cannot stream (a from_pretrained argument only a whole load honours) and loads the whole model.
SCENARIOS = {
    "lr": ("llama", "lowram"),
    "lt": ("llama_tied", "lowram"),
    "lq": ("qwen2", "lowram"),
    "lw": ("llama", "lowram_whole"),
    # DBRX: rank 0 streams its 2-D expert stacks into the fused experts (hf_fsdp_qlora/experts/dbrx.py) and packs
    # them; rank 1 receives the packed bytes into a stand-in skeleton fused the same way (experts/stream.py).
    "ld": ("dbrx", "lowram"),
}
# With 4-bit experts (the default) every rank receives whole tensors, not its rows (loading/low_ram.py): the rows
# tests are the dense models'.
PARTIAL = sorted(name for name in SCENARIOS if name != "ld")


# Run in the suite's shared FSDP2 launch (tests/conftest.py), with other modules' trainer scenarios.
SHARED_TRAIN_SCENARIOS = {2: SCENARIOS}


@pytest.fixture(scope="module")
def run(shared_launch):
    import json

    models, out, results, proc = shared_launch(2)

    def read(name, path):  # absent when the scenario failed before its load ended: its own tests show the traceback
        return json.loads(path.read_text()) if path.exists() else {"missing": str(path), **results[0].get(name, {})}

    lowram = {
        name: {r: read(name, out / f"lowram_{kind}_{arch}_rank{r}.json") for r in (0, 1)}
        for name, (arch, kind) in SCENARIOS.items()
    }
    return models, out, results, lowram, proc


@pytest.mark.parametrize("name", PARTIAL)
def test_each_rank_holds_its_rows_of_a_normal_load(run, name):
    """Rank 0 streamed the checkpoint: each rank holds exactly the packed rows FSDP2 keeps on it, bit for bit
    those of a normal single-process load, and every quant state whole."""
    from hf_fsdp_qlora import load_qlora_model

    models, _, _, lowram, _ = run
    arch = SCENARIOS[name][0]
    found = lowram[name]
    assert found[0]["world_size"] == 2 and found[0]["partial"] and found[1]["partial"]
    oracle = load_qlora_model(str(models / arch), gradient_checkpointing=False)
    expected = {rank: packed_digests(oracle, rank, 2) for rank in (0, 1)}
    assert expected[0] and expected[0] != expected[1]  # different rows: the comparison can fail
    for rank in (0, 1):
        assert found[rank]["digests"] == expected[rank], rank
        assert found[rank]["meta_left"] == []


@pytest.mark.parametrize("name", PARTIAL)
def test_partial_rank_refuses_use_before_fsdp2_wrapped_it(run, name):
    _, _, _, lowram, _ = run
    found = lowram[name]
    streamed = name != "lw"  # rank 0 streamed the checkpoint and kept only its own rows too
    assert found[0]["holds_partial_rows"] is streamed and found[1]["holds_partial_rows"]
    for rank in (0, 1) if streamed else (1,):
        assert "holds only its FSDP2 shard" in found[rank]["forward_before_wrap"]
        assert "wrapped differently" in found[rank]["verify_before_wrap"]
    if not streamed:  # rank 0 holds the whole model: nothing to refuse, and it joins the others' refusal
        assert found[0]["verify_before_wrap"].startswith("peer: ")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fsdp2_engaged_and_4bit_sharded(run, name):
    _, _, results, _, _ = run
    for rank in (0, 1):
        found = results[rank][name]
        assert found["ok"], found.get("traceback")
        assert found["is_fsdp2"] and "FSDP" in found["distributed_type"]
        assert found["packed_count"] > 0 and found["packed_dtensor"] == found["packed_count"]
        assert found["packed_local_bytes"] * 2 == found["packed_full_bytes"]
        assert found["mp_param_dtype"] in found["packed_dtypes"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_logits_equal_normal_load_bit_for_bit(run, name):
    import train_scenarios as worker

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.dtypes import harmonize_dtypes, training_dtype, view_packed_storage_as

    models, out, results, _, _ = run
    arch, _ = SCENARIOS[name]
    # The oracle: a normal single-process load. LoRA B starts at zero, so the random A does not matter.
    model = load_qlora_model(str(models / arch), lora_config=worker.lora_config(), gradient_checkpointing=False)
    dtype = training_dtype(model)
    view_packed_storage_as(model, dtype)
    harmonize_dtypes(model, dtype)
    model.train()  # an eval-mode no_grad forward would repack the weights for the CPU kernel (see hf_fsdp_qlora/_bnb_cpu.py)
    assert_first_logits_equal(model, out, name, results[0][name]["first_batch"], worker.BATCH)


def test_single_process_falls_back_to_normal_load(tmp_path, caplog):
    import logging

    from hf_fsdp_qlora import load_qlora_model

    path = build_tiny_model(tmp_path / "m", "llama")
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora.loading.low_ram"):
        model = load_qlora_model(str(path), gradient_checkpointing=False, low_cpu_ram=True)
    assert any("single process" in r.message for r in caplog.records)
    assert sum(type(p).__name__ == "Params4bit" for p in model.parameters()) > 0


def test_dbrx_experts_received_equal_rank_0_and_a_plain_load(run):
    """DBRX under low_cpu_ram: the 4-bit experts rank 1 received equal rank 0's streamed and fused ones byte for
    byte, and a plain single-process load's (load_qlora_model without low_cpu_ram); FSDP2 shards them, half each,
    and training leaves them unchanged."""
    import hashlib

    import torch
    import train_scenarios as worker

    from hf_fsdp_qlora import load_qlora_model

    models, _, results, _, _ = run
    r0, r1 = results[0]["ld"], results[1]["ld"]
    assert r0["ok"] and r1["ok"], (r0.get("traceback"), r1.get("traceback"))
    _, _, _, lowram, _ = run
    for rank in (0, 1):  # streamed: rank 0 never held 16-bit experts, rank 1 received packed bytes
        assert not [line for line in lowram["ld"][rank]["load_log"] if "16 bits" in line], lowram["ld"][rank]
    assert r0["expert_digest_before_wrap"] == r1["expert_digest_before_wrap"] is not None
    assert r0["expert_digest_after_training"] == r1["expert_digest_after_training"] == r0["expert_digest_before_wrap"]
    plain = load_qlora_model(str(models / "dbrx"), lora_config=worker.lora_config(), gradient_checkpointing=False)
    packed = {n: p for n, p in plain.named_parameters() if n.endswith("_proj_4bit")}
    assert {n.rpartition(".")[2] for n in packed} == {"gate_up_proj_4bit", "down_proj_4bit"}, sorted(packed)
    sha = hashlib.sha256()
    for name in sorted(packed):  # as tests/scripts/train_scenarios.py's expert_digest hashes them
        sha.update(packed[name].detach().clone().view(torch.uint8).numpy().tobytes())
    assert r0["expert_digest_before_wrap"] == sha.hexdigest()
    full = r0["expert_bytes_before_wrap"]
    assert full > 0 and r1["expert_bytes_before_wrap"] == full
    assert [r0["expert_bytes_local"], r1["expert_bytes_local"]] == [full // 2, full // 2]
    assert r0["expert_bytes_dtensor"] == full // 2
