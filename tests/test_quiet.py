"""Quiet by default: the upstream lines hf_fsdp_qlora._quiet filters are gone from a normal run, our own lines stay,
and HF_FSDP_QLORA_VERBOSE=1 brings the upstream lines back (so upstream still prints them: the canary of the
`upstream_noise` entry in hf_fsdp_qlora._compat)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dist_utils import REPO, _env

BNB_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
IS_GC = "FutureWarning: `is_gradient_checkpointing` is deprecated"
GC = "FutureWarning: `gradient_checkpointing` is deprecated"
ELSEWHERE = "FutureWarning: `is_gradient_checkpointing` is deprecated, elsewhere"

# A normal single-process use, step by step (each step marked on stderr, where warnings go): import the package, the
# stock Trainer (which imports bitsandbytes) and peft's get_peft_model through our loader (peft reads the deprecated
# alias), the user's own reads of it (twice from one line, through the PeftModel), trl's config (its default sets
# the deprecated argument), the user's own TrainingArguments with it, and the same text warned from another module.
SCRIPT = """
import logging, sys, warnings
import hf_fsdp_qlora
from transformers import Trainer, TrainingArguments
from tiny_models import build_tiny_model
from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.loading.qlora import default_lora_config
def step(name):
    print("STEP", name, file=sys.stderr, flush=True)
path = build_tiny_model(sys.argv[1], "llama")
step("peft")
model = load_qlora_model(path, lora_config=default_lora_config(lora_dropout=0.0), gradient_checkpointing=False)
logging.getLogger("hf_fsdp_qlora.test").info("hf_fsdp_qlora: our line")
step("user_read")
for _ in range(2):
    assert model.is_gradient_checkpointing is False
step("trl_config")
from trl import SFTConfig
SFTConfig(output_dir=sys.argv[1] + "/sft", use_cpu=True, bf16=False, report_to=[])
step("user_args")
TrainingArguments(output_dir=sys.argv[1] + "/args", use_cpu=True, report_to=[], gradient_checkpointing=True)
step("elsewhere")
warnings.warn("`is_gradient_checkpointing` is deprecated, elsewhere", FutureWarning)
step("end")
from bitsandbytes.backends.cpu.ops import has_avx512bf16
import importlib.util
print("BNB_WARNS", has_avx512bf16() and importlib.util.find_spec("kernels") is None)
"""


def _run(tmp_path, verbose: bool):
    env = _env({"HF_FSDP_QLORA_VERBOSE": "1"} if verbose else {})
    if not verbose:
        env.pop("HF_FSDP_QLORA_VERBOSE", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / ("v" if verbose else "q"))],
        check=False,
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr, _steps(proc.stderr)


def _steps(stderr: str) -> dict[str, dict[str, int]]:
    """Per step of SCRIPT: how many times each of the deprecation warnings was printed."""
    counts, name = {}, "start"
    for line in stderr.splitlines():
        if line.startswith("STEP "):
            name = line.split()[1]
        counts.setdefault(name, {"is_gc": 0, "gc": 0, "elsewhere": 0})
        counts[name]["elsewhere"] += ELSEWHERE in line
        counts[name]["is_gc"] += IS_GC in line and ELSEWHERE not in line
        counts[name]["gc"] += GC in line
    return counts


def test_quiet_by_default_and_verbose_shows_upstream(tmp_path):
    """Upstream's triggers are quiet; the user's own triggers of the same deprecations still print, once per line."""
    (quiet, q), (verbose, v) = _run(tmp_path, verbose=False), _run(tmp_path, verbose=True)
    for out in (quiet, verbose):
        assert "[hf_fsdp_qlora.test] hf_fsdp_qlora: our line" in out
    assert BNB_LINE not in quiet, quiet[-3000:]
    assert q["peft"]["is_gc"] == 0 and q["trl_config"]["gc"] == 0, (q, quiet[-3000:])  # upstream's: quiet
    assert q["user_read"]["is_gc"] == 1 and q["user_args"]["gc"] == 1, (q, quiet[-3000:])  # the user's: shown
    assert q["elsewhere"]["elsewhere"] == 1
    # the oracle: the same run with the switch prints what the default run hid (Python's own once-per-location
    # rule then hides the user's later triggers, which our filter shows)
    assert v["peft"]["is_gc"] == 1 and v["trl_config"]["gc"] == 1, (v, verbose[-3000:])
    if "BNB_WARNS True" in verbose:
        assert BNB_LINE in verbose, verbose[-3000:]
    else:
        pytest.skip("bitsandbytes prints its kernels line only on CPUs with AVX512-BF16 (the rest was checked)")


def test_docs_give_each_filter_as_the_code_has_it():
    """docs/quiet.md states each filter's message pattern, module and callers exactly as hf_fsdp_qlora._quiet has
    them."""
    from hf_fsdp_qlora import _quiet

    docs = (REPO / "docs" / "quiet.md").read_text()
    for noise in _quiet.NOISE:
        if isinstance(noise, _quiet.WarnedNoise):
            assert f'message=r"{noise.message}"' in docs and f'module=r"{noise.module}"' in docs, noise
            assert f"callers={noise.callers!r}" in docs, noise
        else:
            assert f"`{noise.starts}`" in docs and all(f"`{part}`" in docs for part in noise.contains), noise


def test_filters_match_only_their_message():
    """A different failure from the same bitsandbytes logger still gets through (the warnings: in the run above)."""
    import logging

    from hf_fsdp_qlora import _quiet

    assert _quiet.quiet_upstream() is (not _quiet.verbose_requested())
    if _quiet.verbose_requested():
        pytest.skip("HF_FSDP_QLORA_VERBOSE is set: no filters to test")
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. ...", "No module named 'kernels'"
        )
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. ...", "version mismatch")
    finally:
        logger.removeHandler(handler)
    assert kept == ["Failed to load CPU gemm_4bit_forward from kernels-community: version mismatch. ..."]


def test_pyproject_license_builds_without_setuptools_warning():
    """`pip install` prints nothing of ours: the license is an SPDX string (setuptools >= 77), not the deprecated
    TOML table, which made setuptools print "`project.license` as a TOML table is deprecated" on every build."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert not [str(w.message) for w in caught if "license" in str(w.message).lower()]
    assert dist.metadata.license_expression == "Apache-2.0"
    requires = (REPO / "pyproject.toml").read_text().split("[project]")[0]
    assert '"setuptools>=77"' in requires  # the first setuptools that reads an SPDX license string
