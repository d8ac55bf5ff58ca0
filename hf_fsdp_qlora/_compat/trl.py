"""trl: its colocated vLLM generation (GRPO/RLOO), which merges the adapter into the base at every sync."""

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
)
