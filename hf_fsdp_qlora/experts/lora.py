"""LoRA on 4-bit experts, in peft's own adapter format (peft's ``target_parameters``).

peft 0.21 adapts a fused 3-D expert weight ``[E, out, in]`` with a ``ParamWrapper`` module holding ``lora_A``
``[r*E, in]`` and ``lora_B`` ``[out, r*E]`` (two targets on one module nest: the second wrapper wraps the first),
and in its forward it adds the update to the weight through ``torch.nn.utils.parametrize``. A
:class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts` has no 16-bit weight to parametrize - only packed bytes.
So here:

* while peft injects adapters (:func:`peft_sees_expert_weights`), each 4-bit experts module shows peft a zero-byte
  stand-in parameter under the family's weight name, with the 16-bit weight's shape and dtype: peft builds its
  wrappers exactly as on the 16-bit model (same module tree, same state-dict keys, same shapes), so a saved
  adapter loads with ``PeftModel.from_pretrained`` on the 16-bit base. The stand-ins are removed afterwards, so
  FSDP never sees them;
* every wrapper over 4-bit experts gets a forward of its own (:func:`attach_expert_lora`; an instance attribute,
  peft's class is untouched and keeps its name, which peft checks) that hands its adapters to the experts module,
  which adds each routed expert's LoRA term itself (``QuantizedExperts.lora_active``).
"""

from __future__ import annotations

import functools
import logging
import types
from contextlib import contextmanager

from torch import nn

from ..errors import UnsupportedSetupError
from .quantized import ON_BUILD, QuantizedExperts, expert_layout, has_fused_experts, quantize_experts
from .script_stream import experts_quantization, stream_experts_of_script_loads
from .stock_reload import MARK, linear_weights_as_modules_within, save_stock_form, stock_form
from .targets import MAMBA_REFUSED, MAMBA_TYPES, keep_linear_targets, lora_config_for_experts

__all__ = [
    "attach_expert_lora",
    "check_target_modules",
    "check_target_parameters",
    "linear_layer_names",
    "peft_adapts_4bit_experts",
    "peft_sees_expert_weights",
    "quantize_experts_before_peft",
]

logger = logging.getLogger(__name__)


_NO_MERGE = (
    "A LoRA adapter on 4-bit experts cannot be merged into the packed 4-bit expert weights (peft would add the update "
    "to a 16-bit weight that does not exist). Save the adapter and merge it into the 16-bit base model instead."
)


def _refuse_merge(self, *args, **kwargs):
    raise UnsupportedSetupError(_NO_MERGE)


def _wrapper_forward(self, x, *args, **kwargs):
    """A peft ``ParamWrapper``'s forward over 4-bit experts: its active adapters go to the experts module."""
    self._check_forward_args(x, *args, **kwargs)
    kwargs.pop("adapter_names", None)
    active = [] if self.disable_adapters else [a for a in self.active_adapters if a in self.lora_A]
    factors = [(self.lora_A[a], self.lora_B[a], self.scaling[a]) for a in active]
    with self.get_base_layer().lora_active(self.parameter_name, factors):
        return self.base_layer(x, *args, **kwargs)


def attach_expert_lora(model: nn.Module) -> int:
    """Give every peft ``ParamWrapper`` over 4-bit experts in `model` the forward above, and a ``merge`` that refuses
    clearly (peft's would write into the zero-byte stand-in). Idempotent.

    Returns:
        How many wrappers adapt 4-bit experts.
    """
    count = 0
    for module in model.modules():
        if type(module).__name__ == "ParamWrapper" and isinstance(module.get_base_layer(), QuantizedExperts):
            if getattr(module.forward, "__func__", None) is not _wrapper_forward:
                module.forward = types.MethodType(_wrapper_forward, module)
                module.merge = types.MethodType(_refuse_merge, module)
            count += 1
    return count


@contextmanager
def peft_sees_expert_weights(model: nn.Module):
    """Within: every 4-bit experts module of `model` holds zero-byte stand-ins of its 16-bit weights as parameters,
    for peft's ``target_parameters`` matching (it looks at registered parameters only). On exit they are gone and
    the wrappers peft built over them run the 4-bit experts (:func:`attach_expert_lora`)."""
    added = []
    for module in model.modules():
        if isinstance(module, QuantizedExperts):
            for name in module.layout.weights:
                if name not in module._parameters:
                    module._parameters[name] = nn.Parameter(module.logical_weight(name), requires_grad=False)
                    added.append((module, name))
    try:
        yield
    finally:
        for module, name in added:
            module._parameters.pop(name, None)
        attach_expert_lora(model)


