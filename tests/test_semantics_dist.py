"""Training under FSDP is exactly training (issue 12, items 1 and 3), FSDP1 and FSDP2 on 2 CPU ranks.

One launch per FSDP version runs tests/scripts/semantics_train.py:
- evaluation every step leaves the training losses unchanged (bitsandbytes' in-place CPU repack of 4-bit
  weights at the first no-grad forward changed them);
- DistinctBatchesCallback lets a correctly split set of identical rows train and still stops a dataloader
  without a DistributedSampler before step 1; LabelsCheckCallback stops labels that are all -100;
- load_adapter_into refuses an adapter of another LoRA rank or with extra tensors in one line;
- a model whose embeddings were resized for added tokens (peft's ChatML recipe), with trainable tokens and
  modules_to_save: the gathered adapter (final save and checkpoint) holds exactly what peft's own save
  writes for the same model unsharded, resuming from the checkpoint continues exactly, and the adapter
  reloaded with peft gives the trained model's logits, on the new tokens too.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dist_utils import SCRIPTS, accelerate_launch, check, read_results
from tiny_models import build_tiny_model

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "llama", "llama")
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def launched(request, models, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"semantics{request.param}")
    # The hygiene scenarios do not depend on the FSDP version: FSDP2 only.
    scenarios = "eval,tokens" + (",hygiene" if request.param == 2 else "")
    proc = accelerate_launch(
        f"cpu_fsdp{request.param}_rehearsal.yaml", "semantics_train.py",
        "--models", str(models), "--out", str(out), "--fsdp-version", str(request.param),
        "--scenarios", scenarios, timeout=400,
    )  # fmt: skip
    check(proc)
    results = read_results(out)
    for found in results.values():
        for key, value in found.items():
            assert not key.endswith("_error"), value
    return request.param, out, results


def _worker():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import semantics_train

    return semantics_train


def test_evaluation_leaves_training_unchanged(launched):
    version, _, results = launched
    for found in results.values():
        key = "fsdp1_units" if version == 1 else "fsdp2_modules"
        assert found["plain_engaged"][key] > 0 and found["eval_engaged"][key] > 0
        assert len(found["plain_losses"]) == 3
        assert found["eval_losses"] == found["plain_losses"]


def _oracle(models, weights, keep_dtype=False):
    """The tokens model unsharded, holding the weights gathered (independently of hf_fsdp_qlora) after training:
    in the dtype they trained in (keep_dtype: float32 master weights, what the saved adapter holds) or in bf16 (the
    compute dtype, what a reload with autocast_adapter_dtype=False holds)."""
    model = _worker().tokens_model(str(models / "llama"))
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == set(weights), trainable ^ set(weights)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].data = value.clone() if keep_dtype else value.to(torch.bfloat16)
    return model.eval()


def test_added_tokens_adapter_equals_peft_save_and_reloads(launched, models, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    version, out, results = launched
    worker = _worker()
    for found in results.values():  # resuming from checkpoint-2 continues exactly
        assert found["tokens_B_losses"] == found["tokens_A_losses"][2:]
    weights = torch.load(out / "tokens_weights.pt")
    for name, value in weights["A"].items():
        assert torch.equal(value, weights["B"][name]), name
    # The adapter holds the trained weights in the dtype they trained in (float32 master weights).
    expected = get_peft_model_state_dict(_oracle(models, weights["A"], keep_dtype=True), save_embedding_layers="auto")
    oracle = _oracle(models, weights["A"])
    assert any("embed_tokens.token_adapter.base_layer" in k for k in expected)  # peft saves the resized vocab
    for folder in ("final", "checkpoint-2"):
        ours = load_file(str(out / "tokens_A" / folder / "adapter_model.safetensors"))
        assert set(ours) == set(expected), (folder, set(ours) ^ set(expected))
    ours = load_file(str(out / "tokens_A" / "final" / "adapter_model.safetensors"))
    for key, value in expected.items():  # the oracle gather is float32: values compared, dtypes below
        assert torch.equal(ours[key].float(), value.float()), key
    assert {v.dtype for k, v in ours.items() if "lora_" in k or "modules_to_save" in k} == {torch.float32}

    # A user's reload: a fresh base resized for the same tokens (its new rows drawn anew), the adapter on top.
    ids = torch.tensor([[5, 256, 9, 257, 258, 40, 259, 7]])
    with torch.no_grad():
        trained = oracle(input_ids=ids).logits

    def reloaded_logits(adapter_dir):
        base = AutoModelForCausalLM.from_pretrained(
            str(models / "llama"), quantization_config=worker.ts.bnb_config(), dtype=torch.bfloat16
        )
        torch.manual_seed(123)
        base.resize_token_embeddings(worker.BASE_VOCAB + worker.NEW_TOKENS)
        with torch.no_grad():
            # autocast_adapter_dtype=False: the saved fp32 adapters load into bf16 ones, as they computed in training.
            model = PeftModel.from_pretrained(base, str(adapter_dir), autocast_adapter_dtype=False)
            return model.eval()(input_ids=ids).logits

    assert torch.equal(reloaded_logits(out / "tokens_A" / "final"), trained)
    # Control: without the embeddings (what was written before), the reload is a different model.
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    from safetensors.torch import save_file

    save_file({k: v for k, v in ours.items() if "base_layer" not in k and "original_module" not in k
               and k != "base_model.model.lm_head.modules_to_save.weight"}, str(stripped / "adapter_model.safetensors"))  # fmt: skip
    (stripped / "adapter_config.json").write_text((out / "tokens_A" / "final" / "adapter_config.json").read_text())
    off = (reloaded_logits(stripped) - trained).abs()[0, [1, 3, 4, 6]].max()
    print(f"FSDP{version}: max |logit diff| on the new tokens without the embeddings: {float(off):.3f}")
    assert off > 0.05


def test_resume_refuses_other_adapters_in_one_line(launched):
    """A checkpoint of another LoRA rank, or with tensors the model lacks: one clear line, on every rank."""
    _, _, results = launched
    for found in results.values():
        errors = found["mismatch"]
        r8, extra = errors["r8"], errors["extra"]
        assert r8 and r8.startswith("AdapterMismatchError") and "\n" not in r8, r8
        assert "differ in shape" in r8 and "r=8 in the checkpoint, 4 in this model" in r8, r8
        assert extra and extra.startswith("AdapterMismatchError") and "\n" not in extra, extra
        assert "base_model.model.model.norm.weight" in extra and "no place for" in extra, extra
        loaded, in_file = errors["count"]  # the resume line's count is the adapter file's (FSDP2: was every param)
        assert loaded == in_file > 0, errors["count"]


def test_identical_rows_train_and_unsplit_data_stops(launched):
    version, _, results = launched
    if version != 2:
        pytest.skip("run in the FSDP2 launch only")
    for found in results.values():
        same = found["same_rows"]  # identical content, split by Trainer: a healthy run
        assert same["error"] is None and len(same["losses"]) == 2 and same["verdict"] == "split", same
        unsplit = found["no_sampler"]  # every rank draws indices [0, 1], [2, 3]: stopped before any step
        assert unsplit["error"].startswith("DuplicateBatchesError") and unsplit["losses"] == [], unsplit
        assert "DistributedSampler" in unsplit["error"] and unsplit["verdict"] == "duplicate"


def test_all_labels_masked_stops(launched):
    version, _, results = launched
    if version != 2:
        pytest.skip("run in the FSDP2 launch only")
    for found in results.values():
        error = found["no_labels"]["error"]
        assert error.startswith("NoLabelsError") and "-100" in error and "max_length" in error, error
        assert len(found["no_labels"]["losses"]) == 1  # stopped after the first step
