"""``compile_layers``: torch.compile each decoder layer, through accelerate's own regional compilation.

accelerate 1.15 already has the mechanism (``TorchDynamoPlugin(use_regional_compilation=True)``, or
``dynamo_config: {dynamo_backend: INDUCTOR, dynamo_use_regional_compilation: true}`` in the accelerate config):
under FSDP2 its ``prepare`` applies activation checkpointing, then compiles every repeated block *in place*
(``module.compile()``), then shards. In place matters: ``torch.compile(module)`` returns a wrapper whose call skips
the hooks ``fully_shard`` adds, while ``module.compile()`` keeps them, so each layer's all-gather and reshard still
run. transformers' ``TrainingArguments(torch_compile=True)`` sets only the backend, so accelerate compiles the whole
model as one region; this option adds the per-layer choice, the same as the accelerate config's.

Measured on CPU (gloo, 2 ranks, tiny Llama, NF4 with bf16 storage, LoRA): the step-1 and step-2 losses of the
compiled run equal the uncompiled run's bit for bit. Dynamo breaks each layer's graph where FSDP2's hooks and
the checkpoint wrapper call ``torch._dynamo.disable``-marked code and at one ``requires_grad_`` call; the rest
runs as inductor code. On CPU inductor needs a C++ compiler, checked here before anything is compiled.
"""

from __future__ import annotations

import logging
import os
import shutil

from ..errors import UnsupportedSetupError

__all__ = ["compiled_modules", "enable_layer_compilation"]

logger = logging.getLogger(__name__)


def _cpp_compiler() -> str | None:
    # Inductor's CPU backend uses $CXX, else the first C++ compiler on PATH.
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def enable_layer_compilation(trainer) -> bool:
    """Switch accelerate's dynamo plugin of `trainer` to per-layer compilation when ``args.compile_layers`` is set.

    Called after the Accelerator exists and before ``prepare`` wraps the model (where accelerate compiles).
    Keeps a backend the user chose (``torch_compile_backend`` or the accelerate config), else inductor.

    Returns:
        True when compilation was turned on.

    Raises:
        UnsupportedSetupError: not FSDP2, or training on CPU and no C++ compiler for inductor.
    """
    if not getattr(trainer.args, "compile_layers", False):
        return False
    from accelerate.utils import DynamoBackend

    fsdp_plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if fsdp_plugin is None or int(getattr(fsdp_plugin, "fsdp_version", 1) or 1) != 2:
        # Only FSDP2's path compiles in place and is tested here; accelerate's FSDP1/DDP paths compile the wrapped
        # model afterwards, which nothing in this project has run.
        raise UnsupportedSetupError(
            "compile_layers=True is supported under FSDP2 only (accelerate config fsdp_version: 2); this run is "
            f"{trainer.accelerator.distributed_type}. Launch with an FSDP2 config (e.g. fsdp2_qlora.yaml) or set "
            "compile_layers=False."
        )
    plugin = trainer.accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO:
        plugin.backend = DynamoBackend.INDUCTOR
    if plugin.backend == DynamoBackend.INDUCTOR and trainer.accelerator.device.type == "cpu" and not _cpp_compiler():
        raise UnsupportedSetupError(
            "compile_layers=True compiles with inductor, which on CPU needs a C++ compiler, and none was found (set "
            "CXX or put g++/clang++ on PATH). Install one (Debian/Ubuntu: apt-get install g++) or set "
            "compile_layers=False."
        )
    plugin.use_regional_compilation = True
    logger.info("hf_fsdp_qlora: compile_layers: each decoder layer compiled in place (%s)", plugin.backend.value)
    return True


def compiled_modules(model) -> list[str]:
    """Names of the modules of `model` compiled in place (``module.compile()``); proof the option engaged."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
