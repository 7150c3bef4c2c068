"""`muond launch` end to end with the real servers (host mode, gloo trainers):

* per-node: `muond launch --nproc-per-node 2 --device cpu -- torchrun
  --standalone --nproc-per-node 2 launch_trainer.py` trains 4 steps; the
  final parameters equal a plain single-process Muon (written here, fp64) run
  on the same global batches within fp32 tolerance; each rank saw the
  exported environment and its daemon's socket in $MUOND_SOCKET_DIR;
* per-rank: `torchrun --nproc-per-node 2 -m muond.cli launch -- python
  launch_trainer.py` (one launcher per rank, rank 0 starts the coordinator):
  the same check;
* a daemon SIGKILLed mid-run: the launcher exits 1 naming that rank, its pid
  and the signal, and stops the trainers;
* the command failing: its exit status is returned, the servers stopped;
* SIGTERM to the launcher: forwarded to the command, exit 128+15;
* SIGKILL to the launcher while the command ignores SIGTERM: its reaper
  stops the command's process group and the servers and removes the socket
  dir;
* a torchrun worker (its own session, as torchrun starts them) that ignores
  SIGTERM, with --stop-grace below torchrun's 30 s: SIGTERM to the launcher,
  or SIGKILL (then its reaper), still stops it and removes its shm objects;
* node 0 of 2 with node 1 never started: --join-timeout fails naming rank 1
  on node rank 1;
* a TLS coordinator: the daemons join verified by --tls-ca; a CA that did
  not sign its certificate fails the launcher's health check;
* --metrics-port P / --log-format json reach the servers: /metrics on P
  (coordinator), P+1, P+2 (daemons), JSON-lines logs.
After every run: no process, socket directory or shm object of the job is
left (checked through /proc, /tmp and /dev/shm).

Why a tolerance and not bitwise: the daemons run Newton-Schulz with OpenBLAS
sgemm in fp32, the reference in fp64; 4 steps of a 16x8 / 4x16 MLP differ by
~1e-6 relative, while a wrong data slice, gradient average or rank mix-up
moves the parameters by 1e-2 or more.
"""
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import torch

from tests.common.launched import bin_dir, launch_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import launch_trainer as T  # noqa: E402

TRAINER = os.path.join(HERE, "launch_trainer.py")
TOLERANCE = 1e-4
STEPS = 4


def env():
    return launch_env(HERE)


