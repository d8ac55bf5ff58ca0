"""The shipped accelerate configs: names, accelerate's own loader and launcher, opening comments, CLI, wheel.

accelerate's loader rejects unknown top-level keys but copies every `fsdp_config` key into the launch arguments
without checking it, so a misspelt FSDP key is silently ignored. The tests check those keys themselves, against
the arguments `accelerate launch` really has.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import yaml

from hf_fsdp_qlora.configs import config_path, list_configs

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "accelerate_configs"
CLI = Path(sys.executable).parent / "hf-fsdp-qlora"
YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))
NAMES = [path.stem for path in YAMLS]

REQUIRED = (
    "fsdp1_qlora",
    "fsdp2_qlora",
    "fsdp2_qlora_offload",
    "fsdp2_qlora_multinode",
    "cpu_fsdp1_rehearsal",
    "cpu_fsdp2_rehearsal",
    "llama3_70b_2xa100_80gb",
    "llamaguard3_1b_1x24gb",
)
CPU_REHEARSALS = {"cpu_fsdp1_rehearsal": 1, "cpu_fsdp2_rehearsal": 2}
GPU_QLORA = ("fsdp1_qlora", "fsdp2_qlora", "fsdp2_qlora_offload", "fsdp2_qlora_multinode", "llama3_70b_2xa100_80gb")
# Read by accelerate.utils.launch.prepare_multi_gpu_env with getattr although `accelerate launch` has no such flag.
_FSDP_KEYS_WITHOUT_FLAG = {"fsdp_ignored_modules"}


def _load(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path))


@functools.cache
def _launch_fsdp_args() -> frozenset[str]:
    from accelerate.commands.launch import launch_command_parser

    dests = {action.dest for action in launch_command_parser()._actions}
    return frozenset({dest for dest in dests if dest.startswith("fsdp_")} | _FSDP_KEYS_WITHOUT_FLAG)


def _unknown_fsdp_keys(fsdp_config: dict) -> list[str]:
    """`fsdp_config` keys that map to no `accelerate launch` argument.

    The mapping is accelerate's own (commands/launch.py): a key not starting with "fsdp" gets an `fsdp_` prefix.
    """
    known = _launch_fsdp_args()
    return sorted(key for key in fsdp_config if (key if key.startswith("fsdp") else f"fsdp_{key}") not in known)


def _text(name: str) -> str:
    return (CONFIG_DIR / f"{name}.yaml").read_text(encoding="utf-8")


def _comment_prose(name: str) -> str:
    """Every comment in a file as one line of words, so a phrase can be found across a line wrap."""
    lines = _text(name).splitlines()
    return " ".join(" ".join(line.split("#", 1)[1].split()) for line in lines if "#" in line)


def _opening_comment(path: Path) -> str:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- names ------------------------------------------------------------------------------------------------


def test_required_configs_exist_and_list_matches_folder():
    assert set(REQUIRED) <= set(list_configs())
    assert list_configs() == sorted(NAMES)
    assert not (CONFIG_DIR / "__init__.py").exists(), "accelerate_configs/ is data, not a Python package"


def test_config_path_accepts_name_with_or_without_suffix():
    path = config_path("fsdp2_qlora")
    assert path == config_path("fsdp2_qlora.yaml")
    assert path.is_absolute() and path.is_file()
    assert path.samefile(CONFIG_DIR / "fsdp2_qlora.yaml")


@pytest.mark.parametrize("name", ["no_such_config", "../pyproject", "fsdp2_qlora.yml", ""])
def test_config_path_unknown_name_lists_available(name):
    with pytest.raises(ValueError, match="Unknown accelerate config") as err:
        config_path(name)
    for available in REQUIRED:
        assert available in str(err.value)


# --- accelerate's loader and launcher ---------------------------------------------------------------------


@pytest.mark.parametrize("path", YAMLS, ids=NAMES)
def test_loads_through_accelerate_with_only_known_keys(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = _load(path)
    assert isinstance(config, ClusterConfig)
    assert config.distributed_type == DistributedType.FSDP
    assert config.fsdp_config, "an FSDP config without fsdp_config runs accelerate's defaults"
    assert _unknown_fsdp_keys(config.fsdp_config) == []


def test_accelerate_rejects_unknown_top_level_keys(tmp_path):
    data = yaml.safe_load((CONFIG_DIR / "fsdp2_qlora.yaml").read_text())
    data["num_gpus"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"had unknown keys \(\['num_gpus'\]\)"):
        _load(bad)


@pytest.mark.parametrize("key", ["fsdp_shard_everything", "shard_everything", "fsdp_activation_checkpoint"])
def test_unknown_fsdp_key_passes_accelerate_but_not_our_check(tmp_path, key):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    data = yaml.safe_load((CONFIG_DIR / "fsdp2_qlora.yaml").read_text())
    data["fsdp_config"][key] = True
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    # accelerate 1.15 accepts it in the loader and in `accelerate launch`, which is why we check ourselves.
    config = _load(bad)
    args = launch_command_parser().parse_args(["--config_file", str(bad), "train.py"])
    _validate_launch_command(args)
    assert _unknown_fsdp_keys(config.fsdp_config) == [key]


def test_key_check_accepts_keys_without_fsdp_prefix():
    assert _unknown_fsdp_keys({"version": 2, "activation_checkpointing": True, "fsdp_state_dict_type": "X"}) == []


@pytest.mark.parametrize("path", YAMLS, ids=NAMES)
def test_accelerate_launch_builds_the_plugin_the_file_asks_for(path):
    """Run `accelerate launch`'s own argument handling and environment export, then build the FSDP plugin the
    training processes would build from that environment."""
    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    raw = yaml.safe_load(path.read_text())
    fsdp = raw["fsdp_config"]
    argv = ["--config_file", str(path), "--main_process_port", str(_free_port()), "train.py"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    assert args.use_fsdp and args.num_processes == raw["num_processes"]
    env = prepare_multi_gpu_env(args)  # raises if cpu_ram_efficient_loading is on without sync_module_states
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert env["ACCELERATE_MIXED_PRECISION"] == raw["mixed_precision"]
    exported = {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    # The GPU configs set sync_module_states, for which the plugin asks the current GPU; pretend there is one.
    with (
        mock.patch.dict(os.environ, exported),
        mock.patch.object(accelerate_dataclasses, "is_cuda_available", return_value=True),
        mock.patch.object(torch.cuda, "current_device", return_value=0),
    ):
        plugin = FullyShardedDataParallelPlugin()

    assert plugin.fsdp_version == fsdp["fsdp_version"]
    assert plugin.state_dict_type.name == fsdp["fsdp_state_dict_type"]
    assert plugin.activation_checkpointing is fsdp["fsdp_activation_checkpointing"]
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.cpu_ram_efficient_loading is fsdp["fsdp_cpu_ram_efficient_loading"]
    offloaded = getattr(plugin.cpu_offload, "offload_params", type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy")
    assert offloaded is fsdp["fsdp_offload_params"]
    if "fsdp_transformer_layer_cls_to_wrap" in fsdp:
        assert plugin.transformer_cls_names_to_wrap == fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    else:
        assert plugin.transformer_cls_names_to_wrap is None  # falls back to the model's _no_split_modules
    if plugin.fsdp_version == 1:
        assert plugin.use_orig_params is True
        assert plugin.sharding_strategy.name == fsdp["fsdp_sharding_strategy"]
        assert plugin.sync_module_states is fsdp["fsdp_sync_module_states"]
    else:
        assert plugin.reshard_after_forward is True


# --- what each file says ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAMLS, ids=NAMES)
def test_opens_with_description_and_launch_command(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# ") and len(first) > 20, "line 1 must be `# <one-line description>`"
    comment = _opening_comment(path)
    assert f"accelerate launch --config_file accelerate_configs/{path.name}" in comment
    assert f'"$(hf-fsdp-qlora config {path.stem})"' in comment


@pytest.mark.parametrize(("name", "version"), sorted(CPU_REHEARSALS.items()))
def test_cpu_rehearsal_configs(name, version):
    config = _load(CONFIG_DIR / f"{name}.yaml")
    assert config.use_cpu is True
    assert config.distributed_type.value == "FSDP"
    assert config.num_processes == 2 and config.num_machines == 1
    assert config.mixed_precision == "no"
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == version
    # Either one on makes accelerate look for a GPU: "There are currently no available devices found".
    assert fsdp["fsdp_sync_module_states"] is False
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is False


@pytest.mark.parametrize("name", GPU_QLORA)
def test_gpu_qlora_configs(name):
    config = _load(CONFIG_DIR / f"{name}.yaml")
    fsdp = config.fsdp_config
    assert config.use_cpu is False
    assert config.mixed_precision == "bf16"  # must equal bnb_4bit_quant_storage
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True and fsdp["fsdp_sync_module_states"] is True
    assert fsdp["fsdp_state_dict_type"] in ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
    if fsdp["fsdp_version"] == 1:
        assert fsdp["fsdp_use_orig_params"] is True  # LoRA mixes frozen and trainable weights in one unit
    else:
        assert fsdp["fsdp_activation_checkpointing"] is True
    assert "bnb_4bit_quant_storage" in _text(name)


def test_activation_checkpointing_comment_says_it_is_applied_once():
    for name in NAMES:
        fsdp = _load(CONFIG_DIR / f"{name}.yaml").fsdp_config
        if fsdp.get("fsdp_activation_checkpointing"):
            prose = _comment_prose(name)
            assert "TrainingArguments.gradient_checkpointing" in prose and "stock Trainer raises" in prose, name


def test_multinode_template():
    config = _load(CONFIG_DIR / "fsdp2_qlora_multinode.yaml")
    assert config.num_machines == 2
    assert config.num_processes == 16  # total across machines
    assert config.machine_rank == 0
    assert config.main_process_ip.startswith("<"), "the address must be an obvious placeholder"
    text = _text("fsdp2_qlora_multinode")
    assert "set 1 on the second machine" in text and "--machine_rank 1" in text


def test_llamaguard_single_gpu_config():
    config = _load(CONFIG_DIR / "llamaguard3_1b_1x24gb.yaml")
    fsdp = config.fsdp_config
    assert config.num_processes == 1 and config.use_cpu is False
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_offload_params"] is True and fsdp["fsdp_activation_checkpointing"] is True


# --- the CLI ----------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "config", *args], check=False, capture_output=True, text=True, timeout=60, cwd="/"
    )


@pytest.mark.parametrize("name", REQUIRED)
def test_cli_prints_only_the_absolute_path(name):
    proc = _cli(name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1
    printed = Path(proc.stdout.strip())
    assert printed.is_absolute() and printed.is_file()
    assert printed == config_path(name)


def test_cli_list_names_every_config_with_its_description():
    proc = _cli("--list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list_configs()
    for line in lines:
        name = line.split()[0]
        description = _text(name).splitlines()[0].lstrip("# ").strip()
        assert line.endswith(description)


def test_cli_show_prints_the_file():
    proc = _cli("--show", "cpu_fsdp2_rehearsal")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _text("cpu_fsdp2_rehearsal")


@pytest.mark.parametrize("args", [("no_such_config",), ("--show", "no_such_config")])
def test_cli_unknown_name_exits_2_naming_the_configs(args):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    for name in REQUIRED:
        assert name in proc.stderr


def test_cli_module_does_not_import_torch():
    code = (
        "import sys\n"
        "from hf_fsdp_qlora.cli.main import main\n"
        "assert main(['config', '--list']) == 0\n"
        "assert 'torch' not in sys.modules, 'hf-fsdp-qlora config must not import torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_cli_help_explains_the_options():
    proc = _cli("--help")
    assert proc.returncode == 0, proc.stderr
    for text in ("--list", "--show", 'accelerate launch --config_file "$(hf-fsdp-qlora config fsdp2_qlora)"'):
        assert text in proc.stdout


# --- the wheel --------------------------------------------------------------------------------------------


def test_wheel_ships_every_config_and_finds_it(tmp_path):
    # Build from a copy, so the build leaves nothing in the checkout (build/, *.egg-info) while others work in it.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("hf_fsdp_qlora", "accelerate_configs"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    dist = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("hf_fsdp_qlora-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    for path in YAMLS:
        assert f"hf_fsdp_qlora/accelerate_configs/{path.name}" in members
    assert "hf_fsdp_qlora/accelerate_configs/__init__.py" not in members

    # The unpacked wheel, first on sys.path, is what an installed package looks like to config_path().
    code = (
        "from hf_fsdp_qlora.configs import config_path, list_configs\n"
        "print(list_configs()); print(config_path('fsdp2_qlora'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    listed, printed = proc.stdout.splitlines()
    assert listed == repr(sorted(NAMES))
    assert Path(printed) == (tmp_path / "site" / "hf_fsdp_qlora" / "accelerate_configs" / "fsdp2_qlora.yaml")
