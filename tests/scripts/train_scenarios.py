"""Worker for the distributed trainer tests: runs several named scenarios in one launch.

Launched with `accelerate launch --config_file accelerate_configs/cpu_fsdp{1,2}_rehearsal.yaml` or with
torchrun (then --fsdp-version selects TrainingArguments.fsdp). No seed is set anywhere before the
trainers are built: identical adapters across ranks must come from our broadcast. Each rank writes
rank<N>.json with what it saw; the pytest side asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from dist_utils import finish_worker
from tiny_models import DECODER_LAYER

import hf_fsdp_qlora  # noqa: F401  (installs the CPU rehearsal hook before TrainingArguments)
from hf_fsdp_qlora import FSDPQLoRACallback, FSDPQLoRATrainer, load_qlora_model

# Read once at start: TrainingArguments(fsdp=...) exports ACCELERATE_USE_FSDP itself.
LAUNCHED_BY_ACCELERATE = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
SEQ = 16
N_SAMPLES = 8
BATCH = 2


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic samples of equal length (no padding), so the mean of per-rank losses is the global mean."""

    def __init__(self, vocab=256):
        gen = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(3, vocab, (N_SAMPLES, SEQ), generator=gen)

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def lora_config(**kw):
    from peft import LoraConfig

    kwargs = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs.update(kw)
    return LoraConfig(**kwargs)


def expert_lora_config(path=None):
    """LoRA on the experts' fused weights (peft's target_parameters, as trl's --lora_target_parameters) and q/v.
    DBRX (`path`'s config says so): its experts as the loader fuses them (``ffn.experts``, hf_fsdp_qlora/experts/
    dbrx.py) and its attention's fused ``Wqkv``."""
    if path is not None and json.loads((Path(path) / "config.json").read_text()).get("model_type") == "dbrx":
        targets = ["ffn.experts.gate_up_proj", "ffn.experts.down_proj"]
        return lora_config(target_modules=["Wqkv"], target_parameters=targets)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return lora_config(target_modules=["q_proj", "v_proj"], target_parameters=targets)


def bnb_config(storage=torch.bfloat16, eight_bit=False):
    from transformers import BitsAndBytesConfig

    if eight_bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=storage,
    )


def user_loaded(path, storage=torch.bfloat16, eight_bit=False, peft=True, autocast=True, kbit_prep=False):
    """A model loaded the way users do it by hand (peft defaults: fp32 adapters)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(storage, eight_bit), dtype=torch.bfloat16
    )
    if kbit_prep:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if not peft:
        return model
    return get_peft_model(model, lora_config(), autocast_adapter_dtype=autocast)


def _recording(base):
    """`base` with compute_loss recording the local loss of each step and the first step's logits."""

    class Recorder(base):
        losses: list = None
        first_logits = None

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            if self.losses is None:
                self.losses = []
            if not self.losses and getattr(outputs, "logits", None) is not None:
                self.first_logits = outputs.logits.detach().float().cpu()
            self.losses.append(float(loss.detach()))
            return (loss, outputs) if return_outputs else loss

    return Recorder


LossRecorder = _recording(FSDPQLoRATrainer)


def _batch_recording(base):
    """`base` recording each step's local input ids (tests/test_int8.py replays them single-process)."""

    class BatchRecorder(base):
        batches: list = None

        def compute_loss(self, model, inputs, *args, **kwargs):
            self.batches = (self.batches or []) + [inputs["input_ids"].tolist()]
            return super().compute_loss(model, inputs, *args, **kwargs)

    return BatchRecorder


Int8Recorder = _recording(_batch_recording(FSDPQLoRATrainer))
LossRecorderSFT = _recording(hf_fsdp_qlora.FSDPQLoRASFTTrainer)


def sft_dataset():
    """Pre-tokenized samples: trl skips tokenization when input_ids are present."""
    from datasets import Dataset

    data = TokenDataset()
    return Dataset.from_dict({"input_ids": [data.ids[i].tolist() for i in range(N_SAMPLES)]})


def training_args(out, fsdp_version, arch, steps=3, **kw):
    from transformers import TrainingArguments

    extra = {}
    if not LAUNCHED_BY_ACCELERATE:  # torchrun: FSDP from TrainingArguments
        extra = dict(
            fsdp=True,
            fsdp_config={
                "version": fsdp_version,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": [DECODER_LAYER[arch]],
                "state_dict_type": "FULL_STATE_DICT",
                # transformers defaults this to true for FSDP1; on CPU accelerate then looks for a GPU.
                "sync_module_states": False,
            },
        )
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_drop_last=True,
    )
    return TrainingArguments(**{**settings, **extra, **kw})


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def trainable_snapshot(model):
    from hf_fsdp_qlora.train.checkpoint import unwrap_peft_model

    inner = unwrap_peft_model(model) or model
    return {n: p.detach().float().clone() for n, p in inner.named_parameters() if p.requires_grad}


