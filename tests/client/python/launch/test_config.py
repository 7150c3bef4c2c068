"""muond launch's options + environment -> LaunchLayout
(muond/launch/config.py), as tables: torchrun's and Slurm's variables in
per-node and per-rank mode, explicit options winning, and the contradictions
refused before anything starts (the message names the option or variable and
the rule). Expected values are written out by hand from the rules in
deploy/README.md "muond launch", not computed by the code under test.
"""
import unittest

from muond.launch.config import read_env_int
from muond.launch.errors import LaunchError
from tests.client.python.launch.options import layout


class ResolveTest(unittest.TestCase):
    def test_single_node_defaults(self):
        p = layout(["--device", "cpu"])
        self.assertEqual((p.mode, p.nnodes, p.node_rank, p.nproc_per_node, p.world_size),
                         ("per-node", 1, 0, 1, 1))
        self.assertEqual((p.master_addr, p.coordinator_port, p.coordinator_listen),
                         ("127.0.0.1", 0, "127.0.0.1:0"))
        self.assertEqual((p.node_addr, p.job_id, p.job_generated, p.token_file),
                         ("127.0.0.1", "gen-1", True, None))
        self.assertTrue(p.start_coordinator)
        self.assertEqual(p.gpus, (None,))

    def test_per_node_layouts(self):
        """(argv, env, gpus) -> (nnodes, node_rank, nproc, ranks, master, device, gpus)."""
        shared = {"MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/t"}
        cases = [
            (["--nproc-per-node", "2", "--device", "cpu"], {}, 0,
             (1, 0, 2, ((0, 0), (1, 1)), "127.0.0.1", "cpu", (None, None))),
            # auto with 4 visible GPUs: one daemon per GPU.
            ([], {}, 4, (1, 0, 4, ((0, 0), (1, 1), (2, 2), (3, 3)), "127.0.0.1", "cuda",
                         (0, 1, 2, 3))),
            # CUDA_VISIBLE_DEVICES wins over nvidia-smi; indexes within it.
            ([], {"CUDA_VISIBLE_DEVICES": "3,5"}, 8,
             (1, 0, 2, ((0, 0), (1, 1)), "127.0.0.1", "cuda", (0, 1))),
            (["--device", "auto"], {"CUDA_VISIBLE_DEVICES": ""}, 8,
             (1, 0, 1, ((0, 0),), "127.0.0.1", "cpu", (None,))),
            # Slurm, one launcher per node (srun --ntasks-per-node=1).
            (["--nproc-per-node", "4"],
             {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
              "SLURM_JOB_NODELIST": "gpu[007-009]", "SLURM_GPUS_ON_NODE": "4", **shared}, 0,
             (3, 2, 4, ((8, 0), (9, 1), (10, 2), (11, 3)), "gpu007", "cuda", (0, 1, 2, 3))),
            # torchrun-style node identity, explicit options win.
            (["--nnodes", "2", "--node-rank", "1", "--device", "cpu", "--master-addr", "10.1.1.1"],
             {"SLURM_NNODES": "5", "GROUP_RANK": "0", "MASTER_ADDR": "10.9.9.9",
              "LOCAL_WORLD_SIZE": "2", **shared}, 0,
             (2, 1, 2, ((2, 0), (3, 1)), "10.1.1.1", "cpu", (None, None))),
            ([], {"NODE_RANK": "1", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "3(x2)",
                  "MASTER_ADDR": "m0", **shared}, 0,
             (2, 1, 3, ((3, 0), (4, 1), (5, 2)), "m0", "cpu", (None,) * 3)),
            # `srun --ntasks-per-node=1 muond launch`: SLURM_NTASKS_PER_NODE=1 counts the
            # launchers; the daemons follow the node's GPUs.
            ([], {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
                  "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "g[1-2]",
                  "SLURM_GPUS_ON_NODE": "2", **shared}, 0,
             (2, 0, 2, ((0, 0), (1, 1)), "g1", "cuda", (0, 1))),
        ]
        for argv, env, gpus, want in cases:
            p = layout(argv, env, gpus)
            self.assertEqual(p.mode, "per-node", (argv, env))
            self.assertEqual((p.nnodes, p.node_rank, p.nproc_per_node, p.ranks, p.master_addr,
                              p.device, p.gpus), want, (argv, env))
            self.assertEqual(p.world_size, p.nnodes * p.nproc_per_node)
            self.assertEqual(p.start_coordinator, p.node_rank == 0)

    def test_several_nodes(self):
        env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4711",
               "SLURM_JOB_NODELIST": "gpu[001-002]", "MUOND_TOKEN_FILE": "/shared/tok"}
        p = layout(["--device", "cpu"], env)
        self.assertEqual((p.job_id, p.token_file, p.coordinator_port), ("slurm-4711", "/shared/tok",
                                                                          29400))
        # A host name binds every interface; the daemons dial the name.
        self.assertEqual((p.coordinator_listen, p.coordinator_address()),
                         ("0.0.0.0:29400", "gpu001:29400"))
        self.assertEqual(p.node_addr, "10.0.0.5")  # the host name's address
        p = layout(["--device", "cpu", "--master-addr", "10.0.0.1", "--coordinator-port", "7000",
                  "--node-addr", "10.0.0.2"], env)
        self.assertEqual((p.coordinator_listen, p.node_addr), ("10.0.0.1:7000", "10.0.0.2"))

    def test_per_rank(self):
        torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                    "TORCHELASTIC_RUN_ID": "abc123", "MUOND_TOKEN_FILE": "/t"}
        p = layout(["--device", "cpu"], torchrun)
        self.assertEqual((p.mode, p.nnodes, p.node_rank, p.nproc_per_node, p.world_size,
                          p.ranks, p.start_coordinator, p.job_id, p.master_addr),
                         ("per-rank", 2, 1, 2, 4, ((3, 1),), False, "torchrun-abc123",
                          "10.0.0.1"))
        # Global rank 0 starts the coordinator; a single node's ranks share 29400.
        p = layout(["--device", "cpu"], {**torchrun, "RANK": "0", "LOCAL_RANK": "0",
                                       "GROUP_RANK": "0", "WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1"})
        self.assertEqual((p.nnodes, p.ranks, p.start_coordinator, p.coordinator_listen),
                         (1, ((0, 0),), True, "127.0.0.1:29400"))
        # srun with 4 tasks on 2 nodes, one GPU bound per task.
        slurm = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
                 "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2",
                 "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]",
                 "CUDA_VISIBLE_DEVICES": "1", "MUOND_TOKEN_FILE": "/t"}
        p = layout([], slurm, host="10.0.0.7")
        self.assertEqual((p.mode, p.node_rank, p.nproc_per_node, p.ranks, p.gpus, p.job_id,
                          p.master_addr, p.node_addr),
                         ("per-rank", 1, 2, ((2, 0),), (0,), "slurm-9", "n1", "10.0.0.7"))
        # --per-node overrides the environment's per-rank look.
        p = layout(["--per-node", "--device", "cpu", "--nproc-per-node", "2"],
                 {**slurm, "SLURM_PROCID": "0"})
        self.assertEqual((p.mode, p.ranks), ("per-node", ((2, 0), (3, 1))))

    def test_refusals(self):
        """Contradictions refused before anything starts: (argv, env, phrases)."""
        multi = {"SLURM_NNODES": "2", "SLURM_NODEID": "0"}
        cases = [
            (["--nnodes", "2", "--node-rank", "2"], {}, ["--node-rank 2 (--node-rank)",
                                                         "< --nnodes 2"]),
            ([], {"SLURM_NNODES": "2", "SLURM_NODEID": "3"}, ["--node-rank 3 ($SLURM_NODEID)",
                                                             "< --nnodes 2 ($SLURM_NNODES)"]),
            ([], {"RANK": "4", "WORLD_SIZE": "4"}, ["$RANK=4 must be < $WORLD_SIZE=4"]),
            ([], {"SLURM_PROCID": "6", "SLURM_NTASKS": "4", "SLURM_NNODES": "1"},
             ["$SLURM_PROCID=6 must be < $SLURM_NTASKS=4"]),
            ([], {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"},
             ["--nnodes 1", "x --nproc-per-node 4", "$WORLD_SIZE=6"]),
            ([], {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2",
                  "MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/t"},
             ["$LOCAL_RANK=2 must be < --nproc-per-node 2"]),
            ([], {**multi, "MUOND_TOKEN_FILE": "/t"}, ["--job-id is required with --nnodes 2"]),
            ([], {**multi, "MUOND_JOB_ID": "j"}, ["--token-file is required with --nnodes 2"]),
            ([], {"RANK": "0", "WORLD_SIZE": "2", "MUOND_JOB_ID": "j"},
             ["--token-file is required with per-rank mode with 2 ranks"]),
            ([], {"RANK": "0", "WORLD_SIZE": "2", "MUOND_TOKEN_FILE": "/t"},
             ["--job-id is required with per-rank mode"]),
            (["--job-id", "team/a"], {}, ["--job-id 'team/a'", "letters, digits"]),
            ([], {"MUOND_JOB_ID": "a b"}, ["$MUOND_JOB_ID 'a b'"]),
            (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, ["--device cuda: no GPU",
                                                                  "$CUDA_VISIBLE_DEVICES"]),
            (["--device", "cuda", "--nproc-per-node", "3"], {"CUDA_VISIBLE_DEVICES": "0,1"},
             ["local rank 2", "3-th visible GPU", "gives 2"]),
            (["--tls-cert", "c.pem"], {}, ["--tls-cert and --tls-key go together"]),
            (["--tls-cert", "c.pem", "--tls-key", "k.pem", "--device", "cpu"], {},
             ["--tls-cert needs --tls-ca"]),
            (["--metrics-port", "65535", "--nproc-per-node", "2", "--device", "cpu"], {},
             ["--metrics-port 65535", "P+2 <= 65535"]),
            (["--per-rank", "--per-node"], {}, ["exclusive"]),
            (["--per-rank"], {}, ["--per-rank needs", "$RANK and $WORLD_SIZE"]),
            ([], {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MUOND_JOB_ID": "j",
                  "MUOND_TOKEN_FILE": "/t", "SLURM_NTASKS_PER_NODE": "2,4"},
             ["$SLURM_NTASKS_PER_NODE='2,4'", "same count"]),
            ([], {"SLURM_NODEID": "x"}, ["$SLURM_NODEID='x'", "non-negative integer"]),
            ([], {**multi, "MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/t", "MASTER_ADDR": "m"},
             None),  # host 127.0.1.1 below
            ([], {"SLURM_JOB_NODELIST": "gpu[1-2"}, ["$SLURM_JOB_NODELIST='gpu[1-2'"]),
        ]
        for argv, env, phrases in cases:
            if phrases is None:
                with self.assertRaisesRegex(LaunchError, "--node-addr: .*127.0.1.1, a loopback"):
                    layout(argv, env, host="127.0.1.1")
                continue
            with self.assertRaises(LaunchError, msg=(argv, env)) as cm:
                layout(["--device", "cpu"] if not argv else argv, env)
            for phrase in phrases:
                self.assertIn(phrase, str(cm.exception), (argv, env))


    def test_addresses_and_ports(self):
        """--master-addr/$MASTER_ADDR: host name, IPv4, IPv6 with or without
        brackets (host:port brackets it once); garbage refused; metrics ports
        overlapping the coordinator's refused naming both."""
        for given, bare, address in [("[::1]", "::1", "[::1]:29400"),
                                     ("fd00::5", "fd00::5", "[fd00::5]:29400"),
                                     ("10.1.2.3", "10.1.2.3", "10.1.2.3:29400"),
                                     ("gpu-001.cluster", "gpu-001.cluster",
                                      "gpu-001.cluster:29400")]:
            for argv, env in ((["--master-addr", given], {}), ([], {"MASTER_ADDR": given})):
                p = layout(["--device", "cpu", "--coordinator-port", "29400", *argv], env)
                self.assertEqual((p.master_addr, p.coordinator_address()), (bare, address))
        for argv, env, phrase in [
                (["--master-addr", "a b;c"], {}, "--master-addr 'a b;c' is not a host name"),
                ([], {"MASTER_ADDR": "[::1"}, "$MASTER_ADDR '[::1' is not an IPv6"),
                ([], {"MASTER_ADDR": "[zz::1]"}, "$MASTER_ADDR '[zz::1]' is not an IPv6"),
                (["--node-addr", "x/y"], {}, "--node-addr 'x/y'"),
                (["--metrics-address", "a b"], {}, "--metrics-address 'a b'"),
                (["--metrics-port", "29399", "--coordinator-port", "29400"], {},
                 "--metrics-port 29399: its ports 29399..29400"),
                (["--metrics-port", "29400"], {"MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/t",
                                               "SLURM_NNODES": "2", "SLURM_NODEID": "1"},
                 "overlap --coordinator-port 29400"),
                (["--nproc-per-node", "65"], {}, "--nproc-per-node 65 (--nproc-per-node): "
                 "at most 64 daemons per node")]:
            with self.assertRaises(LaunchError, msg=argv) as cm:
                layout(["--device", "cpu", "--node-addr", "10.0.0.9", *argv], env)
            self.assertIn(phrase, str(cm.exception))


class EnvIntTest(unittest.TestCase):
    """The launcher reads integers by the package's one rule (muond/_env.py)
    and refuses in its own words."""

    def test_refusal_names_the_variable(self):
        self.assertEqual(read_env_int("N", {"N": "12"}), 12)
        self.assertIsNone(read_env_int("N", {"N": ""}))
        self.assertIsNone(read_env_int("N", {}))
        for value in ("x", "-1", "1.5", "\u00b2", "\u0663"):
            with self.assertRaises(LaunchError) as cm:
                read_env_int("N", {"N": value})
            self.assertEqual(str(cm.exception), f"$N={value!r} is not a non-negative integer")


if __name__ == "__main__":
    unittest.main()
