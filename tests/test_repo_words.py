"""The repository speaks to users: none of the words of the maintainers' own GPU test set-up (a machine "lent" for
a while, a "device call" with its ``timeout_s``, folders it "carries", its report folder ``$OUT``) in any tracked
text file, new ones not yet committed included. Each pattern is a phrase of that set-up, so ordinary English
("saves carry the record", "excellent", ``$OUTPUT_DIR``) passes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATTERNS = {
    "a machine lent or a lend": re.compile(r"\b(lent|lends?|lending)\b", re.IGNORECASE),
    "the device tool's words": re.compile(r"(?<![a-z])device[ _-](calls?|tool|command|machine|time)\b", re.IGNORECASE),
    "the device tool's timeout option": re.compile(r"\btimeout_s\b"),
    "the device tool's carry option": re.compile(
        r"\bcarry\s*:|\bcarry \.whl|\bcarried (wheels?|set|folder)\b|\b(tool|device) carries\b", re.IGNORECASE
    ),
    "the device tool's report folder": re.compile(r"\$OUT\b|\$\{OUT\}|environ(\.get\(|\[)\s*[\"']OUT[\"']"),
    "the set-up's own folders": re.compile(r"\.library/|/work/shared\b"),
}


def _tracked_text_files() -> list[Path]:
    # Tracked files and new ones not yet added (git's ignore rules apply), so a new page fails before its commit.
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(listing, cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    files = []
    for name in filter(None, names):
        path = REPO / name.decode()
        if path.resolve() == Path(__file__).resolve() or not path.is_file():
            continue  # this file names the patterns it looks for
        data = path.read_bytes()
        if b"\0" not in data[:8192]:  # a binary file (an image) holds no prose
            files.append(path)
    return files


def test_no_words_of_the_internal_gpu_set_up():
    files = _tracked_text_files()
    assert any(f.name == "gpu-check.md" for f in files) and any(f.name == "Makefile" for f in files)
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(REPO)}:{number}: {what}: {line.strip()[:100]}"
                      for what, pattern in PATTERNS.items() if pattern.search(line)]  # fmt: skip
    assert not found, "words of the internal GPU set-up, meaningless to a user:\n" + "\n".join(found)
