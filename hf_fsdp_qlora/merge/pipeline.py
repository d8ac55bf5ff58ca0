"""Streamed merge of a LoRA adapter into a 16-bit base: sharded safetensors in, sharded safetensors out.

The merge reads files, never a live (possibly FSDP-sharded or 4-bit) model. Each output tensor is produced
on its own: read from the base shard, updated in float32 on one device, cast once, written. Tensors the
adapter does not touch are copied byte for byte. Peak memory is a few copies of the largest tensor, not the
model. The output folder appears only when complete (see :class:`AtomicOutputDir`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hf_fsdp_qlora.dtype_names import FLOAT_NAMES
from hf_fsdp_qlora.errors import MergeError, MergeUsageError
from hf_fsdp_qlora.experts.orders import Reorder
from hf_fsdp_qlora.merge._base_model import (
    INDEX_NAME,
    base_entries,
    check_base_name,
)
from hf_fsdp_qlora.merge._job import (
    adapter_updates,
    check_quant_options,
    no_space,
    output_with_room,
    planned_items,
    quantized_layout,
    read_base_config,
    update_config,
)
from hf_fsdp_qlora.merge._lora_math import apply_update_into
from hf_fsdp_qlora.merge._plan import Item, torch_dtype
from hf_fsdp_qlora.merge._roundtrip import quantize_roundtrip
from hf_fsdp_qlora.merge.adapter_io import load_adapter
from hf_fsdp_qlora.merge.output_dir import check_output
from hf_fsdp_qlora.merge.serving import TOKENIZER_CORE, adapter_notes, has_tokenizer, model_notes
from hf_fsdp_qlora.safetensors_io import (
    OrderedWorker,
    ShardWriter,
    parse_shard_size,
    plan_shards,
    read_tensor,
)

__all__ = ["DTYPES", "MergeError", "MergeUsageError", "merge_adapters"]

logger = logging.getLogger(__name__)
DTYPES = {name: getattr(torch, name) for name in FLOAT_NAMES}  # the output dtypes a merge writes
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|distcp)$|.*\.index\.json$")
_TOKENIZER_FILE = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|chat_template\..*"
    r"|spiece\.model|sentencepiece.*\.model)$"
)
_NOT_COPIED = {"adapter_config.json", "README.md"} | {"config.json"}  # config.json is rewritten, not copied


_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' 4-bit kernels accept


def _check_usage(base, adapter, output, force, dtype, device, dequantize, max_shard_size, blocksize, adapter_config):
    if not (base / "config.json").is_file():
        raise MergeUsageError(
            f"`base` {base} is not a model folder (no config.json): pass the 16-bit base model's folder"
        )
    if not adapter.exists():
        raise MergeUsageError(f"`adapter` {adapter} does not exist: pass the adapter folder or Trainer checkpoint")
    if adapter_config is not None and not adapter_config.is_file():
        raise MergeUsageError(f"`adapter_config` {adapter_config} is not a file: pass the run's adapter_config.json")
    inputs = [("`base`", base), ("`adapter`", adapter)]
    if adapter.is_file():  # an adapter_model.* file: its folder holds the config and tokenizer read with it
        inputs.append(("the folder of `adapter`", adapter.parent))
    if adapter_config is not None:
        inputs.append(("`adapter_config`", adapter_config))
    out = check_output(output, inputs, force)
    if dequantize in ("nf4", "fp4") and blocksize is not None and blocksize not in _BLOCKSIZES:
        raise MergeUsageError(
            f"`quant_blocksize` {blocksize} is not a 4-bit block size bitsandbytes uses: pass the "
            f"bnb_4bit_blocksize of training, one of {', '.join(map(str, _BLOCKSIZES))} (default 64)"
        )
    if dtype is not None and dtype not in DTYPES and dtype not in DTYPES.values():
        raise MergeUsageError(f"`dtype` {dtype} is not supported: use one of {', '.join(DTYPES)}")
    if dequantize not in (None, "nf4", "fp4", "int8"):
        raise MergeUsageError(
            f"`dequantize` {dequantize} is not supported: use nf4 or fp4 (the bnb_4bit_quant_type of a 4-bit "
            "training), or int8 (a base loaded with load_in_8bit)"
        )
    try:
        max_bytes = parse_shard_size(max_shard_size)
    except ValueError as err:
        raise MergeUsageError(f"`max_shard_size`: {err}") from None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MergeUsageError(f"`device` {device} is not a device: use cpu or cuda (or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MergeUsageError(
            "`device='cuda'` was given, but no CUDA device is available on this machine: pass `device='cpu'`"
        )
    if dev.type not in ("cpu", "cuda"):
        raise MergeUsageError(f"`device` {device} is not supported: use cpu or cuda")
    return out, dev, max_bytes


def _tokenizer_folder(tokenizer: str | Path | None) -> Path | None:
    if tokenizer is None:
        return None
    folder = Path(tokenizer)
    if not folder.is_dir() or not has_tokenizer(folder):
        raise MergeUsageError(
            f"`tokenizer` {folder} is not a folder with tokenizer files ({', '.join(TOKENIZER_CORE)}): pass the "
            "folder training saved its tokenizer to (tokenizer.save_pretrained), usually the base model's"
        )
    return folder


class _Scratch:
    """Reusable buffers by role, grown to the largest tensor seen: fresh multi-MB allocations cost page
    faults every time, which made up a large share of the merge time."""

    def __init__(self, device: torch.device):
        self.device, self._buffers = device, {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
        device = device or self.device
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get((name, dtype, device))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(name, dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def _produce(item: Item, fh, device: torch.device, quant, scratch: _Scratch, slot: int) -> torch.Tensor:
    if item.ready is not None:
        ready, item.ready = item.ready, None  # the write queue holds it now; freed once written
        return ready
    out = torch_dtype(item.dtype)
    replaced = item.update is not None and item.update.replacement is not None
    weight = None
    if not replaced:
        weight = read_tensor(fh, item.entry, scratch("read", (item.entry.nbytes,), torch.uint8, torch.device("cpu")))
        weight = weight.to(device)
    if item.quantize:
        # Quantized from the tensor in the dtype training loaded it in (the output dtype), as bnb does.
        weight = _roundtrip(item, weight.to(out), quant)
    target = scratch(f"out{slot}", item.shape, out)
    if item.update is not None:
        return apply_update_into(target, weight, item.update, device, scratch)
    return target.copy_(weight)


def _roundtrip(item: Item, weight: torch.Tensor, quant) -> torch.Tensor:
    """The quantization round trip training saw: per expert for fused experts (load_qlora_model quantizes each
    expert's matrix on its own), and for a slice of an expert (gate or up stored apart) that slice of its whole
    matrix's round trip; for experts stored in another order (Inkling 2's interleaved gate/up rows), in the model's
    order and back."""
    if callable(item.group):  # DBRX's 2-D expert stacks (hf_fsdp_qlora/experts/dbrx.py)
        return item.group(weight, quant, quantize_roundtrip, _read_entry)
    if isinstance(item.group, Reorder):
        return item.group.roundtrip(weight, lambda matrix: quantize_roundtrip(matrix, *quant))
    if item.group is not None:
        parts, dim, start, stop = item.group
        pieces = []
        for entry in parts:
            if entry.name == item.name:
                pieces.append(weight)
                continue
            with open(entry.path, "rb", buffering=0) as fh:
                pieces.append(read_tensor(fh, entry).to(weight.device, weight.dtype))
        return quantize_roundtrip(torch.cat(pieces, dim=dim), *quant).narrow(dim, start, stop - start)
    if weight.dim() == 3:
        return torch.stack([quantize_roundtrip(expert, *quant) for expert in weight])
    if item.chunks is not None:  # layers stored as row chunks of one tensor: each was quantized on its own
        parts = weight.chunk(len(item.chunks), dim=0)
        return torch.cat([quantize_roundtrip(p.contiguous(), *quant) if q else p for p, q in zip(parts, item.chunks)])
    if item.transposed:  # a Conv1D weight: bitsandbytes quantized it as the (out, in) Linear4bit weight
        return quantize_roundtrip(weight.T.contiguous(), *quant).T
    return quantize_roundtrip(weight, *quant)


def _read_entry(entry) -> torch.Tensor:
    with open(entry.path, "rb", buffering=0) as fh:
        return read_tensor(fh, entry)


@contextlib.contextmanager
def _leave_a_core_for_writes(device: torch.device):
    """On CPU, compute with one core fewer than this process may use, so the writer thread has one: on 2
    cores, one compute thread plus the writer merged 1.5 GB in 1.3 s, two compute threads competing with
    the writer in 1.6-2.6 s."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(before, cores - 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_shards(items: list[Item], tmp: Path, max_bytes: int, device, quant, progress: bool) -> dict[str, str]:
    """Compute tensors here while a background thread writes the previous ones, in order."""
    from tqdm.auto import tqdm

    by_name = {item.name: item for item in items}
    scratch, files, weight_map = _Scratch(device), contextlib.ExitStack(), {}
    handles = {}
    shards = plan_shards([(item.name, item.nbytes) for item in items], max_bytes)
    # Queue depth 1: at most one write waits and one runs while the next tensor is computed, so three
    # output buffers, taken in turn by the computed tensors only, are never overwritten while queued.
    worker, slots, computed = OrderedWorker(depth=1), 3, 0
    syncer, syncing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="merge-fsync"), []
    try:
        for index, names in enumerate(shards):
            fname = (
                "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            writer = ShardWriter(
                tmp / fname, [(n, by_name[n].dtype, by_name[n].shape) for n in names], {"format": "pt"}
            )
            worker.on_abort(writer.abort)
            total = sum(by_name[n].nbytes for n in names)
            with tqdm(total=total, unit="B", unit_scale=True, desc=fname, disable=not progress) as bar:
                for name in names:
                    item = by_name[name]
                    path = item.entry.path
                    if path not in handles:  # kept open: queued copies read from them later
                        handles[path] = files.enter_context(open(path, "rb", buffering=0))  # noqa: SIM115
                    fh = handles[path]
                    if item.passthrough:
                        worker.submit(writer.copy_bytes, name, fh.fileno(), item.entry.start, item.entry.nbytes)
                    else:
                        tensor = _produce(item, fh, device, quant, scratch, slot=computed % slots)
                        worker.submit(writer.write_tensor, name, tensor)
                        computed += 1
                    weight_map[name] = fname
                    bar.update(item.nbytes)
                # Once its last tensor is written, the shard is fsynced on another thread, overlapping
                # the writes of the next shard.
                worker.submit(lambda w=writer: syncing.append(syncer.submit(w.close)))
        worker.wait()
        for done in syncing:
            done.result()
    except BaseException:
        syncer.shutdown(wait=True, cancel_futures=True)  # no file may be closed under a running fsync
        worker.abort()
        raise
    finally:
        worker.stop()
        syncer.shutdown(wait=True)
        files.close()
    return weight_map


