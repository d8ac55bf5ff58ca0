"""Periodic checkpoints and resume under FSDP1 and FSDP2 (2 CPU ranks, gloo).

- a checkpoint holds the adapter gathered from all ranks plus optimizer/scheduler/RNG state, or only the
  adapter with save_only_model=True (sizes asserted from the files written);
- 3 steps + resume + 3 steps gives the same losses and adapter weights, bit for bit, as 6 steps;
- a rank SIGKILLed in the middle of a save leaves the previous checkpoint intact, and
  resume_from_checkpoint=True picks the newest complete one.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import accelerate_launch, check, read_results
from tiny_models import build_tiny_model

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "llama", "llama")
    return root


def _launch(version, mode, models, out, expect_ok=True, num_processes=None):
    proc = accelerate_launch(
        f"cpu_fsdp{version}_rehearsal.yaml",
        "resume_scenarios.py",
        "--models", str(models), "--out", str(out), "--fsdp-version", str(version), "--mode", mode,
        timeout=300, num_processes=num_processes,
    )  # fmt: skip
    if expect_ok:
        check(proc)
    return proc


@pytest.fixture(scope="module")
def launches(models, tmp_path_factory):
    """`get(version)`: (out, per-rank results, what the killed run left) of one launch per FSDP version, made on
    first use: resume, then the full fine-tune; under FSDP2 also the resume after a kill. The kill needs a launch of
    its own (rank 0 dies); what its folder held is recorded right after it, before the resume changes it."""
    made = {}

    def get(version):
        if version in made:
            return made[version]
        out = tmp_path_factory.mktemp(f"resume{version}")
        seen = None
        if version == 2:
            proc = _launch(2, "kill", models, out, expect_ok=False)
            run = out / "K"
            seen = {
                "returncode": proc.returncode,
                "ckpt2_adapter": (run / "checkpoint-2" / "adapter_model.safetensors").is_file(),
                "ckpt2_state": (run / "checkpoint-2" / "trainer_state.json").is_file(),
                "ckpt4": (run / "checkpoint-4").exists(),
                "ckpt4_staged": (run / ".incomplete-checkpoints" / "checkpoint-4").exists(),
            }
        _launch(version, "resume,full,after" if version == 2 else "resume,full", models, out)
        made[version] = out, read_results(out), seen
        return made[version]

    return get


@pytest.fixture(scope="module", params=[1, 2])
def resumed(request, launches):
    out, results, _ = launches(request.param)
    return request.param, out, results


@pytest.mark.parametrize("version", [1, 2])
def test_single_rank_save_and_resume(models, tmp_path, version):
    """One process (one GPU): FSDP1 turns FULL_SHARD into NO_SHARD, whose forward unregisters the frozen
    parameters, and FSDP's own state-dict hook then failed every save ("FSDP assumes ...base_layer.weight is
    in the state_dict"; seen on an H100). Saves, resume and the optimizer state must work there too."""
    proc = _launch(version, "resume", models, tmp_path, num_processes=1)
    found = read_results(tmp_path)
    assert list(found) == [0], proc.stdout[-2000:]
    engaged = found[0]["engaged"]
    assert (engaged["flat_params"] if version == 1 else engaged["fsdp2_modules"]) > 0, engaged
    assert found[0]["B_losses"] == found[0]["A_losses"][3:]
    weights = torch.load(tmp_path / "weights.pt")
    assert weights["A"] and all(torch.equal(v, weights["B"][k]) for k, v in weights["A"].items())


def test_resume_is_exact(resumed):
    _, out, results = resumed
    for found in results.values():
        assert len(found["A_losses"]) == 6 and len(found["B_losses"]) == 3
        assert found["B_losses"] == found["A_losses"][3:]
    weights = torch.load(out / "weights.pt")
    assert weights["A"].keys() == weights["B"].keys() and weights["A"]
    for name, value in weights["A"].items():
        assert torch.equal(value, weights["B"][name]), name


def _size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_checkpoint_contents_and_sizes(resumed):
    _, out, _ = resumed
    full, model_only = out / "A" / "checkpoint-3", out / "C" / "checkpoint-3"
    adapter = (full / "adapter_model.safetensors").stat().st_size
    assert adapter > 0 and (model_only / "adapter_model.safetensors").stat().st_size == adapter
    # With optimizer state: Adam keeps two moments per adapter parameter.
    assert (full / "optimizer_gathered.pt").stat().st_size >= 2 * adapter
    assert (full / "scheduler.pt").is_file() and (full / "rng_state_0.pth").is_file()
    # save_only_model=True: about the adapter's size, no optimizer, no FSDP model state.
    assert not any(p.name.startswith(("optimizer", "pytorch_model_fsdp")) for p in model_only.iterdir())
    assert _size(model_only) < adapter + 32 * 1024
    assert not (out / "A" / ".incomplete-checkpoints" / "checkpoint-3").exists()


def test_saved_checkpoint_adapter_loads_with_peft(resumed, models):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out, _ = resumed
    base = AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, out / "A" / "checkpoint-6")
    final = torch.load(out / "weights.pt")["A"]
    loaded = dict(model.named_parameters())
    assert final and all(torch.equal(loaded[n].float(), v) for n, v in final.items())


def test_kill_during_save_keeps_previous_checkpoint(launches):
    out, results, seen = launches(2)
    assert seen["returncode"] != 0  # rank 0 was SIGKILLed inside the step-4 save
    run = out / "K"
    assert seen["ckpt2_adapter"]
    assert seen["ckpt2_state"]
    assert not seen["ckpt4"], "a half-written checkpoint must not look complete"
    assert seen["ckpt4_staged"]
    for found in results.values():
        assert found["global_step"] == 6
        assert len(found["resumed_losses"]) == 4  # resumed from checkpoint-2: steps 3..6
    assert (run / "checkpoint-4").is_dir() and (run / "checkpoint-6").is_dir()


def test_full_finetune_checkpoint_forms(resumed):
    """Full fine-tune checkpoints: a whole safetensors model (FULL_STATE_DICT, the FSDP1 rehearsal config)
    or per-rank shards with the optimizer (SHARDED_STATE_DICT, the FSDP2 rehearsal config)."""
    version, out, _ = resumed
    ckpt = out / "F" / "checkpoint-2"
    assert (ckpt / "trainer_state.json").is_file()
    if version == 1:
        from transformers import AutoModelForCausalLM

        assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer_gathered.pt").is_file()
        AutoModelForCausalLM.from_pretrained(ckpt)
    else:
        shards = list((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))
        assert len(shards) == 2 and all(f.stat().st_size > 0 for f in shards)
        assert (ckpt / "optimizer_0").is_dir()
