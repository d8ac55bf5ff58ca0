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
WORDS = "the cat dog sat on a mat red blue green one two three four five and is was".split()


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


def build_chat_dataset(folder: str | Path, n_train: int = 16, n_test: int = 4, seed: int = 1) -> Path:
    rng = random.Random(seed)

    def row():
        return {
            "messages": [
                {"role": "user", "content": _sentence(rng, 6)},
                {"role": "assistant", "content": _sentence(rng, 8)},
            ]
        }

    return _write(Path(folder), {"train": [row() for _ in range(n_train)], "test": [row() for _ in range(n_test)]})


def build_preference_dataset(folder: str | Path, n_train: int = 16, n_test: int = 4, seed: int = 2) -> Path:
    rng = random.Random(seed)

    def row():
        return {"prompt": _sentence(rng, 6), "chosen": " " + _sentence(rng, 5), "rejected": " " + _sentence(rng, 5)}

    return _write(Path(folder), {"train": [row() for _ in range(n_train)], "test": [row() for _ in range(n_test)]})
