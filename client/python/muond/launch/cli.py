"""`muond launch [options] -- <command ...>`: muond's servers around any trainer.

Per-node mode (the default): one launcher per node starts one `muond-daemon`
per local rank (host mode, or one GPU each) and, on node rank 0, the
`muond-coordinator`; waits until every server it started answers the
standard grpc.health.v1 Check (any answer counts: a daemon is SERVING only
once its trainers registered); runs the command with the environment the
client reads (MUOND_JOB_ID, MUOND_TOKEN_FILE, MUOND_SOCKET_DIR,
MUOND_COORDINATOR, MUOND_NNODES, MUOND_NODE_RANK, MUOND_NPROC_PER_NODE,
MUOND_MASTER_ADDR); and stops everything it started when the command ends or
a server dies (naming it: rank, pid, exit status, last lines of its log):
every process of the command, those in sessions of their own included
(stop_command_processes).
Per-rank mode (--per-rank; automatic under torchrun or srun with one task
per GPU) starts only this process's daemon (and the coordinator on global
rank 0). Exit status: the command's, 1 when a server died first, 128+N on
signal N, 2 for refused options. deploy/README.md "muond launch" is the
reference; muond/launch/config.py resolves options and environment.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from muond import _argtypes
from muond.launch.config import check_paths, new_job_id, resolve
from muond.launch.discovery import count_gpus, find_servers, host_address
from muond.launch.errors import Interrupted, LaunchError, ServerDied
from muond.launch.launcher import Launch
from muond.launch.messages import log
from muond.launch.processes import KILL_WAIT, make_subreaper
from muond.launch.reaper import STOP_SIGNALS, Reaper


def add_parser(subparsers):
    """Registers `muond launch` with the `muond` command's subparsers."""
    p = subparsers.add_parser(
        "launch", help="start daemons + coordinator around a command",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="muond launch [options] -- <command ...>")
    add_options(p)
    return p


def _server_flag(text: str) -> str:
    if not text.startswith("--"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a server flag (--name=value)")
    return text


def add_options(p: argparse.ArgumentParser) -> None:
    _add_layout_options(p)
    _add_server_options(p)
    p.add_argument("user_command", nargs=argparse.REMAINDER, metavar="command",
                   help="after --: the command to run (e.g. torchrun ... train.py)")


def _add_layout_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (explicit options win over torchrun's and Slurm's "
                             "environment)")
    g.add_argument("--nproc-per-node", metavar="N", type=_argtypes.count,
                   help="daemons on this node (default "
                   "$LOCAL_WORLD_SIZE, $SLURM_NTASKS_PER_NODE (not in an srun step of one task "
                   "per node), the visible GPUs with "
                   "--device cuda|auto, else 1)")
    g.add_argument("--nnodes", metavar="N", type=_argtypes.count,
                   help="nodes of the job (default $SLURM_NNODES, "
                   "else 1)")
    g.add_argument("--node-rank", metavar="R", type=_argtypes.index,
                   help="this node's rank (default "
                   "$SLURM_NODEID, $GROUP_RANK, $NODE_RANK, else 0); daemon rank = node rank "
                   "x nproc-per-node + local rank")
    g.add_argument("--master-addr", metavar="HOST",
                   help="the coordinator's host, node rank 0 (default "
                   "$MASTER_ADDR, the first host of $SLURM_JOB_NODELIST, else 127.0.0.1)")
    g.add_argument("--coordinator-port", metavar="PORT", type=_argtypes.port,
                   help="default 29400; a free loopback "
                   "port on a single node in per-node mode")
    g.add_argument("--node-addr", metavar="ADDR",
                   help="this node's address for daemon-to-daemon traffic "
                   "(Gloo; default 127.0.0.1 on a single node, else the host name's address)")
    g.add_argument("--per-rank", action="store_true", help="start only this process's "
                   "daemon ($RANK/$SLURM_PROCID); automatic when $RANK and $WORLD_SIZE are "
                   "set, or $SLURM_PROCID with more tasks than nodes")
    g.add_argument("--per-node", action="store_true", help="per-node mode even where the "
                   "environment says per-rank (e.g. inside an sbatch script's batch step)")


def _add_server_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cpu = host-mode daemons; cuda = local rank k on the k-th visible GPU "
                   "($CUDA_VISIBLE_DEVICES); auto = cuda when a GPU is visible")
    g.add_argument("--job-id", metavar="J", help="default $MUOND_JOB_ID, slurm-$SLURM_JOB_ID, "
                   "torchrun-$TORCHELASTIC_RUN_ID (per-rank), else generated (one launcher "
                   "only)")
    g.add_argument("--token-file", metavar="FILE",
                   help="the job's token (default $MUOND_TOKEN_FILE; "
                   "required with several launchers; else generated 0600 in the socket dir)")
    g.add_argument("--tls-cert", metavar="PEM", help="PEM certificate: the coordinator serves TLS")
    g.add_argument("--tls-key", metavar="PEM", help="PEM private key for --tls-cert")
    g.add_argument("--tls-ca", metavar="PEM",
                   help="PEM root: the daemons (and the health check) verify "
                   "the coordinator with it")
    g.add_argument("--bin-dir", metavar="DIR", help="where muond-daemon and muond-coordinator are "
                   "(flat or a bazel-bin tree; default the installed muond wheel's, else "
                   "$MUOND_BIN_DIR, else PATH, else the repository's bazel-bin)")
    g.add_argument("--log-dir", metavar="DIR", help="server logs (default ./muond-logs/<job>); "
                   "created if missing, but its parent must exist")
    g.add_argument("--log-format", choices=["text", "json"], help="the servers' "
                   "--log_format (default: theirs, text)")
    g.add_argument("--metrics-port", metavar="P", type=_argtypes.port,
                   help="Prometheus endpoints: the "
                   "coordinator on P, local rank k's daemon on P+1+k (default off)")
    g.add_argument("--metrics-address", metavar="ADDR", help="the servers' "
                   "--metrics_address: where the endpoints listen (default theirs, 127.0.0.1; "
                   "0.0.0.0 or this node's address for a scraper on another host)")
    g.add_argument("--daemon-arg", action="append", default=[], type=_server_flag,
                   metavar="--FLAG=VALUE", help="pass to every daemon (repeatable)")
    g.add_argument("--coordinator-arg", action="append", default=[], type=_server_flag,
                   metavar="--FLAG=VALUE", help="pass to the coordinator (repeatable)")
    g.add_argument("--health-timeout", metavar="S", type=_argtypes.seconds, default=60.0,
                   help="seconds to wait for the servers to answer (default 60)")
    g.add_argument("--join-timeout", metavar="S", type=_argtypes.seconds_or_off, default=300.0,
                   help="on the coordinator's node: seconds after its own daemons answer "
                   "within which every rank of the job must have joined, else stop the "
                   "command and fail naming the missing ranks and nodes (default 300; 0 = off)")
    g.add_argument("--stop-grace", metavar="S", type=_argtypes.seconds, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 10); "
                   "torchrun gives its workers 30 s of its own: below that the launcher "
                   "SIGKILLs torchrun and its workers (found by $MUOND_SOCKET_DIR) itself")


