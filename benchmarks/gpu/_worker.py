"""Worker of the GPU check: runs the scenarios of one spec file in one process, one JSON line each.

    python benchmarks/gpu/_worker.py SPEC.json                       # no FSDP (the single-GPU user's python)
    python -m accelerate.commands.launch --config_file fsdp2_qlora.yaml --num_processes 1 \
        benchmarks/gpu/_worker.py SPEC.json                          # under a shipped accelerate config

Each scenario's result is appended to ``results-rank<R>.jsonl`` in the spec's ``out`` as soon as it is done, so a
launch killed by its timeout (or by a CUDA error that poisons the process) still reports what came before. A CUDA
out-of-memory error is caught and reported as ``"status": "oom"``. Scenario kinds: ``ours`` (load_qlora_model +
FSDPQLoRATrainer), ``stock`` (benchmarks/_throughput_worker.py's stock recipe + transformers.Trainer), ``merge``
(merge_adapters against peft's merge), ``built`` (a Llama shape quantized in memory, too big for the disk as bf16),
``seq_capacity`` (bisection of the longest sequence), ``torchtune`` (its single-device QLoRA, when installed), and
``adapter_dtype`` / ``moe_layer`` (_worker_stages.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from argparse import Namespace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks"), str(ROOT)]

import _worker_stages  # benchmarks/gpu/ is on sys.path (above)
import torch
from _throughput_worker import _vm_kib  # benchmarks/ is on sys.path (above)

import hf_fsdp_qlora  # noqa: F401  (CPU rehearsal hook before any accelerate state exists)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def dataset(sc: dict, vocab: int, world: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (sc["steps"] * sc["batch"] * world, sc["seq"]), generator=gen)
    return [{"input_ids": r, "labels": r} for r in ids]


def lora_config(r: int):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def recipe(sc: dict) -> str:
    """ "stock" or "ours": the recipe a scenario trains with (``seq_capacity`` names it in ``recipe``)."""
    return sc.get("recipe", "stock" if sc["kind"] == "stock" else "ours")


def run_build(sc: dict, spec: dict) -> dict:
    """Save a random bf16 Llama of ``shape`` to the spec's model folder, made on this device (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(LlamaConfig(**sc["shape"], max_position_embeddings=131072))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(spec["model"])
    return {"parameters": sum(p.numel() for p in model.parameters())}


