"""Stand-ins for Slurm's `srun` and `scontrol` that run a job step's tasks on
this machine (tests/deploy/slurm_sbatch_test.py puts `srun` and `scontrol`
wrappers around this file first on PATH).

    fake_slurm.py srun [OPTIONS] COMMAND [ARGS...]
    fake_slurm.py scontrol show hostnames [NODELIST]

srun starts one process per task, in its own session, with the variables
Slurm sets in a task (SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID,
SLURMD_NODENAME, SLURM_STEP_*...); node k is the k-th host of
$SLURM_JOB_NODELIST. It waits for every task and exits with the highest exit
status; with --kill-on-bad-exit a task that fails terminates the others
(SIGTERM to each task's process group, SIGKILL 20 s later), as does a
SIGTERM/SIGINT to srun. Options it does not model are refused.
"""
import os
import re
import signal
import subprocess
import sys
import time

KILL_WAIT_S = 20


def expand_nodelist(nodelist: str) -> list:
    """Slurm's compressed host list: 'a[01-03,7],b1' -> a01 a02 a03 a7 b1."""
    hosts = []
    for item in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist):
        if not item:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand_nodelist(f"{prefix}{i:0{len(lo)}d}{suffix}"))
    return hosts


def compress(hosts: list) -> str:
    """A plain comma list (Slurm accepts it as a node list)."""
    return ",".join(hosts)


def scontrol(args: list) -> int:
    if args[:2] != ["show", "hostnames"] or len(args) > 3:
        print(f"fake scontrol: only 'show hostnames [LIST]' is modelled, not {args}",
              file=sys.stderr)
        return 1
    nodelist = args[2] if len(args) == 3 else os.environ.get("SLURM_JOB_NODELIST", "")
    for host in expand_nodelist(nodelist):
        print(host)
    return 0


def parse_srun(args: list):
    opts, i = {}, 0
    valued = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
              "--ntasks-per-node": "ntasks-per-node", "--cpus-per-task": "cpus-per-task",
              "--kill-on-bad-exit": "kill-on-bad-exit", "--export": "export"}
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].partition("=")
        if name not in valued:
            raise SystemExit(f"fake srun: option {name} is not modelled")
        if not eq:
            if name == "--kill-on-bad-exit":
                value = "1"
            else:
                i += 1
                value = args[i]
        opts[valued[name]] = value
        i += 1
    if i == len(args):
        raise SystemExit("fake srun: no command")
    if opts.get("export", "ALL").split(",")[0] != "ALL":
        raise SystemExit("fake srun: only --export=ALL[,...] is modelled")
    return opts, args[i:]


def srun(args: list) -> int:
    opts, command = parse_srun(args)
    env = os.environ
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
    nnodes = int(opts.get("nodes", env.get("SLURM_NNODES", len(hosts))))
    per_node = int(opts.get("ntasks-per-node", 1))
    ntasks = int(opts.get("ntasks", nnodes * per_node))
    if nnodes > len(hosts) or ntasks != nnodes * per_node:
        raise SystemExit(f"fake srun: {ntasks} tasks on {nnodes} of {len(hosts)} nodes "
                         f"with {per_node} per node is not modelled")
    step_hosts = hosts[:nnodes]
    extra = dict(kv.split("=", 1) for kv in opts.get("export", "ALL").split(",")[1:])
    procs = []
    for node, host in enumerate(step_hosts):
        for local in range(per_node):
            task_env = dict(env, **extra)
            task_env.update(
                SLURM_NODEID=str(node), SLURM_PROCID=str(node * per_node + local),
                SLURM_LOCALID=str(local), SLURMD_NODENAME=host, SLURM_TOPOLOGY_ADDR=host,
                SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_NTASKS=str(ntasks),
                SLURM_NPROCS=str(ntasks), SLURM_NNODES=str(nnodes),
                SLURM_STEP_NUM_NODES=str(nnodes), SLURM_STEP_NUM_TASKS=str(ntasks),
                SLURM_STEP_NODELIST=compress(step_hosts), SLURM_NODELIST=compress(step_hosts),
                SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nnodes})",
                SLURM_TASKS_PER_NODE=f"{per_node}(x{nnodes})",
                SLURM_NTASKS_PER_NODE=str(per_node))
            if "cpus-per-task" in opts:
                task_env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
            procs.append(subprocess.Popen(command, env=task_env, start_new_session=True))

    def terminate(*_):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_WAIT_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            try:  # the task's whole group, also what outlived its leader
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, lambda *_: (terminate(), sys.exit(143)))
    signal.signal(signal.SIGINT, lambda *_: (terminate(), sys.exit(130)))
    kill_on_bad_exit = opts.get("kill-on-bad-exit", "0") != "0"
    while any(p.poll() is None for p in procs):
        if kill_on_bad_exit and any(p.poll() not in (None, 0) for p in procs):
            terminate()
            break
        time.sleep(0.1)
    # What a task left running is not killed here (real Slurm would end it
    # with the step's cgroup): the test looks for it.
    codes = [p.wait() for p in procs]
    return max((c if c >= 0 else 128 - c) for c in codes)


if __name__ == "__main__":
    tool, rest = sys.argv[1], sys.argv[2:]
    sys.exit(srun(rest) if tool == "srun" else scontrol(rest))
