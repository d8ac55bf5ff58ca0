"""Read a LoRA adapter from wherever training left it, in peft's on-disk key format.

Three sources: a peft adapter folder (`adapter_model.safetensors` or `.bin` + `adapter_config.json`), a
Trainer checkpoint folder (the same files beside optimizer and trainer state), and an FSDP sharded
checkpoint (`pytorch_model_fsdp_0/*.distcp`, read with torch.distributed.checkpoint without a process
group). Every source comes back as peft writes it: keys without the adapter name, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_fsdp_qlora.errors import MergeError, MergeUsageError
from hf_fsdp_qlora.param_names import clean_name
from hf_fsdp_qlora.quant_record import RECORD_NAME, read_record

__all__ = [
    "LoadedAdapter",
    "find_distcp_dir",
    "load_adapter",
    "read_distcp",
    "read_quant_record",
    "write_adapter_files",
]

CONFIG_NAME = "adapter_config.json"
_WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_LORA_NAMES = "lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector"
_LORA_PARAM = re.compile(rf"\.({_LORA_NAMES})\.([^.]+)(\.|$)")
# bitsandbytes 4-bit quant-state entries and other frozen base pieces a full model state dict carries.
_BASE_ONLY = re.compile(r"(\.base_layer\.weight|\.original_module\.|\.absmax|\.quant_map|\.nested_|\.quant_state)")


@dataclass
class LoadedAdapter:
    """An adapter read into memory (it is small): its config, tensors in peft's key format, and where from."""

    config: dict
    tensors: dict[str, torch.Tensor]
    source: Path
    kind: str  # "peft", "trainer-checkpoint" or "fsdp-distcp"
    folder: Path  # where tokenizer files saved with the adapter would be


def _strip_wrappers(key: str) -> str:
    return clean_name(key).removeprefix("module.")  # DDP's wrapper, only ever at the front


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MergeError(
            f"cannot read adapter config {path}: {err}. Save the adapter again with save_pretrained."
        ) from None
    if not isinstance(config, dict):
        raise MergeUsageError(
            f"{path} holds a JSON {type(config).__name__}, not an object of LoraConfig fields: it is not an "
            "adapter_config.json; pass the one peft saved with the adapter (save_pretrained writes it)."
        )
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from hf_fsdp_qlora.safetensors_io import read_header, read_tensor

        entries, _ = read_header(path)
        with open(path, "rb", buffering=0) as fh:
            return {name: read_tensor(fh, entry) for name, entry in entries.items()}
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        ValueError,
        EOFError,
        OSError,
        pickle.UnpicklingError,
    ) as err:  # what torch raises for damage
        # A truncated zip makes torch raise a bare OSError (EINVAL, no file name): name the file here, or the
        # caller would blame the output path.
        why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise MergeError(
            f"cannot read the adapter weights {path} ({why}). The file is truncated or corrupted: save the "
            "adapter again (compare its size with the original's)."
        ) from None
    if not isinstance(state, dict):
        raise MergeError(
            f"{path} does not hold a state dict (found {type(state).__name__}); save the adapter with save_pretrained"
        )
    return state


def find_distcp_dir(path: Path) -> Path | None:
    """The torch.distributed.checkpoint folder at or directly under `path` (`pytorch_model_fsdp_*`), if any."""
    if (path / ".metadata").is_file() and any(path.glob("*.distcp")):
        return path
    found = sorted(p for p in path.glob("pytorch_model_fsdp_*") if (p / ".metadata").is_file())
    return found[0] if found else None


def _adapter_name(keys) -> str | None:
    """The adapter name inside model-state keys (`lora_A.<name>.weight`); None for peft's saved format."""
    for key in keys:
        match = _LORA_PARAM.search(key)
        if match and match.group(2) not in ("weight", "bias"):
            return match.group(2)
    return None


