"""Worker for tests/test_doctor.py and benchmarks/memory_plan.py: does the doctor's verdict match reality?

Launched once with torchrun (2 CPU ranks, gloo). Each scenario carries an accelerate config (as a dict); the
worker turns it into the environment `accelerate launch` would give its processes - with accelerate's own
launch parser and `prepare_multi_gpu_env`, so accelerate's refusals are real - then loads a tiny model as the
scenario says, and trains one step with our trainer, a stock `transformers.Trainer`, or a plain accelerate loop.
Each rank writes rank<N>.json: did it train, the error if not, whether FSDP engaged, how far the step-0 logits
are from the unsharded model's (silent weight corruption shows there), and, for `measure` scenarios, the bytes
each rank really holds in local shards of parameters, gradients and optimizer state after one step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from dist_utils import finish_worker

import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook)
from hf_fsdp_qlora import FSDPQLoRATrainer
from hf_fsdp_qlora.train.fsdp import fsdp_engagement

SEQ = 16
BATCH = 2
_ENV_PREFIXES = ("FSDP_", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def apply_accelerate_config(config: dict) -> None:
    """Set the FSDP environment `accelerate launch --config_file <config>` would give this process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    for key in list(os.environ):
        if key.startswith(_ENV_PREFIXES):
            del os.environ[key]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as tmp:
        yaml.safe_dump(config, tmp)
    try:
        args = launch_command_parser().parse_args(["--config_file", tmp.name, "--main_process_port", "0", "x.py"])
        args = _validate_launch_command(args)[0]
        env = prepare_multi_gpu_env(args)  # raises what `accelerate launch` refuses
    finally:
        os.unlink(tmp.name)
    for key, value in env.items():
        if key.startswith(_ENV_PREFIXES):
            os.environ[key] = value


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


class ConstantDataset(torch.utils.data.Dataset):
    """The same sample everywhere: every rank's first batch is the reference batch."""

    def __init__(self, vocab: int, n: int = 8):
        self.ids = torch.randint(3, vocab, (SEQ,), generator=torch.Generator().manual_seed(7))
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": self.ids, "labels": self.ids.clone(), "attention_mask": torch.ones_like(self.ids)}


def load_model(path: str, spec: dict):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    kwargs = {"dtype": dtype}
    quant = spec.get("quantization")
    if quant == "4bit":
        storage = getattr(torch, spec.get("quant_storage", "bfloat16"))
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, spec.get("compute_dtype", "bfloat16")), bnb_4bit_quant_storage=storage,
        )  # fmt: skip
    elif quant == "8bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if spec.get("device_map") == "multi-device":
        # A CPU machine cannot spread a model over GPUs; set the map accelerate's dispatch_model leaves behind
        # for device_map="auto" over 2 GPUs (or with CPU/disk offload), which is what accelerate checks.
        model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "lm_head": "cpu"}
    if spec.get("full_finetune"):
        return model
    if spec.get("kbit_prep"):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
    torch.manual_seed(0)  # same LoRA initialisation on every rank, whoever trains
    config = LoraConfig(r=spec.get("lora_r", 4), lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, config, autocast_adapter_dtype=spec.get("adapter_dtype") == "float32")


def reference_logits(model, batch):
    # Train mode: in eval mode under no_grad bitsandbytes repacks 4-bit weights in place on some CPUs.
    model.train()
    with torch.no_grad():
        return model(**batch).logits.float()


