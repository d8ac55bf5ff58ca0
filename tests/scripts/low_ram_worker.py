"""Worker for tests/test_low_ram.py: train_scenarios.py with a `lowram` kind (load_qlora_model(low_cpu_ram=True)).

Besides what train_scenarios records, each rank writes lowram_<arch>_rank<N>.json: where its 4-bit weights were
before receiving (rank 0: read from the checkpoint), and a digest of every packed weight and quant state
after loading, for the test to compare across ranks.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as base

from hf_fsdp_qlora import load_qlora_model


def _digest(model) -> dict:
    """sha1 of each 4-bit weight's packed bytes and of every tensor/field of its quant state."""
    found = {}
    for name, param in model.named_parameters():
        if type(param).__name__ != "Params4bit":
            continue
        h = hashlib.sha1(param.data.contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(param.quant_state.as_dict(packed=False).items()):
            h.update(key.encode())
            h.update(
                value.contiguous().view(torch.uint8).numpy().tobytes()
                if torch.is_tensor(value)
                else repr(value).encode()
            )
        found[name] = h.hexdigest()
    return found


def _build_model(path, kind):
    if kind != "lowram":
        return ORIGINAL_BUILD(path, kind)
    model = load_qlora_model(path, lora_config=base.lora_config(), gradient_checkpointing=False, low_cpu_ram=True)
    out = Path(OUT)
    info = {
        "digests": _digest(model),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "meta_left": [n for n, p in model.named_parameters() if p.device.type == "meta"],
    }
    (out / f"lowram_{Path(path).name}_rank{base.rank()}.json").write_text(json.dumps(info))
    return model, base.LossRecorder, None


ORIGINAL_BUILD = base.build_model
OUT = sys.argv[sys.argv.index("--out") + 1]
base.build_model = _build_model  # run_trainer_scenario looks it up in train_scenarios' namespace

if __name__ == "__main__":
    Path(OUT).mkdir(parents=True, exist_ok=True)
    base.main()
    from dist_utils import exit_worker

    exit_worker()
