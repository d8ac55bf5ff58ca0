"""README's main command: the CPU demo as written (examples/cpu_demo.sh). A tiny base pre-trained on the language
of the data knows none of the 20 taught capitals; QLoRA under FSDP2 on 2 CPU ranks teaches them; the merged model
answers the same; the loss curve is a valid PNG; the output carries none of the upstream noise we filter."""

import os
import re
import struct
import zlib

import pytest
from dist_utils import BIN, REPO, _env

pytestmark = pytest.mark.distributed

# Measured over seeds 0, 1 and 2: 0/20 before, 20/20 after (see the CHANGELOG); the margins absorb a fact or two.
MOST_RIGHT_BEFORE = 2
LEAST_RIGHT_AFTER = 18


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG after checking its signature, every chunk's CRC, IHDR first, IDAT that inflates
    and IEND last (AssertionError otherwise)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, kinds, idat = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        kinds.append(kind)
        idat += body if kind == b"IDAT" else b""
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    assert len(zlib.decompress(idat)) > 0
    return width, height


def test_png_size_rejects_a_damaged_file():
    """The oracle for the PNG check below: a good file passes, one flipped byte fails."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1), dpi=50)
    ax.plot([0, 1], [1, 0])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    good = buffer.getvalue()
    assert png_size(good) == (100, 50)
    bad = bytearray(good)
    bad[40] ^= 0xFF
    with pytest.raises(AssertionError):
        png_size(bytes(bad))


def _figure(label: str, out: str) -> tuple[int, int]:
    found = re.search(rf"{re.escape(label)}\s+(\d+)/(\d+)", out)
    assert found, f"no {label!r} line in the demo output"
    return int(found.group(1)), int(found.group(2))


def test_cpu_demo(tmp_path):
    import subprocess

    env = _env({"DEMO_OUTPUT": str(tmp_path / "demo"), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    env.pop("HF_FSDP_QLORA_VERBOSE", None)
    proc = subprocess.run(
        ["bash", "examples/cpu_demo.sh"],
        check=False,
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out, everything = proc.stdout, proc.stdout + proc.stderr

    assert "FSDP engaged: {'fsdp1_units': 0, 'flat_params': 0, 'fsdp2_modules'" in out
    assert re.search(r"\[hf_fsdp_qlora\.train\.callbacks\] hf_fsdp_qlora: FSDP2 engaged on 2 rank\(s\)", everything)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first / 3, f"the loss did not fall: {first} -> {last}"

    before, n = _figure("before QLoRA: 4-bit base", out)
    after, _ = _figure("after QLoRA: 4-bit base + adapter", out)
    merged, _ = _figure("merged (merge-adapters, 16-bit)", out)
    same, _ = _figure("merged answers equal 16-bit base + adapter (peft, unmerged) answers:", out)
    assert n == 20
    assert before <= MOST_RIGHT_BEFORE, f"the base already knew {before}/{n} facts: the demo would teach nothing"
    assert after >= LEAST_RIGHT_AFTER, f"QLoRA taught only {after}/{n} facts"
    assert same == n, f"the merged model answers {n - same} question(s) differently from base+adapter"
    assert merged >= LEAST_RIGHT_AFTER, f"the merged model knows only {merged}/{n} facts"
    assert "  after:  'The capital of France is Paris.'" in out
    assert "  merged: 'The capital of France is Paris.'" in out

    png = tmp_path / "demo" / "adapter" / "loss_curve.png"
    assert f"loss curve plot: {png}" in out
    width, height = png_size(png.read_bytes())
    assert width >= 300 and height >= 200
    assert (tmp_path / "demo" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "demo" / "merged" / "config.json").is_file()

    # quiet by default (hf_fsdp_qlora._quiet): none of the filtered upstream lines, on any rank
    assert "gemm_4bit_forward from kernels-community" not in everything
    assert "`is_gradient_checkpointing` is deprecated" not in everything
