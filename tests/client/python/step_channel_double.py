"""A daemon-side double of the step channel, for client tests: it keeps
proto/step_channel_layout.h's protocol as the daemon does. It opens
the trainer's object by name and locks the daemon's byte; a thread waits on
request_seq with a futex, reads the request with os.pread and writes its
answer with os.pwrite before response_seq. ``servicer_answers`` answers
through a gRPC servicer's Step (e.g. fake_daemon.FakeDaemon's), its aborts
as the RpcStatus the daemon writes."""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import struct
import threading

import grpc

from muond import _rules
from muond.v1 import error_details_pb2
from muond.v1 import muond_pb2 as pb

SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
HAVE_CHANNELS = SYS_FUTEX is not None and hasattr(fcntl, "F_OFD_SETLK")
DETAILS_KEY = "grpc-status-details-bin"
STEP_RESPONSE = _rules.STEP_CHANNEL_STEP_RESPONSE
RPC_STATUS = _rules.STEP_CHANNEL_RPC_STATUS
TOO_LARGE = _rules.STEP_CHANNEL_TOO_LARGE
_LIBC = ctypes.CDLL(None, use_errno=True)
_FLOCK = "hhxxxxqqixxxx"


def futex(word: ctypes.c_uint32, op: int, value: int, timeout_s=None) -> None:
    ts = None
    if timeout_s is not None:
        ts = ctypes.byref((ctypes.c_long * 2)(int(timeout_s), int(timeout_s % 1 * 1e9)))
    _LIBC.syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(ctypes.addressof(word)),
                  ctypes.c_int(op), ctypes.c_uint32(value), ts, None, ctypes.c_uint32(0))


def _set_lock(fd: int, lock_type: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, lock_type, os.SEEK_SET, byte, 1, 0))


def lock_held(fd: int, byte: int) -> bool:
    """Another open file description holds ``byte``."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK,
                      struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK


class ChannelDouble:
    """The daemon's end of one channel; ``answer(request)`` gives
    (kind, payload bytes), or None to never answer (a hung step)."""

    def __init__(self, shm_name: str, answer):
        self.fd = os.open("/dev/shm" + shm_name, os.O_RDWR)
        (self.magic, self.version, self.request_capacity,
         self.response_capacity) = struct.unpack("<QIII", os.pread(self.fd, 20, 0))
        _set_lock(self.fd, fcntl.F_WRLCK, _rules.STEP_CHANNEL_DAEMON_LOCK_BYTE)
        self.header = mmap.mmap(self.fd, 4096)  # the futex words only
        self.request_seq = ctypes.c_uint32.from_buffer(
            self.header, _rules.STEP_CHANNEL_REQUEST_SEQ_OFFSET)
        self.response_seq = ctypes.c_uint32.from_buffer(
            self.header, _rules.STEP_CHANNEL_RESPONSE_SEQ_OFFSET)
        self.answer = answer
        self.ops, self.requests = [], []
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        last = 0
        while not self.stopped:
            seq = self.request_seq.value
            if seq == last:
                futex(self.request_seq, 0, seq, 0.05)
                continue
            last = seq
            length, op = struct.unpack("<II", os.pread(self.fd, 8,
                                                       _rules.STEP_CHANNEL_REQUEST_LEN_OFFSET))
            self.ops.append(op)
            if op == _rules.STEP_CHANNEL_OP_CLOSE:
                return
            request = pb.StepRequest.FromString(
                os.pread(self.fd, length, _rules.STEP_CHANNEL_REQUEST_OFFSET))
            self.requests.append(request)
            reply = self.answer(request)
            if reply is not None:
                self._write_answer(seq, *reply)

    def _write_answer(self, seq: int, kind: int, payload: bytes):
        if kind != TOO_LARGE:
            os.pwrite(self.fd, payload,
                      _rules.STEP_CHANNEL_REQUEST_OFFSET + self.request_capacity)
        os.pwrite(self.fd, struct.pack("<II", len(payload), kind),
                  _rules.STEP_CHANNEL_RESPONSE_LEN_OFFSET)
        self.response_seq.value = seq
        futex(self.response_seq, 1, 1)

    def trainer_lock_held(self) -> bool:
        return lock_held(self.fd, _rules.STEP_CHANNEL_TRAINER_LOCK_BYTE)

    def die(self):
        """As a killed daemon: no answer comes, its lock goes."""
        self.stopped = True
        _set_lock(self.fd, fcntl.F_UNLCK, _rules.STEP_CHANNEL_DAEMON_LOCK_BYTE)

    def stop(self):
        self.stopped = True
        self.thread.join(5)


class _Aborted(Exception):
    pass


class _StepContext:
    """What a servicer's Step uses of its gRPC context."""

    def __init__(self):
        self.trailing = ()

    def set_trailing_metadata(self, metadata):
        self.trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)


def servicer_answers(servicer):
    """answer(request) for a ChannelDouble: ``servicer.Step``'s response, or
    its abort as the daemon writes a failed step (the RpcStatus it would
    send as the gRPC status's details, else code and message alone)."""
    def answer(request):
        context = _StepContext()
        try:
            return STEP_RESPONSE, servicer.Step(request, context).SerializeToString()
        except _Aborted as aborted:
            code, message = aborted.args
        details = dict(context.trailing).get(DETAILS_KEY)
        status = details or error_details_pb2.RpcStatus(
            code=code.value[0], message=message).SerializeToString()
        return RPC_STATUS, status
    return answer
