"""Which loss path a run takes, and how many bytes of logits each path holds at once (torch-free).

Shared by :mod:`hf_fsdp_qlora.train.loss` (which decides the path of a live trainer) and the doctor's memory plan
(which plans it from settings), so both speak of the same paths and the same chunk sizes:

* ``ours``: our trainers and every route that adopts our mixin (``FSDPQLoRACallback`` on any Trainer, ``python -m
  hf_fsdp_qlora.run``) on a Trainer that keeps transformers' own loss: positions labelled -100 are dropped before
  the LM head, and the head and the cross-entropy run ``loss_chunk_size`` tokens at a time, each chunk recomputed in
  the backward. One chunk's logits live at a time.
* ``sft``: trl's ``SFTTrainer`` (1.16), whose fused LM head folds tiles of 4096 tokens x 32768 vocabulary columns.
* ``stock``: a ``transformers.Trainer`` without our mixin (or ``chunked_loss=False``): the model materializes
  ``[batch x seq x vocab]`` logits, the loss makes a float32 copy and its log-softmax, and the backward holds their
  gradient.
* ``dpo``: trl's ``DPOTrainer`` (1.16): the same fused head as ``sft``, over chosen and rejected sequences
  concatenated (twice the sequences of the batch).
"""

from __future__ import annotations

__all__ = ["DEFAULT_LOSS_CHUNK_SIZE", "LOSS_PATHS", "default_loss_path", "logits_bytes"]

LOSS_PATHS = ("ours", "sft", "stock", "dpo")
# 512 tokens x a 128k vocabulary: 0.12 GiB of bf16 logits per chunk (0.7 GiB with the fp32 log-softmax and the
# gradient); the per-chunk overhead (one matmul launch) is negligible from a few hundred tokens on. Measured on CPU
# (benchmarks/chunked_loss.py, 8192 tokens): 15.6x less peak memory than the stock loss at 512, 7.9x at 1024.
DEFAULT_LOSS_CHUNK_SIZE = 512
# trl 1.16's fused LM head (trl.kernels.chunked_logprob): TOKEN_CHUNK_SIZE tokens x _CHUNKED_LOGPROB_CHUNK_SIZE columns.
TRL_TILE_TOKENS = 4096
TRL_TILE_VOCAB = 32768


def default_loss_path(trainer: str) -> str:
    """The loss path of a run whose loop is `trainer` ("hf_fsdp_qlora", "transformers" or "accelerate")."""
    return "ours" if trainer == "hf_fsdp_qlora" else "stock"


def sequences_factor(loss_path: str) -> int:
    """How many sequences per sample the forward runs (DPO: chosen and rejected)."""
    return 2 if loss_path == "dpo" else 1


def logits_bytes(
    loss_path: str, tokens: int, vocab: int, act_bytes: int, hidden: int, chunk: int = DEFAULT_LOSS_CHUNK_SIZE
) -> int:
    """Peak bytes of logits and loss working memory for `tokens` tokens per micro-batch (after any DPO doubling).

    Per logit: the logits in the compute dtype, transformers' float32 copy and the float32 log-softmax / gradient
    (at least 12 bytes). Our chunked path also keeps the gathered hidden states of the labelled positions.
    """
    per_logit = max(act_bytes + (4 if act_bytes < 4 else 0) + 4, 12)
    if loss_path == "stock":
        return tokens * vocab * per_logit
    if loss_path == "ours":
        return min(tokens, chunk) * vocab * per_logit + tokens * hidden * act_bytes
    if loss_path in ("sft", "dpo"):
        # One tile in the compute dtype plus its float32 working copy, and trl's per-token float32 outputs.
        return min(tokens, TRL_TILE_TOKENS) * min(vocab, TRL_TILE_VOCAB) * (act_bytes + 4) + tokens * 4 * 4
    raise ValueError(f"loss_path={loss_path!r}: use one of {', '.join(LOSS_PATHS)}.")
