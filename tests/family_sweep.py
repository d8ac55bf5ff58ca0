"""The family sweep's worker: for every tiny family (tests/family_build.py), on a 4-bit base, what works.

Run as ``python tests/family_sweep.py OUT.json [--shard i/n]``; tests/test_families.py runs it once per session (one
process: tests/make_families_table.py SHARDS) and reads the JSON. Per family, one record of steps, each ``{"ok": bool, "detail": str}``:

- ``build``: the tiny model builds, runs a forward and saves (else the family "could not be built", with the reason);
- ``load``: ``load_qlora_model(all-linear LoRA)``; a refusal is ``UnsupportedSetupError``, recorded with its text;
- ``train``: one forward with labels and backward: finite loss, a non-zero gradient on every LoRA tensor;
- ``merge`` / ``merge_nf4``: ``merge_adapters`` (plain, ``dequantize="nf4"``) against peft's ``merge_and_unload`` on
  the 16-bit base (nf4: on the 4-bit weights training saw, dequantized before any forward): merged tensors within
  two bf16 roundings, every tensor neither trained nor quantized byte-identical to the base;
- ``doctor``: ``diagnose`` on the folder: a plan and no error when the loader loaded; an error when it refused;
- the variants (expert LoRA, 8-bit, pre-quantized) on the families they apply to: tests/family_variants.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from family_build import VOCAB, build, build_error  # noqa: E402
from family_variants import run_variants  # noqa: E402

EPS = torch.finfo(torch.bfloat16).eps


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def _lora_config():
    from peft import LoraConfig

    # dropout 0: peft refuses dropout on parameter targets, which an MoE family may get
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def _quantized_weights(model) -> dict[str, torch.Tensor]:
    """{base key: the dequantized weight training sees} of every 4-bit layer, read before any forward."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_f

    from hf_fsdp_qlora.experts.quantized import QuantizedExperts

    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            seen[f"{_base_name(name)}.weight"] = bnb_f.dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, QuantizedExperts):
            for param in module.layout.weights:
                stacked = [module.dequantize_expert(param, e) for e in range(module.expert_rows(param))]
                seen[f"{_base_name(name)}.{param}"] = torch.stack(stacked)
    from hf_fsdp_qlora.experts.dbrx import fused_experts, to_stored

    return to_stored(
        seen, fused_experts(model)
    )  # under the checkpoint's names: DBRX stores its fused experts as 2-D mlp.w1 / v1 / w2


def _train_step(model, vocab: int) -> str:
    """One forward with labels and backward; raises naming what is wrong, returns the loss."""
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (1, 8))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    if not torch.isfinite(loss):
        raise AssertionError(f"loss {loss.item()}")
    loss.backward()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}
    if not lora:
        raise AssertionError("no LoRA tensor")
    dead = [n for n, p in lora.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    if dead:
        raise AssertionError(f"{len(dead)} of {len(lora)} LoRA tensors without gradient, e.g. {dead[:3]}")
    return f"loss {loss.item():.4f}, {len(lora)} LoRA tensors with gradient"


def _move_adapter(model) -> None:
    """Every LoRA tensor moved off its initial value (lora_B starts at zero, which leaves lora_A no gradient and
    the merge nothing to add), so a step or a merge that drops one shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)


def _load16(path, dtype):
    """The 16-bit base as transformers loads it: the auto class, or the class a text model was saved with."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_fsdp_qlora.towers import saved_text_class

    cls = saved_text_class(AutoConfig.from_pretrained(path)) or AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype)


def _peft_merge(base32, adapter: Path, replace: dict) -> dict:
    """peft's merge_and_unload of `adapter` on a copy of the float32 base `base32` (its weights replaced by
    `replace` first, where given)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(base32)  # one load per family; peft merges into the model it is given
    if replace:
        model.load_state_dict({k: v.float() for k, v in replace.items()}, strict=False)
    # peft 0.21 remaps an adapter's gate_proj/up_proj/down_proj targets onto routed experts when it loads one on an
    # MoE family transformers 5 converts (hf_fsdp_qlora/_compat/peft.py `peft_v5_moe_target_remap`): the oracle loads
    # our adapter as our loader attached it, with that remap kept off (as load_qlora_model(adapter=...) does).
    from types import SimpleNamespace

    from hf_fsdp_qlora.experts.stock_reload import keep_adapter_keys
    from hf_fsdp_qlora.experts.targets import keep_linear_targets

    # And peft 0.21 renames an adapter's keys as if from the family's original checkpoint, which on Laguna and
    # Inkling 2 moves some of them off the model's names (stock_reload.keep_adapter_keys): kept as our loader keeps them.
    with keep_linear_targets(SimpleNamespace(hf_fsdp_qlora_linear_targets=True)), keep_adapter_keys():
        return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def _compare(ours: dict, ref: dict, before: dict, quantized: dict) -> str:
    """Merged tensors within two bf16 roundings of peft's; the others byte-identical to the base."""
    if set(ours) != set(ref):
        raise AssertionError(f"keys differ: ours-only {sorted(set(ours) - set(ref))[:3]}, "
                             f"peft-only {sorted(set(ref) - set(ours))[:3]}")  # fmt: skip
    merged = touched = 0
    for key, tensor in ours.items():
        start = quantized.get(key, before[key]).float()
        if torch.equal(ref[key], start):  # peft left it as training saw it
            expected = quantized[key] if key in quantized else before[key]
            if not torch.equal(tensor, expected.to(tensor.dtype)):
                diff = (tensor.float() - expected.float()).abs()
                raise AssertionError(f"{key} untouched by the adapter changed in {int((diff > 0).sum())} of "
                                     f"{diff.numel()} elements (max {diff.max().item():.3g})")  # fmt: skip
            touched += key in quantized
            continue
        scale = ref[key].abs() + (ref[key] - start).abs()
        err = (tensor.float() - ref[key]).abs()
        if not bool((err <= 2 * EPS * scale + 1e-30).all()):
            raise AssertionError(f"{key}: max |ours - peft| {err.max().item():.3g}")
        merged += 1
    return f"{merged} merged tensors equal peft's, {len(ours) - merged} untouched identical"


