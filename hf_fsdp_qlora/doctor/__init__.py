"""Pre-flight checks for QLoRA under FSDP: what is inconsistent, and how much memory a run needs, before launch.

* :func:`check_setup` / :func:`diagnose` - every known failure of a setup, as :class:`Finding` s (id, severity,
  problem, the setting to change and the value to use), from an accelerate config and a model's config.json
  (built on the meta device: no weight is read), or from a live model and FSDP plugin (what our trainers do
  before wrapping, raising on errors).
* :func:`plan_memory` - the per-GPU memory plan (see :mod:`hf_fsdp_qlora.doctor.memory`).
* ``hf-fsdp-qlora doctor`` - the command line (:mod:`hf_fsdp_qlora.cli.doctor`).

JSON output (``hf-fsdp-qlora doctor --json``, or :func:`to_json`), schema version 1. Keys are only ever added;
a removal or a change of meaning bumps ``schema_version``::

    {
      "schema_version": 1,
      "ok": bool,                      # no finding of severity "error"
      "exit_code": 0 | 1,              # what the command exits with (2, usage errors, prints no JSON)
      "counts": {"error": int, "warning": int, "info": int},
      "setup": {                       # the resolved inputs
        "model": str, "quantization": "4bit" | "8bit" | null, "full_finetune": bool,
        "dtype": str, "quant_storage": str | null, "compute_dtype": str, "adapter_dtype": str | null,
        "lora_r": int, "use_dora": bool, "trainer": "hf_fsdp_qlora" | "transformers" | "accelerate",
        "loss_path": "ours" | "sft" | "stock" | "dpo",
        "seq_len": int, "batch_size": int, "gradient_checkpointing": bool, "optimizer": str,
        "num_gpus": int, "gpu_memory": int | null (bytes), "device_map": str | null, "mixed_precision": str,
        "quantize_experts": bool, "lora_target_parameters": [str] | null,   # mixture of experts
        "fsdp": {"version": 1 | 2 | null, "source": str, "sharding_strategy": str, "auto_wrap_policy": str,
                 "transformer_cls_to_wrap": [str] | null, "offload_params": bool,
                 "use_orig_params": bool | null, "activation_checkpointing": bool, "state_dict_type": str}
      },
      "findings": [                    # errors first, then warnings, then infos
        {"id": str, "severity": "error" | "warning" | "info", "problem": str, "setting": str, "value": str}
      ],
      "memory": {                      # null when the model's shapes are unknown
        "unit": "bytes",
        "num_gpus": int, "gpu_memory": int | null,
        "per_gpu": {"base_quantized", "base_quant_state", "base_other", "adapter", "gradients", "optimizer",
                    "fsdp_gathered", "activations", "logits_loss", "dequant_workspace", "runtime_overhead",
                    "total": int},    # bytes on each GPU; offloaded parts are 0 here
        "host_per_process": {"offloaded": int, "loading": int, "activations_offloaded": int},   # each key only when it applies
        "activations": {"checkpointing": "fsdp" | "trainer" | "model" | "none",
                        "with_checkpointing": int, "without_checkpointing": int},
        "offload": {"enabled": bool, "moved_to_host": int},
        "load_peak_per_gpu": int,      # whole quantized model on each GPU while loading (0: 16-bit, loads on CPU;
                                       # MoE via load_qlora_model: experts packed onto the GPU one at a time, their
                                       # 16-bit weights in host RAM: host_per_process["loading"])
        "checkpoint": {"weights": int, "optimizer": int, "total": int},   # bytes written per checkpoint, all ranks
        "local_shard": {"params_quantized", "quant_state", "params_other", "params_trainable", "gradients",
                        "optimizer"},  # per-rank persistent state, as measured by benchmarks/memory_plan.py
        "parameters": {"total": int, "active": int, "experts": int,   # active: per token (MoE: k routed experts)
                       "experts_bytes": int, "experts_bytes_16bit": int,   # MoE only: as held / in 16 bits
                       "total_with_16bit_experts": int},   # MoE with 4-bit experts: the per-GPU total of a stock load
        "verdict": "fits" | "tight" | "does_not_fit" | "unknown",
        "headroom": int | null,        # gpu_memory - total
        "notes": [str],
        "terms": [                     # the plan's table (hf_fsdp_qlora.doctor.terms), per_gpu's parts in order
          {"name": str, "bytes": int,  # bytes per GPU (per_gpu[name])
           "host_bytes": int,          # host RAM per process (offloaded parameters, activations)
           "reason": str}              # one line: what the term holds and how it is sharded
        ]
      }
    }

Finding ids: ``8bit-under-fsdp``, ``8bit-moe-experts``, ``experts-not-quantizable``, ``expert-lora-dropout``, ``expert-lora-no-match``, ``fsdp1-integer-storage``, ``fsdp2-integer-storage``,
``storage-vs-param-dtype``, ``mixed-precision-vs-storage``, ``storage-vs-compute-dtype``, ``fsdp{1,2}-fp32-adapters``, ``fsdp{1,2}-fp32-norms``,
``fsdp1-use-orig-params``, ``device-map-under-fsdp``, ``cpu-ram-efficient-loading-without-sync``,
``cpu-rehearsal-needs-gpu``, ``not-fsdp``, ``wrap-class-missing``, ``no-auto-wrap``,
``activation-checkpointing-twice``, ``activation-checkpointing-off``, ``checkpointing-unsupported``,
``sequence-parallel-refused``, ``load-does-not-fit``, ``memory-plan``,
``memory-tight``, ``memory-does-not-fit``, ``checkpoint-timeout``, ``optimizer-in-checkpoint``,
``padding-to-max-length``, ``eval-batch-too-large``.
"""

from __future__ import annotations

from ..model_shapes import ModelShape, model_shape
from .checks import Diagnosis, Finding, check_setup, diagnose, raise_for_errors
from .memory import MemoryPlan, parse_gpu_memory, plan_memory
from .report import SCHEMA_VERSION, render, to_json
from .setup import FsdpSettings, RunSetup, SetupInputError, read_accelerate_config

__all__ = [
    "SCHEMA_VERSION",
    "Diagnosis",
    "Finding",
    "FsdpSettings",
    "MemoryPlan",
    "ModelShape",
    "RunSetup",
    "SetupInputError",
    "check_setup",
    "diagnose",
    "model_shape",
    "parse_gpu_memory",
    "plan_memory",
    "raise_for_errors",
    "read_accelerate_config",
    "render",
    "to_json",
]