def adapter_keys_from_model_state(keys, config: dict) -> dict[str, str]:
    """Map keys of a saved state dict to peft's adapter format; keys that are not adapter state are left out.

    A sharded FSDP checkpoint holds either the adapter only (peft's format already) or the whole model
    (base weights, possibly 4-bit packed, and adapter weights named with the adapter name). Only the
    trained tensors are kept: LoRA factors, modules_to_save copies, and the biases `bias` says were trained.
    """
    keys = list(keys)
    name = _adapter_name(_strip_wrappers(k) for k in keys)
    bias = config.get("bias", "none")
    mapping = {}
    for key in keys:
        clean = _strip_wrappers(key)
        if name is None:  # adapter-only state dict: already in peft's format
            mapping[key] = clean
            continue
        if ".modules_to_save." in clean:
            clean = clean.replace(f".modules_to_save.{name}.", ".")  # peft saves the copy under the module's name
        elif _LORA_PARAM.search(clean):
            clean = re.sub(rf"\.({_LORA_NAMES})\.{re.escape(name)}(?=\.|$)", r".\1", clean)
            clean = clean.replace("lora_magnitude_vector.weight", "lora_magnitude_vector")
        elif _BASE_ONLY.search(clean):
            continue
        elif not (clean.endswith(".bias") and (bias == "all" or (bias == "lora_only" and ".base_layer." in clean))):
            continue  # a frozen base weight
        if not clean.startswith("base_model.model."):
            clean = "base_model.model." + clean
        mapping[key] = clean
    return mapping


