"""The Python client against the real daemon binary (host mode, one rank, with
its coordinator): ExportState / ImportState round trips and TCP with a token.

* export_state after two steps equals the state torch.optim.Muon and
  torch.optim.AdamW hold after the same two steps (momentum_buffer, exp_avg,
  exp_avg_sq); an AdamW param of 1.1M values makes each of its entries larger
  than gRPC's default 4 MiB message.
* Importing that state after a third step and replaying the third step gives
  the params the first third step gave, bitwise (a resume through the RPCs);
  export after import returns the imported bytes and step id.
* A refused import (a missing entry) raises MuondError INVALID_ARGUMENT naming
  the entry and changes nothing; a staged import changes nothing until
  commit_state, and abort_state drops it.
* A daemon on TCP started with --token_file answers a Client (and a
  muond.torch.Muon) given the token_file, and refuses a wrong or missing token
  with UNAUTHENTICATED.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

import grpc
import numpy as np
import torch

from muond.client import Client, MuondError, read_token_file
from muond.torch import Muon

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract"))
from cluster import find_binaries  # noqa: E402  (runfiles, bazel-bin or $MUOND_BIN_DIR)

LR, WD, MOMENTUM = 0.02, 0.01, 0.95
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
BIG = 1_100_000  # fp32 values: 4.4 MB per AdamW moment, over gRPC's 4 MiB


def values(seed, shape):
    return torch.from_numpy(np.random.default_rng(seed).uniform(-1, 1, size=shape)
                            .astype(np.float32))


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonTest(unittest.TestCase):
    """A coordinator and one host-mode daemon; `listen` and extra flags per test."""

    def start(self, listen, *flags):
        coordinator_bin, daemon_bin = find_binaries(self)
        self.tmp = tempfile.mkdtemp(prefix="muond-staterpc-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.job = f"staterpc{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.procs = []
        port_file = os.path.join(self.tmp, "port")
        self.spawn("coordinator", [coordinator_bin, "--listen=127.0.0.1:0",
                                   f"--port_file={port_file}"])
        wait_for(lambda: os.path.exists(port_file) and os.path.getsize(port_file), 20,
                 "the coordinator's port file")
        with open(port_file) as f:
            coordinator = f"127.0.0.1:{int(f.read())}"
        self.spawn("muond", [daemon_bin, "--host", f"--coordinator={coordinator}",
                             f"--job_id={self.job}", "--rank=0", "--world_size=1",
                             f"--listen={listen}", "--comm_timeout_s=20", *flags])

    def spawn(self, name, argv):
        log = open(os.path.join(self.tmp, f"{name}.log"), "w")
        self.addCleanup(log.close)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, proc))
        self.addCleanup(self.stop, name, proc)

    def stop(self, name, proc):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        result = getattr(self._outcome, "result", None)
        if any(t is self for t, _ in getattr(result, "errors", []) +
               getattr(result, "failures", [])):
            with open(os.path.join(self.tmp, f"{name}.log")) as f:
                sys.stderr.write(f"---- {name} ----\n{f.read()[-3000:]}\n")


class StateRoundTripTest(DaemonTest):
    def setUp(self):
        self.address = f"unix://{tempfile.mkdtemp(prefix='muond-sock-')}/d.sock"
        self.addCleanup(shutil.rmtree, self.address[len("unix://"):-len("/d.sock")],
                        ignore_errors=True)
        self.start(self.address)

    def make(self):
        w = torch.nn.Parameter(values(1, (32, 24)))
        b = torch.nn.Parameter(values(2, (BIG,)))
        return w, b

    def grads(self, step):
        return values(100 + step, (32, 24)), values(200 + step, (BIG,))

    def step(self, opt, params, step):
        for p, g in zip(params, self.grads(step)):
            p.grad = g.clone()
        opt.step()

    def test_export_matches_torch_and_import_resumes_bitwise(self):
        w, b = self.make()
        opt = Muon([{"params": [w], "name": "dense", "param_names": ["w"]},
                    {"params": [b], "name": "adam", "param_names": ["b"],
                     "algorithm": "adamw", **ADAMW}],
                   lr=LR, weight_decay=WD, momentum=MOMENTUM, daemons=[self.address],
                   job_id=self.job, rpc_timeout=60)
        self.addCleanup(opt.close)
        ref_w, ref_b = self.make()
        ref_muon = torch.optim.Muon([ref_w], lr=LR, weight_decay=WD, momentum=MOMENTUM)
        ref_adamw = torch.optim.AdamW([ref_b], **ADAMW)
        client = opt.clients[0]
        for s in (1, 2):
            self.step(opt, (w, b), s)
            self.step_ref((ref_w, ref_b), (ref_muon, ref_adamw), s)
        step_id, state = client.export_state(self.job, opt.client_id)
        self.assertEqual(step_id, 2)
        expected = {"w.momentum": ref_muon.state[ref_w]["momentum_buffer"],
                    "b.exp_avg": ref_adamw.state[ref_b]["exp_avg"],
                    "b.exp_avg_sq": ref_adamw.state[ref_b]["exp_avg_sq"]}
        for name, ref in expected.items():
            self.assertEqual(state[name].dtype, torch.float32)
            torch.testing.assert_close(state[name], ref.reshape(-1), rtol=1e-6, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")

        # Step 3, then import the step-2 state and replay step 3: bitwise.
        saved = [p.detach().clone() for p in (w, b)]
        self.step(opt, (w, b), 3)
        after_three = [p.detach().clone() for p in (w, b)]
        resp = client.import_state(self.job, opt.client_id, step_id, state,
                                   max_chunk_bytes=3 << 20)
        self.assertEqual(resp.num_entries, len(state))
        again_id, again = client.export_state(self.job, opt.client_id, max_chunk_bytes=1 << 22)
        self.assertEqual(again_id, 2)
        for name in state:
            self.assertTrue(torch.equal(again[name], state[name]), name)
        with torch.no_grad():
            for p, s in zip((w, b), saved):
                p.copy_(s)
        opt.step_id = 2
        self.step(opt, (w, b), 3)
        for p, ref in zip((w, b), after_three):
            self.assertTrue(torch.equal(p.detach(), ref))

    def step_ref(self, params, opts, step):
        for p, g in zip(params, self.grads(step)):
            p.grad = g.clone()
        for o in opts:
            o.step()

    def test_refused_and_staged_imports_change_nothing_until_commit(self):
        w, b = self.make()
        opt = Muon([{"params": [w], "name": "dense", "param_names": ["w"]},
                    {"params": [b], "name": "adam", "param_names": ["b"],
                     "algorithm": "adamw", **ADAMW}],
                   lr=LR, daemons=[self.address], job_id=self.job, rpc_timeout=60)
        self.addCleanup(opt.close)
        self.step(opt, (w, b), 1)
        client = opt.clients[0]
        step_id, before = client.export_state(self.job, opt.client_id)
        other = {k: v + 1 if not k.endswith(".step") else v for k, v in before.items()}

        missing = dict(other)
        del missing["b.exp_avg"]
        with self.assertRaises(MuondError) as e:
            client.import_state(self.job, opt.client_id, 7, missing)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("entry 'b.exp_avg': missing", str(e.exception))
        self.assert_state(client, opt, step_id, before)

        client.import_state(self.job, opt.client_id, 7, other, transaction_id="t1")
        self.assert_state(client, opt, step_id, before)
        client.abort_state(self.job, opt.client_id, "t1")
        with self.assertRaises(MuondError) as e:
            client.commit_state(self.job, opt.client_id, "t1")
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assert_state(client, opt, step_id, before)

        client.import_state(self.job, opt.client_id, 7, other, transaction_id="t2")
        self.assertEqual(client.commit_state(self.job, opt.client_id, "t2").step_id, 7)
        self.assert_state(client, opt, 7, other)

    def assert_state(self, client, opt, step_id, state):
        got_id, got = client.export_state(self.job, opt.client_id)
        self.assertEqual(got_id, step_id)
        self.assertEqual(sorted(got), sorted(state))
        for name in state:
            self.assertTrue(torch.equal(got[name], state[name]), name)


class TokenTest(DaemonTest):
    def setUp(self):
        self.token_dir = tempfile.mkdtemp(prefix="muond-token-")
        self.addCleanup(shutil.rmtree, self.token_dir, ignore_errors=True)
        self.token_file = os.path.join(self.token_dir, "token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"tok-{uuid.uuid4().hex}\n".encode())
        os.close(fd)
        self.address = f"127.0.0.1:{free_port()}"
        self.start(self.address, f"--token_file={self.token_file}")

    def test_token_file_reaches_a_tcp_daemon_and_wrong_tokens_are_refused(self):
        with Client(self.address, timeout=10, token_file=self.token_file) as good:
            good.wait_healthy(20)
        for kwargs in ({"token": "wrong"}, {}):
            with Client(self.address, timeout=10, **kwargs) as bad:
                with self.assertRaises(grpc.RpcError) as e:
                    bad.health()
                self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED, kwargs)
                with self.assertRaises(MuondError) as m:
                    bad.export_state(self.job, "x")
                self.assertEqual(m.exception.code, grpc.StatusCode.UNAUTHENTICATED)

        # muond.torch.Muon passes the token on: a step over TCP.
        w = torch.nn.Parameter(values(1, (8, 6)))
        opt = Muon([w], lr=LR, daemons=[self.address], job_id=self.job,
                   token_file=self.token_file, rpc_timeout=30)
        self.addCleanup(opt.close)
        before = w.detach().clone()
        w.grad = values(2, (8, 6))
        opt.step()
        self.assertFalse(torch.equal(w.detach(), before))

    def test_token_file_rules(self):
        self.assertTrue(read_token_file(self.token_file).startswith("tok-"))
        os.chmod(self.token_file, 0o644)
        with self.assertRaisesRegex(ValueError, "readable or writable by other users"):
            Client(self.address, token_file=self.token_file)
        os.chmod(self.token_file, 0o600)
        with self.assertRaisesRegex(ValueError, "not a regular file"):
            Client(self.address, token_file=self.token_dir)
        with self.assertRaisesRegex(ValueError, "not both"):
            Client(self.address, token="a", token_file=self.token_file)


if __name__ == "__main__":
    unittest.main()
