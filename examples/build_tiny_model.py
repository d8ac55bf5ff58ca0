"""Build a tiny Llama and a BPE tokenizer locally (no hub), for the CPU demo and for rehearsals.

    python examples/build_tiny_model.py --data examples/data/capitals.jsonl --output demo_output/tiny-llama

With ``--pretrain TEXT.jsonl`` the model then learns the language of that text by a short full pre-training
(single process, float32, a few seconds): the demo's base speaks "The capital of X is Y." about other countries
before QLoRA teaches it the facts it does not know.

    python examples/build_tiny_model.py --data examples/data/world.jsonl examples/data/facts.jsonl \
        --pretrain examples/data/world.jsonl --output demo_output/tiny-llama
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


def read_rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def pretrain(model, tokenizer, rows, steps: int, batch_size: int, lr: float, seed: int):
    """Full causal-LM training on every token of ``prompt + completion`` (the language, not a task). Returns
    the mean loss of the first and of the last 10 steps."""
    import torch

    texts = [tokenizer(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"] for r in rows]
    texts = [[tokenizer.bos_token_id, *ids, tokenizer.eos_token_id] for ids in texts]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(texts), (batch_size,), generator=generator).tolist()
        width = max(len(texts[i]) for i in pick)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, i in enumerate(pick):
            n = len(texts[i])
            ids[row, :n] = labels[row, :n] = torch.tensor(texts[i])
            mask[row, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", default=["examples/data/capitals.jsonl"],
                        help="JSONL file(s) with prompt/completion: the tokenizer learns their text")  # fmt: skip
    parser.add_argument("--pretrain", help="JSONL with prompt/completion to pre-train the model on (full training)")
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
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
    rows = [row for path in args.data for row in read_rows(path)]
    tokenizer = train_tokenizer([r["prompt"] + r["completion"] for r in rows], args.vocab_size)
    torch.manual_seed(args.seed)
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
    model = LlamaForCausalLM(config)
    if args.pretrain:
        first, last = pretrain(model, tokenizer, read_rows(args.pretrain), args.pretrain_steps, 32, 3e-3, args.seed)
        print(f"pre-trained on {args.pretrain} for {args.pretrain_steps} steps: loss {first:.2f} -> {last:.2f}")
    model = model.to(torch.bfloat16)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    n = sum(p.numel() for p in model.parameters())
    print(f"built a tiny Llama ({n / 1e6:.2f}M parameters, vocab {len(tokenizer)}) in {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