def load(sc: dict, spec: dict):
    """The scenario's model: ours (our loader), stock (the throughput benchmark's stock recipe) or built."""
    if sc.get("shape"):
        from quantized_build import build_quantized_llama

        return build_quantized_llama(sc["shape"], DEVICE, sc["lora_r"], sc.get("checkpointing", True))
    if recipe(sc) == "stock":
        import _throughput_worker as tw

        return tw._load(Namespace(contestant="stock", model=spec["model"], lora_r=sc["lora_r"]), torch)
    from hf_fsdp_qlora import load_qlora_model

    torch.manual_seed(0)
    extra = {"adapter_dtype": sc["adapter_dtype"]} if sc.get("adapter_dtype") else {}  # _worker_stages.py checks it
    return load_qlora_model(spec["model"], dtype=torch.bfloat16, lora_config=lora_config(sc["lora_r"]),
                            gradient_checkpointing=sc.get("checkpointing", True), **extra)  # fmt: skip


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward (the CPU stand-in for a CUDA peak in dry runs)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        def pack(t):
            self.bytes += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def train(sc: dict, spec: dict, model) -> dict:
    """A few steps of `model` through our trainer (or transformers.Trainer for stock); figures of the steady steps."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments
    from hf_fsdp_qlora.train.fsdp import fsdp_engagement

    world = int(os.environ.get("WORLD_SIZE", "1"))
    found: dict = {"losses": []}
    warmup = sc.get("warmup", 1)

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            found["engaged"] = fsdp_engagement(model)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                found["losses"].append(float(logs["loss"]))

        def on_step_end(self, args, state, control, **kw):
            if CUDA:
                torch.cuda.synchronize()
            if state.global_step == warmup:
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                found["t0"] = time.perf_counter()
            if state.global_step == sc["steps"]:
                found["t1"] = time.perf_counter()

    common = {"output_dir": str(Path(spec["out"]) / "trainer" / sc["name"]), "max_steps": sc["steps"],
                  "per_device_train_batch_size": sc["batch"], "learning_rate": sc.get("lr", 1e-4), "logging_steps": 1, "report_to": [],
                  "save_strategy": "no", "seed": 0, "bf16": True, "use_cpu": not CUDA, "disable_tqdm": True,
                  "dataloader_drop_last": True, "remove_unused_columns": False}  # fmt: skip
    if recipe(sc) == "stock":
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer_cls, args = Trainer, TrainingArguments(**common)
    elif sc["kind"] == "callback":  # the stock Trainer with our callback: the route for Trainer subclasses
        trainer_cls, args = Trainer, TrainingArguments(**common)
    else:
        trainer_cls, args = FSDPQLoRATrainer, FSDPQLoRATrainingArguments(**common, **sc.get("options", {}))
    data = dataset(sc, model.config.vocab_size, world)
    callbacks = [Probe()]
    if sc["kind"] == "callback":
        from hf_fsdp_qlora import FSDPQLoRACallback

        callbacks.append(FSDPQLoRACallback())
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=callbacks)
    found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    # A Python hook runs for every tensor autograd saves: only the CPU stand-in for a memory peak turns it on, never
    # a timed GPU run (``saved_tensor_hooks`` in the result says which).
    counting = bool(sc.get("count_saved")) and not CUDA
    with SavedBytes() if counting else contextlib.nullcontext() as saved:
        trainer.train()
    found["saved_tensor_hooks"] = counting
    if counting:
        found["saved_for_backward_bytes_per_step"] = saved.bytes // sc["steps"]
    if "t0" in found and "t1" in found:
        seconds = found.pop("t1") - found.pop("t0")
        found["s_per_step"] = seconds / (sc["steps"] - warmup)
        found["tokens_per_s"] = (sc["steps"] - warmup) * sc["batch"] * sc["seq"] * world / seconds
    if CUDA:
        found["max_allocated"] = torch.cuda.max_memory_allocated()
        found["max_reserved"] = torch.cuda.max_memory_reserved()
    else:
        found["peak_rss"] = _vm_kib("VmHWM") * 1024
    found["_trainer"] = trainer
    return found


def _lora_key(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", ".default"):
        name = name.replace(junk, "")
    return name


def live_adapter(model) -> dict:
    """The trained LoRA tensors gathered from the live model (DTensor.full_tensor / FSDP1 summon_full_params)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = any(isinstance(m, FSDP) for m in model.modules())
    if fsdp1:
        ctx = FSDP.summon_full_params(model, writeback=False)
    else:
        ctx = contextlib.nullcontext()
    out = {}
    with ctx:
        for name, p in model.named_parameters():
            if "lora_" in name:
                t = p.full_tensor() if hasattr(p, "full_tensor") else p
                out[_lora_key(name)] = t.detach().to("cpu", copy=True)
    return out


def run_ours(sc: dict, spec: dict) -> dict:
    model = load(sc, spec)
    found = train(sc, spec, model)
    trainer = found.pop("_trainer")
    if sc.get("save_adapter"):
        from safetensors.torch import load_file

        folder = Path(spec["work"]) / "adapters" / sc["name"]
        if sc["kind"] == "callback":  # a stock Trainer saves no adapter under FSDP2: our function gathers it
            from hf_fsdp_qlora import save_adapter

            save_adapter(trainer.model, folder)
        else:
            trainer.save_model(str(folder))
        live = live_adapter(trainer.model)
        if trainer.accelerator.is_main_process:
            saved = load_file(str(folder / "adapter_model.safetensors"))
            saved = {_lora_key(k).replace(".weight", ""): v for k, v in saved.items()}
            live = {k.replace(".weight", ""): v for k, v in live.items()}
            common = set(saved) & set(live)
            found["adapter"] = {
                "folder": str(folder), "tensors_saved": len(saved), "tensors_live": len(live),
                "same_names": set(saved) == set(live),
                "max_abs_diff": max((float((saved[k].float() - live[k].float()).abs().max()) for k in common),
                                    default=None),
                "equal": set(saved) == set(live) and all(torch.equal(saved[k], live[k].to(saved[k].dtype))
                                                         for k in common),
            }  # fmt: skip
    del trainer, model
    return found


def run_stock(sc: dict, spec: dict) -> dict:
    found = train(sc, spec, load(sc, spec))
    found.pop("_trainer")
    return found


