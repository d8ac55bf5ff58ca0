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
from hf_fsdp_qlora.error_index import ERRORS, find_known_errors, is_certain

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
    if entry.context is not None:  # a context only means something for a message with other causes
        assert entry.other_causes and re.compile(entry.context), entry.id
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
    assert code == 0 and "== NaN loss from all -100 labels [all-labels-masked]" in out  # certain: NoLabelsError


# Every wording that a supported or commonly used version prints for an entry's failure, exactly as printed, with
# where it comes from. The first two are the texts users paste most (issue 25, item 14).
WORDINGS = [
    ("RuntimeError: Only Tensors of floating point and complex dtype can require gradients",
     {"cannot-flatten-integer", "8bit-under-fsdp"}, "torch 1.13-2.13, FSDP over an integer-stored base"),
    ("ValueError: `FlatParameter` requires uniform dtype but got torch.float16 and torch.float32",
     {"uniform-dtype"}, "torch 1.13-2.0 (accelerate#1620, torch 2.0.1)"),
    ("ValueError: FlatParameter requires uniform dtype but got torch.float16 and torch.float32",
     {"uniform-dtype"}, "the same, as pasted without the backticks"),
    ("ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32",
     {"uniform-dtype"}, "torch >= 2.1"),
    ("ValueError: `FlatParameter` requires uniform `requires_grad`", {"uniform-requires-grad"}, "torch 1.13-2.0"),
    ("ValueError: Integer parameters are unsupported", {"cannot-flatten-integer"}, "torch 2.0"),
    ("RuntimeError: only Tensors of floating point dtype can require gradients",
     {"cannot-flatten-integer", "8bit-under-fsdp"}, "torch's requires_grad_ on an integer tensor"),
    ("RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16", {"m1-m2-same-dtype"},
     "torch >= 2.1 on CUDA"),
    ("RuntimeError: expected scalar type BFloat16 but found Float", {"m1-m2-same-dtype"}, "torch <= 2.0"),
    (("RuntimeError: Expected all tensors to be on the same device, but got mat2 is on cpu, different from other "
     "tensors on cuda:0 (when checking argument in method wrapper_CUDA_mm)"), {"merge-device-mismatch"},
     "torch >= 2.6"),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB.", {"cuda-oom-full-finetune"},
     "torch 1.13-2.4"),
    (("ValueError: The activation_checkpointing in FSDP config and the gradient_checkpointing in training arg can't "
     "be set to True simultaneously. Please use FSDP's activation_checkpointing logic when using FSDP."),
     {"activation-checkpointing-twice"}, "transformers 4.x"),
    ('{"epoch": 0.1, "grad_norm": NaN, "learning_rate": 0.0001, "loss": NaN, "step": 10}', {"all-labels-masked"},
     "trainer_state.json's log_history"),
    (("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
     "1800000ms for recv operation to complete"), {"collective-timeout"}, "gloo"),
]  # fmt: skip


@pytest.mark.parametrize("text,ids,source", WORDINGS, ids=[w[2] for w in WORDINGS])
def test_every_wording_of_a_failure_finds_its_entry(text, ids, source, capsys, monkeypatch):
    assert {e.id for e in find_known_errors(text)} == ids, source
    code, out = _explain(capsys, monkeypatch, f"[rank0]: {text}\n")
    assert code == 0 and all(f"[{i}]" in out for i in ids), out


def _traceback_of(fn) -> str:
    try:
        fn()
    except Exception:  # noqa: BLE001  (the real text of whatever torch raises)
        return traceback.format_exc()
    raise AssertionError("no error raised")


