"""Streamed expert loading (hf_fsdp_qlora/experts/stream.py): experts from the files into 4 bits, one layer
at a time.

Oracle: today's path, transformers' own ``from_pretrained`` (every expert 16-bit) + ``quantize_experts``, on tiny
Qwen3-MoE and Mixtral checkpoints saved per expert (as ``save_pretrained`` writes them) and gpt-oss and Qwen3-MoE saved
fused. The 2-rank part (``low_cpu_ram=True``: rank 0 streams, the other receives packed bytes) runs in the suite's
shared FSDP1/FSDP2 launches (tests/test_moe.py, scenario ``moe_lowram``). trl's route (the launcher's
``from_pretrained`` hook, hf_fsdp_qlora/experts/script_stream.py): oracle, the same load where the stream does not
follow, packed by the launcher's peft hook as before; trl's sft.py itself runs in tests/test_moe.py. Host RAM:
benchmarks/moe_loading.py on a small synthetic checkpoint, each contestant in its own process (VmHWM, anonymous RSS
sampled).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from dist_utils import REPO
from tiny_models import MOE_ARCHS, build_tiny_model

from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.experts.quantized import QuantizedExperts, quantize_experts

# dbrx: 2-D expert stacks (mlp.w1 / v1 / w2) the loader fuses into transformers' layout (hf_fsdp_qlora/experts/dbrx.py)
CASES = [*MOE_ARCHS, "qwen3_moe_fused", "dbrx"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe_stream")
    found = {arch: build_tiny_model(root / arch, arch) for arch in MOE_ARCHS}
    fused = root / "qwen3_moe_fused"
    AutoModelForCausalLM.from_pretrained(found["qwen3_moe"]).save_pretrained(fused, save_original_format=False)
    found["qwen3_moe_fused"] = fused
    from family_build import build

    found["dbrx"] = build("dbrx", root / "dbrx")
    return found


def _bnb():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip


def _today(path, cls=None):
    """What load_qlora_model did before streaming: from_pretrained with every expert 16-bit, then packed."""
    from transformers import AutoModelForCausalLM

    cls = cls or AutoModelForCausalLM
    model = cls.from_pretrained(path, quantization_config=_bnb(), dtype=torch.bfloat16)
    quantize_experts(model, quant_type="nf4", double_quant=True, dtype=torch.bfloat16)
    return model


def _bytes(tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _lora(targets=("q_proj", "v_proj")):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))


# A caller's device map of one device streams as no map does (here the CPU): spread over the cases, no extra load.
ONE_DEVICE = {"qwen3_moe": {}, "mixtral": {"device_map": {"": "cpu"}}, "gpt_oss": {"device_map": "auto"},
              "qwen3_moe_fused": {"device_map": "cpu"}, "dbrx": {}}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_streamed_experts_equal_todays_bit_for_bit(checkpoints, case, caplog):
    """Every tensor of the base (packed experts, their constants, the linear layers' 4-bit bytes, the rest) equals
    today's path to the bit, and the logits are equal; the log says the experts were streamed. Loaded without a
    device_map and with the caller's maps of one device (ONE_DEVICE), which stream the same."""
    from peft import PeftModel

    from hf_fsdp_qlora.safetensors_io import checkpoint_shards, read_header

    path = checkpoints[case]
    names = [k for f in checkpoint_shards(path)[0] for k in read_header(path / f)[0]]
    per_expert = any(".experts.0." in k for k in names)
    assert per_expert == (case in ("qwen3_moe", "mixtral")), names[:8]  # the layouts the cases claim
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
        lora = _lora(["Wqkv"] if case == "dbrx" else ["q_proj", "v_proj"])
        streamed = load_qlora_model(str(path), lora_config=lora, gradient_checkpointing=False, **ONE_DEVICE[case])
    assert any("streamed the experts of 2 MoE layers" in r.message for r in caplog.records)
    assert isinstance(streamed, PeftModel)
    oracle = _today(path)
    ours = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in streamed.state_dict(keep_vars=True).items() if "lora_" not in k}  # fmt: skip
    theirs = oracle.state_dict(keep_vars=True)
    assert set(ours) == set(theirs)
    assert [k for k in theirs if not torch.equal(_bytes(ours[k]), _bytes(theirs[k]))] == []
    pairs = list(
        zip(*[[m for m in model.modules() if isinstance(m, QuantizedExperts)] for model in (streamed, oracle)])
    )
    assert len(pairs) == 2
    for mine, expected in pairs:
        assert mine._meta == expected._meta and mine.packed_bytes == expected.packed_bytes
        for (n, a), (m, b) in zip([*mine.named_parameters(), *mine.named_buffers()],
                                  [*expected.named_parameters(), *expected.named_buffers()]):  # fmt: skip
            assert n == m and torch.equal(_bytes(a), _bytes(b)), n
    ids = torch.randint(0, oracle.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    for model in (streamed, oracle):
        model.train()  # an eval-mode no_grad forward would repack the 4-bit weights for the CPU kernel (FACTS.md)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, oracle(input_ids=ids).logits)


@pytest.mark.parametrize("composite", [False, True])
def test_interleaved_experts_stream_equal_todays(tmp_path, caplog, composite):
    """Inkling 2's original format stores each expert's gate and up rows interleaved (`w13_weight`; transformers
    de-interleaves them on load): the stream reads them in the model's order, so the packed experts equal today's
    path (from_pretrained, then packed) to the bit, for the text model and the image-text class. Before, the plan
    refused the operation and loaded them 16-bit first."""
    from family_build import build
    from test_merge_moe import _inkling2_composite
    from transformers import Inkling2ForConditionalGeneration

    from hf_fsdp_qlora.safetensors_io import checkpoint_shards, read_header

    path = _inkling2_composite(tmp_path / "inkling2") if composite else build("inkling2_text", tmp_path / "inkling2")
    names = [k for f in checkpoint_shards(path)[0] for k in read_header(path / f)[0]]
    assert any(k.endswith("mlp.experts.w13_weight") for k in names)
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
        streamed = load_qlora_model(str(path), lora_config=_lora(), gradient_checkpointing=False)
    assert any("streamed the experts of" in r.message for r in caplog.records)
    oracle = _today(path, Inkling2ForConditionalGeneration if composite else None)
    pairs = list(
        zip(*[[m for m in model.modules() if isinstance(m, QuantizedExperts)] for model in (streamed, oracle)])
    )
    assert len(pairs) >= 2
    for mine, expected in pairs:
        assert mine._meta == expected._meta
        for (n, a), (m, b) in zip([*mine.named_parameters(), *mine.named_buffers()],
                                  [*expected.named_parameters(), *expected.named_buffers()]):  # fmt: skip
            assert n == m and torch.equal(_bytes(a), _bytes(b)), n


def test_a_checkpoint_the_plan_cannot_follow_loads_as_before(checkpoints, caplog):
    """A from_pretrained argument that changes which weights are read: not streamed, said once, the same bytes."""
    path = checkpoints["qwen3_moe"]
    with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
        model = load_qlora_model(str(path), lora_config=_lora(), gradient_checkpointing=False, use_safetensors=True)
    messages = [r.message for r in caplog.records]
    assert any("experts load in 16 bits before they are packed" in m and "use_safetensors" in m for m in messages)
    assert not any("streamed the experts" in m for m in messages)
    assert sum(isinstance(m, QuantizedExperts) for m in model.modules()) == 2


def test_stream_plan_maps_each_expert_slice(checkpoints):
    """The plan of a per-expert checkpoint: every expert's gate and up rows and down matrix, nothing else hidden."""
    from transformers import AutoConfig

    from hf_fsdp_qlora.experts.stream import plan_expert_stream

    path = checkpoints["qwen3_moe"]
    config = AutoConfig.from_pretrained(path)
    stream, reason = plan_expert_stream(path, config, torch.bfloat16, False, {})
    assert reason == "" and sorted(stream.modules) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    gate_up = stream.modules["model.layers.0.mlp.experts"]["gate_up_proj"]
    experts, width = config.num_experts, config.moe_intermediate_size
    assert len(gate_up) == 2 * experts
    assert {(s.expert, s.dim, s.start, s.stop) for s in gate_up if s.disk_key.endswith("up_proj.weight")
            and "gate" not in s.disk_key} == {(e, 0, width, 2 * width) for e in range(experts)}  # fmt: skip
    assert len(stream.entries) == 2 * 3 * experts and all(".experts." in k for k in stream.entries)
    assert plan_expert_stream(path, config, torch.bfloat16, False, {"key_mapping": {}})[0] is None
    assert plan_expert_stream("Qwen/Qwen3-30B-A3B", config, torch.bfloat16, False, {})[1].endswith("local folder")


def test_transformers_leaves_hidden_experts_unread(checkpoints):
    """Canary (hf_fsdp_qlora/_compat/transformers.py, experts_left_unread): within the context, from_pretrained
    reports no missing or unexpected key (the hidden expert tensors are never matched, so never read) and its weight
    initialisation skips the experts (their weights stay as allocated: untouched pages); outside, it initialises
    them again and the experts load as transformers loads them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp_qlora.experts.stream import experts_left_unread, plan_expert_stream

    path = checkpoints["qwen3_moe"]
    stream, _ = plan_expert_stream(path, AutoConfig.from_pretrained(path), torch.bfloat16, False, {})
    with experts_left_unread(stream) as kwargs:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True,
                                                           **kwargs)  # fmt: skip
        experts = model.model.layers[0].mlp.experts
        experts.gate_up_proj.data.fill_(1.0)
        model.initialize_weights()  # what from_pretrained runs for missing weights
        assert torch.all(experts.gate_up_proj == 1.0)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for cls in stream.classes:
        assert "_is_hf_initialized" not in cls.__dict__
    model._initialize_weights(experts)
    assert not torch.all(experts.gate_up_proj == 1.0)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert plain.model.layers[0].mlp.experts.gate_up_proj.count_nonzero() > 0


def _trl_load(path, **extra):
    """The base as trl's sft.py loads it (`--load_in_4bit --dtype bfloat16`): benchmarks/moe_loading.py's trl_base."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from moe_loading import trl_base

    return trl_base(path, **extra)


# The script device maps that put the model on one device (here the CPU), besides trl's own (None on the CPU), spread
# over the two cases: each is one more load.
ONE_DEVICE_MAPS = {"qwen3_moe": [{"": "cpu"}, "auto"], "gpt_oss": ["cpu"]}


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_script_from_pretrained_streams_what_the_peft_hook_packed(checkpoints, case, monkeypatch, caplog):
    """`-m hf_fsdp_qlora.run`'s from_pretrained hook (hf_fsdp_qlora/experts/script_stream.py), loaded as trl loads
    (device_map=None on the CPU) and with device maps of one device a script passes (`{"": "cpu"}`, `"cpu"`, and
    `"auto"`, which on a machine without an accelerator is the CPU): transformers leaves the experts unread and they
    stream into 4 bits before from_pretrained returns (the log says both). Oracle: the same load where the stream does
    not follow (use_safetensors=True: the 16-bit experts, packed by the peft hook at get_peft_model, as before this
    hook) - every tensor of the base equal to the bit, and the logits."""
    loads = {"oracle": {"use_safetensors": True}, "streamed": {}}
    loads.update({f"device_map={m!r}": {"device_map": m} for m in ONE_DEVICE_MAPS[case]})
    models, logs = _trl_peft_loads(checkpoints[case], loads, monkeypatch, caplog)
    oracle, theirs, base_keys = _oracle_of(models, logs)
    ids = torch.randint(0, oracle.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = _train_mode_logits(oracle, ids)
    for name, model in models.items():
        _assert_streamed_equal(name, model, logs[name], theirs, base_keys)
        assert torch.equal(_train_mode_logits(model, ids), expected), name


def _trl_peft_loads(path, loads: dict, monkeypatch, caplog):
    """Under the launcher's hooks: each of `loads` (name -> extra from_pretrained kwargs) loaded as trl loads, then
    get_peft_model; ({name: model}, {name: its log})."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTuner
    from transformers import PreTrainedModel

    from hf_fsdp_qlora.experts.lora import quantize_experts_before_peft
    from hf_fsdp_qlora.train.launcher import QUANTIZE_EXPERTS_ENV

    monkeypatch.setattr(BaseTuner, "inject_adapter", BaseTuner.inject_adapter)  # both hooks restored afterwards
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"])
    quantize_experts_before_peft(QUANTIZE_EXPERTS_ENV)  # what the launcher installs
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    models, logs = {}, {}
    for name, extra in loads.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
            base = _trl_load(path, **extra)
            experts = [type(m).__name__ for m in base.modules() if type(m).__name__.endswith("Experts")]
            torch.manual_seed(0)
            models[name] = get_peft_model(base, lora)
        logs[name] = [r.message for r in caplog.records]
        assert len(experts) == 2 and (experts[0] == "QuantizedExperts") == (name != "oracle"), (name, experts)
    return models, logs


def _oracle_of(models: dict, logs: dict):
    """The load the stream did not follow (popped from `models`), its state dict and its base's keys."""
    assert any("16 bits before they are packed" in m and "use_safetensors" in m for m in logs["oracle"])
    oracle = models.pop("oracle")
    theirs = oracle.state_dict(keep_vars=True)
    base_keys = [k for k in theirs if "lora_" not in k]
    assert len(base_keys) > 20
    return oracle, theirs, base_keys


def _assert_streamed_equal(name, model, log, theirs, base_keys):
    assert any("from_pretrained leaves the experts of 2 MoE layers unread" in m for m in log), name
    assert any("streamed the experts of 2 MoE layers" in m for m in log), name
    assert not any("quantized the experts" in m or "16 bits before" in m for m in log), log
    ours = model.state_dict(keep_vars=True)
    assert set(ours) == set(theirs)
    assert [k for k in base_keys if not torch.equal(_bytes(ours[k]), _bytes(theirs[k]))] == [], name


def test_script_from_pretrained_streams_a_stock_4bit_checkpoint_with_its_quantization(
    checkpoints, tmp_path, monkeypatch, caplog
):
    """A stock 4-bit MoE checkpoint (packed linear layers, 16-bit experts; saved FP4 without double quant) loaded as
    trl loads it (asking NF4): on the CPU its experts stream with the checkpoint's own quantization, which transformers
    loads with whatever the script passes; oracle: the fallback load packed by the peft hook, every tensor of the base
    equal to the bit. On a GPU it streams too: the experts modules on the CPU beside the GPU, which transformers'
    bitsandbytes check (run here on the map built for this checkpoint) accepts only with CPU offload allowed in the
    checkpoint's own quantization_config - so the plan passes a copy of the config that allows it (the script's
    BitsAndBytesConfig is ignored by transformers). CUDA is mocked there (torch.cuda.is_available/device_count/
    current_device): this machine has none, and the decision is taken before anything touches a GPU."""
    from tiny_models import build_prequantized
    from transformers import Qwen3MoeForCausalLM

    from hf_fsdp_qlora.experts import script_stream as _script_stream

    path = build_prequantized(tmp_path / "bnb4", "fp4", False, source=checkpoints["qwen3_moe"])
    models, logs = _trl_peft_loads(path, {"oracle": {"use_safetensors": True}, "streamed": {}}, monkeypatch, caplog)
    _, theirs, base_keys = _oracle_of(models, logs)
    _assert_streamed_equal("streamed", models["streamed"], logs["streamed"], theirs, base_keys)
    experts = [m for m in models["streamed"].modules() if isinstance(m, QuantizedExperts)]
    assert [(m.quant_type, m.gate_up_proj_absmax.dtype) for m in experts] == [("fp4", torch.float32)] * 2
    _mock_cuda(monkeypatch, 1)
    kwargs = {"quantization_config": _bnb(), "use_cache": False}
    stream, placement, device = _script_stream._plan(Qwen3MoeForCausalLM, str(path), kwargs)
    assert device == 0 and sorted(stream.modules) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert set(placement) == {"device_map", "config"}
    assert_transformers_accepts_the_placement(path, placement, {"use_cache": False})
    load = _qlora_placement(path, use_cache=False)  # load_qlora_model's, on the same mocked GPU
    assert load.experts_device == 0 and load.quantization_config is None and load.streamed is not None
    assert set(load.placed) == {"device_map", "config"} and load.from_pretrained_kwargs["device_map"] == placement[
        "device_map"]  # fmt: skip
    assert_transformers_accepts_the_placement(path, {k: load.from_pretrained_kwargs[k] for k in load.placed}, {})
    assert not load.from_pretrained_kwargs["config"].use_cache
    # A config of the caller's (what transformers then loads with): the placement's copy is made of it, the caller's
    # object is left as it was; before, such a load put the 16-bit experts on the GPU.
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(path, output_router_logits=True)
    load = _qlora_placement(path, config=theirs)
    assert load.streamed is not None and set(load.placed) == {"device_map", "config"}
    placed = load.from_pretrained_kwargs["config"]
    assert placed is not theirs and placed.output_router_logits
    assert not theirs.quantization_config.get("llm_int8_enable_fp32_cpu_offload")  # theirs as it was
    assert_transformers_accepts_the_placement(path, {k: load.from_pretrained_kwargs[k] for k in load.placed}, {})


def _qlora_placement(path, **from_pretrained_kwargs):
    """load_qlora_model's steps up to the stream plan (nothing is loaded): where the load goes, what streams."""
    from hf_fsdp_qlora.loading import qlora

    load = qlora._Load(
        source=str(path),
        dtype=torch.bfloat16,
        bits=4,
        quant_type="nf4",
        double_quant=True,
        quantize_experts=True,
        trust_remote_code=False,
        from_pretrained_kwargs=from_pretrained_kwargs,
    )
    for step in (qlora._read_config, qlora._read_checkpoint_quantization, qlora._decide_quantization,
                 qlora._place_experts, qlora._plan_expert_stream):  # fmt: skip
        step(load)
    return load


def _mock_cuda(monkeypatch, gpus: int, current: int = 0):
    """CUDA mocked (this machine has none): only the placement decision and transformers' checks of it run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def assert_transformers_accepts_the_placement(path, placement: dict, user_kwargs: dict):
    """transformers' own quantizer check (get_hf_quantizer -> bitsandbytes' validate_environment, CUDA mocked by the
    caller) accepts the placement built for the pre-quantized checkpoint at `path`, and still refuses the same map
    with the checkpoint's own config (a canary: were it accepted one day, the config copy would be unneeded); the
    copy keeps the checkpoint's quantization and takes the caller's config fields, the checkpoint's config is not
    changed."""
    from transformers import AutoConfig
    from transformers.quantizers.auto import get_hf_quantizer

    from hf_fsdp_qlora.experts.placement import placed_kwargs

    merged = placed_kwargs(dict(user_kwargs, dtype=torch.bfloat16), placement)
    assert not set(user_kwargs) & set(merged) and merged["dtype"] == torch.bfloat16
    config = merged["config"]
    assert all(getattr(config, k) == v for k, v in user_kwargs.items())
    saved = AutoConfig.from_pretrained(path).quantization_config
    assert {**saved, "llm_int8_enable_fp32_cpu_offload": True} == config.quantization_config
    quantizer, _, device_map = get_hf_quantizer(config, _bnb(), placement["device_map"], True, {})
    assert quantizer.quantization_config.llm_int8_enable_fp32_cpu_offload and device_map == placement["device_map"]
    assert quantizer.quantization_config.bnb_4bit_quant_type == saved["bnb_4bit_quant_type"]
    with pytest.raises(ValueError, match="Some modules are dispatched on the CPU"):
        get_hf_quantizer(AutoConfig.from_pretrained(path), _bnb(), placement["device_map"], True, {})
    # The offload flag also keeps the "cpu" modules out of the conversion: they are the experts, which hold no linear
    # layer, so the same layers become 4-bit as with the whole model on the GPU (transformers' own preprocessing).
    whole, _, _ = get_hf_quantizer(AutoConfig.from_pretrained(path), _bnb(), {"": 0}, True, {})
    assert _packed_layers(quantizer, config, device_map) == _packed_layers(whole, AutoConfig.from_pretrained(path), {
        "": 0}) != []  # fmt: skip


def _packed_layers(quantizer, config, device_map) -> list[str]:
    """The layers transformers' quantizer turns into bitsandbytes 4-bit layers in a meta model under `device_map`."""
    import bitsandbytes as bnb

    from hf_fsdp_qlora.experts.placement import _meta_model

    model = _meta_model(config, torch.bfloat16, False)
    quantizer.preprocess_model(model=model, dtype=torch.bfloat16, device_map=device_map, checkpoint_files=None)
    return [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]


@torch.no_grad()
def _train_mode_logits(model, ids):
    model.train()  # an eval-mode no_grad forward would repack the 4-bit weights for the CPU kernel (FACTS.md)
    return model(input_ids=ids).logits


def test_script_device_map_of_one_gpu_streams_onto_it(checkpoints, monkeypatch, caplog):
    """Which script device maps stream on a GPU (the hook's plan, hf_fsdp_qlora/experts/script_stream.py). CUDA is
    mocked (torch.cuda.is_available/device_count/current_device): this machine has none, and the decision is taken
    before anything touches a GPU. A map that puts the model on one CUDA device gets load_qlora_model's placement
    there - every experts module of the meta model on "cpu", everything else on that device (each parameter under one
    key), CPU offload allowed in a copy of the quantization config - and the experts are packed onto that device.
    "auto" is device 0 with one visible GPU, the CPU with none; with two it falls back, saying why in one log line, as
    a per-module map and "auto" with max_memory do."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from hf_fsdp_qlora.experts import script_stream as _script_stream
    from hf_fsdp_qlora.experts.placement import _meta_model

    path, quant = checkpoints["qwen3_moe"], _bnb()
    meta = _meta_model(AutoConfig.from_pretrained(path), torch.bfloat16, False)
    experts = {n for n, m in meta.named_modules() if type(m).__name__.endswith("Experts")}
    assert len(experts) == 2

    def plan(device_map, gpus, **extra):
        _mock_cuda(monkeypatch, gpus, current=max(gpus - 1, 0))  # "auto" must pick device 0 itself
        kwargs = {"quantization_config": quant, "dtype": torch.bfloat16, "device_map": device_map, **extra}
        return _script_stream._plan(Qwen3MoeForCausalLM, str(path), kwargs)

    for device_map, gpus, want in (({"": 0}, 2, 0), ("cuda:1", 2, 1), (0, 1, 0), ("auto", 1, 0), (None, 2, 1),
                                   (torch.device("cuda", 1), 2, 1)):  # fmt: skip
        stream, placement, device = plan(device_map, gpus)
        assert device == want and sorted(stream.modules) == sorted(experts), device_map
        placed = placement["device_map"]
        assert {k for k, v in placed.items() if v == "cpu"} == experts and set(placed.values()) == {"cpu", want}
        for name, _ in meta.named_parameters():
            assert sum(name == k or name.startswith(f"{k}.") for k in placed) == 1, (device_map, name)
        assert placement["quantization_config"].llm_int8_enable_fp32_cpu_offload
    assert not quant.llm_int8_enable_fp32_cpu_offload
    assert plan("auto", 0)[1:] == ({"device_map": {"": "cpu"}}, None)
    for device_map, gpus, extra, why in (
        ("auto", 2, {}, "device_map='auto' spreads the model over the 2 visible GPUs"),
        ({"model": 0, "lm_head": "cpu"}, 1, {}, "device_map places modules one by one (2 entries)"),
        ("sequential", 1, {"max_memory": {0: "10GiB"}}, "device_map='sequential' with max_memory"),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
            assert plan(device_map, gpus, **extra) is None
        said = [r.message for r in caplog.records]
        assert len(said) == 1 and "experts load in 16 bits before they are packed" in said[0] and why in said[0], said


def test_load_qlora_model_device_map_of_one_device_streams(checkpoints, monkeypatch, caplog):
    """load_qlora_model with a device_map of the caller's (its steps up to the stream plan; nothing is loaded). CUDA
    is mocked (torch.cuda.is_available/device_count/current_device): this machine has none, and the decision is taken
    before anything touches a GPU. A map that puts the whole model on one CUDA device gets the placement of no map on
    that GPU (experts modules on "cpu", the rest on it, CPU offload allowed in a copy of the quantization config) and
    the experts stream onto it; one on the CPU is kept and streams there (real loads: the bit-for-bit test above);
    several devices or a per-module map are left to transformers, and the stream plan says why in one log line."""
    path = checkpoints["qwen3_moe"]
    for device_map, gpus, want in (({"": 0}, 2, 0), ("cuda:1", 2, 1), (1, 2, 1), ("auto", 1, 0)):
        _mock_cuda(monkeypatch, gpus, current=gpus - 1)
        load = _qlora_placement(path, device_map=device_map)
        placed = load.from_pretrained_kwargs["device_map"]
        assert load.experts_device == want and load.streamed is not None and load.streamed.device == want
        assert set(placed.values()) == {"cpu", want} and sorted(k for k, v in placed.items() if v == "cpu") == sorted(
            load.streamed.stream.modules)  # fmt: skip
        assert load.quantization_config.llm_int8_enable_fp32_cpu_offload
    for device_map, gpus in (({"": "cpu"}, 1), ("cpu", 1), ("auto", 0)):
        _mock_cuda(monkeypatch, gpus)
        load = _qlora_placement(path, device_map=device_map)
        assert load.from_pretrained_kwargs == {"device_map": device_map} and load.experts_device is None
        assert load.streamed is not None and not load.quantization_config.llm_int8_enable_fp32_cpu_offload
    for device_map, gpus in (({"model": 0, "lm_head": 0}, 1), ("auto", 2)):
        _mock_cuda(monkeypatch, gpus)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_fsdp_qlora"):
            load = _qlora_placement(path, device_map=device_map)
        assert load.from_pretrained_kwargs == {"device_map": device_map} and load.streamed is None
        said = [r.message for r in caplog.records]
        assert len(said) == 1 and "16 bits before they are packed" in said[0] and "device_map" in said[0], said


def test_host_ram_bounded_and_below_todays(tmp_path):
    """benchmarks/moe_loading.py on its "test" checkpoint (4 layers of 32 experts, 201 MB of bf16 experts), each
    contestant in its own process (anonymous RSS sampled, VmHWM), for load_qlora_model and for trl's route (trl's own
    from_pretrained call under `python -m hf_fsdp_qlora.run`, then get_peft_model): the streamed load adds at most the
    4-bit model + one layer's 16-bit experts (+64 MB of slack for the imports a load does, 128 MB on trl's route) to
    the runtime's; the load it replaces (all experts 16-bit, then packed) adds at least the 16-bit experts the stream
    never holds more; peak RSS within 1.3x of the doctor's bound; equal packed experts (the benchmark fails
    otherwise)."""
    # A load's RSS growth at this size moves by up to ~80 MB run to run under a busy machine (allocator reuse, lazy
    # imports: measured streamed 137-217 MB, today 258-342 MB): a failing first measurement is taken again and each
    # contestant's smaller growth counts (noise only adds bytes).
    runs = [_moe_loading_run(tmp_path / "first")]
    try:
        _check_host_ram(*runs[0])
    except AssertionError:
        runs.append(_moe_loading_run(tmp_path / "again"))
        (run, bound), (again, _) = runs
        best = {name: min((run[name], again[name]), key=lambda r: r["peak_anon"] - r["runtime_anon"]) for name in run}
        _check_host_ram(best, bound)


def _moe_loading_run(keep):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_loading.py"), "--shape", "test", "--ranks",
                           "1", "--json", "--keep", str(keep)], check=False, capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(REPO))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout[proc.stdout.index("\n{\n") :])
    return result["runs"]["1_process"], result["planned_bound"]


def _check_host_ram(run, planned_bound):
    assert sorted(run) == ["streamed", "today", "trl", "trl_today"]
    layer16 = 32 * 3 * 512 * 512 * 2
    experts16 = 4 * layer16
    grew = {name: row["peak_anon"] - row["runtime_anon"] for name, row in run.items()}
    # Slack for what a load imports and builds besides weights: trl's route (its create_model_from_path, the
    # launcher's hooks) measured 40-65 MB above load_qlora_model's on this checkpoint, run to run.
    for ours, before, slack in (("streamed", "today", 64), ("trl", "trl_today", 128)):
        assert run[ours]["experts_digest"] == run[before]["experts_digest"] and run[ours]["quantized_experts"] == 4
        four_bit = run[ours]["packed_expert_bytes"] * 1.1 + 30 * 2**20  # constants, 4-bit linear layers, embeddings
        assert grew[ours] <= four_bit + layer16 + slack * 2**20, (ours, grew)
        assert grew[before] - grew[ours] >= 0.8 * (experts16 - layer16 - four_bit), (ours, grew)
        assert run[ours]["peak_rss"] <= planned_bound * 1.3, (ours, run[ours]["peak_rss"])
