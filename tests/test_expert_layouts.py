"""Experts by declared layout (issue 48, item 1): every causal-LM family whose experts class transformers decorates
with ``use_experts_implementation`` loads with 4-bit experts by default, and its 4-bit experts are right.

One process per family, on the tiny model tests/family_build.py builds (a family it cannot build is skipped with
the builder's reason: the family sweep lists it as "not built"). Per family, against these oracles:

- the family's own experts module (transformers' eager forward) holding the dequantized 4-bit weights: our 4-bit
  experts' output, for the same routed tokens, equal within bf16 rounding (the declared flags were read right:
  transposed, bias, no gate, the family's own gate);
- the per-expert loop: the grouped path's logits and every LoRA gradient within the suite's grouped tolerance;
- one optimizer step with all-linear LoRA and LoRA on every fused expert weight (``target_parameters``): every
  expert LoRA tensor moves;
- peft's ``merge_and_unload`` on the float32 base carrying the trained adapter: ``merge_adapters`` on the saved
  adapter writes the same merged experts (and every other tensor), within two bf16 roundings (tests/family_sweep.py's
  comparison).

DBRX (:data:`FUSED_FAMILIES`) stores its experts as 2-D stacks the loader fuses into a declared class
(hf_fsdp_qlora/experts/dbrx.py): its float32 base is fused the same way for the oracles (first checked equal to
DBRX's own forward), and peft's merge is mapped back to DBRX's ``mlp.w1`` / ``v1`` / ``w2`` to compare with the
checkpoint ``merge_adapters`` writes, which ``DbrxForCausalLM`` loads.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import pytest
import torch
from family_build import build, build_error
from family_sweep import _compare, _load16, families
from family_variants import expert_targets

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.experts.dbrx import fuse_dbrx_experts, fused_experts, to_stored
from hf_fsdp_qlora.experts.quantized import QuantizedExperts

# bf16 grouped vs loop, as max |difference| / max |value| (tests/test_moe.py GROUPED_TOLERANCE).
GROUPED = {"rtol": 2**-6, "atol": 2**-6}


@cache
def decorated_families() -> list[str]:
    """Causal-LM families whose modelling file decorates an experts class with ``use_experts_implementation``: read
    from the source text, so collecting imports no model."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    root = Path(transformers.__file__).parent / "models"
    found = []
    for family in families():
        module = model_type_to_module_name(family)
        path = root / module / f"modeling_{module}.py"
        if path.exists() and "@use_experts_implementation" in path.read_text():
            found.append(family)
    return found


def _lora_config(path: Path):
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    fuse_dbrx_experts(meta)  # DBRX's experts as the loader holds them (a no-op for the other families)
    # every 3-D weight of every experts module, as `<parent>.<module>.<param>` suffixes (JetMoE's are not "experts")
    targets = expert_targets(meta) + sorted({
        f"{'.'.join(name.split('.')[-2:])}.{param}"
        for name, module in _declared_experts(meta).items()
        for param, value in module.named_parameters(recurse=False)
        if value.dim() == 3 and not name.endswith(".experts")
    })  # fmt: skip
    # init_lora_weights=False: lora_B starts non-zero, so one step moves lora_A too
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    config.target_parameters = targets
    return config


# Families whose experts class is outside transformers' contract and has a named entry (EXPERT_LAYOUTS).
NAMED_FAMILIES = {
    "llama4_text": "Llama4TextExperts",
    "jetmoe": "JetMoeParallelExperts",
    "longcat_flash": "LongcatFlashExperts",
}


# Families whose experts the loader first fuses into a declared class of ours (hf_fsdp_qlora/experts/dbrx.py).
FUSED_FAMILIES = {"dbrx": "DbrxFusedExperts"}


