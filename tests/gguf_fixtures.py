"""What the GGUF tests share: llama.cpp's converters from the llama-cpp-python sdist (fetched once into .llama-cpp/,
as `make setup` does), tiny models with a sentencepiece tokenizer llama.cpp reads, their LoRA adapters and merges.

tests/test_gguf.py (main suite: tensors read back with gguf-py) and tests/gguf/test_llama_cpp.py (`make test-gguf`:
greedy tokens through llama-cpp-python) both build on these.
"""

from __future__ import annotations

import io
import random
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_VERSION = "0.3.36"  # the Makefile's LLAMA_CPP_VERSION
CACHE = REPO / ".llama-cpp"
SDIST = CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
# The LoRA targets llama.cpp's adapter GGUF carries (attention and MLP projections).
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fetch_sdist() -> tuple[Path | None, str]:
    """(the sdist, "") or (None, why not): pip's own download, with build dependencies as wheels (`--no-binary
    :all:` would build those from source too, minutes more)."""
    if SDIST.is_file():
        return SDIST, ""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--timeout", "60", "--retries", "2", "--no-deps"]
    cmd += ["--no-binary", "llama-cpp-python"]
    cmd += [f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(CACHE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except subprocess.TimeoutExpired:
        return None, "pip download of the llama-cpp-python sdist took over 10 minutes"
    if done.returncode != 0 or not SDIST.is_file():
        return None, f"pip could not download the llama-cpp-python {LLAMA_CPP_VERSION} sdist: {done.stderr[-300:]}"
    return SDIST, ""


def sentencepiece_model(path: Path, vocab_size: int = 128) -> int:
    """Train a tiny BPE sentencepiece model (llama.cpp reads tokenizer.model as is) on made-up words; its size."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 6))) for _ in range(300)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        character_coverage=1.0,
        minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    return vocab_size


def build_sp_model(path: Path, arch: str, seed: int = 0, **config_changes) -> Path:
    """A tiny random fp32 `arch` (tests/tiny_models.py's shapes) with a sentencepiece tokenizer, saved to `path`."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM, LlamaTokenizer

    path.mkdir(parents=True)
    vocab = sentencepiece_model(path / "tokenizer.model")
    config = tiny_config(arch, vocab_size=vocab)
    config.bos_token_id, config.eos_token_id = 1, 2
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    LlamaTokenizer(vocab_file=str(path / "tokenizer.model")).save_pretrained(path)
    return path


def trained_adapter(base: Path, out: Path, seed: int = 1, **lora_kwargs) -> Path:
    """A peft LoRA adapter of `base`, one SGD step away from its initialisation (lora_B nonzero), saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from tiny_models import sgd_step
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, **lora_kwargs}))
    sgd_step(peft_model, torch.randint(3, 100, (2, 12)))
    peft_model.save_pretrained(out)
    return out
