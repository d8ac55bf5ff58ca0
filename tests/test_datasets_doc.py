"""docs/datasets.md: every example row is accepted by its route's real data path.

A ```json block preceded by ``<!-- dataset-route: ROUTE -->`` holds JSONL rows. Our example scripts' rows go through
the columns the script reads and `tokenize_completion_only`; trl's rows through `SFTTrainer` / `DPOTrainer` building
their training sets (and, for SFT, a batch from the trainer's own collator) on the recipe tests' tiny chat model.
Each row must leave tokens that carry the loss, and a prompt's tokens must not.
"""

from __future__ import annotations

import json
import re

import pytest
from dist_utils import REPO

PAGE = REPO / "docs" / "datasets.md"
_BLOCK = re.compile(r"<!--\s*dataset-route:\s*(\w+)\s*-->\n```json\n(.*?)\n```", re.DOTALL)
# The example scripts of each of our routes, and the call that reads a row's columns there.
SCRIPTS = {
    "train_qlora": (["examples/train_qlora.py", "examples/train_with_callback.py"], 'r["prompt"], r["completion"]'),
    "safety_classifier": (["examples/safety_classifier.py"], 'r["prompt"]), r["label"]'),
}
IGNORE = -100


def _rows() -> list[tuple[str, dict]]:
    text = PAGE.read_text(encoding="utf-8")
    found = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        for offset, row in enumerate(match.group(2).splitlines()):
            found.append((match.group(1), json.loads(row), f"datasets.md:{line + 1 + offset}"))
    return found


ROWS = _rows()


def test_every_route_shows_rows():
    assert {route for route, _, _ in ROWS} == {"train_qlora", "safety_classifier", "sft", "dpo"}, ROWS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from recipe_fixtures import build_recipe_model
    from transformers import AutoTokenizer

    path = build_recipe_model(tmp_path_factory.mktemp("datasets_doc") / "model")
    return path, AutoTokenizer.from_pretrained(path)


def _ours(route, row, tokenizer):
    from hf_fsdp_qlora.data import tokenize_completion_only

    scripts, call = SCRIPTS[route]
    for script in scripts:  # the script reads exactly these columns
        assert call in (REPO / script).read_text(), (script, call)
    completion = row["completion"] if route == "train_qlora" else row["label"]
    return tokenize_completion_only(row["prompt"], completion, tokenizer)["labels"]


def _sft(row, path, tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=128)
    trainer = SFTTrainer(
        model=str(path), args=args, train_dataset=Dataset.from_list([row]), processing_class=tokenizer
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    return batch["labels"][0].tolist()


def _dpo(row, path, tokenizer, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=128)
    trainer = DPOTrainer(
        model=str(path), args=args, train_dataset=Dataset.from_list([row]), processing_class=tokenizer
    )
    example = trainer.train_dataset[0]
    assert example["prompt_ids"] and example["chosen_ids"] and example["rejected_ids"], example
    answers = tokenizer.decode(example["chosen_ids"] + example["rejected_ids"])
    assert "user" not in answers, answers  # the prompt (implicit ones too) is split off the answers


@pytest.mark.parametrize("route, row, where", ROWS, ids=[r[2] for r in ROWS])
def test_row_is_accepted_by_its_route(route, row, where, tiny, tmp_path):
    path, tokenizer = tiny
    if route in SCRIPTS:
        labels = _ours(route, row, tokenizer)
    elif route == "sft":
        labels = _sft(row, path, tokenizer, tmp_path)
    else:
        labels = _dpo(row, path, tokenizer, tmp_path)
        return
    learned = [label for label in labels if label != IGNORE]
    assert learned, f"{where}: no token of the row carries the loss: {labels}"
    if "prompt" in row:  # the prompt is context, never a target
        assert labels[0] == IGNORE, f"{where}: the prompt's first token is learned: {labels}"
    else:  # messages and text: every token is learned
        assert len(learned) == len(labels), f"{where}: {labels}"
