"""The standard grpc.health.v1 service and server reflection on real servers
(a muond-coordinator + host-mode `muond-daemon`s, cluster.py), read with the
stock grpcio-health-checking and grpcio-reflection clients.

* The coordinator is SERVING once it listens.
* A daemon is SERVING only while it has an engine built from a plan: not
  before a trainer registered, yes once its plan arrived, not after the
  trainer closed; a Watch stream carries each transition.
* Health and reflection need no token (a TCP daemon with a token answers
  them without one) while muond's own RPCs still refuse a call without it.
* Reflection lists muond's service, grpc.health.v1.Health and resolves a
  muond message to the descriptor the generated Python code has.
* SIGTERM: a Watch stream hears NOT_SERVING before the server goes away.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import unittest

import grpc
import torch
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

_REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                     "..", "..", ".."))
sys.path.insert(0, os.path.join(_REPO, "tests", "client", "python", "contract"))
from cluster import Cluster, find_binaries  # noqa: E402
from muond.client import Client  # noqa: E402
from muond.torch import Muon  # noqa: E402
from muond.v1 import muond_pb2  # noqa: E402

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
OPTIMIZER = "muond.v1.Optimizer"
COORDINATOR = "muond.v1.Coordinator"
# A bound for a hang, not a timed assertion: each transition comes from one
# registration, plan or unregistration.
WAIT_S = 60


def name(status) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


class Watch:
    """A grpc.health.v1 Watch stream of `address`/`service` read on a thread:
    `wait_for(status)` returns once the stream said it; `statuses` is every
    status received, consecutive repeats collapsed; `ended` is set when the
    stream ends (the server went away)."""

    def __init__(self, address: str, service: str):
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=service))
        self._queue: queue.Queue = queue.Queue()
        self.statuses: list[int] = []
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for response in self._call:
                self._queue.put(response.status)
        except grpc.RpcError:
            pass  # cancelled by close(), or the server went away
        finally:
            self.ended.set()
            self._queue.put(None)

    def _take(self, timeout):
        status = self._queue.get(timeout=timeout)
        if status is not None and (not self.statuses or self.statuses[-1] != status):
            self.statuses.append(status)
        return status

    def wait_for(self, status: int):
        while True:
            got = self._take(WAIT_S)
            if got is None:
                raise AssertionError(f"the Watch stream ended before {name(status)}; "
                                     f"saw {[name(s) for s in self.statuses]}")
            if got == status:
                return

    def wait_end(self):
        while self._take(WAIT_S) is not None:
            pass

    def close(self):
        self._call.cancel()
        self._channel.close()
        self._thread.join(WAIT_S)


def tiny_muon(cluster: Cluster, **kw) -> tuple[Muon, torch.nn.Parameter]:
    """muond.torch.Muon over every daemon of `cluster` (split mode, 1 x N) for
    one 16x8 matrix; the constructor returns once the plan arrived."""
    w = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
    kw = {"rpc_timeout": 30, "wait_healthy_timeout": 30, **kw}
    opt = Muon([{"params": [w], "name": "dense", "param_names": ["w"]}], lr=0.02,
               daemons=cluster.daemons, job_id=cluster.job_id, gtp_size=1,
               tp_size=len(cluster.daemons), **kw)
    return opt, w


def step(opt: Muon, w: torch.nn.Parameter, seed: int):
    w.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
    opt.step()


class HealthTest(unittest.TestCase):
    def setUp(self):
        find_binaries(self)

    def cluster(self, *args, **kw) -> Cluster:
        cluster = Cluster(*args, **kw).start()
        self.addCleanup(lambda: cluster.stop(print_logs=self._outcome.success is False))
        return cluster

    def test_coordinator_serves_and_daemons_follow_their_engine(self):
        cluster = self.cluster(2)
        for service in ("", COORDINATOR):
            self.assertEqual(name(check(cluster.coordinator, service)), "SERVING", service)
        for address in cluster.daemons:
            for service in ("", OPTIMIZER):
                self.assertEqual(name(check(address, service)), "NOT_SERVING",
                                 f"{address} {service!r} before registration")
            with self.assertRaises(grpc.RpcError) as caught:
                check(address, "no.such.Service")
            self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        watches = [Watch(a, OPTIMIZER) for a in cluster.daemons]
        try:
            for w in watches:
                w.wait_for(NOT_SERVING)  # a Watch starts with the current status
            opt, w = tiny_muon(cluster)
            try:
                for watch in watches:
                    watch.wait_for(SERVING)
                for address in cluster.daemons:
                    self.assertEqual(name(check(address)), "SERVING", address)
                    self.assertEqual(name(check(address, OPTIMIZER)), "SERVING", address)
                before = w.detach().clone()
                step(opt, w, 7)  # the engine steps while SERVING
                self.assertFalse(torch.equal(before, w.detach()))
            finally:
                opt.close()  # unregisters on every daemon: the engines go
            for watch in watches:
                watch.wait_for(NOT_SERVING)
                self.assertEqual([name(s) for s in watch.statuses],
                                 ["NOT_SERVING", "SERVING", "NOT_SERVING"])
            for address in cluster.daemons:
                self.assertEqual(name(check(address)), "NOT_SERVING", address)
            # A second trainer makes them ready again.
            opt, _ = tiny_muon(cluster)
            try:
                for watch in watches:
                    watch.wait_for(SERVING)
            finally:
                opt.close()
        finally:
            for watch in watches:
                watch.close()

    def test_health_and_reflection_need_no_token_on_tcp(self):
        cluster = self.cluster(1, tcp=True)
        address = cluster.daemons[0]
        self.assertEqual(name(check(address, OPTIMIZER)), "NOT_SERVING")
        with Client(address, timeout=10) as no_token:  # muond's own RPCs refuse it
            with self.assertRaises(grpc.RpcError) as caught:
                no_token.health()
            self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        with Client(address, timeout=10, token=cluster.token) as with_token:
            self.assertTrue(with_token.health().serving)
        with grpc.insecure_channel(address) as channel:
            self.assertIn(OPTIMIZER, ProtoReflectionDescriptorDatabase(channel).get_services())
        # The coordinator has the token too (cluster.py gives it the file).
        self.assertEqual(name(check(cluster.coordinator)), "SERVING")

    def test_reflection_lists_services_and_resolves_messages(self):
        cluster = self.cluster(1)
        for address, service in ((cluster.daemons[0], OPTIMIZER),
                                 (cluster.coordinator, COORDINATOR)):
            with grpc.insecure_channel(address) as channel:
                db = ProtoReflectionDescriptorDatabase(channel)
                services = db.get_services()
                self.assertIn(service, services, address)
                self.assertIn("grpc.health.v1.Health", services, address)
                pool = descriptor_pool.DescriptorPool(db)
                for message in (muond_pb2.StepRequest, muond_pb2.RegisterParamsRequest,
                                muond_pb2.Plan):
                    full_name = message.DESCRIPTOR.full_name
                    got = pool.FindMessageTypeByName(full_name)
                    self.assertEqual(
                        [(f.name, f.number, f.type) for f in got.fields],
                        [(f.name, f.number, f.type) for f in message.DESCRIPTOR.fields],
                        f"{address}: {full_name}")
                methods = [m.name for m in pool.FindServiceByName(service).methods]
                generated = muond_pb2.DESCRIPTOR.services_by_name[service.split(".")[-1]]
                self.assertEqual(methods, [m.name for m in generated.methods])

    def test_sigterm_says_not_serving_before_the_server_goes(self):
        cluster = self.cluster(1)
        opt, _ = tiny_muon(cluster, rpc_timeout=5)
        try:
            daemon = Watch(cluster.daemons[0], OPTIMIZER)
            daemon.wait_for(SERVING)
            cluster.process("muond-rank0").terminate()
            daemon.wait_end()
            # (NOT_SERVING may come first: the Watch can start before the
            # daemon's readiness thread reported the engine.)
            self.assertEqual([name(s) for s in daemon.statuses][-2:], ["SERVING", "NOT_SERVING"])
            daemon.close()
        finally:
            try:
                opt.close()
            except Exception:  # noqa: BLE001  (its daemon is gone: nothing to unregister)
                pass
        coordinator = Watch(cluster.coordinator, COORDINATOR)
        coordinator.wait_for(SERVING)
        cluster.process("coordinator").terminate()
        coordinator.wait_end()
        self.assertEqual([name(s) for s in coordinator.statuses], ["SERVING", "NOT_SERVING"])
        coordinator.close()
        self.assertEqual(cluster.process("coordinator").wait(WAIT_S), 0)
        self.assertEqual(cluster.process("muond-rank0").wait(WAIT_S), 0)


if __name__ == "__main__":
    unittest.main()
