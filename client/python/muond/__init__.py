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
from muond._version import __version__  # noqa: E402

__all__ = ["__version__", "client", "shm", "split", "torch"]
