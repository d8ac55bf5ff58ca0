"""Whether a checkpoint's config builds fused 3-D experts, read on meta before any weight (the loader's checks and
the streamed load of unchanged scripts both ask)."""

from __future__ import annotations

from .layouts import has_fused_experts

__all__ = ["config_has_fused_experts"]


def config_has_fused_experts(config, trust_remote_code: bool) -> bool:
    """Whether the model `config` builds (on meta) has fused 3-D expert weights; False when it cannot be built."""
    from ..towers import auto_class_for, meta_model  # an image-text-only family (Qwen3-VL-MoE): its own auto class

    try:
        skeleton = meta_model(config, auto_class_for(config), None, trust_remote_code)
    except Exception:  # noqa: BLE001 - no meta build from this config: nothing to decide here
        return False
    return has_fused_experts(skeleton)
