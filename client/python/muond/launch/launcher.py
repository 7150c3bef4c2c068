"""The launch itself: start the coordinator (where this node hosts it) and
this node's daemons, wait until each answers the health check, run the
user's command with the environment the client reads, watch the servers
(and, on the coordinator's node, that every rank joins) while it runs, and
stop everything when it ends, a server dies or a stop signal arrives.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

from muond.launch.config import MAX_SOCKET_PATH, LaunchLayout, server_log_dir
from muond.launch.discovery import find_muonctl
from muond.launch.errors import Interrupted, LaunchError, ServerDied
from muond.launch.joins import JoinWatch
from muond.launch.messages import tail
from muond.launch.processes import (command_processes, is_dead, parent_death_signal,
                                    process_table, remove_dead_shm, signal_group,
                                    stop_command_processes)
from muond.launch.reaper import Reaper
from muond.launch.servers import Server, server_answers


def write_token_file(directory: str) -> str:
    """A fresh token in directory/token, created 0600 (O_EXCL, O_NOFOLLOW)."""
    path = os.path.join(directory, "token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def start_server_process(cmd: list, log: str, preexec=None, env=None) -> subprocess.Popen:
    """A server in a session of its own (pgid == pid: a terminal's ^C reaches
    its owner, which stops it in order), stdout and stderr to `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=preexec, env=env)


def raise_if_one_died(servers: list[Server]) -> None:
    """ServerDied naming the first server that exited, its status and log."""
    for server in servers:
        death = server.death_message()
        if death:
            raise ServerDied(death)


def wait_answering(servers: list[Server], deadline: float, check, bound: str) -> None:
    """Until every server answers the health check, in start order; `check()`
    between polls raises to stop waiting (a signal, a dead server);
    ServerDied past `deadline` (time.monotonic()), naming `bound`."""
    pending = list(servers)
    while pending:
        check()
        if server_answers(pending[0].health_address, pending[0].ca_file):
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            s = pending[0]
            raise ServerDied(f"{s.name} (pid {s.proc.pid}) did not answer the health check at "
                             f"{s.health_address} in {bound}; last lines of "
                             f"{s.log}:\n{tail(s.log)}")
        time.sleep(0.1)


def stop_servers(servers: list[Server], grace: float) -> None:
    """Daemons first, then the coordinator (no daemon sees it vanish and
    retries); SIGKILL after `grace` s."""
    daemons = [s for s in servers if s.rank is not None]
    others = [s for s in servers if s.rank is None]
    for group in (daemons, others):
        for s in group:
            if s.proc.poll() is None:
                signal_group(s.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for s in group:
            try:
                s.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(s.proc.pid, signal.SIGKILL)
                s.proc.wait()


class Launch:
    """One launch on this node, from start-up to the last process stopped."""

    def __init__(self, layout: LaunchLayout, args, daemon_bin: str, coordinator_bin: str,
                 reaper: Reaper | None = None):
        self.layout, self.args, self.reaper = layout, args, reaper
        self.daemon_bin, self.coordinator_bin = daemon_bin, coordinator_bin
        self.servers: list[Server] = []
        self.command: subprocess.Popen | None = None
        self.signalled: int | None = None
        self.sockdir: str | None = None
        self.log_dir = server_log_dir(args, layout)
        self.token_file = layout.token_file
        self.coordinator = layout.coordinator_address()
        self.preexec = parent_death_signal()
        self.deadline = float("inf")  # run() sets it
        self.joins = JoinWatch(layout, args)

    # Signals only set a flag: every wait below polls it, so a signal never
    # cuts a Popen or the teardown in half.
    def on_signal(self, signum, _frame):
        if self.signalled is None:
            self.signalled = signum
            if self.command is not None:
                signal_group(self.command.pid, signum)  # forwarded once

    def raise_if_signalled_or_dead(self) -> None:
        """Interrupted after a stop signal; ServerDied once a server exited."""
        if self.signalled is not None:
            raise Interrupted(self.signalled)
        raise_if_one_died(self.servers)

    def run(self) -> int:
        layout = self.layout
        self.deadline = time.monotonic() + self.args.health_timeout  # the whole start-up
        self.sockdir = tempfile.mkdtemp(prefix=f"muond-{layout.job_id}-", dir="/tmp")  # 0700
        self.tell_reaper("dir", self.sockdir)
        self.tell_reaper("job", layout.job_id)
        longest = self.socket_path(max(r for r, _ in layout.ranks))
        if len(longest) > MAX_SOCKET_PATH:
            raise LaunchError(f"--job-id {layout.job_id!r} is too long: the socket path "
                              f"{longest} exceeds {MAX_SOCKET_PATH} bytes")
        if self.token_file is None:
            self.token_file = write_token_file(self.sockdir)
        if layout.start_coordinator:
            self.start_coordinator()
        for (rank, local), gpu in zip(layout.ranks, layout.gpus):
            self.start_daemon(rank, local, gpu)
        self.wait_answering()
        self.announce()
        return self.run_command()

    def announce(self) -> None:
        """Tell the user, on stdout, what answers and how to watch the job."""
        layout = self.layout
        where = "here" if layout.start_coordinator else f"on {layout.master_addr}"
        ranks = [r for r, _ in layout.ranks]
        print(f"muond launch: job {layout.job_id}: coordinator {self.coordinator} ({where}), "
              f"daemon rank{'s' if len(ranks) > 1 else ''} "
              f"{ranks[0]}{f'..{ranks[-1]}' if len(ranks) > 1 else ''} of {layout.world_size} "
              f"({layout.device}, {layout.mode}) answering; logs in {self.log_dir}",
              flush=True)
        muonctl = find_muonctl(self.coordinator_bin)
        print(f"muond launch: while it runs: {muonctl} status --coordinator {self.coordinator} "
              f"--job_id {layout.job_id} --token_file {self.token_file}", flush=True)

    def tell_reaper(self, kind: str, value) -> None:
        if self.reaper:
            self.reaper.tell(kind, value)

    def socket_path(self, rank: int) -> str:
        return f"{self.sockdir}/muond-{self.layout.job_id}-{rank}.sock"

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise ServerDied(f"the servers did not start and answer within "
                             f"{self.args.health_timeout:g} s (--health-timeout bounds the "
                             f"whole start-up); {len(self.servers)} of "
                             f"{len(self.layout.ranks) + self.layout.start_coordinator} started")

    def start_server(self, name: str, rank: int | None, cmd: list, health_address: str,
              ca_file: str | None = None) -> None:
        self.raise_if_signalled_or_dead()
        self.check_deadline()
        log = os.path.join(self.log_dir, f"{name}.log")
        proc = start_server_process(cmd, log, self.preexec)
        self.tell_reaper("server", proc.pid)  # its own session: pgid == pid
        self.servers.append(Server(name if rank is None else f"daemon rank {rank}", rank, proc,
                                   log, health_address, ca_file))

    def common_flags(self, metrics_port: int | None) -> list:
        a = self.args
        flags = [f"--token_file={self.token_file}"]
        if a.log_format:
            flags.append(f"--log_format={a.log_format}")
        if metrics_port is not None:
            flags.append(f"--metrics_port={metrics_port}")
            if a.metrics_address:
                flags.append(f"--metrics_address={a.metrics_address}")
        return flags

    def coordinator_command(self, port_file: str | None) -> list:
        layout, a = self.layout, self.args
        cmd = [self.coordinator_bin, f"--listen={layout.coordinator_listen}",
               *self.common_flags(a.metrics_port)]
        if port_file:
            cmd.append(f"--port_file={port_file}")
        if a.tls_cert:
            cmd += [f"--tls_cert={a.tls_cert}", f"--tls_key={a.tls_key}"]
        return cmd + a.coordinator_arg

    def start_coordinator(self) -> None:
        layout, a = self.layout, self.args
        port_file = None
        if layout.coordinator_port == 0:
            port_file = os.path.join(self.sockdir, "coordinator.port")
        self.start_server("coordinator", None, self.coordinator_command(port_file),
                          self.coordinator, a.tls_ca if a.tls_cert else None)
        if port_file:
            self.coordinator = layout.coordinator_address(self.reported_port(port_file))
            self.servers[0].health_address = self.coordinator

    def reported_port(self, port_file: str) -> int:
        """The port the coordinator (started on port 0) wrote to --port_file;
        ServerDied when it does not within the start-up deadline."""
        a = self.args
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            self.raise_if_signalled_or_dead()
            if time.monotonic() > self.deadline:
                raise ServerDied(f"the coordinator did not report its port in "
                                 f"{a.health_timeout:g} s (--health-timeout); last lines "
                                 f"of {self.servers[0].log}:\n{tail(self.servers[0].log)}")
            time.sleep(0.05)
        with open(port_file) as f:
            return int(f.read().strip())

    def daemon_command(self, rank: int, local: int, gpu: int | None) -> list:
        """Daemon `rank` (local rank `local`; CUDA index `gpu` among the
        visible devices, None = host mode)."""
        layout, a = self.layout, self.args
        cmd = [self.daemon_bin, f"--job_id={layout.job_id}", f"--rank={rank}",
               f"--world_size={layout.world_size}", f"--coordinator={self.coordinator}",
               f"--listen=unix://{self.socket_path(rank)}",
               "--host" if gpu is None else f"--device={gpu}",
               f"--gloo_hostname={layout.node_addr}",
               *self.common_flags(None if a.metrics_port is None else a.metrics_port + 1 + local)]
        if a.tls_ca:
            cmd.append(f"--coordinator_tls_ca={a.tls_ca}")
        return cmd + a.daemon_arg

    def start_daemon(self, rank: int, local: int, gpu: int | None) -> None:
        self.start_server(f"muond-rank{rank}", rank, self.daemon_command(rank, local, gpu),
                          f"unix://{self.socket_path(rank)}")

    def wait_answering(self) -> None:
        """Until every started server answers the health check, in start
        order; ServerDied past the start-up deadline."""
        wait_answering(self.servers, self.deadline, self.raise_if_signalled_or_dead,
                       f"{self.args.health_timeout:g} s (--health-timeout)")

    def command_env(self) -> dict:
        layout = self.layout
        return dict(os.environ, MUOND_JOB_ID=layout.job_id, MUOND_TOKEN_FILE=self.token_file,
                    MUOND_SOCKET_DIR=self.sockdir, MUOND_COORDINATOR=self.coordinator,
                    MUOND_NNODES=str(layout.nnodes), MUOND_NODE_RANK=str(layout.node_rank),
                    MUOND_NPROC_PER_NODE=str(layout.nproc_per_node),
                    MUOND_MASTER_ADDR=layout.master_addr)

    def run_command(self) -> int:
        command = self.args.user_command
        try:
            # Its own session: a stop signals the command and all it started.
            self.command = subprocess.Popen(command, env=self.command_env(),
                                            start_new_session=True, preexec_fn=self.preexec)
        except OSError as e:
            raise LaunchError(f"command {command[0]!r}: {e.strerror}") from None
        self.tell_reaper("command", self.command.pid)
        self.joins.start(self.coordinator, self.token_file)
        while self.command.poll() is None:
            # A server died: ServerDied, and main() stops the command.
            self.raise_if_signalled_or_dead()
            self.joins.check()
            self.reap_orphans()
            time.sleep(0.2)
        code = self.command.returncode
        code = 128 - code if code < 0 else code
        if code != 0:
            # Trainers whose daemon died fail too, maybe before the poll above
            # saw the daemon go: the dead server is the news.
            dead = next((d for d in map(Server.death_message, self.servers) if d), None)
            if dead:
                raise ServerDied(f"{dead}\n(the command then ended with exit status {code})")
        return code

    def command_marker(self) -> str:
        """What every process of the command has in its initial environment."""
        return f"MUOND_SOCKET_DIR={self.sockdir}"

    def held_pids(self) -> set:
        """The servers' pids and the reaper's: children, not the command's."""
        return {s.proc.pid for s in self.servers} | ({self.reaper.pid} if self.reaper else set())

    def reap_orphans(self) -> None:
        """Wait for the zombies that came back to this subreaper (orphans of
        the command); never for a Popen's own child (its status would be
        lost) nor the reaper."""
        me, held = os.getpid(), self.held_pids() | {self.command.pid if self.command else -1}
        for pid, (ppid, _, state, _) in process_table().items():
            if ppid == me and is_dead(state) and pid not in held:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def command_processes(self) -> dict:
        """The command's live processes: its group, the tree below the
        command (while unreaped) and below orphans that came back here, and
        any process with the marker."""
        me, held = os.getpid(), self.held_pids()
        roots = {pid for pid, (ppid, _, state, _) in process_table().items()
                 if ppid == me and pid not in held and not is_dead(state)}
        if self.command.returncode is None:
            roots.add(self.command.pid)
        return command_processes(self.command_marker(), self.command.pid, roots, held)

    def stop_command(self) -> list:
        """SIGTERM the command's process group (on_signal may have forwarded
        a stop signal there already) and its processes elsewhere (torchrun's
        workers), SIGKILL what is left after the grace period, reap. Returns
        what could not be stopped ("pid N (cmdline)")."""
        if self.command is None:
            return []
        return stop_command_processes(self.command_processes, self.command.pid,
                                      self.args.stop_grace, term_group=self.signalled is None,
                                      ended=lambda: self.command.poll() is not None,
                                      reap=self.reap_orphans)

    def stop_servers(self) -> None:
        stop_servers(self.servers, self.args.stop_grace)

    def clean_up(self) -> None:
        """The socket dir (sockets, a generated token, the port file) and the
        job's shm objects whose creator is gone (remove_dead_shm)."""
        if self.sockdir:
            shutil.rmtree(self.sockdir, ignore_errors=True)
        remove_dead_shm(self.layout.job_id)

    def stop(self) -> list:
        """Everything stopped; returns the command's processes that could not
        be stopped ("pid N (cmdline)"), [] when none."""
        left = self.stop_command()
        self.stop_servers()
        self.clean_up()
        return left
