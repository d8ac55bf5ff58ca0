"""Multi-node on the existing engine.

- the shipped `fsdp2_qlora_multinode.yaml` template, run as 2 machines x 1 process on localhost - two
  `accelerate launch --machine_rank 0/1` commands rendezvousing over TCP - with only what a CPU rehearsal
  must change (use_cpu, 2 processes in all, 127.0.0.1, no sync_module_states);
- HSDP (shard inside a node, replicate across nodes) through torch's device mesh, as 2 x 2 CPU processes:
  accelerate's `parallelism_config` with dp_replicate_size=2, dp_shard_size=2.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from dist_utils import BIN, CONFIGS, REPO, SCRIPTS, _env, accelerate_launch, check, free_port, read_results
from tiny_models import build_tiny_model

pytestmark = pytest.mark.distributed


def test_two_machines_on_localhost(tmp_path):
    models = tmp_path / "models"
    build_tiny_model(models / "llama", "llama")
    config = yaml.safe_load((CONFIGS / "fsdp2_qlora_multinode.yaml").read_text())
    assert config["num_machines"] == 2 and config["distributed_type"] == "FSDP"
    config.update(num_processes=2, use_cpu=True, mixed_precision="no", main_process_ip="127.0.0.1",
                  main_process_port=free_port())  # fmt: skip
    config["fsdp_config"].update(fsdp_cpu_ram_efficient_loading=False, fsdp_sync_module_states=False)
    path = tmp_path / "cpu_multinode.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [str(BIN / "accelerate"), "launch", "--config_file", str(path), "--machine_rank", str(rank),
             str(SCRIPTS / "train_scenarios.py"), "--models", str(models), "--out", str(out), "--fsdp-version", "2",
             "--scenarios", "a=llama:ours_loader"],
            cwd=str(REPO), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    results = read_results(out)
    assert sorted(results) == [0, 1]  # one rank per "machine"
    for found in (results[0]["a"], results[1]["a"]):
        assert found["ok"], found.get("traceback")
        assert found["distributed_type"] == "DistributedType.FSDP"
        assert found["engagement"]["fsdp2_modules"] > 0 and found["packed_dtensor"] == found["packed_count"]
    assert results[0]["a"]["init_checksum"] == results[1]["a"]["init_checksum"]
    assert results[0]["a"]["step0_losses"] == results[1]["a"]["step0_losses"]


def test_hsdp_2x2(tmp_path):
    models = tmp_path / "models"
    build_tiny_model(models / "llama", "llama")
    config = yaml.safe_load((CONFIGS / "cpu_fsdp2_rehearsal.yaml").read_text())
    config["num_processes"] = 4
    config["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    path = tmp_path / "hsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    # Our worker script: its 4 ranks are forked with the environment accelerate computes for this config (the
    # users' multi-machine path, real `accelerate launch --machine_rank`, is test_two_machines_on_localhost).
    proc = accelerate_launch(
        path, "train_scenarios.py", "--models", str(models), "--out", str(out), "--fsdp-version", "2",
        "--scenarios", "a=llama:ours_loader", timeout=400,
    )  # fmt: skip
    check(proc)
    results = read_results(out)
    assert sorted(results) == [0, 1, 2, 3]
    for found in (r["a"] for r in results.values()):
        assert found["ok"], found.get("traceback")
        assert found["mesh_shape"] == [2, 2]  # (replicate across "nodes", shard inside one)
        assert found["placements"][0].startswith("R") and found["placements"][1].startswith("S")  # Replicate, Shard(0)
        # Sharded 1/2 inside a node, whatever the replication.
        assert found["packed_local_bytes"] * 2 == found["packed_full_bytes"]
    assert len({r["a"]["init_checksum"] for r in results.values()}) == 1
