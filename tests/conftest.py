import functools
import os
import re
from collections import OrderedDict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- pytest-xdist (`make test` runs `-n 2 --dist loadfile`) ---------------------------------------------------
# Each test file runs whole in one worker, so its module-scoped launches run once; the files that share the
# session's launches (they define SHARED_TRAIN_SCENARIOS) run together in one worker, so those launches run once
# too. Files with the most launches start first: a long file started last would leave the other worker idle.
_LAUNCHES = re.compile(
    r"accelerate_launch\(|torchrun\(|_launch\w*\(|shared_launch\(|subprocess\.(?:run|Popen)\(|_run\("
)


@functools.cache
def _file_facts(path: Path) -> tuple[bool, int]:
    """(shares the session's launches, how many launch-like calls it makes) of a test file."""
    try:
        text = path.read_text()
    except OSError:
        return False, 0
    return "SHARED_TRAIN_SCENARIOS" in text, len(_LAUNCHES.findall(text))


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
