"""A throwaway one-host SLURM cluster for `make test-slurm`: munge, slurmctld and two slurmd daemons (nodes n1, n2)
from Debian's packages, every file under one state folder, stopped and removed by :meth:`SlurmCluster.stop`.

Debian's build has MULTIPLE_SLURMD, so two nodes live on this host (``NodeName=n[1-2] NodeHostname=localhost
Port=...``). No cgroups here (``proctrack/linuxproc``, ``task/none``), no accounting; ``JobRequeue=1``; a short
credential lifetime (``AuthInfo=cred_expire``) so a requeued job runs again after seconds, not two minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
CRED_EXPIRE_S = 10  # SLURM holds a requeued job this long (120 s by default)


def ensure_installed() -> float:
    """Install SLURM and munge from Debian's packages when absent (root); returns the seconds it took."""
    if all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey")):
        return 0.0
    started = time.time()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], check=True, env=env,
                   timeout=600)  # fmt: skip
    return time.time() - started


def _conf(state: Path, cpus: int, ports: tuple[int, int, int]) -> str:
    ctld, n1, n2 = ports
    return f"""ClusterName=hfqtest
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge.sock,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/slurmd-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MinJobAge=600
KillWait=10
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1}-{n2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster:
    def __init__(self, state: Path, cpus: int = 8, base_port: int = 16817):
        self.state = Path(state)
        self.ports = (base_port, base_port + 184, base_port + 185)  # 16817, 17001, 17002 by default
        self.cpus = cpus
        self.env = {**os.environ, "SLURM_CONF": str(self.state / "slurm.conf")}
        self._procs: list[int] = []

    def run(self, *cmd, check=True, timeout=60) -> str:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def start(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "ctld").mkdir(exist_ok=True)
        (self.state / "slurm.conf").write_text(_conf(self.state, self.cpus, self.ports))
        key = self.state / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, timeout=30)
        os.chmod(key, 0o400)
        subprocess.run(
            ["munged", "--force", f"--socket={self.state}/munge.sock", f"--key-file={key}",
             f"--log-file={self.state}/munged.log", f"--pid-file={self.state}/munged.pid",
             f"--seed-file={self.state}/munged.seed"], check=True, timeout=30,
        )  # fmt: skip
        self.run("slurmctld", "-i")  # -i: ignore (absent) saved state
        for node in ("n1", "n2"):
            self.run("slurmd", "-N", node)
        deadline = time.time() + 60
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
            if states.count("idle") == 2:
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after 60 s: {states}\n{self.logs()}")

    def logs(self) -> str:
        found = []
        for name in ("slurmctld.log", "slurmd-n1.log", "slurmd-n2.log", "munged.log"):
            path = self.state / name
            if path.exists():
                found.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(found)

    def stop(self) -> None:
        """Cancel every job, stop the daemons (by their pid files) and remove the state folder."""
        if (self.state / "slurm.conf").exists():
            self.run("scancel", "--full", "-u", "root", check=False)
        for name in ("slurmd-n1.pid", "slurmd-n2.pid", "slurmctld.pid", "munged.pid"):
            pid_file = self.state / name
            if not pid_file.exists():
                continue
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except (ValueError, IndexError, ProcessLookupError):
                pass
        shutil.rmtree(self.state, ignore_errors=True)

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
