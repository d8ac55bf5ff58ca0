"""Multimodal checkpoints trained under ``-m hf_fsdp_qlora.run`` (tests/test_multimodal_train.py), several runs in one
launch:

    accelerate launch --config_file CONFIG -m hf_fsdp_qlora.run multimodal_scenarios.py OUT JOBS MODELS TEXT

JOBS: comma-separated ``FAMILY:ROUTE``. ROUTE ``tokenizer``: as ``text`` through trl's ``SFTTrainer`` with the
tokenizer (for families whose processor AutoProcessor cannot load without torchvision). ``ROUTE-fsdp1``: that run
under FSDP1. ROUTE ``text``: trl's own ``sft.py`` (from the installed trl, unchanged) with
``--use_peft --load_in_4bit --lora_target_modules all-linear`` on MODELS/FAMILY and the JSONL text data in TEXT.
ROUTE ``image``: trl's ``SFTTrainer`` given the model path, a 4-bit ``BitsAndBytesConfig``, LoRA all-linear and the
model's processor (saved beside it; tiny_multimodal.load_processor), on tiny random images made here with PIL. ROUTE
``pixels``: the same without a processor (Llama 4's needs torchvision): token rows with image placeholders and
``pixel_values`` made with torch, through a collator. Each
run meets on its own port (dist_utils.job_port) and writes ``OUT/FAMILY_ROUTE/record_rank{N}.pt``: what FSDP wrapped, the towers'
storage, and the trainable tensors at the start and the end (gathered: train_scenarios.full_trainable); or, for a run
that raised (the same on every rank), ``{"error": ...}``, and the next run goes on.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import trl.scripts.sft as trl_sft
from accelerate.state import AcceleratorState, GradientState
from dist_utils import job_port
from train_scenarios import full_trainable
from transformers import Trainer, TrainerCallback

STEPS = 2


def _tower_facts(model) -> dict:
    """The towers of the (wrapped) model: their 4-bit layers, dtypes, trainable tensors, LoRA and FSDP units."""
    import bitsandbytes as bnb
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from hf_fsdp_qlora.towers import tower_modules

    towers = tower_modules(model)

    def inside(name):
        return any(name.startswith(t + ".") or name == t for t in towers)

    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    units = {n: type(m.module if isinstance(m, FSDP) else m).__name__ for n, m in modules.items()
             if isinstance(m, (FSDP, FSDPModule))}  # fmt: skip
    return {
        "towers": towers,
        "tower_4bit": [n for n, m in modules.items() if inside(n) and isinstance(m, bnb.nn.Linear4bit)],
        "tower_dtypes": sorted({str(p.dtype) for n, p in params.items() if inside(n)}),
        "tower_params": sum(p.numel() for n, p in params.items() if inside(n)),
        "tower_trainable": [n for n, p in params.items() if inside(n) and p.requires_grad],
        "tower_lora": [n for n in modules if inside(n) and n.endswith("lora_A")],
        "tower_units": sorted({kind for n, kind in units.items() if inside(n)}),
        "units": sorted(set(units.values())),
        "language_4bit": sum(isinstance(m, bnb.nn.Linear4bit) for n, m in modules.items() if not inside(n)),
        "class": type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__,
    }


class Recorder(TrainerCallback):
    def __init__(self, trainer, out: Path):
        self.trainer, self.out, self.record, self.batch_keys = trainer, out, {}, set()

    def _keys(self, module, args, kwargs):
        self.batch_keys |= {k for k, v in kwargs.items() if torch.is_tensor(v)}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        version = AcceleratorState().fsdp_plugin.fsdp_version
        self.record = {"version": version, "init": full_trainable(model, version), **_tower_facts(model)}
        self.record["distributed_type"] = str(AcceleratorState().distributed_type)
        self._hook = model.register_forward_pre_hook(self._keys, with_kwargs=True)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._hook.remove()
        self.record["final"] = full_trainable(model, self.record["version"])
        self.record["batch_keys"] = sorted(self.batch_keys)
        self.record["steps"] = state.global_step
        self.record["engagement"] = self.trainer.fsdp_callback.engagement
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.record, self.out / f"record_rank{dist.get_rank()}.pt")


@contextlib.contextmanager
def recording(out: Path):
    """Every Trainer built inside gets a :class:`Recorder` (sft.py builds its own; we cannot pass callbacks)."""
    hooked = Trainer.__init__  # already hf_fsdp_qlora.run's hook

    def __init__(self, *args, **kwargs):
        hooked(self, *args, **kwargs)
        self.add_callback(Recorder(self, out))

    Trainer.__init__ = __init__
    try:
        yield
    finally:
        Trainer.__init__ = hooked


def run_text(model: Path, text: Path, out: Path) -> None:
    """trl's sft.py as users run it on a multimodal checkpoint, text only."""
    script = trl_sft.__file__
    sys.argv = [
        script, "--model_name_or_path", str(model), "--dataset_name", str(text), "--use_peft", "--load_in_4bit",
        "--dtype", "bfloat16", "--lora_target_modules", "all-linear", "--lora_dropout", "0", "--max_steps",
        str(STEPS), "--per_device_train_batch_size", "2", "--save_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", "--learning_rate", "1e-3", "--output_dir", str(out), "--max_length", "32",
    ]  # fmt: skip
    runpy.run_path(script, run_name="__main__")