def _merge_checks(path: Path, adapter: Path, quantized: dict, work: Path, record: dict) -> None:
    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    # The base in float32, loaded once: the oracle's model (copied per step) and, rounded back to bfloat16, the
    # saved bf16 weights exactly (every value came from the bf16 checkpoint), which untouched tensors must keep.
    base32 = _load16(path, torch.float32)
    before = {key: value.to(torch.bfloat16) for key, value in base32.state_dict().items()}
    # GPT-2's Conv1D stores (in, out); bitsandbytes quantized the (out, in) transpose training saw: back to (in, out)
    conv1d = {f"{n}.weight" for n, m in base32.named_modules() if type(m).__name__ == "Conv1D"}
    quantized = {k: v.T if k in conv1d else v for k, v in quantized.items()}
    for step, kwargs, replace in (("merge", {}, {}), ("merge_nf4", {"dequantize": "nf4"}, quantized)):

        def check(step=step, kwargs=kwargs, replace=replace):
            out = merge_adapters(path, adapter, work / step, progress=False, **kwargs)
            ours = _load16(out, torch.bfloat16).state_dict()
            return _compare(ours, _peft_merge(base32, adapter, replace), before, replace)

        run(record, step, check)


def _doctor(path: Path, load: dict) -> str:
    from hf_fsdp_qlora.doctor.checks import diagnose
    from hf_fsdp_qlora.errors import SetupInputError

    try:
        # seq_len within the tiny models' 512 positions: a learned position table refuses longer ones, rightly
        diag = diagnose(str(path), quantization="4bit", lora_dropout=0.0, lora_r=4, seq_len=128)
    except SetupInputError as exc:  # the doctor refuses the model itself (exit status 2): its refusal, in words
        if load["ok"]:
            raise
        return " ".join(str(exc).split())[:200]
    errors = [f"[{f.id}] {f.message}" for f in diag.errors]
    if load["ok"] and (errors or diag.plan is None):
        raise AssertionError(f"the loader loads it, the doctor says {errors or 'no plan'}")
    if not load["ok"] and load.get("refused") and not errors:
        raise AssertionError("the loader refuses it, the doctor plans it")
    return errors[0][:200] if errors else f"plan, {diag.plan.parameters} parameters"


def run(record: dict, step: str, fn):
    """Run one step into `record[step]`; an UnsupportedSetupError is a refusal, anything else a failure."""
    from hf_fsdp_qlora.errors import UnsupportedSetupError

    try:
        record[step] = {"ok": True, "detail": str(fn())}
    except UnsupportedSetupError as exc:
        record[step] = {"ok": False, "refused": True, "detail": " ".join(str(exc).split())[:400]}
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure as data
        record[step] = {"ok": False, "detail": build_error(exc)}
    return record[step]["ok"]


def _train_fresh(model) -> str:
    _move_adapter(model)
    return _train_step(model, VOCAB)


def sweep_family(model_type: str, work: Path) -> dict:
    record: dict = {}
    path = work / "base"
    if not run(record, "build", lambda: build(model_type, path) and "built"):
        return record
    _base_checks(path, work, record)
    run_variants(model_type, path, record, run, _train_fresh)
    return record


def _base_checks(path: Path, work: Path, record: dict) -> None:
    """load, doctor, train, merge and merge_nf4 on the 4-bit base with all-linear LoRA, into `record`."""
    from hf_fsdp_qlora.loading.qlora import load_qlora_model

    holder = {}

    def load():
        holder["model"] = load_qlora_model(path, dtype=torch.bfloat16, lora_config=_lora_config())
        holder["quantized"] = _quantized_weights(holder["model"])
        return f"{len(holder['quantized'])} quantized tensors"

    loaded = run(record, "load", load)
    run(record, "doctor", lambda: _doctor(path, record["load"]))
    if not loaded or not run(record, "train", lambda: _train_fresh(holder["model"])):
        return
    adapter = work / "adapter"
    holder["model"].save_pretrained(adapter)
    del holder["model"]
    _merge_checks(path, adapter, holder["quantized"], work, record)


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    index, count = map(int, argv[2].split("/")) if len(argv) > 2 else (0, 1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in families()[index::count]:
            start = time.perf_counter()
            results[model_type] = sweep_family(model_type, Path(tmp) / model_type)
            results[model_type]["seconds"] = round(time.perf_counter() - start, 2)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")
    # transformers' own bars (weight loading, shard writing) too: a worker forked from the suite's fork server
    # imported tqdm before this line could switch it off
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # some families' modules leave threads behind; the results are written
