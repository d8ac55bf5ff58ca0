"""Refresh the doctor output quoted in docs/recipes/ after a deliberate change of the memory plan or of a recipe's
settings (examples/recipes/*.yaml).

Each page's settings block (``<!-- settings-file: PATH -->``) becomes that file as it is; each quoted block becomes the doctor's whole output for the page's command (tests/test_recipes_docs.py checks
that it is), and every figure that changed is replaced in the page's prose too, in one pass: a quoted line's old
figures map to those of the doctor's line of the same shape (the same text with its numbers blanked). Review the
diff before committing: `PYTHONPATH=$PWD:$PWD/tests python tests/refresh_recipe_figures.py`.
"""

from __future__ import annotations

import re

from test_recipes_docs import _EXCERPT, REPO, RUNS, _excerpts, doctor_block

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SETTINGS = re.compile(r"<!--\s*settings-file:\s*(\S+)\s*-->\n```yaml\n(.*?)\n```", re.DOTALL)


def settings_block(path: str) -> str:
    """A settings file as a page shows it (tests/test_recipes_settings.py): without its header comment."""
    lines = (REPO / path).read_text(encoding="utf-8").splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(lines)


def _shape(line: str) -> str:
    return _NUMBER.sub("#", line.rstrip())


def _new_block(args, quoted: str, model, changed: dict[str, str]) -> str:
    printed = doctor_block(args, model)
    by_shape: dict[str, str] = {}
    for line in printed.splitlines():
        by_shape.setdefault(_shape(line), line)
    for line in quoted.splitlines():
        new = by_shape.get(_shape(line), line.rstrip())
        for old_n, new_n in zip(_NUMBER.findall(line), _NUMBER.findall(new), strict=False):
            if old_n != new_n and "." in old_n:
                changed[old_n] = new_n
    return printed


def refresh(page) -> dict[str, str]:
    text = page.read_text(encoding="utf-8")
    changed: dict[str, str] = {}
    blocks = [_new_block(args, quoted, model, changed) for _, args, quoted, model in _excerpts(page)]
    if changed:  # one pass, so a new figure that equals another's old one is not replaced again
        pattern = "|".join(re.escape(old) for old in sorted(changed, key=len, reverse=True))
        prose = re.compile(rf"(?<![\d.])(?:{pattern})(?!\d)")
        parts = _EXCERPT.split(text)  # (prose, model, quoted, prose, ...): figures change in the prose only
        parts = [prose.sub(lambda m: changed[m.group(0)], p) if i % 3 == 0 else p for i, p in enumerate(parts)]
        text = _rejoin(parts)
    bodies = iter(blocks)
    text = _EXCERPT.sub(lambda m: m.group(0).replace(m.group(2), next(bodies)), text)
    text = _SETTINGS.sub(lambda m: m.group(0).replace(m.group(2), settings_block(m.group(1))), text)
    page.write_text(text, encoding="utf-8")
    return changed


def _rejoin(parts: list[str]) -> str:
    out = []
    for i in range(0, len(parts), 3):
        out.append(parts[i])
        if i + 2 < len(parts):
            out.append(f"<!-- doctor-output: model={parts[i + 1]} -->\n```text\n{parts[i + 2]}\n```")
    return "".join(out)


if __name__ == "__main__":
    for page in RUNS:
        print(page.name, refresh(page))
