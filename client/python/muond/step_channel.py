"""The trainer's end of a step channel: Step requests through a POSIX shm
object the trainer creates, answered by a daemon thread that waits on it
(layout: proto/step_channel_layout.h, read through muond._rules; the
RPC that hands it over: OpenStepChannel). A gRPC call after a step's worth of
idling costs ~0.7-1.1 ms, both ends' threads waking; a futex round trip
through shared memory ~0.01-0.1 ms (bench/results/step_channel_cpu.md).

Linux only (futexes, open-file-description locks). Where a channel cannot be
had (another OS, a daemon without OpenStepChannel or seeing another
/dev/shm), ``StepChannel.open`` gives None and the caller keeps the Step RPC.
A channel whose step's outcome is unknown (a timeout, the daemon gone, an
interrupt) is broken: a late answer must never be read as the next step's,
so it is closed and never used again.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import numbers
import os
import platform
import struct
import sys
import threading
import time
import weakref

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from muond import _rules
from muond.shm import SHM_DIR, shm_name
from muond.v1 import error_details_pb2
from muond.v1 import muond_pb2 as pb

try:
    import fcntl
except ImportError:  # not a POSIX system: no channel, the import still works
    fcntl = None

_LOG = logging.getLogger("muond.step_channel")

MIN_CAPACITY = _rules.STEP_CHANNEL_MIN_CAPACITY
MAX_CAPACITY = _rules.STEP_CHANNEL_MAX_CAPACITY
_PAGE = 4096  # capacities are whole pages
_HEADER = _rules.STEP_CHANNEL_REQUEST_OFFSET
_MASK32 = 0xFFFFFFFF

_FUTEX_SYSCALL = ({"x86_64": 202, "aarch64": 98}.get(platform.machine())
                  if sys.platform.startswith("linux") else None)
# Shared futexes (no FUTEX_PRIVATE_FLAG): the daemon waits on the same words.
_FUTEX_WAIT, _FUTEX_WAKE, _FUTEX_PRIVATE_FLAG = 0, 1, 128
# How often a waiting trainer checks that its daemon still lives.
_WAIT_SLICE_S = 0.5
# struct flock on x86_64 and aarch64: type, whence, start, len, pid.
_FLOCK = "hhxxxxqqixxxx"
# gRPC's trailer of a status's details, where muond.client.error_info reads them.
DETAILS_KEY = "grpc-status-details-bin"
_CODES = {code.value[0]: code for code in grpc.StatusCode}


# The longest answer poll (set_answer_poll), seconds: a poll is a stretch at
# a step's end, not a way to spin through it.
MAX_ANSWER_POLL_S = 0.1


def answer_poll_seconds(seconds) -> float:
    """``seconds`` as an answer poll (set_answer_poll): a real number (not a
    bool) in [0, MAX_ANSWER_POLL_S], else ValueError."""
    try:
        poll = (float(seconds) if isinstance(seconds, numbers.Real)
                and not isinstance(seconds, (bool, np.bool_)) else None)
    except OverflowError:  # an int past float's range
        poll = None
    if poll is None or not 0.0 <= poll <= MAX_ANSWER_POLL_S:
        raise ValueError(f"an answer poll must be a number of seconds in [0, "
                         f"{MAX_ANSWER_POLL_S:g}], got {seconds!r}")
    return poll + 0.0  # -0.0 as 0.0


class ChannelUnusable(Exception):
    """The step was not sent (too large for the channel, or the channel is
    closed, broken, busy in another thread or another process's): send it
    over gRPC."""


class ChannelAnswerTooLarge(Exception):
    """The daemon answered the step (applied or refused it) but its answer
    did not fit the channel: the same request over gRPC gets the daemon's
    record of it."""


class ChannelRpcError(grpc.RpcError):
    """A step failed through the channel, shaped as grpc raises a failed call
    (code, details, the status details in the trailing metadata as the
    daemon's gRPC status carries them), so muond.client.error_info and
    muond.torch.rpc.result read it as they read the same failure over gRPC."""

    def __init__(self, code: grpc.StatusCode, message: str, status: bytes = b""):
        super().__init__(f"{code.name}: {message}")
        self._code, self._message, self._status = code, message, status

    @classmethod
    def from_status(cls, data: bytes) -> "ChannelRpcError":
        """The error a serialized muond.v1.RpcStatus says."""
        status = error_details_pb2.RpcStatus.FromString(data)
        # gRPC carries the details only when the status has some.
        return cls(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message,
                   data if status.details else b"")

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ((DETAILS_KEY, self._status),) if self._status else ()


def capacities(groups, refusal_bytes: int) -> tuple[int, int]:
    """(request, response) capacities for the steps of a registration's wire
    ``groups`` (pb.ParamGroup): room for every param's name (skip_params,
    skipped_nonfinite) and every group's override (a group per layer has
    thousands), 64 KiB for the rest, and in a request a trainer refusal of
    ``refusal_bytes``; whole pages, at most MAX_CAPACITY (a larger request
    goes over gRPC, a larger answer is fetched over gRPC)."""
    names = sum(len(p.name.encode()) + 16 for g in groups for p in g.params)
    overrides = sum(len(g.name.encode()) + 64 for g in groups)
    # An answer names a skipped param "group/param" (skipped_nonfinite).
    prefixes = sum((len(g.name.encode()) + 1) * len(g.params) for g in groups)
    slack = 64 << 10
    return (_whole_pages(slack + names + overrides + refusal_bytes),
            _whole_pages(slack + names + prefixes))


def _whole_pages(n: int) -> int:
    return min(MAX_CAPACITY, max(MIN_CAPACITY, -(-n // _PAGE) * _PAGE))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _FUTEX_SYSCALL is not None else None


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> int:
    """futex(2) on the u32 at ``address`` (ctypes releases the GIL while it
    waits): its result, or -errno."""
    timespec = None
    if timeout_s is not None:
        seconds = int(timeout_s)
        timespec = ctypes.byref(_Timespec(seconds, int((timeout_s - seconds) * 1e9)))
    result = _libc.syscall(ctypes.c_long(_FUTEX_SYSCALL), ctypes.c_void_p(address),
                           ctypes.c_int(op), ctypes.c_uint32(value), timespec,
                           ctypes.c_void_p(None), ctypes.c_uint32(0))
    return result if result >= 0 else -ctypes.get_errno()


# x86-64 keeps plain stores in order and plain loads in order, which is all
# the channel needs (a request before its seq, an answer after its seq).
# Elsewhere a full barrier goes between them: the kernel's FUTEX_WAKE runs
# one (smp_mb) before it looks for waiters, here on a word no one waits on.
_NEEDS_FENCE = platform.machine() != "x86_64"
_FENCE_WORD = ctypes.c_uint32(0)


def _fence() -> None:
    if _NEEDS_FENCE:
        _futex(ctypes.addressof(_FENCE_WORD), _FUTEX_WAKE | _FUTEX_PRIVATE_FLAG, 1)


def _u32_at(address: int) -> ctypes.c_uint32:
    """The u32 field at ``address`` as a ctypes word: one aligned load or
    store per access (struct.pack_into's "<I" stores bytewise, and the
    daemon could read a torn seq)."""
    return ctypes.c_uint32.from_address(address)


def _flock(lock_type: int, byte: int) -> bytes:
    return struct.pack(_FLOCK, lock_type, os.SEEK_SET, byte, 1, 0)


def _set_lock(fd: int, lock_type: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(lock_type, byte))


def _lock_held(fd: int, byte: int) -> bool:
    """Another open file description holds a lock on ``byte`` (the kernel
    drops a lock when its holder's process dies)."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    return struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK


def _why_unsupported() -> str | None:
    if _FUTEX_SYSCALL is None:
        return f"no futex syscall number known for {sys.platform} {platform.machine()}"
    if fcntl is None or not hasattr(fcntl, "F_OFD_SETLK"):
        return "no open-file-description locks (fcntl.F_OFD_SETLK)"
    return None


def _check_capacity(what: str, capacity: int) -> None:
    if not (MIN_CAPACITY <= capacity <= MAX_CAPACITY and capacity % _PAGE == 0):
        raise ValueError(f"{what} {capacity} must be a multiple of {_PAGE} in "
                         f"[{MIN_CAPACITY}, {MAX_CAPACITY}]")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# Every channel open in this process, for the fork handler below.
_OPEN: "weakref.WeakSet[StepChannel]" = weakref.WeakSet()
# Held from a channel's descriptor's creation to its entry in _OPEN, and from
# its removal to the descriptor's close, and by a fork (register_at_fork): a
# child forked in between would keep a copy no handler knows of, so the
# trainer's lock past this process's death. Reentrant: a finalizer may close
# another channel while this thread creates one.
_FORK_FENCE = threading.RLock()


class StepChannel:
    """One daemon's step channel; ``open`` makes one. ``step`` sends a
    StepRequest and waits for its answer; ``close`` ends it."""

    @classmethod
    def open(cls, client, job_id: str, request_capacity: int,
             response_capacity: int) -> "StepChannel | None":
        """A channel to ``client``'s daemon (a muond.client.Client: its stub
        and timeout), or None where one cannot be had (logged at debug
        level). The shm name is unlinked before this returns, whatever the
        daemon answered (it keeps its own descriptor). ValueError for a
        capacity not a multiple of 4096 in [MIN_CAPACITY, MAX_CAPACITY]."""
        _check_capacity("request_capacity", request_capacity)
        _check_capacity("response_capacity", response_capacity)
        why = _why_unsupported()
        if why is not None:
            _LOG.debug("no step channel: %s", why)
            return None
        name = shm_name(job_id)  # unpredictable: no other user creates it first
        try:
            channel = cls._create(SHM_DIR + name, request_capacity, response_capacity)
        except OSError as e:  # /dev/shm full or absent
            _LOG.debug("no step channel: %s: %s", SHM_DIR + name, e)
            return None
        try:
            opened = client.stub.OpenStepChannel(pb.OpenStepChannelRequest(shm_name=name),
                                                 timeout=client.timeout)
            version, channel.answers_kept = opened.version, opened.answers_kept
            channel.trainer_verdicts = opened.trainer_verdicts
        except grpc.RpcError as e:  # an older daemon, another /dev/shm, too many channels
            _LOG.debug("no step channel: daemon %s: OpenStepChannel: %s: %s",
                       client.address, e.code().name, e.details())
            version = None
        except BaseException:
            channel._release()
            raise
        finally:
            _unlink(SHM_DIR + name)
        if version != _rules.STEP_CHANNEL_VERSION:
            if version is not None:
                _LOG.debug("no step channel: daemon %s speaks layout version %d, not %d",
                           client.address, version, _rules.STEP_CHANNEL_VERSION)
            channel._release()  # no close op: the daemon sees the lock dropped
            return None
        return channel

    @classmethod
    def _create(cls, path: str, request_capacity: int, response_capacity: int):
        """The object at ``path`` with its header written, mapped and locked
        (on a failure, removed again)."""
        size = _HEADER + request_capacity + response_capacity
        with _FORK_FENCE:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # Reserved now: a full /dev/shm fails here, not as a SIGBUS on a write.
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size)
                for offset, fmt, value in (
                        (_rules.STEP_CHANNEL_MAGIC_OFFSET, "<Q", _rules.STEP_CHANNEL_MAGIC),
                        (_rules.STEP_CHANNEL_VERSION_OFFSET, "<I", _rules.STEP_CHANNEL_VERSION),
                        (_rules.STEP_CHANNEL_REQUEST_CAPACITY_OFFSET, "<I", request_capacity),
                        (_rules.STEP_CHANNEL_RESPONSE_CAPACITY_OFFSET, "<I",
                         response_capacity)):
                    struct.pack_into(fmt, mapping, offset, value)
                _set_lock(fd, fcntl.F_WRLCK, _rules.STEP_CHANNEL_TRAINER_LOCK_BYTE)
            except BaseException:
                os.close(fd)
                _unlink(path)
                raise
            return cls(fd, mapping, request_capacity, response_capacity)

    def __init__(self, fd: int, mapping: mmap.mmap, request_capacity: int,
                 response_capacity: int):
        self._fd, self._mapping = fd, mapping
        self.request_capacity, self.response_capacity = request_capacity, response_capacity
        self._pid = os.getpid()
        self._lock = threading.Lock()  # one step at a time
        self._seq = 0  # the last request_seq written
        self.broken = False  # a step's outcome is unknown
        self.closed = False
        # The daemon keeps an answer too large for the channel for the Step
        # RPC of the same request, which returns it as it was
        # (OpenStepChannelResponse.answers_kept); else that RPC answers from
        # the daemon's record of the step (replayed).
        self.answers_kept = False
        # The daemon takes a step sent before the trainer's checks and waits
        # for their verdict (OpenStepChannelResponse.trainer_verdicts).
        self.trainer_verdicts = False
        self._closing = False  # close() asked while a step was in flight
        # Polling for the answer (set_answer_poll): how long before the
        # predicted answer, and the last step's wait from which it is
        # predicted.
        self._poll_s = 0.0
        self._last_wait_s = 0.0
        # The last step answered here: (posted, returned), time.monotonic()
        # as its request began to be written and once its answer was parsed;
        # with the
        # answer's received_at_us / answered_at_us (the daemon's readings of
        # the same clock) they split its round trip into legs. None until a
        # step is answered, and after one that was not.
        self.last_trip: tuple[float, float] | None = None
        self._posted_at = 0.0
        anchor = ctypes.c_char.from_buffer(mapping)
        base = ctypes.addressof(anchor)
        del anchor  # a live buffer export would keep the mapping from closing
        self._request_seq = _u32_at(base + _rules.STEP_CHANNEL_REQUEST_SEQ_OFFSET)
        self._response_seq = _u32_at(base + _rules.STEP_CHANNEL_RESPONSE_SEQ_OFFSET)
        self._request_len = _u32_at(base + _rules.STEP_CHANNEL_REQUEST_LEN_OFFSET)
        self._request_op = _u32_at(base + _rules.STEP_CHANNEL_REQUEST_OP_OFFSET)
        self._response_len = _u32_at(base + _rules.STEP_CHANNEL_RESPONSE_LEN_OFFSET)
        self._response_kind = _u32_at(base + _rules.STEP_CHANNEL_RESPONSE_KIND_OFFSET)
        self._verdict_seq = _u32_at(base + _rules.STEP_CHANNEL_VERDICT_SEQ_OFFSET)
        self._verdict = _u32_at(base + _rules.STEP_CHANNEL_VERDICT_OFFSET)
        _OPEN.add(self)

    # -- a step ---------------------------------------------------------------
    def step(self, request: pb.StepRequest, timeout: float | None,
             checks=None) -> pb.StepResponse:
        """The daemon's answer to ``request`` within ``timeout`` seconds (None:
        no deadline). Raises ChannelRpcError for a failed step (as over gRPC;
        also UNAVAILABLE when the daemon is gone, DEADLINE_EXCEEDED past the
        timeout: the channel is then broken), ChannelAnswerTooLarge, or
        ChannelUnusable when the request was not sent.

        ``checks`` (a request with ``await_trainer_verdict``, to a daemon with
        ``trainer_verdicts``): called once the request is sent, while the
        daemon runs the step; its truth is the trainer's verdict (true: go,
        false: withdraw). What it raises withdraws the step and is raised once
        the daemon answered (the answer, the withdrawal, is dropped)."""
        if not self._lock.acquire(blocking=False):
            raise ChannelUnusable("the step channel is in use by another thread")
        try:
            self._check_usable()
            if not _lock_held(self._fd, _rules.STEP_CHANNEL_DAEMON_LOCK_BYTE):
                # The daemon's end is gone (its process, or its thread ended
                # the channel) before this request was written: nothing is
                # sent, so the step goes over gRPC at once (to a daemon
                # restarted on the same address, or to gRPC's own error)
                # rather than waiting a slice to call it UNAVAILABLE.
                self._closing = True
                _LOG.debug("step channel closed: the daemon's end is gone; steps go over "
                           "gRPC from now on")
                raise ChannelUnusable("the daemon's end of the step channel is gone")
            data = request.SerializeToString()
            if len(data) > self.request_capacity:
                raise ChannelUnusable(f"a StepRequest of {len(data)} bytes, past the step "
                                      f"channel's {self.request_capacity}")
            self.broken = True  # until the answer is read, whatever interrupts us
            self.last_trip = None
            self._send(data)
            raised = None
            if checks is not None:
                try:
                    go = bool(checks())
                except BaseException as e:  # noqa: BLE001 (withdrawn first, raised below)
                    raised, go = e, False
                self._give_verdict(go)
            try:
                self._await_answer(timeout)
            except BaseException:
                if raised is not None:
                    raise raised  # the checks' error; the channel stays broken
                raise
            outcome = self._read_answer()
            if isinstance(outcome, pb.StepResponse):
                self.last_trip = (self._posted_at, time.monotonic())
            self.broken = False
        finally:
            if self._closing:
                self._close_now()
            self._lock.release()
        try:
            if raised is not None:
                raise raised
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        finally:
            # An exception raised here holds this frame: dropping its locals
            # keeps that from a cycle holding the checks' owner (the optimizer).
            raised = outcome = checks = None

    def set_answer_poll(self, seconds: float) -> None:
        """Poll for the daemon's answer over the last ``seconds`` before it
        is expected (the last step's wait, counted from its request's
        sending) and as long after, instead of sleeping on the futex, so
        that the thread is awake when the answer comes (one that slept
        through a GPU step wakes ~0.05-0.1 ms after the daemon's futex
        wake-up: bench/results/step_channel_cpu.md). The poll yields the GIL
        and the core between looks and costs up to 2 x ``seconds`` of one
        core a step; a step whose previous wait was shorter than 2 x
        ``seconds`` (a CPU daemon's short step) does not poll. 0 (the
        default): sleep throughout.
        ValueError unless answer_poll_seconds takes it."""
        self._poll_s = answer_poll_seconds(seconds)

    def _give_verdict(self, go: bool) -> None:
        """The verdict on the request just sent: the verdict, then its
        sequence number (the request's), then the daemon woken."""
        self._verdict.value = (_rules.STEP_CHANNEL_VERDICT_GO if go
                               else _rules.STEP_CHANNEL_VERDICT_WITHDRAW)
        _fence()
        self._verdict_seq.value = self._seq
        _futex(ctypes.addressof(self._verdict_seq), _FUTEX_WAKE, 1)

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise ChannelUnusable(f"the step channel of process {self._pid}, of which this "
                                  "one is a fork")
        if self.closed or self.broken or self._closing:
            raise ChannelUnusable("the step channel is closed")

    def _send(self, data: bytes) -> None:
        self._posted_at = time.monotonic()
        self._mapping[_HEADER:_HEADER + len(data)] = data
        self._request_len.value = len(data)
        self._request_op.value = _rules.STEP_CHANNEL_OP_STEP
        self._post()

    def _post(self) -> None:
        """Publishes the request written: request_seq + 1, the daemon woken."""
        _fence()
        self._seq = (self._seq + 1) & _MASK32
        self._request_seq.value = self._seq
        _futex(ctypes.addressof(self._request_seq), _FUTEX_WAKE, 1)

    def _await_answer(self, timeout: float | None) -> None:
        """Returns once response_seq is the request's; between slices of
        waiting it checks the daemon's lock and the deadline."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        # The answer's wait is counted from the request's sending, not from
        # here: the trainer's checks alongside run in between, and their
        # time, which varies, must not move the poll away from the answer.
        sent = self._posted_at
        poll_from = None  # when to poll instead of sleeping (set_answer_poll)
        if self._poll_s > 0 and self._last_wait_s >= 2 * self._poll_s:
            poll_from = sent + self._last_wait_s - self._poll_s
        while True:
            seen = self._response_seq.value
            if seen == self._seq:
                _fence()
                self._last_wait_s = time.monotonic() - sent
                return
            if self._closing:  # as gRPC cancels a closed channel's calls
                raise ChannelRpcError(grpc.StatusCode.CANCELLED,
                                      "Locally cancelled by application!")
            now = time.monotonic()
            wait_s = _WAIT_SLICE_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - now)
                if wait_s <= 0:
                    raise ChannelRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if poll_from is not None:
                if now >= poll_from:  # once a step; then sleep again
                    poll_from = None
                    self._poll_answer(min(now + 2 * self._poll_s, now + wait_s))
                    # A daemon gone during the poll is seen at its end, as
                    # at a slice's end, not a slice later.
                    if self._daemon_gone():
                        raise ChannelRpcError(grpc.StatusCode.UNAVAILABLE,
                                              "the daemon's step channel: its lock is gone "
                                              "(the daemon's process ended)")
                    continue
                wait_s = min(wait_s, poll_from - now)
            waited = _futex(ctypes.addressof(self._response_seq), _FUTEX_WAIT, seen, wait_s)
            # A signal (EINTR) ends a wait early too: signals more frequent
            # than a slice (a timer, a profiler) must not hide a dead daemon
            # until the deadline.
            if waited in (-errno.ETIMEDOUT, -errno.EINTR) and self._daemon_gone():
                raise ChannelRpcError(grpc.StatusCode.UNAVAILABLE,
                                      "the daemon's step channel: its lock is gone (the "
                                      "daemon's process ended)")

    def _poll_answer(self, until: float) -> None:
        """Looks at response_seq until the request's answer is there, a
        close() is asked or ``until`` (time.monotonic), yielding the GIL and
        the core between looks: sched_yield returns at once when nothing
        else waits for the core, where time.sleep(0) sleeps out the timer
        slack (~50 µs), and another Python thread ran at ~96% of its speed
        beside it against ~51% beside time.sleep(0) (2-core VM)."""
        while (self._response_seq.value != self._seq and not self._closing
               and time.monotonic() < until):
            os.sched_yield()

    def _daemon_gone(self) -> bool:
        """No daemon holds its lock, and no answer came before it went."""
        return (not _lock_held(self._fd, _rules.STEP_CHANNEL_DAEMON_LOCK_BYTE)
                and self._response_seq.value != self._seq)

    def _read_answer(self):
        """The StepResponse, or the exception that the answer says to raise."""
        kind, length = self._response_kind.value, self._response_len.value
        if kind == _rules.STEP_CHANNEL_TOO_LARGE:
            return ChannelAnswerTooLarge(f"the daemon's answer of {length} bytes is past "
                                         f"the step channel's {self.response_capacity}")
        known = (_rules.STEP_CHANNEL_STEP_RESPONSE, _rules.STEP_CHANNEL_RPC_STATUS)
        if kind not in known or length > self.response_capacity:
            raise ChannelRpcError(grpc.StatusCode.INTERNAL, "the daemon's step channel "
                                  f"answered kind {kind} of {length} bytes")
        start = _HEADER + self.request_capacity
        data = self._mapping[start:start + length]
        try:
            if kind == _rules.STEP_CHANNEL_STEP_RESPONSE:
                return pb.StepResponse.FromString(data)
            return ChannelRpcError.from_status(data)
        except DecodeError as e:
            raise ChannelRpcError(grpc.StatusCode.INTERNAL, "the daemon's step channel "
                                  f"answered {length} bytes that do not parse: {e}") from e

    # -- the end --------------------------------------------------------------
    def close(self) -> None:
        """Tells the daemon (unless a step's outcome is unknown: then the
        lock dropped here tells it), unmaps the object and closes its
        descriptor. Idempotent. A step in flight in another thread stops
        waiting (CANCELLED) and closes it as it ends."""
        self._closing = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_now()
            finally:
                self._lock.release()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter exit: the process end drops the lock)
            pass

    def _close_now(self) -> None:
        if self.closed:
            return
        try:
            if not self.broken and os.getpid() == self._pid:
                self._request_op.value = _rules.STEP_CHANNEL_OP_CLOSE
                self._post()
        finally:
            self._release()

    def _release(self, in_child: bool = False) -> None:
        """Unmaps and closes; the lock dropped unless ``in_child`` (a forked
        child shares the parent's open file description, so its lock)."""
        with _FORK_FENCE:
            self.closed = True
            _OPEN.discard(self)
            self._request_seq = self._response_seq = self._request_len = None
            self._request_op = self._response_len = self._response_kind = None
            self._verdict_seq = self._verdict = None
            try:
                self._mapping.close()
            finally:
                try:
                    if not in_child:
                        _set_lock(self._fd, fcntl.F_UNLCK,
                                  _rules.STEP_CHANNEL_TRAINER_LOCK_BYTE)
                finally:
                    os.close(self._fd)


def _forget_in_child() -> None:
    """A forked child drops its copies of the parent's channels (never
    sending on them): its descriptor would keep the parent's lock, so the
    daemon's sign of the trainer's death, held past it."""
    _FORK_FENCE.release()  # taken by the fork, in the thread that is the child's
    for channel in list(_OPEN):
        try:
            channel._release(in_child=True)
        except Exception:  # noqa: BLE001 (one channel's failure must not keep the others)
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_FORK_FENCE.acquire, after_in_parent=_FORK_FENCE.release,
                        after_in_child=_forget_in_child)