def _fused_base(base32, ids):
    """The float32 base with its experts fused as the loader fuses them; its logits first checked equal to the
    family's own forward (the stock class), so the fused base is a fair oracle."""
    stock = base32(input_ids=ids, use_cache=False).logits
    assert fuse_dbrx_experts(base32), "the family has experts to fuse"
    fused = base32(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(fused / stock.abs().max(), stock / stock.abs().max(), rtol=1e-5, atol=1e-5)
    return base32


def _declared_experts(model) -> dict[str, torch.nn.Module]:
    """The experts modules whose class transformers decorated (its __init__ sets the declared flags), or whose class
    has a named entry."""
    named = set(NAMED_FAMILIES.values())
    return {
        n: m
        for n, m in model.named_modules()
        if (hasattr(m, "has_gate") and hasattr(m, "is_concatenated")) or type(m).__name__ in named
    }


def _quantized(model) -> dict[str, QuantizedExperts]:
    """{the experts' name in the base model: our 4-bit experts module} (below peft's wrappers)."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer", ""): module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedExperts)
    }


@torch.no_grad()
def _check_against_family_forward(quantized: dict, base32) -> None:
    """Each 4-bit experts module against the family's own module (eager) holding its dequantized weights."""
    stock_modules = _declared_experts(base32)
    assert set(stock_modules) == set(quantized), (sorted(stock_modules), sorted(quantized))
    generator = torch.Generator().manual_seed(0)
    for name, ours in quantized.items():
        stock = copy.deepcopy(stock_modules[name]).to(torch.bfloat16)
        if hasattr(stock, "config"):  # a declared class: transformers' eager forward, the reference
            stock.config._experts_implementation = "eager"
        for weight in ours.layout.weights:
            rows = ours.expert_rows(weight)  # LongCat-Flash's gate_up_proj: its zero experts' rows too
            dequantized = torch.stack([ours.dequantize_expert(weight, e) for e in range(rows)])
            getattr(stock, weight).copy_(dequantized)
        first = ours.quant_meta(ours.layout.weights[0])[0]  # [out, in], or [in, out] transposed
        call = getattr(ours.layout, "call", "routed")  # how the family calls its experts (experts/layouts.py)
        rows = 3 * ours.num_experts if call == "dense" else 12
        hidden = torch.randn(rows, first[0] if ours.layout.transposed else first[1], generator=generator)
        routable = getattr(ours, "total_experts", ours.num_experts)  # LongCat-Flash: its zero experts too
        index = torch.stack([torch.randperm(routable, generator=generator)[:2] for _ in range(12)])
        weights = torch.rand(12, 2, generator=generator)
        hidden = hidden.to(torch.bfloat16)
        # a dense call (Llama 4): every expert on its own 3 rows; else 12 tokens routed to 2 experts each
        args = (hidden, index, weights.to(torch.bfloat16))
        if call == "dense":
            args = (hidden,)
        elif call == "split":  # JetMoE: rows sorted by expert, how many per expert
            args = (hidden, [3, 0, 5, 4][: ours.num_experts])
        compute = ours.compute
        ours.compute = "loop"  # the reference path; grouped is compared with it below
        try:
            got = ours(*args).float()
        finally:
            ours.compute = compute
        want = stock(*args).float()
        scale = want.abs().max()
        assert scale > 0
        torch.testing.assert_close(got / scale, want / scale, rtol=2**-7, atol=2**-7, msg=name)


def _forward_backward(model, ids, compute: str):
    for module in model.modules():
        if isinstance(module, QuantizedExperts):
            module.compute = compute
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    dead = [n for n, p in params.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not dead, f"{len(dead)} of {len(params)} LoRA tensors without gradient ({compute}): {dead[:4]}"
    grads = {n: p.grad.float().clone() for n, p in params.items()}
    return out.logits.detach().float(), grads


def _check_grouped_equals_loop(model, ids) -> None:
    loop_logits, loop_grads = _forward_backward(model, ids, "loop")
    grouped_logits, grouped_grads = _forward_backward(model, ids, "grouped")  # "grouped": raises if it cannot
    scale = loop_logits.abs().max()
    torch.testing.assert_close(grouped_logits / scale, loop_logits / scale, **GROUPED, msg="logits")
    assert set(grouped_grads) == set(loop_grads)
    for name, grad in loop_grads.items():
        top = grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(grouped_grads[name] / top, grad / top, **GROUPED, msg=name)


def _check_one_step_moves_expert_lora(model, ids, quantized: dict) -> int:
    homes = tuple(f"base_model.model.{name}." for name in quantized)
    expert_lora = {n: p for n, p in model.named_parameters() if "lora_" in n and n.startswith(homes)}
    wanted = 2 * sum(len(q.layout.weights) for q in quantized.values())  # lora_A and lora_B per expert weight
    assert len(expert_lora) == wanted, (len(expert_lora), wanted, sorted(expert_lora)[:4])
    before = {n: p.detach().clone() for n, p in expert_lora.items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    still = [n for n, p in expert_lora.items() if torch.equal(p.detach(), before[n])]
    assert not still, f"{len(still)} of {len(expert_lora)} expert LoRA tensors did not move: {still[:3]}"
    return len(expert_lora)


def _check_doctor_plans_4bit_experts(path: Path, model) -> None:
    """The doctor plans the experts 4-bit, their packed bytes exactly those the loader holds."""
    from hf_fsdp_qlora.doctor.checks import diagnose
    from hf_fsdp_qlora.experts.quantized import packed_expert_bytes

    diag = diagnose(str(path), quantization="4bit", lora_dropout=0.0, lora_r=4, seq_len=128)
    assert not diag.errors, [f"[{f.id}] {f.message}" for f in diag.errors]
    planned = diag.plan.parameters
    packed = packed_expert_bytes(model)[1]
    assert packed <= planned["experts_bytes"] < planned["experts_bytes_16bit"] / 3, (packed, planned)


@torch.no_grad()
def _peft_merge_of(model, base32) -> dict:
    """peft's ``merge_and_unload`` on a copy of the float32 base carrying the trained model's adapter, tensor for
    tensor (peft builds the same module tree on the float experts). Not through the saved file: peft 0.21 runs an
    adapter's keys through transformers' checkpoint renamings on load, and Laguna's ``mlp.shared_expert.`` (an
    unescaped regex dot) also matches ``mlp.shared_experts`` - its shared-expert LoRA would load nowhere."""
    from types import SimpleNamespace

    from peft import get_peft_model

    from hf_fsdp_qlora.experts.targets import keep_linear_targets

    config = copy.deepcopy(model.peft_config["default"])
    with keep_linear_targets(SimpleNamespace(hf_fsdp_qlora_linear_targets=True)):
        oracle = get_peft_model(copy.deepcopy(base32), config)
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    params = {n: p for n, p in oracle.named_parameters() if "lora_" in n}
    assert set(params) == set(trained), sorted(set(params) ^ set(trained))[:4]
    for name, param in params.items():
        param.copy_(trained[name].float())
    return oracle.merge_and_unload().state_dict()


def _check_merge(path: Path, adapter: Path, out: Path, base32, ref: dict, expert_keys: list[str]) -> None:
    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    unchanged = [k for k in expert_keys if torch.equal(ref[k], base32.state_dict()[k])]
    assert not unchanged, f"peft's merge left expert weights unchanged: {unchanged[:3]}"
    fused = fused_experts(base32)  # DBRX: the checkpoint's names and shapes (mlp.w1 / v1 / w2); else none
    before = {key: value.to(torch.bfloat16) for key, value in to_stored(base32.state_dict(), fused).items()}
    merged = merge_adapters(path, adapter, out, progress=False)
    ours = _load16(merged, torch.bfloat16).state_dict()
    _compare(ours, to_stored(ref, fused), before, {})


# Families whose 4-bit experts are right but which fail elsewhere (tests/test_families.py OTHER_FAILURES says how).
OUTSIDE_EXPERTS: dict[str, str] = {}


def _family_param(family: str):
    reason = OUTSIDE_EXPERTS.get(family)
    return pytest.param(family, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


@pytest.mark.parametrize(
    "family", [_family_param(f) for f in [*decorated_families(), *NAMED_FAMILIES, *FUSED_FAMILIES]]
)
def test_declared_experts_quantize_train_and_merge(family, tmp_path):
    try:
        path = build(family, tmp_path / "base")
    except Exception as exc:  # noqa: BLE001 - the family sweep owns "not built" and lists the reason
        pytest.skip(f"not built by the generic shrink: {build_error(exc)}")
    base32 = _load16(path, torch.float32)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    if family in FUSED_FAMILIES:
        base32 = _fused_base(base32, ids)
    declared = _declared_experts(base32)
    if not declared:  # Gemma 4: experts only where the configuration enables them (its MoE checkpoints)
        pytest.skip("the family's default configuration holds no experts")
    model = load_qlora_model(str(path), dtype=torch.bfloat16, lora_config=_lora_config(path),
                             gradient_checkpointing=False)  # fmt: skip
    quantized = _quantized(model)
    assert set(quantized) == set(declared), "every declared experts module holds 4-bit experts by default"
    assert all(not any(p.is_floating_point() and p.dim() == 3 for p in q.parameters()) for q in quantized.values())
    _check_against_family_forward(quantized, base32)
    _check_doctor_plans_4bit_experts(path, model)
    model.train()
    _check_grouped_equals_loop(model, ids)
    _check_one_step_moves_expert_lora(model, ids, quantized)
    model.save_pretrained(tmp_path / "adapter")
    ref = _peft_merge_of(model, base32)
    del model
    expert_keys = [f"{name}.{w}" for name, m in quantized.items() for w in m.layout.weights]
    _check_merge(path, tmp_path / "adapter", tmp_path / "merged", base32, ref, expert_keys)


def _synthetic_experts(flags: dict):
    """A class transformers' decorator declares with `flags` (hidden 32, 4 experts of width 16), random weights."""
    from types import SimpleNamespace

    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(**flags)
    class SyntheticExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            gate, bias, transposed = (
                flags.get("has_gate", True),
                flags.get("has_bias", False),
                flags.get("is_transposed"),
            )
            first = ("gate_up_proj" if gate else "up_proj", 32 * (2 if gate else 1))

            def weight(out, inp):
                return torch.nn.Parameter(torch.randn(4, inp, out) if transposed else torch.randn(4, out, inp))

            self.num_experts = 4
            setattr(self, first[0], weight(first[1], 32))
            self.down_proj = weight(32, 32)
            if bias:
                setattr(self, f"{first[0]}_bias", torch.nn.Parameter(torch.randn(4, first[1])))
                self.down_proj_bias = torch.nn.Parameter(torch.randn(4, 32))
            self.act_fn = torch.nn.SiLU()
            if flags.get("has_post_expert_norm"):
                self.post_expert_norm = torch.nn.LayerNorm(32)
                torch.nn.init.normal_(self.post_expert_norm.weight)

        def forward(self, hidden_states, top_k_index, top_k_weights):  # only transformers' dispatch runs here
            raise NotImplementedError

    torch.manual_seed(0)
    return SyntheticExperts(SimpleNamespace(_experts_implementation="batched_mm"))


@pytest.mark.parametrize(
    "flags",
    [{"has_post_expert_norm": True}, {"has_gate": False}, {"is_transposed": True, "has_bias": True}],
    ids=["post_expert_norm", "no_gate", "transposed_bias"],
)
@pytest.mark.parametrize("compute", ["loop", "grouped"])
def test_declared_flags_against_transformers_dispatch(flags, compute):
    """Flags no causal-LM family here combines (a post-expert norm: transformers 5.24's MuseSpark) on a class the
    decorator declares: our 4-bit experts (loop and grouped) against transformers' own ``batched_mm`` forward
    (ExpertsInterface) on the dequantized weights."""
    from hf_fsdp_qlora.experts.quantized import quantize_experts

    stock = _synthetic_experts(flags)
    holder = torch.nn.ModuleDict({"experts": copy.deepcopy(stock)})
    assert quantize_experts(holder, dtype=torch.float32) == ["experts"]
    ours = holder["experts"]
    ours.compute = compute
    with torch.no_grad():
        for weight in ours.layout.weights:
            getattr(stock, weight).copy_(torch.stack([ours.dequantize_expert(weight, e) for e in range(4)]))
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 32, generator=generator)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=generator)
    with torch.no_grad():
        want = stock(hidden, index, weights)
        got = ours(hidden, index, weights)
    scale = want.abs().max()  # float32 sums met in another order: 1e-5 of the largest value (test_moe.py's bound)
    torch.testing.assert_close(got / scale, want / scale, rtol=1e-5, atol=1e-5)
