"""Per-rank bytes of the 4-bit base after wrapping, and peak RSS per rank, for N=2 CPU ranks:
(a) ours (FSDPQLoRATrainer, FSDP2), (b) accelerate's stock FSDP2 path (transformers.Trainer), (c) DDP.

    python benchmarks/fsdp_memory.py [--layers 20 --hidden 1024]   # ~300M parameters by default

The model is built locally and loaded the way most users load it: bitsandbytes' default uint8 storage.
accelerate's FSDP2 leaves uint8-stored 4-bit weights unsharded (a full copy per rank); ours views them as
bf16 and shards them. Figures are ratios to the whole 4-bit model; goal for ours: <= 0.55x per rank.

    python benchmarks/fsdp_memory.py --low-ram

measures loading instead: peak RSS of one process running load_qlora_model, beside the sum over 2 ranks of
load_qlora_model(low_cpu_ram=True) (only rank 0 reads the checkpoint) and of today's load on every rank.
Goal: sum over 2 ranks <= 1.3x the single-process load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, resource, sys, torch
import hf_fsdp_qlora
from hf_fsdp_qlora import FSDPQLoRATrainer
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback, TrainingArguments
path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.bfloat16)  # default storage: uint8
model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"), autocast_adapter_dtype=False)
found = {}
class Measure(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kw):
        packed = [p for n, p in model.named_parameters() if n.endswith("base_layer.weight")]
        found["local"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in packed)
        found["full"] = sum(p.numel() * p.element_size() for p in packed)
        found["sharded"] = sum(type(p).__name__ == "DTensor" for p in packed)
        found["count"] = len(packed)
ids = torch.randint(3, 1000, (4, 16))
data = [{"input_ids": r, "labels": r} for r in ids]
args = TrainingArguments(output_dir=out + "-o", max_steps=1, per_device_train_batch_size=1, report_to=[],
                         save_strategy="no", use_cpu=True)
cls = FSDPQLoRATrainer if mode == "ours" else Trainer
trainer = cls(model=model, args=args, train_dataset=data, callbacks=[Measure()])
found["distributed_type"] = str(trainer.accelerator.state.distributed_type)
trainer.train()
found["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rank = torch.distributed.get_rank()
open(f"{out}-rank{rank}.json", "w").write(json.dumps(found))
torch.distributed.barrier()
"""


