"""muond launch's options + environment -> Plan (muond/_launch_env.py) and
the servers' command lines (muond/launch.py), as tables: Slurm's compressed node lists, torchrun's and Slurm's variables in
per-node and per-rank mode, explicit options winning, and the contradictions
refused before anything starts (the message names the option or variable and
the rule). Expected values are written out by hand from the rules in
deploy/README.md "muond launch", not computed by the code under test.
"""
import contextlib
import io
import os
import re
import shutil
import tempfile
import unittest

from muond import cli
from muond import launch as L
from muond._launch_env import LaunchError, expand_nodelist, first_host, resolve


def options(*argv):
    return cli.build_parser().parse_args(["launch", *argv, "--", "true"])


def plan(argv=(), env=None, gpus=0, host="10.0.0.5"):
    return resolve(options(*argv), env or {}, count_gpus=lambda: gpus,
                   resolve_host=lambda: host, new_job_id=lambda: "gen-1")


class NodelistTest(unittest.TestCase):
    def test_expansion(self):
        cases = [
            ("node1", ["node1"]),
            ("a,b", ["a", "b"]),
            ("gpu[001-004,010],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010",
                                         "login1"]),
            ("a[01-03,7],b1", ["a01", "a02", "a03", "a7", "b1"]),
            ("n[8-11]", ["n8", "n9", "n10", "n11"]),
            ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
            ("x[3]-ib", ["x3-ib"]),
            ("h[1,3],g[2-3]", ["h1", "h3", "g2", "g3"]),
        ]
        for text, hosts in cases:
            self.assertEqual(expand_nodelist(text), hosts, text)

    def test_malformed(self):
        for text, phrase in [("gpu[1-2", "'[' without ']'"), ("gpu1-2]", "']' without '['"),
                             ("a[[1]]", "nested"), ("a,,b", "empty host"),
                             ("n[3-1]", "runs backwards"), ("n[a-b]", "is not N or N-M"),
                             ("n[]", "is not N or N-M")]:
            with self.assertRaisesRegex(LaunchError, re.escape(phrase), msg=text) as cm:
                expand_nodelist(text)
            self.assertIn("$SLURM_JOB_NODELIST", str(cm.exception))


    def test_first_host_without_expanding(self):
        """Only the first host is built; the total is counted, and over
        100000 hosts refused (r[0-99999]n[0-99999] is 10^10 names)."""
        self.assertEqual(first_host("r[5-999]n[07-99],x"), "r5n07")
        self.assertEqual(first_host("gpu[001-004],b"), "gpu001")
        for text in ("r[0-99999]n[0-99999]", "n[0-99999999]", "a[1-60000],b[1-60000]"):
            with self.assertRaisesRegex(LaunchError, r"\$SLURM_JOB_NODELIST=.*more than "
                                        r"100000 hosts") as cm:
                plan(["--device", "cpu"], {"SLURM_JOB_NODELIST": text, "SLURM_NNODES": "2",
                                           "SLURM_NODEID": "1", "MUOND_JOB_ID": "j",
                                           "MUOND_TOKEN_FILE": "/t"})
            self.assertLess(len(str(cm.exception)), 300, text)
        self.assertEqual(len(expand_nodelist("n[1-100000]")), 100000)


