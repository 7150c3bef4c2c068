"""The launcher's configuration under its former module path, for callers
that still import it from here (tests/rules). The home is muond.launch.config
(with muond.launch.slurm, muond.launch.addresses and muond.launch.errors);
new code imports from there."""
from muond.launch.addresses import check_host, host_port, is_ip, is_loopback
from muond.launch.config import (DEFAULT_COORDINATOR_PORT, MAX_LOCAL_RANKS, MAX_SOCKET_PATH,
                                 LaunchLayout, check_job_id, first_env_int, resolve,
                                 visible_gpus)
from muond.launch.errors import LaunchError
from muond.launch.slurm import (MAX_NODELIST_HOSTS, expand_nodelist, first_host,
                                slurm_tasks_per_node)

__all__ = [
    "DEFAULT_COORDINATOR_PORT", "MAX_LOCAL_RANKS", "MAX_NODELIST_HOSTS", "MAX_SOCKET_PATH",
    "LaunchError", "LaunchLayout", "check_host", "check_job_id", "expand_nodelist",
    "first_env_int", "first_host", "host_port", "is_ip", "is_loopback", "resolve",
    "slurm_tasks_per_node", "visible_gpus",
]
