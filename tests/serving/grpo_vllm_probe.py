"""The reward function trl's own ``grpo.py`` is given (``--reward_funcs grpo_vllm_probe.reward``), and the probe.

Importing it (grpo.py does, before building the trainer) wraps the adapter-only sync so that after every sync each
rank records, into ``$GRPO_PROBE_OUT/rank{R}.jsonl``:

* vLLM's greedy tokens for a few fixed prompts, served with the adapter just synced;
* the same from vLLM's base alone (no adapter): the adapter must change them, or the comparison proves nothing;
* the policy's greedy tokens (the FSDP-sharded 4-bit peft model being trained, ``generate_under_fsdp``);
* what the sync sent (tensors, bytes, seconds), and evidence that FSDP2 and the 4-bit base are engaged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

PROBES = [[5, 17, 42, 9, 77], [120, 3, 64, 200, 31, 8], [250, 251, 11]]
PROBE_TOKENS = 8
EOS = 1


def reward(completions, **kwargs):
    """Reward the completions made of even-numbered tokens ("t12 t40 ..."): varies between samples, so GRPO's
    advantages are non-zero and the adapter moves."""
    scores = []
    for text in completions:
        words = [w for w in str(text).split() if w.startswith("t") and w[1:].isdigit()]
        scores.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return scores


def _cut(tokens) -> list[int]:
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def _vllm_greedy(llm, lora_request) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROBES], params, lora_request=lora_request, use_tqdm=False)
    return [_cut(o.outputs[0].token_ids) for o in outs]


def _policy_greedy(model) -> list[list[int]]:
    from hf_fsdp_qlora.train.generation import generate_under_fsdp

    found = []
    for prompt in PROBES:  # one prompt at a time: no padding to tell apart
        ids = torch.tensor([prompt])
        out = generate_under_fsdp(
            model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=PROBE_TOKENS, do_sample=False
        )
        found.append(_cut(out[0, len(prompt) :].tolist()))
    return found


def _engaged(model) -> dict:
    import bitsandbytes as bnb
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    return {
        "fsdp2_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in params),
        # bitsandbytes' own 4-bit layers (peft's LoRA wrapper of one has the same class name)
        "linear4bit": sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()),
        "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
    }


def _install_probe() -> None:
    from hf_fsdp_qlora.train.vllm_sync import adapter_generation_class

    cls = adapter_generation_class()
    original = cls.sync_weights

    def sync_weights(self):
        entry = original(self)
        if entry is None:  # an unmarked model: trl's own sync
            return entry
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        record = {
            **entry,
            "vllm": _vllm_greedy(self.llm._llm, self.llm.request),
            "vllm_base": _vllm_greedy(self.llm._llm, None),
            "policy": _policy_greedy(self.model),
            "engaged": _engaged(self.model),
        }
        out = Path(os.environ["GRPO_PROBE_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return entry

    cls.sync_weights = sync_weights


if os.environ.get("GRPO_PROBE_OUT"):
    _install_probe()
