import functools
import os
from collections import OrderedDict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- pytest-xdist (`make test` runs `-n 2 --dist loadfile`) ---------------------------------------------------
# Each test file runs whole in one worker, so its module-scoped launches run once; the files that share the
# session's launches (they define SHARED_TRAIN_SCENARIOS) run together in one worker, so those launches run once
# too. The slowest files start first: a long file started last would leave the other worker idle at the end.
# Seconds on an idle 2-core machine, roughly (pytest --durations); a file not listed counts 30 s if it launches
# processes (marked distributed), else 5 s. Files whose launches fork their ranks (tests/fork_launch.py) count ~4 s
# less per such launch (~8.5 CPU-s of imports spared each, on a machine whose 2 cores both work), and those forked
# from the fork server (tests/fork_server.py: the stack imported once per pytest process) another ~4 s less.
_SECONDS = {
    "test_recipes.py": 100, "test_trainer_fsdp.py": 48, "test_throughput_benchmark.py": 10,
    "test_speed_options.py": 51, "test_semantics_dist.py": 37, "test_checkpoints.py": 20,
    "test_semantics_pref.py": 28, "test_doctor.py": 31, "test_cpu_rehearsal.py": 25, "test_eval_generate.py": 17,
    "test_low_ram.py": 20, "test_sharding.py": 20, "test_multinode.py": 20, "test_bad_input.py": 8,
    "test_preemption.py": 90, "test_demo.py": 50, "test_chunked_loss.py": 42, "test_readme.py": 35,
    "test_error_index.py": 26, "test_quiet.py": 30, "test_train_imports.py": 8, "test_docs.py": 15,
    "test_slurm_recipe.py": 40, "test_finish.py": 15, "test_fork_launch.py": 25, "test_merge_safety_kill.py": 25,
    "test_dora.py": 35,
    "test_prequantized.py": 40, "test_packing.py": 20,
    "test_merge_moe.py": 35, "test_merge_record.py": 15,
    "test_moe.py": 40, "test_moe_prequantized.py": 25, "test_moe_benchmark.py": 12,
    "test_int8.py": 150,
    "test_moe_load.py": 10,
    "test_moe_stream.py": 60,
    "test_expert_layouts.py": 40,
    "test_recipes_docs.py": 90,
    "test_families.py": 70, "test_flagship_plans.py": 15,
    "test_options.py": 130,
    "test_precision_trl.py": 40, "test_peft_recipe.py": 15,
    "test_sequence_parallel.py": 45, "test_adapter_dtype_benchmark.py": 5,
    "test_multimodal_train.py": 70, "test_multimodal.py": 25,
    "test_gguf.py": 50,
}  # fmt: skip


@functools.cache
def _file_facts(path: Path) -> tuple[bool, float]:
    """(shares the session's launches, rough seconds it takes) of a test file."""
    try:
        text = path.read_text()
    except OSError:
        return False, 0.0
    guess = 30.0 if "pytest.mark.distributed" in text else 5.0
    return "SHARED_TRAIN_SCENARIOS" in text, float(_SECONDS.get(path.name, guess))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    root = config.rootpath

    def files(scope):
        return scope.removeprefix("shared:").split("+")

    class HeaviestFirst(OrderedDict):
        def popitem(self, last=True):
            if last:
                return super().popitem(last=True)
            scope = max(self, key=lambda s: sum(_file_facts(root / f)[1] for f in files(s)))
            return scope, self.pop(scope)

    class Scheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = HeaviestFirst()

        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            if not _file_facts(root / path)[0]:
                return path
            shared = sorted(p for p in root.glob("tests/test_*.py") if _file_facts(p)[0])
            return "shared:" + "+".join(str(p.relative_to(root)) for p in shared)

    return Scheduling(config, log)


@pytest.fixture(scope="session")
def shared_models(tmp_path_factory):
    """One folder for the tiny models (tests/tiny_models.py) of the shared launches, built on demand."""
    return tmp_path_factory.mktemp("shared_models")


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory, shared_models):
    """`get(version)`: the one FSDP{version} launch of every selected module's SHARED_TRAIN_SCENARIOS
    (see dist_utils.shared_scenarios_launch), made on first use: (models dir, out dir, per-rank results, process)."""
    from dist_utils import shared_scenarios_launch

    made = {}

    def get(version):
        if version not in made:
            try:
                made[version] = shared_scenarios_launch(request.session, tmp_path_factory, shared_models, version)
            except Exception as err:  # noqa: BLE001 - a failed launch fails every module sharing it, once
                made[version] = err
        if isinstance(made[version], Exception):
            raise made[version]
        return made[version]

    return get
