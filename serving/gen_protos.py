"""Regenerates the committed Python stubs under serving/proto from the .proto files.

    python -m jaxfill.serving.gen_protos          # needs grpcio-tools (the `test` extra)

protoc names modules after the proto's path (`jaxfill.v1.generation_pb2`,
`jetstream.core.proto.jetstream_pb2`); the *_pb2_grpc.py imports are rewritten to the
package they live in (`jaxfill.serving.proto....`), so no sys.path tricks are needed. The
descriptor file names stay `jaxfill/v1/generation.proto` and
`jetstream/core/proto/jetstream.proto`, the latter exactly JetStream's, which is what
reflection reports.

The stubs are committed so a fresh clone runs without grpcio-tools. protoc's gencode
checks at import that the protobuf runtime is at least as new as the protoc that wrote
it; `--check` fails when the bundled protoc is newer than the installed runtime.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(ROOT, "proto")
PROTOS = ["jaxfill/v1/generation.proto", "jaxfill/v1/engine_admin.proto", "jetstream/core/proto/jetstream.proto"]


def _packages(rel: str) -> list[str]:
    parts = os.path.dirname(rel).split("/")
    return [os.path.join(PROTO_ROOT, *parts[:i + 1]) for i in range(len(parts))]


def generate() -> list[str]:
    from grpc_tools import protoc
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    written = []
    for rel in PROTOS:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={PROTO_ROOT}",
                f"--pyi_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}", os.path.join(PROTO_ROOT, rel)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")
        for pkg in _packages(rel):
            init = os.path.join(pkg, "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
        stem = rel[:-len(".proto")]
        module_pkg = os.path.dirname(rel).replace("/", ".")
        grpc_file = os.path.join(PROTO_ROOT, stem + "_pb2_grpc.py")
        with open(grpc_file) as f:
            src = f.read()
        src = re.sub(rf"^from {re.escape(module_pkg)} import", f"from jaxfill.serving.proto.{module_pkg} import",
                     src, flags=re.M)
        with open(grpc_file, "w") as f:
            f.write(src)
        written += [stem + s for s in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def check_runtime() -> str | None:
    """None when the installed protobuf can import what the bundled protoc writes."""
    import google.protobuf
    from grpc_tools import protoc

    runtime = tuple(int(x) for x in google.protobuf.__version__.split(".")[:3])
    for rel in PROTOS:
        path = os.path.join(PROTO_ROOT, rel[:-len(".proto")] + "_pb2.py")
        m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
                      open(path).read())
        if m and tuple(int(x) for x in m.groups()) > runtime:
            return f"{rel}: generated for protobuf {'.'.join(m.groups())}, installed {google.protobuf.__version__}"
    del protoc
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check the committed stubs import here")
    args = p.parse_args(argv)
    if not args.check:
        for path in generate():
            print("wrote serving/proto/" + path)
    problem = check_runtime()
    if problem:
        print("error:", problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
