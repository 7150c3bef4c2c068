"""deploy/k8s/ checked by kubernetes-validate 1.37.0 (the Kubernetes 1.37
OpenAPI schemas, --strict: unknown fields are errors) and by what the schema
cannot see.

* Every manifest validates (kustomization.yaml lists them all); a manifest
  with a misspelled field or a wrongly typed value does not (the check can
  fail).
* The design: the coordinator's readiness and liveness are native grpc
  probes on its port; the daemons' sidecar is a native sidecar (an init
  container with restartPolicy Always) whose startupProbe holds the trainer
  back until the daemons answer `muond health`; sidecar and trainer share the
  socket volume, an in-memory /dev/shm, the token Secret, the GPUs' claim and
  one uid; every container is non-root, without privilege escalation, on a
  read-only root file system, with resources.
* The shell of every container and probe passes shellcheck.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
K8S = os.path.join(RUNFILES, "deploy/k8s")
KUBERNETES_VERSION = "1.37.0"


def validate(*paths):
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--no-warn",
         "-k", KUBERNETES_VERSION, *paths], capture_output=True, text=True, timeout=300)


def manifests():
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        return yaml.safe_load(f)["resources"]


def load_all():
    """{(kind, name): object} over every manifest."""
    out = {}
    for name in manifests():
        with open(os.path.join(K8S, name)) as f:
            for doc in yaml.safe_load_all(f):
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def shell_scripts(pod_spec):
    """(where, dialect, script) of every `sh|bash -c SCRIPT` of a pod."""
    out = []
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        commands = [("command", c.get("command", []))]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            commands.append((probe, c.get(probe, {}).get("exec", {}).get("command", [])))
        for where, argv in commands:
            if len(argv) == 3 and argv[0] in ("/bin/sh", "/bin/bash") and argv[1] == "-c":
                out.append((f"{c['name']} {where}", os.path.basename(argv[0]), argv[2]))
    return out


class K8sManifestsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="muond-k8s-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.objects = load_all()

    def test_kustomization_lists_every_manifest(self):
        here = sorted(f for f in os.listdir(K8S)
                      if f.endswith(".yaml") and f != "kustomization.yaml")
        self.assertEqual(sorted(manifests()), here)

    def test_every_manifest_validates(self):
        proc = validate(*[os.path.join(K8S, m) for m in manifests()])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        kinds = {kind for kind, _ in self.objects}
        self.assertEqual(kinds, {"ConfigMap", "Deployment", "Service", "Job",
                                 "ResourceClaimTemplate"})

    def broken(self, name, old, new):
        with open(os.path.join(K8S, name)) as f:
            text = f.read()
        self.assertIn(old, text)
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(text.replace(old, new, 1))
        return validate(path)

    def test_a_broken_manifest_fails(self):
        # Strict: an unknown (misspelled) field.
        proc = self.broken("train-job.yaml", "readOnlyRootFilesystem:",
                           "readOnlyRootFileSystem:")
        self.assertNotEqual(proc.returncode, 0, proc.stdout)
        self.assertIn("readOnlyRootFileSystem", proc.stdout + proc.stderr)
        # A wrongly typed value: a probe port must be an integer.
        proc = self.broken("coordinator.yaml", "port: 29400\n              service",
                           "port: grpc\n              service")
        self.assertNotEqual(proc.returncode, 0, proc.stdout)

    def test_coordinator_probes_and_service(self):
        deployment = self.objects[("Deployment", "muond-coordinator")]
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        port = c["ports"][0]["containerPort"]
        for probe in ("readinessProbe", "livenessProbe"):
            self.assertEqual(c[probe]["grpc"], {"port": port, "service": ""}, probe)
        service = self.objects[("Service", "muond-coordinator")]
        self.assertEqual(service["spec"]["selector"],
                         deployment["spec"]["selector"]["matchLabels"])
        config = self.objects[("ConfigMap", "muond-config")]["data"]
        self.assertEqual(config["MUOND_COORDINATOR"],
                         f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}")

    def test_sidecar_shares_with_trainer(self):
        pod = self.objects[("Job", "muond-train")]["spec"]["template"]["spec"]
        (sidecar,) = pod["initContainers"]
        (trainer,) = pod["containers"]
        self.assertEqual(sidecar["restartPolicy"], "Always")
        self.assertIn("muond.cli health", " ".join(sidecar["startupProbe"]["exec"]["command"]))
        self.assertIn("muond.cli health", " ".join(sidecar["livenessProbe"]["exec"]["command"]))
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        config = self.objects[("ConfigMap", "muond-config")]["data"]
        for c in (sidecar, trainer):
            m = mounts(c)
            self.assertEqual(volumes[m["/dev/shm"]]["emptyDir"]["medium"], "Memory", c["name"])
            self.assertTrue(config["MUOND_SOCKET_DIR"].startswith(
                [p for p, n in m.items() if n == "sockets"][0] + "/"), c["name"])
            token_dir = os.path.dirname(config["MUOND_TOKEN_FILE"])
            self.assertEqual(volumes[m[token_dir]]["secret"]["secretName"], "muond-token")
            self.assertEqual(c["resources"]["claims"], [{"name": "gpus"}], c["name"])
        self.assertEqual(pod["resourceClaims"][0]["name"], "gpus")

    def test_security_context(self):
        for (kind, name), obj in self.objects.items():
            if kind not in ("Deployment", "Job"):
                continue
            pod = obj["spec"]["template"]["spec"]
            self.assertTrue(pod["securityContext"]["runAsNonRoot"], name)
            self.assertIn("runAsUser", pod["securityContext"], name)
            self.assertIs(pod.get("automountServiceAccountToken"), False, name)
            for c in pod.get("initContainers", []) + pod["containers"]:
                sc = c["securityContext"]
                where = f"{name}/{c['name']}"
                self.assertIs(sc["allowPrivilegeEscalation"], False, where)
                self.assertIs(sc["readOnlyRootFilesystem"], True, where)
                self.assertEqual(sc["capabilities"]["drop"], ["ALL"], where)
                self.assertNotIn("runAsUser", sc, f"{where}: one uid for the whole pod")
                self.assertIn("requests", c["resources"], where)

    def test_shellcheck_embedded_scripts(self):
        pod = self.objects[("Job", "muond-train")]["spec"]["template"]["spec"]
        scripts = shell_scripts(pod)
        self.assertGreaterEqual(len(scripts), 4)
        for where, dialect, script in scripts:
            path = os.path.join(self.tmp, "script.sh")
            with open(path, "w") as f:
                f.write(script)
            proc = subprocess.run(["shellcheck", "-s", dialect, path],
                                  capture_output=True, text=True, timeout=60)
            self.assertEqual(proc.returncode, 0, f"{where}:\n{proc.stdout}{proc.stderr}")


if __name__ == "__main__":
    unittest.main()
