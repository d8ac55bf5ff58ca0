"""Mixture of experts: peak host RAM per process while loading, streamed experts against the load they replace.

    python benchmarks/moe_loading.py                  # a ~2 GB synthetic Qwen3-MoE, 1 process and 2 ranks (low_cpu_ram)
    python benchmarks/moe_loading.py --shape test --json --ranks 1   # tests/test_moe_stream.py's form

A Qwen3-MoE checkpoint with random bf16 weights is written under a temporary folder (per expert, as
``save_pretrained`` and the Hub store Qwen3-MoE: ``mlp.experts.N.gate_proj.weight``; one shard per layer, written
layer by layer, so the writer never holds the model) and deleted afterwards. Each contestant loads it in a fresh
process (or a 2-rank ``accelerate launch`` with ``low_cpu_ram=True``):

    streamed  ``load_qlora_model(path)``: the experts go from the shards into 4 bits one layer at a time
              (hf_fsdp_qlora/experts/stream.py).
    today     the same call with ``use_safetensors=True``, a from_pretrained argument the stream plan does not follow:
              the experts load as before this change (all of them 16-bit, then packed).
    trl       trl's route: this worker run under ``python -m hf_fsdp_qlora.run`` (the launcher's hooks installed), the
              base loaded as trl's SFTTrainer loads it for ``sft.py --load_in_4bit --dtype bfloat16`` (trl's
              ``create_model_from_path`` with sft.py's arguments and ``get_quantization_config``), then
              ``get_peft_model``: the launcher's from_pretrained hook streams the experts
              (hf_fsdp_qlora/experts/script_stream.py). One process only (each rank streams its own on this route).
    trl_today the same with ``use_safetensors=True``: the stream does not follow, the experts load 16-bit and the
              launcher's peft hook packs them at ``get_peft_model`` (trl's route before the from_pretrained hook).

Per process: the peak resident set (``VmHWM``: anonymous and file-backed pages, including the runtime's ~0.5 GB
of imports), the peak of anonymous memory alone (sampled every 10 ms: the memory-mapped checkpoint pages
``from_pretrained`` reads count in the resident set, but the kernel can drop them), and the doctor's planned bound
(``host_per_process["loading"]``: the 4-bit model, one layer's 16-bit experts and their packed bytes, 1 GiB of
runtime). Goals (issue 40): peak RSS within 1.3x of the bound and at least 3x below today's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
CONTESTANTS = ("streamed", "today", "trl", "trl_today")
PAIRS = (("streamed", "today"), ("trl", "trl_today"))  # (ours, what it replaces): equal packed experts
# Qwen3MoeConfig fields. "bench": 10 layers x 64 experts of width 512 at hidden 1024: 2.0 GB of bf16 experts, 2.1 GB
# on disk. "test": tests/test_moe_stream.py's (201 MB of experts). "tiny": ~30 MB.
SHAPES = {
    "bench": {"hidden_size": 1024, "num_hidden_layers": 10, "num_experts": 64, "moe_intermediate_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096},
    "test": {"hidden_size": 512, "num_hidden_layers": 4, "num_experts": 32, "moe_intermediate_size": 512,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 1024},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024},
}  # fmt: skip


def _config(shape: str):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPES[shape], num_experts_per_tok=2, intermediate_size=1024, tie_word_embeddings=False,
                          max_position_embeddings=512, dtype="bfloat16")  # fmt: skip


def write_checkpoint(folder: Path, shape: str, seed: int = 0) -> int:
    """A per-expert Qwen3-MoE checkpoint of random bf16 weights, one shard per layer; returns its bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _config(shape)
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = ["Qwen3MoeForCausalLM"]  # as save_pretrained of the model writes (trl reads it)
    config.save_pretrained(folder)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    groups: dict[str, dict] = {}
    for name, param in meta.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        if ".mlp.experts." in name:
            continue
        groups.setdefault(layer, {})[name] = tuple(param.shape)
    weight_map, total = {}, 0
    for index, (layer, tensors) in enumerate(sorted(groups.items())):
        out = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in tensors.items()}
        if layer != "rest":
            h, i = config.hidden_size, config.moe_intermediate_size
            for e in range(config.num_experts):
                for proj, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                    key = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                    out[key] = (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
        file = f"model-{index:05d}.safetensors"
        save_file(out, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file))
        total += sum(t.numel() * 2 for t in out.values())
        del out
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return total