def expert_bytes(model, dtensor_only=False):
    """Bytes of 4-bit expert weights (experts/quantized.py) this rank holds: FSDP2 local shards, FSDP1 sharded views."""
    total = 0
    for name, p in model.named_parameters():
        if name.endswith("_proj_4bit") and (not dtensor_only or hasattr(p, "to_local")):
            total += (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
    return total


def expert_digest(model, version=None):
    """sha256 of the packed expert bytes, gathered whole under FSDP (collective then), or None without them.

    Bytes, not values: any float cast of the packed weights (a bf16 NaN pattern through fp32) changes it.
    """
    import hashlib

    from torch.distributed.tensor import DTensor

    def strip(name):
        return (
            name.replace("_fsdp_wrapped_module.", "")
            .replace("_checkpoint_wrapped_module.", "")
            .removeprefix("module.")
        )

    def digest():
        packed = {strip(n): p for n, p in model.named_parameters() if n.endswith("_proj_4bit")}
        if not packed:
            return None
        sha = hashlib.sha256()
        for name in sorted(packed):
            full = packed[name].full_tensor() if isinstance(packed[name], DTensor) else packed[name]
            sha.update(full.detach().clone().view(torch.uint8).numpy().tobytes())  # a copy: FSDP1 frees its storage
        return sha.hexdigest()

    if version != 1:
        return digest()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return digest()


def flat_bytes(model):
    """FSDP1: bytes of this rank's FlatParameter shards and of the whole unsharded FlatParameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flats = [m._flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]
    return {
        "flat_local_bytes": sum(f.numel() * f.element_size() for f in flats),
        "flat_full_bytes": sum(f._unpadded_unsharded_size.numel() * f.element_size() for f in flats),
    }


def checksum(state):
    return float(sum(v.double().sum() * (i + 1) for i, v in enumerate(state.values())))


def full_trainable(model, version):
    """Oracle gather, independent of hf_fsdp_qlora.train.checkpoint: FSDP2 DTensor.full_tensor / FSDP1 summon."""
    from torch.distributed.tensor import DTensor

    if version == 2:
        return {
            n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p)
            .detach()
            .float()
            .clone()
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", "")
            .replace("_checkpoint_wrapped_module.", "")
            .removeprefix("module."): p.detach().float().clone()
            for n, p in model.named_parameters()
            if p.requires_grad
        }


STORAGE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "uint8": torch.uint8}


def storage_config(kind):
    from transformers import BitsAndBytesConfig

    _, storage, quant_type, dq = kind.split("_")
    storage = STORAGE[storage]
    compute = storage if storage.is_floating_point else torch.bfloat16
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=dq == "dq",
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage,
    )
    return config, compute


def load_storage_variant(path, kind, peft=True):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    config, compute = storage_config(kind)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=compute)
    return get_peft_model(model, lora_config(), autocast_adapter_dtype=False) if peft else model


def build_model(path, kind):
    """(model, trainer class, callbacks) for a scenario kind."""
    from transformers import Trainer

    if kind == "ours_loader":
        return load_qlora_model(path, lora_config=lora_config(), gradient_checkpointing=False), LossRecorder, None
    if kind == "ours_user":  # loaded by hand, peft defaults (fp32 adapters)
        return user_loaded(path), LossRecorder, None
    if kind == "callback":  # stock Trainer + our callback
        return user_loaded(path), _recording(Trainer), [FSDPQLoRACallback()]
    if kind.startswith("st_"):  # st_<storage>_<quant type>_<dq|nodq>: the 4-bit storage matrix
        model = load_storage_variant(path, kind)
        return model, LossRecorder, None
    if kind == "dupbatches":  # a dataloader without a DistributedSampler: every rank sees the same data

        class NoSampler(LossRecorder):
            def get_train_dataloader(self):
                return torch.utils.data.DataLoader(self.train_dataset, batch_size=BATCH)

        return load_qlora_model(path, lora_config=lora_config(), gradient_checkpointing=False), NoSampler, None
    if kind == "expertlora":  # MoE: LoRA on the 4-bit experts (peft target_parameters) and on attention
        return (
            load_qlora_model(path, lora_config=expert_lora_config(path), gradient_checkpointing=False),
            LossRecorder,
            None,
        )
    if kind == "expertlora_callback":  # the same, trained by a stock Trainer with our callback
        model = load_qlora_model(path, lora_config=expert_lora_config(path), gradient_checkpointing=False)
        return model, _recording(Trainer), [FSDPQLoRACallback()]
    if kind == "int8_loader":  # tests/test_int8.py: load_qlora_model(bits=8)
        return (
            load_qlora_model(path, bits=8, lora_config=lora_config(), gradient_checkpointing=False),
            Int8Recorder,
            None,
        )
    if kind == "int8_lowram":  # tests/test_int8.py: load_qlora_model(bits=8, low_cpu_ram=True)
        model = load_qlora_model(
            path, bits=8, lora_config=lora_config(), gradient_checkpointing=False, low_cpu_ram=True
        )
        return model, Int8Recorder, None
    if kind == "int8_callback":  # tests/test_int8.py: stock Trainer + our callback on a load_in_8bit model
        return user_loaded(path, eight_bit=True), _recording(_batch_recording(Trainer)), [FSDPQLoRACallback()]
    if kind == "full":  # full fine-tune: no quantization, no adapter
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), LossRecorder, None
    if kind == "sft":  # base model + peft_config: trl builds the peft model (fp32 adapters)
        return user_loaded(path, peft=False), LossRecorderSFT, None
    # The classic failures: `stock_*` runs upstream transformers.Trainer on real FSDP; `ours_*` runs ours on
    # the same model, which must train or refuse with a clear error.
    who, problem = kind.split("_", 1)
    model = {
        "fp32lora": lambda: user_loaded(path, autocast=True),
        "kbitprep": lambda: user_loaded(path, kbit_prep=True),
        "uint8": lambda: user_loaded(path, storage=torch.uint8),
        "int8": lambda: user_loaded(path, eight_bit=True),
        # peft's own LoRA on 16-bit experts (quantize_experts=False): peft reads lora_A.weight outside its unit.
        # bf16 adapters: fp32 ones under a stock Trainer without our callback (no per-unit input cast) would fail
        # earlier, at the first LoRA matmul ("expected m1 and m2 to have the same dtype"), hiding peft's reshape.
        "expertlora16": lambda: load_qlora_model(
            path,
            lora_config=expert_lora_config(path),
            gradient_checkpointing=False,
            quantize_experts=False,
            adapter_dtype=torch.bfloat16,
        ),
    }[problem]()
    return model, (Trainer if who == "stock" else LossRecorder), None


def run_trainer_scenario(name, path, out, version, arch, kind):
    if kind.startswith("pack_"):  # padding-free packing (tests/test_packing.py): packed vs padded runs
        import packing_scenarios

        return packing_scenarios.run(name, path, out, version, arch, kind)
    if kind.startswith("precision_"):  # float32 master weights (tests/test_precision.py)
        import precision_scenarios

        return precision_scenarios.run(name, path, out, version, arch, kind)
    if kind.startswith("acrng_"):  # FSDP's activation checkpointing and dropout masks (tests/test_precision.py)
        import ac_rng_scenarios

        return ac_rng_scenarios.run(name, path, out, version, arch, kind)
    if kind.startswith("peftrecipe_"):  # peft's FSDP + QLoRA recipe (tests/test_peft_recipe.py)
        import peft_recipe_scenarios

        return peft_recipe_scenarios.run(name, path, out, version, arch, kind)
    if kind == "expertresume":  # LoRA on 4-bit experts: checkpoint and exact resume (tests/test_moe.py)
        import resume_scenarios

        return resume_scenarios.run_expert_lora_resume(name, path, out, version)
    result = {"scenario": name}
    model, trainer_cls, callbacks = build_model(path, kind)
    result["checksum_before_trainer"] = checksum(trainable_snapshot(model))
    args = training_args(out / name, version, arch)
    kwargs = dict(model=model, args=args, train_dataset=TokenDataset())
    if callbacks:
        kwargs["callbacks"] = callbacks
    if kind == "sft":
        from trl import SFTConfig

        fields = {f for f, d in SFTConfig.__dataclass_fields__.items() if d.init}
        sft_args = SFTConfig(**{**{k: v for k, v in vars(args).items() if k in fields}, "bf16": False})
        kwargs.update(args=sft_args, peft_config=lora_config(), train_dataset=sft_dataset())
    result["expert_bytes_before_wrap"] = expert_bytes(model)
    result["expert_digest_before_wrap"] = expert_digest(model)
    trainer = trainer_cls(**kwargs)
    init = trainable_snapshot(trainer.model)
    result["init_checksum"] = checksum(init)
    result["dtypes_before_wrap"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    # float32 master weights (train/precision.py): an adapter run's trainable tensors fp32, the frozen ones bf16
    result["frozen_dtypes_before_wrap"] = sorted(
        {str(p.dtype) for p in trainer.model.parameters() if not p.requires_grad}
    )
    result["trainable_dtypes_before_wrap"] = sorted(
        {str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}
    )
    result["adapter_run"] = hasattr(trainer.model, "peft_config")
    trainer.train()
    cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback)), None)
    result["engagement"] = cb.engagement if cb else None
    from hf_fsdp_qlora import MemoryThroughputCallback

    mem = next((c for c in trainer.callback_handler.callbacks if isinstance(c, MemoryThroughputCallback)), None)
    result["memory_throughput"] = mem.history if mem else None
    result["distributed_type"] = str(trainer.accelerator.state.distributed_type)
    result["is_fsdp2"] = bool(trainer.accelerator.is_fsdp2)
    packed = [p for n, p in trainer.model.named_parameters() if n.endswith("base_layer.weight")]
    result["packed_dtypes"] = sorted({str(p.dtype) for p in packed})
    result["packed_dtensor"] = sum(type(p).__name__ == "DTensor" for p in packed)
    result["packed_count"] = len(packed)
    result["packed_local_bytes"] = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in packed
    )
    result["packed_full_bytes"] = sum(p.numel() * p.element_size() for p in packed)
    sharded = [p for p in packed if hasattr(p, "device_mesh")]
    if sharded:
        result["mesh_shape"] = list(sharded[0].device_mesh.mesh.shape)
        result["placements"] = [str(pl) for pl in sharded[0].placements]
    if result["expert_digest_before_wrap"] is not None:
        result["expert_digest_after_training"] = expert_digest(trainer.model, version)
    result["expert_bytes_local"] = expert_bytes(trainer.model)
    result["expert_bytes_dtensor"] = expert_bytes(trainer.model, dtensor_only=True)
    policy = getattr(trainer.accelerator.state.fsdp_plugin, "mixed_precision_policy", None)
    result["mp_param_dtype"] = str(getattr(policy, "param_dtype", None))
    result["dtensor_lora"] = sum(
        type(p).__name__ == "DTensor" for n, p in trainer.model.named_parameters() if "lora_" in n
    )
    if getattr(trainer, "losses", None):
        step0 = torch.tensor([trainer.losses[0]], dtype=torch.float64)
        per_rank = [torch.zeros_like(step0) for _ in range(dist.get_world_size())]
        dist.all_gather(per_rank, step0)
        result["step0_losses"] = [float(x.item()) for x in per_rank]
        if trainer.first_logits is not None:  # trl may compute the loss without materialising logits
            torch.save(trainer.first_logits, out / name / f"logits_rank{rank()}.pt")
        # Which samples made the first global batch: each rank's first batch, gathered.
        first = next(iter(trainer.get_train_dataloader()))
        ids = first["input_ids"].contiguous()
        gathered = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, ids)
        result["first_batch"] = torch.cat(gathered).tolist()
    if getattr(trainer, "batches", None) is not None:  # tests/test_int8.py: every step's batch and loss
        result["step_batches"], result["step_losses"] = trainer.batches, trainer.losses
        result.update(flat_bytes(trainer.model) if version == 1 else {})
    try:  # merging a sharded model must fail clearly, naming the way to merge instead
        trainer.model.merge_and_unload()
        result["merge_while_sharded"] = "no error"
    except Exception as err:  # noqa: BLE001
        result["merge_while_sharded"] = f"{type(err).__name__}: {err}"
    trained = full_trainable(trainer.model, version)
    adapter_dir = out / name / "adapter"
    if not hasattr(trainer, "fsdp_callback"):  # a stock Trainer: save with our function
        from hf_fsdp_qlora.train.checkpoint import save_adapter

        save_adapter(trainer.model, adapter_dir)
    else:
        trainer.save_model(str(adapter_dir))
    if rank() == 0:
        torch.save({"init": init, "trained": trained}, out / name / "weights.pt")
    dist.barrier()
    reset_accelerate()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", required=True, help="folder with one tiny model per architecture")
    parser.add_argument("--fsdp-version", type=int, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated name=arch:kind")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for spec in args.scenarios.split(","):
        name, rest = spec.split("=")
        arch, kind = rest.split(":")
        path = Path(args.models) / arch  # built by the test before the launch
        try:
            results[name] = run_trainer_scenario(name, str(path), out, args.fsdp_version, arch, kind)
            results[name]["ok"] = True
        except Exception as err:  # recorded for the test to assert on
            results[name] = {"ok": False, "error_type": type(err).__name__, "error": str(err)[:2000],
                             "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
            print(f"[rank{rank()}] scenario {name} failed:\n{traceback.format_exc()}", flush=True)
            reset_accelerate()
    finish_worker(out, results)  # results on disk, barrier, teardown, exit


if __name__ == "__main__":
    main()
