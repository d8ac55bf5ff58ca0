"""Greedy tokens from vLLM's offline engine for the cases of a job file. Runs in .venv-serving (vLLM's own venv).

    python tests/serving/vllm_generate.py JOB.json OUT.json

JOB.json: {"prompts": [[ids]], "new_tokens": N, "cases": [{"name", "model", "lora": {"path", "max_rank"} | null,
"refused": bool}],
"expert_layouts": [{"adapter", "architecture", "experts", "out"}]}.
One engine per case, built in turn in this process (vLLM's import, ~20 s, paid once). A case with a LoRA gives the
base's tokens too (`name`/base) and the adapter's through a `LoRARequest` (`name`/lora), then the same adapter under
a second id (`name`/lora_again: a hot swap). OUT.json: {key: tokens, ...}, with each case's engine start time.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# One process, no engine-core subprocess (which would re-import everything), fp32, eager: the settings under which
# vLLM's CPU backend is exact enough for greedy tokens to equal transformers'.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the server test's engine starts beside this one
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 128, "seed": 0}


def generate(llm, prompts, new_tokens, lora=None):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def run_case(case, prompts, new_tokens) -> dict:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    lora = case.get("lora")
    extra = {"enable_lora": True, "max_lora_rank": lora["max_rank"], "max_loras": 1} if lora else {}
    start = time.perf_counter()
    if case.get("refused"):  # a folder vLLM must refuse: its message, for the test to compare with our warning
        try:
            LLM(model=case["model"], **ENGINE, **extra)
        except Exception as err:  # noqa: BLE001 - whatever vLLM raises is the finding
            return {f"{case['name']}/refused": f"{type(err).__name__}: {err}"}
        return {f"{case['name']}/refused": None}
    llm = LLM(model=case["model"], **ENGINE, **extra)
    found = {f"{case['name']}/engine_start_s": round(time.perf_counter() - start, 1)}
    if not lora:
        found[case["name"]] = generate(llm, prompts, new_tokens)
    else:
        found[f"{case['name']}/base"] = generate(llm, prompts, new_tokens)
        request = LoRARequest("trained", 1, lora["path"])
        found[f"{case['name']}/lora"] = generate(llm, prompts, new_tokens, request)
        # max_loras=1: the second id evicts the first from the engine's slot
        found[f"{case['name']}/lora_again"] = generate(llm, prompts, new_tokens, LoRARequest("again", 2, lora["path"]))
    del llm
    gc.collect()
    return found


def expert_layout(case) -> None:
    """vLLM's own reading of peft's fused expert LoRA, run on CPU without an engine (its fused-MoE LoRA kernels are
    GPU-only): the adapter loaded as vLLM loads it, scaling folded into B, then the conversion into per-expert gate
    (w1), down (w2) and up (w3) factors that `enable_mixed_moe_lora_format` + `is_3d_lora_weight` run on a GPU
    (`LoRAModelManager._convert_3d_to_2d_moe_lora`, called with stand-ins for the manager and the layer: it reads
    only the architecture and the expert counts). Writes each layer's per-expert updates B @ A, [experts, out, in]."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file, save_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(case["adapter"], max_position_embeddings=None)
    tensors = load_file(os.path.join(case["adapter"], "adapter_model.safetensors"))
    lora = LoRAModel.from_lora_tensors(1, tensors, helper, device="cpu", dtype=torch.float32)
    for weights in lora.loras.values():
        weights.optimize()  # as the manager does before converting
    manager = SimpleNamespace(is_pooling_model=False)
    manager.model = SimpleNamespace(config=SimpleNamespace(architectures=[case["architecture"]]))
    manager._get_lora_layer_weights = lambda model, name: LoRAModelManager._get_lora_layer_weights(
        manager, model, name
    )
    layer = SimpleNamespace(local_num_experts=case["experts"], global_num_experts=case["experts"], ep_rank=0)
    updates = {}
    for name in sorted(n for n in lora.loras if n.endswith(".experts")):
        LoRAModelManager._convert_3d_to_2d_moe_lora(manager, lora, layer, name)
        weights = lora.loras[name]
        for slot, proj in enumerate(("w1", "w2", "w3")):
            updates[f"{name}.{proj}"] = torch.bmm(weights.lora_b[slot], weights.lora_a[slot]).contiguous()
    save_file(updates, case["out"])


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    for case in job.get("expert_layouts", []):
        expert_layout(case)
    found = {}
    for case in job["cases"]:
        found.update(run_case(case, job["prompts"], job["new_tokens"]))
        with open(out_path, "w") as fh:  # written after each case: a later crash keeps what was measured
            json.dump(found, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
