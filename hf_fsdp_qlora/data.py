"""Data helpers for instruction and classification fine-tuning: completion-only labels, padding, packing.

Completion-only labels: the loss is taken on the answer, not on the prompt (prompt tokens get label
-100), which is what an instruction or a classifier fine-tune (a Llama Guard style safety label as the
completion) wants.

Padding vs packing: padding each batch to its longest sequence wastes compute on pad tokens when lengths
vary (:func:`padding_waste` measures it); packing concatenates examples into fixed-length blocks with no
pad at all, and emits ``position_ids`` that restart at 0 for each example. Batch the blocks with
:class:`PackedCollator`: transformers (checked on 5.23) then builds a block-diagonal causal mask from the
``position_ids`` for ``sdpa`` and ``eager`` attention too (``flash_attention_2`` reads them directly), so no
example attends to another - the logits of a packed block equal each example's alone. That detection only
runs when the batch has no ``attention_mask`` and the model builds no KV cache; models come with
``use_cache=True`` in their config, and a forward with a cache silently lets packed examples attend to the
earlier ones in their block (logits off by 0.4 on a tiny Llama), so the collator passes ``use_cache=False``.
Use padding for short classification data, packing for long, varied instruction data.
"""

from __future__ import annotations

import warnings

import torch

__all__ = [
    "IGNORE_INDEX",
    "CompletionOnlyCollator",
    "PackedCollator",
    "pack_examples",
    "padding_waste",
    "tokenize_completion_only",
]

IGNORE_INDEX = -100


def tokenize_completion_only(prompt: str, completion: str, tokenizer, max_length: int | None = None, add_eos=True):
    """Tokenize ``prompt + completion``; labels are -100 on prompt tokens.

    Returns:
        ``{"input_ids": [...], "labels": [...]}`` (lists), truncated to `max_length` from the right.

    Warns (``UserWarning``) when no token keeps a label - `max_length` truncated the completion away, or
    the completion is empty - since such examples train on nothing.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if add_eos and tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    input_ids = bos + prompt_ids + completion_ids
    labels = [IGNORE_INDEX] * (len(bos) + len(prompt_ids)) + completion_ids
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        # Every label -100: this example trains on nothing, and a data set of them trains at loss 0 in silence.
        cause = (
            f"max_length={max_length} cut the whole completion away (the prompt alone is "
            f"{len(bos) + len(prompt_ids)} tokens); raise max_length or shorten the prompt"
            if completion_ids and max_length is not None
            else "the completion is empty; pass the text the model should learn to produce"
        )
        warnings.warn(f"tokenize_completion_only: no token of this example has a label: {cause}.", stacklevel=2)
    return {"input_ids": input_ids, "labels": labels}


class CompletionOnlyCollator:
    """Pad a list of ``{"input_ids", "labels"}`` to the longest (right side); pad labels are -100.

    Args:
        pad_token_id: the tokenizer's pad id (or eos id when it has no pad token).
        pad_to_multiple_of: round the padded length up (e.g. 8 for tensor cores).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, batch):
        width = max(len(example["input_ids"]) for example in batch)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, example in enumerate(batch):
            n = len(example["input_ids"])
            input_ids[row, :n] = torch.as_tensor(example["input_ids"])
            labels[row, :n] = torch.as_tensor(example.get("labels", example["input_ids"]))
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def pack_examples(examples, max_length: int):
    """Concatenate tokenized examples into blocks of exactly `max_length` tokens (the last may be shorter).

    Labels travel with their tokens (prompt tokens stay -100); the first token of every example after the
    first in a block gets label -100 too, so no loss is taken across an example boundary. ``position_ids``
    restart at 0 for every example.

    Returns:
        A list of ``{"input_ids", "labels", "position_ids"}`` blocks.
    """
    blocks, ids, labels, positions = [], [], [], []
    for example in examples:
        ex_ids = list(example["input_ids"])
        ex_labels = list(example.get("labels", ex_ids))
        start = 0
        while start < len(ex_ids):
            room = max_length - len(ids)
            piece = ex_ids[start : start + room]
            piece_labels = ex_labels[start : start + room]
            if ids and start == 0:
                piece_labels = [IGNORE_INDEX] + piece_labels[1:]
            ids += piece
            labels += piece_labels
            positions += list(range(start, start + len(piece)))
            start += len(piece)
            if len(ids) == max_length:
                blocks.append({"input_ids": ids, "labels": labels, "position_ids": positions})
                ids, labels, positions = [], [], []
    if ids:
        blocks.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return blocks


def padding_waste(examples, batch_size: int) -> float:
    """Fraction of tokens that would be padding when `examples` are batched in order and padded to the longest."""
    total = padded = 0
    for i in range(0, len(examples), batch_size):
        lengths = [len(e["input_ids"]) for e in examples[i : i + batch_size]]
        total += sum(lengths)
        padded += max(lengths) * len(lengths)
    return 1.0 - total / padded if padded else 0.0


class PackedCollator:
    """Batch blocks from :func:`pack_examples` so packed examples never attend to each other.

    Stacks ``input_ids``, ``labels`` and ``position_ids`` (blocks of one length: pack with the same
    `max_length` and drop or pad the short last block) and adds ``use_cache=False``, which the model's
    forward receives from the Trainer: with a KV cache, or with an ``attention_mask`` in the batch,
    transformers ignores the ``position_ids`` boundaries and every example sees the earlier ones in its block.
    """

    def __call__(self, blocks):
        widths = {len(block["input_ids"]) for block in blocks}
        if len(widths) > 1:
            raise ValueError(
                f"PackedCollator got blocks of lengths {sorted(widths)}; pack_examples leaves the last block "
                "shorter than max_length. Drop it (keep blocks with len(block['input_ids']) == max_length) "
                "or use batch size 1."
            )
        batch = {
            key: torch.tensor([list(block[key]) for block in blocks], dtype=torch.long)
            for key in ("input_ids", "labels", "position_ids")
        }
        batch["use_cache"] = False
        return batch
