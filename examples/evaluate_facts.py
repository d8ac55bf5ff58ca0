"""Exact match on the taught facts, before and after QLoRA, and the merged model's answers (single process).

    python examples/evaluate_facts.py --base demo_output/tiny-llama --adapter demo_output/adapter \
        --merged demo_output/merged --data examples/data/facts.jsonl

Every question of DATA (rows whose prompt starts with --questions) is answered greedily: by the 4-bit base without
the adapter (before) and with the trained adapter (after; both loaded with hf_fsdp_qlora's own loader: the model
QLoRA trained), and by the merged model from merge-adapters, loaded as a plain 16-bit model. An answer is right when
it equals the completion exactly. merge-adapters adds the adapter to the 16-bit base (not to its 4-bit
quantization), so the merged model is checked against that: peft's unmerged 16-bit base + adapter. Exits 1 if the
two answer differently.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Before torch/peft/transformers: the CPU fixes and the filters of upstream noise come with this import.
from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.train.checkpoint import load_adapter_into


def answer(model, tokenizer, prompts, max_new_tokens=16):
    """Greedy answers, one batch, left-padded; the text up to the end-of-sequence token."""
    import torch

    batch = tokenizer([tokenizer.bos_token + p for p in prompts], return_tensors="pt", padding=True,
                      add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return [tokenizer.decode(row[batch["input_ids"].shape[1] :], skip_special_tokens=True) for row in out]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the 16-bit base model QLoRA trained on (quantized here)")
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--merged", required=True, help="merge-adapters output")
    parser.add_argument("--data", required=True, help="JSONL with prompt/completion: the taught facts")
    parser.add_argument("--questions", default="What is the capital of", help="evaluate rows with this prompt start")
    parser.add_argument("--show", default="What is the capital of France?", help="a question to print in full")
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["prompt"].startswith(args.questions)]
    if not rows:
        raise SystemExit(f"no row of {args.data} has a prompt starting with {args.questions!r}: pass --questions")
    prompts, expected = [r["prompt"] for r in rows], [r["completion"].strip() for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    tokenizer.padding_side = "left"

    torch.manual_seed(0)
    model = load_qlora_model(args.base, dtype=torch.bfloat16, lora_config=LoraConfig.from_pretrained(args.adapter),
                             gradient_checkpointing=False).eval()  # fmt: skip
    with model.disable_adapter():
        before = answer(model, tokenizer, prompts)
    load_adapter_into(model, args.adapter)
    after = answer(model, tokenizer, prompts)
    del model
    merged = answer(AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.bfloat16).eval(), tokenizer, prompts)
    base16 = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.bfloat16)
    unmerged = answer(PeftModel.from_pretrained(base16, args.adapter).eval(), tokenizer, prompts)

    def score(answers):
        return sum(a.strip() == e for a, e in zip(answers, expected))

    n = len(rows)
    same = sum(u == m for u, m in zip(unmerged, merged))
    print(f"\nexact match on the {n} taught facts (greedy answers to {args.questions!r} ...):")
    print(f"  {'model':<38} {'right':>7}")
    print(f"  {'before QLoRA: 4-bit base':<38} {score(before):>4}/{n}")
    print(f"  {'after QLoRA: 4-bit base + adapter':<38} {score(after):>4}/{n}")
    print(f"  {'16-bit base + adapter (peft, unmerged)':<38} {score(unmerged):>4}/{n}")
    print(f"  {'merged (merge-adapters, 16-bit)':<38} {score(merged):>4}/{n}")
    print(f"merged answers equal 16-bit base + adapter (peft, unmerged) answers: {same}/{n}")
    if args.show in prompts:
        i = prompts.index(args.show)
        print(f"{args.show!r}\n  before: {before[i].strip()!r}\n  after:  {after[i].strip()!r}\n"
              f"  merged: {merged[i].strip()!r}")  # fmt: skip
    if same != n:
        differ = [p for p, u, m in zip(prompts, unmerged, merged) if u != m]
        raise SystemExit(f"the merged model answers {len(differ)} question(s) differently from base+adapter: {differ}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
