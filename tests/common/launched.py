"""What the Python tests that start `muond launch` share: where the servers
are and the environment a fresh launch gets."""
import os

import muond

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(muond.__file__)))
# A test may itself run under torchrun, Slurm or a launch: none of that may
# leak into the job it starts.
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MUOND_JOB_ID", "MUOND_TOKEN_FILE",
             "MUOND_DAEMON", "SLURM_PROCID", "SLURM_JOB_ID", "SLURM_NNODES")


def bin_dir() -> str:
    """The servers: Bazel's runfiles tree, else $MUOND_BIN_DIR."""
    if os.path.exists(os.path.join(RUNFILES, "server/daemon/muond-daemon")):
        return RUNFILES
    return os.environ["MUOND_BIN_DIR"]


def launch_env(*paths: str) -> dict:
    """os.environ with the package (and `paths`) first on PYTHONPATH, one
    thread per trainer, and no inherited rank or job variable."""
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PKG_ROOT, *paths, *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    for key in INHERITED:
        e.pop(key, None)
    return e
