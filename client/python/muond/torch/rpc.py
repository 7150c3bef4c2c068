"""One call on every daemon of an optimizer: concurrent, answered in rank
order, the first failure raised as a MuondError naming the daemon and the RPC."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from muond.client import PEER_GONE, Client, MuondError, error_info


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
    still running are cancelled and the failure is raised (as result's
    MuondError): a peer of a failed step may never answer (a stopped daemon),
    and waiting for it would hang the trainer."""
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
            result(futures[failed].result, clients[failed], what)  # raises
        if pending:
            changed.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [result(f.result, c, what) for f, c in zip(futures, clients)]


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
