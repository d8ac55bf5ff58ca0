"""Worker for tests/test_low_ram.py: train_scenarios.py with a `lowram` kind (load_qlora_model(low_cpu_ram=True)).

Besides what train_scenarios records, each rank writes lowram_<arch>_rank<N>.json: where its 4-bit weights were
before receiving (rank 0: read from the checkpoint), and a digest of every packed weight and quant state
after loading, for the test to compare across ranks.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import train_scenarios as base
from dist_utils import packed_digests

from hf_fsdp_qlora import load_qlora_model


def _build_model(path, kind):
    if kind not in ("lowram", "lowram_whole"):
        return ORIGINAL_BUILD(path, kind)
    # lowram_whole: a from_pretrained argument that only a whole load honours makes rank 0 load the whole model
    # (the fallback to streaming); the other ranks still receive only their rows.
    extra = {"device_map": {"": "cpu"}} if kind == "lowram_whole" else {}
    from hf_fsdp_qlora.errors import UnsupportedSetupError
    from hf_fsdp_qlora.loading._transfer import _FLAG_ATTR, _ROWS_ATTR
    from hf_fsdp_qlora.loading.low_ram import verify_partial_rows

    with _info_log() as load_log:
        model = load_qlora_model(
            path, lora_config=base.lora_config(), gradient_checkpointing=False, low_cpu_ram=True, **extra
        )
    out = Path(OUT)
    world = dist.get_world_size() if dist.is_initialized() else 1
    partial = any(getattr(m, _FLAG_ATTR, False) for m in model.modules())
    rank = base.rank()
    info = {
        "partial": partial,
        "holds_partial_rows": any(getattr(m, _ROWS_ATTR, None) for m in model.modules()),
        # Each rank hashes the rows it holds; the test compares them with a normal load's.
        "digests": packed_digests(model, rank, world if partial else None),
        "world_size": world,
        "meta_left": [n for n, p in model.named_parameters() if p.device.type == "meta"],
        "load_log": load_log,  # what the loader said (e.g. "the experts load in 16 bits before they are packed")
    }
    # Before FSDP2 has wrapped it, a rank with partial rows must refuse a forward, and the check must fail.
    # (Not tried on a rank holding the whole model: an eval-mode CPU forward may repack its 4-bit weights.)
    if info["holds_partial_rows"]:
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
    (out / f"lowram_{kind}_{Path(path).name}_rank{base.rank()}.json").write_text(json.dumps(info))
    return model, base.LossRecorder, None


@contextlib.contextmanager
def _info_log():
    """The package's INFO log lines while inside (its loggers are quiet by default)."""
    import logging

    lines, root = [], logging.getLogger("hf_fsdp_qlora")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, level = Keep(logging.INFO), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _timed_scenario(*args, **kwargs):
    """run_trainer_scenario with its wall and CPU seconds (this rank's process) in the result: the shared launches
    run every module's scenarios, and these figures say which ones the launch's time goes to (issue 33)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = ORIGINAL_RUN(*args, **kwargs)
    result["seconds"] = round(time.perf_counter() - wall, 2)
    result["cpu_s"] = round(time.process_time() - cpu, 2)
    return result


ORIGINAL_BUILD = base.build_model
ORIGINAL_RUN = base.run_trainer_scenario
OUT = sys.argv[sys.argv.index("--out") + 1]
base.build_model = _build_model  # run_trainer_scenario looks it up in train_scenarios' namespace
base.run_trainer_scenario = _timed_scenario  # so does main()

if __name__ == "__main__":
    Path(OUT).mkdir(parents=True, exist_ok=True)
    base.main()
    from dist_utils import exit_worker

    exit_worker()
