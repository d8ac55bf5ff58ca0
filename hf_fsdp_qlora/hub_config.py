"""A model named by its Hugging Face Hub id (``org/name``): only its ``config.json`` is fetched, never a weight.

The doctor plans from a config alone, so ``--model meta-llama/Llama-3.1-8B`` needs one small file, not 16 GB.
``huggingface_hub`` fetches it with the user's own token (``hf auth login``, ``HF_TOKEN``) into the user's own cache
(``HF_HUB_CACHE``); under ``HF_HUB_OFFLINE=1`` it reads that cache only. Every way of not getting the file (gated,
unknown or private repository, offline and not cached, no ``config.json``) becomes one ``SetupInputError`` that
names the repository and the fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import SetupInputError

__all__ = ["fetch_config", "looks_like_hub_id"]

# Hub ids: `org/name`, letters, digits, `-`, `_`, `.`; a path that starts with `.`, `/` or `~`, or names a .json
# file, is a local path whatever else it looks like.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_hub_id(model) -> bool:
    """True for a string of the form ``org/name`` that is not an existing local path."""
    if not isinstance(model, (str, os.PathLike)):
        return False
    text = os.fspath(model)
    return bool(_HUB_ID.fullmatch(text)) and not text.endswith(".json") and not Path(text).exists()


def _fixes(repo: str) -> str:
    return (
        f"Log in with an account that may read it (`hf auth login`, or `huggingface-cli login` with huggingface_hub "
        f"< 1.0; or set HF_TOKEN), pre-fetch the file with `hf download {repo} config.json` (`huggingface-cli "
        f"download {repo} config.json`), or pass a local model folder or its config.json."
    )


def _explain(repo: str, err: Exception) -> str:
    """The user's message for a failed fetch of ``config.json`` from ``repo``."""
    from huggingface_hub import errors

    if isinstance(err, errors.GatedRepoError):  # before RepositoryNotFoundError, its parent class
        return (
            f"{repo} is a gated repository: its files need access granted to your account. Ask for access on "
            f"https://huggingface.co/{repo}, then log in (`hf auth login`, or `huggingface-cli login`; or set "
            f"HF_TOKEN) and run again. Or pass a local model folder or its config.json."
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"--model {repo}: no local folder of that name, and no Hub repository {repo} that your token may read "
            f"(a typo, or a private repository). {_fixes(repo)}"
        )
    if isinstance(err, errors.LocalEntryNotFoundError):  # offline, or no connection, and not in the cache
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        return (
            f"--model {repo}: {why} and {repo}'s config.json is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}). On a machine with internet run `hf download {repo} config.json` "
            f"(`huggingface-cli download {repo} config.json`) into the same cache, log in first for a gated "
            f"repository (`hf auth login` / `huggingface-cli login`), or pass a local model folder or its config.json."
        )
    if isinstance(err, errors.EntryNotFoundError):
        return f"{repo} has no config.json: it is not a transformers model repository. Pass a model's repository."
    return f"--model {repo}: could not fetch its config.json from the Hugging Face Hub ({err}). {_fixes(repo)}"


def fetch_config(repo: str) -> Path:
    """The local path of ``repo``'s ``config.json`` (downloaded into the Hugging Face cache, or read from it).

    Raises:
        SetupInputError: the file cannot be had; the message names the repository and the fix.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        return Path(hf_hub_download(repo, "config.json"))
    except (HfHubHTTPError, EntryNotFoundError, OSError) as err:
        raise SetupInputError(_explain(repo, err)) from err
