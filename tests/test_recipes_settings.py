"""Each recipe's launch trains what its doctor command planned: one settings file (examples/recipes/*.yaml), read
by the doctor (`--training-config`) and by the launch (trl's `--config`, the example scripts' `--config`).

Fast: the doctor with the file plans as with the same settings given as flags, and a flag beside it wins; every
recipe file is read whole by its script's own parser (trl's TrlParser, nothing left over; the example scripts,
unknown keys refused by name).

The rehearsal (one launch, 2 gloo ranks, FSDP2, ranks forked with accelerate's launch environment): each recipe
page's launch command, with the page's own flags and settings file, at a tiny shape (a tiny local model and data
with one sample longer than the planned sequence length; `--max_steps 1`), every run in the same launch
(tests/scripts/recipe_rehearsal.py). Each trainer records the arguments it trains with and every training
forward's (rows, tokens); the test compares them with the doctor's plan of the page's doctor command: the
sequence length (the long sample is cut to exactly it), the micro-batch (every forward's rows), the checkpoint
interval, and the file's learning rate, scheduler and gradient accumulation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import BIN, REPO, SCRIPTS, _env, check, launch_via_run
from readme_blocks import blocks, program, shell_commands
from refresh_recipe_figures import settings_block
from test_recipes_docs import RUNS, _excerpts

from hf_fsdp_qlora.train.training_config import read_training_config

RECIPES = REPO / "examples" / "recipes"
LONG_WORDS = 5000  # tokens past every recipe's max_length (each word is at least one token)


# ---------------------------------------------------------------- the doctor and the scripts read the same file


def _doctor(*args):
    from test_recipes_docs import run_doctor

    return run_doctor(("doctor", *args))


def test_doctor_plans_the_file_as_the_same_flags():
    base = ("--accelerate-config", "fsdp2_qlora", "--num-gpus", "1", "--gpu-memory", "24GB", "--model",
            str(REPO / "tests" / "data" / "llama3_1_8b_config.json"))  # fmt: skip
    from_file = _doctor(*base, "--training-config", str(RECIPES / "llama-8b-1x24gb.yaml"))
    as_flags = _doctor(*base, "--load-in-4bit", "--seq-len", "4096", "--batch-size", "1", "--save-steps", "200")
    assert from_file == as_flags and "batch 1 x 4096 tokens" in from_file[1] and "each 200 steps" in from_file[1]
    # A flag beside the file wins, quantization included.
    wins = _doctor(*base, "--training-config", str(RECIPES / "llama-8b-1x24gb.yaml"), "--seq-len", "1024",
                   "--load-in-8bit")  # fmt: skip
    assert "batch 1 x 1024 tokens" in wins[1] and "LoRA on 8-bit" in wins[1], wins[1][:400]


def test_doctor_plans_a_trainer_class_with_a_loss_of_its_own():
    """trl's GRPOTrainer (no loss path of its own in the plan): planned with the whole logits, not a traceback."""
    status, printed = _doctor("--accelerate-config", "fsdp2_qlora", "--gpu-memory", "24GB", "--model",
                              str(REPO / "tests" / "data" / "llama3_1_8b_config.json"), "--trainer-class", "GRPOTrainer")  # fmt: skip
    assert status == 0 and "| loss stock |" in printed.splitlines()[0], printed[:500]


def test_doctor_names_a_missing_or_bad_file(tmp_path, capsys):
    base = ("--accelerate-config", "fsdp2_qlora", "--model", str(REPO / "tests" / "data" / "llama3_1_8b_config.json"))
    from hf_fsdp_qlora.cli.main import main

    assert main(["doctor", *base, "--training-config", str(tmp_path / "none.yaml")]) == 2
    assert "--training-config" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: lion\n")
    assert main(["doctor", *base, "--training-config", str(bad)]) == 2
    assert "optim: 'lion' has no memory plan" in capsys.readouterr().err


def _trl_script(name) -> str:
    import importlib

    return importlib.import_module(f"trl.scripts.{name}").__file__


def _trl_parser(name):
    import importlib

    return importlib.import_module(f"trl.scripts.{name}").make_parser()


TRL_FILES = {"llama-70b-2x80gb.yaml": "sft", "qwen3-moe-2x24gb.yaml": "sft", "dpo-trl.yaml": "dpo",
             "grpo-trl.yaml": "grpo"}  # fmt: skip
EXAMPLE_FILES = {"llama-8b-1x24gb.yaml": "train_qlora.py", "slurm-multinode.yaml": "train_qlora.py",
                 "llama-guard-full-finetune.yaml": "safety_classifier.py"}  # fmt: skip


