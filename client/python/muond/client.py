"""A thin client for one muond daemon's Optimizer service (proto/muond/v1/muond.proto)."""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
import time
from typing import Iterable, Mapping

import grpc
import numpy as np

from muond import _rules
from muond.step_channel import DETAILS_KEY as _DETAILS_KEY
from muond.step_channel import (ChannelAnswerTooLarge, ChannelUnusable, StepChannel,
                                answer_poll_seconds)
from muond.v1 import error_details_pb2
from muond.v1 import muond_pb2 as pb
from muond.v1 import muond_pb2_grpc as pb_grpc

# Why an RPC failed, beyond its status code: google.rpc.ErrorInfo.reason in
# the status details (proto/muond/v1/error_details.proto). Domain and names
# come from core/common/error_reason.h through the generated muond._rules.
ERROR_DOMAIN = _rules.ERROR_DOMAIN
REASONS = _rules.ERROR_REASONS
(PEER_GONE, NO_PLAN_YET, ALREADY_REGISTERED, TRAINER_REFUSED, REFUSED_BY_PEER,
 STEP_WITHDRAWN) = REASONS
# PEER_GONE        Step: a peer daemon failed or is gone; nothing applied: resend
# NO_PLAN_YET      Coordinator.GetPlan: the job has no plan yet
# ALREADY_REGISTERED  RegisterParams: another client holds the daemon's params;
#                  metadata {"client_id": holder}. Unregister it as the
#                  operator (Client.unregister_as_operator) if it is gone.
# TRAINER_REFUSED  Step: a trainer's own checks failed before it sent its
#                  step (it raised the error naming the param and the rule);
#                  the job refused the step on every rank, nothing applied;
#                  metadata {"ranks": the job ranks (daemons) whose trainers
#                  refused} on the other ranks
# REFUSED_BY_PEER  Step: another daemon refused the step (non-finite
#                  gradients, overrides, ...) and the job refused it on every
#                  rank, nothing applied; metadata {"ranks": the refusers},
#                  whose own answers have the details (param and rule, ...)
# STEP_WITHDRAWN   Step: a trainer withdrew a step it sent before its checks
#                  (Client.step_with_checks), refused on every rank, nothing
#                  applied; metadata {"ranks": the withdrawers}: send it again


def operator_client_id(token: str | None) -> str:
    """The operator's client_id for daemons whose token is ``token`` (None or
    "" for a daemon without one): it may save/load any registration's state and
    unregister a trainer that is gone. Derived from the token, as the daemon
    derives it (server/common/operator_id.h: "operator:" + hex HMAC-SHA256 of a
    fixed label keyed with the token), so only holders of the token can act as
    the operator; a credential, never to be logged."""
    digest = hmac.new((token or "").encode("ascii"), _rules.OPERATOR_ID_LABEL.encode("ascii"),
                      hashlib.sha256).hexdigest()
    return _rules.OPERATOR_ID_PREFIX + digest

_ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo"


class MuondError(RuntimeError):
    """A failed muond RPC, as muond.torch raises it: ``code`` (a
    grpc.StatusCode, or None when the failure was not an RPC status),
    ``reason`` (one of REASONS, or "" when the daemon gave none) and its
    ``metadata`` (dict), so callers branch on them, never on the text.
    One with code INVALID_ARGUMENT is an InvalidArgumentError, also a
    ValueError."""

    def __new__(cls, message: str = "", code=None, *args, **kwargs):
        if cls is MuondError and code == grpc.StatusCode.INVALID_ARGUMENT:
            cls = InvalidArgumentError
        return super().__new__(cls, message)

    def __init__(self, message: str, code=None, reason: str = "", metadata=None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})


class InvalidArgumentError(MuondError, ValueError):
    """A request muond refused as breaking a rule (a bad shard, tag, option
    or state: code INVALID_ARGUMENT): also a ValueError, as torch.optim
    raises for bad input (``except ValueError`` catches both)."""


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


