"""Local launcher of the main job: coordinator + one muond per rank + a torchrun job.

Started by deploy/run-demo.sh after setup and build. It starts
`muond-coordinator` on a free loopback port and one `muond` per trainer rank
(host mode on a machine without a GPU, `--device=<local rank>` with --device
cuda), each on its default socket (`$XDG_RUNTIME_DIR/muond/muond-<job>-<rank>.sock`,
XDG_RUNTIME_DIR being the launch's private directory), waits until every daemon
answers Health, then runs

    torchrun --standalone --nproc-per-node N examples/char_gpt/train_dist.py --parallel P

with the environment muond.torch.Muon reads (docs/parallelism.md):
MUOND_JOB_ID, MUOND_TOKEN_FILE, XDG_RUNTIME_DIR, and MUOND_COORDINATOR (for
the report's plan). It stops everything it started when the trainer ends,
on Ctrl-C, or when a process dies: no orphan processes, sockets or shm
objects are left behind. Logs go to <out>/logs/; a daemon or coordinator
that dies is named with the last lines of its log; a trainer rank that dies
is named by torchrun's failure summary.

The coordinator requires a token: a fresh one per launch, written to a 0600
file in the launch's private (0700) socket directory and handed to the
servers as --token_file, never on a command line (argv is visible to every
user in `ps`). Once the daemons are healthy the launcher prints the job id
and a `muonctl status --coordinator ... --job_id ... --token-file ...` line
that works as printed while the job runs; the token file is removed with the
directory when the launch ends.
"""
import argparse
import fcntl
import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
TRAINER = os.path.join(ROOT, "examples", "char_gpt", "train_dist.py")
sys.path.insert(0, os.path.dirname(TRAINER))
# The trainer's options and layout rule, torch-free: --check-args applies the
# rule every trainer rank would apply after the build.
import options as trainer_options  # noqa: E402


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 (seconds)")
    return value


def job_id(text):
    """Names the socket directory and the shm objects: letters, digits, '._-'."""
    if not text or len(text) > 64 or not all(c.isascii() and (c.isalnum() or c in "._-")
                                             for c in text):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be 1-64 letters, digits, '.', '_' or '-' (it names the "
            "socket directory and shared-memory objects)")
    return text


# One trainer and one daemon process per rank on this host: far more than the
# cores is a typo.
MAX_LOCAL_RANKS = 64
LAYOUTS = trainer_options.LAYOUTS
# sun_path of a Unix socket holds 107 bytes and a NUL.
MAX_SOCKET_PATH = 107


def nproc(text):
    """Trainer processes (= daemons): 1..MAX_LOCAL_RANKS."""
    value = positive_int(text)
    if value > MAX_LOCAL_RANKS:
        raise argparse.ArgumentTypeError(
            f"{value} processes, but the launcher starts one trainer and one daemon "
            f"process per rank on this host; at most {MAX_LOCAL_RANKS}")
    return value


def default_layout(n):
    """FSDP2 x TP on an even number of ranks (2 x 2 on a CPU machine), else FSDP2
    (e.g. a one-GPU host)."""
    return "fsdp+tp" if n % 2 == 0 else "fsdp"


def trainer_argv(a, parallel, device):
    """examples/char_gpt/train_dist.py's options for this launch."""
    return ["--parallel", parallel, "--inner", str(a.inner), "--optimizer", a.optimizer,
            "--steps", str(a.steps), "--out", a.out, "--device", device,
            *[t for t in a.trainer_args if t != "--"]]


class TrainerArgsError(ValueError):
    pass


