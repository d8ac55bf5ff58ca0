"""The error index: every entry backed by tests that exist and hold its text; `hf-fsdp-qlora explain` finds them.

New reproductions of stock texts (not elsewhere in the suite) run here: the all -100 NaN loss in-process, and two
FSDP1 failures in one 2-rank torchrun launch (tests/scripts/stock_errors.py), each beside our route.
"""

from __future__ import annotations

import re
import subprocess
import sys
import traceback

import pytest
from dist_utils import REPO, check, read_results, torchrun
from readme_blocks import node_exists

from hf_fsdp_qlora.cli.main import main
from hf_fsdp_qlora.error_index import ERRORS, find_known_errors

REQUIRED = {
    "cannot-flatten-integer", "uniform-dtype", "8bit-under-fsdp", "m1-m2-same-dtype", "merge-device-mismatch",
    "collective-timeout", "duplicate-batches", "cuda-oom-full-finetune", "checkpoint-bloat", "all-labels-masked",
    "activation-checkpointing-twice", "checkpoint-recompute-metadata", "weight-must-be-2d",
    "model-and-optimizer-together", "bf16-gpu-on-cpu",
}  # fmt: skip


def _sources(node: str) -> str:
    """The text of a test node's file and of the worker scripts (tests/scripts/*.py) that file names."""
    path = REPO / node.partition("::")[0]
    text = path.read_text()
    for script in set(re.findall(r"\b(\w+)(?:\.py\b|\"|\s+as worker)", text)):
        worker = REPO / "tests" / "scripts" / f"{script}.py"
        if worker.is_file():
            text += worker.read_text()
    return text


def test_the_index_covers_the_known_errors():
    ids = [entry.id for entry in ERRORS]
    assert len(ids) == len(set(ids))
    assert REQUIRED <= set(ids), REQUIRED - set(ids)


@pytest.mark.parametrize("entry", ERRORS, ids=lambda e: e.id)
def test_every_entry_is_backed_by_tests_that_hold_its_text(entry):
    assert entry.tests and entry.cause and entry.ours and entry.stock_fix
    for node in entry.tests:
        assert node_exists(node), f"{entry.id}: no test {node}"
    assert re.search(entry.pattern, entry.text), f"{entry.id}: its pattern does not find its own text"
    if entry.test_text is None:
        assert entry.cpu, f"{entry.id}: neither a reproduced text nor the reason a CPU cannot reproduce it"
        return
    assert entry.test_text in entry.text
    holders = [node for node in entry.tests if entry.test_text in _sources(node)]
    assert holders, f"{entry.id}: no backing test's file holds {entry.test_text!r}"


def _explain(capsys, monkeypatch, text):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = main(["explain", "-"])
    return code, capsys.readouterr().out


def test_explain_maps_a_real_traceback_to_its_entry(tmp_path, capsys, monkeypatch):
    """A traceback raised here by the stock stack (TrainingArguments' bf16 refusal on a CPU-only machine)."""
    import torch
    from transformers import TrainingArguments

    if torch.cuda.is_available():
        pytest.skip("bf16 is allowed with a GPU")
    try:
        TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to=[])
    except ValueError:
        real = traceback.format_exc()
    code, out = _explain(capsys, monkeypatch, "some log line\n" + real)
    assert code == 0 and "[bf16-gpu-on-cpu]" in out and "use_cpu=True" in out, out
    assert out.count("== ") == 1


def test_explain_reads_a_file_and_lists(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(
        "[rank0]: ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32\n"
    )
    assert main(["explain", str(log)]) == 0
    assert "[uniform-dtype]" in capsys.readouterr().out
    assert main(["explain", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(entry.id in listed for entry in ERRORS)


def test_explain_unknown_text_exits_1_and_bad_file_exits_2(tmp_path, capsys, monkeypatch):
    code, out = _explain(capsys, monkeypatch, "Traceback (most recent call last):\nKeyError: 'foo'\n")
    assert code == 1 and "no known error" in out
    assert main(["explain", str(tmp_path / "missing.log")]) == 2
    assert "cannot read FILE" in capsys.readouterr().err


def test_explain_help_is_instant_and_says_what_it_does():
    code = (
        "import sys\nfrom hf_fsdp_qlora.cli.main import main\ntry:\n    main(['explain', '--help'])\n"
        "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'explain imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "traceback" in proc.stdout and "exit status: 0" in proc.stdout and "explain -" in proc.stdout


def test_all_masked_labels_give_nan_stock_and_stop_ours(capsys, monkeypatch):
    """Stock: the mean cross entropy over no label is nan. Ours: NoLabelsError before the step."""
    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from hf_fsdp_qlora import NoLabelsError
    from hf_fsdp_qlora.train.hygiene import check_labels

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(3, 200, (2, 8))
    labels = torch.full_like(ids, -100)
    assert torch.isnan(model(input_ids=ids, labels=labels).loss)
    assert not torch.isnan(model(input_ids=ids, labels=ids).loss)  # the oracle: real labels give a loss
    with pytest.raises(NoLabelsError) as err:
        check_labels(labels)
    code, out = _explain(capsys, monkeypatch, f"{{'loss': 'nan', 'grad_norm': 'nan'}}\n{err.exconly()}")
    assert code == 0 and "[all-labels-masked]" in out


@pytest.fixture(scope="module")
def stock_fsdp1(tmp_path_factory):
    from tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "llama", "llama")
    out = tmp_path_factory.mktemp("stock_errors") / "run"
    proc = torchrun("stock_errors.py", "--model", str(model), "--out", str(out), timeout=300)
    check(proc)
    results = read_results(out)
    assert sorted(results) == [0, 1]
    return results


@pytest.mark.distributed
def test_stock_fsdp1_errors_reproduced(stock_fsdp1, capsys, monkeypatch):
    for found in stock_fsdp1.values():
        stock = found["generate_stock"]
        assert not stock["ok"] and "'weight' must be 2-D" in stock["error"], stock
        ours = found["generate_ours"]
        assert ours.get("ok") and ours["equal"], ours  # the unwrapped model's greedy tokens
        stock = found["checkpoint_stock"]
        assert not stock["ok"] and "have different metadata" in stock["error"], stock
        ours = found["checkpoint_ours"]
        assert ours.get("ok"), ours.get("traceback")
        assert ours["engagement"]["flat_params"] > 0, ours
    # Their real tracebacks map to their entries.
    for scenario, entry in (
        ("generate_stock", "weight-must-be-2d"),
        ("checkpoint_stock", "checkpoint-recompute-metadata"),
    ):
        assert [e.id for e in find_known_errors(stock_fsdp1[0][scenario]["traceback"])] == [entry]
