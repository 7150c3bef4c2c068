"""What `muond launch` starts on this node: its options and the environment
(torchrun's, Slurm's) resolved into one ``LaunchLayout``, or ``LaunchError``
naming the option or variable and the rule, before anything starts.

``resolve`` is pure: it reads only the ``env`` mapping it is given; the GPU
count, the host name's address and a fresh job id come from callables the
caller passes (the launcher passes real ones, the tests fixed ones).
``check_paths`` then looks at the filesystem (log dir, token file).

Precedence: an explicit option, then the environment, then a default
(deploy/README.md "muond launch" lists each). Per-node mode starts one daemon
per local rank and, on node rank 0, the coordinator; per-rank mode (one
launcher per trainer process, as torchrun or `srun` with one task per GPU
start it) starts the daemon of this process's global rank only, and the
coordinator on global rank 0.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping

from muond import _rules
from muond._env import env_int
from muond.launch.addresses import check_host, host_port, is_ip, is_loopback
from muond.launch.errors import LaunchError
from muond.launch.slurm import first_host, slurm_tasks_per_node

DEFAULT_COORDINATOR_PORT = 29400
# Daemons on one node. A fixed bound, not one from os.cpu_count(): every
# node's launcher (and a login node's dry run) must agree. 64 is 8x the GPUs
# of the largest nodes; each daemon is a process with its own threads, Gloo
# pairs to every peer and a health-checked start, so hundreds on one node
# only swamp it (deploy/local/launch.py's demo uses this bound too).
MAX_LOCAL_RANKS = 64
# The longest Unix socket path the daemon's gRPC listener binds
# (server/common/unix_socket.h MaxUnixSocketPathBytes says why).
MAX_SOCKET_PATH = _rules.MAX_UNIX_SOCKET_PATH_BYTES
# The daemon's job id rule (server/common/job_id.h CheckJobId).
MAX_JOB_ID_CHARS = _rules.MAX_JOB_ID_CHARS
_JOB_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_JOB_ID_CHARS}}}")


# -- environment readers -------------------------------------------------------
def read_env_int(key: str, env: Mapping[str, str]) -> int | None:
    """``$key`` as a non-negative int by the package's one rule
    (muond._env.env_int), None when unset or empty; a value it refuses is a
    LaunchError in the launcher's own words."""
    try:
        return env_int(key, env)
    except ValueError:
        raise LaunchError(f"${key}={env[key]!r} is not a non-negative integer") from None


def first_env_int(env: Mapping[str, str], *keys: str) -> tuple[int | None, str]:
    """(value, "$KEY") of the first of `keys` that is set, else (None, "")."""
    for key in keys:
        value = read_env_int(key, env)
        if value is not None:
            return value, f"${key}"
    return None, ""


def new_job_id() -> str:
    """A fresh job id for a single launcher: pid + random tag (pids repeat
    across PID namespaces, i.e. containers)."""
    return f"muond{os.getpid()}-{uuid.uuid4().hex[:6]}"


def check_job_id(job: str, source: str) -> str:
    """A job id names sockets and shm objects: 1-MAX_JOB_ID_CHARS letters,
    digits, '._-'."""
    if not _JOB_ID.fullmatch(job):
        raise LaunchError(f"{source} {job!r} must be 1-{MAX_JOB_ID_CHARS} letters, digits, "
                          "'.', '_' or '-' (it names the sockets and shared-memory objects)")
    return job