def check_layout(a, parallel, n, device):
    """'' when train_dist.py accepts its options (the ones after --) and
    lays --nproc processes out as --parallel asks, else what it would refuse
    on every rank after the build (its own parser and rule,
    examples/char_gpt/options.py), worded for this launcher."""
    parser = trainer_options.dist_parser(prog="examples/char_gpt/train_dist.py")

    def refuse(message):
        raise TrainerArgsError(message)

    parser.error = refuse  # its usage is not the launcher's: one line, no exit
    try:
        targs, unknown = parser.parse_known_args(trainer_argv(a, parallel, device))
        if unknown:
            return (f"unknown trainer option(s) after --: {' '.join(unknown)} (the options "
                    "of examples/char_gpt/train_dist.py, listed by its --help)")
        trainer_options.check_layout(targs, n, launcher=True)
    except TrainerArgsError as e:
        return f"trainer options after --: {e}"
    except ValueError as e:
        return str(e)
    return ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-args", action="store_true",
                   help="only validate the arguments and exit (run-demo.sh does this "
                        "before it builds)")
    p.add_argument("--steps", type=positive_int, default=300,
                   help="training steps (default 300)")
    p.add_argument("--nproc", type=nproc, default=None,
                   help="trainer processes, one daemon each (default 4 on CPU, one per GPU "
                        "with --device cuda)")
    p.add_argument("--parallel", choices=LAYOUTS, default=None,
                   help="the trainers' layout: ddp, fsdp (FSDP2), tp (DTensor TP), fsdp+tp "
                        "(2-D mesh), hsdp (replicate x shard) (default fsdp+tp on an even "
                        "--nproc, else fsdp)")
    p.add_argument("--inner", type=positive_int, default=2,
                   help="inner mesh size of fsdp+tp (TP) and hsdp (shard group) (default 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu = gloo trainers, host-mode daemons (shared memory, Gloo); cuda "
                        "= nccl trainers, one per GPU, each daemon on its rank's GPU (CUDA "
                        "IPC); auto = cuda when a GPU is visible")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "demo"),
                   help="logs, report and params (default out/demo); one launch at a "
                        "time per --out")
    p.add_argument("--bin", default=os.environ.get("MUOND_BIN", os.path.join(ROOT, "bazel-bin")),
                   help="where server/daemon/muond and server/coordinator/muond-coordinator "
                        "are, or a GPU bundle's bin/ with muond and muond-coordinator "
                        "(default $MUOND_BIN, else bazel-bin)")
    p.add_argument("--optimizer", default="both", choices=["both", "muond"],
                   help="both = also train the in-process reference for the overlay plot")
    p.add_argument("--health-timeout", type=positive_float, default=60.0,
                   help="seconds to wait for the coordinator and daemons (default 60)")
    p.add_argument("--job-id", type=job_id, default=None,
                   help="job id (default demo<pid>-<6 hex digits>; the launcher prints it)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER,
                   help="after --, extra arguments for examples/char_gpt/train_dist.py")
    args = p.parse_args(argv)
    n = args.nproc or (4 if args.device == "cpu" else None)
    if n is not None:
        problem = check_layout(args, args.parallel or default_layout(n), n,
                               "cuda" if args.device == "cuda" else "cpu")
        if problem:
            p.error(problem)
    return args


def cuda_device_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def binary(bin_dir, rel):
    """bin_dir/rel (a bazel-bin tree), or bin_dir/<name> (a bundle's flat bin/)."""
    flat = os.path.join(bin_dir, os.path.basename(rel))
    return flat if os.path.isfile(flat) else os.path.join(bin_dir, rel)


