"""Registration with the daemons: RegisterParams on every daemon, taking
over a stale holder, the agreement of every rank of a distributed job on
the outcome, and the unregistering at the optimizer's end."""
from __future__ import annotations

import itertools
import logging
import os

from muond.client import ALREADY_REGISTERED, MuondError
from muond.torch import memory as _memory
from muond.torch import rpc as _rpc

# The optimizer's records keep the name they had in the single-module client.
_LOG = logging.getLogger("muond.torch")

# Optimizers this process created: the first is the daemons' default
# instance "", the n-th "opt-<n>" (instance_name).
_CREATED = itertools.count(1)


def instance_name(name: str | None) -> str:
    """The daemons' optimizer instance of a new Muon: ``name`` when given,
    else "" for the process's first optimizer and ``opt-<n>`` for its n-th,
    so SPMD ranks that create their optimizers in the same order agree."""
    n = next(_CREATED)
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        return name
    return "" if n == 1 else f"opt-{n}"


def register_all(clients, job_id: str, client_id: str, per_rank, regions) -> list:
    """RegisterParams on every daemon concurrently; per daemon its
    response or its MuondError (all answers awaited: the refusals name
    each daemon's holder)."""
    futures = [c.register_future(job_id, per_rank[r], client_id,
                                 regions=regions.used_by(per_rank[r]))
               for r, c in enumerate(clients)]
    out = []
    for f, c in zip(futures, clients):
        try:
            out.append(_rpc.result(f.result, c, "RegisterParams"))
        except MuondError as e:
            out.append(e)
    return out


def register_taking_over_stale(clients, job_id: str, client_id: str, per_rank, regions,
                               takeover: bool) -> None:
    """Registers with every daemon. A daemon held by another client
    (ALREADY_REGISTERED: a trainer that ended without close(), or one
    still running) is cleared as the operator and registered again only
    when ``takeover`` is set or every holder is a client id of this host
    whose process is gone (muond.torch's default ids); a live holder is
    never taken over by default."""
    answers = register_all(clients, job_id, client_id, per_rank, regions)
    errors = [e for e in answers if isinstance(e, MuondError)]
    if not errors:
        return
    held = {clients[r].address: e.metadata.get("client_id", "")
            for r, e in enumerate(answers)
            if isinstance(e, MuondError) and e.reason == ALREADY_REGISTERED}
    if len(held) < len(errors):
        raise next(e for e in errors if e.reason != ALREADY_REGISTERED)
    live = {a: h for a, h in held.items() if not is_stale_local_client(h)}
    if live and not takeover:
        raise MuondError(
            f"muond.torch.Muon: the daemons' {_instance(clients)} holds another "
            "trainer's params ("
            + ", ".join(f"{a}: client {h!r}" for a, h in live.items())
            + "). If that trainer is gone (crashed, killed, preempted), pass "
            "takeover=True to clear its registration; otherwise stop it (or close() "
            "its optimizer) first", code=errors[0].code, reason=ALREADY_REGISTERED,
            metadata={"client_id": next(iter(live.values()))})
    _LOG.warning("muond.torch.Muon: taking over the daemons from client(s) %s (%s); "
                 "registering %r", sorted(set(held.values())),
                 "takeover=True" if live else "their process on this host is gone",
                 client_id)
    # As the operator: clears the stale holders and our own partial
    # registrations alike, then every daemon is registered afresh.
    _rpc.on_all(clients, lambda c: c.unregister_as_operator(job_id),
                "UnregisterParams (operator)")
    _rpc.gather([c.register_future(job_id, per_rank[r], client_id,
                                   regions=regions.used_by(per_rank[r]))
                 for r, c in enumerate(clients)], clients, "RegisterParams")


def _instance(clients) -> str:
    """The optimizer instance ``clients`` are about, in words."""
    name = clients[0].optimizer if clients else None
    return f"optimizer instance {name!r}" if name else "default optimizer instance"


# Unregistering at exit must not hold up the interpreter on a daemon that is
# gone: each call gets this many seconds.
_FINAL_UNREGISTER_TIMEOUT_S = 2.0


def finalize(memory, clients, job_id: str, client_id: str, pid: int,
             local_lease=None) -> None:
    """The optimizer's end (close(), garbage collection or interpreter exit):
    unregisters from every daemon (best effort: a daemon may be gone, or never
    registered us), closes the channels, then frees ``memory`` (SharedParams:
    the shm names and CUDA buffers, which the daemons no longer map). Only the
    process that built the optimizer unregisters and frees CUDA memory (a
    forked child inherits it). Last, it releases its local cluster
    (muond.local.Lease; the last release stops it)."""
    if os.getpid() == pid:
        for c in clients:
            try:
                c.unregister(job_id, client_id, timeout=_FINAL_UNREGISTER_TIMEOUT_S)
            except Exception:  # gone, or held by another client: nothing of ours
                pass
            try:
                c.close()
            except Exception:
                pass
        memory.close()
        if local_lease is not None:
            local_lease.release()
    else:
        _memory.release(memory.buffers)


def is_stale_local_client(client_id: str) -> bool:
    """True when ``client_id`` is a default muond.torch id
    (``<hostname>-<pid>-<8 hex>``) of this host whose process no longer
    exists: that trainer ended without unregistering (killed, crashed)."""
    host, _, rest = client_id.rpartition("-")
    host, _, pid = host.rpartition("-")
    if host != os.uname().nodename or not (pid.isascii() and pid.isdigit()) or len(rest) != 8:
        return False
    try:
        int(rest, 16)
    except ValueError:
        return False
    if int(pid) == os.getpid():
        return False  # another optimizer of this very process: alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: exists, another user's
        return False
    return False