def run_merge(sc: dict, spec: dict) -> dict:
    """merge_adapters on this device against peft's merge_and_unload of the same bf16 base: within one bf16 ulp."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    out = Path(spec["work"]) / "merged" / sc["name"]
    t = time.perf_counter()
    merge_adapters(spec["model"], sc["adapter"], out, device=DEVICE, progress=False, force=True)
    merge_s = time.perf_counter() - t
    base = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16, device_map=DEVICE)
    ref = PeftModel.from_pretrained(base, sc["adapter"]).merge_and_unload().state_dict()
    from safetensors import safe_open

    base_files = {}
    for f in Path(spec["model"]).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            base_files.update(dict.fromkeys(h.keys(), f))
    worst, differ, changed, compared = 0.0, 0, 0, 0
    for f in sorted(out.glob("*.safetensors")):
        for key, ours in load_file(str(f), device=DEVICE).items():
            theirs = ref[key]
            compared += 1
            diff = (ours.float() - theirs.float()).abs()
            ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(ours.float().abs(), theirs.float().abs())
            differ += int((diff > ulp + 1e-30).any())
            worst = max(worst, float(diff.max()))
            if key in base_files:  # the merge must have moved something, or equality proves nothing
                with safe_open(str(base_files[key]), "pt", device=DEVICE) as h:
                    changed += int(not torch.equal(h.get_tensor(key), ours))
    return {"merge_s": merge_s, "tensors_compared": compared, "tensors_beyond_one_bf16_ulp": differ,
            "tensors_changed_vs_base": changed, "max_abs_diff": worst,
            "equal_within_one_ulp": compared > 0 and differ == 0 and changed > 0}  # fmt: skip


def run_seq_capacity(sc: dict, spec: dict) -> dict:
    """Bisection of the longest sequence (batch 1) whose training step fits each memory cap, in this process (one
    model load for every cap; caps in ascending order, each search starting from the previous cap's answer)."""
    from search_fit import largest_fitting

    model = load(sc, spec)
    total = torch.cuda.get_device_properties(0).total_memory if CUDA else None
    answers, low = {}, sc["low"]
    for cap_name, cap in sorted(sc["caps"].items(), key=lambda kv: kv[1]):
        if CUDA:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        log = Path(spec["out"]) / f"probes-{sc['name']}.{cap_name}.jsonl"

        def probe(seq: int, cap=cap, log=log) -> dict:
            step = {**sc, "seq": seq, "batch": 1, "steps": 1, "warmup": 0, "name": f"{sc['name']}-{seq}"}
            try:
                found = train(step, spec, model)
                found.pop("_trainer")
                used = found.get("max_allocated", found["saved_for_backward_bytes_per_step"])
                result = {"ok": CUDA or used <= cap, "bytes": used, "s_per_step": found.get("s_per_step")}
            except torch.OutOfMemoryError:
                result = {"ok": False, "bytes": None, "oom": True}
            model.zero_grad(set_to_none=True)
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()
            with log.open("a") as f:
                f.write(json.dumps({"seq": seq, **result}) + "\n")
            return result

        answers[cap_name] = largest_fitting(probe, low, sc["high"], sc["step"], sc["seconds"])
        low = answers[cap_name]["largest"] or low
    return {"caps": answers}


def run_torchtune(sc: dict, spec: dict) -> dict:
    try:
        import torchtune  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or torchao refusing this torch), or torchao refusing this torch
        return {"status": "skipped", "reason": f"torchtune is not importable here ({type(e).__name__}: {e})"[:300]}
    try:
        from torchtune_contestant import run as run_tt
    except ImportError:
        return {
            "status": "skipped",
            "reason": "torchtune is importable, but this check has no torchtune contestant yet",
        }
    return run_tt(sc, spec, dataset, CUDA)


RUNNERS = {"build": run_build, "ours": run_ours, "callback": run_ours, "stock": run_stock, "merge": run_merge, "built": run_ours,
           "seq_capacity": run_seq_capacity, "torchtune": run_torchtune,
           "adapter_dtype": lambda sc, spec: _worker_stages.run_adapter_dtype(sc, spec, load, train),
           "moe_layer": lambda sc, spec: _worker_stages.run_moe_layer(sc, spec, DEVICE)}  # fmt: skip


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    results = Path(spec["out"]) / f"results-rank{rank}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    for sc in spec["scenarios"]:
        started = time.perf_counter()
        try:
            found = {"status": "ok", **RUNNERS[sc["kind"]](sc, spec)}
        except torch.OutOfMemoryError as e:
            found = {"status": "oom", "error": str(e)[:400]}
        except Exception as e:  # noqa: BLE001  (recorded; the next scenario still runs)
            found = {
                "status": "failed",
                "error": f"{type(e).__name__}: {e}"[:600],
                "trace": traceback.format_exc()[-3000:],
            }
        found.update(name=sc["name"], kind=sc["kind"], seconds=time.perf_counter() - started)
        with results.open("a") as f:
            f.write(json.dumps(found, default=str) + "\n")
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo/FSDP teardown at interpreter exit sometimes aborts after the work is done


if __name__ == "__main__":
    main(sys.argv[1])
