"""The demo: `muond launch` around a torchrun job of the char-GPT trainer.

Started by deploy/run-demo.sh after setup and build. It checks the demo's
options (--check-args: the trainer's own parser and layout rule, before the
build), takes --out, then runs

    muond launch --nproc-per-node N --device cpu|cuda --bin-dir BIN --log-dir OUT/logs
                 --job-id J -- python -m torch.distributed.run --standalone
                 --nproc-per-node N examples/char_gpt/train_dist.py --parallel P ...

and prints that command. `muond launch` (client/python/muond/launch/,
deploy/README.md) does the rest: a coordinator on a free loopback port with a
fresh per-launch token (a 0600 file in its private 0700 socket directory,
never on a command line), one `muond-daemon` per rank (host mode without a GPU,
`--device=<local rank>` with --device cuda) on its socket in that directory,
the health wait, the environment muond.torch.Muon reads (MUOND_JOB_ID,
MUOND_TOKEN_FILE, MUOND_SOCKET_DIR, MUOND_COORDINATOR for the report's plan),
a `muonctl status ...` line that works as printed, and the teardown: it stops
everything when the trainers end, on Ctrl-C, or when a server dies (named
with the last lines of its log; a trainer rank is named by torchrun's failure
summary), leaving no process, socket or shm object behind. Logs go to
<out>/logs/, the report to <out>/report.md.
"""
import argparse
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "examples", "char_gpt", "train_dist.py")
sys.path.insert(0, os.path.dirname(TRAINER))
# The trainer's options and layout rule, torch-free: --check-args applies the
# rule every trainer rank would apply after the build.
import options as trainer_options  # noqa: E402
from muond._argtypes import count as positive_int, seconds as positive_float  # noqa: E402
from muond.launch.config import MAX_LOCAL_RANKS, check_job_id  # noqa: E402
from muond.launch.discovery import find_servers, servers_dir  # noqa: E402
from muond.launch.errors import LaunchError  # noqa: E402


def job_id(text):
    """Names the socket directory and the shm objects (muond launch's rule)."""
    try:
        return check_job_id(text, "job id")
    except LaunchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


LAYOUTS = trainer_options.LAYOUTS


