"""The entries of :mod:`hf_fsdp_qlora.error_index`, as plain data (the texts live here and nowhere else)."""

from __future__ import annotations

# Each pattern holds every wording a supported or commonly used version prints for the failure: torch <= 2.0 said
# "`FlatParameter` requires uniform dtype" / "Integer parameters are unsupported" where torch >= 2.1 says "Must flatten
# tensors with uniform dtype" / "Cannot flatten integer dtype tensors"; transformers 4.x said "can't be set to True
# simultaneously" where 5.x says "can't both be set to True". A `context` is what makes the cause certain in a log
# whose message has other causes too (`other_causes` says which, and how to tell them apart).
_REQUIRE_GRAD = r"[Oo]nly Tensors of floating point (?:and complex )?dtype can require gradients"
_DOCTOR = "tests/test_doctor.py::test_doctor_agrees_with_reality"
_CLASSIC = "tests/test_trainer_fsdp.py::test_fsdp1_classic_failures"

ENTRIES = (
    {
        "id": "cannot-flatten-integer",
        "title": "Cannot flatten integer dtype tensors",
        "text": "ValueError: Cannot flatten integer dtype tensors",
        "pattern": rf"Cannot flatten integer dtype tensors|Integer parameters are unsupported|{_REQUIRE_GRAD}",
        "context": r"Cannot flatten integer dtype tensors|Integer parameters are unsupported|Params4bit|load_in_4bit"
        r"|quant_storage",
        "other_causes": "`Only Tensors of floating point and complex dtype can require gradients` is raised for any "
        "integer tensor made trainable. Under FSDP with a quantized base it is this entry (accelerate#2813, "
        "bitsandbytes#1232: 4-bit weights stored as `uint8` while FSDP loads or wraps them) or an 8-bit base ([8-bit models "
        "under FSDP](#8bit-under-fsdp)); the traceback names `Params4bit` or `load_in_4bit` when it is this one.",
        "cause": "FSDP1 flattens every parameter of a unit into one floating-point FlatParameter. bitsandbytes stores "
        "4-bit weights packed in `uint8` by default (`bnb_4bit_quant_storage`; trl's `--load_in_4bit` keeps that "
        "default), and an 8-bit base holds `int8` weights: neither can be flattened.",
        "ours": "Before wrapping, the packed `uint8` bytes are viewed as the compute dtype (the bytes, never the "
        "values), so FSDP1 flattens them and the logits equal the unwrapped model's bit for bit; "
        "`load_qlora_model(path, dtype=torch.bfloat16)` stores them as bfloat16 in the first place. An 8-bit base "
        "trains too (see [8-bit models under FSDP](#8bit-under-fsdp)).",
        "stock_fix": "`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, "
        "bnb_4bit_quant_storage=torch.bfloat16)`: the storage dtype equal to the compute dtype and to FSDP's "
        "`mixed_precision`.",
        "tests": (_CLASSIC, _DOCTOR),
        "test_text": "Cannot flatten integer dtype tensors",
    },
    {
        "id": "uniform-dtype",
        "title": "Must flatten tensors with uniform dtype",
        "text": "ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32",
        "pattern": r"Must flatten tensors with uniform dtype|`?FlatParameter`? requires uniform dtype",
        "cause": "One FSDP1 unit holds parameters of two dtypes: peft's default `autocast_adapter_dtype=True` makes "
        "the LoRA weights float32 beside a bfloat16 base, and `prepare_model_for_kbit_training` upcasts norms and "
        "embeddings to float32.",
        "ours": "Every non-quantized floating parameter (adapters, norms, embeddings, biases, heads) is cast to the "
        "4-bit storage dtype before wrapping, under FSDP1 and FSDP2.",
        "stock_fix": "`get_peft_model(model, config, autocast_adapter_dtype=False)` and no "
        "`prepare_model_for_kbit_training` (freeze the base and enable gradient checkpointing yourself), or cast "
        "the peft model to the storage dtype before `Trainer` wraps it.",
        "tests": (_CLASSIC, _DOCTOR),
        "test_text": "Must flatten tensors with uniform dtype",
    },
    {
        "id": "uniform-requires-grad",
        "title": "Must flatten tensors with uniform requires_grad",
        "text": "ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
        "pattern": r"Must flatten tensors with uniform `?requires_grad|`?FlatParameter`? requires uniform `?requires_grad",
        "cause": "A transformer-layer FSDP1 unit holds frozen base weights and trainable LoRA weights, and "
        "`use_orig_params=False` needs one `requires_grad` per FlatParameter.",
        "ours": "Our trainers set `use_orig_params=True` for FSDP1 before wrapping (the doctor's "
        "`fsdp1-use-orig-params` rule).",
        "stock_fix": "`fsdp_use_orig_params: true` in the accelerate config.",
        "tests": (_DOCTOR,),
        "test_text": "Must flatten tensors with uniform `requires_grad`",
    },
    {
        "id": "8bit-under-fsdp",
        "title": "8-bit models under FSDP",
        "text": "AttributeError: 'Parameter' object has no attribute 'CB'\n"
        "ValueError: Cannot flatten integer dtype tensors   (FSDP1)\n"
        "RuntimeError: Creating a Parameter from an instance of type Int8Params requires that detach() returns "
        "an instance of the same type   (accelerate's FSDP2 path)\n"
        "RuntimeError: Only Tensors of floating point and complex dtype can require gradients   (FSDP loading)",
        "pattern": rf"has no attribute 'CB'|instance of type Int8Params|{_REQUIRE_GRAD}",
        "context": r"has no attribute 'CB'|Int8Params|Linear8bitLt|load_in_8bit",
        "other_causes": "`Only Tensors of floating point and complex dtype can require gradients` is raised for any "
        "integer tensor made trainable: under FSDP, an 8-bit base (its `int8` weights) or a 4-bit base stored as "
        "`uint8` (see [Cannot flatten integer dtype tensors](#cannot-flatten-integer)). The traceback names "
        "`Int8Params`, `Linear8bitLt` or `load_in_8bit` when it is this one.",
        "cause": "An 8-bit (`load_in_8bit=True`) base keeps int8 weights and their scales on bitsandbytes' `Int8Params`: "
        "FSDP1 cannot flatten them, and FSDP2's sharding replaces the parameter and loses the `CB`/`SCB` state.",
        "ours": "Trains. Before wrapping, each bitsandbytes `Linear8bitLt` becomes our `Int8Linear`: the same int8 "
        "codes viewed as the training dtype (a frozen parameter FSDP1 flattens and FSDP2 shards, 1/N per rank) and "
        "the row scales as a buffer beside them, with a forward that dequantizes the gathered rows. "
        "`load_qlora_model(path, bits=8)` loads it that way; a `load_in_8bit` model (trl's `--use_peft "
        "--load_in_8bit` through `python -m hf_fsdp_qlora.run`, our trainers, `FSDPQLoRACallback`) is converted by "
        "the pre-wrap pass. See [8-bit LoRA](int8.md).",
        "stock_fix": "None under FSDP: load the base in 4 bits (`BitsAndBytesConfig(load_in_4bit=True, "
        "bnb_4bit_quant_storage=torch.bfloat16)`), or train the 8-bit model with DDP instead of FSDP.",
        "tests": (
            "tests/test_trainer_fsdp.py::test_fsdp2_8bit",
            _CLASSIC,
            "tests/test_int8.py::test_trains_under_fsdp_as_single_process",
        ),
        "test_text": "has no attribute 'CB'",
    },
    {
        "id": "m1-m2-same-dtype",
        "title": "expected m1 and m2 to have the same dtype",
        "text": "RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16",
        "pattern": r"expected m1 and m2 to have the same dtype|expected mat1 and mat2 to have the same dtype"
        r"|mat1 and mat2 must have the same dtype|expected scalar type \w+ but found \w+",
        "context": r"peft[/\\]tuners[/\\]lora|lora_[AB]",
        "other_causes": "Any matmul of two dtypes raises it (torch >= 2.1 on CPU: `expected m1 and m2 ...`, on CUDA: "
        "`mat1 and mat2 must have the same dtype`; torch <= 2.0: `expected scalar type BFloat16 but found Float`): "
        "inputs or a head in float32 beside a bfloat16 model, a custom layer without autocast. It is this entry when "
        "the failing frame is in peft's LoRA layer (`peft/tuners/lora/`).",
        "cause": "float32 LoRA weights (peft's default `autocast_adapter_dtype=True`) beside a bfloat16 base under "
        "`Trainer` + FSDP1: transformers sets FSDP's mixed precision to the 4-bit storage dtype, so the adapter's "
        "matmul meets a bfloat16 input.",
        "ours": "Adapters are cast to the storage dtype before wrapping; FSDP's `param_dtype` is set to it.",
        "stock_fix": "`get_peft_model(model, config, autocast_adapter_dtype=False)` (adapters in the base's dtype).",
        "tests": (_CLASSIC, _DOCTOR),
        "test_text": "expected m1 and m2 to have the same dtype",
    },
    {
        "id": "merge-device-mismatch",
        "title": "Device mismatch in peft's merge_and_unload",
        "text": "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 "
        "and cpu!",
        "pattern": r"Expected all tensors to be on the same device",
        "context": r"merge_and_unload|_unload_and_optionally_merge|merge_adapter",
        "other_causes": "Most often it is not a merge: inputs left on the CPU while the model is on a GPU "
        "(`batch = {k: v.to(model.device) ...}`), a `device_map` that split the model, a tensor created inside a "
        "custom layer without `device=`. It is this entry when the traceback goes through `merge_and_unload` (torch "
        "2.x wordings: `... but found at least two devices, cuda:0 and cpu!` and, newer, `... but got mat2 is on "
        "cpu, different from other tensors on cuda:0`).",
        "cause": "`merge_and_unload` merges the live model in place: a base spread over GPU and CPU "
        '(`device_map="auto"`, FSDP CPU offload) or an adapter loaded on another device than its base puts the '
        "two operands of one update on two devices. On an FSDP2-sharded model the merge fails with "
        "`'DTensor' object has no attribute 'quant_state'` instead.",
        "ours": "`merge-adapters` never merges the live model: it streams the base's safetensors shards and the "
        "adapter files and computes every update on one device (`--device cpu` or `cuda`). Merging a sharded "
        "model in place is refused with a message that says to save the adapter and run `merge-adapters`.",
        "stock_fix": 'Reload the 16-bit base on one device (`device_map={"": "cpu"}` or `{"": 0}`), load the '
        "adapter with `PeftModel.from_pretrained` onto the same device, then `merge_and_unload()`.",
        "tests": (
            "tests/test_merge.py::test_tensors_equal_peft_merge_within_one_rounding",
            "tests/test_cuda.py::test_merge_on_cuda_equals_cpu_merge_and_peft",
        ),
        "cpu": "The stock text needs two devices, so a CPU-only machine cannot reproduce it; `tests/test_cuda.py` runs "
        "our merge on a GPU.",
    },
    {
        "id": "collective-timeout",
        "title": "Collective timeout (NCCL watchdog)",
        "text": "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=ALLGATHER, ...) "
        "ran for 1800012 milliseconds before timing out.",
        "pattern": r"Watchdog caught collective operation timeout|collective operation timeout|Timeout\(ms\)=\d+"
        r"|Timed out waiting \d+ms for (?:recv|send) operation",
        "cause": "One rank works alone longer than the collective timeout (saving a large checkpoint, gathering a "
        "full state dict, evaluating on rank 0 only) while the others wait in a collective. transformers' "
        "default `ddp_timeout` is 1800 s.",
        "ours": "`FSDPQLoRATrainingArguments` defaults to `ddp_timeout=7200`; the doctor's `checkpoint-timeout` rule "
        "estimates a checkpoint's write time against the timeout.",
        "stock_fix": "`TrainingArguments(ddp_timeout=7200)` (seconds; more for very large models), or "
        "`InitProcessGroupKwargs(timeout=timedelta(hours=2))` for a plain accelerate loop.",
        "tests": ("tests/test_doctor.py::test_memory_checks_on_large_models",),
        "cpu": "NCCL's watchdog exists only on GPUs: the stock text cannot be reproduced on CPU. The test checks the "
        "doctor's `checkpoint-timeout` finding against `ddp_timeout`.",
    },
    {
        "id": "duplicate-batches",
        "title": "A dataloader without DistributedSampler",
        "text": "DuplicateBatchesError: All 2 ranks would draw the same samples (dataset indices [0, 1, ...]... in "
        "the first batch): the data is not split across ranks, so every GPU repeats the same work.",
        "pattern": r"DuplicateBatchesError|would draw the same samples",
        "cause": "A dataloader built without a `DistributedSampler` (an overridden `get_train_dataloader`, an "
        "`IterableDataset` not split per rank) gives every rank the same batches. The stock stack is silent: "
        "the run trains N times slower than it should, on 1/N of the data. The text above is ours.",
        "ours": "`DistinctBatchesCallback` compares the ranks' first batch indices before the first step and stops "
        "with `DuplicateBatchesError` (`check_distinct_batches=2`; `0` turns it off).",
        "stock_fix": "Let `Trainer` build the dataloader from a `Dataset` with `__len__`, or split an "
        "`IterableDataset` per rank with `datasets.distributed.split_dataset_by_node`.",
        "tests": (
            "tests/test_semantics_dist.py::test_identical_rows_train_and_unsplit_data_stops",
            "tests/test_trainer_fsdp.py::test_duplicate_batches_fail_fast",
        ),
        "test_text": "DuplicateBatchesError",
    },
    {
        "id": "cuda-oom-full-finetune",
        "title": "CUDA out of memory in a full fine-tune",
        "text": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity "
        "of 23.55 GiB of which ...",
        "pattern": r"CUDA out of memory|HIP out of memory|OutOfMemoryError",
        "other_causes": "Any run that does not fit prints it (`torch.cuda.OutOfMemoryError` in torch 1.13-2.4, "
        "`torch.OutOfMemoryError` from 2.5). This entry's cause is certain only for a full fine-tune (every "
        "parameter trains, no LoRA) without activation checkpointing. Under QLoRA it is mostly the activations and "
        "the logits (sequence length x batch x vocabulary), an eval batch larger than the training one, or a 4-bit "
        "base left unsharded (`uint8` storage under FSDP2): `hf-fsdp-qlora doctor` with the run's settings gives "
        "the memory per GPU, part by part.",
        "cause": "A full fine-tune without activation checkpointing keeps every layer's activations for the "
        "backward, on top of the weights, gradients and two fp32 Adam states per parameter.",
        "ours": "`hf-fsdp-qlora doctor --full-finetune --gpu-memory 24GB` plans the memory per GPU before launch "
        "(`activation-checkpointing-off` is an error when the plan does not fit), and the shipped "
        "`llamaguard3_1b_1x24gb.yaml` turns on FSDP's activation checkpointing and offload.",
        "stock_fix": "`fsdp_activation_checkpointing: true` in the accelerate config (and `gradient_checkpointing="
        "False` in `TrainingArguments`: not both), plus `fsdp_offload_params: true` for a single 24 GB GPU.",
        "tests": ("tests/test_doctor.py::test_llamaguard_1b_full_finetune_1x24gb_verdict_matches_shipped_config",),
        "cpu": "A CPU has no CUDA memory to exhaust: the stock text cannot be reproduced here. The test checks the "
        "doctor's plan and verdict for the shipped config.",
    },
    {
        "id": "checkpoint-bloat",
        "title": "Checkpoints bloated by optimizer state",
        "text": "OSError: [Errno 28] No space left on device",
        "pattern": r"No space left on device",
        "cause": "Every `save_steps` checkpoint holds the optimizer state (Adam: two fp32 values per trainable "
        "parameter) and, with FSDP's SHARDED_STATE_DICT or a full fine-tune, the whole model: checkpoints grow "
        "to several times the adapter and fill the disk.",
        "ours": "Checkpoints hold the adapter gathered from every rank plus only the adapter's optimizer state; the "
        "log states each checkpoint's size, and the doctor's `optimizer-in-checkpoint` finding gives it before "
        "launch. `save_only_model=True` writes the adapter alone.",
        "stock_fix": "`save_only_model=True` (not with `fsdp_state_dict_type: SHARDED_STATE_DICT`, which transformers "
        "refuses) and `save_total_limit=2`.",
        "tests": ("tests/test_checkpoints.py::test_checkpoint_contents_and_sizes",),
        "cpu": "A full disk is not reproduced; the test measures what each checkpoint holds.",
    },
    {
        "id": "all-labels-masked",
        "title": "NaN loss from all -100 labels",
        "text": "{'loss': 'nan', 'grad_norm': 'nan', 'learning_rate': ..., 'epoch': ...}",
        "pattern": r"'loss': '?nan|\"loss\": NaN|NoLabelsError|Every label in .* is -100",
        "context": r"NoLabelsError|Every label in .* is -100",
        "other_causes": "A NaN loss also comes from overflow: float16 without loss scaling, a learning rate too high, "
        "inf or NaN in the inputs or the weights (then the first steps' losses are finite and `grad_norm` grows "
        "first). It is this entry when a batch has no label but -100: our `LabelsCheckCallback` says so with "
        "`NoLabelsError`; on the stock stack, count `(batch['labels'] != -100).sum()` per batch.",
        "cause": "Every label of the batch is -100 (the ignore index): `max_length` truncated every completion "
        "away, or a completion-only collator masked everything. The mean cross entropy over zero tokens is "
        "0/0 = nan (or 0), and nothing is learned.",
        "ours": "`LabelsCheckCallback` stops the run after the first batch with `NoLabelsError` naming the cause; "
        "`tokenize_completion_only` warns when `max_length` leaves no completion token.",
        "stock_fix": "Raise `max_length` (`SFTConfig(max_length=...)`) above the longest prompt plus some completion, "
        "or truncate prompts instead of completions.",
        "tests": (
            "tests/test_error_index.py::test_all_masked_labels_give_nan_stock_and_stop_ours",
            "tests/test_semantics_dist.py::test_all_labels_masked_stops",
        ),
        "test_text": "'loss': 'nan'",
    },
    {
        "id": "activation-checkpointing-twice",
        "title": "Activation checkpointing set twice",
        "text": "ValueError: `fsdp_config['activation_checkpointing']` (FSDP's own activation checkpointing) and the "
        "`activation_checkpointing` training argument can't both be set to True. Use FSDP's activation "
        "checkpointing when using FSDP.",
        "pattern": r"can't both be set to True|can't be set to True simultaneously",
        "cause": "trl's configs default to `gradient_checkpointing=True`, and the shipped FSDP2 configs set "
        "`fsdp_activation_checkpointing: true`: `Trainer.__init__` raises before any callback runs.",
        "ours": "Applied exactly once: when the accelerate config asks for FSDP's, that one is kept and the "
        "Trainer's and the model's are turned off; one line says which.",
        "stock_fix": "`gradient_checkpointing=False` in the training arguments when the accelerate config has "
        "`fsdp_activation_checkpointing: true` (or the reverse).",
        "tests": (_DOCTOR,),
        "test_text": "can't both be set to True",
    },
    {
        "id": "checkpoint-recompute-metadata",
        "title": "CheckpointError: recomputed values have different metadata",
        "text": "torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the following "
        "tensors have different metadata than during the forward pass.",
        "pattern": r"Recomputed values for the following tensors have different metadata",
        "cause": "With `bf16=True` under FSDP1 accelerate upcasts trainable FlatParameters (the LoRA weights) to "
        "float32; with LoRA dropout and non-reentrant activation checkpointing the forward saved bfloat16 "
        "tensors and the recomputation produces float32 ones.",
        "ours": "Trainable parameters stay in the training dtype under FSDP1 (the upcast is undone after wrapping): "
        "one dtype for every tensor.",
        "stock_fix": "`bf16=False` when the model is already stored in bfloat16 (the storage dtype is the compute "
        "dtype), or FSDP2 (`fsdp_version: 2`).",
        "tests": (
            "tests/test_error_index.py::test_stock_fsdp1_errors_reproduced",
            "tests/test_recipes.py::test_route_trains_saves_and_resumes",
        ),
        "test_text": "have different metadata",
    },
    {
        "id": "weight-must-be-2d",
        "title": "'weight' must be 2-D",
        "text": "RuntimeError: 'weight' must be 2-D",
        "pattern": r"'weight' must be 2-D",
        "context": r"\bFSDP\b|FullyShardedDataParallel|torch[/\\]distributed[/\\]fsdp|fsdp_config",
        "other_causes": "DeepSpeed ZeRO-3 partitions the embedding the same way (generate outside "
        "`deepspeed.zero.GatheredParameters`), and the traceback of either names neither: `generate` is reached "
        "through the wrapper's attribute forwarding. It is this entry when the log shows FSDP (accelerate's "
        "`Distributed environment: FSDP`, a `FullyShardedDataParallel` frame, an `fsdp_config`).",
        "cause": "`model.generate` on an FSDP1-wrapped model bypasses the root unit's forward, so the embeddings and "
        "LM head it holds stay flattened and sharded (1-D).",
        "ours": "`generate_under_fsdp(model, ...)` gathers the root unit only (`summon_full_params(recurse=False)` "
        "for FSDP1, `unshard()` for FSDP2) and sets `synced_gpus=True`; `SampleGenerationsCallback` uses it.",
        "stock_fix": "Call `model.generate(..., synced_gpus=True)` inside `with FSDP.summon_full_params(model, "
        "recurse=False):` on every rank.",
        "tests": (
            "tests/test_error_index.py::test_stock_fsdp1_errors_reproduced",
            "tests/test_eval_generate.py::test_evaluate_predict_generate_before_training",
        ),
        "test_text": "'weight' must be 2-D",
    },
    {
        "id": "model-and-optimizer-together",
        "title": "A model and optimizer must be passed together",
        "text": "ValueError: When using FSDP2, a model and optimizer must be passed together to "
        "`Accelerator.prepare()` as the optimizer needs to have its parameters modified after the model is converted.",
        "pattern": r"a model and optimizer must be passed together",
        "cause": "`trainer.evaluate()` or `predict()` before `train()` under FSDP2: `Trainer` prepares the model "
        "alone (huggingface/transformers#39961).",
        "ours": "Our trainers, and any `Trainer` built with `FSDPQLoRACallback`, call "
        "`hf_fsdp_qlora.prepare_for_evaluation(trainer)` first, which wraps the model as `train()` would; the "
        "training that follows is unchanged.",
        "stock_fix": "No setting avoids it in transformers 5.23: evaluate after `train()` (no `eval_on_start=True`), "
        "or add `FSDPQLoRACallback()` to the trainer's callbacks.",
        "tests": (
            "tests/test_eval_generate.py::test_stock_trainer_evaluate_before_training_is_the_upstream_bug",
            "tests/test_eval_generate.py::test_evaluate_predict_generate_before_training",
        ),
        "test_text": "a model and optimizer must be passed together",
    },
    {
        "id": "bf16-gpu-on-cpu",
        "title": "Your setup doesn't support bf16/gpu",
        "text": "ValueError: Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the model "
        "on CPU.",
        "pattern": r"Your setup doesn't support bf16/gpu",
        "cause": "`TrainingArguments(bf16=True)` (trl's configs default to it) on a machine without a GPU.",
        "ours": "In a CPU rehearsal launch (an FSDP launch on a machine without an accelerator) the rehearsal hook "
        "sets `use_cpu=True`, so trl's defaults train as they are.",
        "stock_fix": "`use_cpu=True` in the training arguments (or `bf16=False`).",
        "tests": (
            "tests/test_compat.py::test_stock_training_arguments_refuse_bf16_on_cpu",
            "tests/test_recipes.py::test_trl_script_unchanged_through_run",
        ),
        "test_text": "Your setup doesn't support bf16/gpu",
    },
    {
        "id": "no-available-devices",
        "title": "There are currently no available devices found",
        "text": "RuntimeError: There are currently no available devices found, must be one of 'XPU', 'CUDA', ...",
        "pattern": r"There are currently no available devices found",
        "cause": "`fsdp_sync_module_states` or `fsdp_cpu_ram_efficient_loading` on a machine without a GPU: "
        "accelerate's FSDP plugin looks for an accelerator.",
        "ours": "The doctor's `cpu-rehearsal-needs-gpu` rule names the setting; the shipped CPU rehearsal configs "
        "leave both off.",
        "stock_fix": "`fsdp_sync_module_states: false` and `fsdp_cpu_ram_efficient_loading: false` for CPU runs.",
        "tests": (_DOCTOR,),
        "test_text": "There are currently no available devices found",
    },
    {
        "id": "dora-fsdp1-index-error",
        "title": "DoRA under FSDP1: tuple index out of range",
        "text": "IndexError: tuple index out of range\n"
        '  File ".../peft/tuners/lora/dora.py", in get_lora_weight\n'
        "    x_eye = torch.eye(lora_A.weight.shape[1], device=lora_A.weight.device, dtype=lora_A.weight.dtype)",
        "pattern": r"tuple index out of range[\s\S]*get_lora_weight|get_lora_weight[\s\S]*tuple index out of range",
        "cause": "DoRA (`LoraConfig(use_dora=True)`) under FSDP1. transformers installs peft's FSDP1 wrap policy, which "
        "makes each `lora_A`/`lora_B` Linear and each DoRA magnitude its own FSDP unit; DoRA's forward reads "
        "`lora_A.weight.shape[1]` before `lora_A` runs, when that weight is a 1-D flat shard. Every rank fails in "
        "the first forward. FSDP2 and single-process training are not affected.",
        "ours": "Before wrapping, our trainers, the callback and `-m hf_fsdp_qlora.run` make each DoRA layer read the "
        "width from `lora_A.in_features` (peft's computation otherwise, and peft's units, so no extra memory); the "
        "losses then equal the single-process run's (see [Adapters and checkpoints](adapters-and-checkpoints.md#dora)).",
        "stock_fix": "Use FSDP2 (`fsdp_version: 2`), or add `FSDPQLoRACallback()` to the trainer's callbacks.",
        "tests": (
            "tests/test_dora.py::test_stock_trainer_fails_under_fsdp1",
            "tests/test_dora.py::test_dora_trains_like_single_process",
        ),
        "test_text": "tuple index out of range",
    },
    {
        "id": "expert-lora-fsdp1-reshape",
        "title": "LoRA on MoE experts under FSDP1: shape '[8, -1, 2048]' is invalid",
        "text": "RuntimeError: shape '[8, -1, 2048]' is invalid for input of size 2048\n"
        '  File ".../peft/tuners/lora/layer.py", in get_delta_factors\n'
        "    weight_A = weight_A.reshape(self.num_experts, -1, weight_A.shape[-1])  # (experts, rank, in)",
        "pattern": r"shape '\[\d+, -1, \d+\]' is invalid for input of size \d+",
        "context": r"get_delta_factors|get_delta_weight|ParamWrapper|_activate_lora|target_parameters",
        "other_causes": "Any reshape of a tensor of the wrong size prints this. It is this entry when the traceback "
        "goes through peft's `ParamWrapper` (`_activate_lora`, `get_delta_factors` or `get_delta_weight`) under "
        "FSDP1: LoRA on fused expert weights (`target_parameters`, trl's `--lora_target_parameters`).",
        "cause": "LoRA on a mixture-of-experts model's fused expert weights (peft's `target_parameters`, e.g. "
        "`mlp.experts.gate_up_proj`) under FSDP1. transformers installs peft's FSDP1 wrap policy, which makes each "
        "`lora_A`/`lora_B` Linear its own FSDP unit; peft's `ParamWrapper` reads `lora_A.weight` and reshapes it to "
        "`[experts, rank, in]` outside that unit's forward, where the weight is this rank's 1-D flat shard. Every "
        "rank fails in the first forward. FSDP2 and single-process training are not affected.",
        "ours": "The experts are quantized to 4 bits (`load_qlora_model`, and trl's `--load_in_4bit` under "
        "`-m hf_fsdp_qlora.run`) and our 4-bit experts module runs the adapters through their own forwards, so FSDP1 "
        "gathers them first; the adapters stay in peft's format and the first step's loss equals the single-process run's (see "
        "[Mixture of experts](moe.md)).",
        "stock_fix": "Use FSDP2 (`fsdp_version: 2`), or load with `hf_fsdp_qlora.load_qlora_model` (4-bit experts) "
        "or run the script through `python -m hf_fsdp_qlora.run`.",
        "tests": (
            "tests/test_moe.py::test_stock_peft_expert_lora_fails_under_fsdp1",
            "tests/test_moe.py::test_fsdp_trains_lora_on_4bit_experts",
        ),
        "test_text": "is invalid for input of size",
    },
)