class ResolveTest(unittest.TestCase):
    def test_single_node_defaults(self):
        p = plan(["--device", "cpu"])
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
            p = plan(argv, env, gpus)
            self.assertEqual(p.mode, "per-node", (argv, env))
            self.assertEqual((p.nnodes, p.node_rank, p.nproc_per_node, p.ranks, p.master_addr,
                              p.device, p.gpus), want, (argv, env))
            self.assertEqual(p.world_size, p.nnodes * p.nproc_per_node)
            self.assertEqual(p.start_coordinator, p.node_rank == 0)

    def test_several_nodes(self):
        env = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4711",
               "SLURM_JOB_NODELIST": "gpu[001-002]", "MUOND_TOKEN_FILE": "/shared/tok"}
        p = plan(["--device", "cpu"], env)
        self.assertEqual((p.job_id, p.token_file, p.coordinator_port), ("slurm-4711", "/shared/tok",
                                                                          29400))
        # A host name binds every interface; the daemons dial the name.
        self.assertEqual((p.coordinator_listen, p.coordinator_address()),
                         ("0.0.0.0:29400", "gpu001:29400"))
        self.assertEqual(p.node_addr, "10.0.0.5")  # the host name's address
        p = plan(["--device", "cpu", "--master-addr", "10.0.0.1", "--coordinator-port", "7000",
                  "--node-addr", "10.0.0.2"], env)
        self.assertEqual((p.coordinator_listen, p.node_addr), ("10.0.0.1:7000", "10.0.0.2"))

    def test_per_rank(self):
        torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                    "TORCHELASTIC_RUN_ID": "abc123", "MUOND_TOKEN_FILE": "/t"}
        p = plan(["--device", "cpu"], torchrun)
        self.assertEqual((p.mode, p.nnodes, p.node_rank, p.nproc_per_node, p.world_size,
                          p.ranks, p.start_coordinator, p.job_id, p.master_addr),
                         ("per-rank", 2, 1, 2, 4, ((3, 1),), False, "torchrun-abc123",
                          "10.0.0.1"))
        # Global rank 0 starts the coordinator; a single node's ranks share 29400.
        p = plan(["--device", "cpu"], {**torchrun, "RANK": "0", "LOCAL_RANK": "0",
                                       "GROUP_RANK": "0", "WORLD_SIZE": "2",
                                       "MASTER_ADDR": "127.0.0.1"})
        self.assertEqual((p.nnodes, p.ranks, p.start_coordinator, p.coordinator_listen),
                         (1, ((0, 0),), True, "127.0.0.1:29400"))
        # srun with 4 tasks on 2 nodes, one GPU bound per task.
        slurm = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4",
                 "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2",
                 "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]",
                 "CUDA_VISIBLE_DEVICES": "1", "MUOND_TOKEN_FILE": "/t"}
        p = plan([], slurm, host="10.0.0.7")
        self.assertEqual((p.mode, p.node_rank, p.nproc_per_node, p.ranks, p.gpus, p.job_id,
                          p.master_addr, p.node_addr),
                         ("per-rank", 1, 2, ((2, 0),), (0,), "slurm-9", "n1", "10.0.0.7"))
        # --per-node overrides the environment's per-rank look.
        p = plan(["--per-node", "--device", "cpu", "--nproc-per-node", "2"],
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
                    plan(argv, env, host="127.0.1.1")
                continue
            with self.assertRaises(LaunchError, msg=(argv, env)) as cm:
                plan(["--device", "cpu"] if not argv else argv, env)
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
                p = plan(["--device", "cpu", "--coordinator-port", "29400", *argv], env)
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
                plan(["--device", "cpu", "--node-addr", "10.0.0.9", *argv], env)
            self.assertIn(phrase, str(cm.exception))


class CheckBeforeStartTest(unittest.TestCase):
    """What main() refuses (exit 2, one line) before it starts anything."""

    def main(self, *argv, env=None):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = L.main(cli.build_parser().parse_args(["launch", *argv]))
        return code, err.getvalue()

    def test_missing_command_refused_first(self):
        # --bin-dir names nothing: the command is still what is reported.
        for argv, phrase in [([], "no command: the command goes after --"),
                             (["--"], "no command after --"),
                             (["true"], "'true' without --: the command goes after --")]:
            code, err = self.main("--bin-dir", "/nonexistent", *argv)
            self.assertEqual(code, 2, err)
            self.assertIn(phrase, err)
            self.assertIn("muond launch [options] -- COMMAND ...", err)
            self.assertEqual(err.count("\n"), 1, err)

    def test_paths(self):
        tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, tmp)
        bins = os.path.join(tmp, "bin")
        os.mkdir(bins)
        for name in ("muond-daemon", "muond-coordinator"):
            with open(os.path.join(bins, name), "w") as f:
                f.write("#!/bin/sh\nexit 9\n")
            os.chmod(os.path.join(bins, name), 0o755)
        base = ["--bin-dir", bins, "--device", "cpu"]
        for argv, phrase in [
                (["--log-dir", "/proc/1"], "--log-dir /proc/1: not a writable directory"),
                (["--log-dir", os.path.join(bins, "muond-daemon", "x")], "not a writable directory"),
                (["--log-dir", tmp, "--token-file", "/dev/null"],
                 "--token-file /dev/null: not a regular file"),
                (["--log-dir", tmp, "--token-file", tmp], f"--token-file {tmp}: not a regular"),
                (["--log-dir", tmp, "--token-file", f"{tmp}/no"], "No such file")]:
            code, err = self.main(*base, *argv, "--", "true")
            self.assertEqual(code, 2, err)
            self.assertIn(phrase, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual(err.count("\n"), 1, err)


class FindServersTest(unittest.TestCase):
    """Without --bin-dir/$MUOND_BIN_DIR/PATH: the bazel-bin of the checkout
    around the current directory (WORKSPACE upwards), wherever the package is
    installed."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp)
        self.addCleanup(os.chdir, os.getcwd())
        self.repo = os.path.join(self.tmp, "repo")
        os.makedirs(os.path.join(self.repo, "a", "b"))
        open(os.path.join(self.repo, "WORKSPACE"), "w").close()

    def test_checkout_bazel_bin_from_a_subdirectory(self):
        os.chdir(os.path.join(self.repo, "a", "b"))
        with self.assertRaisesRegex(LaunchError, re.escape(
                f"pass --bin-dir {self.repo}/bazel-bin")):
            L.find_servers(None, {"PATH": ""})
        want = []
        for rel in ("server/daemon/muond-daemon", "server/coordinator/muond-coordinator"):
            path = os.path.join(self.repo, "bazel-bin", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").close()
            os.chmod(path, 0o755)
            want.append(path)
        self.assertEqual(L.find_servers(None, {"PATH": ""}),
                         (want[0], want[1], os.path.join(self.repo, "bazel-bin")))

    def test_path_lookup_by_name(self):
        """muond-daemon and muond-coordinator on PATH, each where it is (the
        `muond` CLI on PATH is not the daemon); one without the other is refused."""
        os.chdir(self.tmp)
        dirs = [os.path.join(self.tmp, d) for d in ("cli", "d", "c")]
        for d, name in zip(dirs, ("muond", "muond-daemon", "muond-coordinator")):
            os.mkdir(d)
            open(os.path.join(d, name), "w").close()
            os.chmod(os.path.join(d, name), 0o755)
        self.assertEqual(L.find_servers(None, {"PATH": os.pathsep.join(dirs)}),
                         (os.path.join(dirs[1], "muond-daemon"),
                          os.path.join(dirs[2], "muond-coordinator"), "PATH"))
        with self.assertRaisesRegex(LaunchError, "no executable muond-daemon; pass --bin-dir"):
            L.find_servers(None, {"PATH": os.pathsep.join([dirs[0], dirs[2]])})

    def test_outside_a_checkout(self):
        os.chdir(self.tmp)
        with self.assertRaises(LaunchError) as cm:
            L.find_servers(None, {"PATH": ""})
        self.assertIn("--bin-dir (a bundle's bin/ or a bazel-bin tree)", str(cm.exception))


class ServerCommandTest(unittest.TestCase):
    """The servers' command lines for a plan (muond/launch.py Launch.*_command),
    written out by hand: no process is started."""

    def launch(self, argv, env):
        from muond.launch import Launch
        a = options(*argv)
        launch = Launch(resolve(a, env, count_gpus=lambda: 0, resolve_host=lambda: "10.0.0.5",
                                new_job_id=lambda: "gen-1"), a, "/b/muond-daemon", "/b/muond-coordinator")
        launch.sockdir, launch.token_file = "/tmp/s", "/tok"
        return launch

    def test_second_node_gpu_daemons(self):
        env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77",
               "SLURM_JOB_NODELIST": "gpu[001-002]", "MUOND_TOKEN_FILE": "/tok",
               "CUDA_VISIBLE_DEVICES": "4,6"}
        launch = self.launch(["--node-addr", "10.0.0.2", "--metrics-port", "9100",
                              "--metrics-address", "0.0.0.0",
                              "--log-format", "json", "--tls-ca", "/ca.pem",
                              "--daemon-arg=--comm_timeout_s=120"], env)
        self.assertFalse(launch.plan.start_coordinator)
        self.assertEqual(launch.daemon_command(3, 1, 1), [
            "/b/muond-daemon", "--job_id=slurm-77", "--rank=3", "--world_size=4",
            "--coordinator=gpu001:29400", "--listen=unix:///tmp/s/muond-slurm-77-3.sock",
            "--device=1", "--gloo_hostname=10.0.0.2", "--token_file=/tok", "--log_format=json",
            "--metrics_port=9102", "--metrics_address=0.0.0.0", "--coordinator_tls_ca=/ca.pem", "--comm_timeout_s=120"])

    def test_single_node_coordinator_and_host_daemon(self):
        launch = self.launch(["--device", "cpu", "--coordinator-arg=--max_jobs=2"], {})
        self.assertEqual(launch.coordinator_command("/tmp/s/coordinator.port"), [
            "/b/muond-coordinator", "--listen=127.0.0.1:0", "--token_file=/tok",
            "--port_file=/tmp/s/coordinator.port", "--max_jobs=2"])
        launch.coordinator = "127.0.0.1:4242"  # what the port file said
        self.assertEqual(launch.daemon_command(0, 0, None), [
            "/b/muond-daemon", "--job_id=gen-1", "--rank=0", "--world_size=1",
            "--coordinator=127.0.0.1:4242", "--listen=unix:///tmp/s/muond-gen-1-0.sock", "--host",
            "--gloo_hostname=127.0.0.1", "--token_file=/tok"])

    def test_tls_coordinator_on_node_zero(self):
        env = {"MUOND_JOB_ID": "j", "MUOND_TOKEN_FILE": "/tok"}
        launch = self.launch(["--nnodes", "2", "--node-rank", "0", "--device", "cpu",
                              "--master-addr", "10.0.0.1", "--node-addr", "10.0.0.1",
                              "--tls-cert", "/c.pem", "--tls-key", "/k.pem", "--tls-ca",
                              "/ca.pem", "--metrics-port", "9100"], env)
        self.assertEqual(launch.coordinator_command(None), [
            "/b/muond-coordinator", "--listen=10.0.0.1:29400", "--token_file=/tok",
            "--metrics_port=9100", "--tls_cert=/c.pem", "--tls_key=/k.pem"])


if __name__ == "__main__":
    unittest.main()
