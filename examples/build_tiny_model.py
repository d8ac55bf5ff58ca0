"""Build a tiny Llama and a BPE tokenizer locally (no hub), for the CPU demo and for rehearsals.

python examples/build_tiny_model.py --data examples/data/capitals.jsonl --output demo_output/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="examples/data/capitals.jsonl", help="JSONL with prompt/completion")
    parser.add_argument("--output", default="demo_output/tiny-llama", help="where to save model + tokenizer")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--force", action="store_true", help="rebuild even if OUTPUT already holds a model")
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    output = Path(args.output)
    if (output / "config.json").exists() and not args.force:
        print(f"{output} already holds a model (pass --force to rebuild)")
        return 0
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    tokenizer = train_tokenizer([r["prompt"] + r["completion"] for r in rows], args.vocab_size)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    n = sum(p.numel() for p in model.parameters())
    print(f"built a tiny Llama ({n / 1e6:.2f}M parameters, vocab {len(tokenizer)}) in {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