def test_every_recipe_file_is_read_whole_by_its_script():
    assert {p.name for p in RECIPES.glob("*.yaml")} == set(TRL_FILES) | set(EXAMPLE_FILES)
    for name, script in TRL_FILES.items():
        config = read_training_config(RECIPES / name)
        parsed = _trl_parser(script).parse_args_and_config(
            [
                "--config",
                str(RECIPES / name),
                "--model_name_or_path",
                "m",
                "--dataset_name",
                "d",
                "--output_dir",
                "o",
                "--use_cpu",
                "true",
            ],  # bf16 (trl's default) needs it on a machine without a GPU
            fail_with_unknown_args=True,  # trl's scripts pass False: a misspelt key would be dropped in silence
        )
        values = {k: v for dc in parsed for k, v in vars(dc).items()}
        assert all(values[k] == v for k, v in config.items()), {k: (v, values[k]) for k, v in config.items()}
    for name, script in EXAMPLE_FILES.items():
        args = _example(script).parse_args(["--config", str(RECIPES / name), "--model", "m", "--data", "d",
                                            "--output", "o"])  # fmt: skip
        assert args.max_length == read_training_config(RECIPES / name)["max_length"]
        assert args.training["save_strategy"] == "steps" and args.training["save_steps"] > 0


def _example(script):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", REPO / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_scripts_refuse_what_they_cannot_run(tmp_path, capsys):
    train_qlora = _example("train_qlora.py")
    for text, said in (("lerning_rate: 1.0e-4\n", "lerning_rate: not a setting of this script"),
                       ("load_in_4bit: false\n", "this script runs load_in_4bit=True only")):  # fmt: skip
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(SystemExit):
            train_qlora.parse_args(
                ["--config", str(tmp_path / "c.yaml"), "--model", "m", "--data", "d", "--output", "o"]
            )
        assert said in capsys.readouterr().err
    flag_wins = train_qlora.parse_args(["--config", str(RECIPES / "llama-8b-1x24gb.yaml"), "--model", "m", "--data",
                                        "d", "--output", "o", "--max-length", "512"])  # fmt: skip
    assert flag_wins.max_length == 512 and flag_wins.lr == 2e-4
    from hf_fsdp_qlora.train.training_config import held_out_rows

    assert held_out_rows(list(range(100)), 0.02, {"eval_strategy": "steps"}) == (list(range(98)), [98, 99])
    with pytest.raises(ValueError, match="eval_fraction"):
        held_out_rows(list(range(10)), 0.0, {"eval_strategy": "steps"})


_SETTINGS_BLOCK = re.compile(r"<!--\s*settings-file:\s*(\S+)\s*-->\n```yaml\n(.*?)\n```", re.DOTALL)


def test_each_page_shows_its_settings_file_and_both_commands_read_it():
    for page in RUNS:
        found = _SETTINGS_BLOCK.findall(page.read_text(encoding="utf-8"))
        assert len(found) == 1, (page.name, found)
        path, shown = found[0]
        # (without the file's header comment: its two commands; tests/refresh_recipe_figures.py rewrites the block)
        assert shown == settings_block(path), f"{page.name}: the settings block is not {path} as it is"
        for where, args in _plans(page):
            assert args[args.index("--training-config") + 1] == str(REPO / path), where
        for words in map(_without_env, _launches(page)):  # sbatch: its TRAINING_CONFIG, tests/test_slurm_recipe.py
            assert words[0] == "sbatch" or ["--config", path] == words[words.index("--config") :][:2], words


# ---------------------------------------------------------------- the rehearsal of every page's launch


def _sections(page) -> tuple[int, int]:
    """The lines where a page's "## 1." and "## 3." sections start."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("## 1."))
    end = next(i for i, line in enumerate(lines, 1) if line.startswith("## 3."))
    return start, end


def _launches(page) -> list[list[str]]:
    start, end = _sections(page)
    return [
        words
        for block in blocks(page)
        if start < block.line < end and block.lang == "bash"
        for words in shell_commands(block.body)
        if program(_without_env(words)) in ("accelerate launch", "sbatch")
    ]


def _without_env(words):
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def _plans(page) -> list[tuple[str, tuple[str, ...]]]:
    """(where, doctor arguments on the local config) of each doctor run in section 1: what the launches train."""
    start, end = _sections(page)
    return [(where, args) for where, args, _, _ in _excerpts(page) if start < int(where.rsplit(":", 1)[1]) < end]


def planned(args: tuple[str, ...]):
    """The doctor's own setup for `hf-fsdp-qlora doctor ARGS` (its sequence length, batch, checkpoint interval)."""
    from hf_fsdp_qlora.cli.doctor import _apply_training_config, _settings
    from hf_fsdp_qlora.cli.main import build_parser
    from hf_fsdp_qlora.doctor import diagnose

    ns = build_parser().parse_args(["doctor", *args])
    if ns.training_config:
        _apply_training_config(ns.cli_command, ns)
    return diagnose(ns.model, accelerate_config=ns.accelerate_config, **_settings(ns)).setup


