"""On a CUDA GPU: the paths CPU CI cannot run (bnb CUDA kernels, NCCL, `merge-adapters --device cuda`).

Skipped where no CUDA device is visible (CI has none); run on a GPU machine with `pytest -m cuda`.
Each test compares against an oracle: the CPU merge and peft's own merge for `--device cuda`, the loss
curve and FSDP engagement printed by the example for the NCCL launches.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from dist_utils import REPO, _env, free_port
from test_merge import (
    _build,
    assert_within_one_rounding,
    load_base_tensor,
    make_adapter,
    peft_merged,
    read_output,
)
from tiny_models import tiny_config

from hf_fsdp_qlora.merge.pipeline import merge_adapters

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine: pytest -m cuda)"
    ),
]

MERGE_SCENARIOS = {
    "all_linear": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "rslora_patterns": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"v_proj": 8},
        "alpha_pattern": {"q_proj": 32},
    },
    "modules_to_save": {"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "dora": {"r": 4, "target_modules": ["q_proj", "gate_proj"], "use_dora": True},
}


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("base") / "llama", tiny_config("llama"), max_shard_size="100KB")


@pytest.mark.parametrize("name", list(MERGE_SCENARIOS))
def test_merge_on_cuda_equals_cpu_merge_and_peft(llama_base, tmp_path, name):
    """Every tensor of a `device="cuda"` merge: within one bf16 rounding of the CPU merge and of peft's."""
    adapter = make_adapter(llama_base, tmp_path / "adapter", **MERGE_SCENARIOS[name])
    on_cpu = read_output(merge_adapters(llama_base, adapter, tmp_path / "cpu", device="cpu", progress=False))
    on_gpu = read_output(merge_adapters(llama_base, adapter, tmp_path / "cuda", device="cuda", progress=False))
    ref = peft_merged(llama_base, adapter)
    assert set(on_gpu) == set(on_cpu)
    changed = 0
    for key, tensor in on_gpu.items():
        assert tensor.device.type == "cpu"
        assert_within_one_rounding(tensor, on_cpu[key], key)
        assert_within_one_rounding(tensor, ref[key], key)
        changed += not torch.equal(tensor, load_base_tensor(llama_base, key))
    assert changed > 0


def test_dequantized_merge_on_cuda_uses_the_cuda_kernels_and_matches_cpu(llama_base, tmp_path):
    """`dequantize="nf4"` on CUDA quantizes with bnb's CUDA kernels: the same 4-bit round trip as on CPU."""
    adapter = make_adapter(llama_base, tmp_path / "adapter", r=4, target_modules=["q_proj", "down_proj"])
    kwargs = {"dequantize": "nf4", "double_quant": True, "progress": False}
    on_cpu = read_output(merge_adapters(llama_base, adapter, tmp_path / "cpu", device="cpu", **kwargs))
    on_gpu = read_output(merge_adapters(llama_base, adapter, tmp_path / "cuda", device="cuda", **kwargs))
    untargeted = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(on_gpu[untargeted], on_cpu[untargeted])  # pure quantize/dequantize: bit for bit
    assert not torch.equal(on_gpu[untargeted], load_base_tensor(llama_base, untargeted))
    for key, tensor in on_gpu.items():
        assert_within_one_rounding(tensor, on_cpu[key], key)


