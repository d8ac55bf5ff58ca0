"""Check a merged model against peft: logits of base+adapter (unmerged) vs the merged model.

    python examples/check_merged.py --base demo_output/tiny-llama --adapter demo_output/adapter \
        --merged demo_output/merged
"""

from __future__ import annotations

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--merged", required=True)
    parser.add_argument("--prompt", default="What is the capital of France?")
    args = parser.parse_args(argv)

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.merged)
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, args.adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = unmerged(input_ids=ids).logits, merged(input_ids=ids).logits
    diff = (a - b).abs().max().item()
    scale = a.abs().max().item()
    print(f"merged vs peft (unmerged) logits: max abs diff {diff:.3e} (logit scale {scale:.2f})")
    if diff > 0.05 * scale:
        raise SystemExit("the merged model does not reproduce base+adapter: merge is wrong")
    out = merged.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"{args.prompt!r} -> {tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
