"""deploy/slurm/muond.sbatch end to end under a fake Slurm (fake_slurm.py:
`srun` runs each task here with the variables Slurm sets, `scontrol show
hostnames` expands the node list), on CPU (MUOND_DEVICE=cpu, host mode):

* 2 simulated nodes x 2 ranks, node k on its own loopback address (the node
  list is 127.0.1.[1-2], so SLURMD_NODENAME -- the launcher's --node-addr --
  and the first host -- coordinator and torchrun master -- are addresses):
  every rank 0..3 trains, on the node torchrun's static node rank says, with
  its node's daemons; the final params are the same on every rank, moved,
  and bitwise equal to the same job on 1 node x 4 ranks.
* A trainer rank that fails on node 1: the job exits non-zero (srun's
  --kill-on-bad-exit ends node 0's launcher, which stops its trainers and
  servers).
* Every run leaves nothing behind: no process naming the job, no socket
  directory, no shm object of the job, no token file.
"""
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import unittest

import torch

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SBATCH = os.path.join(RUNFILES, "deploy/slurm/muond.sbatch")
FAKE_SLURM = os.path.join(RUNFILES, "tests/deploy/fake_slurm.py")
TRAINER = os.path.join(RUNFILES, "tests/deploy/slurm_trainer.py")
STEPS = 3
# Variables of the caller that would steer the launcher, torchrun or client.
STEERING = re.compile(r"^(MUOND_|SLURM|RANK$|WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|"
                      r"GROUP_RANK$|NODE_RANK$|MASTER_ADDR$|MASTER_PORT$|TORCHELASTIC_)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list:
    """(pid, cmdline) of every process whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append((int(pid), cmdline))
    return found


class SlurmSbatchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="mslurm-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.shims = os.path.join(self.tmp, "shims")
        os.mkdir(self.shims)
        wrappers = {
            "srun": f'exec "{sys.executable}" "{FAKE_SLURM}" srun "$@"',
            "scontrol": f'exec "{sys.executable}" "{FAKE_SLURM}" scontrol "$@"',
            # The `muond` command of the package under test.
            "muond": f'exec "{sys.executable}" -m muond.cli "$@"',
        }
        for name, line in wrappers.items():
            path = os.path.join(self.shims, name)
            with open(path, "w") as f:
                f.write(f"#!/bin/sh\n{line}\n")
            os.chmod(path, 0o755)

    def submit(self, slurm_job_id: str, nodes: int, nproc: int, *trainer_args):
        """Runs the sbatch script as sbatch's batch step on the first node
        would; returns (exit status, output, submit dir)."""
        hosts = [f"127.0.1.{k + 1}" for k in range(nodes)]
        submit_dir = os.path.join(self.tmp, f"submit-{slurm_job_id}")
        os.mkdir(submit_dir)
        env = {k: v for k, v in os.environ.items() if not STEERING.match(k)}
        env.update(
            PATH=f"{self.shims}:{env['PATH']}",
            MUOND_BIN_DIR=RUNFILES, MUOND_DEVICE="cpu", MUOND_NPROC_PER_NODE=str(nproc),
            MUOND_COORDINATOR_PORT=str(free_port()), MUOND_MASTER_PORT=str(free_port()),
            SLURM_JOB_ID=slurm_job_id, SLURM_JOBID=slurm_job_id, SLURM_JOB_NAME="muond",
            SLURM_JOB_NODELIST="127.0.1.[1-%d]" % nodes if nodes > 1 else hosts[0],
            SLURM_NODELIST="127.0.1.[1-%d]" % nodes if nodes > 1 else hosts[0],
            SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_NTASKS=str(nodes), SLURM_NPROCS=str(nodes), SLURM_NTASKS_PER_NODE="1",
            SLURM_TASKS_PER_NODE=f"1(x{nodes})", SLURM_NODEID="0", SLURM_PROCID="0",
            SLURM_LOCALID="0", SLURMD_NODENAME=hosts[0], SLURM_SUBMIT_DIR=submit_dir,
            SLURM_SUBMIT_HOST=socket.gethostname(), SLURM_CPUS_ON_NODE="2",
            SLURM_JOB_CPUS_PER_NODE=f"2(x{nodes})", SLURM_CLUSTER_NAME="fake")
        proc = subprocess.Popen(["bash", SBATCH, TRAINER, *trainer_args], cwd=submit_dir,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            self.fail(f"job {slurm_job_id} did not end in 400 s:\n{output[-6000:]}")
        finally:
            self.assertNothingLeft(slurm_job_id, submit_dir)
        return proc.returncode, output, submit_dir

    def assertNothingLeft(self, slurm_job_id: str, submit_dir: str):
        job = f"slurm-{slurm_job_id}"
        left = processes_naming(job) + processes_naming(submit_dir)
        for pid, _ in left:  # ours: they name this test's job
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.assertEqual(left, [], "processes left behind")
        self.assertEqual([f for f in os.listdir("/dev/shm") if job in f], [],
                         "shm objects left behind")
        self.assertEqual([d for d in os.listdir("/tmp") if d.startswith(f"muond-{job}")], [],
                         "socket directories left behind")
        token_dir = os.path.join(submit_dir, ".muond")
        if os.path.isdir(token_dir):
            self.assertEqual(stat.S_IMODE(os.stat(token_dir).st_mode), 0o700)
            self.assertEqual(os.listdir(token_dir), [], "token file left behind")

    def run_training(self, slurm_job_id: str, nodes: int, nproc: int) -> list:
        out = os.path.join(self.tmp, f"out-{slurm_job_id}")
        os.mkdir(out)
        rc, output, submit_dir = self.submit(slurm_job_id, nodes, nproc, out, str(STEPS))
        self.assertEqual(rc, 0, output[-8000:])
        world = nodes * nproc
        records = []
        for rank in range(world):
            path = os.path.join(out, f"rank{rank}.json")
            self.assertTrue(os.path.exists(path), f"rank {rank} wrote nothing:\n{output[-8000:]}")
            with open(path) as f:
                records.append(json.load(f))
        for rank, r in enumerate(records):
            self.assertEqual((r["rank"], r["world"], r["job_id"]),
                             (rank, world, f"slurm-{slurm_job_id}"))
            self.assertEqual(r["node_rank"], rank // nproc, f"rank {rank}")
            self.assertEqual(r["muond_node_rank"], rank // nproc, f"rank {rank}")
            self.assertEqual(r["local_rank"], rank % nproc, f"rank {rank}")
            # Its node's daemon, with the node's address for Gloo traffic.
            self.assertEqual(r["daemon_flags"].get("gloo_hostname"),
                             f"127.0.1.{rank // nproc + 1}", f"rank {rank}")
        # Each node its own launcher: its own socket directory.
        self.assertEqual(len({r["socket_dir"] for r in records}), nodes)
        logs = os.path.join(submit_dir, "muond-logs", slurm_job_id)
        self.assertEqual(sorted(os.listdir(logs)), [f"node{k}" for k in range(nodes)])
        return records

    def test_two_nodes_match_one_node(self):
        two = self.run_training("1001", nodes=2, nproc=2)
        one = self.run_training("1002", nodes=1, nproc=4)
        torch.manual_seed(0)  # the trainer's initial model
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        init = {n: p.detach().tolist() for n, p in model.named_parameters()}
        for name in init:
            self.assertNotEqual(two[0]["params"][name], init[name], f"{name} never moved")
            for r in two + one:
                self.assertEqual(r["params"][name], two[0]["params"][name],
                                 f"{name} on rank {r['rank']} of a {len(two)}-rank run")

    def test_a_failing_rank_fails_the_job(self):
        out = os.path.join(self.tmp, "out-fail")
        os.mkdir(out)
        # Rank 3 (node 1) exits 3 before training; node 0 is stopped by srun.
        rc, output, _ = self.submit("1003", 2, 2, out, str(STEPS), "--fail-rank", "3")
        self.assertNotEqual(rc, 0, output[-8000:])
        self.assertNotIn("rank3.json", os.listdir(out))


if __name__ == "__main__":
    unittest.main()
