"""Worker for tests/test_finish.py: one rank of a 2-rank gloo group (plain processes, tcp:// rendezvous) that ends
its script the way the examples and `python -m hf_fsdp_qlora.run` do.

--case tail: rank 0 runs a tail of its own (a push_to_hub, a merge) longer than the group's collective timeout;
             rank 1 is done at once. Run under `-m hf_fsdp_qlora.run`, whose exit ends it.
--case exit: rank 0 leaves a non-daemon thread running (push_to_hub(blocking=False)) and an idle thread pool
             open (vLLM's engine leaves one), and returns 0; rank 1's
             main() has no return (None). Ends with `finish_distributed(main())`, as the examples do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

TIMEOUT_S = 5  # the process group's collective timeout
TAIL_S = TIMEOUT_S + 3
_POOLS = []


def _wait_for_peer(out: Path, case: str, rank: int) -> None:
    """Start the rendezvous only when both ranks have imported torch, so the short timeout is spent on nothing else
    (the two processes start seconds apart on a loaded machine)."""
    (out / f"{case}_ready{rank}").touch()
    deadline = time.time() + 240
    while not (out / f"{case}_ready{1 - rank}").exists():
        assert time.time() < deadline, "the other rank never started"
        time.sleep(0.05)


def main(args) -> int | None:
    import torch
    import torch.distributed as dist

    out = Path(args.out)
    rank = int(os.environ["RANK"])
    _wait_for_peer(out, args.case, rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    total = torch.ones(1)
    dist.all_reduce(total)  # the training: both ranks take part
    assert total.item() == 2
    if args.case == "tail" and rank == 0:
        time.sleep(TAIL_S)
        print(f"rank 0: tail of {TAIL_S} s done", flush=True)
    if args.case == "exit":
        if rank == 1:
            return None

        def upload():
            time.sleep(2)
            (out / "upload_done").write_text("uploaded")

        threading.Thread(target=upload, daemon=False).start()
        # An idle thread pool left open, as vLLM's engine leaves one: its worker is a non-daemon thread too (kept
        # referenced: a collected pool's worker ends by itself).
        _POOLS.append(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        _POOLS[-1].submit(int).result()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["tail", "exit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    parsed = parser.parse_args()
    result = main(parsed)
    if parsed.case == "exit":
        from hf_fsdp_qlora import finish_distributed

        finish_distributed(result)
    # case tail: the script simply ends; `python -m hf_fsdp_qlora.run` finishes the process
