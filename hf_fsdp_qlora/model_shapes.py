"""A model's shapes from its config.json alone: the model is built on the meta device, no weight is read.

What the memory plan and the checks need: every linear layer (which ones bitsandbytes quantizes and LoRA
targets), the other parameters (embeddings, norms, head, biases), the decoder layer class that FSDP wraps, and
the attention/MLP sizes that drive activation memory. A 70B config builds in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import SetupInputError
from .experts.routers import router_layers
from .loss_paths import LOGIT_TRANSFORMS
from .model_config import config_value as _config_value
from .model_config import from_parts as _from_parts
from .model_config import load_model_config
from .model_config import position_limit as _position_limit
from .sp_rules import local_attention_kinds, router_aux_kind
from .towers import auto_class_for, meta_model, tower_modules

__all__ = [
    "ExpertsShape",
    "LinearShape",
    "ModelShape",
    "apply_checkpoint_quantization",
    "load_model_config",
    "model_shape",
]


@dataclass
class LinearShape:
    """One ``nn.Linear``: its weight is quantized (4/8-bit runs) unless it is the output head."""

    name: str
    in_features: int
    out_features: int
    layer: int | None  # index of the decoder layer holding it; None outside the layers (the head)
    quantized: bool
    lora: bool

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass
class ExpertsShape:
    """One module of fused 3-D expert weights (a mixture-of-experts layer's routed experts)."""

    name: str
    family: str  # the experts class, e.g. "Qwen3MoeExperts"
    layer: int | None
    num_experts: int
    weights: dict[str, tuple[int, int]]  # weight name -> one expert's (rows, columns) as stored
    bias_numel: int  # the biases of every expert (gpt-oss), kept in the model's dtype
    quantizable: bool  # a layout hf_fsdp_qlora.experts.quantized quantizes to 4 bits

    def expert_numel(self, name: str) -> int:
        rows, cols = self.weights[name]
        return rows * cols

    @property
    def numel(self) -> int:
        """Weights of every expert (biases not included)."""
        return self.num_experts * sum(self.expert_numel(n) for n in self.weights)


@dataclass
class ModelShape:
    model_type: str
    layer_classes: list[str]  # the model's `_no_split_modules`: what FSDP's transformer wrap wraps
    module_classes: set[str]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    linears: list[LinearShape] = field(default_factory=list)
    # numel of parameters that are not linear weights (embeddings, norms, biases), inside / outside the layers
    other_in_layers: int = 0
    other_outside: int = 0
    num_tensors: int = 0  # parameter tensors, tied ones once
    max_positions: int | None = None  # max_position_embeddings (n_positions), if the config has one
    rotary: bool = True  # positions from RoPE (a longer sequence runs, degraded), not a learned table
    checkpointing: bool = True  # the class supports transformers' activation checkpointing (XLNet, OpenAI GPT: not)
    # the config's transforms of the logits after the head (hf_fsdp_qlora.loss_paths.LOGIT_TRANSFORMS) that are set
    logit_transforms: dict = field(default_factory=dict)
    # Mixture of experts: the fused expert modules (their weights and biases are in no other count), the experts
    # each token is routed to, and the MLP widths that drive activation memory.
    experts: list[ExpertsShape] = field(default_factory=list)
    experts_per_token: int = 0
    expert_width: int = 0  # moe_intermediate_size (intermediate_size where the family has no other)
    shared_expert_width: int = 0  # the always-on shared experts' total width (Qwen2-MoE, DeepSeek)
    # attention layers that are not full causal attention (sliding-window, linear): sequence parallelism refuses them
    local_attention: tuple[str, ...] = ()
    sliding_window: int | None = None
    # the router aux loss under sequence parallelism (hf_fsdp_qlora.sp_rules.router_aux_problem): asked for by the
    # config, and how the class computes it (sp_rules.router_aux_kind)
    output_router_logits: bool = False
    router_aux: str | None = None
    # a multimodal model's vision/audio towers and projectors (hf_fsdp_qlora.towers): kept 16-bit, frozen, no LoRA
    towers: list[str] = field(default_factory=list)
    tower_params: int = 0

    @property
    def expert_params(self) -> int:
        return sum(e.numel + e.bias_numel for e in self.experts)

    @property
    def total_params(self) -> int:
        linear = sum(lin.numel for lin in self.linears)
        return linear + self.other_in_layers + self.other_outside + self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the experts it is not routed to."""
        idle = sum((e.numel + e.bias_numel) * (1 - self.experts_per_token / e.num_experts) for e in self.experts)
        return self.total_params - round(idle)

    @property
    def moe_layers(self) -> set[int]:
        return {e.layer for e in self.experts if e.layer is not None}

    def lora_params(self, r: int) -> int:
        return sum(r * (lin.in_features + lin.out_features) for lin in self.linears if lin.lora)

    def expert_lora_targets(self, targets) -> list[tuple[ExpertsShape, str]]:
        """The expert weights peft's ``target_parameters`` adapt: a parameter's full name equals a target or ends
        with ``"." + target`` (peft's own rule)."""
        targets = list(targets or [])
        return [
            (experts, name)
            for experts in self.experts
            for name in experts.weights
            if any(f"{experts.name}.{name}" == t or f"{experts.name}.{name}".endswith(f".{t}") for t in targets)
        ]

    def expert_lora_params(self, r: int, targets) -> int:
        """peft's LoRA on a fused ``[E, rows, cols]`` weight: ``lora_A`` ``[r*E, cols]``, ``lora_B`` ``[rows, r*E]``."""
        return sum(r * e.num_experts * sum(e.weights[name]) for e, name in self.expert_lora_targets(targets))

    def lora_in_features(self) -> list[int]:
        return [lin.in_features for lin in self.linears if lin.lora and lin.layer is not None]

    def dora_params(self) -> int:
        """DoRA's magnitude vectors: one element per output of each adapted Linear."""
        return sum(lin.out_features for lin in self.linears if lin.lora)

    def dora_workspace(self) -> int:
        """Elements DoRA's forward holds at once for its largest adapted Linear (peft's DoraLinearLayer): the
        dequantized weight, ``B @ A``, its scaled copy and their sum (each out x in) for the weight norm, and the
        identity matrix (in x in) it runs through lora_A and lora_B to form ``B @ A``."""
        return max(
            (lin.in_features * (lin.in_features + 4 * lin.out_features) for lin in self.linears if lin.lora), default=0
        )

    def per_layer(self, what: str) -> int:
        """numel of the largest decoder layer's quantizable linears (``"linear"``), expert weights (``"experts"``) or
        other params (``"other"``)."""
        if self.num_layers == 0:
            return 0
        if what == "other":
            return self.other_in_layers // self.num_layers
        if what == "experts":
            return max((e.numel for e in self.experts if e.layer is not None), default=0)
        sizes: dict[int, int] = {}
        for lin in self.linears:
            if lin.layer is not None:
                sizes[lin.layer] = sizes.get(lin.layer, 0) + lin.numel
        return max(sizes.values(), default=0)


def apply_checkpoint_quantization(setup, model) -> None:
    """A pre-quantized checkpoint's own quantization decides the run's (transformers ignores any other), in place.

    Our loader views its packed bytes as the run's dtype; a stock Trainer keeps the checkpoint's storage dtype.

    Raises:
        SetupInputError: a quantization method other than bitsandbytes, or a storage dtype it never writes.
    """
    from .errors import UnsupportedSetupError
    from .prequantized import checkpoint_quantization, quantized_bits

    config = load_model_config(model)
    bits = quantized_bits(config)
    try:
        quant = checkpoint_quantization(config, allow_8bit=bits == 8)
    except UnsupportedSetupError as err:
        if bits != 8:
            raise SetupInputError(str(err)) from err
        # The loader refuses this 8-bit checkpoint: the 8bit-under-fsdp finding says why and names the fix.
        setup.int8_unsupported = str(err)
    if bits == 8:
        setup.quantization = "8bit"
        return
    if quant is None:
        return
    setup.quantization = "4bit"
    setup.double_quant = quant.double_quant
    setup.quant_storage = None if setup.trainer == "hf_fsdp_qlora" else quant.storage


def _layer_index(name: str, layer_prefixes: list[str]) -> int | None:
    for prefix in layer_prefixes:
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            if index.isdigit():
                return int(index)
    return None


def _targets(config_targets, name: str) -> bool:
    if config_targets == "all-linear":
        return True
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(LoraConfig(target_modules=config_targets), name))


def model_shape(model, lora_target_modules="all-linear") -> ModelShape:
    """The shapes of `model` (a path, config.json, config object or an ``nn.Module``), built on the meta device.

    LoRA targets follow peft's rule for ``"all-linear"`` (every linear layer but the output head), routers aside
    (``load_qlora_model``'s all-linear never adapts them: :mod:`hf_fsdp_qlora.experts.routers`); bitsandbytes
    quantizes every linear layer but the output head (transformers' ``modules_to_not_convert``).

    Raises:
        SetupInputError: the config cannot be read or has no causal-LM class.
    """
    module, config = _module_and_config(model)
    if hasattr(module, "get_base_model"):  # a peft model: shapes of the base
        module = module.get_base_model()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_classes = list(getattr(module, "_no_split_modules", None) or [])
    towers = tower_modules(module)
    # the language model's layers: a tower's blocks are FSDP units too, but not the decoder layers counted per layer
    layer_prefixes = [p for p in _layer_prefixes(module, layer_classes) if not _in_towers(p, towers)]
    shape = _sizes(config, text, module, layer_classes)
    shape.towers = towers
    shape.tower_params = sum(p.numel() for n, p in module.named_parameters() if _in_towers(n, towers))
    linear_weights = set()
    _add_experts(shape, module, text, layer_prefixes, linear_weights)
    _add_linears(shape, module, layer_prefixes, lora_target_modules, linear_weights)
    _count_other_parameters(shape, module, layer_prefixes, linear_weights)
    return shape


def _module_and_config(model):
    """The module to read (`model` itself, or built from its config on the meta device) and its config."""
    import torch

    if isinstance(model, torch.nn.Module):
        return model, model.config
    config = load_model_config(model)
    try:
        # AutoModelForCausalLM, the image-text class of a family mapped only there, or a text model's own class
        return meta_model(config, auto_class_for(config), torch.bfloat16), config
    except Exception as err:  # any failure to build a model from this config is bad input
        raise SetupInputError(
            f"{config.model_type!r} has no causal-LM class in transformers ({err}). Pass a causal language "
            "model's config (Llama, Qwen2, Mistral, ...)."
        ) from err


def _in_towers(name: str, towers: list[str]) -> bool:
    return any(name == t or name.startswith(f"{t}.") for t in towers)


def _layer_prefixes(module, layer_classes: list[str]) -> list[str]:
    """The decoder layers live in a ModuleList: "model.layers.3" -> prefix "model.layers."."""
    return sorted(
        {
            n[: n.rfind(".") + 1]
            for n, m in module.named_modules()
            if type(m).__name__ in layer_classes and n.rsplit(".", 1)[-1].isdigit()
        }
    )


def _sizes(config, text, module, layer_classes: list[str]) -> ModelShape:
    """A shape with the config's sizes (no parameters counted yet)."""
    hidden = int(_from_parts(text, "hidden_size", max))  # the widest part plans the peak
    # Attention-free families (Mamba, RWKV, xLSTM) have no heads: one "head" as wide as the hidden size.
    heads = int(getattr(text, "num_attention_heads", None) or getattr(text, "num_heads", None) or 1)
    return ModelShape(
        model_type=config.model_type,
        layer_classes=layer_classes,
        module_classes={type(m).__name__ for m in module.modules()},
        checkpointing=bool(getattr(module, "supports_gradient_checkpointing", True)),
        num_layers=int(_from_parts(text, "num_hidden_layers", sum) or 0),
        hidden_size=hidden,
        intermediate_size=_widest(getattr(text, "intermediate_size", None)) or 4 * hidden,
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(_config_value(text, "head_dim") or hidden // heads),
        vocab_size=int(text.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=_position_limit(text),
        rotary=any(getattr(text, name, None) is not None for name in ("rope_parameters", "rope_theta", "rotary_dim")),
        logit_transforms={k: getattr(text, k) for k in LOGIT_TRANSFORMS if getattr(text, k, None) is not None},
        local_attention=local_attention_kinds(text),
        sliding_window=getattr(text, "sliding_window", None),
        output_router_logits=bool(getattr(text, "output_router_logits", False)),
        router_aux=router_aux_kind(type(module)),
    )


def _widest(size) -> int:
    """A config's size field as one number: Gemma 3n gives a width per layer (the widest plans the peak)."""
    return int(max(size) if isinstance(size, (list, tuple)) else size or 0)


def _add_linears(shape: ModelShape, module, layer_prefixes: list[str], lora_target_modules, counted: set) -> None:
    """Every linear layer of `module` into `shape` (quantized and LoRA-targeted but the head); weight ids into
    `counted`."""
    import torch

    head = module.get_output_embeddings()
    routers = router_layers(module) if lora_target_modules == "all-linear" else set()  # never all-linear targets
    towers = shape.towers  # 16-bit and frozen: neither quantized nor LoRA targets
    for name, sub in module.named_modules():
        is_linear = isinstance(sub, torch.nn.Linear) or type(sub).__name__ in ("Linear4bit", "Linear8bitLt")
        if not is_linear or "lora_" in name or ".base_layer" in name[-11:]:
            continue
        is_head = sub is head or _in_towers(name, towers)
        shape.linears.append(
            LinearShape(
                name=name,
                in_features=int(sub.in_features),
                out_features=int(sub.out_features),
                layer=_layer_index(name, layer_prefixes),
                quantized=not is_head,
                lora=not is_head and name not in routers and _targets(lora_target_modules, name),
            )
        )
        counted.add(id(sub.weight))


def _count_other_parameters(shape: ModelShape, module, layer_prefixes: list[str], counted: set) -> None:
    """Parameters that are neither linear nor expert weights (embeddings, norms, biases), inside / outside the
    layers, tied ones once; and the number of parameter tensors."""
    seen = set()
    shape.num_tensors = sum(1 for _ in module.parameters())
    for name, param in module.named_parameters(remove_duplicate=True):
        if id(param) in counted or id(param) in seen or "lora_" in name:
            continue
        seen.add(id(param))
        if _layer_index(name, layer_prefixes) is None:
            shape.other_outside += param.numel()
        else:
            shape.other_in_layers += param.numel()


def _add_experts(shape: ModelShape, module, text, layer_prefixes: list[str], counted: set) -> None:
    """The experts modules of `module` (by class: ``is_experts_module``, never a Conv1d's 3-D weight) into `shape`
    (their parameters' ids into `counted`)."""
    from .experts.layouts import expert_layout, is_experts_module

    for name, sub in module.named_modules():
        if not is_experts_module(sub):
            continue
        layout = expert_layout(sub)
        # An experts class we do not know: its weights, wherever inside it they are (Dbrx nests them one deeper).
        direct = dict(sub.named_parameters(recurse=layout is None))
        weight_names = layout.weights if layout else tuple(n for n, p in direct.items() if p.dim() >= 2)
        if not weight_names:
            continue
        bias_names = layout.biases if layout else ()
        first = direct[weight_names[0]]  # stacked [E, ...], or DBRX's 2-D [E * ffn, hidden] (E: the class's count)
        count = int(first.shape[0] if first.dim() >= 3 else getattr(sub, "num_experts", 0) or first.shape[0])
        weights = {n: _per_expert(direct[n], count) for n in weight_names}
        shape.experts.append(
            ExpertsShape(
                name=name,
                family=type(sub).__name__,
                layer=_layer_index(name, layer_prefixes),
                num_experts=count,
                weights=weights,
                bias_numel=sum(direct[n].numel() for n in bias_names),
                quantizable=layout is not None,
            )
        )
        counted.update(id(direct[n]) for n in weight_names + bias_names)
    if not shape.experts:
        return
    shape.experts_per_token = int(getattr(text, "num_experts_per_tok", 0) or getattr(text, "top_k", 0) or 0)
    width = getattr(text, "moe_intermediate_size", None) or shape.intermediate_size
    shape.expert_width = int(width)
    shared = getattr(text, "shared_expert_intermediate_size", None) or 0
    if not shared and getattr(text, "n_shared_experts", None):  # DeepSeek: n_shared_experts experts of width
        shared = int(text.n_shared_experts) * shape.expert_width
    shape.shared_expert_width = int(shared)


def _per_expert(param, count: int) -> tuple[int, ...]:
    """One expert's weight shape: a stacked [E, ...] weight's trailing dims; DBRX stacks its experts' rows in 2-D
    weights ([E * ffn, hidden])."""
    if param.dim() >= 3:
        return tuple(int(d) for d in param.shape[1:])
    return (int(param.shape[0]) // count, int(param.shape[1]))