def visible_gpus(env: Mapping[str, str], count_gpus: Callable[[], int]) -> tuple[list[str], str]:
    """The GPUs this node's processes may use, as the ids CUDA numbers from
    0, and where that came from: $CUDA_VISIBLE_DEVICES when set (empty or
    -1: none), else $SLURM_GPUS_ON_NODE, else count_gpus() (nvidia-smi)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        text = env["CUDA_VISIBLE_DEVICES"].strip()
        ids = [] if text in ("", "-1", "NoDevFiles") else [t.strip() for t in text.split(",")]
        # CUDA stops at the first invalid entry ("-1" included).
        ids = ids[:next((i for i, t in enumerate(ids) if t.startswith("-")), len(ids))]
        return ids, f"$CUDA_VISIBLE_DEVICES={text!r}"
    n = read_env_int("SLURM_GPUS_ON_NODE", env)
    if n is not None:
        return [str(i) for i in range(n)], f"$SLURM_GPUS_ON_NODE={n}"
    n = count_gpus()
    return [str(i) for i in range(n)], f"nvidia-smi lists {n}"


# -- the layout -------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchLayout:
    """What this launcher starts. ``ranks``: (global rank, local rank) of each
    daemon it starts; ``gpus``: the CUDA device index of each (None in host
    mode); ``coordinator_port`` 0: a free port (a single node's loopback
    coordinator, reported through --port_file)."""
    mode: str  # "per-node" | "per-rank"
    nnodes: int
    node_rank: int
    nproc_per_node: int
    world_size: int
    ranks: tuple
    gpus: tuple
    device: str  # "cpu" | "cuda"
    master_addr: str
    coordinator_port: int
    start_coordinator: bool
    coordinator_listen: str
    node_addr: str
    job_id: str
    job_generated: bool
    token_file: str | None  # None: generate one (single launcher)
    sources: dict = field(default_factory=dict)  # value -> where it came from

    def coordinator_address(self, port: int | None = None) -> str:
        return host_port(self.master_addr, self.coordinator_port if port is None else port)


def resolve(opts, env: Mapping[str, str], *, count_gpus: Callable[[], int] = lambda: 0,
            resolve_host: Callable[[], str] = lambda: "127.0.0.1",
            new_job_id: Callable[[], str] = lambda: "muond") -> LaunchLayout:
    """The LaunchLayout for `opts` (the parsed options; None = not given) in
    `env`, or LaunchError. The checks run in a fixed order: the first
    contradiction found is the one reported."""
    src: dict = {}
    mode = _mode(opts, env)
    device, gpus, gpu_source = _device(opts, env, count_gpus)
    if mode == "per-node":
        layout = _per_node(opts, env, device, gpus, src)
    else:
        layout = _per_rank(opts, env, src)
    nnodes, node_rank, nproc, world, ranks = layout
    if nproc > MAX_LOCAL_RANKS:
        raise LaunchError(f"--nproc-per-node {nproc} ({src['nproc']}): at most "
                          f"{MAX_LOCAL_RANKS} daemons per node (one per GPU or host-mode rank; "
                          "more only swamp the node)")
    device_ids = _device_ids(device, ranks, gpus, gpu_source, mode)

    master, src["master_addr"] = _master_addr(opts, env)
    port = _coordinator_port(opts, mode, nnodes)
    start_coordinator = (node_rank == 0) if mode == "per-node" else (ranks[0][0] == 0)
    # An IP literal or loopback name binds itself; another host name may
    # resolve to a loopback alias on its own node (Debian's 127.0.1.1), so
    # the coordinator binds every interface then.
    listen_host = master if (is_ip(master) or is_loopback(master)) else "0.0.0.0"
    node_addr = _node_addr(opts, nnodes, resolve_host)
    job, generated, token = _job_and_token(opts, env, mode, nnodes, world, src, new_job_id)
    _check_tls(opts, start_coordinator)
    _check_metrics(opts, nproc, port)
    return LaunchLayout(
        mode=mode, nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc,
        world_size=world, ranks=tuple(ranks), gpus=tuple(device_ids), device=device,
        master_addr=master, coordinator_port=port, start_coordinator=start_coordinator,
        coordinator_listen=host_port(listen_host, port), node_addr=node_addr,
        job_id=job, job_generated=generated, token_file=token, sources=src)


def _device(opts, env, count_gpus) -> tuple[str, list[str], str]:
    """(cpu | cuda, the visible GPUs, where they came from); --device cuda
    without a visible GPU refused."""
    gpus, gpu_source = ([], "") if opts.device == "cpu" else visible_gpus(env, count_gpus)
    device = opts.device
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and not gpus:
        raise LaunchError(f"--device cuda: no GPU visible ({gpu_source})")
    return device, gpus, gpu_source


def _coordinator_port(opts, mode: str, nnodes: int) -> int:
    port = opts.coordinator_port
    if port is None:
        # A single node's coordinator is loopback-only: a free port keeps two
        # launches on one machine (CI) apart. Several launchers must agree.
        port = 0 if (mode == "per-node" and nnodes == 1) else DEFAULT_COORDINATOR_PORT
    if not 0 <= port <= 65535:
        raise LaunchError(f"--coordinator-port {port} must be 0-65535")
    return port


def _node_addr(opts, nnodes: int, resolve_host) -> str:
    """This node's address for daemon-to-daemon traffic: --node-addr, else
    loopback on a single node, else the host name's address (refused when
    that is a loopback address the other nodes cannot reach)."""
    node_addr = opts.node_addr and check_host(opts.node_addr, "--node-addr")
    if node_addr is None:
        node_addr = "127.0.0.1" if nnodes == 1 else resolve_host()
        if nnodes > 1 and is_loopback(node_addr):
            raise LaunchError(
                f"--node-addr: this host's name resolves to {node_addr}, a loopback address "
                f"the other {nnodes - 1} node(s) cannot reach; pass --node-addr=<this "
                "node's address on the job's network>")
    return node_addr


def _job_and_token(opts, env, mode, nnodes, world, src, new_job_id):
    """(job id, whether generated, token file or None = generate one). Only
    the one launcher of a whole job may generate either."""
    single = nnodes == 1 and (mode == "per-node" or world == 1)
    several = (f"--nnodes {nnodes}" if nnodes > 1
               else f"per-rank mode with {world} ranks (one launcher each)")
    job, src["job_id"] = _job_id(opts, env, mode)
    generated = job is None
    if generated:
        if not single:
            raise LaunchError(
                f"--job-id is required with {several}: every launcher must give its daemons "
                "the same job id (pass --job-id or set $MUOND_JOB_ID; under Slurm "
                "$SLURM_JOB_ID gives slurm-<id>)")
        job, src["job_id"] = new_job_id(), "generated"
    token = opts.token_file or env.get("MUOND_TOKEN_FILE") or None
    src["token_file"] = ("--token-file" if opts.token_file else
                         "$MUOND_TOKEN_FILE" if token else "generated")
    if token is None and not single:
        raise LaunchError(
            f"--token-file is required with {several}: every daemon must send the "
            "coordinator the same token (a 0600 file on a shared filesystem or a mounted "
            "secret; or set $MUOND_TOKEN_FILE)")
    return job, generated, token


def _check_tls(opts, start_coordinator: bool) -> None:
    if bool(opts.tls_cert) != bool(opts.tls_key):
        raise LaunchError("--tls-cert and --tls-key go together (the coordinator's "
                          "certificate and its private key)")
    if opts.tls_cert and start_coordinator and not opts.tls_ca:
        raise LaunchError("--tls-cert needs --tls-ca: the daemons verify the coordinator's "
                          "certificate with it (give every node's launcher the same --tls-ca)")


def _check_metrics(opts, nproc: int, port: int) -> None:
    """--metrics-port P: the coordinator on P, local rank k's daemon on
    P+1+k, clear of the coordinator's port; --metrics-address a host."""
    if opts.metrics_port is not None:
        top = opts.metrics_port + nproc
        if opts.metrics_port < 1 or top > 65535:
            raise LaunchError(f"--metrics-port {opts.metrics_port}: the coordinator takes P "
                              f"and local rank k's daemon P+1+k, so 1 <= P and P+{nproc} <= "
                              "65535")
        if port and opts.metrics_port <= port <= top:
            raise LaunchError(f"--metrics-port {opts.metrics_port}: its ports "
                              f"{opts.metrics_port}..{top} (coordinator P, daemons P+1+k) "
                              f"overlap --coordinator-port {port}; pick ranges apart")
    if getattr(opts, "metrics_address", None) is not None:
        check_host(opts.metrics_address, "--metrics-address")


