"""Seconds the serving check's stages took and what vLLM said, filled by tests/serving/test_vllm.py, printed by its
conftest."""

TIMES: dict[str, float] = {}
FINDINGS: list[str] = []
