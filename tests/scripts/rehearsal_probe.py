"""Worker: what accelerate does on CPU with an FSDP config, without and then with our rehearsal hook."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    out = Path(sys.argv[1])
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    found = {}
    # 1. Upstream alone (no hf_fsdp_qlora imported yet).
    acc = Accelerator()
    found["upstream_distributed_type"] = str(acc.state.distributed_type)
    found["upstream_num_processes"] = acc.num_processes
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

    # 2. With the hook.
    from hf_fsdp_qlora import enable_cpu_fsdp
    from hf_fsdp_qlora.train.fsdp import fsdp_engagement

    enable_cpu_fsdp()
    acc = Accelerator()
    found["ours_distributed_type"] = str(acc.state.distributed_type)
    found["ours_num_processes"] = acc.num_processes
    found["ours_device"] = str(acc.device)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    found["engagement"] = fsdp_engagement(model)
    loss = model(torch.randn(4, 8)).sum()
    acc.backward(loss)
    opt.step()
    found["trained"] = True
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))
    dist.barrier()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
    from dist_utils import exit_worker

    exit_worker()
