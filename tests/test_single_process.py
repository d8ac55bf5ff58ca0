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


def test_fsdp_checkpointing_stops_forcing_input_grads(tmp_path):
    """load_qlora_model's checkpointing makes the embeddings' output require grad (reentrant checkpointing needs it).
    Where FSDP's own, non-reentrant checkpointing replaces it, that hook is removed, so no step back-propagates into
    the frozen embedding through the first layer (3 extra 4-bit matmuls forward and backward per step, issue 49).
    Before, transformers' gradient_checkpointing_enable and load_qlora_model each registered one and the first
    could not be removed."""
    from hf_fsdp_qlora.train.accelerator_setup import _stop_forcing_input_grads

    model = load_qlora_model(str(build_tiny_model(tmp_path / "llama", "llama")))
    embeddings = model.get_input_embeddings()
    ids = torch.tensor([[3, 4, 5]])
    assert len(embeddings._forward_hooks) == 1 and embeddings(ids).requires_grad
    assert _stop_forcing_input_grads(model)
    assert not embeddings._forward_hooks and not embeddings(ids).requires_grad
    assert not _stop_forcing_input_grads(model)  # nothing left to remove
