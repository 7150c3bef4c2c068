"""Which daemon this trainer rank talks to, from the environment.

Environment (``discover``): one daemon per trainer rank, daemon rank ==
trainer global rank. The address is ``$MUOND_DAEMON`` if set, else
``unix://$MUOND_SOCKET_DIR/muond-<job>-<rank>.sock`` when ``$MUOND_SOCKET_DIR``
is an absolute path (``muond launch`` exports it: its daemons listen there),
else the daemon's own default socket for (job, rank) (server/daemon/main.cc,
server/common/unix_socket.cc PrivateSocketDir):
``unix://$XDG_RUNTIME_DIR/muond/muond-<job>-<rank>.sock``, or
``unix:///tmp/muond-<uid>/muond-<job>-<rank>.sock`` without an absolute
XDG_RUNTIME_DIR; job = ``$MUOND_JOB_ID`` (default "default"), rank =
``$RANK`` (torchrun), else ``$SLURM_PROCID`` (ASCII digits only), else 0 in a
one-rank launch (``muond launch --nproc-per-node 1 -- python train.py``); the
token file is ``$MUOND_TOKEN_FILE``. A default socket that does not exist is
reported at once (``Discovered.missing_socket``) instead of waited for, and so
are a malformed ``$MUOND_DAEMON`` (``check_daemon_address``) and a trainer
world that differs from ``muond launch``'s daemons (``check_world_matches_daemons``).

The local cluster (``local_daemon``): when none of JOB_VARIABLES is set (or
``$MUOND_LOCAL`` is 1), no torch.distributed group is initialized and
``$MUOND_LOCAL`` is not 0, the process starts its own coordinator and daemon
(muond.local) instead. When a job variable alone kept it from doing so and no
daemon is found, the error names the variables (``stray_job_variables``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from muond._env import env_int


# Any of these set: this process belongs to a launched or distributed job and
# finds its daemon from them (discover), never starts one (muond.local).
JOB_VARIABLES = ("MUOND_DAEMON", "MUOND_SOCKET_DIR", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
                 "MUOND_COORDINATOR", "MUOND_NNODES", "MUOND_NPROC_PER_NODE", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")


def env_rank(env=None) -> int | None:
    """This trainer's global rank: $RANK (torchrun), else $SLURM_PROCID,
    else 0 when `muond launch` started one rank in all."""
    for key in ("RANK", "SLURM_PROCID"):
        rank = env_int(key, env)
        if rank is not None:
            return rank
    return 0 if launched_world_size(env) == 1 else None


def launched_world_size(env=None) -> int | None:
    """The ranks `muond launch` started for the job ($MUOND_NNODES x
    $MUOND_NPROC_PER_NODE, which it exports); None outside a launch."""
    nnodes, nproc = env_int("MUOND_NNODES", env), env_int("MUOND_NPROC_PER_NODE", env)
    return None if nnodes is None or nproc is None else nnodes * nproc


def wants_local_cluster(env=None) -> bool:
    """True when $MUOND_LOCAL is 1, or unset and nothing in the environment
    names this process's daemon (JOB_VARIABLES); ValueError for a
    $MUOND_LOCAL other than 0, 1 or empty."""
    env = os.environ if env is None else env
    local = env.get("MUOND_LOCAL", "")
    if local not in ("", "0", "1"):
        raise ValueError(f"$MUOND_LOCAL={local!r} must be 0 (no local daemon) or 1 (start one "
                         "even when a launcher's or torchrun's variable is set); unset, one "
                         "starts when nothing names a daemon")
    if local == "1":
        return True
    return local != "0" and not any(env.get(key) for key in JOB_VARIABLES)


def stray_job_variables(env) -> str:
    """Why no local cluster started, when job variables alone kept it from
    starting (no $MUOND_LOCAL, not under `muond launch`): the variables
    found, and the fixes; "" otherwise. Appended to the errors of a process
    that finds no daemon: a $LOCAL_RANK left in a shell or a notebook's
    environment otherwise reads as a missing daemon."""
    found = [key for key in JOB_VARIABLES if env.get(key)]
    launch = ("run it under muond launch (muond launch --nproc-per-node N -- torchrun "
              "--nproc-per-node N train.py)")
    if _several_ranks(env) and env.get("MUOND_LOCAL") == "1" and not env.get("MUOND_SOCKET_DIR"):
        return (". $MUOND_LOCAL=1 does not apply to a job of several processes (a private "
                f"daemon per process would not form one job): {launch}")
    if not found or env.get("MUOND_LOCAL") or env.get("MUOND_SOCKET_DIR"):
        return ""
    names = ", ".join(f"${key}={env[key]!r}" for key in found)
    one = len(found) == 1
    anyway = ("" if _several_ranks(env) else
              "; or set MUOND_LOCAL=1 to start the local cluster anyway")
    return (f". No local coordinator and daemon were started because {names} "
            f"{'is' if one else 'are'} set (a launcher's or torchrun's variable{'' if one else 's'}"
            ": such a process finds its daemon from them). In a plain script, unset "
            f"{'it' if one else 'them'}; for a job, {launch}{anyway}")


def _several_ranks(env) -> bool:
    """A job of several processes: $WORLD_SIZE > 1 or torch.distributed so."""
    try:
        if int(env.get("WORLD_SIZE") or 1) > 1:
            return True
    except ValueError:
        pass
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def local_daemon(param_groups, job_id: str | None, timeout: float) -> Discovered | None:
    """This process's local daemon (muond.local, started by the first
    optimizer that needs it) when it wants one (wants_local_cluster, no
    initialized torch.distributed), with the lease the optimizer releases at
    its end; else None. ValueError when the params span devices."""
    import torch.distributed as dist
    if not wants_local_cluster() or (dist.is_available() and dist.is_initialized()):
        return None
    devices = {p.device for group in param_groups for p in group["params"]}
    if len(devices) > 1:
        raise ValueError(f"muond.torch.Muon with a local cluster: the params are on "
                         f"{sorted(map(str, devices))}; one local daemon serves one device")
    device = next(iter(devices), None)
    from muond import local  # lazy: starts nothing on import, needs muond.launch
    lease = local.acquire(device.index if device is not None and device.type == "cuda"
                          else None, job_id, timeout)
    cluster = lease.cluster
    return Discovered(cluster.daemon_address, cluster.job_id, 0, cluster.token_file,
                      "the local cluster's", lease=lease)


def default_socket(job_id: str, rank: int, env=None, uid: int | None = None) -> str:
    """The socket of (job, rank): in ``$MUOND_SOCKET_DIR`` when it is absolute
    (where ``muond launch`` puts its daemons' sockets), else the daemon's
    default --listen, server/daemon/main.cc's rule (PrivateSocketDir in
    server/common/unix_socket.cc)."""
    env = os.environ if env is None else env
    launched = env.get("MUOND_SOCKET_DIR", "")
    if launched.startswith("/"):
        return f"unix://{launched.rstrip('/')}/muond-{job_id}-{rank}.sock"
    xdg = env.get("XDG_RUNTIME_DIR", "")
    directory = (f"{xdg}/muond" if xdg.startswith("/")
                 else f"/tmp/muond-{os.geteuid() if uid is None else uid}")
    return f"unix://{directory}/muond-{job_id}-{rank}.sock"


_DAEMON_FORMS = ("unix:/ABS/PATH, unix:///ABS/PATH or HOST:PORT (a host name, an IPv4 "
                 "address or a bracketed IPv6 address; PORT 1-65535)")


def check_daemon_address(text: str, source: str = "$MUOND_DAEMON") -> str:
    """``text`` when it is a daemon address a channel can reach, else
    ValueError naming ``source``, the value and the accepted forms (a
    malformed address would otherwise be retried until the health timeout)."""
    def refuse(why: str):
        raise ValueError(f"{source}={text!r} is malformed: {why}; expected {_DAEMON_FORMS}")

    if text.startswith("unix:"):
        path = text[len("unix:"):]
        path = path[2:] if path.startswith("//") else path
        if not path.startswith("/") or "\0" in path:
            refuse("the unix socket path must be absolute")
        return text
    host, colon, port = text.rpartition(":")
    if not colon or not host:
        refuse("no HOST:PORT")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        refuse(f"port {port!r} is not in 1-65535")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        refuse("an IPv6 address needs brackets ([::1]:PORT)")
    # The launcher's host rule (lazy: muond.launch is not needed otherwise).
    from muond.launch.addresses import check_host
    try:
        check_host(host, "host")
    except ValueError:
        refuse(f"host {host!r} is not a host name or an IP address")
    return text


def _no_rank_message(env) -> str:
    world = launched_world_size(env)
    if world is not None:
        return (f"muond.torch.Muon: muond launch started {world} daemons ($MUOND_NNODES x "
                f"$MUOND_NPROC_PER_NODE) but $RANK is unset: run the {world} ranks with "
                "torchrun (muond launch --nproc-per-node N -- torchrun --nproc-per-node N "
                "train.py), or launch one rank (--nproc-per-node 1)")
    off = (" ($MUOND_LOCAL=0 turned off the local coordinator and daemon muond.torch.Muon "
           "starts when nothing names one)" if env.get("MUOND_LOCAL") == "0" else "")
    return ("muond.torch.Muon needs its daemon: pass daemons=[addresses], or run under "
            "torchrun/srun ($RANK or $SLURM_PROCID picks the daemon's default socket "
            "muond-<job>-<rank>.sock, job from $MUOND_JOB_ID), or set $MUOND_DAEMON" + off
            + stray_job_variables(env))


def _ranks(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"


def _world_mismatch(daemons: int, daemons_source: str, trainers: int, trainers_source: str,
                    rank: int) -> ValueError:
    if rank >= daemons:
        why = f"trainer rank {rank} >= the daemons' world size {daemons}: it has no daemon"
    elif trainers > daemons:
        why = f"trainer {_ranks(daemons, trainers)} without a daemon"
    else:
        why = f"daemon {_ranks(trainers, daemons)} waiting for trainers that never come"
    ranks = "rank" if trainers == 1 else "ranks"
    return ValueError(
        f"muond: the daemons' world size is {daemons} ({daemons_source}) but this job runs "
        f"{trainers} trainer {ranks} ({trainers_source}); {why}. One trainer rank per daemon: "
        "give muond launch (or the daemons' --world_size) and torchrun (or srun) the same "
        "--nproc-per-node and --nnodes")


def _env_trainer_world(env) -> tuple[int | None, str]:
    key = "WORLD_SIZE" if env.get("WORLD_SIZE") else "SLURM_NTASKS"
    world = env_int(key, env)
    return world, f"${key}={world}"


def check_world_matches_daemons(rank: int, env=None) -> None:
    """Under ``muond launch`` (which exports $MUOND_NNODES and
    $MUOND_NPROC_PER_NODE: one daemon per local rank), ValueError naming
    both world sizes and the fix when the trainer's world ($WORLD_SIZE, else
    $SLURM_NTASKS) differs from the daemons': a rank without a daemon, or
    daemons waiting for trainers that never come (the plan needs all)."""
    env = os.environ if env is None else env
    daemons = launched_world_size(env)
    trainers, trainers_source = _env_trainer_world(env)
    if daemons is None or trainers is None or trainers == daemons:
        return
    raise _world_mismatch(daemons, "muond launch: $MUOND_NNODES x $MUOND_NPROC_PER_NODE",
                          trainers, trainers_source, rank)


def check_daemon_world(client, rank: int, world: int, env=None) -> None:
    """Local mode (one trainer rank per daemon): the daemon's GetStatus names
    its job's world size (0: a daemon too old to say), which must be the
    trainers' — ``world`` (torch.distributed's) when above 1, else
    $WORLD_SIZE / $SLURM_NTASKS, else 1 — or ValueError naming both (checked
    before registering, instead of waiting for a plan that needs every
    daemon's trainer)."""
    from muond.v1 import muond_pb2 as pb  # lazy: discovery itself needs no stubs
    # The default instance always exists (this optimizer's may not yet), and
    # the world size is the daemon's, the same for every instance.
    status = client.stub.GetStatus(pb.GetStatusRequest(), timeout=client.timeout)
    env = os.environ if env is None else env
    trainers, trainers_source = world, f"torch.distributed world size {world}"
    if world <= 1:
        trainers, trainers_source = _env_trainer_world(env)
        if trainers is None:
            trainers, trainers_source = 1, "one process: no $WORLD_SIZE"
    if status.world_size <= 0 or status.world_size == trainers:
        return
    raise _world_mismatch(status.world_size, f"daemon rank {status.rank}'s --world_size",
                          trainers, trainers_source, rank)


@dataclass(frozen=True)
class Discovered:
    """``job_source`` says where ``job_id`` came from (for error messages);
    ``default_socket``: the socket path when the address is the daemon's
    default socket (no $MUOND_DAEMON), else None."""
    address: str
    job_id: str
    rank: int | None
    token_file: str | None
    job_source: str = ""
    default_socket: str | None = None
    lease: object = None  # a local cluster's muond.local.Lease, released at the end
    stray_variables: str = ""  # stray_job_variables of the environment it came from

    def missing_socket(self) -> str | None:
        """Why this rank has no daemon, when the address is a default socket
        that does not exist (a forgotten $MUOND_JOB_ID waits out the health
        timeout otherwise); None when there is nothing to say. A socket that
        exists may be a daemon still starting: the caller waits for it."""
        if self.default_socket is None or os.path.exists(self.default_socket):
            return None
        return (f"muond: no daemon socket at {self.default_socket}: the default socket for "
                f"job {self.job_id!r} ({self.job_source}) and rank {self.rank}; set "
                "$MUOND_JOB_ID to the daemons' --job_id, or $MUOND_DAEMON to this rank's "
                "daemon address" + self.stray_variables)


def discover(job_id: str | None = None, env=None) -> Discovered:
    """This trainer's daemon from the environment (module docstring), or
    ValueError saying what to set."""
    env = os.environ if env is None else env
    if job_id is not None:
        job, job_source = job_id, "job_id= given"
    elif env.get("MUOND_JOB_ID"):
        job, job_source = env["MUOND_JOB_ID"], "from $MUOND_JOB_ID"
    else:
        job, job_source = "default", "$MUOND_JOB_ID is unset, so \"default\""
    rank = env_rank(env)
    address = env.get("MUOND_DAEMON", "")
    path = None
    if address:
        check_daemon_address(address)
    else:
        if rank is None:
            raise ValueError(_no_rank_message(env))
        if "/" in job:
            raise ValueError(f"job id {job!r} contains '/': it cannot name the default socket "
                             "muond-<job>-<rank>.sock; set $MUOND_DAEMON")
        check_world_matches_daemons(rank, env)
        address = default_socket(job, rank, env)
        path = address[len("unix://"):]
    return Discovered(address, job, rank, env.get("MUOND_TOKEN_FILE") or None, job_source, path,
                      stray_variables=stray_job_variables(env))
