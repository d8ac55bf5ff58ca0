"""One contestant of benchmarks/throughput.py: train the shared workload and write what was measured as JSON.

Launched once per contestant and round by throughput.py (never imported by it):

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_rehearsal.yaml \
        benchmarks/_throughput_worker.py --contestant ours --model DIR --out DIR ...
    torchrun --nproc-per-node 2 benchmarks/_throughput_worker.py --contestant stock ...

Contestants:
    ours         load_qlora_model + FSDPQLoRATrainer (FSDP2; activation checkpointing from the config).
    stock        the single-GPU recipe: BitsAndBytesConfig + prepare_model_for_kbit_training + get_peft_model +
                 transformers.Trainer (gradient checkpointing, no FSDP; DDP when launched on several ranks).
    ours_ddp     ours (load_qlora_model + FSDPQLoRATrainer) launched like the stock recipe, without FSDP (DDP): the
                 same engine as `stock`, so the ratio between them is the cost of our loader, callbacks and checks.
    accel_fsdp2  the same stock Trainer under accelerate's FSDP2 plugin, loaded as peft's FSDP-QLoRA guide says
                 (bnb_4bit_quant_storage = bf16). On CPU accelerate only runs FSDP with our rehearsal hook
                 (hf_fsdp_qlora.enable_cpu_fsdp); nothing else of ours is used.

Every contestant runs the same bitsandbytes CPU kernel path: ``Linear4bit.support_avx512bf16_for_cpu`` is set
False on every 4-bit layer (our loader does it; the stock contestants get it here), since with it True
bitsandbytes repacks weights for a different kernel at no-grad forwards and the comparison would be unfair.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

CONTESTANTS = ("ours", "stock", "accel_fsdp2", "ours_ddp")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contestant", required=True, help="one contestant, or several trained in turn (A,B)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="directory for rank{R}.json")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="per-device batch size")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--packed", action="store_true", help="variable-length examples packed with position_ids")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-bf16", action="store_true", help="TrainingArguments(bf16=False): no autocast")
    p.add_argument("--profile", action="store_true", help="torch.profiler over the steady steps: top ops to --out")
    args = p.parse_args(argv)
    unknown = [c for c in args.contestant.split(",") if c not in CONTESTANTS]
    if unknown:
        p.error(f"--contestant: unknown {unknown}; choose from {', '.join(CONTESTANTS)}")
    return args


def _vm_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    # Linux: writing 5 to clear_refs resets VmHWM, so the training peak is not the load's peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _dataset(args, world: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    rows = args.steps * args.batch * world
    if not args.packed:
        ids = torch.randint(3, vocab, (rows, args.seq), generator=gen)
        return [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids], rows * args.seq
    from hf_fsdp_qlora.data import pack_examples

    examples, total = [], 0
    while total < rows * args.seq:  # lengths between seq/8 and seq: what padding would waste compute on
        n = int(torch.randint(max(2, args.seq // 8), args.seq + 1, (1,), generator=gen))
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": ids})
        total += n
    blocks = [b for b in pack_examples(examples, args.seq) if len(b["input_ids"]) == args.seq][:rows]
    return blocks, rows * args.seq


def _load(args, torch):
    from peft import LoraConfig

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")  # fmt: skip
    if args.contestant in ("ours", "ours_ddp"):
        from hf_fsdp_qlora import load_qlora_model

        # Under FSDP the config's activation checkpointing is the one applied (our trainer turns the model's off);
        # under DDP the model's own (use_reentrant=False), as for the stock recipe.
        return load_qlora_model(args.model, dtype=torch.bfloat16, lora_config=lora)
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
             "bnb_4bit_compute_dtype": torch.bfloat16}  # fmt: skip
    if args.contestant == "accel_fsdp2":
        q["bnb_4bit_quant_storage"] = torch.bfloat16  # peft's FSDP-QLoRA guide: FSDP shards floating storage
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=BitsAndBytesConfig(**q),
                                                 dtype=torch.bfloat16)  # fmt: skip
    if args.contestant == "stock":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    return get_peft_model(model, lora)


def _same_kernel_path(model) -> int:
    """bitsandbytes' CPU repack off on every 4-bit layer, as our loader does; returns the layer count."""
    from bitsandbytes.nn import Linear4bit

    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


