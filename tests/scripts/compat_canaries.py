"""Worker: stock upstream behaviours the compat registry (hf_fsdp_qlora/_compat/) works around, which need FSDP.

Launched once with 2 ranks: `accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml
compat_canaries.py OUT`. Only the CPU rehearsal hook (accelerate's FSDP decision on CPU) is ours; everything
measured is the stock path. Each canary records what happened; tests/test_compat.py asserts on it.
"""

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def _error_of(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error text is the finding
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


def fsdp1_cpu0():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return _error_of(lambda: FSDP(nn.Linear(4, 4), device_id=torch.device("cpu", 0)))


def fsdp1_internals():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")
    inner, head = nn.Linear(8, 8), nn.Linear(8, 2)
    total = sum(p.numel() for p in head.parameters())
    model = FSDP(nn.Sequential(FSDP(inner, device_id=cpu, use_orig_params=True), head), device_id=cpu,
                 use_orig_params=True)  # fmt: skip
    before = model._is_root
    model(torch.randn(2, 8)).sum().backward()
    flat = model._flat_param
    return {
        "is_root_before": before,
        "is_root_after": model._is_root,
        "is_flat_param": bool(getattr(flat, "_is_flat_param", False)),
        "numels_total": sum(flat._numels),
        "total_numel": total,
        "orig_param_dtype": str(model._handle._orig_param_dtype),
        "wrapped_names": any("_fsdp_wrapped_module." in n for n, _ in model.named_parameters()),
    }


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


def save_only_model(out):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out / "trainer"), save_only_model=True, use_cpu=True, report_to=[])
    return _error_of(lambda: Trainer(model=_tiny_llama(), args=args))


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fsdp2_amp(acc):
    model = nn.Sequential(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return {
        "fsdp2": acc.is_fsdp2,
        "has_original_forward": getattr(model, "_original_forward", None) is not None,
        "output_dtype": str(model(torch.randn(2, 8)).dtype),
        "models": len(acc._models),
        "optimizers": len(acc._optimizers),
    }


def _linear4bit(storage):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              quant_storage=storage)  # fmt: skip
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False,
                                     quant_type="nf4", quant_storage=storage)  # fmt: skip
    return layer.to("cpu")  # quantizes


class _Net(nn.Module):
    def __init__(self, storage):
        super().__init__()
        self.proj = _linear4bit(storage)
        self.head = nn.Linear(64, 2, dtype=torch.bfloat16)

    def forward(self, x):
        return self.head(self.proj(x))


def fsdp2_uint8(acc):
    from torch.distributed.tensor import DTensor

    model = _Net(torch.uint8)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = acc.prepare(model, opt)
    return {
        "dtensor": isinstance(model.proj.weight, DTensor),
        "warned": any("non-floating frozen Params4bit" in str(w.message) for w in caught),
    }


def sharded_merge(out):
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = get_peft_model(_Net(torch.bfloat16), LoraConfig(r=4, target_modules=["proj"]))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    save = _error_of(lambda: model.save_pretrained(str(out / f"adapter{dist.get_rank()}")))
    merge = _error_of(model.merge_and_unload)
    return {"merge_error": merge["error"], "save_error": save["error"]}


def fsdp1_upcast(acc):
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return {
        "fsdp_version": acc.state.fsdp_plugin.fsdp_version,
        "flat_dtype": str(model._flat_param.dtype),
        "orig_param_dtype": str(model._handle._orig_param_dtype),
    }


def main():
    out = Path(sys.argv[1])
    from accelerate import Accelerator
    from accelerate.state import PartialState

    from hf_fsdp_qlora import enable_cpu_fsdp

    enable_cpu_fsdp()  # ours: only accelerate's decision to run FSDP on CPU ranks
    state = PartialState()
    found = {}

    def record(name, fn, *args):
        try:
            found[name] = fn(*args)
        except Exception:  # noqa: BLE001 - reported, not raised: the other canaries still run
            found[name] = {"crash": traceback.format_exc()[-3000:]}

    record("fsdp1_cpu0", fsdp1_cpu0)
    record("fsdp1_internals", fsdp1_internals)
    record("save_only_model", save_only_model, out)  # the launch config: FSDP2, SHARDED_STATE_DICT
    record("sharded_merge", sharded_merge, out)

    _reset()
    os.environ.update(FSDP_ACTIVATION_CHECKPOINTING="false", FSDP_AUTO_WRAP_POLICY="NO_WRAP")
    acc = Accelerator(mixed_precision="bf16")
    record("fsdp2_amp", fsdp2_amp, acc)
    record("fsdp2_uint8", fsdp2_uint8, acc)

    _reset()
    os.environ.update(FSDP_VERSION="1", FSDP_USE_ORIG_PARAMS="true")
    acc = Accelerator(mixed_precision="bf16")
    record("fsdp1_upcast", fsdp1_upcast, acc)

    rank = dist.get_rank()
    if rank != 0:  # accelerate warns on the main process only
        found["fsdp2_uint8"].pop("warned", None)
    (out / f"rank{rank}.json").write_text(json.dumps(found, default=str))
    dist.barrier()
    state.destroy_process_group()


if __name__ == "__main__":
    main()
    from dist_utils import exit_worker

    exit_worker()
