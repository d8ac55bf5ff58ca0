"""Keep bitsandbytes from repacking 4-bit weights in place on CPU (AVX512-BF16), which corrupts training.

bitsandbytes (checked on 0.50.2) gives every ``Linear4bit`` a ``support_avx512bf16_for_cpu`` flag, True on
CPUs with AVX512-BF16. Its ``forward`` then rewrites ``weight.data`` and the quant state into a CPU-kernel
layout (uint8, ``quant_state.packing_format_for_cpu = True``) the first time it runs on a CPU input in eval
mode with ``requires_grad == False`` - exactly what ``Trainer.evaluate()`` (and any ``torch.no_grad()``
forward) does. The repack is meant for inference; after it, during training:

* no gradient reaches the adapters of the repacked layers (the packed kernel path has no backward),
* FSDP2 keeps computing on bytes laid out differently from its shards (loss 5.82 instead of 5.68 at
  step 2 of the same run),
* FSDP1's next state-dict save asserts in ``_convert_weight_packed_for_cpu_inverse`` (the bytes FSDP
  holds are bf16 views, not the uint8 the inverse expects),
* peft's dequantize and ``merge_and_unload`` read wrong values (max err 0.12).

The fix is bitsandbytes' own switch: set the flag False, on every ``Linear4bit`` created from now on (a
wrap of ``Linear4bit.__init__``, installed with the CPU rehearsal hook) and on the layers of a model we are
handed, and undo a repack that already happened. Nothing changes on a GPU: the repack only runs on CPU
inputs. Remove when bitsandbytes stops repacking in place during training-time evaluation;
``tests/test_semantics_eval.py::test_upstream_bitsandbytes_still_repacks`` fails then.
"""

from __future__ import annotations

import functools

__all__ = ["disable_cpu_repack_in_model", "prevent_cpu_weight_repack"]

_PATCHED = False


def _linear4bit_class():
    try:
        from bitsandbytes.nn import Linear4bit
    except Exception:  # noqa: BLE001 - bitsandbytes missing or failing to load: nothing to prevent
        return None
    return Linear4bit


def prevent_cpu_weight_repack() -> bool:
    """Make every ``Linear4bit`` built after this call keep its 4-bit layout on CPU. Idempotent.

    Returns:
        True when the wrap is installed (bitsandbytes importable), False otherwise.
    """
    global _PATCHED
    if _PATCHED:
        return True
    cls = _linear4bit_class()
    if cls is None:
        return False
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.support_avx512bf16_for_cpu = False

    cls.__init__ = __init__
    _PATCHED = True
    return True


def disable_cpu_repack_in_model(model) -> int:
    """Turn the CPU repack off on every ``Linear4bit`` of `model`, and undo a repack that already ran.

    A model that went through a no-grad eval forward before it reached us (``from_pretrained`` returns
    models in eval mode) holds repacked weights; they are converted back with bitsandbytes' own inverse,
    the one its ``state_dict`` save uses.

    Returns:
        How many weights were converted back.
    """
    cls = _linear4bit_class()
    if cls is None:
        return 0
    restored = 0
    for module in model.modules():
        if not isinstance(module, cls):
            continue
        module.support_avx512bf16_for_cpu = False
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
            restored += 1
    return restored