def _copy_side_files(base: Path, adapter_folder: Path, tokenizer: Path | None, tmp: Path, config: dict) -> None:
    for src in sorted(base.iterdir()):
        if (
            src.is_file()
            and not src.name.startswith(".")
            and not _WEIGHT_FILE.match(src.name)
            and src.name not in _NOT_COPIED
            and not (tokenizer is not None and _TOKENIZER_FILE.match(src.name))
        ):
            shutil.copy2(src, tmp / src.name)
    # A tokenizer saved with the adapter (Trainer saves it into checkpoints) is the one training used. A folder named
    # with `tokenizer` replaces both, whole (never a mix of two tokenizers' files). Engines refuse a model folder
    # without one (merge/serving.py).
    for folder in (adapter_folder,) if tokenizer is None else (tokenizer,):
        if folder.is_dir():
            for src in sorted(folder.iterdir()):
                if src.is_file() and _TOKENIZER_FILE.match(src.name):
                    shutil.copy2(src, tmp / src.name)
    # config.json last: a folder without it is never mistaken for a finished model.
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def merge_adapters(
    base: str | Path,
    adapter: str | Path,
    output: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    device: str = "cpu",
    force: bool = False,
    dequantize: str | None = None,
    double_quant: bool | None = None,
    quant_blocksize: int | None = None,
    dequantize_experts: bool = True,
    skip_modules: list[str] | tuple[str, ...] = (),
    untie_embeddings: bool = False,
    adapter_config: str | Path | None = None,
    allow_other_base: bool = False,
    tokenizer: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Merge a LoRA adapter into a 16-bit base model, streaming shard by shard, and write a plain model folder.

    Args:
        base: the 16-bit base model folder (safetensors, one file or sharded with an index).
        adapter: a peft adapter folder, a Trainer checkpoint folder, or an FSDP sharded checkpoint folder.
        output: the folder to create; it appears only once complete.
        dtype: output dtype of floating tensors ("bfloat16", "float16", "float32"); default: the base's.
        max_shard_size: largest output shard, e.g. "5GB" (decimal units, like transformers) or "2GiB".
        device: where every update is computed, "cpu" or "cuda[:N]". On CPU the merge computes with one
            torch thread fewer than the cores it may use (one is left to the writer), restored on return.
        force: replace an existing `output` that an earlier merge-adapters or convert wrote and that holds
            nothing else (the old folder is kept until the new one is complete). Nothing else is ever replaced:
            an output that is, contains or lies inside an input (after resolving symlinks and `..`), `""`,
            the current or home folder, or a folder with other content is refused.
        dequantize: "nf4" or "fp4" to merge onto the 4-bit round trip of the base that QLoRA trained against;
            "int8" onto the 8-bit round trip (LLM.int8 row scales) of a base trained with load_in_8bit. An adapter
            saved by ``load_qlora_model``'s model or by our trainers and callback carries the record of what training
            quantized (:mod:`hf_fsdp_qlora.quant_record`): exactly those tensors are round-tripped, with its double
            quant and block size; without one, every linear layer transformers quantizes and the experts of the
            families in the experts table, with the settings of the pre-quantized base adapter_config.json names
            or `double_quant` (nf4 / fp4 without either is refused: nothing says which round trip training saw).
        double_quant: whether training used bnb_4bit_use_double_quant (only with `dequantize` nf4 / fp4); needed
            where no record and no pre-quantized base says, refused where one says otherwise.
        quant_blocksize: the 4-bit block size of training (only with nf4 / fp4; default: the record's, else
            bitsandbytes' 64); refused where the record says otherwise.
        dequantize_experts: with `dequantize` nf4 / fp4 and no record, also round-trip the fused experts of an MoE
            base, expert by expert, as load_qlora_model quantizes them (quantize_experts=True, its default); False
            for a run that kept them in 16 bits.
        skip_modules: with `dequantize` and no record, the layers training kept 16-bit beside transformers' own (the
            ``skip_modules`` of ``load_qlora_model``): merged onto the 16-bit base as is, not round-tripped.
        untie_embeddings: when the adapter changes only one side of tied embeddings, write both sides
            (tie_word_embeddings=false) instead of failing.
        adapter_config: the run's adapter_config.json, for an FSDP sharded checkpoint saved without one.
        allow_other_base: merge even though adapter_config.json names a local model of another architecture
            than `base` (by default that is refused, even when the shapes match).
        tokenizer: a folder whose tokenizer files to write beside the merge, instead of the base's and the adapter
            folder's (the default: the base's, then the adapter folder's over them). A merge without tokenizer files
            does not load in vLLM; the merge warns then.
        progress: show a tqdm bar per output shard.

    Returns:
        The output folder, loadable with `AutoModelForCausalLM.from_pretrained` and free of peft files.

    Raises:
        MergeUsageError: an option or path that cannot work (exit status 2 on the command line).
        MergeError: the adapter does not fit the base, a file is corrupted, or the disk is full (exit status 1).
    """
    base, adapter = Path(base), Path(adapter)
    adapter_config = Path(adapter_config) if adapter_config is not None else None
    tokenizer = _tokenizer_folder(tokenizer)
    output, device, max_bytes = _check_usage(
        base, adapter, output, force, dtype, device, dequantize, max_shard_size, quant_blocksize, adapter_config
    )
    check_quant_options(skip_modules, dequantize, double_quant, quant_blocksize)
    out_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        config = read_base_config(base)
        entries = base_entries(base)
        loaded = load_adapter(adapter, config_path=adapter_config)
        updates, conv1d, places = adapter_updates(base, loaded, entries)
        *layout, double_quant, quant_blocksize = quantized_layout(
            base, loaded, entries, places, dequantize=dequantize, dequantize_experts=dequantize_experts,
            skip_modules=skip_modules, double_quant=double_quant, blocksize=quant_blocksize,
        )  # fmt: skip
        items, untied, task = planned_items(
            base, config, loaded, entries, updates, layout, conv1d,
            out_dtype=out_dtype, untie_embeddings=untie_embeddings, device=device,
        )  # fmt: skip
        update_config(config, items, task, out_dtype, untied)
        check_base_name(loaded.config, base, config, allow_other=allow_other_base)
        needed = sum(item.nbytes for item in items)
        quant = (dequantize, quant_blocksize, double_quant) if dequantize else None
        with output_with_room(output, needed) as tmp:
            with _leave_a_core_for_writes(device):
                weight_map = _write_shards(items, tmp, max_bytes, device, quant, progress)
            if len(set(weight_map.values())) > 1:
                index = {"metadata": {"total_size": needed}, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            _copy_side_files(base, loaded.folder, tokenizer, tmp, config)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise no_space(output, None, None) from None
        raise MergeError(
            f"{err.strerror or err}: {err.filename or output}. Check the path and its permissions."
        ) from None
    _log_serving_notes(output, loaded.config, config)
    return output


def _log_serving_notes(output: Path, adapter_config: dict, config: dict) -> None:
    """What vLLM will refuse in the merge, or needs to serve the adapter itself, said before anyone deploys it."""
    for note in model_notes(output):
        logger.warning(note)
    for note in adapter_notes(adapter_config, config):
        logger.info(note)
