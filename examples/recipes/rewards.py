"""The GRPO recipe's reward function (docs/recipes/grpo-trl.md), named in examples/recipes/grpo-trl.yaml by its
dotted path `examples.recipes.rewards.concise_summary`: trl's grpo.py imports it from the directory you launch in.

trl calls a reward function with the batch's completions (and every dataset column as a keyword argument) and
takes one float per completion; the completions of one prompt are then compared with each other.
"""

from __future__ import annotations

TARGET_WORDS = 40


def concise_summary(completions, **kwargs) -> list[float]:
    """1.0 for a summary of TARGET_WORDS words, falling linearly to 0.0 at none or twice as many.

    `completions` are strings (a dataset of plain prompts, like trl-lib/tldr) or, for chat prompts, lists of
    messages whose last one is the model's.
    """
    rewards = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        words = len(text.split())
        rewards.append(max(0.0, 1.0 - abs(words - TARGET_WORDS) / TARGET_WORDS))
    return rewards
