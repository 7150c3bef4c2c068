"""One call on every daemon of an optimizer: concurrent, answered in rank
order, the first failure raised as a MuondError naming the daemon and the RPC."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from muond.client import PEER_GONE, REFUSED_BY_PEER, Client, MuondError, error_info


# After one daemon's call failed, how long the others get to answer before
# they are cancelled. A daemon past a step's commit vote is still writing the
# params and the momentum (read from the grads) in trainer memory and answers
# within milliseconds, so the trainer's error comes after those writes and
# its recovery may touch the tensors. A daemon still before the vote (its
# peer stopped) may take the communicator timeout: not waited for.
AFTER_FAILURE_GRACE_S = 5.0


def gather(futures, clients, what: str, grace_s: float = AFTER_FAILURE_GRACE_S):
    """The responses of concurrent calls, one per daemon, in rank order. On
    the first failure the others get up to `grace_s` to finish, then the ones
    still running are cancelled and a failure is raised (as result's
    MuondError): a peer of a failed step may never answer (a stopped daemon),
    and waiting for it would hang the trainer. The failure raised is the
    first to arrive, unless it is a REFUSED_BY_PEER echo (which only names
    the refusing daemon, whose own answer names the param and the rule):
    then the first failure in rank order that is not one."""
    changed = threading.Event()
    for f in futures:
        f.add_done_callback(lambda _: changed.set())
    pending = set(range(len(futures)))
    failed = None
    deadline = None
    while pending:
        changed.clear()
        for i in sorted(pending):
            if not futures[i].done():
                continue
            pending.discard(i)
            if failed is None and futures[i].exception() is not None:
                failed, deadline = i, time.monotonic() + grace_s
        if failed is not None and (not pending or time.monotonic() >= deadline):
            for j in pending:
                futures[j].cancel()
            shown = _detailed_failure(futures, failed)
            result(futures[shown].result, clients[shown], what)  # raises
        if pending:
            changed.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [result(f.result, c, what) for f, c in zip(futures, clients)]


def _detailed_failure(futures, first: int) -> int:
    """The failed call whose error has the details: `first` (the first to
    fail) unless it is a REFUSED_BY_PEER echo of another daemon's refusal,
    then the first in rank order that is not, else `first`."""
    if not _echoes_a_refusal(futures[first].exception()):
        return first
    for i, f in enumerate(futures):
        if not f.done():
            continue
        try:
            e = f.exception()
        except Exception:  # cancelled: no answer
            continue
        if e is not None and not _echoes_a_refusal(e):
            return i
    return first


def _echoes_a_refusal(error) -> bool:
    """A failed call's `error` is a REFUSED_BY_PEER echo."""
    info = error_info(error) if isinstance(error, grpc.RpcError) else None
    return info is not None and info.reason == REFUSED_BY_PEER


def result(call, client: Client, what: str):
    """call(): an RPC's response (e.g. a future's ``result``); its grpc error
    as a MuondError (a RuntimeError) naming the daemon and the RPC, with the
    status code and the daemon's reason (e.g. PEER_GONE) as attributes."""
    try:
        return call()
    except MuondError:  # the client's own (export/import_state): names the daemon already
        raise
    except grpc.RpcError as e:
        detail = e.details() if hasattr(e, "details") else str(e)
        code = e.code() if hasattr(e, "code") else None
        info = error_info(e)
        reason = info.reason if info else ""
        metadata = dict(info.metadata) if info else None
        if not reason and code is not None and code.name == "UNAVAILABLE":
            # No daemon answered at all (its process is gone or its socket
            # refuses): the trainer recovers exactly as from a peer's
            # PEER_GONE, so it gets the same reason to branch on.
            reason, metadata = PEER_GONE, {"daemon": client.address}
            from muond import local  # the optimizer's own daemon: say if it died
            detail = f"{detail}{local.death_note(client.address)}"
        raise MuondError(f"muond daemon {client.address}: {what} failed: "
                         f"{code.name if code is not None else type(e).__name__}: {detail}",
                         code=code, reason=reason, metadata=metadata) from e


def on_all(clients, call, what: str, with_rank: bool = False) -> list:
    """call(client) (or call(client, rank)) on every daemon concurrently;
    results in rank order, the first failure raised as a MuondError naming
    the daemon and `what`."""
    def run(r, c):
        return result(lambda: call(c, r) if with_rank else call(c), c, what)
    if len(clients) == 1:
        return [run(0, clients[0])]
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(run, r, c) for r, c in enumerate(clients)]
        return [f.result() for f in futures]