def nproc(text):
    """Trainer processes (= daemons): 1..MAX_LOCAL_RANKS, muond launch's
    bound on the daemons of one node (one trainer and one daemon process per
    rank on this host: far more than the cores is a typo)."""
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
    examples/char_gpt/options.py), worded for this launcher. n None (the
    process count of --device auto is known at launch): the options alone."""
    parser = trainer_options.dist_parser(prog="examples/char_gpt/train_dist.py")

    def refuse(message):
        raise TrainerArgsError(message)

    parser.error = refuse  # its usage is not the launcher's: one line, no exit
    try:
        targs, unknown = parser.parse_known_args(trainer_argv(a, parallel, device))
        if unknown:
            return (f"unknown trainer option(s) after --: {' '.join(unknown)} (the options "
                    "of examples/char_gpt/train_dist.py, listed by its --help)")
        if n is not None:
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
    p.add_argument("--bin", default=None,
                   help="where server/daemon/muond-daemon and server/coordinator/muond-coordinator "
                        "are, or a GPU bundle's bin/ with muond-daemon and muond-coordinator "
                        "(default: the installed muond wheel's servers, else $MUOND_BIN, else "
                        "bazel-bin)")
    p.add_argument("--optimizer", default="both", choices=["both", "muond"],
                   help="both = also train the in-process reference for the overlay plot")
    p.add_argument("--health-timeout", type=positive_float, default=60.0,
                   help="seconds to wait for the coordinator and daemons (default 60)")
    p.add_argument("--job-id", type=job_id, default=None,
                   help="job id (default demo<pid>-<6 hex digits>; the launcher prints it)")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER,
                   help="after --, extra arguments for examples/char_gpt/train_dist.py")
    args = p.parse_args(argv)
    args.bin = args.bin or default_bin()
    n = args.nproc or (4 if args.device == "cpu" else None)
    problem = check_layout(args, args.parallel or default_layout(n or 1), n,
                           "cuda" if args.device == "cuda" else "cpu")
    if problem:
        p.error(problem)
    return args


def default_bin():
    """--bin's default: where muond launch's lookup (find_servers: the
    installed package's servers first) finds both, with $MUOND_BIN as its
    $MUOND_BIN_DIR and this checkout's bazel-bin last; when none holds them,
    $MUOND_BIN or bazel-bin, for check_binaries to name what is missing."""
    env = {"MUOND_BIN_DIR": os.environ.get("MUOND_BIN", ""), "PATH": ""}
    try:
        return servers_dir(*find_servers(None, env, checkout=ROOT)[:2])
    except LaunchError:
        return os.environ.get("MUOND_BIN") or os.path.join(ROOT, "bazel-bin")


def binary(bin_dir, rel):
    """bin_dir/rel (a bazel-bin tree), or bin_dir/<name> (a bundle's flat bin/)."""
    flat = os.path.join(bin_dir, os.path.basename(rel))
    return flat if os.path.isfile(flat) else os.path.join(bin_dir, rel)


def muond_command():
    """The `muond` command: the venv's console script when the package is
    installed, else the same CLI as a module (the bundle's client/python on
    PYTHONPATH, or Bazel's runfiles)."""
    script = os.path.join(os.path.dirname(sys.executable), "muond")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "muond.cli"]


class Demo:
    def __init__(self, args):
        self.args = args
        # pid + random tag: pids repeat across PID namespaces (containers).
        self.job = args.job_id or f"demo{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.logs = os.path.join(args.out, "logs")
        self.out_lock = None  # held while this launch writes to --out
        self.child = None

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
        for rel in ("server/coordinator/muond-coordinator", "server/daemon/muond-daemon"):
            path = binary(self.args.bin, rel)
            if not os.access(path, os.X_OK):
                raise RuntimeError(
                    f"--bin {self.args.bin}: no {os.path.basename(rel)} at {path} (run "
                    "deploy/run-demo.sh, which builds it, or pass --bin / $MUOND_BIN)")

    def command(self):
        """(argv of `muond launch ... -- torchrun ...`, n, parallel, device)."""
        from muond.launch.discovery import count_gpus
        a = self.args
        device = a.device
        gpus = count_gpus() if device in ("auto", "cuda") else 0
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
        argv = [*muond_command(), "launch", "--nproc-per-node", str(n), "--device", device,
                "--bin-dir", a.bin, "--log-dir", self.logs, "--job-id", self.job,
                "--health-timeout", f"{a.health_timeout:g}", "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(n), TRAINER, *trainer_argv(a, parallel, device)]
        return argv, n, parallel, device

    def run(self):
        a = self.args
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            raise RuntimeError(f"--out {a.out}: cannot create it ({e.strerror})") from None
        self.lock_out()
        os.makedirs(self.logs, exist_ok=True)
        self.check_binaries()
        argv, n, parallel, device = self.command()
        print(f"launcher: job {self.job}: {n} trainers ({device}), torchrun --nproc-per-node "
              f"{n}, --parallel {parallel}; logs in {self.logs}\nlauncher: "
              f"{shlex.join(argv)}", flush=True)
        # The trainers import the installed muond package (deploy/setup.sh), the
        # bundle's via env.sh, Bazel's via its PYTHONPATH: all inherited.
        self.child = subprocess.Popen(argv)
        code = self.child.wait()
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM):
            raise KeyboardInterrupt
        if code != 0:
            raise RuntimeError(f"muond launch exited with code {code} (above: a server that "
                               "died, named with its log, or torchrun's failure summary "
                               "naming the trainer rank that failed first)")

    def forward(self, signum, _frame):
        """SIGTERM (or a Ctrl-C) for the demo: muond launch stops everything."""
        if self.child is None:
            raise KeyboardInterrupt(f"signal {signum}")
        if self.child.poll() is None:
            self.child.send_signal(signum)


def main():
    args = parse_args()
    if args.check_args:
        return 0
    demo = Demo(args)
    signal.signal(signal.SIGTERM, demo.forward)
    signal.signal(signal.SIGINT, demo.forward)  # also when started with SIGINT ignored
    try:
        demo.run()
        verdict, code = f"launcher: done; report in {os.path.join(args.out, 'report.md')}", 0
    except KeyboardInterrupt:
        if demo.child is not None:
            demo.child.wait()
        verdict, code = "launcher: interrupted; stopped everything", 130
    except RuntimeError as e:
        verdict, code = f"launcher: FAILED: {e}", 1
    print(verdict, file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