USAGE = "muond launch [options] -- COMMAND ..."


def user_command(remainder: list) -> list:
    """The command after `--` (argparse's REMAINDER keeps the `--`); refused
    first, before anything is looked up: a launch without one would start
    servers for nothing."""
    if remainder[:1] != ["--"]:
        got = f"{remainder[0]!r} without --" if remainder else "no command"
        raise LaunchError(f"{got}: the command goes after -- ({USAGE})")
    if len(remainder) == 1:
        raise LaunchError(f"no command after -- ({USAGE}, e.g. muond launch -- torchrun ... "
                          "train.py)")
    return remainder[1:]


def main(args) -> int:
    """`muond launch`: refusals first (exit 2, nothing started), then the
    reaper, the launch and the stop."""
    try:
        args.user_command = user_command(list(args.user_command))
        layout = resolve(args, os.environ, count_gpus=count_gpus, resolve_host=host_address,
                         new_job_id=new_job_id)
        daemon_bin, coordinator_bin, _ = find_servers(args.bin_dir, os.environ)
        check_paths(args, layout)
    except LaunchError as e:
        log(f"error: {e}")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()  # a fork must not print the launcher's buffers twice
    reaper = Reaper(args.stop_grace)
    make_subreaper()  # after the fork: the reaper must not collect the launcher's orphans
    launch = Launch(layout, args, daemon_bin, coordinator_bin, reaper)
    for signum in STOP_SIGNALS:
        signal.signal(signum, launch.on_signal)
    code = run_and_stop(launch)
    reaper.done()  # only once launch.stop() returned; else its EOF stops everything
    return code


def run_and_stop(launch: Launch) -> int:
    """Runs the launch, stops everything it started, and returns the exit
    status: the command's, 1 when a server died, 128+N on signal N, 2 for
    a refusal."""
    stopped = None  # what a stop signal then says: everything stopped, or not
    try:
        code, note = launch.run(), None
    except Interrupted as e:
        code, note = 128 + e.signum, f"stopped by signal {signal.Signals(e.signum).name}"
        stopped = f"{note}; stopped everything"
    except ServerDied as e:
        # Printed after the stop: what the stopped command prints must not
        # bury the name of what died.
        code, note = 1, f"FAILED: {e}"
    except LaunchError as e:
        code, note = 2, f"error: {e}"
    except BaseException:
        launch.stop()
        raise
    left = launch.stop()
    if left:
        # Not "stopped everything": a process of the command outlived SIGKILL
        # (e.g. stuck in the kernel), with its shm objects and device memory.
        stuck = (f"could not stop {len(left)} process{'es' if len(left) > 1 else ''} of the "
                 f"command (SIGKILL sent {KILL_WAIT:g} s ago): {'; '.join(left)}")
        log(f"{note}; {stuck}" if note else f"FAILED: {stuck}")
        return code or 1
    if note:
        log(stopped or note)
    return code
