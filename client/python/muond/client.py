"""A thin client for one muond daemon's Optimizer service (proto/muond/v1/muond.proto)."""
from __future__ import annotations

import time
from typing import Iterable

import grpc

from muond.v1 import error_details_pb2
from muond.v1 import muond_pb2 as pb
from muond.v1 import muond_pb2_grpc as pb_grpc

# Why an RPC failed, beyond its status code: google.rpc.ErrorInfo.reason in
# the status details (proto/muond/v1/error_details.proto). The names repeat
# core/common/error_reason.h; tests/client/python/test_error_reason.py checks
# that the two lists agree.
ERROR_DOMAIN = "muond.dev"
PEER_GONE = "PEER_GONE"      # Step: a peer daemon is gone; restart the job's daemons
NO_PLAN_YET = "NO_PLAN_YET"  # Coordinator.GetPlan: the job has no plan yet
REASONS = (PEER_GONE, NO_PLAN_YET)

_ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo"
_DETAILS_KEY = "grpc-status-details-bin"


class MuondError(RuntimeError):
    """A failed muond RPC, as muond.torch raises it: ``code`` (a
    grpc.StatusCode, or None when the failure was not an RPC status),
    ``reason`` (one of REASONS, or "" when the daemon gave none) and its
    ``metadata`` (dict), so callers branch on them, never on the text."""

    def __init__(self, message: str, code=None, reason: str = "", metadata=None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})


def error_info(error) -> error_details_pb2.ErrorInfo | None:
    """The muond ErrorInfo of a failed RPC (a grpc.RpcError, or a failed
    future's exception), read from its trailing metadata; None without one.
    Unparsable details count as none (the status code still holds)."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key != _DETAILS_KEY:
            continue
        try:
            status = error_details_pb2.RpcStatus.FromString(value)
            for detail in status.details:
                if detail.type_url != _ERROR_INFO_TYPE_URL:
                    continue
                info = error_details_pb2.ErrorInfo.FromString(detail.value)
                if info.domain == ERROR_DOMAIN:
                    return info
        except Exception:  # a DecodeError: not muond's details
            return None
    return None


def error_reason(error) -> str:
    """ErrorInfo.reason of a failed RPC (see error_info); "" without one."""
    info = error_info(error)
    return info.reason if info is not None else ""


class Client:
    """One daemon, e.g. ``Client("unix:///tmp/muond-job-0.sock")``.

    Every method raises ``grpc.RpcError`` on a failed RPC (its ``.code()`` and
    ``.details()`` name the param/field the daemon rejected; ``error_reason(e)``
    says why, where the daemon says). ``timeout`` is a per-RPC deadline in
    seconds (None: no deadline).
    """

    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.OptimizerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- RPCs ---------------------------------------------------------------
    def register(self, job_id: str, groups: Iterable[pb.ParamGroup], client_id: str = "",
                 regions: Iterable[pb.MemoryRegion] = ()) -> pb.RegisterParamsResponse:
        """Registers `groups`, whose TensorRefs lie in the memory `regions`
        declare, all or nothing."""
        return self.register_future(job_id, groups, client_id, regions).result()

    def register_future(self, job_id, groups, client_id="", regions=()):
        req = pb.RegisterParamsRequest(job_id=job_id, groups=list(groups), client_id=client_id,
                                       regions=list(regions))
        return self.stub.RegisterParams.future(req, timeout=self.timeout)

    def step(self, job_id: str, step_id: int, overrides: Iterable[pb.GroupOverride] = (),
             client_id: str = "", skip_params: Iterable[str] = ()) -> pb.StepResponse:
        """``skip_params``: names of params this step leaves alone (torch.optim's
        grad-None rule; StepRequest.skip_params)."""
        # A blocking call runs on this thread; a future makes grpc start a
        # channel polling thread per call (~100 µs more per step).
        return self.stub.Step(_step_request(job_id, step_id, overrides, client_id, skip_params),
                              timeout=self.timeout)

    def step_future(self, job_id, step_id, overrides=(), client_id="", skip_params=()):
        return self.stub.Step.future(
            _step_request(job_id, step_id, overrides, client_id, skip_params),
            timeout=self.timeout)

    def unregister(self, job_id: str, client_id: str = "") -> pb.UnregisterParamsResponse:
        return self.stub.UnregisterParams(
            pb.UnregisterParamsRequest(job_id=job_id, client_id=client_id), timeout=self.timeout)

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout)

    def health(self, timeout: float | None = None) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), timeout=timeout or self.timeout)

    def save_state(self, path: str, job_id: str = "",
                   client_id: str = "") -> pb.SaveStateResponse:
        """One-shot save. Only the params' owner (the job_id/client_id that
        registered them) or the operator (muonctl) may save or load."""
        return self.stub.SaveState(
            pb.SaveStateRequest(path=path, job_id=job_id, client_id=client_id),
            timeout=self.timeout)

    def load_state(self, path: str, job_id: str = "",
                   client_id: str = "") -> pb.LoadStateResponse:
        return self.stub.LoadState(
            pb.LoadStateRequest(path=path, job_id=job_id, client_id=client_id),
            timeout=self.timeout)

    def wait_healthy(self, timeout: float = 30.0, poll: float = 0.1,
                     need_plan: bool = False) -> pb.HealthResponse:
        """Polls Health until the daemon answers ``serving`` (and, with
        ``need_plan``, ``has_plan``: after registration the daemon publishes its
        manifest, receives the coordinator's plan and builds its communicators
        together with its peers; Step before that is refused). Raises
        TimeoutError naming the address and the last state otherwise, and
        RuntimeError with the daemon's reason when building its step engine
        failed (``engine_error``; it waits for a new plan, so waiting on is
        pointless)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                resp = self.health(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                if resp.serving and (resp.has_plan or not need_plan):
                    return resp
                if need_plan and resp.engine_error:
                    # The build failed and waits for a new plan: no use waiting.
                    raise RuntimeError(f"muond daemon at {self.address}: no step engine: "
                                       f"{resp.engine_error}")
                last = "no plan yet" if resp.serving else "answered serving=false"
            except grpc.RpcError as e:  # not up yet
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"muond daemon at {self.address} not healthy after "
                                   f"{timeout:.1f}s ({last})")
            time.sleep(poll)


def _step_request(job_id, step_id, overrides, client_id, skip_params=()) -> pb.StepRequest:
    return pb.StepRequest(job_id=job_id, step_id=step_id, overrides=list(overrides),
                          client_id=client_id, skip_params=list(skip_params))
