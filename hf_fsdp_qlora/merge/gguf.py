"""GGUF export through llama.cpp's own converters: a merged (or any 16-bit) model folder, or a LoRA adapter.

The conversion itself is llama.cpp's (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`, with the `gguf-py` and
`conversion/` beside them), run as a subprocess of the current Python; nothing here re-implements it. This module
finds the converter (a llama.cpp checkout, an unpacked `llama-cpp-python` sdist, or the sdist's .tar.gz itself),
refuses before running what llama.cpp cannot convert or would compute differently (:mod:`._gguf_checks`), and
writes the file atomically.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hf_fsdp_qlora.errors import MergeUsageError
from hf_fsdp_qlora.merge import _gguf_checks as checks

__all__ = ["GGUF_OUTTYPES", "GgufExport", "export_gguf", "find_llama_cpp", "unpack_llama_cpp"]

# The converters' --outtype choices both accept (f32 keeps every merged value exactly; q8_0 is llama.cpp's own).
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "auto")
_SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
# What the converters import from beside themselves: everything else in a llama.cpp tree is the C++ engine.
_NEEDED = (*_SCRIPTS, "gguf-py/", "conversion/")
SDIST_HINT = (
    "pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d DIR (its sdist carries "
    "llama.cpp with both converters), or `git clone https://github.com/ggml-org/llama.cpp`"
)


@dataclass
class GgufExport:
    """What `export_gguf` wrote: the file, its kind ("model" or "adapter"), and notes on how llama.cpp will differ."""

    path: Path
    kind: str
    notes: list[str] = field(default_factory=list)


def find_llama_cpp(path: str | Path) -> Path:
    """The folder holding llama.cpp's converters under `path`: a llama.cpp checkout or an unpacked llama-cpp-python
    sdist (its `vendor/llama.cpp`). A .tar.gz sdist is unpacked by `export_gguf` itself.

    Raises:
        MergeUsageError: `path` holds no converter, or one without its `gguf-py` / `conversion` folders.
    """
    path = Path(path).expanduser()
    for root in (path, path / "vendor" / "llama.cpp"):
        if (root / _SCRIPTS[0]).is_file():
            missing = [n for n in _NEEDED if not (root / n.rstrip("/")).exists()]
            if missing:
                raise MergeUsageError(
                    f"the llama.cpp converter in {root} lacks {', '.join(missing)} (a partial copy?): point "
                    f"`llama_cpp` at a whole llama.cpp checkout or llama-cpp-python sdist; get one with {SDIST_HINT}"
                )
            return root
    raise MergeUsageError(
        f"no llama.cpp converter ({_SCRIPTS[0]}) in {path}: `llama_cpp` takes a llama.cpp checkout, the "
        f"llama-cpp-python sdist (.tar.gz) or that sdist unpacked. Get one with {SDIST_HINT}"
    )


def unpack_llama_cpp(sdist: str | Path, dest: str | Path) -> Path:
    """Unpack only the converters of a llama-cpp-python sdist (.tar.gz) into `dest`; returns their folder."""
    dest = Path(dest)
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if _is_converter_file(m.name)]
            if not members:
                raise MergeUsageError(
                    f"{sdist} holds no vendor/llama.cpp/{_SCRIPTS[0]}: it is not a llama-cpp-python sdist. "
                    f"Get one with {SDIST_HINT}"
                )
            # The "data" filter (no links out, no devices) where this Python has it (3.10.12+, 3.11.4+).
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **safe)
    except (tarfile.TarError, EOFError) as err:
        raise MergeUsageError(
            f"cannot read {sdist} as a .tar.gz ({err}): download it again with {SDIST_HINT}"
        ) from None
    return find_llama_cpp(dest / members[0].name.split("/", 1)[0])


def _is_converter_file(name: str) -> bool:
    parts = name.split("/", 1)
    if len(parts) < 2 or not parts[1].startswith("vendor/llama.cpp/"):
        return False
    rest = parts[1].removeprefix("vendor/llama.cpp/")
    return rest in _SCRIPTS or rest.startswith(_NEEDED[2:])


def export_gguf(
    model: str | Path,
    output: str | Path,
    *,
    llama_cpp: str | Path,
    adapter: str | Path | None = None,
    adapter_config: str | Path | None = None,
    outtype: str = "f32",
    force: bool = False,
    on_note: Callable[[str], None] | None = None,
) -> GgufExport:
    """Write a GGUF of `model` (a merged model folder), or with `adapter`, a GGUF LoRA adapter for `model` as its base.

    Args:
        model: a Hugging Face model folder (config.json, safetensors, tokenizer files), e.g. merge-adapters' output.
        output: the .gguf file to write.
        llama_cpp: a llama.cpp checkout, a llama-cpp-python sdist (.tar.gz) or that sdist unpacked.
        adapter: a peft adapter folder, Trainer checkpoint or FSDP sharded checkpoint, converted against `model`.
        adapter_config: adapter_config.json for an FSDP sharded checkpoint saved without one.
        outtype: the converter's --outtype (f32 keeps the merged values exactly).
        force: replace an existing `output` file.
        on_note: called with each note (a family llama.cpp computes differently) before converting, so that it is
            seen even where the conversion then fails; the notes are also in the result.

    Raises:
        MergeUsageError: a bad path or option, a missing converter or package, or what llama.cpp cannot convert.
        MergeError: the converter failed; the message names the cause where llama.cpp's output says it.
    """
    model, out = Path(model), _check_output(output, force)
    if outtype not in GGUF_OUTTYPES:
        raise MergeUsageError(
            f"`outtype={outtype!r}` is not a GGUF type the converters write: use one of {GGUF_OUTTYPES}"
        )
    config = checks.read_model_config(model)
    notes = checks.family_notes(config)
    for note in notes if on_note is not None else ():
        on_note(note)
    _check_packages(model if adapter is None else None)
    with tempfile.TemporaryDirectory(prefix="gguf-") as tmp:
        # What llama.cpp cannot convert is refused before the converter is unpacked or run.
        if adapter is None:
            checks.check_model_folder(model)
        else:
            staged = _stage_adapter(adapter, adapter_config, Path(tmp) / "adapter")
        root = _converter_root(Path(llama_cpp).expanduser(), Path(tmp))
        partial = out.parent / f".{out.name}.partial-{os.getpid()}"
        if adapter is None:
            args = [root / _SCRIPTS[0], model, "--outfile", partial, "--outtype", outtype]
        else:
            args = [root / _SCRIPTS[1], staged, "--base", model, "--outfile", partial, "--outtype", outtype]
        try:
            _run_converter(root, args, model)
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
    return GgufExport(path=out, kind="model" if adapter is None else "adapter", notes=notes)


def _check_output(output: str | Path, force: bool) -> Path:
    raw = str(output)
    if not raw.strip():
        raise MergeUsageError("`output` is empty (an unset shell variable?): name the .gguf file to write")
    out = Path(raw).expanduser().resolve()
    if out.is_dir():
        raise MergeUsageError(f"`output` {raw} is a folder: name the .gguf file to write, e.g. {raw}/model.gguf")
    if out.exists() and not force:
        raise MergeUsageError(f"`output` {raw} exists: pass `force=True` to replace it, or name another file")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _converter_root(llama_cpp: Path, tmp: Path) -> Path:
    if llama_cpp.is_file():
        return unpack_llama_cpp(llama_cpp, tmp / "llama.cpp")
    if not llama_cpp.exists():
        raise MergeUsageError(f"`llama_cpp` {llama_cpp} does not exist. Get llama.cpp's converter with {SDIST_HINT}")
    return find_llama_cpp(llama_cpp)


def _check_packages(model: Path | None) -> None:
    """The converters' imports beyond ours: numpy always, sentencepiece for a sentencepiece tokenizer."""
    needed = ["numpy"]
    if model is not None and (model / "tokenizer.model").is_file():
        needed.append("sentencepiece")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise MergeUsageError(
            f"llama.cpp's converter runs in this Python ({sys.executable}) and needs {', '.join(missing)}: "
            f"`{sys.executable} -m pip install {' '.join(missing)}`"
        )


def _stage_adapter(adapter: str | Path, adapter_config: str | Path | None, dest: Path) -> Path:
    """A plain peft folder of the adapter (the converter reads only those), after refusing what it cannot convert."""
    from hf_fsdp_qlora.merge.adapter_io import load_adapter, write_adapter_files

    loaded = load_adapter(adapter, config_path=adapter_config)
    checks.check_adapter(loaded.config, loaded.tensors)
    write_adapter_files(loaded, dest)
    return dest


def _run_converter(root: Path, args: list, model: Path) -> None:
    # The converter's own gguf-py first: PyPI's `gguf` may be older than the converter (0.19 lacks what it uses).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), str(root)])}
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise checks.converter_error(args[0].name, result.returncode, result.stdout + result.stderr, model)