TOKEN_METADATA_KEY = "x-muond-token"  # server/common/auth.h kTokenMetadataKey
MAX_TOKEN_BYTES = 4096                # server/common/auth.h kMaxTokenBytes
# StateChunk data per message (server/daemon/state_transactions.h): the default and
# the bound; the daemon receives messages up to the bound plus 1 MiB.
DEFAULT_STATE_CHUNK_BYTES = 1 << 20
MAX_STATE_CHUNK_BYTES = 64 << 20
_MAX_MESSAGE_BYTES = MAX_STATE_CHUNK_BYTES + (1 << 20)


def read_token_file(path) -> str:
    """The token in ``path``, read as the servers and muonctl read
    ``--token_file`` (server/common/auth.h ReadTokenFile): a regular file, not
    readable or writable by others (chmod 600), at most 4096 bytes, one
    printable-ASCII token (surrounding whitespace dropped). ValueError naming
    the path and the rule; FileNotFoundError when it cannot be opened."""
    where = f"token_file={os.fspath(path)!r}"
    try:
        # O_NONBLOCK: a FIFO planted at the path must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise FileNotFoundError(f"{where}: cannot open: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ValueError(f"{where}: readable or writable by other users "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        if st.st_size > MAX_TOKEN_BYTES:
            raise ValueError(f"{where}: larger than {MAX_TOKEN_BYTES} bytes")
        data = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_BYTES:
        raise ValueError(f"{where}: larger than {MAX_TOKEN_BYTES} bytes")
    # ASCII whitespace only, as absl::StripAsciiWhitespace: str.strip() would
    # also drop 0x1c-0x1f, 0x85 and 0xa0, bytes the servers refuse.
    return _check_token(data.strip(_ASCII_WHITESPACE).decode("latin-1"), where)


_ASCII_WHITESPACE = b" \t\n\v\f\r"


def _check_token(token: str, where: str) -> str:
    if not token:
        raise ValueError(f"{where}: the token is empty")
    if len(token) > MAX_TOKEN_BYTES or any(not (0x20 < ord(c) < 0x7F) for c in token):
        raise ValueError(f"{where}: a token is at most {MAX_TOKEN_BYTES} printable ASCII "
                         "characters without spaces (gRPC metadata)")
    return token


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``x-muond-token`` to every call, as the C++ client does."""

    def __init__(self, token: str):
        self._metadata = (TOKEN_METADATA_KEY, token)

    def _details(self, details):
        metadata = list(details.metadata or ()) + [self._metadata]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") \
            else _CallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def _root_certificates(root_certificates) -> bytes:
    """PEM bytes as given, or read from a path (str / os.PathLike)."""
    if isinstance(root_certificates, (bytes, bytearray)):
        return bytes(root_certificates)
    with open(root_certificates, "rb") as f:
        return f.read()


def _rpc_error(e: Exception, address: str, what: str) -> MuondError:
    """A failed RPC as MuondError naming the daemon and the RPC, with its
    status code and the daemon's ErrorInfo reason and metadata."""
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    info = error_info(e)
    return MuondError(f"muond daemon {address}: {what} failed: "
                      f"{code.name if code is not None else type(e).__name__}: {detail}",
                      code=code, reason=info.reason if info else "",
                      metadata=dict(info.metadata) if info else None)


def _fp32_bytes(values) -> memoryview:
    """The little-endian fp32 bytes of a tensor or array-like (flattened)."""
    import torch  # only here and in export_state: client.py works without it

    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float32).contiguous().numpy()
    arr = np.ascontiguousarray(np.asarray(values, dtype="<f4")).reshape(-1)
    return memoryview(arr).cast("B")


