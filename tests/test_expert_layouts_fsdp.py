"""Experts by declared layout (issue 48, item 1) under FSDP2: two families refused by their experts class name before
(Aria: transposed experts; MiniMax-M2) and DBRX (2-D expert stacks the loader fuses into a declared class,
hf_fsdp_qlora/experts/dbrx.py) train LoRA on their 4-bit experts in the suite's shared FSDP2 launch
(tests/conftest.py ``shared_launch``; the worker is tests/scripts/train_scenarios.py's ``expertlora`` kind). The
single-process checks of every declared family are in tests/test_expert_layouts.py (kept apart: a file sharing the
launch runs in the launch's worker).
"""

from __future__ import annotations

import pytest
import torch
from test_trainer_fsdp import _assert_adapter_equals
from tiny_models import DECLARED_MOE_ARCHS, FUSED_MOE_ARCHS

from hf_fsdp_qlora import load_qlora_model

# --- two ranks: FSDP2, in the suite's shared launch (tests/conftest.py shared_launch) ----------------------------

SCENARIO_ARCHS = {
    **{f"declared_{arch}": arch for arch in DECLARED_MOE_ARCHS},
    **{f"fused_{arch}": arch for arch in FUSED_MOE_ARCHS},
}
SHARED_TRAIN_SCENARIOS = {2: {name: (arch, "expertlora") for name, arch in SCENARIO_ARCHS.items()}}


@pytest.mark.distributed
@pytest.mark.parametrize("name", SCENARIO_ARCHS)
def test_fsdp2_trains_lora_on_declared_4bit_experts(shared_launch, name):
    """Two families that were refused by class name before, and DBRX's fused experts, trained under FSDP2 with LoRA
    on their 4-bit experts: FSDP engaged, the packed experts sharded and unchanged by training, step-0 loss and
    logits equal the single-process run on the same global batch, every expert LoRA tensor moved, the adapter saved
    in peft's format."""
    import train_scenarios as worker  # tests/scripts: on the path once test_trainer_fsdp is imported

    arch = SCENARIO_ARCHS[name]
    models, out, results, _ = shared_launch(2)
    r0, r1 = results[0][name], results[1][name]
    for r in (r0, r1):
        assert r.get("ok"), r.get("traceback")
        assert r["distributed_type"] == "DistributedType.FSDP" and r["is_fsdp2"]
        assert r["engagement"]["dtensor_params"] > 0, r["engagement"]
    assert r0["init_checksum"] == r1["init_checksum"]
    full, local = r0["expert_bytes_before_wrap"], [r0["expert_bytes_local"], r1["expert_bytes_local"]]
    assert sum(local) == full and all(0 < b < full for b in local), local
    assert r0["expert_digest_after_training"] == r0["expert_digest_before_wrap"] is not None
    weights = torch.load(out / name / "weights.pt")
    experts_lora = [k for k in weights["init"] if ".experts." in k]
    assert experts_lora, sorted(weights["init"])[:10]
    model = load_qlora_model(
        str(models / arch), lora_config=worker.expert_lora_config(models / arch), gradient_checkpointing=False
    )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in weights["init"].items():
            params[key].copy_(value.to(params[key].dtype))
    model.train()
    for rank, chunk in enumerate(torch.tensor(r0["first_batch"]).split(worker.BATCH)):
        oracle = model(input_ids=chunk, labels=chunk, attention_mask=torch.ones_like(chunk))
        assert r0["step0_losses"][rank] == pytest.approx(float(oracle.loss), rel=1e-6)
        logits = torch.load(out / name / f"logits_rank{rank}.pt")
        torch.testing.assert_close(logits, oracle.logits.detach().float(), rtol=1e-5, atol=1e-5)
    lora_b = [k for k in experts_lora if "lora_B" in k]
    assert lora_b and len(lora_b) * 2 == len(experts_lora), experts_lora
    still = [k for k in experts_lora if torch.equal(weights["trained"][k], weights["init"][k].float())]
    assert not still, still  # every expert lora_A and lora_B moved: the expert adapters trained
    _assert_adapter_equals(out / name / "adapter", weights, models / arch)