_OPTION_VALUE = {"--model": "model", "--model_name_or_path": "model", "--data": "data", "--dataset_name": "data",
                 "--output": "out", "--output_dir": "out"}  # fmt: skip


def _script_and_args(words, tiny, out, steps: int = 1) -> tuple[str, list[str]]:
    """The page's launch as (script, its arguments) at the tiny shape: model, data and output folder replaced, and
    `steps` optimizer steps."""
    if words[0] == "sbatch":  # the batch script's own launch line, with the page's variables (made tiny)
        env = {"DRY_RUN": "1", "SLURM_JOB_NUM_NODES": "2", "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
               "MODEL": tiny["model"], "DATA": tiny["data"], "OUTPUT_DIR": str(out),
               "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
        proc = subprocess.run(["bash", words[-1]], check=True, capture_output=True, text=True, env=_env(env),
                              cwd=str(REPO), timeout=60)  # fmt: skip
        line = next(line for line in proc.stdout.splitlines() if line.startswith("node 0: "))
        words = line.split(": ", 1)[1].split()
    at = next(i for i, w in enumerate(words) if w.endswith(".py") or "trl.scripts." in w)
    trl = re.search(r"trl\.scripts\.(\w+)", words[at])
    script = _trl_script(trl.group(1)) if trl else str(REPO / words[at])
    args = list(words[at + 1 :])
    for i, word in enumerate(args[:-1]):
        if word in _OPTION_VALUE:
            args[i + 1] = str(out) if _OPTION_VALUE[word] == "out" else tiny[_OPTION_VALUE[word]]
    return script, [*args, "--max_steps" if trl else "--max-steps", str(steps)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per script kind: the tiny model and data its rehearsal trains on."""
    from recipe_fixtures import (
        build_chat_dataset,
        build_example_jsonl,
        build_preference_dataset,
        build_prompt_dataset,
        build_recipe_model,
    )
    from tiny_models import build_tiny_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("recipe_settings")
    llama = str(build_recipe_model(root / "llama"))
    moe = build_tiny_model(root / "qwen3_moe", "qwen3_moe")
    AutoTokenizer.from_pretrained(llama).save_pretrained(moe)
    return {
        "train_qlora": {
            "model": llama,
            "data": str(build_example_jsonl(root / "pc.jsonl", ("prompt", "completion"), long_words=LONG_WORDS)),
        },
        "safety_classifier": {
            "model": llama,
            "data": str(build_example_jsonl(root / "labels.jsonl", ("prompt", "label"), long_words=LONG_WORDS)),
        },
        "sft": {"model": llama, "data": str(build_chat_dataset(root / "chat", 12, 2, long_words=LONG_WORDS))},
        "sft_moe": {"model": str(moe), "data": str(build_chat_dataset(root / "chat", 12, 2, long_words=LONG_WORDS))},
        "dpo": {"model": llama, "data": str(build_preference_dataset(root / "pref", 12, 2, long_words=LONG_WORDS))},
        "grpo": {"model": llama, "data": str(build_prompt_dataset(root / "prompts"))},
        # the SLURM recipe runs to its first checkpoint: 200 rows and a held-out one, 50 steps an epoch on 2 ranks
        "slurm": {
            "model": llama,
            "data": str(
                build_example_jsonl(root / "slurm.jsonl", ("prompt", "completion"), 201, long_words=LONG_WORDS)
            ),
        },
    }


def _kind(page, words) -> str:
    text = " ".join(words)
    if words[0] == "sbatch":
        return "slurm"
    for kind in ("train_qlora", "safety_classifier", "grpo", "dpo"):
        if kind in text:
            return kind
    return "sft_moe" if "Qwen3" in text else "sft"


@pytest.fixture(scope="module")
def rehearsal(tiny, tmp_path_factory):
    """{name: (the doctor's setup, the run's settings file, what each rank recorded)}, from one launch."""
    root = tmp_path_factory.mktemp("recipe_rehearsal")
    runs, plans = [], {}
    for page in RUNS:
        launches, doctors = _launches(page), _plans(page)
        assert launches and len(launches) == len(doctors), (page.name, len(launches), len(doctors))
        for i, (words, (where, args)) in enumerate(zip(launches, doctors)):
            name, kind, setup = f"{page.stem}-{i}", _kind(page, _without_env(words)), planned(args)
            # The SLURM recipe (preemptible) runs to its first periodic checkpoint; the others one step.
            steps = setup.save_steps if kind == "slurm" else 1
            script, argv = _script_and_args(_without_env(words), tiny[kind], root / name, steps)
            runs.append({"name": name, "script": script, "argv": argv, "out": str(root / name / "record"),
                         "cwd": str(REPO)})  # fmt: skip
            config = args[args.index("--training-config") + 1]
            plans[name] = (where, setup, read_training_config(config), kind)
    plan = root / "plan.json"
    plan.write_text(json.dumps(runs, indent=1))
    proc = launch_via_run("cpu_fsdp2_rehearsal.yaml", SCRIPTS / "recipe_rehearsal.py", str(plan), timeout=900)
    check(proc)
    engaged = (proc.stdout + proc.stderr).count("hf_fsdp_qlora: FSDP2 engaged on 2 rank(s)")
    assert engaged == len(runs), f"FSDP2 engaged in {engaged} of {len(runs)} runs"  # once per trainer, rank 0
    records = {}
    for run in runs:
        found = [json.loads(p.read_text()) for p in sorted(Path(run["out"]).glob("record_rank*.json"))]
        assert len(found) == 2, (run["name"], proc.stderr[-4000:])
        records[run["name"]] = (*plans[run["name"]], found, run["argv"], root / run["name"])
    return records


def _name(value) -> str:
    """An enum's value as recorded ("SaveStrategy.STEPS" or "steps") -> "steps"."""
    return str(value).rsplit(".", 1)[-1].lower()


@pytest.mark.distributed
def test_launch_trains_what_the_doctor_planned(rehearsal):
    assert {name.rsplit("-", 1)[0] for name in rehearsal} == {p.stem for p in RUNS}
    for name, (where, setup, config, kind, ranks, argv, out) in rehearsal.items():
        said = f"{name} (planned at {where}; launched with {argv})"
        assert setup.save_steps and setup.save_steps > 0, said  # every recipe saves periodic checkpoints
        forwards = [f for r in ranks for f in r["forwards"]]
        assert forwards, said
        for r in ranks:
            a = r["args"]
            assert a["per_device_train_batch_size"] == setup.batch_size, (said, a)
            assert (_name(a["save_strategy"]), a["save_steps"]) == ("steps", setup.save_steps), (said, a)
            assert _name(a["lr_scheduler_type"]) == config["lr_scheduler_type"], (said, a)
            for key in ("learning_rate", "gradient_accumulation_steps", "warmup_steps"):
                assert a[key] == config[key], (said, key, a[key], config[key])
        for r in ranks:  # the base as planned (4-bit, 8-bit, or every weight trained) and the LoRA rank
            facts, bits = r["model"], setup.quantization
            held = {"8bit" if re.search("8bit|Int8", c) else "4bit" for c in facts["quantized_classes"]}
            assert held == ({bits} if bits else set()), (said, facts)
            if kind == "sft_moe":  # the experts too, as the page's plan counts them (a stock load leaves them 16-bit)
                assert "QuantizedExperts" in facts["quantized_classes"], (said, facts)
            assert facts["lora_r"] == (None if setup.full_finetune else setup.lora_r), (said, facts)
        rows = {rows for rows, _ in forwards}
        longest = max(tokens for _, tokens in forwards)
        if kind == "dpo":  # chosen and rejected run together: twice the batch's rows, the pair at max_length
            assert rows == {2 * setup.batch_size} and longest == setup.seq_len, (said, rows, longest)
        elif kind == "grpo":  # prompt + completion within the planned length
            assert rows == {setup.batch_size} and longest <= setup.seq_len, (said, rows, longest)
            assert ranks[0]["args"]["max_completion_length"] == config["max_completion_length"]
            names = [f.rsplit(".", 1)[-1] for f in config["reward_funcs"]]  # the page's reward function scored
            assert ranks[0]["reward_funcs"] == names and ranks[0]["rewards"], (said, ranks[0])
        else:  # the long sample cut to exactly the planned length
            assert rows == {setup.batch_size} and longest == setup.seq_len, (said, rows, longest)
        if kind == "slurm":  # the periodic checkpoint a preempted job resumes from, at the planned step
            written = {p.name for p in (out / f"checkpoint-{setup.save_steps}").iterdir()}
            assert ranks[0]["steps"] == setup.save_steps and "adapter_model.safetensors" in written, (said, written)
            assert any(n.startswith("optimizer") for n in written), (said, written)
        print(f"{name}: planned batch {setup.batch_size} x {setup.seq_len}, save every {setup.save_steps}; "
              f"trained rows {sorted(rows)}, longest {longest} tokens, {len(forwards)} forwards, {ranks[0]['model']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
