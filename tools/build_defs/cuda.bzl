"""cuda_library: .cu files compiled by nvcc into objects that a cc_library links.

Bazel 4 has no CUDA rules and Debian has no rules_cuda, so each .cu becomes a
genrule that runs /usr/local/cuda/bin/nvcc (sm_90 and sm_80 SASS, -O3,
C++17, -fPIC). Keep .cu files self-contained: they may include CUDA headers
and project headers listed in `hdrs`/`cu_deps_hdrs`, not Abseil or gRPC.
"""

NVCC = "/usr/local/cuda/bin/nvcc"
NVCC_FLAGS = " ".join([
    "-std=c++17",
    "-O3",
    "-Xcompiler -fPIC",
    "-gencode arch=compute_90,code=sm_90",
    "-gencode arch=compute_80,code=sm_80",
    "-I.",
])

def cuda_library(name, srcs, hdrs = [], deps = [], cu_hdrs = [], visibility = None):
    objs = []
    for src in srcs:
        obj = "_objs_%s/%s" % (name, src.replace(".cu", ".pic.o"))
        native.genrule(
            name = "%s_%s_nvcc" % (name, src.replace("/", "_").replace(".", "_")),
            srcs = [src] + hdrs + cu_hdrs,
            outs = [obj],
            cmd = "%s %s -c $(location %s) -o $@" % (NVCC, NVCC_FLAGS, src),
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
