"""The Slurm recipe: valid bash, and the right commands on the right nodes (Slurm, Ray and python stubbed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "recipes" / "slurm_multinode.sbatch"

# Each stub appends its command line to $LOG; `srun ... hostname` answers like a dual-stack node.
STUBS = {
    "scontrol": 'echo node-a; echo node-b; echo node-c',
    "srun": 'if [[ " $* " == *" hostname "* ]]; then echo "fe80::1 10.0.0.7"; '
            'else echo "srun $*" >> "$LOG"; fi',
    "python": 'echo "python $*" >> "$LOG"; [[ $1 == -c ]] && echo token123; '
              '[[ $1 == - ]] && cat > /dev/null; true',
    "sleep": 'true',
}


def test_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_head_workers_and_molt_command(tmp_path: Path) -> None:
    for name, body in STUBS.items():
        stub = tmp_path / name
        stub.write_text(f"#!/bin/bash\n{body}\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
           "SLURM_JOB_NODELIST": "node-[a-c]", "SLURM_JOB_NUM_NODES": "3", "SLURM_CPUS_PER_TASK": "64",
           "SLURM_GPUS_PER_TASK": "8"}
    done = subprocess.run(["bash", str(SCRIPT), "train.lr=5e-7"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    log = sorted((tmp_path / "log").read_text().splitlines())  # background steps may log in any order
    resources = "--num-cpus 64 --num-gpus 8 --block"
    on = "srun --nodes=1 --ntasks=1 -w"
    assert log == sorted([
        "python -c import secrets; print(secrets.token_hex(32))",
        f"{on} node-a ray start --head --node-ip-address=10.0.0.7 --port=6379 {resources}",
        f"{on} node-b ray start --address=10.0.0.7:6379 {resources}",
        f"{on} node-c ray start --address=10.0.0.7:6379 {resources}",
        "python - 10.0.0.7:6379 3",
        "python -u -m molt +experiment=qwen30b_tools ray.address=10.0.0.7:6379 run.resume=auto train.lr=5e-7",
    ])