LOAD_WORKER = r"""
import json, os, resource, sys, threading, time, torch
import hf_fsdp_qlora
from hf_fsdp_qlora import load_qlora_model
path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
# What every QLoRA process imports whatever it loads (about 140 MiB of heap): in "before", not in the load.
import accelerate, bitsandbytes, peft, transformers.integrations.bitsandbytes
from transformers import AutoConfig, AutoModelForCausalLM
AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(path))]  # imports the modeling module
def status():  # current VmRSS and RssAnon (heap, not file pages of the mmapped checkpoint), bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon")}
peak, done = status(), threading.Event()
def sample():  # ru_maxrss has no anonymous-only twin: sample it
    while not done.wait(0.002):
        now = status()
        for k in peak:
            peak[k] = max(peak[k], now[k])
before = status()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
model = load_qlora_model(path, gradient_checkpointing=False, low_cpu_ram=(mode == "lowram"))
done.set()
sampler.join()
found = {"before": before["VmRSS"], "before_anon": before["RssAnon"], "peak_anon": peak["RssAnon"],
         "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
rank = int(os.environ.get("RANK", 0))  # a normal load never joins the process group
open(f"{out}-rank{rank}.json", "w").write(json.dumps(found))
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(path: Path, layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16)  # fmt: skip
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M-parameter model", flush=True)
    model.save_pretrained(path)


def launch(tmp: Path, model: Path, mode: str) -> list[dict]:
    config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    out = tmp / mode
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if mode == "ddp":  # torchrun + TrainingArguments(use_cpu=True): accelerate picks DDP on gloo
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2", f"--master-port={port()}",
               str(worker), str(model), str(out), mode]  # fmt: skip
    else:
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
               "--main_process_port", str(port()), str(worker), str(model), str(out), mode]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} launch failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in (0, 1)]


def launch_load(tmp: Path, model: Path, mode: str) -> list[dict]:
    """Peak RSS of loading alone: `single` (one plain process), `lowram` / `normal` (2 ranks, accelerate FSDP2)."""
    worker = tmp / "load_worker.py"
    worker.write_text(LOAD_WORKER)
    out = tmp / f"load-{mode}"
    # A fixed mmap threshold: glibc otherwise raises it as big blocks are freed, and later tensors then come
    # from a heap that keeps freed pages resident, so the same load measured several hundred MiB apart
    # from run to run. With it, every tensor of 128 KiB or more is its own mapping, returned when freed.
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="131072")
    if mode == "single":
        cmd = [sys.executable, str(worker), str(model), str(out), mode]
    else:
        config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
               "--main_process_port", str(port()), str(worker), str(model), str(out), mode]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} load failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in ((0,) if mode == "single" else (0, 1))]


def main_low_ram(args) -> int:
    """Two measures per load: peak RSS (ru_maxrss: heap plus the file pages of the mmapped checkpoint,
    which vary with page-cache state from run to run) and peak anonymous RSS (RssAnon sampled every 2 ms:
    the memory the load itself allocates, the steadier figure). Median of `--repeat` runs of each."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "model", args.layers, args.hidden)
        runs = {mode: [launch_load(tmp, tmp / "model", mode) for _ in range(args.repeat)]
                for mode in ("single", "lowram", "normal")}  # fmt: skip
    mib = 2**20
    names = {
        "single": "1 process, normal load",
        "lowram": "2 ranks, low_cpu_ram=True",
        "normal": "2 ranks, normal load",
    }
    verdicts = []
    measures = (("peak", "before", "peak RSS (ru_maxrss)"),
                ("peak_anon", "before_anon", "peak anonymous RSS (RssAnon, sampled)"))  # fmt: skip
    for key, base, title in measures:

        def total(ranks, key=key):
            return sum(r[key] for r in ranks)

        def grown(ranks, key=key, base=base):  # the load's own growth: the imports' fixed cost left out
            return sum(r[key] - r[base] for r in ranks)

        medians = {mode: sorted(rs, key=total)[len(rs) // 2] for mode, rs in runs.items()}
        single, single_grown = total(medians["single"]), grown(medians["single"])
        print(f"\n{title}: median of {args.repeat} run(s); every run's sum over ranks (MiB) in brackets")
        print(f"{'load':<28}{'per rank MiB':>16}{'sum MiB':>10}{'ratio':>8}{'grown MiB':>11}{'ratio':>8}   runs")
        for mode, ranks in medians.items():
            per_rank = " / ".join(f"{r[key] / mib:.0f}" for r in ranks)
            every = " ".join(f"{total(rs) / mib:.0f}" for rs in runs[mode])
            print(f"{names[mode]:<28}{per_rank:>16}{total(ranks) / mib:>10.0f}{total(ranks) / single:>7.2f}x"
                  f"{grown(ranks) / mib:>11.0f}{grown(ranks) / single_grown:>7.2f}x   [{every}]")  # fmt: skip
        ratio = total(medians["lowram"]) / single
        verdicts.append(f"{title}: {ratio:.2f}x {'met' if ratio <= 1.3 else 'MISSED'}")
    print("\ngoal: sum over 2 ranks <= 1.3x one process -> " + "; ".join(verdicts))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--modes", default="ours,stock,ddp", help="which setups to measure")
    parser.add_argument("--low-ram", action="store_true", help="measure loading: low_cpu_ram=True vs one process")
    parser.add_argument("--repeat", type=int, default=3, help="--low-ram: runs per setup (the median is shown)")
    args = parser.parse_args(argv)
    if args.low_ram:
        return main_low_ram(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build(tmp / "model", args.layers, args.hidden)
        rows = {mode: launch(tmp, tmp / "model", mode) for mode in args.modes.split(",")}
    whole = rows["ours"][0]["full"]
    print(f"\nwhole 4-bit base: {whole / 2**20:.1f} MiB")
    print(f"{'setup':<26}{'type':<26}{'4-bit bytes/rank (ratio)':>28}{'sharded':>10}{'peak RSS/rank MiB':>20}")
    names = {"ours": "ours (FSDP2)", "stock": "accelerate stock FSDP2", "ddp": "DDP"}
    for mode, ranks in rows.items():
        local = max(r["local"] for r in ranks)
        rss = " / ".join(f"{r['peak_rss'] / 2**20:.0f}" for r in ranks)
        print(f"{names[mode]:<26}{ranks[0]['distributed_type']:<26}"
              f"{local / 2**20:>15.1f} MiB ({local / whole:.2f}x){ranks[0]['sharded']:>7}/{ranks[0]['count']}{rss:>20}")  # fmt: skip
    ours = max(r["local"] for r in rows["ours"]) / whole
    print(f"\ngoal: ours <= 0.55x per rank -> {ours:.2f}x: {'met' if ours <= 0.55 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
