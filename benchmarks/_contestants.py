"""One launch that trains several contestants of a benchmark in turn (the benchmarks' `--worker A,B` form, which the
smoke tests reach through `--one-launch`): each rank writes OUT/NAME/rankR.json per contestant."""

from __future__ import annotations

import json
import os
from pathlib import Path


def run_contestants(names: str, train_one, args, out_dir) -> None:
    """`train_one(name, args)` for each comma-separated name, its figures written as this rank's JSON, then exit."""
    import torch

    for name in names.split(","):
        found = train_one(name, args)
        out = Path(out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{found['rank']}.json").write_text(json.dumps(found))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # gloo/FSDP teardown at interpreter exit sometimes aborts after the work is done; the JSON is written
