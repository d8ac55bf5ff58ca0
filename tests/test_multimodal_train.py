"""Issue 48: multimodal checkpoints train under FSDP2 on 2 gloo ranks with a 4-bit language model, through the routes
users take: trl's own ``sft.py`` (text; unchanged, from the installed trl) and trl's ``SFTTrainer`` with the model's
processor on image-text rows (tiny images made with PIL), both under ``-m hf_fsdp_qlora.run``.

One launch runs every (family, route) in turn (tests/scripts/multimodal_scenarios.py). For each: FSDP2 engaged; the
towers' blocks are FSDP units of their own (``_no_split_modules`` lists them, e.g. SigLIP's ``SiglipEncoderLayer``);
the towers hold no 4-bit layer, no LoRA and nothing trainable, in the compute dtype (bf16); the language model is
4-bit; every LoRA tensor moved. Before (the loader and hooks of hf_fsdp_qlora/towers.py absent): Gemma 3's vision
tower is quantized and adapted (``tower_4bit`` and ``tower_lora`` non-empty); Qwen3.5, Mllama and Llama 4 were not
reachable through ``load_qlora_model`` at all.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from dist_utils import CONFIGS, _fork_cmd, _run, check
from tiny_multimodal import (
    COMPOSITE,
    FAMILIES,
    PROCESSORS,
    TEXT_ONLY,
    build_multimodal,
    build_processor,
    build_text_only,
    build_tokenizer,
    llama4_image_config,
)

pytestmark = pytest.mark.distributed

# (family, route). "text": trl's own sft.py on the checkpoint; "llama4_text" is Llama 4's language model saved alone
# from Llama4ForCausalLM (the class AutoModelForCausalLM maps llama4 to), which sft.py loads as such. sft.py builds
# its processing class with AutoProcessor, which needs torchvision (not installed here) for Gemma 4 and Qwen3.5(-MoE)
# (their video processors have no other backend) and Llama 4 (its image processor): their text rows go through the
# same SFTTrainer given the tokenizer ("tokenizer"). "image": SFTTrainer with the processor on image-text rows.
# "pixels": image-text rows made without the processor (Llama 4's needs torchvision), pixel_values made with torch.
# "text-fsdp1": the run again under FSDP1 (Gemma 3; Llama4ForCausalLM, whose fused-head failure was the same there).
SFT_PY = ("gemma3", "mllama", "llama4_text")
JOBS = [
    *((f, "text" if f in SFT_PY else "tokenizer") for f in (*FAMILIES, "llama4_text")),
    *((f, "image") for f in PROCESSORS),
    ("llama4", "pixels"),
    ("gemma3", "text-fsdp1"),
    ("llama4_text", "text-fsdp1"),
]
# the class trl's loader picks (the checkpoint's `architectures`)
CLASS = {**COMPOSITE, "llama4_text": TEXT_ONLY["llama4"]}


def _text_data(folder: Path, rows: int = 16) -> Path:
    rng = random.Random(5)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": " ".join(f"t{rng.randrange(8, 500)}" for _ in range(rng.randint(4, 12)))})
             for _ in range(rows)]  # fmt: skip
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("multimodal")
    for family in sorted({f for f, _ in JOBS}):
        if family == "llama4_text":
            path = build_text_only(root / family, "llama4", dtype=torch.bfloat16)
        else:  # Llama 4 with a vision tower whose forward runs (its image job goes through it)
            config = llama4_image_config() if family == "llama4" else None
            path = build_multimodal(root / family, family, dtype=torch.bfloat16, config=config)
        build_processor(path, family) if family in PROCESSORS else build_tokenizer(path)
    out = root / "runs"
    rest = [str(out), ",".join(f"{f}:{r}" for f, r in JOBS), str(root),
            str(_text_data(root / "text"))]  # fmt: skip
    cmd = _fork_cmd("multimodal_scenarios.py", rest, 600, config=CONFIGS / "cpu_fsdp2_rehearsal.yaml")
    at = len(cmd) - len(rest) - 1  # before the script: fork_launch's `-m MODULE SCRIPT ARGS`
    check(_run([*cmd[:at], "-m", "hf_fsdp_qlora.run", *cmd[at:]], 600, None))
    return {job: torch.load(out / f"{job[0]}_{job[1]}" / "record_rank0.pt", weights_only=False) for job in JOBS}


TOWER_BLOCK = {"gemma3": "SiglipEncoderLayer", "gemma4": "Gemma4VisionEncoderLayer", "mllama": "MllamaVisionEncoderLayer",
               "qwen3_5": "Qwen3_5VisionBlock", "qwen3_5_moe": "Qwen3_5MoeVisionBlock",
               "llama4": "Llama4VisionEncoderLayer"}  # fmt: skip


@pytest.mark.parametrize("job", JOBS, ids=[f"{f}-{r}" for f, r in JOBS])
def test_trains_with_16bit_frozen_towers_sharded_in_their_own_units(records, job):
    family, route = job
    rec = records[job]
    assert "error" not in rec, rec.get("error")
    version = 1 if route.endswith("-fsdp1") else 2
    assert rec["distributed_type"] == "DistributedType.FSDP" and rec["version"] == version
    if version == 2:
        assert rec["engagement"]["fsdp2_modules"] > 0 and rec["engagement"]["dtensor_params"] > 0, rec["engagement"]
    else:
        assert rec["engagement"]["fsdp1_units"] > 0 and rec["engagement"]["flat_params"] > 0, rec["engagement"]
    assert rec["class"] == CLASS[family], rec
    # before (hf_fsdp_qlora/train/backbone.py absent), Llama 4 in either class: "'MoeCausalLMOutputWithPast' (or
    # 'Llama4CausalLMOutputWithPast') object has no attribute 'last_hidden_state'" in trl's fused LM head
    if family == "llama4_text":  # a language model alone: no tower
        assert rec["towers"] == [] and rec["language_4bit"] > 0 and rec["steps"] == 2
        return _all_lora_moved(rec)
    assert rec["towers"], rec
    assert rec["tower_4bit"] == [] and rec["tower_lora"] == [] and rec["tower_trainable"] == []
    assert rec["tower_dtypes"] == ["torch.bfloat16"] and rec["tower_params"] > 0
    # the towers' blocks are FSDP units of their own (FSDP2: "FSDP" + class; FSDP1: the wrapped class)
    assert any(kind.endswith(TOWER_BLOCK[family]) for kind in rec["tower_units"]), rec["tower_units"]
    if family == "gemma4":  # its audio tower's layers too
        assert any(kind.endswith("Gemma4AudioLayer") for kind in rec["tower_units"]), rec["tower_units"]
    print(f"{family} {route}: units {rec['units']}, tower units {rec['tower_units']}, towers {rec['towers']}")
    assert rec["language_4bit"] > 0
    assert rec["steps"] == 2
    if route in ("image", "pixels"):
        assert "pixel_values" in rec["batch_keys"], rec["batch_keys"]
    # Mllama's layer 1 is a cross-attention layer: text rows skip it (no image states), so its LoRA has no gradient
    idle = ".language_model.layers.1." if (family, route) == ("mllama", "text") else None
    _all_lora_moved(rec, idle)


def _all_lora_moved(rec, idle: str | None = None) -> None:
    moved = {n: not torch.equal(rec["init"][n], rec["final"][n]) for n in rec["init"] if "lora_B" in n}
    assert idle is None or not any(m for n, m in moved.items() if idle in n)
    moved = {n: m for n, m in moved.items() if idle is None or idle not in n}
    assert moved and all(moved.values()), [n for n, m in moved.items() if not m]
