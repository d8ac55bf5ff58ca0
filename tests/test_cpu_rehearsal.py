"""CPU rehearsal: accelerate's FSDP path on CPU ranks (gloo).

The first test pins the upstream behaviour we rely on: accelerate (1.15) does NOT run FSDP on CPU by
itself. If an accelerate release starts doing so, it fails - then hf_fsdp_qlora.cpu_rehearsal can go.
"""

import pytest
from dist_utils import accelerate_launch, check, read_results

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module", params=[1, 2])
def probe(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"probe{request.param}")
    proc = accelerate_launch(f"cpu_fsdp{request.param}_rehearsal.yaml", "rehearsal_probe.py", str(out), timeout=300,
                             fork=False)  # fmt: skip
    check(proc)
    results = read_results(out)
    assert sorted(results) == [0, 1]
    return request.param, results


def test_upstream_accelerate_does_not_run_fsdp_on_cpu(probe):
    _, results = probe
    for found in results.values():
        assert found["upstream_distributed_type"] != "DistributedType.FSDP", (
            "accelerate now runs FSDP on CPU by itself: hf_fsdp_qlora.cpu_rehearsal is no longer needed "
            "(see hf_fsdp_qlora/_compat/accelerate.py)"
        )
        # Not even distributed: each rank trains alone (the silent fallback this module exists for).
        assert found["upstream_distributed_type"] == "DistributedType.NO"
        assert found["upstream_num_processes"] == 1


def test_hook_runs_real_fsdp_on_cpu(probe):
    version, results = probe
    for found in results.values():
        assert found["ours_distributed_type"] == "DistributedType.FSDP"
        assert found["ours_num_processes"] == 2
        assert found["ours_device"] == "cpu"  # FSDP1 refuses device_id cpu:0
        eng = found["engagement"]
        if version == 1:
            assert eng["fsdp1_units"] > 0 and eng["flat_params"] > 0
        else:
            assert eng["fsdp2_modules"] > 0 and eng["dtensor_params"] > 0
        assert found["trained"]
