"""cuda_library: .cu files compiled by nvcc into objects that a cc_library links.

Bazel 4 has no CUDA rules and Debian has no rules_cuda, so each .cu becomes a
genrule that runs /usr/local/cuda/bin/nvcc (-O3, C++17, -fPIC; by default
sm_90 and sm_80 SASS). Keep .cu files self-contained: they may include CUDA
headers and project headers listed in `hdrs`/`cu_hdrs`, not Abseil or gRPC.

`gencode` replaces the default targets for one library (the sm_90a kernels:
wgmma/TMA exist only on the `a` target); `cu_includes` adds -I directories
(e.g. external/cutlass/include, with the headers in `cu_hdrs`); `copts` adds
nvcc flags.
"""

NVCC = "/usr/local/cuda/bin/nvcc"
NVCC_FLAGS = " ".join([
    "-std=c++17",
    "-O3",
    "-Xcompiler -fPIC",
    "-I.",
])
DEFAULT_GENCODE = [
    "arch=compute_90,code=sm_90",
    "arch=compute_80,code=sm_80",
]

def cuda_library(
        name,
        srcs,
        hdrs = [],
        deps = [],
        cu_hdrs = [],
        gencode = None,
        cu_includes = [],
        copts = [],
        visibility = None):
    flags = " ".join(
        [NVCC_FLAGS] +
        ["-gencode " + g for g in (gencode or DEFAULT_GENCODE)] +
        ["-I" + i for i in cu_includes] +
        copts,
    )
    objs = []
    for src in srcs:
        obj = "_objs_%s/%s" % (name, src.replace(".cu", ".pic.o"))
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + cu_hdrs,
            outs = [obj],
            # A temporary folder of its own: nvcc names its intermediate
            # files by process id, which is the same (2) in every sandbox
            # sharing /tmp, so two nvcc running at once would clobber each
            # other's .ptx.
            # (A trap removes it: genrules run under set -e, so a failed
            # nvcc would skip a plain rm after it.)
            cmd = ("t=$$(mktemp -d) && trap 'rm -rf \"$$t\"' EXIT && " +
                   "TMPDIR=$$t %s %s -c $(location %s) -o $@") % (NVCC, flags, src),
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        linkstatic = 1,
        visibility = visibility,
    )