def main(argv=None):
    args = parse(argv)
    if "," in args.contestant:  # several in turn in this launch (throughput.py --one-launch): OUT/NAME/rankR.json
        from _contestants import run_contestants  # benchmarks/, the script's own folder, is first on sys.path

        def one(name, a):
            return train_one(argparse.Namespace(**{**vars(a), "contestant": name}))

        run_contestants(args.contestant, one, args, args.out)  # exits when done
    found = train_one(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{found['rank']}.json").write_text(json.dumps(found))
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # gloo/FSDP teardown at interpreter exit sometimes aborts after the work is done; the JSON is on disk.
    os._exit(0)


def train_one(args) -> dict:
    """Train `args.contestant` on this rank; returns what was measured."""
    import torch

    if args.contestant in ("ours", "accel_fsdp2") and args.device == "cpu":
        import hf_fsdp_qlora

        hf_fsdp_qlora.enable_cpu_fsdp()  # accelerate runs FSDP on CPU only with this (see cpu_rehearsal.py)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cuda = args.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    started = time.perf_counter()
    model = _load(args, torch)
    layers4 = _same_kernel_path(model)
    data, tokens = _dataset(args, world, model.config.vocab_size)
    found = {"contestant": args.contestant, "rank": rank, "world": world, "linear4bit_layers": layers4,
             "load_s": time.perf_counter() - started, "tokens_total": tokens}  # fmt: skip

    class Clock(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            from torch.distributed.fsdp import FSDPModule

            found["fsdp2_modules"] = sum(isinstance(m, FSDPModule) for m in model.modules())
            found["dtensor_params"] = sum(type(p).__name__ == "DTensor" for p in model.parameters())
            found["repack_off"] = all(
                not getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules()
                if type(m).__name__ == "Linear4bit"
            )  # fmt: skip
            found["gradient_checkpointing"] = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())

        def on_step_end(self, targs, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            if state.global_step == args.warmup:
                found["rss_reset"] = _reset_peak_rss()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                found["t0"] = time.perf_counter()
                found["cpu0"] = time.process_time()
                if args.profile:
                    found["_profiler"] = torch.profiler.profile()
                    found["_profiler"].__enter__()
            if state.global_step == args.steps:
                found["t1"] = time.perf_counter()
                found["cpu1"] = time.process_time()
                profiler = found.pop("_profiler", None)
                if profiler is not None:
                    profiler.__exit__(None, None, None)
                    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    (Path(args.out) / f"profile-rank{rank}.txt").write_text(table)
                if found.get("rss_reset"):
                    found["peak_rss_train"] = _vm_kib("VmHWM") * 1024
                if cuda:
                    found["cuda_max_allocated"] = torch.cuda.max_memory_allocated()

    common = {"output_dir": str(Path(args.out) / f"trainer-{args.contestant}"), "max_steps": args.steps,
                  "per_device_train_batch_size": args.batch, "learning_rate": 1e-4, "logging_steps": 5, "report_to": [],
                  "save_strategy": "no", "seed": 0, "bf16": not args.no_bf16, "use_cpu": not cuda, "disable_tqdm": True,
                  "dataloader_drop_last": True, "remove_unused_columns": False}  # fmt: skip
    if args.contestant in ("ours", "ours_ddp"):
        from hf_fsdp_qlora import FSDPQLoRATrainer as trainer_cls
    else:
        trainer_cls = Trainer
    if args.contestant == "ours_ddp":
        common.update(ddp_find_unused_parameters=False)
    if args.contestant == "stock":
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                      ddp_find_unused_parameters=False)  # fmt: skip
    collator = None
    if args.packed:  # stacks position_ids, no attention_mask, use_cache=False: examples stay apart
        from hf_fsdp_qlora.data import PackedCollator

        collator = PackedCollator()
    trainer = trainer_cls(model=model, args=TrainingArguments(**common), train_dataset=data, data_collator=collator,
                          callbacks=[Clock()])  # fmt: skip
    found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    trainer.train()
    steady = args.steps - args.warmup
    seconds = found["t1"] - found["t0"]
    found["steady_steps"] = steady
    found["steady_s"] = seconds
    found["tokens_per_s"] = steady * args.batch * args.seq * world / seconds  # global: every rank's tokens
    # CPU seconds this rank's process spent in the steady steps (all its threads). On a shared machine wall time
    # moves with other jobs' load; CPU time much less, so tokens per CPU-second compares contestants more steadily.
    found["cpu_s"] = found["cpu1"] - found["cpu0"]
    found["tokens_per_cpu_s"] = steady * args.batch * args.seq / found["cpu_s"]  # this rank's tokens
    found["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return found


if __name__ == "__main__":
    main()
