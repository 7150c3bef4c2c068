"""cutlass_repository: the CUTLASS/CuTe headers of the nvidia-cutlass wheel.

The wheel (pinned in requirements-cutlass.txt, installed into .venv by
deploy/setup.sh) carries the C++ headers under
cutlass_library/source/include. This rule asks the workspace's .venv python
where that package is and links the include directory into the repository,
so every checkout that shares or has the .venv builds offline with no other
step. Its BUILD file is third_party/cutlass.BUILD.
"""

def _cutlass_repository_impl(ctx):
    root = ctx.path(Label("//:WORKSPACE")).dirname
    python = root.get_child(".venv").get_child("bin").get_child("python")
    res = ctx.execute([
        str(python),
        "-c",
        "import importlib.util as u; " +
        "print(u.find_spec('cutlass_library').submodule_search_locations[0])",
    ])
    if res.return_code != 0 or not res.stdout.strip():
        fail("nvidia-cutlass is not installed in %s: run deploy/setup.sh " % python +
             "(requirements-cutlass.txt)\n" + res.stderr)
    ctx.symlink(res.stdout.strip() + "/source/include", "include")
    ctx.symlink(ctx.attr.build_file, "BUILD.bazel")

cutlass_repository = repository_rule(
    implementation = _cutlass_repository_impl,
    attrs = {"build_file": attr.label(allow_single_file = True)},
    local = True,
)
