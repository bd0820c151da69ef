"""examples/multinode/ on one host: the SLURM script and the per-node launcher start two
"nodes" on the loopback address, which rendezvous (torchrun's c10d) into one world of two gloo
ranks that train the toy recipe. SLURM itself needs a cluster: ``srun`` and ``scontrol`` are
stand-ins (shell scripts put first on PATH) that do only what the script asks of them, one
task per node with SLURM_NODEID set, and the allocation's host names."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from trainer.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "multinode"

FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for SLURM's srun: its own options dropped, one task per node on this host
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$SRUN_LOG_DIR/node$node.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# stand-in for `scontrol show hostnames LIST`: every node of this test is the loopback host
[[ "$1 $2" == "show hostnames" ]] && printf '127.0.0.1\\n127.0.0.1\\n'
"""


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)


def test_slurm_script_rendezvous_two_nodes_on_one_host(tmp_path):
    _fake_slurm(tmp_path / "bin")
    run = tmp_path / "run"
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT), PYTHON=sys.executable, SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node[0-1]", SLURM_SUBMIT_DIR=str(ROOT),
               SRUN_LOG_DIR=str(tmp_path), MASTER_PORT=str(free_port()), RECIPE="toy",
               NPROC_PER_NODE="1")
    done = subprocess.run(
        ["bash", str(EXAMPLE / "slurm.sbatch"), "--set", f"logging.run_dir={run}",
         "--set", "launch.device=cpu", "--set", "train.num_rollouts=1",
         "--set", "data.eval_prompt_data=none", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--set", "train.micro_batch_size=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    logs = [(tmp_path / f"node{n}.log").read_text() if (tmp_path / f"node{n}.log").exists()
            else f"(node{n}.log was never written: srun did not start it)" for n in (0, 1)]
    assert done.returncode == 0, (done.stdout[-2000:] + done.stderr[-2000:] + "\n----\n"
                                  + "\n----\n".join(x[-3000:] for x in logs))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "perf/step_time" in r] == [1]
    state = json.loads(next(run.glob("checkpoints/t2i/iter_*/trainer_state.json")).read_text())
    assert state["world_size"] == 2  # one rank from each "node", in one world


def test_launch_node_names_every_missing_variable(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    done = subprocess.run(["bash", str(EXAMPLE / "launch_node.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "set NNODES NODE_RANK MASTER_ADDR" in done.stderr


def test_launch_node_passes_torchruns_flags_to_launch(tmp_path):
    """The node launcher's command line, checked by launch itself (--dry-run resolves the
    flags into the config it prints, starting nothing)."""
    env = dict(os.environ, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3",
               MASTER_PORT="29999", NPROC_PER_NODE="1", RECIPE="toy", PYTHONPATH=str(ROOT),
               PYTHON=sys.executable)
    done = subprocess.run(["bash", str(EXAMPLE / "launch_node.sh"), "--dry-run", "--set",
                           f"logging.run_dir={tmp_path / 'run'}", "--set", "launch.device=cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    launch = done.stdout.split("[launch]", 1)[1].split("[", 1)[0]
    for line in ('nproc = 1', 'nnodes = "2"', 'node_rank = 1',
                 'rdzv_endpoint = "10.1.2.3:29999"'):
        assert line in launch, launch
