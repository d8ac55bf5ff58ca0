"""Low CPU-RAM loading of a 4-bit base model under FSDP: only rank 0 reads and quantizes the checkpoint.

accelerate's ``cpu_ram_efficient_loading`` skips models with ``Params4bit`` weights, so by default every
rank reads the whole checkpoint and quantizes the whole model: N ranks on one machine need N times the
host RAM of one load. Here rank 0 loads as usual; every other rank builds the same quantized module
tree on the meta device (no checkpoint read, no quantization) and receives rank 0's tensors one at a
time. FSDP2 then shards as usual.

Launched for FSDP2 (``accelerate launch`` with ``fsdp_version: 2``, one shard dimension), a receiving
rank gets only the rows of each parameter that FSDP2 will keep on it: the parameter is allocated full
size but only that byte range is ever written, so the rest of it never becomes resident (the kernel
maps pages on first touch) and ``fully_shard`` copies exactly those rows into the rank's shard. The
peak RAM of such a rank is about 1/N of the quantized model instead of all of it. Until FSDP2 has
sharded the model such a rank's weights are incomplete: a forward pass raises, and
:func:`verify_partial_rows` (run by :class:`~hf_fsdp_qlora.FSDPQLoRACallback` once the model is
wrapped) checks that each rank's shard lies inside what it received. Any other launch (FSDP1, HSDP
and other device meshes) receives whole tensors.

The quantization state of each 4-bit weight (``weight.quant_state``: absmax, nested absmax/offset/state2,
code, shape, dtype, blocksize) is not a parameter; FSDP2 never moves it, yet every rank needs an exact
copy to dequantize the all-gathered weight. It travels pickled in one small ``broadcast_object_list``.

Use it through ``load_qlora_model(path, low_cpu_ram=True)``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from ..distributed import (
    collective_device,
    fsdp_requested_by_launch,
    launch_fsdp_version,
    multi_process_launch,
    parallelism_config_requested,
)
from ..dtypes import is_params4bit
from ..experts.placement import release_experts_dispatch
from ..experts.quantized import has_fused_experts
from ..rank_sync import agree_on_failure
from ._transfer import (
    _FLAG_ATTR,
    _ROWS_ATTR,
    _new_tensor,
    _receive_rows,
    _send_rows,
    _slots,
    params4bit_fields,
)

__all__ = ["load_base_low_ram", "materialize_from_rank0", "verify_partial_rows"]


logger = logging.getLogger(__name__)


def _ensure_process_group() -> bool:
    """Join the launch's process group if it is not joined yet; ``True`` when there are several ranks.

    Models are usually loaded before ``TrainingArguments`` creates accelerate's state (which joins the
    group), so the group may not exist yet. accelerate's ``PartialState`` joins it the way the Trainer
    will later (gloo for CPU ranks, with our CPU-rehearsal hook), and the Trainer then reuses it.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if not multi_process_launch():
        return False
    from accelerate.state import PartialState

    PartialState()
    return dist.is_initialized() and dist.get_world_size() > 1


def _manifest(model) -> list[dict]:
    """What a receiving rank needs to rebuild each tensor of rank 0's `model` (the tensor data excluded)."""
    entries, first_name = [], {}
    for name, module, local, is_param in _slots(model):
        tensor = (module._parameters if is_param else module._buffers)[local]
        entry = {"name": name, "param": is_param, "shape": tuple(tensor.shape), "dtype": tensor.dtype}
        entry["on_cpu"] = tensor.device.type == "cpu"
        # Tied weights (e.g. lm_head <-> embed_tokens) must stay one tensor on every rank, and travel once.
        entry["tied_to"] = first_name.get(id(tensor))
        first_name.setdefault(id(tensor), name)
        if is_param:
            entry["requires_grad"] = tensor.requires_grad
        if is_params4bit(tensor):
            entry["params4bit"] = params4bit_fields(tensor)
        entries.append(entry)
    return entries


def fsdp2_shard_world() -> int | None:
    """The number of FSDP2 shards when this launch is plain FSDP2 over all ranks (one mesh dimension), else None.

    Read from what ``accelerate launch`` exports, the same on every rank. HSDP and other parallelism
    configs (device meshes with more than one dimension) are excluded: their shard groups are not the world.
    """
    if not fsdp_requested_by_launch() or launch_fsdp_version() != 2 or parallelism_config_requested():
        return None
    return dist.get_world_size()


