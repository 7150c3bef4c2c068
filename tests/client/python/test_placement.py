"""muond.placement: each param's place in a D x G x T domain, from the
environment, DTensor meshes/placements (FSDP2, TP, FSDP + TP, HSDP), DDP and
Megatron tags, and the layout pre-check (no daemon).

The layouts run in 4 gloo processes (torch.multiprocessing); every derived
place is checked against torch's own DTensor: the rows/columns the place says
this rank holds, cut from ``full_tensor()``, must equal the rank's local
shard (Megatron's order: the TP block first, then the GTP row block)."""
import os
import pickle
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from muond import placement as P  # noqa: E402

WORLD = 4


def _expected_local(full: torch.Tensor, pl: P.ParamPlace) -> torch.Tensor:
    """The block of `full` that `pl` says this rank holds (Megatron's layout)."""
    rows, cols = full.shape
    block = full
    if pl.tp_dim == 0:
        block = block[pl.t * rows // pl.T:(pl.t + 1) * rows // pl.T]
    elif pl.tp_dim == 1:
        block = block[:, pl.t * cols // pl.T:(pl.t + 1) * cols // pl.T]
    if pl.gtp_sharded:
        sizes = pl.gtp_rows or (block.shape[0] // pl.G,) * pl.G
        start = sum(sizes[:pl.g])
        block = block[start:start + sizes[pl.g]]
    return block


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _settle(requests, **kw):
    opts = P.Options(rank=dist.get_rank(), world=dist.get_world_size(), **kw)
    return P.settle(lambda: P.place_params(requests, opts), opts.rank, opts.world, _gather,
                    dp_given=kw.get("dp_size") is not None)


def _record(places, params):
    """Each place, and whether the local shard is the block it names."""
    out = {}
    for name, p in params.items():
        pl = places[name]
        ok = None
        if P.is_dtensor(p):
            full = p.full_tensor()
            ok = torch.equal(_expected_local(full, pl), p.to_local())
        out[name] = (pl, ok)
    return out


def _refusal(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank, tmp):
    with open(f"{tmp}/port") as f:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=f.read())
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(0)
    lin = torch.nn.Linear
    results = {}

    def named(model, prefix):
        return {f"{prefix}.{n}": p for n, p in model.named_parameters() if p.ndim == 2}

    def req(params, algorithm="muon"):
        return [P.Request(n, p, algorithm) for n, p in params.items()]

    # FSDP2 over 4 ranks: even (8 rows), uneven (3 rows: 1, 1, 1, 0; 7 rows: 2, 2, 2, 1).
    mesh1 = init_device_mesh("cpu", (WORLD,))
    fsdp = torch.nn.Sequential(lin(5, 8, bias=False), lin(8, 3, bias=False), lin(3, 7))
    fully_shard(fsdp, mesh=mesh1)
    params = named(fsdp, "fsdp")
    places = _settle(req(params) + [P.Request("fsdp.2.bias", fsdp[2].bias, "adamw")])
    results["fsdp"] = _record(places, params)
    results["fsdp_bias"] = places["fsdp.2.bias"]

    # HSDP: (replicate 2) x (shard 2); 38 rows -> 19, 19; 37 rows -> 19, 18.
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = torch.nn.Sequential(lin(4, 38, bias=False), lin(38, 37, bias=False))
    fully_shard(hsdp, mesh=mesh2)
    params = named(hsdp, "hsdp")
    results["hsdp"] = _record(_settle(req(params)), params)

    # TP over 4: ColwiseParallel -> tp_dim 0, RowwiseParallel -> tp_dim 1.
    mesh_tp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    tp = torch.nn.Sequential(lin(4, 8, bias=False), lin(8, 4, bias=False))
    parallelize_module(tp, mesh_tp, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    params = named(tp, "tp")
    results["tp"] = _record(_settle(req(params)), params)

    # Uneven TP (6 rows over 4) is refused, naming the param, on every rank.
    uneven = torch.nn.Sequential(lin(4, 6, bias=False))
    parallelize_module(uneven, mesh_tp, {"0": ColwiseParallel()})
    results["uneven_tp"] = _refusal(lambda: _settle(req(named(uneven, "utp"))))

    # FSDP + TP on a (dp 2, tp 2) mesh: the FSDP block cuts the TP-local rows.
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fsdp_tp = torch.nn.Sequential(lin(8, 12, bias=False), lin(12, 6, bias=False))
    parallelize_module(fsdp_tp, mesh_2d["tp"], {"0": ColwiseParallel(),
                                                "1": RowwiseParallel()})
    fully_shard(fsdp_tp, mesh=mesh_2d["dp"])
    params = named(fsdp_tp, "fsdp_tp")
    results["fsdp_tp"] = _record(_settle(req(params)), params)

    # FSDP + TP with TP of 1 rank, (dp 4, tp 1): FSDP2 writes a plain
    # (Shard(0), Shard(0)), not _StridedShard; the TP split cuts nothing.
    mesh_t1 = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    fsdp_tp1 = torch.nn.Sequential(lin(8, 12, bias=False), lin(12, 7, bias=False))
    parallelize_module(fsdp_tp1, mesh_t1["tp"], {"0": ColwiseParallel(),
                                                 "1": RowwiseParallel()})
    fully_shard(fsdp_tp1, mesh=mesh_t1["dp"])
    params = named(fsdp_tp1, "fsdp_tp1")
    results["fsdp_tp1_placements"] = [tuple(map(str, p.placements)) for p in params.values()]
    results["fsdp_tp1"] = _record(_settle(req(params)), params)

    # DDP: plain params under a process group of 4.
    ddp = {"ddp.w": torch.nn.Parameter(torch.randn(6, 4))}
    results["ddp"] = _record(_settle(req(ddp)), ddp)

    # Megatron tags, G = 2: ranks {0, 2} claim g = 0, {1, 3} g = 1 -> D = 2.
    w = torch.nn.Parameter(torch.randn(3, 4))
    w.is_gtp_weight_remat = True
    results["megatron"] = _settle(req({"meg.w": w}), gtp_size=2, g=rank % 2,
                                  given_grid=True)["meg.w"]

    # A refusal on one rank reaches every rank, with its rank and reason.
    def compute():
        if rank == 2:
            raise ValueError("param x: made up")
        return {}
    results["one_refuses"] = _refusal(lambda: P.settle(compute, rank, WORLD, _gather))

    # Different full shapes for one name: check_layout refuses on every rank.
    v = torch.nn.Parameter(torch.randn(3 if rank == 3 else 2, 4))
    v.is_gtp_weight_remat = True
    results["disagree"] = _refusal(lambda: _settle(req({"meg.v": v}), gtp_size=2, g=rank % 2,
                                                   given_grid=True))
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
    dist.destroy_process_group()


class LayoutsTest(unittest.TestCase):
    """One spawn of 4 gloo ranks for every layout (each test reads its part)."""

    @classmethod
    def setUpClass(cls):
        import socket
        cls.tmp = tempfile.mkdtemp(prefix="muond-placement-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(f"{cls.tmp}/port", "w") as f:
            f.write(str(port))
        # fork: the children share the imported torch (a spawn imports it 4 times).
        mp.start_processes(_worker, args=(cls.tmp,), nprocs=WORLD, join=True,
                           start_method="fork")
        cls.results = []
        for r in range(WORLD):
            with open(f"{cls.tmp}/rank{r}.pkl", "rb") as f:
                cls.results.append(pickle.load(f))

    def places(self, layout, name):
        out = []
        for r in range(WORLD):
            pl, ok = self.results[r][layout][name]
            self.assertTrue(ok is None or ok, f"{layout} {name} rank {r}: the local shard is "
                            f"not the block {pl} names")
            out.append(pl)
        return out

    def assert_domain(self, places, D, G, T):
        self.assertEqual({pl.domain for pl in places}.__len__(), 1)
        self.assertEqual({(pl.D, pl.G, pl.T) for pl in places}, {(D, G, T)})
        self.assertEqual(sorted(pl.coordinate for pl in places),
                         sorted((d, g, t) for d in range(D) for g in range(G)
                                for t in range(T)))

    def test_fsdp2_even_and_uneven_rows(self):
        even = self.places("fsdp", "fsdp.0.weight")
        self.assert_domain(even, 1, 4, 1)
        self.assertEqual([(pl.g, pl.gtp_sharded, pl.gtp_rows) for pl in even],
                         [(r, True, ()) for r in range(WORLD)])
        three = self.places("fsdp", "fsdp.1.weight")
        self.assertEqual([pl.gtp_rows for pl in three], [(1, 1, 1, 0)] * WORLD)
        self.assertEqual([pl.local_shape for pl in three], [(1, 8), (1, 8), (1, 8), (0, 8)])
        seven = self.places("fsdp", "fsdp.2.weight")
        self.assertEqual(seven[0].gtp_rows, (2, 2, 2, 1))
        self.assertEqual(seven[0].full_shape, (7, 3))
        bias = [self.results[r]["fsdp_bias"] for r in range(WORLD)]
        self.assertEqual([(pl.domain, pl.D, pl.G, pl.T) for pl in bias],
                         [(f"solo-r{r}", 1, 1, 1) for r in range(WORLD)])

    def test_hsdp_replicate_times_shard(self):
        even = self.places("hsdp", "hsdp.0.weight")
        self.assert_domain(even, 2, 2, 1)
        self.assertEqual([(pl.d, pl.g) for pl in even], [(0, 0), (0, 1), (1, 0), (1, 1)])
        self.assertEqual(even[0].gtp_rows, ())  # 38 over 2: 19, 19
        uneven = self.places("hsdp", "hsdp.1.weight")
        self.assertEqual([pl.gtp_rows for pl in uneven], [(19, 18)] * WORLD)

    def test_tp_colwise_rowwise(self):
        col = self.places("tp", "tp.0.weight")
        row = self.places("tp", "tp.1.weight")
        self.assert_domain(col, 1, 1, 4)
        self.assertEqual({pl.tp_dim for pl in col}, {0})
        self.assertEqual({pl.tp_dim for pl in row}, {1})
        self.assertEqual(col[0].domain, row[0].domain)

    def test_uneven_tp_refused_on_every_rank(self):
        messages = {self.results[r]["uneven_tp"] for r in range(WORLD)}
        self.assertEqual(len(messages), 1, messages)
        message = messages.pop()
        self.assertIn("utp.0.weight", message)
        self.assertIn("unevenly", message)

    def test_fsdp_plus_tp(self):
        col = self.places("fsdp_tp", "fsdp_tp.0.weight")
        row = self.places("fsdp_tp", "fsdp_tp.1.weight")
        self.assert_domain(col, 1, 2, 2)
        self.assertEqual(col[0].domain, row[0].domain)
        self.assertEqual({(pl.tp_dim, pl.gtp_sharded) for pl in col}, {(0, True)})
        self.assertEqual({(pl.tp_dim, pl.gtp_sharded) for pl in row}, {(1, True)})
        self.assertEqual([(pl.g, pl.t) for pl in col], [(0, 0), (0, 1), (1, 0), (1, 1)])

    def test_fsdp_plus_tp_of_one_rank(self):
        self.assertEqual(self.results[0]["fsdp_tp1_placements"],
                         [("S(0)", "S(0)"), ("S(0)", "S(1)")])  # no _StridedShard
        col = self.places("fsdp_tp1", "fsdp_tp1.0.weight")
        row = self.places("fsdp_tp1", "fsdp_tp1.1.weight")
        self.assert_domain(col, 1, WORLD, 1)
        self.assertEqual(col[0].domain, row[0].domain)
        self.assertEqual([(pl.g, pl.t, pl.tp_dim, pl.gtp_sharded) for pl in col],
                         [(r, 0, None, True) for r in range(WORLD)])
        self.assertEqual([pl.local_shape for pl in col], [(3, 8)] * WORLD)
        self.assertEqual([pl.local_shape for pl in row], [(2, 12)] * 3 + [(1, 12)])

    def test_ddp(self):
        places = self.places("ddp", "ddp.w")
        self.assert_domain(places, 4, 1, 1)
        self.assertEqual([pl.d for pl in places], list(range(WORLD)))
        self.assertEqual(places[0].domain, "ddp-w4")

    def test_megatron_replicas_from_claims(self):
        places = [self.results[r]["megatron"] for r in range(WORLD)]
        self.assertEqual([(pl.D, pl.d, pl.g) for pl in places],
                         [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)])
        self.assertEqual(places[0].full_shape, (6, 4))

    def test_one_rank_refusing_stops_every_rank(self):
        messages = {self.results[r]["one_refuses"] for r in range(WORLD)}
        self.assertEqual(messages, {"rank 2: param x: made up"})

    def test_disagreeing_full_shapes_refused_on_every_rank(self):
        messages = {self.results[r]["disagree"] for r in range(WORLD)}
        self.assertEqual(len(messages), 1, messages)
        message = messages.pop()
        self.assertIn("param meg.v", message)
        self.assertIn("full_shape", message)
        self.assertIn("rank 3", message)


class _Mesh:
    """What place_dtensor reads of a DeviceMesh: its rank layout."""

    def __init__(self, *shape):
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)


class PureTest(unittest.TestCase):
    def test_plain_dim0_shards_before_tp_only_when_a_dim_has_one_rank(self):
        from torch.distributed.tensor import Shard
        roles, shards = (P.ROLE_GTP, P.ROLE_TP), (Shard(0), Shard(0))
        for mesh, G, T in ((_Mesh(4, 1), 4, 1), (_Mesh(1, 4), 1, 4)):
            for rank in range(4):
                pl = P.place_dtensor("w", (8, 6), (2, 6), mesh, shards, roles, rank)
                self.assertEqual((pl.D, pl.G, pl.T, pl.coordinate, pl.local_shape),
                                 (1, G, T, (0, rank % G, rank % T), (2, 6)))
                self.assertEqual((pl.tp_dim, pl.gtp_sharded), (0 if T > 1 else None, G > 1))
        # G = T = 2: a plain Shard(0) on the GTP dim first cuts the full rows
        # (rank 1 holds rows 2..3, the TP split wants its rows inside 0..3 cut
        # by G): still refused, as is a _StridedShard of the wrong factor.
        with self.assertRaisesRegex(ValueError, "cut the full rows before the TP blocks"):
            P.place_dtensor("w", (8, 6), (2, 6), _Mesh(2, 2), shards, roles, 1)

    def test_chunk_rows_is_torch_chunk(self):
        for rows, parts in [(38, 2), (37, 2), (3, 4), (0, 3), (7, 4), (16, 4), (5, 8)]:
            torch_sizes = [c.shape[0] for c in torch.empty(rows).chunk(parts)]
            torch_sizes += [0] * (parts - len(torch_sizes))
            self.assertEqual(list(P.chunk_rows(rows, parts)), torch_sizes, (rows, parts))

    def test_default_socket_is_the_daemons_rule(self):
        self.assertEqual(P.default_socket("j", 3, {"XDG_RUNTIME_DIR": "/run/user/7"}),
                         "unix:///run/user/7/muond/muond-j-3.sock")
        self.assertEqual(P.default_socket("j", 3, {}, uid=7), "unix:///tmp/muond-7/muond-j-3.sock")
        self.assertEqual(P.default_socket("j", 3, {"XDG_RUNTIME_DIR": "rel"}, uid=7),
                         "unix:///tmp/muond-7/muond-j-3.sock")
        # muond launch's socket dir comes first; a relative one is ignored.
        self.assertEqual(P.default_socket("j", 3, {"MUOND_SOCKET_DIR": "/tmp/l/",
                                                   "XDG_RUNTIME_DIR": "/run/user/7"}),
                         "unix:///tmp/l/muond-j-3.sock")
        self.assertEqual(P.default_socket("j", 3, {"MUOND_SOCKET_DIR": "rel",
                                                   "XDG_RUNTIME_DIR": "/run/user/7"}),
                         "unix:///run/user/7/muond/muond-j-3.sock")

    def test_discover(self):
        env = {"RANK": "2", "MUOND_JOB_ID": "job", "XDG_RUNTIME_DIR": "/x",
               "MUOND_TOKEN_FILE": "/t"}
        found = P.discover(None, env)
        self.assertEqual((found.address, found.job_id, found.rank, found.token_file),
                         ("unix:///x/muond/muond-job-2.sock", "job", 2, "/t"))
        self.assertEqual(P.discover(None, {"SLURM_PROCID": "5", "XDG_RUNTIME_DIR": "/x"}).address,
                         "unix:///x/muond/muond-default-5.sock")
        self.assertEqual(P.discover("mine", {"MUOND_DAEMON": "unix:///s"}).address, "unix:///s")
        with self.assertRaisesRegex(ValueError, "daemons="):
            P.discover(None, {})
        with self.assertRaisesRegex(ValueError, "RANK"):
            P.discover(None, {"RANK": "x"})

    def test_ranks_are_ascii_digits_only(self):
        # "²" passes str.isdigit() but int() refuses it; "٣" int() reads as 3.
        for key in ("RANK", "SLURM_PROCID"):
            for value in ("\u00b2", "\u0663", "1\u0663", "-1", " 1"):
                with self.assertRaisesRegex(ValueError, rf"\${key}=.*ASCII digits"):
                    P.discover(None, {key: value, "XDG_RUNTIME_DIR": "/x"})
        self.assertEqual(P.env_rank({"RANK": "12"}), 12)

    def test_missing_default_socket_names_path_job_and_fix(self):
        with tempfile.TemporaryDirectory() as xdg:
            found = P.discover(None, {"RANK": "1", "XDG_RUNTIME_DIR": xdg})
            path = f"{xdg}/muond/muond-default-1.sock"
            self.assertEqual(found.default_socket, path)
            why = found.missing_socket()
            for part in (path, "job 'default'", "$MUOND_JOB_ID is unset", "rank 1",
                         "--job_id", "$MUOND_DAEMON"):
                self.assertIn(part, why)
            self.assertIn("from $MUOND_JOB_ID", P.discover(
                None, {"RANK": "1", "XDG_RUNTIME_DIR": xdg, "MUOND_JOB_ID": "j"}).missing_socket())
            os.makedirs(f"{xdg}/muond")
            open(path, "w").close()  # exists: maybe a daemon still starting, so no verdict
            self.assertIsNone(found.missing_socket())
        # An explicit address is never judged here.
        self.assertIsNone(P.discover(None, {"MUOND_DAEMON": "unix:///nowhere"}).missing_socket())

    def _summary(self, domain="dom", size=(1, 2, 1), coord=(0, 0, 0), params=None):
        return {"domains": {domain: (size, coord)},
                "params": params if params is not None else
                {"w": (domain, (4, 4), None, True, (), 0, ())}}

    def test_check_layout_refusals(self):
        P.check_layout([self._summary(coord=(0, 0, 0)), self._summary(coord=(0, 1, 0))])
        with self.assertRaisesRegex(ValueError, r"ranks 0 and 1 both claim \(d, g, t\) = "
                                    r"\(0, 0, 0\)"):
            P.check_layout([self._summary(), self._summary()])
        with self.assertRaisesRegex(ValueError, "rank 0 has D x G x T = 1x2x1, rank 1 1x4x1"):
            P.check_layout([self._summary(), self._summary(size=(1, 4, 1), coord=(0, 1, 0))])
        with self.assertRaisesRegex(ValueError, r"no rank claims .*\(0, 1, 0\)"):
            P.check_layout([self._summary()])
        with self.assertRaisesRegex(ValueError, "param w .*: gtp_rows is \\(\\) on rank 0 "
                                    "but \\(3, 1\\) on rank 1"):
            P.check_layout([self._summary(), self._summary(
                coord=(0, 1, 0), params={"w": ("dom", (4, 4), None, True, (3, 1), 0, ())})])
        with self.assertRaisesRegex(ValueError, r"param w: in domain 'dom' on ranks \[0\] but "
                                    r"not on ranks \[1\]"):
            P.check_layout([self._summary(), self._summary(coord=(0, 1, 0), params={})])

    def test_replicas(self):
        claims = [[("m", 2, 1, 0, 0)], [("m", 2, 1, 1, 0)], [("m", 2, 1, 0, 0)],
                  [("m", 2, 1, 1, 0)]]
        self.assertEqual([P.replicas(claims, r) for r in range(4)],
                         [{"m": (2, 0)}, {"m": (2, 0)}, {"m": (2, 1)}, {"m": (2, 1)}])
        with self.assertRaisesRegex(ValueError, "different numbers of DP replicas"):
            P.replicas(claims[:3], 0)


if __name__ == "__main__":
    unittest.main()
