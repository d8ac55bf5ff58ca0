"""Our trainer without any distributed launch: same API, plain upstream saving, crash-safe checkpoints."""

import torch

from hf_fsdp_qlora import FSDPQLoRATrainer, FSDPQLoRATrainingArguments, load_qlora_model
from tiny_models import build_tiny_model


def test_single_process_checkpoints_and_resume(tmp_path):
    path = build_tiny_model(tmp_path / "llama", "llama")
    ids = torch.randint(3, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]

    def trainer(steps):
        args = FSDPQLoRATrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=steps, save_strategy="steps", save_steps=1,
            per_device_train_batch_size=2, report_to=[], use_cpu=True, seed=0, learning_rate=1e-2,
        )  # fmt: skip
        return FSDPQLoRATrainer(model=load_qlora_model(str(path), gradient_checkpointing=False), args=args,
                                train_dataset=data)  # fmt: skip

    first = trainer(2)
    first.train()
    out = tmp_path / "out"
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoint-2" / "optimizer.pt").is_file()  # upstream's own format outside FSDP
    assert not (out / ".incomplete-checkpoints").exists()  # nothing staged is left behind, not even the folder
    second = trainer(3)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 3 and (out / "checkpoint-3").is_dir()
