"""What trl's own scripts need, built locally: a tiny Llama whose tokenizer has a ChatML chat template, a chat
dataset ("messages") and a preference dataset ("prompt"/"chosen"/"rejected"), as JSONL folders that
`datasets.load_dataset(folder)` reads with train and test splits (trl's `--dataset_name`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Printed (stdout and stderr) by tests/scripts/recipe_scenarios.py between its routes and the trl script it runs last.
TRL_MARKER = "recipe_scenarios: the routes are done; now trl's script through hf_fsdp_qlora.run"
WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "a",
    "mat",
    "red",
    "blue",
    "green",
    "one",
    "two",
    "three",
    "four",
    "five",
    "and",
    "is",
    "was",
]


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_recipe_model(path: str | Path, vocab_size: int = 160, seed: int = 0) -> Path:
    """A tiny bf16 Llama with a byte-level BPE tokenizer that knows ChatML's special tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return path
    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    tok.train_from_iterator(
        [_sentence(rng, 12) for _ in range(200)] + ["user assistant system\n"] * 20,
        trainer=trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>", bos_token=None
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _write(folder: Path, rows_by_split: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def build_chat_dataset(
    folder: str | Path, n_train: int = 16, n_test: int = 4, seed: int = 1, long_words: int = 0
) -> Path:
    """`long_words`: the first training row's answer has that many words (past a recipe's max_length)."""
    rng = random.Random(seed)

    def row(words=8):
        return {
            "messages": [
                {"role": "user", "content": _sentence(rng, 6)},
                {"role": "assistant", "content": _sentence(rng, words)},
            ]
        }

    train = [row(long_words or 8)] + [row() for _ in range(n_train - 1)]
    return _write(Path(folder), {"train": train, "test": [row() for _ in range(n_test)]})


def build_preference_dataset(
    folder: str | Path, n_train: int = 16, n_test: int = 4, seed: int = 2, long_words: int = 0
) -> Path:
    """`long_words`: the first training row's chosen answer has that many words."""
    rng = random.Random(seed)

    def row(words=5):
        return {
            "prompt": _sentence(rng, 6),
            "chosen": " " + _sentence(rng, words),
            "rejected": " " + _sentence(rng, 5),
        }

    train = [row(long_words or 5)] + [row() for _ in range(n_train - 1)]
    return _write(Path(folder), {"train": train, "test": [row() for _ in range(n_test)]})


def build_prompt_dataset(folder: str | Path, n_train: int = 8, n_test: int = 2, seed: int = 3) -> Path:
    """Plain prompts (trl-lib/tldr's `prompt` column), for GRPO."""
    rng = random.Random(seed)

    def row():
        return {"prompt": _sentence(rng, 10) + " TL;DR:"}

    return _write(Path(folder), {"train": [row() for _ in range(n_train)], "test": [row() for _ in range(n_test)]})


def build_example_jsonl(path: str | Path, columns: tuple[str, str], n: int = 12, seed: int = 4, long_words: int = 0):
    """The example scripts' JSONL (`prompt`/`completion`, or `prompt`/`label`); `long_words`: the first row's
    completion has that many words (cut at max_length from the right, it keeps labels: it trains on something)."""
    rng = random.Random(seed)
    first, second = columns
    rows = [{first: _sentence(rng, 6), second: _sentence(rng, long_words or 3)}]
    rows += [{first: _sentence(rng, 6), second: _sentence(rng, 3)} for _ in range(n - 1)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
