"""One registry entry: a workaround of upstream behaviour, where it lives in our code, and the canary watching it.

Import-light on purpose: no torch at import time (the CLI imports the registry before any heavy library).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CANARIES", "DOCTOR", "LAUNCHED", "MIXIN", "Workaround"]


@dataclass(frozen=True)
class Workaround:
    key: str
    upstream: str  # the package (versions checked) and issue, if any
    works_around: str  # the upstream behaviour, in one or two lines
    where: tuple[str, ...]  # dotted paths of our code holding the workaround (module[.Class].function)
    remove_when: str
    canary: str  # pytest node id of the test that runs the stock path


# Canary shorthands the library modules share.
CANARIES = "tests/test_compat.py::"
LAUNCHED = CANARIES + "test_launched_stock_canaries"  # one 2-rank gloo launch, several stock behaviours
DOCTOR = "tests/test_doctor.py::test_doctor_agrees_with_reality"  # real stock failures, rehearsed on 2 ranks
MIXIN = "hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin"  # our trainer mixin: the Trainer hooks we override