def tail(path, n=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def write_token_file(directory):
    """A fresh job token in directory/token, created 0600 (O_EXCL: never an
    existing file or a planted link); returns the path."""
    path = os.path.join(directory, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


class Launcher:
    def __init__(self, args):
        self.args = args
        self.procs = []  # (name, Popen, log path)
        self.trainer = None
        # pid + random tag: pids repeat across PID namespaces (containers).
        self.job = args.job_id or f"demo{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.logs = os.path.join(args.out, "logs")
        self.sockdir = None  # a fresh directory per launch (run)
        self.out_lock = None  # held while this launch writes to --out

    def lock_out(self):
        """Two launches writing one --out would overwrite each other's logs and
        report: the second fails here, before it starts anything."""
        path = os.path.join(self.args.out, ".launch.lock")
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "?"
            lock.close()
            raise RuntimeError(f"--out {self.args.out} is in use by another launch (pid "
                               f"{owner}): wait for it to end, or give each launch its "
                               "own --out") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self.out_lock = lock

    def check_binaries(self):
        for rel in ("server/coordinator/muond-coordinator", "server/daemon/muond"):
            path = binary(self.args.bin, rel)
            if not os.access(path, os.X_OK):
                raise RuntimeError(
                    f"--bin {self.args.bin}: no {os.path.basename(rel)} at {path} (run "
                    "deploy/run-demo.sh, which builds it, or pass --bin / $MUOND_BIN)")

    def start(self, name, cmd, env=None):
        log = os.path.join(self.logs, f"{name}.log")
        f = open(log, "w")
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=env or os.environ.copy(), start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def check_alive(self):
        for name, proc, log in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; "
                                   f"last lines of {log}:\n{tail(log)}")

    def stop(self):
        # A second Ctrl-C (or timeout's signal to the whole group) must not
        # abandon the clean-up half way: ignore them while stopping.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.trainer is not None:
            # torchrun and its workers share a session; a worker may outlive
            # a torchrun that already exited.
            try:
                os.killpg(self.trainer.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.trainer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.trainer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.trainer.wait()
        # Daemons first (started last), then the coordinator, so no daemon
        # sees its coordinator go away and tries to reconnect.
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 10
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)
        # The trainer's shm objects are named /muond-<job>-<pid>-... (shm.py).
        for path in glob.glob(f"/dev/shm/muond-{self.job}-*"):
            try:
                os.unlink(path)
            except OSError:
                pass

    def run(self):
        a = self.args
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            raise RuntimeError(f"--out {a.out}: cannot create it ({e.strerror})") from None
        self.lock_out()
        os.makedirs(self.logs, exist_ok=True)
        self.check_binaries()
        device = a.device
        gpus = cuda_device_count() if device in ("auto", "cuda") else 0
        if device == "auto":
            device = "cuda" if gpus > 0 else "cpu"
        if device == "cuda" and gpus == 0:
            raise RuntimeError("--device cuda: no GPU visible (nvidia-smi -L lists none)")
        n = a.nproc or (4 if device == "cpu" else gpus)
        if device == "cuda" and n > gpus:
            raise RuntimeError(f"--nproc {n} with --device cuda: one process per GPU, but "
                               f"nvidia-smi -L lists {gpus}")
        parallel = a.parallel or default_layout(n)
        problem = check_layout(a, parallel, n, device)
        if problem:
            raise RuntimeError(problem)
        self.sockdir = tempfile.mkdtemp(prefix=f"muond-{self.job}-", dir="/tmp")
        token_file = write_token_file(self.sockdir)
        # The daemons listen on their default socket under XDG_RUNTIME_DIR, the
        # rule muond.torch.Muon follows to find its rank's daemon.
        env = dict(os.environ, XDG_RUNTIME_DIR=self.sockdir)
        addresses = [f"unix://{self.sockdir}/muond/muond-{self.job}-{r}.sock" for r in range(n)]
        if len(addresses[-1]) - len("unix://") > MAX_SOCKET_PATH:
            raise RuntimeError(f"--job-id {self.job!r} is too long: the socket path "
                               f"{addresses[-1][7:]} exceeds {MAX_SOCKET_PATH} bytes")

        port_file = os.path.join(self.logs, "coordinator.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        self.start("coordinator", [binary(a.bin, "server/coordinator/muond-coordinator"),
                                   "--listen=127.0.0.1:0", f"--port_file={port_file}",
                                   f"--token_file={token_file}"])
        deadline = time.time() + a.health_timeout
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError("the coordinator did not report its port")
            time.sleep(0.05)
        coordinator = f"127.0.0.1:{open(port_file).read().strip()}"

        for r in range(n):
            mode = ["--host"] if device == "cpu" else [f"--device={r}"]
            self.start(f"muond-rank{r}", [
                binary(a.bin, "server/daemon/muond"), f"--coordinator={coordinator}",
                f"--job_id={self.job}", f"--rank={r}", f"--world_size={n}",
                f"--token_file={token_file}", *mode], env=env)
        self.wait_healthy(addresses, deadline)
        muonctl = binary(a.bin, "tools/muonctl/muonctl")
        if not os.access(muonctl, os.X_OK):
            muonctl = "muonctl"
        print(f"launcher: job {self.job}: coordinator {coordinator}, {n} daemons ({device}) "
              f"healthy; trainers: torchrun --nproc-per-node {n}, --parallel {parallel}; "
              f"logs in {self.logs}\nlauncher: while it runs: {muonctl} status --coordinator "
              f"{coordinator} --job_id {self.job} --token-file {token_file}", flush=True)

        env.update(MUOND_JOB_ID=self.job, MUOND_TOKEN_FILE=token_file,
                   MUOND_COORDINATOR=coordinator)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(n), TRAINER, *trainer_argv(a, parallel, device)]
        # Its own session: stop() signals torchrun and every trainer rank together.
        self.trainer = subprocess.Popen(cmd, env=env, start_new_session=True)
        while self.trainer.poll() is None:
            self.check_alive()  # a dead daemon: named, then stop() ends the trainers
            time.sleep(0.2)
        if self.trainer.returncode != 0:
            raise RuntimeError(f"the trainers (torchrun, {n} processes) exited with code "
                               f"{self.trainer.returncode}; torchrun's failure summary above "
                               "names the rank that failed first")

    def wait_healthy(self, addresses, deadline):
        import grpc
        from muond.v1 import muond_pb2, muond_pb2_grpc
        pending = list(addresses)
        while pending:
            self.check_alive()
            if time.time() > deadline:
                raise RuntimeError(f"daemons not healthy in time: {pending}")
            addr = pending[0]
            try:
                with grpc.insecure_channel(addr) as ch:
                    reply = muond_pb2_grpc.OptimizerStub(ch).Health(
                        muond_pb2.HealthRequest(), timeout=1.0)
                if reply.serving:
                    pending.pop(0)
                    continue
            except grpc.RpcError:
                pass
            time.sleep(0.1)


def main():
    args = parse_args()
    if args.check_args:
        return 0
    launcher = Launcher(args)

    def on_signal(signum, _):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started with SIGINT ignored
    # The verdict is printed after stop(): what the stopped trainers print
    # (torchrun's traceback on SIGTERM) must not bury the name of what died.
    try:
        launcher.run()
        verdict, code = f"launcher: done; report in {os.path.join(args.out, 'report.md')}", 0
    except KeyboardInterrupt:
        verdict, code = "launcher: interrupted; stopped everything", 130
    except RuntimeError as e:
        verdict, code = f"launcher: FAILED: {e}", 1
    finally:
        launcher.stop()
    print(verdict, file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
