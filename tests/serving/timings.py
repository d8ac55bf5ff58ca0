"""Seconds the serving check's stages took, filled by tests/serving/test_vllm.py, printed by its conftest."""

TIMES: dict[str, float] = {}