def launch_argv(*args):
    return [sys.executable, "-m", "muond.cli", "launch", "--bin-dir", bin_dir(), *args]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n):
    """A port P with P..P+n-1 free now."""
    while True:
        base = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def reference():
    """Plain Muon (torch.optim.Muon's math: simple coefficients x 5, Nesterov,
    original scale, decoupled weight decay) in fp64 in one process on the
    global batch, which the DDP ranks' averaged gradients equal."""
    h = T.HYPER
    params = [t.double().requires_grad_() for t in T.initial_params()]
    bufs = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        x, y = (t.double() for t in T.global_batch(step))
        for p in params:
            p.grad = None
        T.loss_fn(params, x, y).backward()
        with torch.no_grad():
            for p, buf in zip(params, bufs):
                buf.lerp_(p.grad, 1 - h["momentum"])
                update = p.grad.lerp(buf, h["momentum"])
                X = update / (update.norm() + h["eps"])
                tall = X.shape[0] > X.shape[1]
                if tall:
                    X = X.T
                for _ in range(h["ns_steps"]):
                    A = X @ X.T
                    X = 3.4445 * X + (-4.775 * A + 2.0315 * A @ A) @ X
                if tall:
                    X = X.T
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.mul_(1 - h["lr"] * h["weight_decay"])
                p.add_(X, alpha=-h["lr"] * scale)
    return [p.detach() for p in params]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def job_processes(job):
    """Pids whose command line names the job (servers: --job_id=J)."""
    pids = (int(path.split("/")[2]) for path in glob.glob("/proc/[0-9]*"))
    return [pid for pid in pids if pid != os.getpid() and job in "\0".join(cmdline(pid))]


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _lives(pid):
    """Running (a zombie has let go of its memory and shm mappings)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _kill_if_left(pid, argv):
    """Cleanup after a failed check: the worker the test started, if the pid
    is still that process."""
    if argv and cmdline(pid) == argv:
        os.kill(pid, signal.SIGKILL)


class LaunchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="mlt-", dir="/tmp")
        self.job = f"lt{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.logs = os.path.join(self.tmp, "logs")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)  # runs last
        self.addCleanup(self.assert_nothing_left)

    def assert_nothing_left(self):
        self.assertEqual(glob.glob(f"/tmp/muond-{self.job}-*"), [])  # socket dirs
        self.assertEqual(glob.glob(f"/dev/shm/muond-{self.job}-*"), [])
        self.assertEqual(job_processes(self.job), [])
        self.assertEqual(job_processes(self.tmp), [])  # trainers (their out dir)

    def run_launch(self, argv, timeout=300):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env())

    def check_training(self, world, master="127.0.0.1"):
        want = reference()
        seen = []
        for rank in range(world):
            with open(os.path.join(self.tmp, f"rank{rank}.json")) as f:
                seen.append(json.load(f))
        for rank, s in enumerate(seen):
            e = s["env"]
            self.assertTrue(s["socket_existed"], rank)  # found in $MUOND_SOCKET_DIR
            self.assertEqual((e["MUOND_JOB_ID"], e["RANK"], e["WORLD_SIZE"], e["MUOND_NNODES"],
                              e["MUOND_NODE_RANK"], e["MUOND_MASTER_ADDR"]),
                             (self.job, str(rank), str(world), "1", "0", master))
            self.assertEqual(e["MUOND_NPROC_PER_NODE"], str(world))
            self.assertRegex(e["MUOND_COORDINATOR"], rf"^{master}:\d+$")
            self.assertTrue(e["MUOND_SOCKET_DIR"].startswith(f"/tmp/muond-{self.job}-"))
        got = [torch.tensor(t, dtype=torch.float64) for t in seen[0]["final"]]
        for g, w, init in zip(got, want, T.initial_params()):
            self.assertGreater(float((w - init.double()).abs().max()), 1e-3)  # it trained
            rel = float((g - w).abs().max() / w.abs().max())
            self.assertLessEqual(rel, TOLERANCE)

    def test_per_node_trains_like_plain_muon(self):
        proc = self.run_launch(launch_argv(
            "--nproc-per-node", "2", "--device", "cpu", "--job-id", self.job, "--log-dir",
            self.logs, "--", *torchrun("--nproc-per-node", "2", TRAINER, self.tmp,
                                       "--steps", str(STEPS))))
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertIn(f"muond launch: job {self.job}: coordinator 127.0.0.1:", proc.stdout)
        self.assertEqual(sorted(os.listdir(self.logs)),
                         ["coordinator.log", "muond-rank0.log", "muond-rank1.log"])
        with open(os.path.join(self.logs, "coordinator.log")) as f:
            self.assertIn("(token required)", f.read())
        self.check_training(2)

    def test_per_rank_under_torchrun(self):
        token = os.path.join(self.tmp, "token")
        fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"per-rank-test-token\n")
        os.close(fd)
        proc = self.run_launch(torchrun(
            "--nproc-per-node", "2", "-m", "muond.cli", "launch", "--bin-dir", bin_dir(),
            "--device", "cpu", "--job-id", self.job, "--token-file", token,
            "--coordinator-port", str(free_port()), "--log-dir", self.logs, "--",
            sys.executable, TRAINER, self.tmp, "--steps", str(STEPS)))
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertIn("per-rank", proc.stdout)
        # torchrun --standalone's MASTER_ADDR is "localhost": the coordinator's host.
        # Rank 0's launcher started the coordinator, each its own daemon.
        self.assertEqual(sorted(os.listdir(self.logs)),
                         ["coordinator.log", "muond-rank0.log", "muond-rank1.log"])
        self.check_training(2, master="localhost")

    def start_slow(self):
        argv = launch_argv("--nproc-per-node", "2", "--device", "cpu", "--job-id", self.job,
                           "--log-dir", self.logs, "--stop-grace", "5", "--",
                           *torchrun("--nproc-per-node", "2", TRAINER, self.tmp, "--steps",
                                     "100000", "--slow"))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        marker = os.path.join(self.tmp, "stepped")
        while not os.path.exists(marker):
            self.assertIsNone(proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
            time.sleep(0.1)
        return proc

    def test_daemon_killed_mid_run(self):
        proc = self.start_slow()
        victim = [pid for pid in job_processes(self.job)
                  if {"--rank=1", "--host"} <= set(cmdline(pid))]
        self.assertEqual(len(victim), 1, victim)
        os.kill(victim[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        self.assertEqual(proc.returncode, 1, out[-2000:] + err[-2000:])
        self.assertIn(f"muond launch: FAILED: daemon rank 1 (pid {victim[0]}) killed by "
                      "signal 9 (SIGKILL)", err)
        self.assertIn("muond-rank1.log", err)

    def test_signal_to_launcher_is_forwarded(self):
        proc = self.start_slow()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        self.assertEqual(proc.returncode, 128 + signal.SIGTERM, out[-2000:] + err[-2000:])
        self.assertIn("stopped by signal SIGTERM", err)
        # torchrun got the signal (its own summary names it), not a daemon death.
        self.assertNotIn("FAILED", err)

    def test_launcher_killed_takes_its_servers(self):
        """SIGKILL to the launcher (no teardown runs) while the command ignores
        SIGTERM and runs children of its own: the reaper the launcher forked
        at start stops the command's whole process group (SIGKILL after the
        stop grace), the servers, and removes the socket dir and its token."""
        up = os.path.join(self.tmp, "up")
        proc = subprocess.Popen(launch_argv(
            "--device", "cpu", "--nproc-per-node", "2", "--job-id", self.job, "--log-dir",
            self.logs, "--stop-grace", "1", "--", "bash", "-c",
            f'trap "" TERM; echo $$ > {up}.tmp; mv {up}.tmp {up}; while :; do sleep 1; done'),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        while not os.path.exists(up):
            self.assertIsNone(proc.poll())
            time.sleep(0.1)
        with open(up) as f:
            pgid = os.getpgid(int(f.read()))
        # The coordinator (its --token_file names the job's socket dir), 2 daemons.
        servers = [p for p in job_processes(self.job) if "muond.cli" not in cmdline(p)]
        self.assertEqual(len(servers), 3, [cmdline(p) for p in servers])
        self.assertEqual(len(glob.glob(f"/tmp/muond-{self.job}-*/token")), 1)
        proc.kill()
        proc.wait()

        def group():
            return [pid for pid in map(int, (p.split("/")[2] for p in glob.glob("/proc/[0-9]*")))
                    if _pgid(pid) == pgid]
        for _ in range(600):  # until all is gone (bounded: the test must end)
            if not (job_processes(self.job) or group() or glob.glob(f"/tmp/muond-{self.job}-*")):
                break
            time.sleep(0.1)
        self.assertEqual(group(), [])
        self.assertEqual(job_processes(self.job), [])  # servers and the reaper
        self.assertEqual(glob.glob(f"/tmp/muond-{self.job}-*"), [])

    def start_stubborn(self):
        """1 rank under torchrun whose worker, after a step, ignores SIGTERM;
        --stop-grace 1 (torchrun would wait 30 s for it): (launcher, worker
        pid). Its stderr goes to a file: a worker left running would hold a
        pipe open."""
        self.stderr = open(os.path.join(self.tmp, "stderr"), "w")
        self.addCleanup(self.stderr.close)
        proc = subprocess.Popen(launch_argv(
            "--device", "cpu", "--nproc-per-node", "1", "--job-id", self.job, "--log-dir",
            self.logs, "--stop-grace", "1", "--",
            *torchrun("--nproc-per-node", "1", TRAINER, self.tmp, "--stubborn")),
            stdout=subprocess.DEVNULL, stderr=self.stderr, env=env())
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        up = os.path.join(self.tmp, "stubborn")
        while not os.path.exists(up):
            if proc.poll() is not None:
                self.fail(self.read_stderr())
            time.sleep(0.1)
        with open(up) as f:
            worker = int(f.read())
        self.addCleanup(_kill_if_left, worker, cmdline(worker))
        self.assertNotEqual(_pgid(worker), _pgid(proc.pid))  # out of the group's reach
        self.assertTrue(glob.glob(f"/dev/shm/muond-{self.job}-{worker}-*"))
        return proc, worker

    def read_stderr(self):
        with open(self.stderr.name) as f:
            return f.read()[-6000:]

    def test_stop_reaches_workers_in_their_own_sessions(self):
        proc, worker = self.start_stubborn()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        err = self.read_stderr()
        self.assertEqual(proc.returncode, 128 + signal.SIGTERM, err)
        self.assertIn("stopped by signal SIGTERM; stopped everything", err)
        self.assertFalse(_lives(worker), cmdline(worker))
        self.assertEqual(glob.glob(f"/dev/shm/muond-{self.job}-*"), [])

    def test_reaper_stops_workers_in_their_own_sessions(self):
        proc, worker = self.start_stubborn()
        proc.kill()
        proc.wait()
        for _ in range(600):  # until all is gone (bounded: the test must end)
            if not (_lives(worker) or job_processes(self.job)
                    or glob.glob(f"/dev/shm/muond-{self.job}-*")):
                break
            time.sleep(0.1)
        self.assertFalse(_lives(worker), cmdline(worker))
        self.assertEqual(job_processes(self.job), [])  # servers and the reaper
        self.assertEqual(glob.glob(f"/dev/shm/muond-{self.job}-*"), [])

    def test_join_timeout_names_the_missing_node(self):
        """Node 0 of 2 (loopback) while node 1's launcher never starts: with
        --join-timeout 2 the launcher stops the command and fails naming rank
        1 on node rank 1."""
        token = os.path.join(self.tmp, "token")
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("join-timeout-test-token\n")
        proc = self.run_launch(launch_argv(
            "--device", "cpu", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1",
            "--job-id", self.job, "--token-file", token, "--master-addr", "127.0.0.1",
            "--node-addr", "127.0.0.1", "--coordinator-port", str(free_port()),
            "--log-dir", self.logs, "--join-timeout", "2", "--stop-grace", "2", "--",
            "sleep", "600"), timeout=120)
        self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-2000:])
        self.assertIn(f"job {self.job}: 1 of 2 daemons did not join the coordinator within "
                      "2 s (--join-timeout): rank 1 on node rank 1", proc.stderr)

    def test_command_failure_status_is_returned(self):
        # The command checks its daemon's socket while it runs, then fails.
        script = ('test -S "$MUOND_SOCKET_DIR/muond-$MUOND_JOB_ID-0.sock" && '
                  'test -r "$MUOND_TOKEN_FILE" && exit 7; exit 3')
        proc = self.run_launch(launch_argv("--device", "cpu", "--job-id", self.job,
                                           "--log-dir", self.logs, "--", "sh", "-c", script))
        self.assertEqual(proc.returncode, 7, proc.stdout[-2000:] + proc.stderr[-2000:])

    @unittest.skipUnless(shutil.which("openssl"), "no openssl to make a certificate")
    def test_tls_coordinator(self):
        """--tls-cert/--tls-key: the daemons join over TLS verified with --tls-ca;
        a CA that did not sign the certificate fails the health check."""
        def cert(name):
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                            "2", "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=IP:127.0.0.1", "-keyout",
                            os.path.join(self.tmp, f"{name}.key"), "-out",
                            os.path.join(self.tmp, f"{name}.pem")],
                           check=True, capture_output=True)
            return os.path.join(self.tmp, f"{name}.pem"), os.path.join(self.tmp, f"{name}.key")
        crt, key = cert("server")
        other, _ = cert("other")
        base = ["--device", "cpu", "--nproc-per-node", "2", "--job-id", self.job,
                "--coordinator-port", str(free_port()), "--tls-cert", crt, "--tls-key", key]
        # The launcher runs the command once the daemons answer health, which they
        # do before their Join completes: the command waits for both joins (or
        # fails after 60 s), so the logs checked below are complete.
        logs = [os.path.join(self.logs, f"muond-rank{rank}.log") for rank in (0, 1)]
        wait_joined = ("for _ in $(seq 600); do grep -q 'joined job' \"$1\" && "
                       "grep -q 'joined job' \"$2\" && exit 0; sleep 0.1; done; exit 1")
        proc = self.run_launch(launch_argv(*base, "--tls-ca", crt, "--log-dir", self.logs,
                                           "--", "bash", "-c", wait_joined, "wait", *logs))
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
        for rank in (0, 1):
            with open(os.path.join(self.logs, f"muond-rank{rank}.log")) as f:
                self.assertIn(f"joined job {self.job} as rank {rank}/2", f.read())
        proc = self.run_launch(launch_argv(*base, "--tls-ca", other, "--log-dir", self.logs,
                                           "--health-timeout", "3", "--", "true"))
        self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-2000:])
        self.assertIn("coordinator (pid", proc.stderr)
        self.assertIn("did not answer the health check", proc.stderr)

    def test_metrics_and_json_logs_reach_the_servers(self):
        """--metrics-port P: the coordinator serves /metrics on P, local rank k's
        daemon on P+1+k (scraped by the command while they run, parsed with
        prometheus-client's parser); --log-format json: the servers' logs are
        JSON lines."""
        port = free_ports(3)
        scrape = ("import sys, urllib.request\n"
                  "for i in range(3):\n"
                  f"    body = urllib.request.urlopen('http://127.0.0.1:%d/metrics' % ({port} + i),"
                  " timeout=30).read()\n"
                  f"    open('{self.tmp}/metrics%d.txt' % i, 'wb').write(body)\n")
        proc = self.run_launch(launch_argv(
            "--device", "cpu", "--nproc-per-node", "2", "--job-id", self.job, "--log-dir",
            self.logs, "--metrics-port", str(port), "--log-format", "json", "--",
            sys.executable, "-c", scrape))
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
        from prometheus_client.parser import text_string_to_metric_families
        names = []
        for i in range(3):
            with open(os.path.join(self.tmp, f"metrics{i}.txt")) as f:
                names.append({m.name for m in text_string_to_metric_families(f.read())})
        applied = {"muond_steps_applied", "muond_steps_applied_total"}  # parser drops _total
        self.assertIn("muond_coordinator_jobs", names[0])
        self.assertFalse(applied & names[0])
        for i in (1, 2):
            self.assertTrue(applied & names[i], names[i])
            self.assertNotIn("muond_coordinator_jobs", names[i])
        for n in names:
            self.assertIn("muond_build_info", n)
        for name in ("coordinator", "muond-rank0", "muond-rank1"):
            with open(os.path.join(self.logs, f"{name}.log")) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            self.assertTrue(lines, name)
            self.assertTrue(all({"time", "severity", "message"} <= set(e) for e in lines), name)

    def test_refusals_start_nothing(self):
        proc = self.run_launch(launch_argv("--nnodes", "2", "--node-rank", "2", "--job-id",
                                           self.job, "--", "true"))
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--node-rank 2 (--node-rank) must be < --nnodes 2", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        proc = self.run_launch([sys.executable, "-m", "muond.cli", "launch", "--bin-dir",
                                os.path.join(self.tmp, "nope"), "--", "true"])
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--bin-dir", proc.stderr)
        self.assertIn("no executable muond-coordinator", proc.stderr)


if __name__ == "__main__":
    unittest.main()