def _local(t):
    return t.to_local() if type(t).__name__ == "DTensor" else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def measure(model, optimizer) -> dict:
    """Bytes this rank holds in local shards of parameters, gradients and optimizer state (and quant states)."""
    modules = list(model.modules())
    # bitsandbytes' Linear4bit; peft's LoRA wrapper has the same class name and a `base_layer`.
    bnb = [m for m in modules if type(m).__name__ == "Linear4bit" and not hasattr(m, "base_layer")]
    quantized = {id(m.weight) for m in bnb}
    out = dict.fromkeys(("params_quantized", "params_other", "params_trainable", "gradients", "optimizer"), 0)
    for _, p in model.named_parameters():
        key = "params_trainable" if p.requires_grad else "params_quantized" if id(p) in quantized else "params_other"
        out[key] += _nbytes(p)
        if p.grad is not None:
            out["gradients"] += _nbytes(p.grad)
    seen = set()
    quant_state = 0
    for m in bnb:
        # Under FSDP2 the sharded DTensor has lost the attribute; bitsandbytes keeps a copy on the module.
        qs = getattr(m.weight, "quant_state", None) or getattr(m, "quant_state", None)
        if qs is None:
            continue
        tensors = [qs.absmax, qs.code, getattr(qs, "offset", None)]
        if getattr(qs, "state2", None) is not None:
            tensors += [qs.state2.absmax, qs.state2.code]
        for t in tensors:
            if torch.is_tensor(t) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                quant_state += _nbytes(t)
    out["quant_state"] = quant_state
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        out["optimizer"] += sum(_nbytes(v) for v in state.values() if torch.is_tensor(v))
    flat = [getattr(m, "_flat_param", None) for m in modules]
    out["fsdp1_flat_params_with_padding"] = sum(_nbytes(f) for f in flat if f is not None)
    return out


def _training_args(out: Path, training: dict):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=training.get("steps", 1),
        learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
        activation_checkpointing=training.get("activation_checkpointing", False),
    )  # fmt: skip


def run_trainer(model, scenario, out, dataset):
    from transformers import Trainer, TrainerCallback

    base = FSDPQLoRATrainer if scenario["trainer"] == "hf_fsdp_qlora" else Trainer
    record = {}

    class Recorder(base):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            record.setdefault("logits", outputs.logits.detach().float())
            return (loss, outputs) if return_outputs else loss

    class Measure(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if scenario.get("measure") and "measured" not in record:
                record["measured"] = measure(trainer.model_wrapped, trainer.optimizer)

    trainer = Recorder(model=model, args=_training_args(out, scenario.get("training", {})), train_dataset=dataset,
                       callbacks=[Measure()])  # fmt: skip
    trainer.train()
    record["engagement"] = fsdp_engagement(trainer.model_wrapped)
    record["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    return record


def run_accelerate(model, scenario, dataset):
    from accelerate import Accelerator

    accelerator = Accelerator()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = {k: v.unsqueeze(0).repeat(BATCH, 1) for k, v in dataset[0].items()}
    outputs = model(**batch)
    accelerator.backward(outputs.loss)
    optimizer.step()
    return {"logits": outputs.logits.detach().float(), "engagement": fsdp_engagement(model),
            "distributed_type": str(accelerator.state.distributed_type)}  # fmt: skip


def run_scenario(scenario: dict, models: Path, out: Path) -> dict:
    apply_accelerate_config(scenario["accelerate_config"])
    reset_accelerate()
    spec = scenario["model"]
    path = str(models / spec.get("arch", "llama"))
    model = load_model(path, spec)
    dataset = ConstantDataset(model.config.vocab_size)
    batch = {k: v.unsqueeze(0).repeat(BATCH, 1) for k, v in dataset[0].items()}
    reference = reference_logits(model, batch)
    if scenario["trainer"] == "accelerate":
        record = run_accelerate(model, scenario, dataset)
    else:
        record = run_trainer(model, scenario, out / scenario["name"], dataset)
    logits = record.pop("logits")
    scale = reference.abs().max().clamp_min(1e-6)
    record["logits_rel_err"] = float(((logits - reference).abs().max() / scale).nan_to_num(float("inf")))
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", required=True, help="folder with one tiny model per architecture")
    parser.add_argument("--scenarios", required=True, help="JSON file: a list of scenarios")
    args = parser.parse_args()
    from accelerate.state import PartialState

    PartialState(cpu=True)  # joins the gloo group once; each scenario's FSDP state is built on top of it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for scenario in json.loads(Path(args.scenarios).read_text()):
        name = scenario["name"]
        try:
            results[name] = {"ok": True, **run_scenario(scenario, Path(args.models), out)}
        except Exception as err:  # noqa: BLE001 - recorded for the test to compare with the doctor's verdict
            results[name] = {"ok": False, "error_type": type(err).__name__, "error": str(err)[:2000],
                             "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        reset_accelerate()
        dist.barrier()
    finish_worker(out, results)  # results on disk, barrier, teardown, exit


if __name__ == "__main__":
    main()
