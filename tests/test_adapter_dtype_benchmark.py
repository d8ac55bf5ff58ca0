"""benchmarks/adapter_dtype.py in its smallest form: 2 gloo ranks under FSDP2, a few steps per adapter dtype.

The benchmark itself refuses a run where FSDP2 did not engage or a contestant trained other adapters than it
claims. Here: the tracked bytes follow the dtypes exactly (float32 adapters, gradients and Adam states are twice
the bfloat16 ones: the oracle is the element size) and the other figures are positive. Step time and RSS are the
benchmark's to report, not this test's to assert.
"""

from __future__ import annotations

import pytest


@pytest.mark.distributed
def test_smoke_fp32_bytes_twice_bf16(tmp_path, capsys):
    # The benchmark's main() runs here, its one launch forked (tests/bench_runner.py) from the command it built.
    from bench_runner import one_fsdp2_launch_smoke

    argv = "--shape small --steps 2 --warmup 1 --seq 16 --batch 1 --keep".split() + [str(tmp_path)]
    result, out = one_fsdp2_launch_smoke("adapter_dtype", argv, capsys)
    fp32, bf16 = result["contestants"]["float32"], result["contestants"]["bfloat16"]
    for key in ("adapter_bytes", "grad_bytes"):
        assert fp32[key] == 2 * bf16[key] > 0, key
    assert fp32["optimizer_bytes"] == 2 * bf16["optimizer_bytes"] == 2 * fp32["adapter_bytes"]  # Adam: 2 states
    for row in (fp32, bf16):
        assert row["peak_rss_train"] > 0 and row["step_s"] > 0 and row["step_cpu_s"] > 0
    assert "fp32/bf16" in out and result["workload"]["ranks"] == 2
