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


def _digest(model, rank: int, world: int | None) -> dict:
    """sha1 of each 4-bit weight's packed bytes and of every tensor/field of its quant state.

    `world`: the model holds partial rows (an FSDP2 launch): hash only the bytes FSDP2 keeps on `rank`.
    """
    from hf_fsdp_qlora.low_ram import _row_bytes

    found = {}
    for name, param in model.named_parameters():
        if type(param).__name__ != "Params4bit":
            continue
        data = param.data.contiguous().reshape(-1).view(torch.uint8)
        if world:
            first, end, _ = _row_bytes(tuple(param.shape), param.dtype, rank, world)
            data = data[first:end]
        h = hashlib.sha1(data.numpy().tobytes())
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
    from hf_fsdp_qlora.errors import UnsupportedSetupError
    from hf_fsdp_qlora.low_ram import _FLAG_ATTR, verify_partial_rows

    model = load_qlora_model(path, lora_config=base.lora_config(), gradient_checkpointing=False, low_cpu_ram=True)
    out = Path(OUT)
    world = dist.get_world_size() if dist.is_initialized() else 1
    partial = any(getattr(m, _FLAG_ATTR, False) for m in model.modules())
    rank = base.rank()
    info = {
        "partial": partial,
        # rank 0 hashes every rank's rows, each other rank its own: the test compares them.
        "digests": {r: _digest(model, r, world if partial else None) for r in (range(world) if rank == 0 else [rank])},
        "world_size": world,
        "meta_left": [n for n, p in model.named_parameters() if p.device.type == "meta"],
    }
    # Before FSDP2 has wrapped it, a rank with partial rows must refuse a forward, and the check must fail.
    if rank != 0:
        try:
            model(input_ids=torch.tensor([[1, 2, 3]]))
            info["forward_before_wrap"] = "ran"
        except RuntimeError as err:
            info["forward_before_wrap"] = str(err)
    try:
        verify_partial_rows(model)
        info["verify_before_wrap"] = "passed"
    except UnsupportedSetupError as err:
        info["verify_before_wrap"] = str(err)
    except RuntimeError as err:  # the other rank's refusal, raised here by agree_on_failure
        info["verify_before_wrap"] = "peer: " + str(err)
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
