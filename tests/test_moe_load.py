"""Loading an MoE model on a GPU without its 16-bit experts on the GPU (hf_fsdp_qlora/experts/placement.py).

No GPU here: the device map is built on real configs with ``torch.cuda`` mocked (the only mock; it is what makes
the loader pick a GPU), the quantize-onto-a-device path runs with "cpu" as the target, and the dispatch cleanup runs
on a real 4-bit load with the per-module map on the CPU, the GPU dispatch's offload of the experts re-created with
accelerate's own hooks (with a GPU main device, ``dispatch_model`` offloads the "cpu" modules the same way), and
accelerate's real ``dispatch_model`` runs with "meta" standing in for the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import MOE_ARCHS, build_tiny_model

DATA = Path(__file__).parent / "data"
PUBLISHED = ["qwen3_30b_a3b_config.json", "mixtral_8x7b_config.json", "qwen3_235b_a22b_config.json"]


def _bnb(**kw):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_quant_storage=torch.bfloat16, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_load")
    return {arch: build_tiny_model(root / arch, arch) for arch in MOE_ARCHS}


def _config(source, tiny_moe):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_moe[source] if source in tiny_moe else DATA / source)


@pytest.mark.parametrize("source", [*MOE_ARCHS, *PUBLISHED])
def test_device_map_puts_every_experts_module_on_cpu(source, tiny_moe, monkeypatch):
    """With CUDA (mocked: torch.cuda only), every fused experts module maps to "cpu" and everything else to the GPU
    bitsandbytes would use; accelerate accepts the map, transformers' own expansion of it sends exactly the expert
    weights to the CPU, and no key is an ancestor of an experts module (a dispatch hook there would move them)."""
    from accelerate.utils.modeling import check_device_map
    from transformers import AutoModelForCausalLM
    from transformers.integrations.accelerate import expand_device_map

    from hf_fsdp_qlora.doctor import model_shape
    from hf_fsdp_qlora.experts.placement import experts_on_cpu_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    config, quant = _config(source, tiny_moe), _bnb()
    kwargs = experts_on_cpu_kwargs(config, quant, torch.bfloat16)
    device_map = kwargs["device_map"]
    assert set(device_map.values()) == {3, "cpu"}
    assert (
        kwargs["quantization_config"].llm_int8_enable_fp32_cpu_offload and not quant.llm_int8_enable_fp32_cpu_offload
    )
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    # by the flags transformers' use_experts_implementation sets, not our lookup
    oracle = [n for n, m in meta.named_modules() if getattr(m, "has_gate", None) is not None]
    assert [n for n, d in device_map.items() if d == "cpu"] == oracle
    assert len(oracle) == len(model_shape(config).moe_layers) > 0
    assert not [k for k in device_map if any(e.startswith(f"{k}.") for e in oracle)] and "" not in device_map
    check_device_map(meta, device_map)  # every parameter covered
    expanded = expand_device_map(device_map, [n for n, _ in meta.named_parameters()])
    on_cpu = {n for n, d in expanded.items() if d == "cpu"}
    assert on_cpu == {n for n, p in meta.named_parameters() if p.dim() == 3 or ".experts." in n and "shared" not in n}
    assert set(expanded.values()) == {3, "cpu"}
    # No GPU, or a dense model: nothing changes.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert experts_on_cpu_kwargs(config, quant, torch.bfloat16) == {}
    assert experts_on_cpu_kwargs(_config("llama3_1_70b_config.json", {}), quant, torch.bfloat16, device=0) == {}


def test_dispatch_keeps_the_experts_off_the_gpu(tiny_moe):
    """accelerate's real dispatch_model with the map, the "meta" device standing in for the GPU (the same code path
    as "cuda:0"; a tensor moved there loses its data, so every move shows): the experts are offloaded, never moved,
    and the release brings back their own 16-bit weights on the CPU. A map with ``""`` on the GPU (what the
    quantizer uses by default) would move them onto it first, and the release would refuse."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.experts.placement import experts_device_map, release_experts_dispatch

    for good in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_moe["qwen3_moe"], dtype=torch.bfloat16)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
        device_map = experts_device_map(model, "meta")
        if not good:
            device_map = {"": "meta", **{k: v for k, v in device_map.items() if v == "cpu"}}
        dispatch_model(model, device_map=device_map, main_device="meta")
        model.hf_device_map = dict(device_map)
        assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
        if not good:
            with pytest.raises(RuntimeError, match="meta device"):
                release_experts_dispatch(model)
            continue
        assert release_experts_dispatch(model)
        after = dict(model.named_parameters())
        assert all(torch.equal(after[n], t) and after[n].device.type == "cpu" for n, t in before.items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_quantize_onto_a_target_device_is_bit_identical(arch, tiny_moe):
    """QuantizedExperts with an explicit target device ("cpu" here; a GPU in a real load) packs each expert exactly
    as bitsandbytes' quantize_4bit of that expert's weight does (oracle), and as without a target device."""
    from bitsandbytes.functional import quantize_4bit
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.experts.quantized import QuantizedExperts, expert_layout

    model = AutoModelForCausalLM.from_pretrained(tiny_moe[arch], dtype=torch.bfloat16)
    experts = next(m for m in model.modules() if expert_layout(m) is not None)
    layout = expert_layout(experts)
    kw = {"quant_type": "nf4", "double_quant": True, "dtype": torch.bfloat16}
    targeted = QuantizedExperts(experts, layout, device="cpu", **kw)
    default = QuantizedExperts(experts, layout, **kw)
    for name in layout.weights:
        weight = getattr(experts, name).detach()
        for e in (0, weight.shape[0] - 1):
            data, state = quantize_4bit(weight[e].contiguous(), compress_statistics=True, quant_type="nf4",
                                        quant_storage=torch.bfloat16)  # fmt: skip
            packed = getattr(targeted, f"{name}_4bit")[e]
            assert torch.equal(packed.view(torch.uint8), data.reshape(-1).view(torch.uint8))
            assert torch.equal(getattr(targeted, f"{name}_absmax")[e], state.absmax)
            assert torch.equal(getattr(targeted, f"{name}_absmax2")[e], state.state2.absmax)
    for key, tensor in default.state_dict(keep_vars=True).items():
        assert torch.equal(tensor.view(torch.uint8), targeted.state_dict()[key].view(torch.uint8)), key
    for key, buffer in default.named_buffers():
        assert torch.equal(buffer, dict(targeted.named_buffers())[key]), key
    assert all(p.device.type == "cpu" for p in targeted.parameters())


def test_release_experts_dispatch_after_a_real_load(tiny_moe):
    """A real 4-bit load with the experts map ("cpu" for the rest too: the only device here), dispatched as
    transformers does for a GPU + "cpu" map (accelerate hooks, the experts offloaded to meta behind a CPU weights
    map, ``hf_device_map``, ``model.to`` wrapped): the release leaves no hook, no ``hf_device_map`` and the experts'
    own 16-bit weights, and the 4-bit model then equals a plain load's (logits bit for bit)."""
    from accelerate import cpu_offload, dispatch_model
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.experts.placement import experts_device_map, experts_on_cpu_kwargs, release_experts_dispatch
    from hf_fsdp_qlora.experts.quantized import quantize_experts

    path = tiny_moe["qwen3_moe"]
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=_bnb())
    kwargs = experts_on_cpu_kwargs(_config("qwen3_moe", tiny_moe), _bnb(), torch.bfloat16, device="cpu")
    # With the flag, bitsandbytes skips every "cpu" entry, here all of them (on a GPU only the experts): the GPU needs
    # it to accept the map, an all-"cpu" map does not.
    kwargs["quantization_config"].llm_int8_enable_fp32_cpu_offload = False
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    assert model.is_loaded_in_4bit and "Linear4bit" in type(model.model.layers[0].self_attn.q_proj).__name__
    experts = [n for n, d in kwargs["device_map"].items() if d == "cpu" and ".experts" in n]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    assert release_experts_dispatch(model) is False  # one device: transformers dispatched nothing
    dispatch_model(model, device_map=kwargs["device_map"], main_device="cpu", force_hooks=True)
    for name in experts:  # what dispatch_model does to "cpu" modules when the main device is a GPU
        cpu_offload(model.get_submodule(name), execution_device="cpu")
    assert model.get_submodule(experts[0]).gate_up_proj.device.type == "meta" and "to" in model.__dict__
    assert set(model.hf_device_map.values()) == {"cpu"}
    model.hf_device_map = experts_device_map(model, 0)  # what a GPU load records (here every device is "cpu")

    assert release_experts_dispatch(model) is True
    assert not model.config.quantization_config.llm_int8_enable_fp32_cpu_offload
    assert not hasattr(model, "hf_device_map") and "to" not in model.__dict__
    assert not [n for n, m in model.named_modules() if {"_hf_hook", "_old_forward", "forward"} & set(vars(m))]
    model.config.quantization_config.llm_int8_enable_fp32_cpu_offload = True  # as after a GPU load
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) and after[n].device.type == "cpu" for n, t in before.items())

    quantize_experts(model, dtype=torch.bfloat16, device="cpu")
    quantize_experts(plain, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for m in (model, plain):
        m.train()  # eval + no_grad would repack 4-bit weights for the CPU kernel (FACTS.md)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_release_leaves_other_device_maps_alone(tiny_moe):
    """A device map that is not ours (a user's own, non-expert module on "cpu") is not touched."""
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora.experts.placement import release_experts_dispatch

    model = AutoModelForCausalLM.from_pretrained(tiny_moe["qwen3_moe"], dtype=torch.bfloat16)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0.self_attn": "cpu"}
    assert release_experts_dispatch(model) is False and model.hf_device_map


def test_experts_module_alone_makes_peft_adapt_4bit_experts():
    """In a fresh process that imports only ``hf_fsdp_qlora.experts.quantized`` (never experts.lora by name), the first
    4-bit experts module built installs the peft hook (experts.ON_BUILD, registered by experts/lora.py through
    experts/__init__.py): peft's own loaders then adapt 4-bit experts, as docs/moe.md says after quantize_experts."""
    import subprocess
    import sys

    probe = (
        "import torch\n"
        "from peft.tuners.tuners_utils import BaseTuner\n"
        "from transformers import AutoModelForCausalLM, Qwen3MoeConfig\n"
        "from hf_fsdp_qlora.experts.quantized import quantize_experts\n"
        "config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)\n"
        "model = AutoModelForCausalLM.from_config(config)\n"
        "before = hasattr(BaseTuner.inject_adapter, 'hf_fsdp_qlora_experts')\n"
        "assert quantize_experts(model, dtype=torch.float32)\n"
        "print(before, hasattr(BaseTuner.inject_adapter, 'hf_fsdp_qlora_experts'))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout
