"""Refresh the doctor output quoted in docs/recipes/ after a deliberate change of the memory plan.

Each quoted doctor line is replaced by the doctor's line of the same shape (the same text with its numbers
blanked), and every GiB/figure that changed is replaced in the page's prose too, in one pass. Review the diff
before committing: `PYTHONPATH=$PWD:$PWD/tests python tests/refresh_recipe_figures.py`.
"""

from __future__ import annotations

import re

from test_recipes_docs import RUNS, _EXCERPT, excerpts, run_doctor

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _shape(line: str) -> str:
    return _NUMBER.sub("#", line.rstrip())


def _new_block(args, quoted: str, changed: dict[str, str]) -> str:
    printed = [line.rstrip() for line in run_doctor(("doctor", *args))[1].splitlines()]
    by_shape: dict[str, str] = {}
    for line in printed:
        by_shape.setdefault(_shape(line), line)
    out = []
    for line in quoted.splitlines():
        new = by_shape.get(_shape(line), line.rstrip())
        for old_n, new_n in zip(_NUMBER.findall(line), _NUMBER.findall(new), strict=False):
            if old_n != new_n and "." in old_n:
                changed[old_n] = new_n
        out.append(new)
    return "\n".join(out)


def refresh(page) -> dict[str, str]:
    text = page.read_text(encoding="utf-8")
    changed: dict[str, str] = {}
    blocks = [_new_block(args, quoted, changed) for _, args, quoted in excerpts(page)]
    if changed:  # one pass, so a new figure that equals another's old one is not replaced again
        pattern = "|".join(re.escape(old) for old in sorted(changed, key=len, reverse=True))
        text = re.sub(rf"(?<![\d.])(?:{pattern})(?!\d)", lambda m: changed[m.group(0)], text)
    bodies = iter(blocks)
    text = _EXCERPT.sub(lambda m: m.group(0).replace(m.group(2), next(bodies)), text)
    page.write_text(text, encoding="utf-8")
    return changed


if __name__ == "__main__":
    for page in RUNS:
        print(page.name, refresh(page))