def test_generic_messages_are_possible_causes_until_the_log_makes_them_certain(capsys, monkeypatch):
    """Real texts of the same messages from other causes are reported as possible causes, with what tells them
    apart; the context that makes the cause certain turns each into the entry's cause."""
    import torch

    torch.manual_seed(0)
    # Real tracebacks raised here by torch, none by the entry's cause: a plain float32 x bfloat16 matmul, an
    # integer Parameter outside any quantized model, an embedding with a 1-D weight outside FSDP.
    m1m2 = _traceback_of(lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16)))
    integer = _traceback_of(lambda: torch.nn.Parameter(torch.zeros(2, dtype=torch.int8)))
    embedding = _traceback_of(lambda: torch.nn.functional.embedding(torch.tensor([0]), torch.ones(4)))
    # A NaN loss from overflow with every label real (a weight set to inf), as Trainer logs it.
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(3, 200, (2, 8))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isnan(loss) and (ids != -100).all()
    nan = f"{{'loss': {loss.item()}, 'grad_norm': nan, 'learning_rate': 0.0001, 'epoch': 0.5}}"
    # Upstream reports of other causes (no GPU here): a DPO run's inputs left on the CPU
    # (huggingface/alignment-handbook#209), a QLoRA + FSDP run out of memory in backward (bitsandbytes#1252).
    device = (
        "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cpu "
        "and cuda:0! (when checking argument for argument index in method wrapper_CUDA__index_select)"
    )
    oom = ('[rank1]:   File "/venv/lib/python3.10/site-packages/trl/trainer/sft_trainer.py", line 440, in train\n'
           '[rank1]:   File "/venv/lib/python3.10/site-packages/accelerate/accelerator.py", line 2134, in backward\n'
           "[rank1]: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB.")  # fmt: skip
    cases = [
        (m1m2, "m1-m2-same-dtype", '  File "/x/peft/tuners/lora/layer.py", line 771, in forward\n'),
        (integer, "8bit-under-fsdp", '  File "/x/bitsandbytes/nn/modules.py", line 620, in Int8Params\n'),
        (embedding, "weight-must-be-2d", '  File "/x/torch/distributed/fsdp/fully_sharded_data_parallel.py"\n'),
        (nan, "all-labels-masked", "NoLabelsError: Every label in the first batch is -100\n"),
        (device, "merge-device-mismatch", '  File "/x/merge.py", line 9, in <module>\n    model.merge_and_unload()\n'),
        (oom, "cuda-oom-full-finetune", None),
    ]
    for text, entry_id, context in cases:
        entry = next(e for e in ERRORS if e.id == entry_id)
        assert entry in find_known_errors(text) and not is_certain(entry, text), (entry_id, text)
        code, out = _explain(capsys, monkeypatch, text)
        assert code == 0 and f"== possibly: {entry.title} [{entry_id}]" in out, out
        assert "other causes:" in out and f"== {entry.title}" not in out, out
        if context:  # the same message with the context that makes it this entry's cause
            assert is_certain(entry, context + text), entry_id
            code, out = _explain(capsys, monkeypatch, context + text)
            assert f"== {entry.title} [{entry_id}]" in out, out


def test_explain_on_a_terminal_says_how_to_give_it_the_log(capsys, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("ValueError: Cannot flatten integer dtype tensors\n"))
    assert main(["explain"]) == 0
    captured = capsys.readouterr()
    assert "paste the traceback, then press Ctrl-D" in captured.err and "[cannot-flatten-integer]" in captured.out
    code, _ = _explain(capsys, monkeypatch, "ValueError: Cannot flatten integer dtype tensors\n")
    assert code == 0 and "Ctrl-D" not in capsys.readouterr().err  # a pipe: no prompt


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
        text = stock_fsdp1[0][scenario]["traceback"]
        assert [e.id for e in find_known_errors(text)] == [entry]
    # The generate traceback alone cannot tell FSDP1 from DeepSpeed ZeRO-3 (no FSDP frame: `generate` is reached
    # through the wrapper's attribute forwarding): a possible cause, certain with the launch's FSDP line.
    generate, ckpt = (stock_fsdp1[0][s]["traceback"] for s in ("generate_stock", "checkpoint_stock"))
    weight = next(e for e in ERRORS if e.id == "weight-must-be-2d")
    assert not is_certain(weight, generate) and is_certain(weight, "Distributed environment: FSDP\n" + generate)
    assert all(is_certain(e, ckpt) for e in find_known_errors(ckpt))
