"""The oracle: greedy tokens of the stock transformers model, with the adapter applied by peft (main venv)."""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def greedy_tokens(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy continuations (no KV cache, no stopping at EOS: vLLM runs with ignore_eos) and the smallest gap between
    the two best logits met on the way (a gap near float32 rounding would make any engine's tie-break legitimate)."""
    model.eval()
    outs, margin = [], float("inf")
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            top = logits.topk(2).values
            margin = min(margin, float(top[0] - top[1]))
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        outs.append(ids[0, len(prompt) :].tolist())
    return outs, margin


def peft_tokens(base: Path, adapter: Path | None, prompts, new_tokens: int):
    """Greedy tokens of `base` in float32, with `adapter` through peft (unmerged) when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return greedy_tokens(model, prompts, new_tokens)
