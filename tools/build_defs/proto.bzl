"""Protobuf/gRPC code generation with the system protoc and gRPC plugins.

Debian ships protoc 3.21 and grpc_{cpp,python}_plugin 1.51; Bazel's own proto
rules would download protobuf, so genrules run the system tools. Import paths
are relative to the package that holds the .proto files (//proto), so the C++
include is "muond/v1/muond.pb.h" and the Python module `muond.v1.muond_pb2`.
"""

def cc_grpc_proto_library(name, srcs, deps = [], visibility = None):
    """C++ messages + gRPC services for `srcs` (paths inside this package)."""
    root = native.package_name()
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_codegen",
        srcs = srcs,
        outs = outs,
        cmd = ("protoc --proto_path=%s --cpp_out=$(RULEDIR) --grpc_out=$(RULEDIR) " +
               "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) $(SRCS)") % root,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )

def py_grpc_proto_sources(name, srcs, proto_package, visibility = None):
    """Python messages + gRPC stubs for `srcs` (labels in `proto_package`),
    written into this package at the same relative paths, so a py_library here
    with imports=["."] sees them next to hand-written modules."""
    outs = []
    for src in srcs:
        base = src.split(":")[-1][:-len(".proto")]
        outs += [base + "_pb2.py", base + "_pb2_grpc.py"]
    native.genrule(
        name = name,
        srcs = srcs,
        outs = outs,
        cmd = ("protoc --proto_path=%s --python_out=$(RULEDIR) --grpc_python_out=$(RULEDIR) " +
               "--plugin=protoc-gen-grpc_python=$$(command -v grpc_python_plugin) $(SRCS)") % proto_package,
        visibility = visibility,
    )
