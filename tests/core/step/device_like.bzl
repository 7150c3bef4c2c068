"""A step engine test and its twin on a backend that calls itself a device."""

def step_engine_test(name, host_only = [], **kwargs):
    """A cc_test `name` and `<name>_device_like`, the same test run with
    MUOND_TEST_DEVICE_LIKE=1: testing::MakeStepTestBackend() then gives a CPU
    backend that calls itself a device, so a Muon group's momentum runs in
    its domain agreement with the grad check in its pass, held to the same
    references as the host path. `host_only`: gtest names (or patterns) the
    twin leaves out, for what only a host backend does."""
    native.cc_test(name = name, **kwargs)
    twin = dict(kwargs)
    twin["env"] = dict(twin.get("env", {}), MUOND_TEST_DEVICE_LIKE = "1")
    if host_only:
        twin["args"] = twin.get("args", []) + ["--gtest_filter=-" + ":".join(host_only)]
    native.cc_test(name = name + "_device_like", **twin)
