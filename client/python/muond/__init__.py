"""muond trainer-side Python client.

* ``muond.client.Client`` — a thin wrapper over the generated gRPC stub of one daemon.
* ``muond.torch.Muon``    — a ``torch.optim.Optimizer`` whose step runs on muond daemons
  (the package ``muond.torch``: optimizer, option objects, layout strategies, memory
  sharing, registration; ``muond.placement`` re-exports its placement and discovery).
* ``muond.split``         — single-trainer split mode: how a full weight is laid out in one
  shared buffer and cut into per-daemon strided views (pure math, no I/O).
* ``muond.shm``           — POSIX shared-memory buffers viewed as torch tensors.

The generated stubs live in ``muond.v1`` (the package build generates them from proto/).
"""
import os as _os

# gRPC's fork handlers off, unless the user chose: with fork support on (the
# grpcio wheels' default), a child that subprocess forks (preexec_fn,
# process_group, start_new_session: no vfork) while a channel is busy runs
# gRPC's post-fork handlers and can abort before its exec. muond's launcher
# and local cluster start servers and commands that way with channels live;
# a muond optimizer refuses to step in a forked child anyway. Read when grpc
# is first imported: a process that imported grpc before muond keeps its
# own setting.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from muond._version import __version__  # noqa: E402

__all__ = ["__version__", "client", "shm", "split", "torch"]
