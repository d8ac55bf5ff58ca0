"""The compat registry (the hf_fsdp_qlora/_compat/ package) is complete and its canaries watch upstream.

* the registry: every `where` resolves to our code, every canary test exists, keys are unique; every module of
  the package is part of the combined registry and holds only entries for its own upstream library;
* the guard: every private access / patch of upstream in the package is covered by an entry's `where`
  (a new one without an entry fails here);
* canaries: each runs the STOCK upstream path and asserts the behaviour we work around (or the private API we
  lean on, with the signature we call it with). They fail when upstream changes: then read the entry's
  `remove_when`. The stock behaviours that need FSDP run in one 2-rank gloo launch (scripts/compat_canaries.py).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from hf_fsdp_qlora._compat import LIBRARIES, WORKAROUNDS, Workaround

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_fsdp_qlora"
COMPAT = PACKAGE / "_compat"
UPSTREAM = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "trl", "safetensors", "atexit", "os")
# Attributes of upstream objects (methods, switches) that we assign: a patch or a setting upstream reads.
PATCHED_ATTRS = {
    "__init__", "__post_init__", "__new__", "__class__", "forward", "set_mixed_precision", "prepare_model",
    "mixed_precision_policy", "use_orig_params", "activation_checkpointing", "gradient_checkpointing", "use_cpu",
    "distributed_type", "fsdp_plugin", "support_avx512bf16_for_cpu", "compute_dtype", "quant_storage", "quant_state",
}  # fmt: skip


def _params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


# ---------------------------------------------------------------- the registry


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError names what is missing
        return obj
    raise ImportError(path)


def test_registry_entries_resolve_and_are_unique():
    keys = [entry.key for entry in WORKAROUNDS]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    for entry in WORKAROUNDS:
        assert all(getattr(entry, f.name) for f in dataclasses.fields(Workaround)), entry
        for path in entry.where:
            assert path.startswith("hf_fsdp_qlora."), (entry.key, path)
            _resolve(path)


def test_every_registry_module_is_in_the_registry():
    """A module added to _compat/ but not to LIBRARIES would drop its entries from every check here."""
    modules = {p.stem for p in COMPAT.glob("*.py")} - {"__init__", "_entry"}
    assert modules == set(LIBRARIES), sorted(modules ^ set(LIBRARIES))
    assert WORKAROUNDS == tuple(entry for module in LIBRARIES.values() for entry in module.WORKAROUNDS)
    assert all(module.WORKAROUNDS for module in LIBRARIES.values()), "an empty registry module"


def test_each_entry_sits_with_its_upstream_library():
    """An entry goes in the module of the library it works around: the first its `upstream` names. `multi` holds
    only entries that name several libraries."""
    names = [library for library in LIBRARIES if library != "multi"]
    misplaced = []
    for library, module in LIBRARIES.items():
        for entry in module.WORKAROUNDS:
            at = {name: entry.upstream.find(name) for name in names if name in entry.upstream}
            ok = len(at) >= 2 if library == "multi" else min(at, key=at.get, default=None) == library
            if not ok:
                misplaced.append(f"{entry.key} in _compat/{library}.py: {entry.upstream[:60]}")
    assert not misplaced, "\n".join(misplaced)


def test_every_canary_exists():
    for entry in WORKAROUNDS:
        file, _, test = entry.canary.partition("::")
        name, _, param = test.partition("[")
        source = (REPO / file).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), (entry.key, entry.canary)
        if param:  # a parametrize id: it must be one of the test's cases
            assert f'"{param.rstrip("]")}"' in source, (entry.key, entry.canary)


# ---------------------------------------------------------------- the guard


class _Finder(ast.NodeVisitor):
    """Private accesses and patches of upstream objects in one module, each with its enclosing qualified name."""

    def __init__(self, module: str, trainer_methods=frozenset()):
        self.module, self.stack, self.found, self.local_defs = module, [], [], [set()]
        self.trainer_methods, self.in_class = trainer_methods, [False]

    def _where(self) -> str:
        return ".".join([self.module, *self.stack])

    def _add(self, what: str) -> None:
        self.found.append((self._where(), what))

    def _scope(self, node):
        is_class = isinstance(node, ast.ClassDef)
        self.local_defs[-1].add(node.name)
        self.stack.append(node.name)
        if self.in_class[-1] and not is_class and node.name in self.trainer_methods:
            self._add(f"overrides Trainer.{node.name}")
        self.local_defs.append(set())
        self.in_class.append(is_class)
        self.generic_visit(node)
        self.in_class.pop()
        self.local_defs.pop()
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Attribute(self, node):
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if private and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            self._add(f"._{node.attr[1:]}")
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and str(name.value).startswith("_") and not name.value.startswith("__"):
                self._add(f"{func.id}(..., {name.value!r})")
            if func.id == "setattr" and len(node.args) == 3 and self._is_patch_value(node.args[2]):
                self._add("setattr(..., <function>)")
        self.generic_visit(node)

    def _is_patch_value(self, value) -> bool:
        return isinstance(value, ast.Lambda) or (
            isinstance(value, ast.Name) and any(value.id in defs for defs in self.local_defs[1:])
        )

    def visit_Assign(self, node):
        for target in node.targets:
            ours = (
                isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            )
            patch = isinstance(target, ast.Attribute) and (
                target.attr in PATCHED_ATTRS or self._is_patch_value(node.value)
            )
            if patch and not ours:
                self._add(f".{target.attr} = ...")
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] in UPSTREAM:
            for alias in node.names:
                if "._" in f".{module}." or alias.name.startswith("_"):
                    self._add(f"from {module} import {alias.name}")
        self.generic_visit(node)


def _trainer_methods() -> frozenset:
    from transformers import Trainer

    return frozenset(n for n in dir(Trainer) if not n.startswith("__") and callable(getattr(Trainer, n)))


def find_upstream_internals(source: str, module: str, trainer_methods=frozenset()) -> list[tuple[str, str]]:
    finder = _Finder(module, trainer_methods)
    finder.visit(ast.parse(source))
    return finder.found


# Assignments the guard sees that touch our own objects, not upstream's.
NOT_UPSTREAM = {
    "hf_fsdp_qlora.doctor.setup._settings_from_launch",  # fills our FsdpSettings dataclass
    "hf_fsdp_qlora.quant_record._live_settings",  # reads our QuantizedExperts' own block sizes (experts/quantized.py)
}


def _covered(where: str) -> bool:
    return where in NOT_UPSTREAM or any(
        where == w or where.startswith(w + ".") for entry in WORKAROUNDS for w in entry.where
    )


def test_guard_finds_private_access_and_patches():
    """The finder itself can fail: a private read, a private import and a patch are all found."""
    source = (
        "from torch.distributed.fsdp._common_utils import x\n"
        "def f(m):\n    return m._secret\n"
        "def g(cls):\n    def new(self): pass\n    Other.__init__ = new\n    setattr(obj, 'run', new)\n"
        "class T:\n    def _save_checkpoint(self, model, trial):\n        self._mine = 1\n"
    )
    found = find_upstream_internals(source, "hf_fsdp_qlora.fake", _trainer_methods())
    assert ("hf_fsdp_qlora.fake.T._save_checkpoint", "overrides Trainer._save_checkpoint") in found
    assert not any("_mine" in what for _, what in found)  # our own attributes are ours
    assert ("hf_fsdp_qlora.fake.f", "._secret") in found
    assert any(w == "hf_fsdp_qlora.fake" and "import x" in what for w, what in found)
    assert ("hf_fsdp_qlora.fake.g", ".__init__ = ...") in found
    assert ("hf_fsdp_qlora.fake.g", "setattr(..., <function>)") in found
    assert not _covered("hf_fsdp_qlora.fake.f")


def test_every_upstream_internal_has_a_registry_entry():
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for where, what in find_upstream_internals(path.read_text(), module, _trainer_methods()):
            if not _covered(where):
                missing.append(f"{where}: {what}")
    assert not missing, (
        "private upstream access or patches without an entry in hf_fsdp_qlora/_compat/<library>.py (add one, with a "
        "canary):\n" + "\n".join(missing)
    )


# ---------------------------------------------------------------- single-process canaries


def test_stock_training_arguments_refuse_bf16_on_cpu(tmp_path):
    from transformers import TrainingArguments

    if torch.cuda.is_available():
        pytest.skip("bf16 is allowed with a GPU")
    with pytest.raises(ValueError, match=re.escape("Your setup doesn't support bf16/gpu")):
        TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to=[])
    assert TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[]).bf16


def test_accelerate_state_internals():
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    assert isinstance(PartialState.__dict__["_shared_state"], dict)
    assert isinstance(AcceleratorState.__dict__["_shared_state"], dict)
    init = inspect.unwrap(AcceleratorState.__init__)
    assert "_mixed_precision" in init.__code__.co_names and "fsdp_plugin" in _params(init)
    partial = inspect.unwrap(PartialState.__init__)
    assert _params(partial)[:2] == ["self", "cpu"]
    # configure_plugin replaces set_mixed_precision on the instance with one of the same signature
    assert _params(FullyShardedDataParallelPlugin.set_mixed_precision) == [
        "self", "mixed_precision", "buffer_autocast", "override"
    ]  # fmt: skip


def test_teardown_internals():
    """The gloo abort itself is intermittent (about one exit in four), so it cannot be a deterministic canary;
    this watches what the workaround calls."""
    import atexit
    import os

    import torch.distributed as dist

    assert callable(atexit._run_exitfuncs) and callable(os._exit)
    assert _params(dist.destroy_process_group) == ["group"]


def test_bitsandbytes_internals():
    import bitsandbytes as bnb
    from bitsandbytes.functional import _convert_weight_packed_for_cpu, _convert_weight_packed_for_cpu_inverse

    assert _params(_convert_weight_packed_for_cpu_inverse)[:2] == ["packed_weight", "quant_state"]
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              quant_storage=torch.bfloat16)  # fmt: skip
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes
    weight = layer.weight
    # the inverse undoes the CPU repack exactly (what disable_cpu_repack_in_model relies on)
    before = weight.data.clone()
    packed, state = _convert_weight_packed_for_cpu(weight.data.view(torch.uint8), weight.quant_state)
    assert state.packing_format_for_cpu is True
    restored, state = _convert_weight_packed_for_cpu_inverse(packed, state)
    assert not state.packing_format_for_cpu and torch.equal(restored.view(torch.uint8).flatten(),
                                                            before.view(torch.uint8).flatten())  # fmt: skip
    # the stock __init__ sets the instance flag our wrap turns off
    stock = inspect.unwrap(bnb.nn.Linear4bit.__init__)
    assert "support_avx512bf16_for_cpu" in stock.__code__.co_names
    # Params4bit is rebuilt from received bytes with the same fields (low_ram)
    assert {"module", "bnb_quantized", "quant_state", "quant_storage", "blocksize", "quant_type"} <= set(
        _params(bnb.nn.Params4bit.__new__)
    )
    rebuilt = bnb.nn.Params4bit(weight.data, requires_grad=False, **weight.__dict__)
    assert rebuilt.quant_state is weight.quant_state and rebuilt.bnb_quantized
    assert hasattr(bnb.nn.modules, "fix_4bit_weight_quant_state_from_module")
    # forward reads compute_dtype, which harmonize_dtypes sets
    assert "compute_dtype" in bnb.nn.Linear4bit.forward.__code__.co_names


def test_torch_state_dict_options():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    fields = {f.name for f in dataclasses.fields(StateDictOptions)}
    assert {"full_state_dict", "cpu_offload", "ignore_frozen_params", "strict"} <= fields
    for func in (get_model_state_dict, set_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict):
        assert "options" in _params(func), func


def test_torch_internals():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE
    from torch.utils import deterministic

    from hf_fsdp_qlora.param_names import WRAPPER_SEGMENTS

    module = torch.nn.Linear(2, 2)
    assert isinstance(module._parameters, dict) and "weight" in module._parameters
    assert isinstance(module._buffers, dict)
    module._parameters["weight"] = replacement = torch.nn.Parameter(torch.zeros(2, 2))
    assert module.weight is replacement  # the slot swap low_ram relies on
    assert isinstance(deterministic.fill_uninitialized_memory, bool)
    compiled = torch.compile(module)  # wrapping only; nothing is compiled before a call
    assert compiled._orig_mod is module
    in_place = torch.nn.Linear(2, 2)
    assert getattr(in_place, "_compiled_call_impl", None) is None
    in_place.compile()  # what accelerate's regional compilation calls on each layer
    assert in_place._compiled_call_impl is not None  # what compile.compiled_modules reads
    assert set(WRAPPER_SEGMENTS) == {FSDP_WRAPPED_MODULE + ".", _CHECKPOINT_WRAPPED_MODULE + ".", "_orig_mod."}


def test_torch_grouped_mm():
    """What experts/grouped.py relies on and works around in torch's grouped matmul on CPU: equal to a per-group
    matmul forward and backward; an expanded incoming gradient and 8-byte rows are refused (the hook makes the
    gradient contiguous, LoRA ranks are padded to 16-byte rows)."""
    grouped = torch._grouped_mm
    assert torch.nn.functional.grouped_mm.__module__ == "torch.nn.functional"
    assert {"offs"} <= set(_params(torch.nn.functional.grouped_mm))
    x = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)  # an empty group, as unrouted experts give
    out = grouped(x, w.transpose(-2, -1), offs=offs)
    loop = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    assert torch.equal(out, loop)
    with pytest.raises(RuntimeError, match="Invalid strides/sizes"):
        out.sum().backward()
    grouped(x, w.transpose(-2, -1), offs=offs).backward(torch.ones(10, 8, dtype=torch.bfloat16))
    assert w.grad[1].abs().sum() == 0 and w.grad[0].abs().sum() > 0
    narrow = torch.randn(3, 4, 16, dtype=torch.bfloat16, requires_grad=True)  # rank 4 in bf16: 8-byte rows
    low = grouped(x, narrow.transpose(-2, -1), offs=offs)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        low.backward(torch.ones_like(low))


def test_trainer_private_methods():
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    expected = {
        "_save_checkpoint": ["self", "model", "trial"],
        "_get_output_dir": ["self", "trial"],
        "_save_optimizer_and_scheduler": ["self", "output_dir"],
        "_load_optimizer_and_scheduler": ["self", "checkpoint"],
        "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
        "save_model": ["self", "output_dir", "_internal_call"],
        "create_accelerator_and_postprocess": ["self"],
    }
    for name, params in expected.items():
        assert _params(getattr(Trainer, name)) == params, name
    assert _params(Trainer.evaluation_loop)[:3] == ["self", "dataloader", "description"]
    # our staging works because _save_checkpoint asks _get_output_dir for the folder and calls these hooks
    calls = Trainer._save_checkpoint.__code__.co_names
    assert {"_get_output_dir", "save_model", "_save_optimizer_and_scheduler", "rotate_checkpoints"} <= set(calls)
    assert PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert _params(rotate_checkpoints)[:3] == ["output_dir", "save_total_limit", "best_model_checkpoint"]
    # the hook finds `args` and `callbacks` by name in the stock __init__, which creates the accelerator itself
    init = inspect.unwrap(Trainer.__init__)
    assert {"args", "callbacks"} <= set(_params(init))
    assert "create_accelerator_and_postprocess" in init.__code__.co_names


def test_transformers_internals():
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, TrainingArguments
    from transformers.distributed.fsdp import update_fsdp_plugin_peft
    from transformers.quantizers.auto import get_hf_quantizer
    from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.trainer_utils import _is_peft_model

    assert _params(get_hf_quantizer)[:5] == [
        "config",
        "quantization_config",
        "device_map",
        "weights_only",
        "user_agent",
    ]
    assert _params(HfQuantizer.preprocess_model)[:3] == ["self", "model", "dtype"]
    assert _params(HfQuantizer.postprocess_model)[:2] == ["self", "model"]
    assert _params(get_keys_to_not_convert) == ["model"]
    assert _params(should_convert_module)[:2] == ["full_name", "patterns"]
    assert LlamaForCausalLM._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert LlamaForCausalLM._no_split_modules == ["LlamaDecoderLayer"]
    assert hasattr(PreTrainedModel, "_keep_in_fp32_modules") and hasattr(
        PreTrainedModel, "_keep_in_fp32_modules_strict"
    )
    config = LlamaConfig()
    config._attn_implementation = "eager"
    assert config._attn_implementation == "eager"
    assert _params(_is_peft_model) == ["model"] and _params(update_fsdp_plugin_peft) == ["model", "accelerator"]
    # transformers 5: gradient_checkpointing is the deprecated alias of activation_checkpointing; both exist
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {"activation_checkpointing", "gradient_checkpointing"} <= fields


def test_accelerate_launch_internals(tmp_path):
    """accelerate still ignores an unknown fsdp_config key silently - what the doctor's key check exists for."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = tmp_path / "c.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: 'no'\nnum_machines: 1\n"
        "num_processes: 2\nmachine_rank: 0\nuse_cpu: true\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n  fsdp_no_such_key: 7\n"
    )
    dests = {action.dest for action in launch_command_parser()._actions}
    assert "fsdp_version" in dests and "fsdp_no_such_key" not in dests
    args = launch_command_parser().parse_args(["--config_file", str(config), "--main_process_port", "0", "t.py"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)
    assert env["FSDP_VERSION"] == "2" and not any("NO_SUCH" in key for key in env)


def test_peft_internals():
    from peft import LoraConfig, get_peft_model_state_dict
    from peft.tuners.tuners_utils import check_target_module_exists

    assert _params(check_target_module_exists) == ["config", "key"]
    config = LoraConfig(target_modules=["q_proj"])
    assert check_target_module_exists(config, "model.layers.0.self_attn.q_proj")
    assert not check_target_module_exists(config, "model.layers.0.self_attn.k_proj")
    assert {"state_dict", "adapter_name"} <= set(_params(get_peft_model_state_dict))


def test_packed_mask_skipped_with_a_cache():
    """Two examples packed in one block (position_ids restart): with the config's use_cache=True the second
    example attends to the first; with use_cache=False (what PackedCollator passes) its logits are its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    assert model.config.use_cache
    first, second = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 4))
    ids = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0)
    with torch.no_grad():
        alone = model(input_ids=second).logits
        cached = model(input_ids=ids, position_ids=positions).logits[:, 5:]
        uncached = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 5:]
    assert torch.allclose(uncached, alone, atol=1e-5), (uncached - alone).abs().max()
    assert not torch.allclose(cached, alone, atol=1e-3), "transformers now isolates packed examples with a cache"


# ---------------------------------------------------------------- the launched canaries (FSDP needs ranks)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from dist_utils import accelerate_launch, check, read_results

    out = tmp_path_factory.mktemp("compat")
    proc = accelerate_launch("cpu_fsdp2_rehearsal.yaml", "compat_canaries.py", str(out), timeout=300)
    check(proc)
    results = read_results(out)
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.distributed
def test_launched_stock_canaries(launched):
    for rank, found in launched.items():
        errors = {k: v for k, v in found.items() if isinstance(v, dict) and "crash" in v}
        assert not errors, (rank, errors)
        # fsdp1_plain_cpu_device
        assert "Inconsistent compute device and `device_id` on rank" in found["fsdp1_cpu0"]["error"]
        # fsdp1_internals / wrapper_name_segments
        internals = found["fsdp1_internals"]
        assert internals["is_root_before"] is None and internals["is_root_after"] is True, internals
        assert internals["is_flat_param"] and internals["numels_total"] == internals["total_numel"], internals
        assert internals["orig_param_dtype"] == "torch.float32", internals
        assert internals["wrapped_names"], internals
        # save_only_model_sharded
        assert (
            "save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'"
            in (found["save_only_model"]["error"])
        )
        # fsdp2_amp_forward: no autocast wrap, bf16 outputs (DDP/FSDP1 would give fp32)
        amp = found["fsdp2_amp"]
        assert amp["fsdp2"] and not amp["has_original_forward"] and amp["output_dtype"] == "torch.bfloat16", amp
        # accelerator_private_lists
        assert amp["models"] == 1 and amp["optimizers"] == 1, amp
        # integer_storage_under_fsdp (FSDP2): uint8 Params4bit left unsharded
        uint8 = found["fsdp2_uint8"]
        assert uint8["dtensor"] is False and (rank != 0 or uint8["warned"]), uint8  # warned on the main process
        # fsdp1_trainable_upcast
        upcast = found["fsdp1_upcast"]
        assert upcast["flat_dtype"] == "torch.float32" and upcast["orig_param_dtype"] == "torch.float32", upcast
        # sharded_merge_guard
        # sharded_merge_guard: peft merges into the packed 4-bit DTensor shard and fails (with accelerate's
        # wrapping the 4-bit weight loses its quant_state instead: "'DTensor' object has no attribute 'quant_state'")
        merge = found["sharded_merge"]["merge_error"] or ""
        assert merge.startswith("RuntimeError: Attempting to broadcast a dimension") or (
            "'DTensor' object has no attribute 'quant_state'" in merge
        ), merge
        # fsdp_adapter_saves: peft's own save of an FSDP2-sharded adapter
        assert found["sharded_merge"]["save_error"] == (
            "RuntimeError: Attempted to access the data pointer on an invalid python storage."
        ), found["sharded_merge"]


# ---------------------------------------------------------------- library errors name parameters, the CLI flags


def test_cli_shows_its_flags_for_the_parameters_library_errors_name():
    from hf_fsdp_qlora.cli._flags import cli_message
    from hf_fsdp_qlora.cli.convert import ConvertCommand
    from hf_fsdp_qlora.cli.doctor import DoctorCommand
    from hf_fsdp_qlora.cli.merge import MergeCommand
    from hf_fsdp_qlora.doctor import diagnose
    from hf_fsdp_qlora.merge.pipeline import merge_adapters

    names = {"base", "force", "dequantize", "output"}
    text = "`output` /x already exists. Pass `force=True`; pass `base` (and `dequantize='nf4'`); `seq_len` stays"
    assert cli_message(text, names) == (
        "--output /x already exists. Pass --force; pass --base (and --dequantize nf4); `seq_len` stays"
    )
    assert cli_message("Pass `double_quant=False` or `double_quant=True`", {"double_quant"}) == (
        "Pass --no-double-quant or --double-quant"
    )
    # every parameter a library message may name has the option cli_message writes for it
    for parser, func in (
        (MergeCommand().standalone_parser("merge-adapters"), merge_adapters),
        (DoctorCommand().standalone_parser("doctor"), diagnose),
    ):
        options = {o for action in parser._actions for o in action.option_strings}
        params = [p for p in _params(func) if p not in ("base", "adapter", "output", "model", "settings")]
        params += ["base", "adapter", "output"] if func is merge_adapters else []
        inverted = {
            "double_quant",
            "progress",
            "dequantize_experts",
            "fsdp_plugin",
        }  # --no-...; fsdp_plugin: Python only
        missing = [p for p in params if p not in inverted and cli_message(f"`{p}`", {p}) not in options]
        assert not missing, (func.__name__, missing)
    convert = {o for action in ConvertCommand().standalone_parser("convert")._actions for o in action.option_strings}
    assert {"--output", "--force", "--adapter-config"} <= convert


_FSDP2_MIXED_DTYPES = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
class Layer(torch.nn.Module):
    def __init__(self, lora_dtype):
        super().__init__()
        self.base = torch.nn.Linear(8, 8, dtype=torch.bfloat16).requires_grad_(False)
        self.a, self.b = torch.nn.Linear(8, 2), torch.nn.Linear(2, 8, dtype=lora_dtype)
    def forward(self, x):
        return self.base(x) + self.b(self.a(x))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ok = fully_shard(Layer(torch.float32), mp_policy=policy)  # frozen bf16 + trainable fp32: one group
x = torch.randn(2, 8, dtype=torch.bfloat16)
ok(x).float().sum().backward()
print("grad", ok.a.weight.grad.dtype)
bad = fully_shard(Layer(torch.bfloat16), mp_policy=policy)  # trainable fp32 + bf16: refused
try:
    bad(x).float().sum().backward()
except AssertionError as err:
    print("refused", err)
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp2_uniform_dtype_among_trainable_only():
    """FSDP2 asks one original dtype among a group's trainable params only: fp32 adapters next to the frozen bf16
    base in one fully_shard group (train/precision.py). Real FSDP2 on a 1-rank gloo group, in a subprocess."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-c", _FSDP2_MIXED_DTYPES.format(port=port)],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grad torch.float32" in proc.stdout  # the fp32 trainable shard got its fp32-reduced gradient
    assert "refused FSDP expects uniform original parameter dtype" in proc.stdout, proc.stdout
