"""`hf-fsdp-qlora doctor --model org/name`: only config.json, through huggingface_hub's own cache, no network.

The cache is laid out as huggingface_hub lays it out (``models--org--name/refs/main`` naming a revision,
``snapshots/<revision>/config.json``) in a temporary ``HF_HUB_CACHE``, and the installed console script runs with
``HF_HUB_OFFLINE=1`` as a user without internet would: the plan from the id equals the plan from the same file given
as a path; an id the cache lacks, and a gated repository, exit 2 with the fix."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

from dist_utils import BIN

from hf_fsdp_qlora.cli.main import main as cli_main

DATA = Path(__file__).resolve().parent / "data"
REPO_ID = "meta-llama/Llama-3.1-8B"
REVISION = "0e9e39f249a16976918f6564b8830bc894c89659"
# A pre-quantized checkpoint's quantization_config decides the run's quantization (no --load-in-4bit given).
QUANTIZED = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
             "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
             "bnb_4bit_quant_storage": "bfloat16"}  # fmt: skip


def _cache(root: Path, repo: str, config: dict) -> Path:
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(REVISION)
    snapshot = folder / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


def _doctor(tmp_path: Path, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    cmd = [str(BIN / "hf-fsdp-qlora"), "doctor", "--accelerate-config", "fsdp2_qlora", "--model", model,
           "--seq-len", "4096", "--gpu-memory", "24GB", "--json", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)


def test_doctor_plans_from_the_local_hub_cache_offline(tmp_path):
    config = json.loads((DATA / "llama3_1_8b_config.json").read_text())
    cached = _cache(tmp_path / "hub", REPO_ID, {**config, "quantization_config": QUANTIZED})
    by_id, by_path = _doctor(tmp_path, REPO_ID), _doctor(tmp_path, str(cached))
    assert by_id.returncode == 0 and by_path.returncode == 0, (by_id.stderr, by_path.stderr)
    doc, oracle = json.loads(by_id.stdout), json.loads(by_path.stdout)
    assert doc["setup"]["model"] == REPO_ID and doc["setup"]["quantization"] == "4bit"  # read from the config
    assert doc["memory"] == oracle["memory"] and doc["findings"] == oracle["findings"]
    assert doc["memory"]["per_gpu"]["total"] > 4 * 2**30  # an 8B plan, not an empty one
    assert not list((tmp_path / "hub").rglob("*.safetensors"))  # nothing but the config was asked for


def test_doctor_hub_id_not_in_the_offline_cache_says_how_to_fetch_it(tmp_path):
    (tmp_path / "hub").mkdir()
    proc = _doctor(tmp_path, "org/name")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    err = proc.stderr
    assert err.startswith("hf-fsdp-qlora doctor: error:") and "HF_HUB_OFFLINE is set" in err, err
    assert "org/name's config.json is not in the local Hugging Face cache" in err and str(tmp_path / "hub") in err
    assert "hf download org/name config.json" in err and "huggingface-cli download org/name config.json" in err
    assert "hf auth login" in err and "huggingface-cli login" in err and "local model folder" in err


def test_doctor_gated_repo_is_explained_by_name(monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import errors

    http = importlib.import_module(errors.Response.__module__)  # the HTTP client huggingface_hub uses (httpx)

    def gated(repo_id, filename, **kwargs):
        url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
        response = http.Response(401, request=http.Request("HEAD", url))
        raise errors.GatedRepoError(f"401 Client Error: access to model {repo_id} is restricted", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    code = cli_main(["doctor", "--accelerate-config", "fsdp2_qlora", "--model", "meta-llama/Llama-3.1-8B"])
    err = capsys.readouterr().err
    assert code == 2 and "meta-llama/Llama-3.1-8B is a gated repository" in err, err
    assert "https://huggingface.co/meta-llama/Llama-3.1-8B" in err and "hf auth login" in err