def _launch(config: str, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`accelerate launch` with one process per visible GPU (NCCL), as a user launches on a GPU machine."""
    nproc = torch.cuda.device_count()
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / config),
        "--num_processes", str(nproc), "--main_process_port", str(free_port()), str(REPO / script), *args,
    ]  # fmt: skip
    env = _env({"OMP_NUM_THREADS": "4"})
    env.pop("CUDA_VISIBLE_DEVICES", None) if nproc > 1 else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "tiny-llama"
    data = REPO / "examples" / "data" / "capitals.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "build_tiny_model.py"), "--data", str(data), "--output", str(out)],
        check=True, capture_output=True, timeout=300, env=_env(),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("config", ["fsdp2_qlora.yaml", "fsdp1_qlora.yaml", "fsdp2_qlora_offload.yaml"])
def test_shipped_gpu_config_trains_and_merges_on_cuda(demo_model, tmp_path, config):
    """The shipped GPU config + examples/train_qlora.py on NCCL: FSDP engaged, the loss falls, and the
    adapter merged with `merge-adapters --device cuda` reproduces base+adapter (examples/check_merged.py)."""
    data = REPO / "examples" / "data" / "capitals.jsonl"
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    proc = _launch(config, "examples/train_qlora.py", "--model", str(demo_model), "--data", str(data),
                   "--output", str(adapter), "--epochs", "8")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    engaged = re.search(r"FSDP engaged: (\{.*\})", proc.stdout)
    assert engaged, proc.stdout[-3000:]
    counts = {k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", engaged.group(1))}
    assert (counts["fsdp2_modules"] if "fsdp2" in config else counts["flat_params"]) > 0, counts
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first - 0.5, f"the loss did not fall: {first} -> {last}"
    assert (adapter / "adapter_model.safetensors").is_file()

    cmd = [sys.executable, "-m", "hf_fsdp_qlora.cli", "merge", "--base", str(demo_model), "--adapter", str(adapter),
           "--output", str(merged), "--device", "cuda", "--no-progress"]  # fmt: skip
    merge = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=str(REPO))
    assert merge.returncode == 0, merge.stderr[-3000:]
    check = subprocess.run(
        [sys.executable, str(REPO / "examples" / "check_merged.py"), "--base", str(demo_model),
         "--adapter", str(adapter), "--merged", str(merged)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=str(REPO),
    )  # fmt: skip
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]
    diff, scale = map(float, re.search(r"max abs diff ([\d.e+-]+) \(logit scale ([\d.]+)\)", check.stdout).groups())
    assert diff < 0.02 * scale, check.stdout


def test_llamaguard_single_gpu_config_full_finetune(demo_model, tmp_path):
    """The shipped one-GPU full fine-tune config (FSDP2, CPU offload, activation checkpointing) with
    examples/safety_classifier.py: the loss falls and the saved model loads, with every weight trained."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "guard"
    proc = _launch("llamaguard3_1b_1x24gb.yaml", "examples/safety_classifier.py", "--model", str(demo_model),
                   "--data", str(REPO / "examples" / "data" / "safety.jsonl"), "--output", str(out),
                   "--full-finetune", "--epochs", "4")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [float(v) for v in re.findall(r"'loss': '([\d.]+)'", proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).state_dict()
    assert trained.keys() == base.keys()
    changed = [k for k in base if not torch.equal(trained[k], base[k])]
    assert len(changed) > len(base) // 2, f"only {len(changed)} of {len(base)} tensors changed"


def test_qlora_weights_on_gpu_have_one_dtype_and_match_cpu_quantization(demo_model):
    """`load_qlora_model` on CUDA: bf16 quant storage, bf16 adapters, and packed NF4 bytes equal to bnb's CPU
    quantization of the same weights (the CPU rehearsal quantizes exactly what a GPU run trains on)."""
    import bitsandbytes as bnb
    from peft import LoraConfig

    from hf_fsdp_qlora import load_qlora_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    gpu = load_qlora_model(str(demo_model), dtype="bfloat16", lora_config=lora, device_map={"": 0})
    cpu = load_qlora_model(str(demo_model), dtype="bfloat16", lora_config=lora, device_map={"": "cpu"})
    gpu_layers = {n: m for n, m in gpu.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    cpu_layers = {n: m for n, m in cpu.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert gpu_layers and gpu_layers.keys() == cpu_layers.keys()
    for name, layer in gpu_layers.items():
        assert layer.weight.device.type == "cuda" and layer.weight.dtype == torch.bfloat16, name
        assert torch.equal(layer.weight.data.cpu().view(torch.uint8), cpu_layers[name].weight.data.view(torch.uint8))
    assert {p.dtype for n, p in gpu.named_parameters() if p.requires_grad} == {torch.bfloat16}
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        logits = gpu(input_ids=ids.cuda()).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("prequantized", [False, True], ids=["16bit", "stock_4bit"])
def test_moe_experts_stream_onto_the_gpu(tmp_path, prequantized, monkeypatch, caplog):
    """Issue 40 on a GPU (run by the GPU check's tests_rest stage; on CPU the same loads are tests/test_moe_stream.py's,
    with CUDA mocked for the placement): a tiny Qwen3-MoE, 16-bit or a stock 4-bit save (FP4, packed linear layers,
    16-bit experts), loaded as trl's sft.py loads it under ``-m hf_fsdp_qlora.run`` (``device_map=None`` in a
    multi-GPU launch, ``"auto"`` in one process: both stream), and by ``load_qlora_model``. The experts modules load
    on the CPU and stream onto the GPU in 4 bits: every tensor of the model ends on the GPU, no 16-bit expert weight
    is left, the dispatch is released (no ``hf_device_map``, the offload flag cleared). Oracle: the load the stream
    does not follow (``use_safetensors=True``: the 16-bit experts packed on the GPU by the peft hook / the loader),
    every base tensor equal to the bit, and the logits."""
    from test_moe_stream import _bytes, _lora, _trl_peft_loads
    from tiny_models import build_prequantized, build_tiny_model

    from hf_fsdp_qlora import load_qlora_model
    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    path = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    if prequantized:
        path = build_prequantized(tmp_path / "bnb4", "fp4", False, source=path)
    loads = {"oracle": {"use_safetensors": True}, "none": {"device_map": None}, "auto": {}}
    # _trl_peft_loads asserts the streamed loads came back with 4-bit experts (streamed before peft), the oracle not
    models, _ = _trl_peft_loads(path, loads, monkeypatch, caplog)
    oracle = models.pop("oracle")
    theirs = oracle.state_dict(keep_vars=True)
    base_keys = [k for k in theirs if "lora_" not in k]
    for name, model in models.items():
        ours = model.state_dict(keep_vars=True)
        assert set(ours) == set(theirs), name
        assert [k for k in base_keys if not torch.equal(_bytes(ours[k]), _bytes(theirs[k]))] == [], name
    kinds = {"none": "trl, device_map=None", "auto": "trl, device_map='auto'"}
    ids = torch.randint(0, oracle.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = oracle(input_ids=ids).logits
    loader = {k: {"use_safetensors": True} if k == "oracle" else {} for k in ("oracle", "streamed")}
    for name, extra in loader.items():
        models[f"loader_{name}"] = load_qlora_model(str(path), dtype="bfloat16", lora_config=_lora(),
                                                    gradient_checkpointing=False, **extra)  # fmt: skip
    kinds["loader_streamed"] = "load_qlora_model"
    for name, model in models.items():
        where = {t.device.type for t in [*model.parameters(), *model.buffers()]}
        assert where == {"cuda"}, (kinds.get(name, name), where)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        devices = {str(d) for d in (getattr(base, "hf_device_map", None) or {}).values()}
        assert devices <= {"0", "cuda", "cuda:0"}, (name, base.hf_device_map)  # released, or all on the GPU
        experts = [m for m in base.modules() if isinstance(m, QuantizedExperts)]
        assert len(experts) == 2, name
        left_16bit = [n for n, p in base.named_parameters() if p.dim() == 3 and p.dtype == torch.bfloat16]
        assert not left_16bit, (name, left_16bit)
        quant = getattr(base.config, "quantization_config", None)
        flag = (quant.get if isinstance(quant, dict) else lambda k: getattr(quant, k, None))(
            "llm_int8_enable_fp32_cpu_offload"
        )
        assert not flag, (name, quant)
        if not name.startswith("loader"):
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, expected), kinds[name]
    mine, theirs = (models[f"loader_{k}"].state_dict() for k in ("streamed", "oracle"))
    assert [k for k in theirs if "lora_" not in k and not torch.equal(_bytes(mine[k]), _bytes(theirs[k]))] == []