def read_distcp(ckpt_dir: Path, config: dict) -> dict[str, torch.Tensor]:
    """Read the adapter tensors of a torch.distributed.checkpoint folder (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt_dir))
    try:
        metadata = reader.read_metadata()
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
        raise MergeError(
            f"cannot read {ckpt_dir / '.metadata'}: {err}. The checkpoint is incomplete or corrupted."
        ) from None
    tensors_meta = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    # accelerate saves {"model": state_dict}; DCP flattens that to "model.<key>".
    nested = all(k.startswith("model.") for k in tensors_meta) and any(
        k.startswith(("model.base_model.", "model.model.")) for k in tensors_meta
    )
    stripped = {(k[len("model.") :] if nested else k): k for k in tensors_meta}
    mapping = adapter_keys_from_model_state(stripped, config)
    if not any(_LORA_PARAM.search(_strip_wrappers(k)) for k in mapping):
        # No LoRA factor under any name: a checkpoint of a model without LoRA (e.g. a full fine-tune), whose
        # keys would otherwise all pass as an adapter-only state dict.
        mapping = {}
    state = {}
    for key in mapping:
        meta = tensors_meta[stripped[key]]
        state[stripped[key]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    if state:
        try:
            with warnings.catch_warnings():  # reading in one process without a process group is the intent
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load(state, storage_reader=reader, no_dist=True)
        except (dcp.CheckpointException, OSError, RuntimeError, ValueError) as err:
            raise MergeError(
                f"cannot read the tensors of {ckpt_dir}: {err}. The checkpoint is incomplete or corrupted."
            ) from None
    return {mapping[key]: state[stripped[key]] for key in mapping}


def _find_config(start: Path, explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    for folder in (start, start.parent, start.parent.parent):
        if (folder / CONFIG_NAME).is_file():
            return folder / CONFIG_NAME
    raise MergeError(
        f"no {CONFIG_NAME} found beside the FSDP checkpoint {start} (looked in it and its two parents). "
        f"Pass the LoraConfig the run used: `adapter_config=PATH/{CONFIG_NAME}` (merge-adapters and "
        "hf-fsdp-qlora convert both take it; e.g. one saved by peft_model.peft_config['default'].save_pretrained(PATH))."
    )


def load_adapter(path: str | Path, config_path: str | Path | None = None, *, fsdp_only: bool = False) -> LoadedAdapter:
    """Read an adapter from a peft folder, a Trainer checkpoint or an FSDP sharded checkpoint.

    Args:
        path: the folder (or the `adapter_model.*` file itself).
        config_path: the `adapter_config.json` to use for an FSDP checkpoint that has none beside it.
        fsdp_only: read the FSDP sharded checkpoint even where adapter files lie beside it.

    Raises:
        MergeError: no adapter is found, the files are unreadable, or the adapter holds no tensors.
    """
    path = Path(path)
    explicit = Path(config_path) if config_path is not None else None
    folder, weights = _adapter_files(path, fsdp_only)
    kind = "trainer-checkpoint" if (folder / "trainer_state.json").is_file() else "peft"
    if weights is not None:
        config = _read_config(explicit or folder / CONFIG_NAME)
        raw = _read_weights(weights)
        mapping = adapter_keys_from_model_state(raw, config)
        tensors = {mapping[k]: v for k, v in raw.items() if k in mapping}
        source = weights
    elif (distcp := find_distcp_dir(path)) is not None:
        config = _read_config(_find_config(distcp, explicit))
        tensors, source, kind, folder = read_distcp(distcp, config), distcp, "fsdp-distcp", distcp.parent
    else:
        raise _no_adapter_error(path)
    _check_loaded(config, tensors, source, kind)
    return LoadedAdapter(config=config, tensors=tensors, source=source, kind=kind, folder=folder)


def _adapter_files(path: Path, fsdp_only: bool) -> tuple[Path, Path | None]:
    """(the adapter's folder, its weights file: None where there is none or the FSDP checkpoint is asked for)."""
    if path.is_file():
        return path.parent, path
    if fsdp_only:
        return path, None
    return path, next((path / n for n in _WEIGHT_NAMES if (path / n).is_file()), None)


def _no_adapter_error(path: Path) -> MergeError:
    checkpoints = sorted(
        path.glob("checkpoint-*"),
        key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1,
    )
    hint = f" It holds Trainer checkpoints; pass one of them, e.g. `adapter={checkpoints[-1]}`." if checkpoints else ""
    return MergeError(
        f"no adapter found in {path}: expected adapter_model.safetensors or adapter_model.bin with "
        f"{CONFIG_NAME} (a peft adapter or Trainer checkpoint), or an FSDP checkpoint folder "
        f"(pytorch_model_fsdp_0 with .distcp files).{hint}"
    )


def _check_loaded(config: dict, tensors: dict, source: Path, kind: str) -> None:
    """A MergeError for an adapter without tensors (saying how it came to be empty) or one that is not LoRA."""
    if not tensors and kind == "fsdp-distcp":
        raise MergeError(
            f"the FSDP checkpoint {source} holds no adapter tensors (no lora_A/lora_B or modules_to_save entries "
            "among its keys): it was saved from a model without LoRA, or by a stock Trainer under FSDP2, whose "
            "sharded checkpoint keeps 0 adapter tensors. Use a checkpoint saved by hf_fsdp_qlora's trainers, or the "
            "run's adapter_model.safetensors."
        )
    if not tensors:
        raise MergeError(
            f"the adapter at {source} holds no adapter tensors (an empty adapter). Under FSDP1 with nested "
            "wrapping, peft's state-dict filter can save 0 keys: save the adapter from the gathered full state "
            "dict (hf_fsdp_qlora's checkpointing does), or convert the FSDP sharded checkpoint with "
            "`hf-fsdp-qlora convert CHECKPOINT --output ADAPTER_DIR`."
        )
    if config.get("peft_type", "LORA") != "LORA":
        raise MergeError(
            f"{source} is a {config.get('peft_type')} adapter; only LoRA adapters (peft_type LORA) can be merged"
        )


def write_adapter_files(adapter: LoadedAdapter, output: Path) -> None:
    """Write `adapter` as a plain peft adapter folder (`adapter_model.safetensors` + `adapter_config.json`, and the
    quantization record where the source had one: what `merge-adapters --dequantize` follows)."""
    from safetensors.torch import save_file

    from hf_fsdp_qlora.quant_record import read_record, write_record

    output.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.tensors.items()}
    save_file(tensors, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    (output / CONFIG_NAME).write_text(json.dumps(adapter.config, indent=2, sort_keys=True) + "\n")
    try:
        write_record(output, read_record(adapter.folder))
    except ValueError as err:
        raise MergeError(f"{err} Delete it to convert without it (a merge then follows transformers' rule).") from None


def read_quant_record(folder: Path, dequantize: str | None):
    """The adapter's quantization record (:mod:`hf_fsdp_qlora.quant_record`) when `dequantize` asks for a round
    trip, refused where it says training quantized otherwise."""
    if not dequantize:
        return None
    try:
        record = read_record(folder)
    except ValueError as err:
        raise MergeError(
            f"{err} Delete it to merge by transformers' rule, or pass the adapter it came with."
        ) from None
    if record is None:
        return None
    trained = "int8" if record.bits == 8 else record.quant_type
    if trained != dequantize:
        raise MergeUsageError(
            f"`dequantize` {dequantize} does not match training: {folder / RECORD_NAME} records a {trained} base "
            f"({record.bits}-bit). Pass `dequantize={trained!r}`."
        )
    return record