def _matches(key: str, target: str) -> bool:
    # peft's rule (tuners_utils._inject_parameters): the full name, or a suffix at a dot.
    return key == target or key.endswith(f".{target}")


def check_target_parameters(model: nn.Module, lora_config) -> None:
    """Before ``get_peft_model``: every ``target_parameters`` name must match a weight of `model`.

    peft only complains when none matches, and on 4-bit experts a name could match the packed bytes. Raises
    :class:`UnsupportedSetupError` naming the name and the weights it could have meant.
    """
    targets = list(getattr(lora_config, "target_parameters", None) or [])
    if not targets:
        return
    weights, packed, expert_names = set(), {}, set()
    for module_name, module in model.named_modules():
        names = [n for n, _ in module.named_parameters(recurse=False)]
        if isinstance(module, QuantizedExperts):
            packed.update({f"{module_name}.{n}_4bit": n for n in module.layout.weights})
            names = list(module.layout.weights)
            expert_names.update(f"{module_name.rsplit('.', 2)[-2]}.experts.{n}" for n in names if "." in module_name)
        weights.update(f"{module_name}.{n}" for n in names)
    for target in targets:
        hit_packed = sorted({w for key, w in packed.items() if _matches(key, target)})
        if hit_packed:
            raise UnsupportedSetupError(
                f"LoRA target_parameters {target!r} names the packed 4-bit bytes of the experts, which are not "
                f"weights. Target the experts' weights by their 16-bit names instead, e.g. "
                f"target_parameters=['mlp.experts.{hit_packed[0]}']."
            )
        if not any(_matches(key, target) for key in weights):
            raise UnsupportedSetupError(
                f"LoRA target_parameters {target!r} matches no parameter of this model (peft ignores such a name "
                f"silently when another one matches). Name the weights to adapt, e.g. {sorted(expert_names) or ''} "
                "(trl: --lora_target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj)."
            )


def linear_layer_names(model: nn.Module) -> list[str]:
    """The last name part of every linear layer of `model` (peft's ``target_modules`` names), peft's own layers left out."""
    names = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        if "base_layer" in parts or any(p.startswith("lora_") for p in parts):
            continue  # inside a peft layer: its base layer and adapters are not the model's layers
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(parts[-1])
    return sorted(names)


def lora_config_for_mamba(model: nn.Module, lora_config):
    """`lora_config` with ``"all-linear"`` spelled out as the linear layers peft accepts on a Mamba-based model."""
    if lora_config.target_modules != "all-linear" or getattr(model.config, "model_type", None) not in MAMBA_TYPES:
        return lora_config
    import copy

    head = model.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    lora_config = copy.deepcopy(lora_config)
    lora_config.target_modules = sorted(names - MAMBA_REFUSED)
    logger.info(
        "hf_fsdp_qlora: all-linear on this Mamba-based model (peft refuses out_proj, conv1d): %s",
        lora_config.target_modules,
    )
    return lora_config


def check_target_modules(model: nn.Module, lora_config) -> None:
    """Before ``get_peft_model``: a ``target_modules`` name that names a mixture-of-experts module is refused with the
    way to adapt experts (peft adapts their fused weights by ``target_parameters``; as a module it refuses them)."""
    targets = lora_config.target_modules
    if not targets or isinstance(targets, str):  # "all-linear" or a regex: peft's own rules
        return
    for name, module in model.named_modules():
        layout = module.layout if isinstance(module, QuantizedExperts) else expert_layout(module)
        hit = sorted(t for t in targets if _matches(name, t)) if layout is not None else []
        if hit:
            owner = ".".join(name.split(".")[-2:])
            params = [f"{owner}.{w}" for w in layout.weights]
            raise UnsupportedSetupError(
                f"LoRA target_modules {hit} names the mixture-of-experts module {name!r} ({type(module).__name__}), "
                f"which peft adapts by its weights, not as a module. Target the experts with "
                f"LoraConfig(target_parameters={params}, lora_dropout=0.0) (trl: --lora_target_parameters "
                f"{' '.join(params)} --lora_dropout 0), and keep target_modules for linear layers: "
                f"{linear_layer_names(model)}."
            )


