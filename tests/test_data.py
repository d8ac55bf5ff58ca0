"""Data helpers: completion-only labels, padding collator, packing."""

import pytest


from hf_fsdp_qlora.data import (
    IGNORE_INDEX,
    CompletionOnlyCollator,
    pack_examples,
    padding_waste,
    tokenize_completion_only,
)
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(64)


def test_completion_only_labels(tokenizer):
    out = tokenize_completion_only("t3 t4 t5", "t6 t7", tokenizer)
    assert out["input_ids"] == [3, 4, 5, 6, 7, tokenizer.eos_token_id]
    assert out["labels"] == [IGNORE_INDEX] * 3 + [6, 7, tokenizer.eos_token_id]
    cut = tokenize_completion_only("t3 t4 t5", "t6 t7", tokenizer, max_length=4)
    assert cut["input_ids"] == [3, 4, 5, 6] and cut["labels"] == [IGNORE_INDEX] * 3 + [6]


def test_collator_pads_and_masks(tokenizer):
    batch = [tokenize_completion_only("t3", "t4 t5", tokenizer), tokenize_completion_only("t3 t4 t5", "t6", tokenizer)]
    out = CompletionOnlyCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)(batch)
    assert out["input_ids"].shape == (2, 8)
    assert out["attention_mask"].sum(1).tolist() == [4, 5]
    assert (out["labels"][out["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert (out["input_ids"][out["attention_mask"] == 0] == tokenizer.pad_token_id).all()


def test_packing_keeps_every_token_and_label(tokenizer):
    examples = [tokenize_completion_only(f"t{3 + i}", "t9 t10 t11", tokenizer) for i in range(7)]
    blocks = pack_examples(examples, max_length=8)
    flat = [t for b in blocks for t in b["input_ids"]]
    assert flat == [t for e in examples for t in e["input_ids"]]
    assert all(len(b["input_ids"]) == 8 for b in blocks[:-1]) and len(blocks[-1]["input_ids"]) <= 8
    # No loss across an example boundary; positions restart per example.
    assert blocks[0]["labels"][5] == IGNORE_INDEX and blocks[0]["position_ids"][:6] == [0, 1, 2, 3, 4, 0]
    assert sum(lab != IGNORE_INDEX for b in blocks for lab in b["labels"]) == sum(
        lab != IGNORE_INDEX for e in examples for lab in e["labels"]
    )


def test_padding_waste():
    examples = [{"input_ids": [0] * n} for n in (2, 8, 4, 4)]
    assert padding_waste(examples, 2) == pytest.approx(1 - 18 / 24)
    assert padding_waste(examples, 1) == 0.0


def test_completion_truncated_away_warns(tokenizer):
    with pytest.warns(
        UserWarning, match=r"max_length=3 cut the whole completion away \(the prompt alone is 3 tokens\)"
    ):
        cut = tokenize_completion_only("t3 t4 t5", "t6 t7", tokenizer, max_length=3)
    assert cut["labels"] == [IGNORE_INDEX] * 3
    with pytest.warns(UserWarning, match="the completion is empty"):
        tokenize_completion_only("t3 t4", "", tokenizer, add_eos=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize_completion_only("t3 t4 t5", "t6 t7", tokenizer, max_length=4)  # one label left: no warning
