"""peft's own FSDP + QLoRA recipe (kinds ``peftrecipe_<variant>``) for train_scenarios.py, used by
tests/test_peft_recipe.py.

peft's examples are not installed, so this is peft's ``examples/sft/train.py`` (with its ``utils.py``) as
``run_peft_qlora_fsdp.sh`` runs it, rebuilt step by step, with ``SFTTrainer`` swapped for our
``FSDPQLoRASFTTrainer`` (the one change a user makes) and the model and data made small: the tiny ChatML Llama of
tests/recipe_fixtures.py, a local chat dataset, ``max_length`` 64, eager attention (``--use_flash_attn`` needs a
GPU; the recipe's own fallback is eager). The script's flags, as its ``SFTConfig``/``LoraConfig``/
``BitsAndBytesConfig``: ``--bf16 True --packing True --gradient_accumulation_steps 2 --gradient_checkpointing True
--use_reentrant True --lora_target_modules all-linear --lora_r 8 --lora_alpha 16 --lora_dropout 0.1
--use_nested_quant True --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_storage_dtype bfloat16 --max_grad_norm
1.0 --weight_decay 1e-4 --eval_strategy epoch --save_strategy epoch --lr_scheduler_type cosine --seed 100``, then
``set_state_dict_type("FULL_STATE_DICT")`` and ``save_model()``.

Variants: ``flags`` - the recipe's flags unchanged; ``record`` - the same with ``--lora_dropout 0`` (a rank's dropout
masks cannot be replayed in one process), recording the start and every rank's micro-batches for the test's
single-process oracle (trl's stock SFTTrainer, gradient accumulation 4 = 2 ranks x 2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import train_scenarios as base
from recipe_fixtures import CHATML_TEMPLATE, build_chat_dataset

CHATML = {"pad_token": "<pad>", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
MAX_LENGTH = 64
TRAIN_ROWS = 48  # packed into 64-token sequences: 3 optimizer steps of 2 ranks x 2 micro-batches x 2 sequences


def recipe_model(path, tokenizer):
    """utils.create_and_prepare_model: NF4 with nested quant and bf16 storage, the model in the storage dtype, the
    embeddings resized for the ChatML tokens (to a multiple of 8)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed

    # train.py's main() starts with set_seed(training_args.seed): every rank (and the oracle) then initialises the
    # embedding rows the resize adds alike (the CPU configs do not broadcast frozen weights: sync_module_states off).
    set_seed(100)
    bnb = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, attn_implementation="eager", dtype=torch.bfloat16
    )
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    return model


def recipe_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        path, **CHATML, additional_special_tokens=[CHATML["bos_token"], CHATML["eos_token"]]
    )


def recipe_lora(dropout):
    from peft import LoraConfig

    return LoraConfig(
        lora_alpha=16, lora_dropout=dropout, r=8, bias="none", task_type="CAUSAL_LM", target_modules="all-linear"
    )


def recipe_args(out, **kw):
    """train.py's SFTConfig for run_peft_qlora_fsdp.sh's flags (the model and dataset sizes scaled down)."""
    from trl import SFTConfig

    settings = {
        "output_dir": str(out), "seed": 100, "num_train_epochs": 1, "logging_steps": 1, "logging_strategy": "steps",
        "eval_strategy": "epoch", "save_strategy": "epoch", "bf16": True, "packing": True, "learning_rate": 1e-4,
        "lr_scheduler_type": "cosine", "weight_decay": 1e-4, "warmup_steps": 0, "max_grad_norm": 1.0,
        "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
        "dataset_text_field": "content", "max_length": MAX_LENGTH, "report_to": "none", "use_cpu": True,
    }  # fmt: skip
    settings.update(kw)
    return SFTConfig(**settings)


def recipe_datasets(folder, tokenizer):
    """utils.create_datasets: the chat rows rendered with the chat template into the "content" text column."""
    from datasets import load_dataset

    raw = load_dataset(str(build_chat_dataset(folder, n_train=TRAIN_ROWS)))

    def render(samples):
        return {"content": [tokenizer.apply_chat_template(c, tokenize=False) for c in samples["messages"]]}

    data = raw.map(render, batched=True, remove_columns=raw["train"].column_names)
    return data["train"], data["test"]


def record_micro_batches(trainer) -> list:
    """Every micro-batch this rank trains on, as the Trainer hands it to ``training_step``."""
    seen = []
    step = trainer.training_step

    def recording(model, inputs, *args, **kwargs):
        seen.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = recording
    return seen


def run(name, path, out, version, arch, kind):
    from hf_fsdp_qlora import FSDPQLoRACallback, FSDPQLoRASFTTrainer

    variant = kind.removeprefix("peftrecipe_")
    folder = out / name
    tokenizer = recipe_tokenizer(path)
    tokenizer.chat_template = CHATML_TEMPLATE  # utils.py: DEFAULT_CHATML_CHAT_TEMPLATE
    model = recipe_model(path, tokenizer)
    args = recipe_args(folder)
    model.config.use_cache = not args.gradient_checkpointing
    train, evaluation = recipe_datasets(folder / f"data_rank{base.rank()}", tokenizer)
    trainer = FSDPQLoRASFTTrainer(
        model=model, processing_class=tokenizer, args=args, train_dataset=train, eval_dataset=evaluation,
        peft_config=recipe_lora(0.1 if variant == "flags" else 0.0),
    )  # fmt: skip
    batches = record_micro_batches(trainer) if variant == "record" else None
    init = base.trainable_snapshot(trainer.model)
    trainer.train()
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, FSDPQLoRACallback))
    result = {"engagement": cb.engagement, "distributed_type": str(trainer.accelerator.state.distributed_type)}
    result["gradient_accumulation_steps"] = trainer.args.gradient_accumulation_steps
    result["global_steps"] = trainer.state.global_step
    result["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result["eval_losses"] = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    result["trainable_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad})
    result["checkpoints"] = sorted(p.name for p in folder.glob("checkpoint-*"))
    trained = base.full_trainable(trainer.model, version)
    if trainer.is_fsdp_enabled:  # train.py's last lines
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()
    if batches is not None:
        torch.save({"init": init, "batches": batches}, folder / f"record_rank{base.rank()}.pt")
    if base.rank() == 0:
        torch.save({"init": init, "trained": trained}, folder / "weights.pt")
    dist.barrier()
    base.reset_accelerate()
    return result