class Client:
    """One daemon, e.g. ``Client("unix:///tmp/muond-job-0.sock")``.

    The older methods raise ``grpc.RpcError`` on a failed RPC (its ``.code()``
    and ``.details()`` name the param/field the daemon rejected;
    ``error_reason(e)`` says why, where the daemon says); the state methods
    (export_state, import_state, commit_state, abort_state) raise MuondError.
    ``timeout`` is a per-RPC deadline in seconds (None: no deadline).

    A daemon on TCP needs the job token or TLS (server/README.md "Access"):
    ``token`` (sent as ``x-muond-token`` on every call, as the C++ client's
    ``ClientOptions.token``) or ``token_file`` (read once, as the servers read
    ``--token_file``: a regular file not readable by others; prefer it, argv
    and environments leak); ``root_certificates`` (PEM bytes, or a path to a
    PEM file) connects with TLS, as ``ClientOptions.tls_root_cert_pem``.

    ``optimizer`` names the optimizer instance every request is about (a
    daemon hosts several, each its own registration: server/README.md
    "Optimizer instances"); None or "" is the daemon's default one. With a
    name given (even ""), ``health()`` asks about that instance, else about
    the daemon as a whole.

    ``open_step_channel`` makes ``step()`` go through shared memory
    (muond.step_channel), with the same answers and errors as the Step RPC.
    """

    def __init__(self, address: str, timeout: float | None = None, *,
                 token: str | None = None, token_file=None, root_certificates=None,
                 optimizer: str | None = None):
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        elif token is not None:
            token = _check_token(token, "token")
        self.address = address
        self.timeout = timeout
        self.optimizer = optimizer
        self._name = optimizer or ""
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)]
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_root_certificates(root_certificates))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        channel = self._channel
        self._operator_id = operator_client_id(token)
        if token:
            channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
        self.stub = pb_grpc.OptimizerStub(channel)
        self._step_channel: StepChannel | None = None
        # The last step's StepChannel.last_trip when it went through the step
        # channel, else None (over gRPC the daemon may be on another host,
        # with another clock).
        self.last_trip: tuple[float, float] | None = None

    def close(self) -> None:
        self.close_step_channel()
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
                                       regions=list(regions), optimizer=self._name)
        return self.stub.RegisterParams.future(req, timeout=self.timeout)

    def step(self, job_id: str, step_id: int, overrides: Iterable[pb.GroupOverride] = (),
             client_id: str = "", skip_params: Iterable[str] = (),
             trainer_refusal: str = "") -> pb.StepResponse:
        """``skip_params``: names of params this step leaves alone (torch.optim's
        grad-None rule; StepRequest.skip_params). ``trainer_refusal``: why the
        trainer refuses this step (StepRequest.trainer_refusal): every rank of
        the job then fails it at once and nothing changes."""
        request = _step_request(job_id, step_id, overrides, client_id, skip_params,
                                self._name, trainer_refusal)
        channel = self._step_channel
        if channel is not None:
            response = self._step_through(channel, request)
            if response is not None:
                return response
        self.last_trip = None
        # A blocking call runs on this thread; a future makes grpc start a
        # channel polling thread per call (~100 µs more per step).
        return self.stub.Step(request, timeout=self.timeout)

    @property
    def takes_trainer_verdicts(self) -> bool:
        """step_with_checks can send through this client's step channel: one
        is open, to a daemon that waits for a trainer's verdict."""
        return self._step_channel is not None and self._step_channel.trainer_verdicts

    def step_with_checks(self, job_id: str, step_id: int, checks,
                         overrides: Iterable[pb.GroupOverride] = (), client_id: str = "",
                         skip_params: Iterable[str] = ()) -> pb.StepResponse | None:
        """The step sent through the step channel before the trainer's
        ``checks``, which run once it is sent: the daemon runs it up to its
        job vote, writing nothing, and goes on only if ``checks()`` returns
        true ("go"; false: "withdraw"; StepRequest.await_trainer_verdict). A withdrawn step
        raises as step() does, reason STEP_WITHDRAWN on every rank, nothing
        applied: send it again. What ``checks()`` raises withdraws the step
        and is raised once the daemon answered. None when it could not be
        sent so (no channel, a daemon without verdicts, the channel unusable):
        nothing was sent, ``checks`` not called."""
        channel = self._step_channel
        if channel is None or not channel.trainer_verdicts:
            return None
        request = _step_request(job_id, step_id, overrides, client_id, skip_params,
                                self._name)
        request.await_trainer_verdict = True
        return self._step_through(channel, request, checks)

    def _step_through(self, channel: StepChannel, request,
                      checks=None) -> pb.StepResponse | None:
        """The step channel's answer to ``request``, or None when it was not
        sent there (step() sends it over gRPC). A failure raises as the Step
        RPC's would; a channel whose step's outcome is unknown is closed."""
        self.last_trip = None
        try:
            response = channel.step(request, self.timeout, checks)
            self.last_trip = channel.last_trip
            return response
        except ChannelUnusable:
            return None
        except ChannelAnswerTooLarge:
            response = self.stub.Step(request, timeout=self.timeout)
            # A daemon that keeps the answer returns it as it was. An older
            # one answers from its record of this very request, which it
            # answered through the channel: no other process's step
            # (process_guard).
            if not channel.answers_kept:
                response.replayed = False
            return response
        finally:
            if channel.broken or channel.closed:
                self._drop_step_channel(channel)

    def open_step_channel(self, job_id: str, request_capacity: int,
                          response_capacity: int, answer_poll_s: float = 0.0) -> bool:
        """Opens a step channel to the daemon (muond.step_channel; replacing
        one open), through which step() then sends StepRequests of up to
        ``request_capacity`` bytes (larger ones go over gRPC). False when
        this host or the daemon cannot have one: step() keeps using gRPC.
        Capacities: multiples of 4096 in [64 KiB, 64 MiB]. ``answer_poll_s``:
        StepChannel.set_answer_poll (checked before anything is opened)."""
        answer_poll_s = answer_poll_seconds(answer_poll_s)
        self.close_step_channel()
        self._step_channel = StepChannel.open(self, job_id, request_capacity,
                                              response_capacity)
        if self._step_channel is not None:
            self._step_channel.set_answer_poll(answer_poll_s)
        return self._step_channel is not None

    def close_step_channel(self) -> None:
        """step() goes over gRPC again."""
        channel, self._step_channel = self._step_channel, None
        if channel is not None:
            channel.close()

    @property
    def has_step_channel(self) -> bool:
        """step() sends through a step channel now (else the Step RPC). Why
        one could not be opened is logged at DEBUG (logger
        ``muond.step_channel``)."""
        return self._step_channel is not None

    def _drop_step_channel(self, channel: StepChannel) -> None:
        if self._step_channel is channel:
            self._step_channel = None
        channel.close()

    def step_future(self, job_id, step_id, overrides=(), client_id="", skip_params=(),
                    trainer_refusal=""):
        return self.stub.Step.future(
            _step_request(job_id, step_id, overrides, client_id, skip_params, self._name,
                          trainer_refusal),
            timeout=self.timeout)

    def unregister(self, job_id: str, client_id: str = "",
                   timeout: float | None = None) -> pb.UnregisterParamsResponse:
        """Only the params' owner, or the operator (unregister_as_operator, to
        clear a trainer that ended without unregistering), may unregister them."""
        return self.stub.UnregisterParams(
            pb.UnregisterParamsRequest(job_id=job_id, client_id=client_id,
                                       optimizer=self._name),
            timeout=timeout or self.timeout)

    def unregister_as_operator(self, job_id: str,
                               timeout: float | None = None) -> pb.UnregisterParamsResponse:
        """Clears whatever registration the daemon holds, as the operator: the
        client_id derived from this client's token (operator_client_id)."""
        return self.unregister(job_id, self._operator_id, timeout)

    def status(self) -> pb.GetStatusResponse:
        return self.stub.GetStatus(pb.GetStatusRequest(optimizer=self._name),
                                   timeout=self.timeout)

    def health(self, timeout: float | None = None) -> pb.HealthResponse:
        request = (pb.HealthRequest() if self.optimizer is None
                   else pb.HealthRequest(optimizer=self.optimizer))
        return self.stub.Health(request, timeout=timeout or self.timeout)

    def save_state(self, path: str, job_id: str = "",
                   client_id: str = "") -> pb.SaveStateResponse:
        """One-shot save. Only the params' owner (the job_id/client_id that
        registered them) or the operator (``client_id=operator_client_id(token)``,
        as muonctl sends) may save or load."""
        return self.stub.SaveState(
            pb.SaveStateRequest(path=path, job_id=job_id, client_id=client_id,
                                optimizer=self._name),
            timeout=self.timeout)

    def load_state(self, path: str, job_id: str = "",
                   client_id: str = "") -> pb.LoadStateResponse:
        return self.stub.LoadState(
            pb.LoadStateRequest(path=path, job_id=job_id, client_id=client_id,
                                optimizer=self._name),
            timeout=self.timeout)

    # -- Optimizer state, streamed (proto ExportState / ImportState) --------
    def export_state(self, job_id: str, client_id: str, max_chunk_bytes: int = 0
                     ) -> tuple[int, dict[str, "torch.Tensor"]]:
        """The daemon's state of the params ``client_id`` registered:
        ``(step_id, {entry: 1-D float32 tensor})`` with entries
        ``"<param>.momentum"``, ``"<param>.exp_avg"``, ``"<param>.exp_avg_sq"``
        (this rank's shard, row-major) and ``"<param>.step"``; ``step_id`` is
        the step the state is the result of (-1: none yet). Streamed in chunks
        of at most ``max_chunk_bytes`` (0: 1 MiB), so any size fits gRPC's
        message limit. MuondError on failure."""
        import torch

        request = pb.ExportStateRequest(header=pb.StateHeader(
            job_id=job_id, client_id=client_id, max_chunk_bytes=max_chunk_bytes,
            optimizer=self._name))
        step_id, buffers = None, {}
        try:
            for chunk in self.stub.ExportState(request, timeout=self.timeout):
                if chunk.HasField("header"):
                    step_id = chunk.header.step_id
                    continue
                buf, filled = buffers.setdefault(chunk.entry, [bytearray(chunk.numel * 4), 0])
                if chunk.offset * 4 != filled or filled + len(chunk.data) > len(buf):
                    raise MuondError(f"muond daemon {self.address}: ExportState: entry "
                                     f"{chunk.entry!r} arrived out of order")
                buf[filled:filled + len(chunk.data)] = chunk.data
                buffers[chunk.entry][1] = filled + len(chunk.data)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.address, "ExportState") from e
        if step_id is None:
            raise MuondError(f"muond daemon {self.address}: ExportState: no header")
        state = {}
        for entry, (buf, filled) in buffers.items():
            if filled != len(buf):
                raise MuondError(f"muond daemon {self.address}: ExportState: entry "
                                 f"{entry!r} incomplete ({filled // 4} of {len(buf) // 4})")
            # Zero-copy over the bytearray; torch.frombuffer refuses empty ones.
            state[entry] = (torch.frombuffer(buf, dtype=torch.float32) if buf
                            else torch.empty(0, dtype=torch.float32))
        return step_id, state

    def import_state(self, job_id: str, client_id: str, step_id: int,
                     entries: Mapping[str, object], transaction_id: str = "",
                     max_chunk_bytes: int = 0) -> pb.ImportStateResponse:
        """Sends ``entries`` (name -> tensor or array of fp32 values, as
        export_state returns them) to the daemon, streamed in chunks of at
        most ``max_chunk_bytes`` (0: 1 MiB). All or nothing: the daemon checks
        every entry (known, right size, complete, finite) before it changes
        anything. After it the next step id is ``step_id + 1``. With a
        ``transaction_id`` the state is only staged: commit_state applies it,
        abort_state drops it. MuondError naming the entry and the rule."""
        chunk_bytes = max_chunk_bytes or DEFAULT_STATE_CHUNK_BYTES
        if not 4 <= chunk_bytes <= MAX_STATE_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes {max_chunk_bytes} not 0 or in "
                             f"[4, {MAX_STATE_CHUNK_BYTES}]")
        chunk_bytes -= chunk_bytes % 4
        header = pb.StateHeader(job_id=job_id, client_id=client_id, step_id=step_id,
                                transaction_id=transaction_id, num_entries=len(entries),
                                optimizer=self._name)

        def chunks():
            yield pb.StateChunk(header=header)
            for name, values in entries.items():
                data = _fp32_bytes(values)
                numel = len(data) // 4
                offset = 0
                while True:
                    piece = data[offset:offset + chunk_bytes]
                    yield pb.StateChunk(entry=name, numel=numel, offset=offset // 4,
                                        data=bytes(piece))
                    offset += len(piece)
                    if offset >= len(data):
                        break

        try:
            return self.stub.ImportState(chunks(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.address, "ImportState") from e

    def commit_state(self, job_id: str, client_id: str,
                     transaction_id: str) -> pb.LoadStateResponse:
        """Applies the state import_state staged under ``transaction_id``
        (LoadState COMMIT; refused when a step ran since)."""
        return self._end_state(job_id, client_id, transaction_id, pb.STATE_PHASE_COMMIT)

    def abort_state(self, job_id: str, client_id: str,
                    transaction_id: str) -> pb.LoadStateResponse:
        """Drops the state staged under ``transaction_id`` (LoadState ABORT;
        aborting what is gone succeeds)."""
        return self._end_state(job_id, client_id, transaction_id, pb.STATE_PHASE_ABORT)

    def _end_state(self, job_id, client_id, transaction_id, phase):
        request = pb.LoadStateRequest(job_id=job_id, client_id=client_id, phase=phase,
                                      transaction_id=transaction_id, optimizer=self._name)
        try:
            return self.stub.LoadState(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _rpc_error(e, self.address, "LoadState " + pb.StatePhase.Name(phase)) from e

    def wait_healthy(self, timeout: float = 30.0, poll: float = 0.1,
                     need_plan: bool = False) -> pb.HealthResponse:
        """Polls Health until the daemon answers ``serving`` (and, with
        ``need_plan``, ``has_plan``: after registration the daemon publishes its
        manifest, receives the coordinator's plan and builds its communicators
        together with its peers; Step before that is refused). Raises
        TimeoutError naming the address and the last state otherwise, and
        RuntimeError with the daemon's reason when building its step engine
        failed (``engine_error``; it waits for a new plan, so waiting on is
        pointless). A refused token (UNAUTHENTICATED / PERMISSION_DENIED) is
        raised at once as MuondError: waiting cannot fix it."""
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
            except grpc.RpcError as e:  # not up yet, unless the daemon refused us
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED):
                    # Permanent: waiting out the timeout cannot fix the token.
                    raise MuondError(
                        f"muond daemon {self.address}: Health refused: {e.code().name}: "
                        f"{e.details()}; pass the job's token (token= or token_file=, the "
                        "file the daemons read with --token_file) to reach a daemon on TCP",
                        code=e.code()) from e
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                hint = _no_plan_hint() if last == "no plan yet" else ""
                raise TimeoutError(f"muond daemon at {self.address} not healthy after "
                                   f"{timeout:.1f}s ({last}){hint}")
            time.sleep(poll)


def _no_plan_hint() -> str:
    """Why a serving daemon may have no plan: the coordinator plans once every
    rank's trainer has registered (a torchrun job run with fewer ranks than
    its daemons never gets one)."""
    world = os.environ.get("WORLD_SIZE", "")
    ranks = f"all $WORLD_SIZE={world} ranks" if world else "all of its ranks"
    return ("; the plan waits for every rank's trainer to register with its daemon: "
            f"a torchrun job must run {ranks}, one per daemon of the job")


def _step_request(job_id, step_id, overrides, client_id, skip_params=(),
                  optimizer="", trainer_refusal="") -> pb.StepRequest:
    return pb.StepRequest(job_id=job_id, step_id=step_id, overrides=list(overrides),
                          client_id=client_id, skip_params=list(skip_params),
                          optimizer=optimizer, trainer_refusal=trainer_refusal)
