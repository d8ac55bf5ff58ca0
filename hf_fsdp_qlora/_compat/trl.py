"""trl: its colocated vLLM generation (GRPO/RLOO), which merges the adapter into the base at every sync; its fused LM
head, which takes ``model.base_model`` for the text backbone."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="trl_vllm_adapter_sync",
        upstream="trl <= 1.16 (VLLMGeneration._init_vllm / sync_weights, looked up as a module global by "
        "trl.trainer.grpo_trainer and rloo_trainer; trl#5975, PR 6007 open) with vllm 0.32",
        works_around="colocated vLLM with a peft model: trl merges the adapter into the base and sends every weight "
        "at each sync (impossible on FSDP2 4-bit shards: \"'DTensor' object has no attribute 'quant_state'\"), and "
        'builds its engine with quantization="bitsandbytes", which vLLM 0.32 refuses; our subclass serves the '
        "adapter as vLLM LoRA and syncs the LoRA tensors only, for the models our mixin marked",
        where=("hf_fsdp_qlora.train.vllm_sync.adapter_generation_class", "hf_fsdp_qlora.train.vllm_sync._install"),
        remove_when="trl syncs adapter-only itself (PR 6007) and builds its engine for a sharded 4-bit policy",
        canary="tests/test_vllm_sync.py::test_stock_trl_vllm_sync_merges_and_sends_every_weight",
    ),
    Workaround(
        key="thread_pool_at_exit",
        upstream="trl <= 1.16 colocated vLLM (vllm 0.32's engine leaves a concurrent.futures thread pool open); "
        "Python stops such pools only in the interpreter's own exit (concurrent.futures.thread._python_exit)",
        works_around="finish_distributed skips the interpreter teardown (os._exit): an idle pool worker, a "
        "non-daemon thread, was joined forever and the rank never exited",
        where=("hf_fsdp_qlora.train.finish._stop_idle_thread_pools",),
        remove_when="never while finish_distributed skips the interpreter's teardown; the canary runs the path",
        canary="tests/test_finish.py::test_finished_ranks_leave_without_waiting_and_keep_threads_and_none",
    ),
    Workaround(
        key="trl_fused_head_backbone",
        upstream="trl <= 1.16 (SFTTrainer always patches in trl.trainer.utils.add_fused_lm_head, which runs "
        "model.base_model and reads last_hidden_state) with transformers 5.23 (Llama4ForCausalLM and "
        "MllamaForCausalLM: base_model_prefix 'language_model' but the backbone is .model; "
        "Llama4ForConditionalGeneration: prefix 'model', no .model)",
        works_around="\"'...CausalLMOutputWithPast' object has no attribute 'last_hidden_state'\" at the first step: "
        "the model's class becomes a same-named subclass whose base_model is the text backbone; for "
        "Llama4ForConditionalGeneration a pre-hook merges the image features as the class's forward does (a marker "
        "attribute of ours, _hf_fsdp_qlora_merges_images, keeps it registered once)",
        where=("hf_fsdp_qlora.train.backbone.expose_text_backbone", "hf_fsdp_qlora.train.backbone._merge_images"),
        remove_when="trl finds these classes' text backbone itself (the canary then fails)",
        canary="tests/test_multimodal.py::test_stock_trl_fused_lm_head_fails_on_these_classes",
    ),
)