# --- the worker: one contestant in one process (or on every rank of a launch) -----------------------------------


def _status(field: str) -> int:
    """A figure of /proc/self/status in bytes. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a worker
    started from the driver would report the driver's peak (the checkpoint writer's) if it were higher."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(f"{field}:"))


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon), sampled every 10 ms in a thread."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        return _status("RssAnon")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def trl_base(model: str, **extra):
    """The base as trl's SFTTrainer loads it for sft.py `--load_in_4bit --dtype bfloat16`: sft.py's model_init_kwargs,
    trl's get_quantization_config and create_model_from_path (also tests/test_moe_stream.py's)."""
    from trl import ModelConfig, get_quantization_config
    from trl.trainer.utils import create_model_from_path

    args = ModelConfig(model_name_or_path=model, dtype="bfloat16", load_in_4bit=True)
    return create_model_from_path(str(model), revision=args.model_revision, trust_remote_code=False,
                                  attn_implementation=None, dtype=args.dtype,
                                  quantization_config=get_quantization_config(args), **extra)  # fmt: skip


def worker(name: str, model: str, out: Path, low_cpu_ram: bool) -> None:
    import torch
    from peft import LoraConfig

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts, packed_expert_bytes

    if name.startswith("trl"):
        import trl.trainer.utils  # noqa: F401 - imported before the baseline: the runtime, as the load's own imports

    baseline = _status("VmHWM")  # after the imports: the runtime
    baseline_anon = AnonPeak.now()
    extra = {"use_safetensors": True} if name.endswith("today") else {}
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    start = time.perf_counter()
    with AnonPeak() as anon:
        if name.startswith("trl"):
            from peft import get_peft_model

            loaded = get_peft_model(trl_base(model, **extra), lora)  # as SFTTrainer does
        else:
            loaded = load_qlora_model(model, lora_config=lora, gradient_checkpointing=False, low_cpu_ram=low_cpu_ram,
                                      dtype=torch.bfloat16, **extra)  # fmt: skip
    seconds = time.perf_counter() - start
    import hashlib

    digest = hashlib.sha256()
    for n, p in sorted(loaded.named_parameters()):
        if n.endswith("_4bit"):
            digest.update(p.detach().view(torch.uint8).numpy().tobytes())
    rank = int(os.environ.get("RANK", "0"))
    found = {
        "contestant": name, "rank": rank, "low_cpu_ram": low_cpu_ram, "load_s": round(seconds, 2),
        "peak_rss": _status("VmHWM"), "peak_anon": anon.peak,
        "runtime_rss": baseline, "runtime_anon": baseline_anon,
        "quantized_experts": sum(isinstance(m, QuantizedExperts) for m in loaded.modules()),
        "packed_expert_bytes": packed_expert_bytes(loaded)[1], "experts_digest": digest.hexdigest(),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-{int(low_cpu_ram)}-rank{rank}.json").write_text(json.dumps(found))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- the driver ----------------------------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, model: Path, out: Path, ranks: int, timeout: int) -> list[dict]:
    """One contestant in a fresh process (ranks 1; trl's under `python -m hf_fsdp_qlora.run`) or a 2-rank launch
    with low_cpu_ram=True; every rank's figures."""
    me = [str(Path(__file__).resolve()), "--worker", name, "--model", str(model), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_FSDP", None)
    if ranks == 1:
        cmd = [sys.executable, *(["-m", "hf_fsdp_qlora.run"] if name.startswith("trl") else []), *me]
    else:
        config = ROOT / "accelerate_configs" / "cpu_fsdp2_rehearsal.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
               "--num_processes", str(ranks), "--main_process_port", str(_port()), *me, "--low-cpu-ram"]  # fmt: skip
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    files = [out / f"{name}-{int(ranks > 1)}-rank{r}.json" for r in range(ranks)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        raise RuntimeError(f"{name} ({ranks} ranks) failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
    return [json.loads(f.read_text()) for f in files]


def planned_bound(model: Path) -> int:
    from hf_fsdp_qlora.doctor import diagnose

    d = diagnose(str(model / "config.json"), accelerate_config="fsdp2_qlora", quantization="4bit", num_gpus=1)
    return d.plan.host["loading"]


def _table(rows: dict, bound: int) -> str:
    pairs = [(ours, before) for ours, before in PAIRS if ours in rows and before in rows]
    names = [n for pair in pairs for n in pair]
    head = [*names, *(f"{before} / {ours}" for ours, before in pairs)]
    lines = ["| per process | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for key, label in (("peak_rss", "peak RSS (GiB)"), ("peak_anon", "peak anonymous RSS (GiB)"),
                       ("load_s", "load time (s)")):  # fmt: skip
        scale = 1 if key == "load_s" else GIB
        cells = [f"{rows[n][key] / scale:.2f}" for n in names]
        cells += [f"{rows[before][key] / rows[ours][key]:.2f}x" for ours, before in pairs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    pad = " |" * (len(head) - 1)
    lines.append(f"| planned bound (GiB) | {bound / GIB:.2f}{pad}")
    lines.append("| peak RSS / bound | " + " | ".join(f"{rows[n]['peak_rss'] / bound:.2f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--ranks", type=int, choices=(1, 2), nargs="*", default=[1, 2],
                   help="1: one process; 2: a 2-rank launch with low_cpu_ram=True (default: both)")  # fmt: skip
    p.add_argument("--contestants", nargs="*", choices=CONTESTANTS, default=list(CONTESTANTS),
                   help="which loads to measure (default: all; trl's only in the 1-process run)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    p.add_argument("--keep", type=Path, help="write the checkpoint and results here and keep them")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per contestant")
    p.add_argument("--worker", choices=CONTESTANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--low-cpu-ram", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.out, args.low_cpu_ram)
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="moe_loading_", dir="/tmp"))
    try:
        model = work / "model"
        size = write_checkpoint(model, args.shape)
        bound = planned_bound(model)
        result = {"shape": args.shape, "checkpoint_bytes": size, "planned_bound": bound, "runs": {}}
        for ranks in args.ranks:
            rows = {}
            for name in args.contestants:
                if ranks > 1 and name.startswith("trl"):
                    continue  # no low_cpu_ram on trl's route: each rank loads (and streams) its own, as 1 process
                found = run(name, model, work / "out", ranks, args.timeout)
                rows[name] = max(found, key=lambda r: r["peak_rss"])  # the process that peaked highest
                rows[name]["per_rank_peak_rss"] = [r["peak_rss"] for r in found]
                rows[name]["digests_equal_across_ranks"] = len({r["experts_digest"] for r in found}) == 1
            for ours, before in PAIRS:
                if ours in rows and before in rows and rows[ours]["experts_digest"] != rows[before]["experts_digest"]:
                    raise RuntimeError(f"the {ours} experts' packed bytes differ from the {before} load's")
            result["runs"][f"{ranks}_process" if ranks == 1 else f"{ranks}_ranks_low_cpu_ram"] = rows
            print(f"\n{ranks} process(es){' (low_cpu_ram)' if ranks > 1 else ''}, checkpoint {size / GIB:.2f} GiB:")
            print(_table(rows, bound))
        if args.json:
            print("\n" + json.dumps(result, indent=1))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