def _train(model: Path, out: Path, dataset, processing_class, collator=None, **config) -> None:
    """trl's SFTTrainer given the model's path, a 4-bit BitsAndBytesConfig and LoRA all-linear, for STEPS steps;
    then the group ends as after sft.py's trainer.end() (the next run makes a new one)."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, report_to="none", save_strategy="no",
        logging_steps=1, learning_rate=1e-3, model_init_kwargs={"dtype": torch.bfloat16}, **config,
    )  # fmt: skip
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = SFTTrainer(model=str(model), args=args, train_dataset=dataset, data_collator=collator,
                         processing_class=processing_class, peft_config=lora, quantization_config=quant)  # fmt: skip
    trainer.train()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_image(model: Path, text: Path, out: Path) -> None:
    """trl's SFTTrainer on image-text rows, with the model's processor, as its docs show for vision models."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image
    from tiny_multimodal import load_processor

    processor = load_processor(model, model.name)  # AutoProcessor, or the class without its video processor
    prefix = (model / "image_prefix.txt").read_text().strip()
    rng = np.random.default_rng(0)
    rows = [
        {"images": [Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8"))],
         "text": f"{prefix} " + " ".join(f"t{rng.integers(8, 500)}" for _ in range(6))}
        for _ in range(2 * 2 * STEPS)
    ]  # fmt: skip
    _train(model, out, Dataset.from_list(rows), processor, remove_unused_columns=False)


def run_tokenizer(model: Path, text: Path, out: Path) -> None:
    """trl's SFTTrainer on the image-text class with text rows and the tokenizer as its processing class: what sft.py
    builds, for the families whose processor AutoProcessor cannot load without torchvision (not installed here)."""
    from datasets import load_dataset
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    _train(model, out, load_dataset(str(text), split="train"), tokenizer, max_length=32)


def run_pixels(model: Path, text: Path, out: Path) -> None:
    """trl's SFTTrainer on image-text rows made without a processor, for a family whose processor cannot load here
    (Llama 4's image processor needs torchvision): token rows with the image placeholders (labels skip them) and
    float32 ``pixel_values`` made with torch, as a processor gives them, stacked by a collator."""
    from datasets import Dataset
    from tiny_multimodal import BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, LLAMA4_IMAGE_TOKENS
    from transformers import PreTrainedTokenizerFast

    gen = torch.Generator().manual_seed(0)
    image = [BOI_TOKEN, *[IMAGE_TOKEN] * LLAMA4_IMAGE_TOKENS, EOI_TOKEN]
    ids = [[1, *image, *torch.randint(8, 500, (6,), generator=gen).tolist()] for _ in range(2 * 2 * STEPS)]
    rows = [{"input_ids": row, "labels": [-100 if t == IMAGE_TOKEN else t for t in row],
             "pixel_values": torch.rand(3, 32, 32, generator=gen).tolist()} for row in ids]  # fmt: skip

    def collate(batch):
        out = {key: torch.tensor([row[key] for row in batch]) for key in ("input_ids", "labels", "pixel_values")}
        return {**out, "attention_mask": torch.ones_like(out["input_ids"])}

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    _train(model, out, Dataset.from_list(rows), tokenizer, collate, remove_unused_columns=False)


ROUTES = {"text": run_text, "image": run_image, "tokenizer": run_tokenizer, "pixels": run_pixels}


def main() -> None:
    out, jobs = Path(sys.argv[1]), sys.argv[2].split(",")
    models, text = Path(sys.argv[3]), Path(sys.argv[4])
    used: set[str] = set()
    for job in jobs:
        family, route = job.split(":")
        # "ROUTE-fsdp1": this run under FSDP1 (accelerate's plugin reads FSDP_VERSION when the trainer builds it)
        route, _, fsdp1 = route.partition("-fsdp")
        os.environ["FSDP_VERSION"] = fsdp1 or "2"
        torch.manual_seed(0)
        run_out = out / job.replace(":", "_")
        # each run meets on a port of its own, chosen as it starts (a rank still leaving the old group must not
        # meet the new one)
        os.environ["MASTER_PORT"] = job_port(run_out, used)
        with recording(run_out):
            try:
                ROUTES[route](models / family, text, run_out)
            except Exception as err:  # noqa: BLE001 - recorded for the test (an upstream break, named there)
                rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
                run_out.mkdir(parents=True, exist_ok=True)
                torch.save({"error": f"{type(err).__name__}: {err}"}, run_out / f"record_rank{rank}.pt")
                if dist.is_initialized():
                    dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


if __name__ == "__main__":
    main()
