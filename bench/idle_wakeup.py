#!/usr/bin/env python3
"""Round-trip latency after an idle gap: why a step goes through a step
channel rather than a gRPC call. A trainer's step is one request/answer after
the trainer (forward, backward) and the daemon (waiting) both idled; this
times one such round trip between two processes after gaps of 0-80 ms, by:

    grpc   a Health RPC to a host-mode muond-daemon (a handler that does nothing)
    pipe   one byte each way through two pipes (a blocking read wakes)
    futex  a word each way in shared memory, FUTEX_WAIT / FUTEX_WAKE (the step
           channel's wake-up)
    spin   a word each way in shared memory, both sides polling (no sleep at
           all: the floor of a memory round trip)

p50 / p90 µs per gap; each method's partner is a separate process.

    bazel build //server/daemon:muond-daemon //server/coordinator:muond-coordinator
    .venv/bin/python bench/idle_wakeup.py --bin bazel-bin --rounds 60
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import platform
import struct
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The checkout's client where its stubs are generated there (a GPU host's copy
# of them from the bundle); else the muond package deploy/setup.sh installed.
if os.path.exists(os.path.join(ROOT, "client", "python", "muond", "v1", "muond_pb2.py")):
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

GAPS_S = (0.0, 0.001, 0.01, 0.03, 0.08)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}[platform.machine()]
_libc = ctypes.CDLL(None, use_errno=True)


def futex(address: int, op: int, value: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), op, value, None, None, 0)


def pct(values, q):
    v = sorted(values)
    return v[int(q * (len(v) - 1))]


def timed(name, call, rounds):
    for gap in GAPS_S:
        out = []
        for _ in range(rounds):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            call()
            out.append((time.perf_counter() - t0) * 1e6)
        print(f"| {name} | {gap * 1e3:g} | {pct(out, .5):.0f} / {pct(out, .9):.0f} |",
              flush=True)


def pipe_echo(r, w):
    while os.read(r, 1) == b"x":  # b"q": stop (the child holds the write end too)
        os.write(w, b"x")


def word_echo(path, use_futex):
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    request, answer = ctypes.c_int32.from_address(base), ctypes.c_int32.from_address(base + 64)
    seen = 0
    while True:
        while request.value == seen:
            if use_futex:
                futex(base, 0, seen)
        seen = request.value
        if seen < 0:
            return
        answer.value = seen
        if use_futex:
            futex(base + 64, 1, 1)


def word_pair(use_futex, rounds):
    fd, path = tempfile.mkstemp(prefix="idle_wakeup_", dir="/dev/shm")
    with os.fdopen(fd, "w+b") as f:
        f.truncate(4096)
        m = mmap.mmap(f.fileno(), 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    request, answer = ctypes.c_int32.from_address(base), ctypes.c_int32.from_address(base + 64)
    partner = mp.Process(target=word_echo, args=(path, use_futex))
    partner.start()
    seq = [0]

    def call():
        seq[0] += 1
        request.value = seq[0]
        if use_futex:
            futex(base, 1, 1)
        while answer.value != seq[0]:
            if use_futex:
                futex(base + 64, 0, answer.value)
    try:
        timed("futex" if use_futex else "spin", call, rounds)
    finally:
        request.value = -1
        futex(base, 1, 1)
        partner.join()
        os.unlink(path)


def grpc_health(bin_dir, rounds):
    os.environ["MUOND_BIN"] = bin_dir
    import grpc
    from daemon_harness import Daemon
    from muond.v1 import muond_pb2 as pb, muond_pb2_grpc as pb_grpc
    with Daemon(f"idlewake{os.getpid()}", host=True) as d:
        stub = pb_grpc.OptimizerStub(grpc.insecure_channel(d.address))
        for _ in range(100):
            try:
                stub.Health(pb.HealthRequest())
                break
            except grpc.RpcError:
                time.sleep(0.2)
        timed("grpc", lambda: stub.Health(pb.HealthRequest()), rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("MUOND_BIN", os.path.join(ROOT, "bazel-bin")))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--methods", default="grpc,pipe,futex,spin")
    a = ap.parse_args()
    methods = a.methods.split(",")
    print("| method | idle gap ms | round trip p50 / p90 µs |\n|---|---|---|")
    if "pipe" in methods:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        partner = mp.Process(target=pipe_echo, args=(r1, w2))
        partner.start()
        timed("pipe", lambda: (os.write(w1, b"x"), os.read(r2, 1)), a.rounds)
        os.write(w1, b"q")
        partner.join()
    for method in ("futex", "spin"):
        if method in methods:
            word_pair(method == "futex", a.rounds)
    if "grpc" in methods:  # last: the partners above are forks, and gRPC does not fork
        grpc_health(a.bin, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
