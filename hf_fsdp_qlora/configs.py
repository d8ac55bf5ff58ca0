"""The accelerate FSDP config files shipped with hf_fsdp_qlora, found by name.

The YAMLs live in ``accelerate_configs/`` at the top of the repository, where users look for them, and are
installed as ``hf_fsdp_qlora/accelerate_configs/`` inside the package, so ``accelerate launch --config_file
"$(hf-fsdp-qlora config fsdp2_qlora)" train.py`` works from a wheel as well as from a checkout.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
from pathlib import Path

__all__ = ["config_path", "list_configs"]

_SUFFIX = ".yaml"
# Keeps a config extracted from a zipped install alive until the interpreter exits.
_EXTRACTED = contextlib.ExitStack()
atexit.register(_EXTRACTED.close)


def _configs_dir() -> Path:
    # Wheel install: the folder sits inside the package. It has no __init__.py, so resolve it through the
    # parent package: in an editable install setuptools' finder cannot import a subpackage without one.
    installed = importlib.resources.files("hf_fsdp_qlora") / "accelerate_configs"
    if installed.is_dir():
        if isinstance(installed, Path):
            return installed.resolve()
        # A zipped install: extract once, so callers always get a real file to hand to `accelerate launch`.
        return Path(_EXTRACTED.enter_context(importlib.resources.as_file(installed))).resolve()
    # Editable install or source checkout: the package maps the top-level folder (see pyproject.toml).
    checkout = Path(__file__).resolve().parent.parent / "accelerate_configs"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        "hf_fsdp_qlora's accelerate configs are missing from this installation (looked in "
        f"{installed} and {checkout}); reinstall the package: pip install --force-reinstall hf-fsdp-qlora"
    )


def list_configs() -> list[str]:
    """Names of the shipped accelerate configs, without the ``.yaml`` suffix, sorted.

    Returns:
        For example ``["cpu_fsdp1_rehearsal", "cpu_fsdp2_rehearsal", "fsdp1_qlora", "fsdp2_qlora", ...]``.
    """
    return sorted(path.name.removesuffix(_SUFFIX) for path in _configs_dir().glob(f"*{_SUFFIX}"))


def config_path(name: str) -> Path:
    """Absolute path of a shipped accelerate config, ready for ``accelerate launch --config_file``.

    Args:
        name: A name from :func:`list_configs`, with or without the ``.yaml`` suffix (``"fsdp2_qlora"`` or
            ``"fsdp2_qlora.yaml"``).

    Returns:
        The absolute path of the YAML file.

    Raises:
        ValueError: If no shipped config has that name; the message lists the available names.
    """
    stem = name.removesuffix(_SUFFIX)
    available = list_configs()
    # Compare against the listed names rather than joining paths, so "../x" or "sub/x" never escape the folder.
    if stem not in available:
        raise ValueError(
            f"Unknown accelerate config {name!r}. Available configs: {', '.join(available)}. "
            "Pass one of these names (with or without .yaml), or your own file to `accelerate launch --config_file`."
        )
    return _configs_dir() / f"{stem}{_SUFFIX}"
