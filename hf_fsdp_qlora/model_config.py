"""Reading a model's config.json into a transformers config, refusing what is not a causal language model (the
loader, the doctor and the model shapes all start here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .causal_lm import causal_lm_fix, causal_lm_problem, refused_family
from .errors import SetupInputError
from .hub_config import fetch_config, looks_like_hub_id

__all__ = ["config_value", "from_parts", "load_config", "load_model_config", "position_limit"]


def load_model_config(model, trust_remote_code: bool = False):
    """A transformers config from a model directory, a config.json path, a Hub id or a config object.

    A Hub id (``org/name``, no local path of that name) is read from its ``config.json`` alone, through
    ``huggingface_hub`` with the user's token and cache (hub_config.py); no weight is downloaded.

    Raises:
        SetupInputError: the path does not exist, holds no config.json, or is not a causal LM config; a Hub id
            whose config.json cannot be had (gated, unknown, offline and not cached), with the fix.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    path = Path(os.path.expanduser(os.fspath(model)))
    if looks_like_hub_id(model):
        path = fetch_config(os.fspath(model))
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SetupInputError(
                f"{path.parent} has no config.json. Pass the model directory written by save_pretrained, or its "
                "config.json file (only the config is read)."
            )
    elif not path.is_file():
        raise SetupInputError(
            f"Model path {os.fspath(model)!r} does not exist. Pass a model directory, a config.json, or a Hugging "
            "Face Hub id such as meta-llama/Llama-3.1-8B (only its config.json is fetched)."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_hook=_special_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SetupInputError(f"{path} is not a JSON model config ({err}). Pass the model's config.json.") from err
    if not isinstance(data, dict) or "model_type" not in data:
        raise SetupInputError(f"{path} has no `model_type`, so it is not a transformers config.json.")
    try:
        config = AutoConfig.for_model(**data) if not trust_remote_code else AutoConfig.from_pretrained(path.parent)
    except (ValueError, KeyError) as err:
        reason = str(err).split(". Should contain", 1)[0]  # transformers appends every known model type
        raise SetupInputError(f"transformers cannot read {path}: {reason}.") from err
    _check_causal_lm(config, path)
    return config


def load_config(model_name_or_path, trust_remote_code: bool):
    """The checkpoint's config; a path that is no saved transformers model is refused with what to pass instead."""
    from transformers import AutoConfig

    path = os.fspath(model_name_or_path)
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if looks_local:
        local = os.path.expanduser(path)
        if not os.path.isdir(local):
            raise FileNotFoundError(
                f"Model path {path!r} does not exist. Pass the directory written by save_pretrained (it holds "
                "config.json and *.safetensors) or a model id on the Hugging Face Hub."
            )
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(
                f"{path!r} has no config.json, so it is not a saved transformers model. Pass the directory "
                "written by model.save_pretrained(...)."
            )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise FileNotFoundError(f"Could not read a model config from {path!r}: {err}") from err


def _special_float(obj: dict):
    # transformers writes Infinity / NaN as {"__float__": "Infinity"} (Falcon-H1's time_step_limit): read them back.
    if len(obj) == 1 and isinstance(obj.get("__float__"), str):
        return float(obj["__float__"])
    return obj


def _check_causal_lm(config, path) -> None:
    kind = causal_lm_problem(config)
    if kind is not None:
        raise SetupInputError(
            f"{path} describes {kind}, which has no causal-LM head to fine-tune. {causal_lm_fix(config)}"
        )
    refused = refused_family(config)
    if refused is not None:
        raise SetupInputError(f"{path}: {refused}")


def position_limit(text) -> int | None:
    """max_position_embeddings (n_positions); None where there is none, or -1 (XLNet: no limit)."""
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def from_parts(text, name: str, combine) -> int | None:
    """`name` of `text`, else `combine` of it over the sub-configs that have it (BLT: no width of its own, but a
    local encoder, a global transformer, a local decoder and a patcher, each with theirs); None where none has it."""
    value = getattr(text, name, None)
    if value is not None:
        return value
    parts = [getattr(v, name, None) for v in vars(text).values() if hasattr(v, "to_dict") and hasattr(v, name)]
    parts = [int(p) for p in parts if isinstance(p, int)]
    return combine(parts) if parts else None


def config_value(config, name: str):
    try:  # None where the config has only per-layer values (Gemma 4 refuses a global read of those)
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute error: no single global value
        return None