@torch.no_grad()
def materialize_from_rank0(model, src: int = 0, *, shard_world: int | None = None) -> int:
    """Collective: make every other rank's `model` a bit-exact copy of rank `src`'s, one tensor at a time.

    On rank `src`, `model` is the loaded model; elsewhere it is the same module tree on the meta device
    (see :func:`load_base_low_ram`). Receiving ranks allocate each tensor just before receiving it, so
    their peak RAM is one copy of the model as rank `src` holds it (4-bit weights stay packed).

    With `shard_world` (rank `src`'s value counts), each receiving rank gets only the rows of each
    parameter that FSDP2 will keep on it when sharding over `shard_world` ranks; see the module docstring.

    Returns:
        The number of tensors broadcast.

    Raises:
        RuntimeError: if the module trees differ between ranks (names are compared before any tensor moves).
    """
    is_src = dist.get_rank() == src
    slots, manifest, shard_world = _agree_on_manifest(model, src, shard_world)
    device = collective_device()
    made = {}
    sent = 0
    for (name, module, local, is_param), entry in zip(slots, manifest):
        store = module._parameters if is_param else module._buffers
        if entry["tied_to"] is not None:
            if not is_src:
                store[local] = made[entry["tied_to"]]
            continue
        if shard_world and is_param and len(entry["shape"]) >= 1:
            tensor, moved = _move_rows(store, module, local, entry, device, shard_world, src)
        else:
            tensor, moved = _move_whole(store, module, local, entry, device, src)
        sent += moved
        if not is_src:
            made[name] = store[local] = tensor
    if shard_world:
        object.__setattr__(model, _FLAG_ATTR, True)
    return sent


def _agree_on_manifest(model, src: int, shard_world: int | None) -> tuple[list, list[dict], int | None]:
    """Rank `src`'s manifest and `shard_world` on every rank, once every rank has checked it built the same tree.

    Returns:
        This rank's slots of `model`, rank `src`'s manifest, and rank `src`'s `shard_world`.
    """
    is_src = dist.get_rank() == src
    payload = [(_manifest(model), shard_world) if is_src else None]
    dist.broadcast_object_list(payload, src=src)
    manifest, shard_world = payload[0]
    slots = list(_slots(model))
    names = [s[0] for s in slots]
    error = None
    if names != [e["name"] for e in manifest]:
        missing = sorted({e["name"] for e in manifest} ^ set(names))[:5]
        error = RuntimeError(
            f"hf_fsdp_qlora: rank {dist.get_rank()} built a different module tree than rank {src} "
            f"(first differing tensors: {missing}). Every rank must load the same model with the same settings."
        )
    agree_on_failure(error)  # rank `src` must not go on broadcasting to a rank that gave up
    return slots, manifest, shard_world


def _move_rows(store, module, local, entry, device, shard_world: int, src: int):
    """Rank `src` sends each rank the rows of one parameter FSDP2 will keep there; returns (a receiver's tensor, 1)."""
    if dist.get_rank() == src:
        _send_rows(store[local].data.contiguous(), device, shard_world, src)
        return None, 1
    data = _receive_rows(entry, module, local, device, shard_world, src)
    if not entry["on_cpu"] and "params4bit" in entry:
        entry["params4bit"]["quant_state"].to(data.device)
    return _new_tensor(entry, module, data), 1


def _move_whole(store, module, local, entry, device, src: int):
    """Rank `src` broadcasts one whole tensor; returns (a receiver's tensor, how many tensors moved: 0 when empty)."""
    is_src = dist.get_rank() == src
    if is_src:
        data = store[local].data
        buffer = data if data.device == device and data.is_contiguous() else data.contiguous().to(device)
    else:
        buffer = torch.empty(entry["shape"], dtype=entry["dtype"], device=device)
    moved = 0
    if buffer.numel():
        dist.broadcast(buffer, src=src)
        moved = 1
    if is_src:
        return None, moved
    # NCCL moves GPU tensors only; put each tensor where rank `src` keeps it (CPU or this rank's GPU).
    if entry["on_cpu"] and buffer.device.type != "cpu":
        buffer = buffer.cpu()
    elif not entry["on_cpu"] and "params4bit" in entry:
        entry["params4bit"]["quant_state"].to(buffer.device)  # unpickled on rank `src`'s device
    return _new_tensor(entry, module, buffer), moved


