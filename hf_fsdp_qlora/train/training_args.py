"""`FSDPQLoRATrainingArguments`: `transformers.TrainingArguments` plus our training-hygiene settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..loss_paths import DEFAULT_LOSS_CHUNK_SIZE
from .tiled_mlp import DEFAULT_TILE_TOKENS

__all__ = ["FSDPQLoRATrainingArguments", "DEFAULT_COLLECTIVE_TIMEOUT_S"]

# A 70B QLoRA run gathers and writes its adapter and optimizer state, and a full fine-tune its whole
# model, while the other ranks wait in a collective; on slow shared storage that exceeds transformers'
# 30-minute default (`ddp_timeout=1800`) and the job dies with a NCCL watchdog timeout.
DEFAULT_COLLECTIVE_TIMEOUT_S = 2 * 60 * 60


@dataclass
class FSDPQLoRATrainingArguments(TrainingArguments):
    """TrainingArguments with a longer collective timeout and the hygiene checks of our trainers.

    Everything else is transformers' own; ``HfArgumentParser`` builds ``--help`` from these fields.
    For bit-for-bit reproducible runs use transformers' ``full_determinism=True`` (seed plus
    deterministic algorithms; see README for its measured cost).
    """

    ddp_timeout: int = field(
        default=DEFAULT_COLLECTIVE_TIMEOUT_S,
        metadata={
            "help": "Collective timeout in seconds (transformers' default is 1800). Checkpoint saves of large "
            "models keep the other ranks waiting in a collective; 7200 covers a 70B save on slow storage."
        },
    )
    check_distinct_batches: int = field(
        default=2,
        metadata={
            "help": "Check during the first N steps that ranks receive different batches, and fail fast if they "
            "do not (a missing DistributedSampler). 0 turns the check off."
        },
    )
    log_memory_throughput: bool = field(
        default=True,
        metadata={"help": "Add peak memory per rank and tokens per second to the logs at every logging step."},
    )
    compile_layers: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each decoder layer in place (accelerate's regional compilation; under FSDP2 after "
            "activation checkpointing and before sharding, so FSDP's hooks still run). Same as the accelerate "
            "config's dynamo_config: {dynamo_backend: INDUCTOR, dynamo_use_regional_compilation: true}. On CPU "
            "inductor needs a C++ compiler."
        },
    )
    auto_resume: bool = field(
        default=False,
        metadata={
            "help": "Resume train() from the latest complete checkpoint in output_dir, or start fresh when there is "
            "none, so a preempted job resumes with the same command (unchanged scripts under "
            "`-m hf_fsdp_qlora.run`: HF_FSDP_QLORA_AUTO_RESUME=1)."
        },
    )
    stop_after: str | None = field(
        default=None,
        metadata={
            "help": "Wall-clock budget from the process start, HH:MM:SS: then every rank saves one checkpoint at "
            "the next optimizer step and the process exits with status 75, as on a preemption signal (for clusters "
            "that kill without warning; under `-m hf_fsdp_qlora.run`: HF_FSDP_QLORA_STOP_AFTER)."
        },
    )
    preemption_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "Signals that make every rank save one checkpoint at the next optimizer step and exit with "
            "status 75 (comma-separated; '' for none). Handlers installed before train() are still called."
        },
    )
    activation_offloading: bool = field(
        default=False,
        metadata={
            "help": "Keep the activations saved for backward in host RAM between forward and backward (for long "
            "sequences on small GPUs; costs a copy each way). Parameters and tensors already in host memory are "
            "left alone, so on CPU it changes nothing."
        },
    )
    chunked_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the causal-LM loss without the full [batch x seq x vocab] logits: -100 positions dropped "
            "before the LM head, head and cross-entropy run loss_chunk_size tokens at a time and recomputed in the "
            "backward. Same loss as transformers' (sum / num_items_in_batch, or the mean). Trainers with a loss of "
            "their own (trl SFT/DPO) keep theirs; predict() and compute_metrics still get logits. False: stock loss."
        },
    )
    adapter_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the trainable tensors (LoRA, DoRA magnitudes, modules_to_save) are kept, stepped and saved "
            "in. 'float32' (default): fp32 master weights as stock peft, compute stays in the model's 16-bit dtype. "
            "'bfloat16' (or the model's 16-bit dtype): pure 16-bit adapters as torchtune's, less memory, but Adam "
            "steps below half a bf16 unit are rounded away (lr 1e-5: lora_A moved 0.17x of stock's). Under "
            "`-m hf_fsdp_qlora.run`: HF_FSDP_QLORA_ADAPTER_DTYPE."
        },
    )
    loss_chunk_size: int = field(
        default=DEFAULT_LOSS_CHUNK_SIZE,
        metadata={
            "help": "Tokens per chunk of the chunked loss. At a 128k vocabulary 512 tokens hold 0.12 GiB of bf16 "
            "logits (about 0.75 GiB with the fp32 loss and gradient) instead of the whole sequence's."
        },
    )

    sp_size: int = field(
        default=1,
        metadata={
            "help": "Ulysses sequence parallelism (accelerate's ParallelismConfig name): groups of sp_size ranks share "
            "each sequence, each holding 1/sp_size of its tokens; an all-to-all around attention trades the token "
            "split for a head split. FSDP still shards the base over every rank. Must divide the number of processes "
            "and the attention heads; SDPA attention, full-attention layers only (see docs/long-context.md)."
        },
    )
    tiled_mlp: bool = field(
        default=False,
        metadata={
            "help": "Run each dense MLP over tiles of tiled_mlp_tokens tokens, recomputed in backward, so the MLP's "
            "intermediate activations of the whole sequence are never held at once (exact; about a third more MLP "
            "compute). Mixture-of-experts blocks keep their own path."
        },
    )
    tiled_mlp_tokens: int = field(
        default=DEFAULT_TILE_TOKENS,
        metadata={"help": "Tokens per tile of the tiled MLP."},
    )

    def __post_init__(self):
        from .precision import check_adapter_dtype_name
        from .preemption import parse_signals, parse_stop_after

        parse_stop_after(self.stop_after)  # bad input fails here, not hours later
        parse_signals(self.preemption_signals)
        self.adapter_dtype = check_adapter_dtype_name(self.adapter_dtype)
        if self.loss_chunk_size < 1:
            raise ValueError(
                f"loss_chunk_size={self.loss_chunk_size}: must be at least 1 token; use {DEFAULT_LOSS_CHUNK_SIZE} (the "
                "default) or set chunked_loss=False for the stock loss."
            )
        if self.sp_size < 1 or self.tiled_mlp_tokens < 1:
            raise ValueError(
                f"sp_size={self.sp_size}, tiled_mlp_tokens={self.tiled_mlp_tokens}: both must be at least 1; use "
                f"sp_size=1 (no sequence parallelism) and tiled_mlp_tokens={DEFAULT_TILE_TOKENS} (the default)."
            )
        super().__post_init__()
