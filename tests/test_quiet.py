"""Quiet by default: the upstream lines hf_fsdp_qlora._quiet filters are gone from a normal run, our own lines stay,
and HF_FSDP_QLORA_VERBOSE=1 brings the upstream lines back (so upstream still prints them: the canary of the
`upstream_noise` entry in hf_fsdp_qlora._compat)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from dist_utils import REPO, _env

BNB_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'"
FUTURE_LINE = "FutureWarning: `is_gradient_checkpointing` is deprecated"

# A normal single-process use: import the package, the stock Trainer (which imports bitsandbytes) and peft's
# get_peft_model through our loader (which reads the deprecated alias), then one line of ours.
SCRIPT = """
import logging, sys
import hf_fsdp_qlora
from transformers import Trainer
from tiny_models import build_tiny_model
from hf_fsdp_qlora import load_qlora_model
from hf_fsdp_qlora.loading.qlora import default_lora_config
path = build_tiny_model(sys.argv[1], "llama")
model = load_qlora_model(path, lora_config=default_lora_config(lora_dropout=0.0), gradient_checkpointing=False)
logging.getLogger("hf_fsdp_qlora.test").info("hf_fsdp_qlora: our line")
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
    return proc.stdout + proc.stderr


def test_quiet_by_default_and_verbose_shows_upstream(tmp_path):
    quiet, verbose = _run(tmp_path, verbose=False), _run(tmp_path, verbose=True)
    for out in (quiet, verbose):
        assert "[hf_fsdp_qlora.test] hf_fsdp_qlora: our line" in out
    assert BNB_LINE not in quiet and FUTURE_LINE not in quiet, quiet[-3000:]
    # the oracle: the same run with the switch prints what the default run hid
    assert FUTURE_LINE in verbose, verbose[-3000:]
    if "BNB_WARNS True" in verbose:
        assert BNB_LINE in verbose, verbose[-3000:]
    else:
        pytest.skip("bitsandbytes prints its kernels line only on CPUs with AVX512-BF16 (the rest was checked)")


def test_filters_match_only_their_message():
    """A different failure from the same bitsandbytes logger, and other FutureWarnings, still get through."""
    import logging
    import warnings

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

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _quiet.quiet_upstream()  # again, inside this catch_warnings
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
        assert model.is_gradient_checkpointing is False  # transformers.modeling_utils: filtered
        warnings.warn("`is_gradient_checkpointing` is deprecated, elsewhere", FutureWarning, stacklevel=1)  # not it
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert messages == ["`is_gradient_checkpointing` is deprecated, elsewhere"], messages
