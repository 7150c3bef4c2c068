"""A GPU test that starts its own coordinator and daemon (daemon_harness.py)."""

def gpu_daemon_test(name, deps = []):
    """py_test `name` from `name`.py and daemon_harness.py, tagged gpu, with
    the servers as data (found through $MUOND_BIN) and the muond client.
    It prints SKIP and passes without a CUDA device."""
    native.py_test(
        name = name,
        srcs = [
            "daemon_harness.py",
            name + ".py",
        ],
        data = [
            "//server/coordinator:muond-coordinator",
            "//server/daemon:muond-daemon",
        ],
        env = {"MUOND_BIN": "."},
        python_version = "PY3",
        tags = ["gpu"],
        deps = ["//client/python:muond"] + deps,
    )