def _mode(opts, env) -> str:
    if opts.per_rank and opts.per_node:
        raise LaunchError("--per-rank and --per-node are exclusive")
    if opts.per_rank:
        return "per-rank"
    if opts.per_node:
        return "per-node"
    if env.get("RANK", "") != "" and env.get("WORLD_SIZE", "") != "":
        return "per-rank"  # started by torchrun (one launcher per trainer process)
    procid = read_env_int("SLURM_PROCID", env)
    ntasks, nnodes = read_env_int("SLURM_NTASKS", env), read_env_int("SLURM_NNODES", env)
    if procid is not None and ntasks is not None and ntasks > (nnodes or 1):
        return "per-rank"  # srun with several tasks per node
    return "per-node"


def _positive(value: int, what: str) -> int:
    if value < 1:
        raise LaunchError(f"{what} must be >= 1")
    return value


def _per_node(opts, env, device, gpus, src):
    nnodes, src["nnodes"] = _given_or_env(opts.nnodes, "--nnodes", env, "SLURM_NNODES")
    nnodes = _positive(nnodes or 1, f"--nnodes {nnodes} ({src['nnodes'] or 'default'})")
    node_rank, src["node_rank"] = _given_or_env(opts.node_rank, "--node-rank", env,
                                                "SLURM_NODEID", "GROUP_RANK", "NODE_RANK")
    node_rank = node_rank or 0
    if node_rank >= nnodes:
        raise LaunchError(f"--node-rank {node_rank} ({src['node_rank'] or 'default'}) must be "
                          f"< --nnodes {nnodes} ({src['nnodes'] or 'default'})")
    nproc, src["nproc"] = _nproc(opts, env, per_node=True)
    if nproc is None:
        nproc, src["nproc"] = ((len(gpus), "visible GPUs") if device == "cuda"
                               else (1, "default"))
    _positive(nproc, f"--nproc-per-node {nproc} ({src['nproc']})")
    ranks = [(node_rank * nproc + k, k) for k in range(nproc)]
    return nnodes, node_rank, nproc, nnodes * nproc, ranks