def _quantize_experts_of_4bit_model(model: nn.Module, env_switch: str) -> None:
    from ..dtypes import quantization_kind

    if quantization_kind(model) != "4bit" or not has_fused_experts(model):
        return
    try:
        quantize_experts(model, **experts_quantization(model))
    except UnsupportedSetupError as err:
        raise UnsupportedSetupError(f"{err} With `-m hf_fsdp_qlora.run`: set {env_switch}=0 instead.") from err


def _holds_4bit_experts(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedExperts) for m in model.modules())


def _all_linear_as_the_loader(model: nn.Module, config) -> dict | None:
    """A script's ``"all-linear"`` on a mixture of experts (trl's ``--lora_target_modules all-linear``) means what it
    means in ``load_qlora_model``: the linear layers, no router, none moved onto the experts (set in `config`, in
    place: peft keeps the config object). Returns the form its saves take (:func:`.stock_reload.stock_form`)."""
    resolved = lora_config_for_experts(model, config)
    if resolved is config:
        return None
    config.target_modules = resolved.target_modules
    setattr(config, MARK, True)
    return stock_form(model, config)


def peft_adapts_4bit_experts() -> None:
    """Make every peft loader in this process (``get_peft_model``, ``PeftModel.from_pretrained``,
    ``PeftModel.load_adapter``, transformers' ``load_adapter``) build expert LoRA on 4-bit experts as
    ``load_qlora_model`` does: without it peft finds no weight to wrap there, warns, and drops the adapter's expert
    tensors (a loaded-back adapter would run without them). Called when the first 4-bit experts module is built; a
    model without 4-bit experts is left to peft as is. Idempotent."""
    quantize_experts_before_peft(None)


ON_BUILD.append(peft_adapts_4bit_experts)  # each 4-bit experts module built makes peft's loaders adapt it


def quantize_experts_before_peft(env_switch: str | None, quantize: bool = True) -> None:
    """Wrap peft's ``BaseTuner.inject_adapter`` (once per mode) so that peft adapts 4-bit experts.

    With `env_switch` (``-m hf_fsdp_qlora.run``, for scripts that build their peft model themselves, e.g. trl's
    ``sft.py --load_in_4bit --use_peft``): unless `quantize` is False, the script's 4-bit ``from_pretrained`` of a
    local MoE checkpoint streams the experts into 4 bits one layer at a time (:mod:`._script_stream`), and a model
    loaded in 4 bits whose experts are still 16-bit gets them quantized here (with its linear layers' quant type and
    double quant); every
    ``target_parameters`` name must match a weight; LoRA on 4-bit experts works as with ``load_qlora_model``. All of
    it happens before the Trainer wraps the model in FSDP. `env_switch` names the switch in messages.

    Without (:func:`peft_adapts_4bit_experts`): only models that hold 4-bit experts are touched - their
    ``target_parameters`` must match, and peft sees their weights while it injects.
    """
    from peft.tuners.tuners_utils import BaseTuner

    original = BaseTuner.inject_adapter
    settings = getattr(original, "hf_fsdp_qlora_experts", None)
    if settings is not None and (env_switch is None or settings["env_switch"] is not None):
        if env_switch is not None:
            settings["quantize"] = quantize
        return
    # None installed yet, or only the loaders' mode and the launcher asks for more: wrap what is there.
    settings = {"quantize": quantize and env_switch is not None, "env_switch": env_switch}

    @functools.wraps(original)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        launcher = settings["env_switch"] is not None
        if launcher and settings["quantize"]:
            _quantize_experts_of_4bit_model(model, settings["env_switch"])
        config = self.peft_config[adapter_name]
        form = _all_linear_as_the_loader(model, config) if launcher else None
        # an adapter saved for stock peft (stock_reload.py): LoRA on the linear layers its target_parameters name
        with linear_weights_as_modules_within(model, self.peft_config):
            if launcher or _holds_4bit_experts(model):
                check_target_modules(model, config)
                check_target_parameters(model, config)
            with peft_sees_expert_weights(model), keep_linear_targets(config):
                result = original(self, model, adapter_name, *args, **kwargs)
        save_stock_form(config, form)
        return result

    inject_adapter.hf_fsdp_qlora_experts = settings
    BaseTuner.inject_adapter = inject_adapter
    if env_switch is not None:
        stream_experts_of_script_loads(settings)
