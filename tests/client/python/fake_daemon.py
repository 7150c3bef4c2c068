"""An in-process fake of the muond Optimizer service, for client tests.

Each FakeDaemon serves one Unix socket. It maps the MEMORY_KIND_HOST_SHM regions it is
given with numpy (each region once, checking it against the object's size and
each view against its region, as the real daemon must), and on Step applies a reference Muon/AdamW step *following the wire
contract only*: momentum on its local shard; then, for a G x T domain, every
daemon publishes its shard of the NS input, the shards of each param are
assembled as docs/ARCHITECTURE.md "Sharding" says (stage 1: concatenate the G shards of a TP
column along dim 0 and strip pad_length rows; stage 2: concatenate the T
TP-local blocks along partition_dim), Newton–Schulz runs on the full matrix
(reference_muon.newton_schulz of examples/char_gpt), and each daemon takes
back its own shard of the update (padding rows restored as zeros).
"""
from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import threading
import unittest
from concurrent import futures

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
for p in (os.path.join(REPO, "client", "python"), os.path.join(REPO, "examples", "char_gpt")):
    if p not in sys.path:
        sys.path.insert(0, p)

import reference_muon as ref  # noqa: E402
from muond import wire_enums  # noqa: E402
from muond.v1 import muond_pb2 as pb  # noqa: E402
from muond.v1 import muond_pb2_grpc as pb_grpc  # noqa: E402


class _Mapping:
    def __init__(self, region: pb.MemoryRegion):
        if region.kind != pb.MEMORY_KIND_HOST_SHM:
            raise ValueError(f"region {region.name!r}: kind must be MEMORY_KIND_HOST_SHM")
        fd = os.open("/dev/shm" + region.shm_name, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < region.byte_size or region.byte_size == 0:
                raise ValueError(f"region {region.name!r}: byte_size {region.byte_size} is 0 "
                                 "or past its shm object")
            self.size = region.byte_size
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)


def map_regions(request: pb.RegisterParamsRequest) -> dict:
    """Region name -> _Mapping, each declared region mapped once."""
    mappings = {}
    for region in request.regions:
        if not region.name or region.name in mappings:
            raise ValueError(f"region {region.name!r}: empty or declared twice")
        mappings[region.name] = _Mapping(region)
    return mappings


def map_ref(ref_: pb.TensorRef, mappings: dict, what: str) -> np.ndarray:
    if ref_.dtype != pb.DTYPE_FP32:
        raise ValueError(f"{what}: dtype must be FP32 in this fake")
    if ref_.region not in mappings:
        raise ValueError(f"{what}: region {ref_.region!r} is not declared")
    m = mappings[ref_.region]
    shape, strides = list(ref_.shape), list(ref_.strides)
    if len(shape) != len(strides) or len(shape) not in (1, 2) or strides[-1] != 1:
        raise ValueError(f"{what}: bad shape/strides {shape}/{strides}")
    last = ref_.byte_offset + 4 * (1 + sum((n - 1) * s for n, s in zip(shape, strides)))
    if last > m.size:
        raise ValueError(f"{what}: view ends at byte {last}, past region {ref_.region!r} "
                         f"of {m.size}")
    return np.ndarray(shape, np.float32, buffer=m.mm, offset=ref_.byte_offset,
                      strides=[4 * s for s in strides])