def _per_rank(opts, env, src):
    rank, rank_src = first_env_int(env, "RANK", "SLURM_PROCID")
    world, world_src = first_env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise LaunchError("--per-rank needs this process's global rank and the world size "
                          "from the environment: $RANK and $WORLD_SIZE (torchrun) or "
                          "$SLURM_PROCID and $SLURM_NTASKS (srun)")
    _positive(world, f"{world_src}={world}")
    if rank >= world:
        raise LaunchError(f"{rank_src}={rank} must be < {world_src}={world}")
    nproc, src["nproc"] = _nproc(opts, env)
    nnodes, src["nnodes"] = _given_or_env(opts.nnodes, "--nnodes", env, "SLURM_NNODES")
    if nproc is None:
        nnodes = nnodes or 1
        if world % nnodes:
            raise LaunchError(f"{world_src}={world} is not a multiple of --nnodes {nnodes} "
                              f"({src['nnodes'] or 'default'}); pass --nproc-per-node")
        nproc, src["nproc"] = world // nnodes, f"{world_src} / nodes"
    _positive(nproc, f"--nproc-per-node {nproc} ({src['nproc']})")
    if nnodes is None:
        nnodes, src["nnodes"] = max(1, world // nproc), f"{world_src} / nproc"
    if nnodes * nproc != world:
        raise LaunchError(f"--nnodes {nnodes} ({src['nnodes']}) x --nproc-per-node {nproc} "
                          f"({src['nproc']}) = {nnodes * nproc}, but {world_src}={world}")
    local, local_src = first_env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
    if local is None:
        local, local_src = rank % nproc, f"{rank_src} mod --nproc-per-node"
    if local >= nproc:
        raise LaunchError(f"{local_src}={local} must be < --nproc-per-node {nproc} "
                          f"({src['nproc']})")
    node_rank, src["node_rank"] = _given_or_env(opts.node_rank, "--node-rank", env,
                                                "GROUP_RANK", "SLURM_NODEID", "NODE_RANK")
    if node_rank is None:
        node_rank, src["node_rank"] = rank // nproc, f"{rank_src} / nproc"
    if node_rank >= nnodes:
        raise LaunchError(f"--node-rank {node_rank} ({src['node_rank']}) must be < --nnodes "
                          f"{nnodes} ({src['nnodes']})")
    src["rank"] = rank_src
    return nnodes, node_rank, nproc, world, [(rank, local)]


def _given_or_env(given, option, env, *keys):
    if given is not None:
        return given, option
    return first_env_int(env, *keys)


def _nproc(opts, env, per_node: bool = False):
    if opts.nproc_per_node is not None:
        return opts.nproc_per_node, "--nproc-per-node"
    value = read_env_int("LOCAL_WORLD_SIZE", env)
    if value is not None:
        return value, "$LOCAL_WORLD_SIZE"
    text = env.get("SLURM_NTASKS_PER_NODE", "")
    # In an srun step of one task per node (the per-node launchers
    # themselves) it counts launchers, not trainer ranks.
    launchers = (per_node and read_env_int("SLURM_PROCID", env) is not None
                 and read_env_int("SLURM_NTASKS", env)
                 == (read_env_int("SLURM_NNODES", env) or 1))
    if text and not launchers:
        return slurm_tasks_per_node(text), "$SLURM_NTASKS_PER_NODE"
    return None, ""


def _device_ids(device, ranks, gpus, gpu_source, mode):
    """The CUDA index (within the visible devices) of each daemon: local rank
    k gets the k-th visible GPU; a per-rank process that sees one GPU (Slurm's
    per-task binding) gets that one."""
    if device == "cpu":
        return [None] * len(ranks)
    out = []
    for rank, local in ranks:
        if local < len(gpus):
            out.append(local)
        elif mode == "per-rank" and len(gpus) == 1:
            out.append(0)
        else:
            raise LaunchError(f"--device cuda: local rank {local} (global {rank}) needs the "
                              f"{local + 1}-th visible GPU, but {gpu_source} gives "
                              f"{len(gpus)}; one daemon per GPU (lower --nproc-per-node or "
                              "use --device cpu)")
    return out


def _master_addr(opts, env) -> tuple[str, str]:
    if opts.master_addr:
        return check_host(opts.master_addr, "--master-addr"), "--master-addr"
    if env.get("MASTER_ADDR"):
        return check_host(env["MASTER_ADDR"], "$MASTER_ADDR"), "$MASTER_ADDR"
    for key in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            source = f"first host of ${key}"
            return check_host(first_host(env[key], f"${key}"), source), source
    return "127.0.0.1", "default"


def _job_id(opts, env, mode) -> tuple[str | None, str]:
    # `is not None`: an empty --job-id is refused by the rule, not taken as
    # "not given".
    if opts.job_id is not None:
        return check_job_id(opts.job_id, "--job-id"), "--job-id"
    if env.get("MUOND_JOB_ID"):
        return check_job_id(env["MUOND_JOB_ID"], "$MUOND_JOB_ID"), "$MUOND_JOB_ID"
    if env.get("SLURM_JOB_ID"):
        return (check_job_id(f"slurm-{env['SLURM_JOB_ID']}", "$SLURM_JOB_ID as slurm-<id>"),
                "$SLURM_JOB_ID")
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if mode == "per-rank" and run_id not in ("", "none"):
        # torchrun's run id is the same in every worker of one run.
        job = f"torchrun-{run_id}"[:MAX_JOB_ID_CHARS]
        return check_job_id(job, "$TORCHELASTIC_RUN_ID as torchrun-<id>"), "$TORCHELASTIC_RUN_ID"
    return None, ""


def check_paths(args, layout: LaunchLayout) -> None:
    """--log-dir a writable directory, created when missing if its parent
    exists (a missing parent is more likely a typo than a wish: refused), the
    default one created with its parents; the token file a regular file:
    checked before anything starts."""
    log_dir = server_log_dir(args, layout)
    what = "--log-dir" if args.log_dir else "the default log dir (--log-dir)"
    if args.log_dir:
        parent = os.path.dirname(os.path.abspath(log_dir))
        if not os.path.isdir(parent):
            raise LaunchError(f"--log-dir {log_dir}: its parent {parent} is not a directory "
                              "(the launcher creates the log dir, not its parents)")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as e:
        raise LaunchError(f"{what} {log_dir}: not a writable directory ({e.strerror})") from None
    if layout.token_file is not None:
        where = layout.sources["token_file"]
        try:
            st = os.stat(layout.token_file)
        except OSError as e:
            raise LaunchError(f"{where} {layout.token_file}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise LaunchError(f"{where} {layout.token_file}: not a regular file (the job's "
                              "token: a file holding one line)")


def server_log_dir(args, layout: LaunchLayout) -> str:
    """--log-dir, else ./muond-logs/<job>."""
    return args.log_dir or os.path.join(os.getcwd(), "muond-logs", layout.job_id)