def verify_partial_rows(model) -> int:
    """Collective, after FSDP2 wrapping: check that every rank's shard lies inside the rows it received.

    Call on every rank (the callback does). A no-op unless the base model was loaded with partial rows
    (:func:`materialize_from_rank0` with `shard_world`). On success the forward guard is lifted.

    Returns:
        The number of parameters checked on this rank.

    Raises:
        UnsupportedSetupError: on every rank, if some rank's FSDP2 shard reaches outside what it received
            (the model was wrapped differently from the launch's FSDP2 config).
    """
    from torch.distributed.tensor import DTensor, Shard

    from ..errors import UnsupportedSetupError

    if not any(getattr(m, _FLAG_ATTR, False) for m in model.modules()):
        return 0
    checked, outside = 0, []
    owners = [m for m in model.modules() if getattr(m, _ROWS_ATTR, None) is not None]
    for module in owners:
        for local, (first, end, total) in getattr(module, _ROWS_ATTR).items():
            param = module._parameters.get(local)
            checked += 1
            if not isinstance(param, DTensor) or param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
                outside.append(f"{type(module).__name__}.{local} (not an FSDP2 Shard(0) DTensor)")
                continue
            mesh_rank, world, rows = param.device_mesh.get_local_rank(), param.device_mesh.size(), param.shape[0]
            row_bytes = total // rows if rows else 0
            kept_first = min(rows, mesh_rank * -(-rows // world)) * row_bytes
            kept_end = kept_first + param.to_local().shape[0] * row_bytes
            if kept_end > kept_first and not (first <= kept_first and kept_end <= end):
                outside.append(f"{type(module).__name__}.{local} (keeps bytes {kept_first}-{kept_end}, "
                               f"received {first}-{end})")  # fmt: skip
    error = None
    if outside:
        error = UnsupportedSetupError(
            f"hf_fsdp_qlora: rank {dist.get_rank()} received only the rows FSDP2 over all ranks would keep on it "
            f"(load_qlora_model(low_cpu_ram=True)), but the model was wrapped differently: {outside[:3]}. Its "
            "weights would be incomplete. Load with low_cpu_ram=False for this setup, or launch with plain FSDP2 "
            "(fsdp_version: 2, no parallelism_config)."
        )
    agree_on_failure(error)
    for module in owners:
        object.__delattr__(module, _ROWS_ATTR)
    return checked


def _build_skeleton(model_name_or_path, quantization_config, dtype, trust_remote_code, from_pretrained_kwargs):
    """The module tree ``from_pretrained`` would build, 4-bit layers included, with every weight on meta."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.auto import get_hf_quantizer

    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    if "attn_implementation" in from_pretrained_kwargs:
        config._attn_implementation = from_pretrained_kwargs["attn_implementation"]
    hf_quantizer, config, _ = get_hf_quantizer(config, quantization_config, None, True, {})
    # include_buffers=False: buffers computed in __init__ (rotary inv_freq) stay real; they are re-sent anyway.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        hf_quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"}, checkpoint_files=None)
    model.hf_quantizer = hf_quantizer
    hf_quantizer.postprocess_model(model)  # sets is_loaded_in_4bit / config.quantization_config as on rank 0
    model.tie_weights()  # tied embeddings are one tensor here too, as after from_pretrained
    return model.eval()


def load_base_low_ram(
    model_name_or_path,
    *,
    quantization_config,
    dtype,
    trust_remote_code=False,
    whole_experts=False,
    prepare=None,
    streamed=None,
    **kwargs,
):
    """``AutoModelForCausalLM.from_pretrained`` in 4 bits (or 8, with `prepare`), where only rank 0 reads the checkpoint.

    Collective when launched with several processes (call it on every rank). Not launched distributed
    (a single process): a normal load, with a log line.

    Args:
        model_name_or_path: as for ``from_pretrained``.
        quantization_config: the ``BitsAndBytesConfig`` (4-bit) every rank uses; ``None`` for a pre-quantized
            checkpoint (its own ``quantization_config`` is used).
        dtype: the model dtype.
        trust_remote_code: passed to transformers.
        whole_experts: the caller quantizes fused MoE experts after the load: every rank then receives whole
            tensors (no per-rank rows) when the model has them.
        prepare: ``prepare(model)``, run on rank 0's loaded model and on the other ranks' meta skeleton before any
            tensor moves (an 8-bit base: :func:`~hf_fsdp_qlora.loading.int8.keep_int8_scales`, since bitsandbytes
            keeps the int8 row scales outside parameters and buffers, where no transfer sees them). Rank 0 then
            loads the whole checkpoint (no streaming: it quantizes 4-bit weights only).
        streamed: a :class:`~hf_fsdp_qlora.experts.stream.StreamedExperts`: rank 0 streams the experts from the
            files into 4 bits after its load (the caller hides them from ``from_pretrained``), and the other ranks
            receive the packed bytes and quantization constants, never 16-bit experts.
        **kwargs: passed to ``from_pretrained`` on rank 0 (``attn_implementation`` is honoured on every rank).

    Returns:
        The quantized base model, identical on every rank (packed bytes and quant states bit for bit).
    """
    load = functools.partial(_load_whole, model_name_or_path, quantization_config, dtype, trust_remote_code, kwargs)
    if not _ensure_process_group():
        logger.info("hf_fsdp_qlora: low_cpu_ram=True but this is a single process: loading normally")
        return load()
    model, shard_world, plan = _skeleton_and_plan(
        model_name_or_path, quantization_config, dtype, trust_remote_code, whole_experts, prepare, kwargs, streamed
    )
    decision = [None if plan is None else (plan["entries"] is not None, plan["reason"])]
    dist.broadcast_object_list(decision, src=0)  # rank 0's plan decides for every rank
    if decision[0] is not None and decision[0][0]:
        from ._stream import stream_to_ranks

        sent = stream_to_ranks(model, plan["entries"] if plan else None, shard_world, dtype)
        logger.info("hf_fsdp_qlora: rank %d has its rows of the base model (%d tensors)", dist.get_rank(), sent)
        return model
    if decision[0] is not None:
        logger.info("hf_fsdp_qlora: rank 0 loads the whole checkpoint: %s", decision[0][1])
    return _send_rank0_load(model, load, prepare, shard_world, streamed)


def _load_whole(model_name_or_path, quantization_config, dtype, trust_remote_code, kwargs):
    """A plain ``from_pretrained`` of the whole checkpoint (a single process, or rank 0 when it does not stream)."""
    from transformers import AutoModelForCausalLM

    # None (a pre-quantized checkpoint): not passed at all, since an explicit quantization_config=None
    # replaces the checkpoint's own in transformers' AutoConfig.
    quant = {} if quantization_config is None else {"quantization_config": quantization_config}
    model = AutoModelForCausalLM.from_pretrained(
        model_name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, **quant, **kwargs
    )
    release_experts_dispatch(model)  # experts loaded on the CPU (placement.py): real tensors before broadcasting
    return model


def _skeleton_and_plan(
    model_name_or_path, quantization_config, dtype, trust_remote_code, whole_experts, prepare, kwargs, streamed=None
):
    """Every rank's meta skeleton, the FSDP2 shard count rows are sent for, and rank 0's streaming plan (or None).

    Collective: a failure on any rank is raised on every rank before any tensor moves.
    """
    from ._stream import stream_plan

    shard_world = fsdp2_shard_world()
    model, error, plan = None, None, None
    try:
        # Under FSDP2, rank 0 streams the checkpoint tensor by tensor and keeps only its own rows too, when
        # the checkpoint maps one to one onto the model (see _stream); otherwise it loads it whole.
        model = _build_skeleton(model_name_or_path, quantization_config, dtype, trust_remote_code, kwargs)
        if prepare is not None:
            prepare(model)
        if shard_world and whole_experts and has_fused_experts(model):
            # Each rank quantizes the experts itself after the load (experts/quantized.py), and every rank needs the
            # quant states of all experts: it must hold all of their 16-bit rows, not only its own.
            logger.info("hf_fsdp_qlora: MoE experts to quantize: every rank receives whole tensors, not its rows")
            shard_world = None
        if shard_world and dist.get_rank() == 0 and prepare is None:
            plan = stream_plan(model, model_name_or_path, dtype, kwargs)
        if streamed is not None and dist.get_rank() != 0:
            streamed.stand_in(model)  # where rank 0's packed experts land (rank 0 loads its own model)
    except Exception as err:  # noqa: BLE001 - re-raised below; the other ranks must not wait in a broadcast
        error = err
    agree_on_failure(error)
    return model, shard_world, plan


def _send_rank0_load(skeleton, load, prepare, shard_world: int | None, streamed=None):
    """Rank 0 loads the whole checkpoint and every other rank receives its tensors into `skeleton`."""
    model, error = skeleton, None
    try:
        if dist.get_rank() == 0:
            model = load()
            if prepare is not None:
                prepare(model)
            if streamed is not None:
                streamed.quantize(model)  # the experts travel packed
    except Exception as err:  # noqa: BLE001 - re-raised below; the other ranks must not wait in a broadcast
        error = err
    agree_on_failure(error)
    sent = materialize_from_rank0(model, shard_world=shard_world)
    if streamed is not None:
        streamed.mark_received(model)
    logger.info("hf_fsdp_qlora: rank %d has the base model from rank 0 (%d tensors)", dist.get_rank(), sent)
    return model