class FakeCluster:
    """Shared between the fake daemons of one test: the exchange board."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.board: dict = {}
        self.lock = threading.Lock()
        self.daemons: list[FakeDaemon] = []


class FakeDaemon(pb_grpc.OptimizerServicer):
    def __init__(self, cluster: FakeCluster, rank: int, address: str):
        self.cluster, self.rank, self.address = cluster, rank, address
        self.groups: list[tuple[pb.ParamGroup, list]] = []
        self.mappings: dict = {}
        self.state: dict = {}
        self.last_step = 0
        self.requests: list = []
        self.step_requests: list = []  # every StepRequest received, in order
        # Test hooks: Health's engine_error (with has_plan false when set),
        # and a Step handler that replaces the fake step.
        self.engine_error = ""
        self.plan_ready = True  # false: serving, no plan yet (a rank never registered)
        self.on_step = None
        self.refuse_import = ""  # set: ImportState refuses after checking (a test hook)
        # set: RegisterParams refuses when refuse_register(request) returns a reason
        self.refuse_register = None
        self.staged: dict = {}
        self.imports = self.aborts = 0
        cluster.daemons.append(self)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_OptimizerServicer_to_server(self, self.server)
        self.server.add_insecure_port(address)
        self.server.start()

    def stop(self):
        self.server.stop(None)

    def Health(self, request, context):
        return pb.HealthResponse(serving=True,
                                 has_plan=self.plan_ready and not self.engine_error,
                                 engine_error=self.engine_error)

    def GetStatus(self, request, context):
        return pb.GetStatusResponse(rank=self.rank, world_size=self.cluster.world, device="cpu",
                                    last_step_id=self.last_step,
                                    num_params=sum(len(g.params) for g, _ in self.groups))

    def UnregisterParams(self, request, context):
        self.groups = []
        self.state = {}
        return pb.UnregisterParamsResponse()

    def RegisterParams(self, request, context):
        self.requests.append(request)
        reason = self.refuse_register(request) if self.refuse_register else ""
        if reason:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        try:
            self.mappings = map_regions(request)
            for group in request.groups:
                views = [(map_ref(p.param, self.mappings, f"{p.name}.param"),
                          map_ref(p.grad, self.mappings, f"{p.name}.grad")) for p in group.params]
                self.groups.append((group, views))
        except (ValueError, OSError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.RegisterParamsResponse(num_params=sum(len(g.params) for g in request.groups))

    def Step(self, request, context):
        self.step_requests.append(request)
        if request.trainer_refusal:  # the real daemon's job vote refuses it on every rank
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {request.step_id}: the trainer refused it before sending it "
                          f"({request.trainer_refusal[:128]}); no rank applies it")
        if self.on_step is not None:
            return self.on_step(request, context)
        # Per-step hyperparameters (GroupOverride): unset fields keep the
        # registered value. skip_params: torch.optim's grad-None rule (no
        # momentum/moment update, no weight decay, no step count).
        over = {o.group: o for o in request.overrides}
        skip = set(request.skip_params)
        step = request.step_id
        known = {g.name for g, _ in self.groups}
        for o in request.overrides:
            if o.group not in known:
                context.abort(grpc.StatusCode.NOT_FOUND, f"override for unknown group {o.group}")
        held = {p.name for g, _ in self.groups for p in g.params}
        for name in skip - held:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"skip_params: unknown param {name}")

        def live(group, field, registered):
            o = over.get(group.name)
            return getattr(o, field) if o is not None and o.HasField(field) else registered

        local = []
        for group, views in self.groups:
            if group.algorithm == pb.ALGORITHM_ADAMW:
                continue
            h = group.muon
            momentum = live(group, "momentum", h.momentum)
            nesterov = live(group, "nesterov", h.nesterov)
            for p, (pv, gv) in zip(group.params, views):
                if p.name in skip:
                    continue
                grad = torch.from_numpy(gv.copy())
                buf = self.state.setdefault(p.name, torch.zeros_like(grad))
                buf.lerp_(grad, 1 - momentum)
                x = grad.lerp(buf, momentum) if nesterov else buf.clone()
                d = group.domain
                with self.cluster.lock:
                    self.cluster.board[(step, d.name, p.name, d.g, d.t)] = x
                local.append((group, p, pv))
        self.cluster.barrier.wait()
        for group, p, pv in local:
            h, d = group.muon, group.domain
            full = assemble(self.cluster.board, step, d, p)
            # The daemon's defaults for unset fields (proto_convert, core/muon).
            coefficient_type = wire_enums.from_wire(pb.CoefficientType, h.coefficient_type,
                                                    "quintic")
            orth = ref.newton_schulz(full, h.num_ns_steps if h.HasField("num_ns_steps") else 5,
                                     coefficient_type, h.eps if h.HasField("eps") else 1e-15,
                                     list(h.custom_coefficients))
            rows, cols = p.full_shape
            scale_mode = wire_enums.from_wire(pb.ScaleMode, h.scale_mode, "spectral")
            update = orth * ref.scale_factor(rows, cols, scale_mode) * (
                h.extra_scale_factor if h.HasField("extra_scale_factor") else 1.0)
            mine = shard_of(update, d, p)
            ref.apply_muon(torch.from_numpy(pv), mine, live(group, "lr", h.lr),
                           live(group, "weight_decay", h.weight_decay))
        for group, views in self.groups:
            if group.algorithm != pb.ALGORITHM_ADAMW:
                continue
            h = group.adamw
            for p, (pv, gv) in zip(group.params, views):
                if p.name in skip:
                    continue
                st = self.state.setdefault(p.name, {"step": 0, "m": torch.zeros(gv.shape),
                                                    "v": torch.zeros(gv.shape)})
                st["step"] += 1
                ref.adamw_step(torch.from_numpy(pv), torch.from_numpy(gv.copy()), st["m"],
                               st["v"], st["step"], lr=live(group, "lr", h.lr),
                               beta1=live(group, "beta1", h.beta1),
                               beta2=live(group, "beta2", h.beta2), eps=live(group, "eps", h.eps),
                               weight_decay=live(group, "weight_decay", h.weight_decay))
        self.cluster.barrier.wait()
        self.last_step = step
        return pb.StepResponse(step_id=step, timings=pb.StepTimings(
            ns_us=10.0 * (self.rank + 1), total_us=100.0 * (self.rank + 1)))


    # -- state streaming (the real daemon's ExportState / ImportState contract) --
    def _expected_entries(self) -> dict:
        """entry name -> numel, for every registered param of this daemon."""
        out = {}
        for group, views in self.groups:
            for p, (pv, _) in zip(group.params, views):
                if group.algorithm == pb.ALGORITHM_ADAMW:
                    out.update({f"{p.name}.exp_avg": pv.size, f"{p.name}.exp_avg_sq": pv.size,
                                f"{p.name}.step": 1})
                else:
                    out[f"{p.name}.momentum"] = pv.size
        return out

    def _entries(self) -> dict:
        out = {}
        for group, views in self.groups:
            for p, (pv, _) in zip(group.params, views):
                if group.algorithm == pb.ALGORITHM_ADAMW:
                    st = self.state.get(p.name, {"step": 0, "m": torch.zeros(pv.shape),
                                                 "v": torch.zeros(pv.shape)})
                    out[f"{p.name}.exp_avg"] = st["m"].reshape(-1)
                    out[f"{p.name}.exp_avg_sq"] = st["v"].reshape(-1)
                    out[f"{p.name}.step"] = torch.tensor([float(st["step"])])
                else:
                    out[f"{p.name}.momentum"] = self.state.get(
                        p.name, torch.zeros(pv.shape)).reshape(-1)
        return out

    def ExportState(self, request, context):
        entries = self._entries()
        yield pb.StateChunk(header=pb.StateHeader(step_id=self.last_step,
                                                  num_entries=len(entries)))
        for name, value in entries.items():
            yield pb.StateChunk(entry=name, numel=value.numel(), offset=0,
                                data=value.to(torch.float32).numpy().astype("<f4").tobytes())

    def ImportState(self, request_iterator, context):
        header, got = None, {}
        for chunk in request_iterator:
            if header is None:
                header = chunk.header
                continue
            buf = got.setdefault(chunk.entry, np.zeros(chunk.numel, np.float32))
            values = np.frombuffer(chunk.data, "<f4")
            buf[chunk.offset:chunk.offset + values.size] = values
        expected = self._expected_entries()
        for name, numel in expected.items():
            if name not in got or got[name].size != numel:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"entry {name}: missing or "
                              f"not {numel} values")
        unknown = sorted(set(got) - set(expected))
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown entries {unknown}")
        if self.refuse_import:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse_import)
        staged = (header.step_id, got)
        if header.transaction_id:
            self.staged[header.transaction_id] = staged
        else:
            self._apply(staged)
        return pb.ImportStateResponse(step_id=header.step_id, num_entries=len(got))

    def _apply(self, staged):
        step_id, got = staged
        for group, views in self.groups:
            for p, (pv, _) in zip(group.params, views):
                if group.algorithm == pb.ALGORITHM_ADAMW:
                    self.state[p.name] = {
                        "step": int(got[f"{p.name}.step"][0]),
                        "m": torch.from_numpy(got[f"{p.name}.exp_avg"].copy()).view(pv.shape),
                        "v": torch.from_numpy(got[f"{p.name}.exp_avg_sq"].copy()).view(pv.shape)}
                else:
                    self.state[p.name] = torch.from_numpy(
                        got[f"{p.name}.momentum"].copy()).view(pv.shape)
        self.last_step = step_id
        self.imports += 1

    def LoadState(self, request, context):
        if request.phase == pb.STATE_PHASE_COMMIT:
            if request.transaction_id not in self.staged:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nothing staged")
            self._apply(self.staged.pop(request.transaction_id))
        elif request.phase == pb.STATE_PHASE_ABORT:
            self.staged.pop(request.transaction_id, None)
            self.aborts += 1
        else:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake: only COMMIT/ABORT")
        return pb.LoadStateResponse(step_id=self.last_step)


def assemble(board, step, d: pb.Domain, p: pb.Param) -> torch.Tensor:
    G, T = max(d.gtp_size, 1), max(d.tp_size, 1)
    tags = p.tags
    gtp = tags.is_gtp_weight_remat and G > 1
    tp = tags.tensor_model_parallel and T > 1
    if not gtp and not tp:
        return board[(step, d.name, p.name, d.g, d.t)]
    blocks = []
    for t in (range(T) if tp else [d.t]):
        col = [board[(step, d.name, p.name, g, t)] for g in (range(G) if gtp else [d.g])]
        local = torch.cat(col, 0)
        if gtp and tags.pad_length:
            local = local[:local.shape[0] - tags.pad_length]
        blocks.append(local)
    return torch.cat(blocks, tags.partition_dim) if tp else blocks[0]


def shard_of(full: torch.Tensor, d: pb.Domain, p: pb.Param) -> torch.Tensor:
    G, T = max(d.gtp_size, 1), max(d.tp_size, 1)
    tags = p.tags
    x = full
    if tags.tensor_model_parallel and T > 1:
        x = torch.chunk(x, T, tags.partition_dim)[d.t]
    if tags.is_gtp_weight_remat and G > 1:
        x = torch.cat([x, torch.zeros(tags.pad_length, x.shape[1])], 0)
        # Uneven row blocks (FSDP2's torch.chunk, empty ones included) when given.
        x = (torch.split(x, list(tags.gtp_rows), 0) if tags.gtp_rows
             else torch.chunk(x, G, 0))[d.g]
    return x


def start_cluster(directory: str, world: int):
    cluster = FakeCluster(world)
    addresses = [f"unix://{directory}/fake-{r}.sock" for r in range(world)]
    for r, a in enumerate(addresses):
        FakeDaemon(cluster, r, a)
    return cluster, addresses


class FakeClusterTestCase(unittest.TestCase):
    """A test case with `world` fake daemons for each test (self.cluster,
    self.addresses), stopped and their socket directory removed after it."""
    world = 1

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="muond-test-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.cluster, self.addresses = start_cluster(self.dir, self.world)
        self.addCleanup(lambda: [d.stop() for d in self.cluster.daemons])

    def build(self, params, **kw):
        """A muond.torch.Muon on this test's fake daemons (job "fake"),
        closed after the test."""
        from muond.torch import Muon  # noqa: PLC0415 (tests without torch import this module)
        opt = Muon(params, daemons=self.addresses, job_id="fake", **kw)
        self.addCleanup(opt.close)
        return opt
