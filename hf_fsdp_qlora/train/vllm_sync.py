"""GRPO (trl) generating with a colocated vLLM engine, synced with the LoRA tensors only.

trl's own colocated sync (``VLLMGeneration.sync_weights``) merges the adapter into the base (``merge_adapter``),
walks every parameter of the model, gathers each one whole and loads it into vLLM, then unmerges. Under FSDP with a
4-bit base that cannot work: merging needs each layer's whole 4-bit weight and its quant state on one rank (peft
fails with "'DTensor' object has no attribute 'quant_state'"), and even where it runs it sends the whole model at
every step and re-quantizes the merged weights (rounding error each time).

Here the engine serves the base plus the adapter as vLLM's own LoRA (``enable_lora=True``):

* once, when the engine is built, its base weights are replaced (``reload_weights``) by the 16-bit checkpoint with
  every weight training quantized round-tripped through bitsandbytes with training's settings - the base the
  policy computes with, read from disk tensor by tensor, never gathered from the sharded model;
* at each sync, only the LoRA tensors are gathered (each rank its slices, one tensor at a time), written as a peft
  adapter folder, and served under a new ``LoRARequest``; the previous one is removed. Nothing is merged.

:func:`prepare_adapter_sync` (called by our trainer mixin before trl builds its engine) marks the model and puts
:func:`adapter_generation_class` where trl's trainers look ``VLLMGeneration`` up; trainers without the mark (a stock
trainer in the same process) keep trl's behaviour unchanged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import torch
from transformers.utils import logging

from ..errors import UnsupportedSetupError

__all__ = ["adapter_generation_class", "adapter_tensors", "prepare_adapter_sync", "vllm_base_weights"]

logger = logging.get_logger(__name__)

_MARK = "hf_fsdp_qlora_vllm_adapter_sync"  # on the peft model: build the adapter-synced engine for it
# The LoRA ranks vLLM accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Wrapper segments that appear in parameter names under FSDP and activation checkpointing, never in peft's files.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def _refuse(problem: str, instead: str) -> None:
    raise UnsupportedSetupError(f"GRPO with use_vllm=True (adapter-only sync): {problem} Use {instead}.")


def _check_setup(trainer, peft_model) -> None:
    """Refuse, before any step, what the adapter-only sync cannot serve (each message names the setting)."""
    args = trainer.args
    if args.vllm_mode != "colocate":
        _refuse(
            f"vllm_mode={args.vllm_mode!r} is not supported with a peft model under hf_fsdp_qlora (trl's server "
            "sync merges the adapter into the base, impossible on a sharded 4-bit base).",
            'vllm_mode="colocate"',
        )
    if getattr(trainer.accelerator.state, "fsdp_plugin", None) is not None:
        version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            _refuse(f"fsdp_version={version} gathers whole flat parameters.", "fsdp_version: 2")
    config = peft_model.peft_config[peft_model.active_adapter]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        _refuse(f"the adapter is {config.peft_type}, vLLM serves LoRA only.", "a LoraConfig")
    if args.vllm_enable_sleep_mode:
        _refuse("vllm_enable_sleep_mode=True discards the engine's base weights at each sleep.", "the default False")
    if args.vllm_tensor_parallel_size != 1:
        _refuse(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} is not supported yet.", "1")
    if getattr(config, "use_dora", False):
        _refuse("use_dora=True: vLLM does not serve DoRA adapters.", "use_dora=False")
    extra = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    if extra:
        _refuse(
            f"trainable parameters that are not LoRA weights ({extra[:3]}...; modules_to_save / trainable_token"
            "_indices) cannot be sent as a vLLM LoRA adapter.",
            "target_modules only (no modules_to_save)",
        )


def prepare_adapter_sync(trainer) -> bool:
    """Before trl builds its vLLM engine (inside ``Trainer.__init__``): for a trainer with ``use_vllm=True`` on a
    peft model, check the setup, record its quantization and mark the model for :func:`adapter_generation_class`.

    Returns:
        Whether the adapter-only sync will be used.

    Raises:
        UnsupportedSetupError: server mode, FSDP1, DoRA, or trainable non-LoRA parameters (each named).
    """
    if not getattr(trainer.args, "use_vllm", False):
        return False
    from ..quant_record import keep_live_record
    from .checkpoint import unwrap_peft_model

    peft_model = unwrap_peft_model(trainer.model)
    if peft_model is None:
        return False  # a full fine-tune: trl's own sync sends what changed (everything)
    _check_setup(trainer, peft_model)
    keep_live_record(peft_model)
    setattr(peft_model, _MARK, True)
    _install()
    return True


def _install() -> None:
    """Make trl's trainers build :func:`adapter_generation_class` (it behaves as trl's class for unmarked models)."""
    import importlib

    for module in ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer"):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if getattr(found, "VLLMGeneration", None) is not None:
            found.VLLMGeneration = adapter_generation_class()


def _compute_dtype(peft_model) -> torch.dtype:
    """The dtype the policy computes in: bitsandbytes' compute dtype for a 4-bit base, else the base's dtype."""
    for module in peft_model.modules():
        dtype = getattr(module, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return peft_model.get_base_model().dtype


def _vllm_max_rank(rank: int) -> int:
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        _refuse(f"LoRA rank r={rank} is above vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}.", "a smaller r")
    return fits[0]


def vllm_base_weights(checkpoint: str | os.PathLike, record, device, dtype, load_dtype=None):
    """Yield (name, tensor in `dtype`) for every tensor of the 16-bit `checkpoint`, one at a time: the weights
    `record` says training quantized come back round-tripped through bitsandbytes with training's settings (the base
    the policy computes with), quantized from `load_dtype` (the dtype training loaded them in, default `dtype`: the
    block maxima depend on it), the others as stored. `record` None: everything as stored."""
    from safetensors import safe_open

    from ..merge import quantize_roundtrip

    quantized = set(record.linear) if record is not None else set()
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        _refuse(f"no *.safetensors files in the base checkpoint {str(checkpoint)!r}.", "a safetensors checkpoint")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                tensor = f.get_tensor(name)
                if name in quantized:
                    quant = (record.quant_type, record.blocksize or 64, record.double_quant)
                    tensor = quantize_roundtrip(tensor.to(device=device, dtype=load_dtype or dtype), *quant)
                yield name, tensor.to(dtype)


def _peft_key(name: str, adapter: str) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS and p != adapter]
    return ".".join(parts)


def adapter_tensors(peft_model):
    """Yield (key as in peft's adapter_model.safetensors, whole CPU tensor) for each LoRA weight of the active
    adapter. Collective under FSDP2: every rank must iterate (each DTensor is gathered alone, then freed)."""
    adapter = peft_model.active_adapter
    for name, param in peft_model.named_parameters():
        if "lora_" not in name or f".{adapter}." not in f"{name}.":
            continue
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield _peft_key(name, adapter), tensor.detach().to("cpu", copy=True).contiguous()


class _LoRAEngine:
    """trl's ``LLM`` as trl uses it (``generate``, ``llm_engine``, ``reset_prefix_cache`` ...), every generation
    served with the adapter of the latest sync."""

    def __init__(self, llm):
        self._llm = llm
        self.request = None
        self.syncs: list[dict] = []  # per sync: step, tensors, bytes, seconds (read by tests and the log)
        self._dir = tempfile.mkdtemp(prefix="hf_fsdp_qlora_vllm_lora_")
        weakref.finalize(self, shutil.rmtree, self._dir, True)

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, *args, **kwargs):
        kwargs.setdefault("lora_request", self.request)
        return self._llm.generate(*args, **kwargs)

    def load_adapter(self, peft_model, step: int) -> dict:
        """Gather the LoRA tensors, write them as a peft folder and serve them under a new LoRARequest."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        tensors = dict(adapter_tensors(peft_model))
        new_id = len(self.syncs) + 1
        folder = Path(self._dir) / f"sync{new_id}"
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        peft_model.peft_config[peft_model.active_adapter].save_pretrained(str(folder))
        old = self.request
        self.request = LoRARequest(f"policy-sync{new_id}", new_id, str(folder))
        if old is not None:  # served no more: free its slot in vLLM and its folder
            self._llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        sent = sum(t.numel() * t.element_size() for t in tensors.values())
        entry = {"step": step, "tensors": len(tensors), "bytes": sent, "seconds": time.perf_counter() - start}
        self.syncs.append(entry)
        return entry


def _engine_kwargs(generation, peft_model, dtype) -> dict:
    """trl's colocated engine settings, with vLLM's LoRA on, the policy's dtype, and eager mode on CPU."""
    config = peft_model.peft_config[peft_model.active_adapter]
    device = generation.accelerator.device
    return {
        "model": peft_model.name_or_path,
        "dtype": dtype,
        "enable_lora": True,
        "max_lora_rank": _vllm_max_rank(int(config.r)),
        "max_loras": 1,
        "enforce_eager": device.type == "cpu",  # no CUDA graphs to capture on CPU
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": generation.gpu_memory_utilization,
        "max_model_len": generation.max_model_length,
        "max_num_seqs": generation.max_num_seqs,
        "model_impl": generation.model_impl,
        "distributed_executor_backend": "external_launcher",
        "seed": generation.accelerator.process_index,
        "max_num_batched_tokens": 4096,
        "logprobs_mode": "processed_logprobs",
        "trust_remote_code": generation.trust_remote_code,
    }


def _build_engine(generation) -> _LoRAEngine:
    """The colocated engine: vLLM's LoRA on, its base replaced once by the base the policy computes with."""
    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM

    from ..quant_record import RECORD_ATTR
    from .checkpoint import unwrap_peft_model

    peft_model = unwrap_peft_model(generation.model)
    accelerator = generation.accelerator
    os.environ["RANK"] = str(accelerator.process_index)  # vLLM's external launcher reads the torch.distributed rank
    os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
    os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
    ensure_master_addr_port()
    dtype = _compute_dtype(peft_model)
    llm = LLM(**_engine_kwargs(generation, peft_model, dtype))
    record = getattr(peft_model, RECORD_ATTR, None)
    if record is not None and record.linear:
        load_dtype = peft_model.get_input_embeddings().weight.dtype  # never quantized: as training loaded it
        weights = vllm_base_weights(peft_model.name_or_path, record, accelerator.device, dtype, load_dtype)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    return _LoRAEngine(llm)


_CLASS = None


def adapter_generation_class() -> type:
    """trl's ``VLLMGeneration`` with the adapter-only engine and sync for models :func:`prepare_adapter_sync`
    marked; unchanged for any other model."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from trl.generation.vllm_generation import VLLMGeneration

    class AdapterVLLMGeneration(VLLMGeneration):
        __doc__ = adapter_generation_class.__doc__

        def _marked(self) -> bool:
            from .checkpoint import unwrap_peft_model

            return getattr(unwrap_peft_model(self.model), _MARK, False)

        def _init_vllm(self):
            if not self._marked():
                return super()._init_vllm()
            self.llm = _build_engine(self)
            self.accelerator.wait_for_everyone()

        def sync_weights(self):
            if not self._marked():
                return super().sync_weights()
            from .checkpoint import unwrap_peft_model

            step = len(self.llm.syncs)
            entry = self.llm.load_adapter(unwrap_peft_model(self.model), step)
            self.llm.reset_prefix_cache()
            if step == 0 and self.accelerator.is_main_process:
                logger.info(
                    "hf_fsdp_qlora: vLLM generates with the adapter synced alone: %d LoRA tensors, %.2f MB per sync "
                    "(nothing merged)", entry["tensors"], entry["bytes"] / 1e6,
                )  # fmt: skip
            return entry

    _CLASS = AdapterVLLMGeneration
    return _CLASS
