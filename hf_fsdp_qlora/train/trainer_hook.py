"""Give any `transformers.Trainer` (trl's SFT/DPO/GRPO/reward trainers, your own subclass) our FSDP behaviour.

There is one implementation of that behaviour: :class:`~hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin` (resolving
activation checkpointing before accelerate is created, gathered adapter saves, crash-safe checkpoints, exact
resume) plus the callbacks it installs (:class:`~hf_fsdp_qlora.FSDPQLoRACallback` and the hygiene callbacks).
Our trainer classes inherit it; every other route gets it here, by giving the trainer object a subclass of its own
class with the mixin in front, at the start of ``Trainer.__init__``:

* ``Trainer(..., callbacks=[FSDPQLoRACallback()])`` - the callback alone is enough. Part of what it fixes happens
  inside ``Trainer.__init__`` before any callback event (transformers raises there when FSDP's and the Trainer's
  activation checkpointing are both on), so the callback's presence is looked for when ``__init__`` starts;
* ``Trainer(..., callbacks=[PreemptionCallback()])`` - likewise: what the preemption callback promises (an evaluation
  ended early, the checkpoint kept through the end of training, the signal handlers restored when ``train()``
  raises) happens in the mixin's methods;
* ``python -m hf_fsdp_qlora.run SCRIPT.py`` - every trainer the script builds, without any change to it.

The subclass keeps the class's name and is an instance of the user's class (``isinstance(t, DPOTrainer)`` holds).
Installing the hook wraps ``Trainer.__init__`` once; it changes nothing for a trainer built without our callback
unless ``adopt_all`` was asked for.

Imports go one way: ``callbacks`` <- ``_trainer_mixin`` <- ``trainer_hook``. The public name
``hf_fsdp_qlora.FSDPQLoRACallback`` (and ``hf_fsdp_qlora.PreemptionCallback``) is resolved through this module, so
importing the callback installs the hook before the user's Trainer is built.
"""

from __future__ import annotations

import functools
import inspect

from ._trainer_mixin import FSDPSaveMixin, with_fsdp_callback
from .callbacks import FSDPQLoRACallback
from .preemption_callback import PreemptionCallback
from .sequence_parallel import adopt_launch_sp_size

__all__ = ["FSDPQLoRACallback", "PreemptionCallback", "adopted_class", "install_trainer_hook"]

_INSTALLED = False
_ADOPT_ALL = False
_CLASSES: dict[type, type] = {}


def adopted_class(cls: type) -> type:
    """`cls` with our behaviour: `cls` itself if it already has it, else a cached subclass with the mixin first."""
    if issubclass(cls, FSDPSaveMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            cls.__name__,
            (FSDPSaveMixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
        )
    return _CLASSES[cls]


def _has_our_callback(callbacks) -> bool:
    # PreemptionCallback too: ending an evaluation early, keeping the checkpoint and restoring the signal handlers
    # when train() raises all happen in the mixin.
    ours = (FSDPQLoRACallback, PreemptionCallback)
    return any(isinstance(cb, ours) or cb in ours for cb in callbacks or ())


def install_trainer_hook(adopt_all: bool = False) -> None:
    """Wrap ``transformers.Trainer.__init__`` (once) so trainers built with our callback - or every trainer, with
    `adopt_all` - get our behaviour. Idempotent; `adopt_all=True` is sticky for the process."""
    global _INSTALLED, _ADOPT_ALL
    _ADOPT_ALL = _ADOPT_ALL or adopt_all
    if _INSTALLED:
        return
    from transformers import Trainer

    original = Trainer.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind_partial(self, *args, **kwargs)
        except TypeError:  # let the original raise its own error for a wrong call
            return original(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        adopt_launch_sp_size(bound.arguments.get("args"))  # hf_fsdp_qlora.run's sp_size, for args without one
        # sp_size > 1 only works through the mixin's hooks: never ignore it silently on a stock Trainer.
        needs_mixin = getattr(bound.arguments.get("args"), "sp_size", 1) > 1
        if not isinstance(self, FSDPSaveMixin) and (_ADOPT_ALL or _has_our_callback(callbacks) or needs_mixin):
            self.__class__ = adopted_class(type(self))
        if isinstance(self, FSDPSaveMixin):
            bound.arguments["callbacks"] = with_fsdp_callback(callbacks, bound.arguments.get("args"))
        original(*bound.args, **bound.kwargs)

    Trainer.__init__ = __init__
    _INSTALLED = True


# `from hf_fsdp_qlora import FSDPQLoRACallback` (or PreemptionCallback) imports this module: a Trainer built with
# the callback then gets our behaviour (what the callback cannot fix happens inside Trainer.__init__, before any
# callback event).
install_trainer_hook()
