"""Which loss path a run takes, and how many bytes of logits each path holds at once (torch-free).

The one predicate of "which loss will this run compute" (:func:`loss_path`, :func:`stock_loss_reason`), shared by
:mod:`hf_fsdp_qlora.train.loss` (which asks it with the facts of a live trainer) and the doctor's memory plan (which
asks it with the planned settings and the model's config.json), so the doctor plans the loss the trainer computes:

* ``ours``: our trainers and every route that adopts our mixin (``FSDPQLoRACallback`` on any Trainer, ``python -m
  hf_fsdp_qlora.run``) on a Trainer that keeps transformers' own loss: positions labelled -100 are dropped before
  the LM head, and the head and the cross-entropy run ``loss_chunk_size`` tokens at a time. One chunk's logits live
  at a time; a plain ``nn.Linear`` head computes its gradients in the forward and holds them until the backward.
* ``sft``: trl's ``SFTTrainer`` (1.16), whose fused LM head folds tiles of 4096 tokens x 32768 vocabulary columns.
  Also under ``python -m hf_fsdp_qlora.run`` with trl's ``sft.py``: the trainer's own loss runs, not ours.
* ``stock``: a ``transformers.Trainer`` without our mixin, ``chunked_loss=False``, or a model/setting our chunked
  loss cannot reproduce (:func:`stock_loss_reason`): the model materializes ``[batch x seq x vocab]`` logits, the
  loss makes a float32 copy and its log-softmax, and the backward holds their gradient.
* ``dpo``: trl's ``DPOTrainer`` (1.16): the same fused head as ``sft``, over chosen and rejected sequences
  concatenated (twice the sequences of the batch).
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_LOSS_CHUNK_SIZE",
    "LOGIT_TRANSFORMS",
    "LOSS_PATHS",
    "config_loss_reason",
    "logits_bytes",
    "loss_path",
    "own_loss_path",
    "sequences_factor",
    "stock_loss_reason",
]

LOSS_PATHS = ("ours", "sft", "stock", "dpo")
# 512 tokens x a 128k vocabulary: 0.12 GiB of bf16 logits per chunk (0.7 GiB with the fp32 log-softmax and the
# gradient); the per-chunk overhead (one matmul launch) is negligible from a few hundred tokens on. Measured on CPU
# (benchmarks/chunked_loss.py, 8192 tokens): 15.6x less peak memory than the stock loss at 512, 7.9x at 1024.
DEFAULT_LOSS_CHUNK_SIZE = 512
# trl 1.16's fused LM head (trl.kernels.chunked_logprob): TOKEN_CHUNK_SIZE tokens x _CHUNKED_LOGPROB_CHUNK_SIZE columns.
TRL_TILE_TOKENS = 4096
TRL_TILE_VOCAB = 32768
# Config attributes of known transforms of the logits after the head (caps, scales). Only a prediction for the doctor
# (which has no model to run): the trainer also detects any transform at run time, whatever its name
# (hf_fsdp_qlora.train.loss), and both then keep the stock loss.
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",  # Gemma 2/3
    "logits_soft_cap",  # RecurrentGemma
    "output_logit_soft_cap",  # xLSTM
    "logit_scale",  # Cohere
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",  # Granite
)


def config_loss_reason(config) -> str | None:
    """Why a model of `config` (a config object or config.json's dict; its text config for a multimodal one) keeps
    the stock loss, as far as its config tells (None: nothing known)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    for name in LOGIT_TRANSFORMS:
        if get(name) is not None:
            return f"the model transforms its logits after the head (`{name}`)"
    return None


def own_loss_path(trainer_class: str) -> str:
    """The path of a trainer class that computes its own loss: trl's SFT and DPO trainers by name, else "own"."""
    return "dpo" if "DPO" in trainer_class else "sft" if "SFT" in trainer_class else "own"


def stock_loss_reason(
    *,
    chunked_loss: bool = True,
    compute_loss_func: bool = False,
    label_smoothing: bool = False,
    liger: bool = False,
    causal_lm: bool = True,
    config=None,
) -> str | None:
    """Why a trainer with our mixin (and no loss of its own) keeps transformers' stock loss; None: ours runs.

    Args:
        chunked_loss: ``FSDPQLoRATrainingArguments.chunked_loss``.
        compute_loss_func: a ``compute_loss_func`` was given to the trainer.
        label_smoothing: ``label_smoothing_factor`` is not 0.
        liger: ``use_liger_kernel``.
        causal_lm: the model is a causal LM with an output embedding.
        config: the model's (text) config, object or dict; see :func:`config_loss_reason`.
    """
    if not chunked_loss:
        return "chunked_loss=False"
    if compute_loss_func or label_smoothing:
        return "compute_loss_func or label smoothing needs the full logits"
    if liger:
        return "Liger computes its own fused loss"
    if not causal_lm:
        return "not a causal LM with an output embedding"
    return config_loss_reason(config) if config is not None else None


def loss_path(trainer: str = "hf_fsdp_qlora", trainer_class: str | None = None, **facts) -> tuple[str, str | None]:
    """The loss path of a run, and why it is not ``ours`` (None when it is).

    Args:
        trainer: whose loop runs: "hf_fsdp_qlora" (our trainers, the callback, ``-m hf_fsdp_qlora.run``),
            "transformers" or "accelerate" (no mixin: the stock loss).
        trainer_class: the Trainer class the script builds when it defines its own ``compute_loss`` (trl's
            ``SFTTrainer``, ``DPOTrainer``); None for a Trainer that keeps transformers' loss.
        **facts: the keyword arguments of :func:`stock_loss_reason`.
    """
    if trainer != "hf_fsdp_qlora":
        return "stock", f"trainer={trainer!r} runs transformers' loss"
    if trainer_class is not None:
        return own_loss_path(trainer_class), f"{trainer_class} computes its own loss"
    reason = stock_loss_reason(**facts)
    return ("stock", reason) if reason else ("ours", None)


def sequences_factor(loss_path: str) -> int:
    """How many sequences per sample the forward runs (DPO: chosen and rejected)."""
    return 2 if loss_path == "dpo" else 1


def logits_bytes(
    loss_path: str,
    tokens: int,
    vocab: int,
    act_bytes: int,
    hidden: int,
    chunk: int = DEFAULT_LOSS_CHUNK_SIZE,
    head_trained: bool = False,
) -> int:
    """Peak bytes of logits and loss working memory for `tokens` tokens per micro-batch (after any DPO doubling).

    Per logit: the logits in the compute dtype, transformers' float32 copy and the float32 log-softmax / gradient
    (at least 12 bytes). Our chunked path also keeps the labelled positions' hidden states and their gradient (held
    from the forward to the backward) and, for a trained head (a full fine-tune), the float32 ``[vocab x hidden]``
    weight gradient it accumulates over the chunks in the forward plus one chunk's product in the compute dtype.
    """
    per_logit = max(act_bytes + (4 if act_bytes < 4 else 0) + 4, 12)
    if loss_path == "stock":
        return tokens * vocab * per_logit
    if loss_path == "ours":
        # a trained head: its float32 gradient, and each chunk's [vocab x hidden] product before it is added in
        held = 2 * tokens * hidden * act_bytes + (vocab * hidden * (4 + act_bytes) if head_trained else 0)
        return min(tokens, chunk) * vocab * per_logit + held
    if loss_path in ("sft", "dpo"):
        # One tile in the compute dtype plus its float32 working copy, and trl's per-token float32 outputs.
        return min(tokens, TRL_TILE_TOKENS) * min(vocab, TRL_TILE_VOCAB) * (act_bytes + 4) + tokens * 4 * 4
    raise ValueError(f"loss_path={loss_path!r}: use one of {', '.join(LOSS_PATHS)}.")
