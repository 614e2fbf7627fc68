"""Build of tf_dlt: the Python packages and the native extension.

Compile flags (C++ standard, C++ ABI, defines) come from tf.sysconfig only, so
everything native matches the installed TensorFlow. Build with
``pip install --no-build-isolation .`` after installing requirements/build.txt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pybind11
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.extension import Extension

ROOT = os.path.dirname(os.path.abspath(__file__))

# Pure C++ (no TF or Python headers): table core, wire format, server, client.
# BUILD lists the same files; tests/test_packaging.py keeps them equal.
NATIVE_CORE_SOURCES = [
    "native/core/disk_tier.cc",
    "native/core/half.cc",
    "native/core/initializer.cc",
    "native/core/optimizer.cc",
    "native/core/shard.cc",
    "native/core/sketch.cc",
    "native/core/status.cc",
    "native/core/table.cc",
    "native/core/table_config.cc",
    "native/core/work_queue.cc",
    "native/net/client.cc",
    "native/net/data_server.cc",
    "native/net/pull_ahead.cc",
    "native/net/row_cache.cc",
    "native/net/request_handler.cc",
    "native/net/server_stats.cc",
    "native/net/socket.cc",
    "native/net/transport.cc",
    "native/net/wire.cc",
]
PYTHON_EXTENSION_SOURCES = ["native/python/module.cc"]
# TF custom ops: the only translation units that include TensorFlow headers.
TF_OPS_SOURCES = [
    "ops/cc/kernels/client_kernels.cc",
    "ops/cc/kernels/client_resource.cc",
    "ops/cc/kernels/lookup_grad_kernels.cc",
    "ops/cc/kernels/lookup_kernels.cc",
    "ops/cc/kernels/push_kernels.cc",
    "ops/cc/kernels/table_io_kernels.cc",
    "ops/cc/ops/dlt_ops.cc",
]
OPS_LIBRARY = "tf_dlt._dlt_ops"


def _version() -> str:
    scope: dict[str, str] = {}
    with open(os.path.join(ROOT, "tf_dlt", "version.py"), encoding="utf-8") as f:
        exec(f.read(), scope)
    return scope["__version__"]


def tf_sysconfig() -> tuple[list[str], list[str]]:
    """TensorFlow's (compile flags, link flags), from tf.sysconfig."""
    code = (
        "import json, tensorflow as tf; "
        "print(json.dumps([tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    ).stdout
    compile_flags, link_flags = json.loads(out.strip().splitlines()[-1])
    return compile_flags, link_flags


class BuildExt(build_ext):
    """Generates the control-plane protobuf code, then compiles with TF's
    flags."""

    def run(self) -> None:
        self._generate_protos()
        compile_flags, link_flags = tf_sysconfig()
        no_include = [f for f in compile_flags if not f.startswith("-I")]
        for ext in self.extensions:
            if ext.name == OPS_LIBRARY:
                ext.extra_compile_args = compile_flags + ext.extra_compile_args
                ext.extra_link_args = link_flags + ext.extra_link_args
            else:  # the native core and its bindings include no TF header
                ext.extra_compile_args = no_include + ext.extra_compile_args
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        super().run()

    def get_ext_filename(self, fullname: str) -> str:
        # Plain "_dlt_ops.so": tf.load_op_library loads it by path. distutils
        # asks both with the full and with the last dotted name.
        if fullname.split(".")[-1] == OPS_LIBRARY.split(".")[-1]:
            return os.path.join(*fullname.split(".")) + ".so"
        return str(super().get_ext_filename(fullname))

    def _generate_protos(self) -> None:
        from grpc_tools import protoc

        proto = "tf_dlt/proto/dlt.proto"
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(
            [
                "protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={ROOT}",
                f"--grpc_python_out={ROOT}",
                f"--pyi_out={ROOT}",
                os.path.join(ROOT, proto),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        if not self.inplace:  # copy into the build tree
            for name in ("dlt_pb2.py", "dlt_pb2_grpc.py", "dlt_pb2.pyi"):
                src = os.path.join(ROOT, "tf_dlt", "proto", name)
                dst_dir = os.path.join(self.build_lib, "tf_dlt", "proto")
                os.makedirs(dst_dir, exist_ok=True)
                self.copy_file(src, os.path.join(dst_dir, name))


NATIVE_FLAGS = ["-O3", "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"]

native = Extension(
    "tf_dlt._native",
    sources=NATIVE_CORE_SOURCES + PYTHON_EXTENSION_SOURCES,
    include_dirs=[ROOT, pybind11.get_include()],
    extra_compile_args=NATIVE_FLAGS,
    extra_link_args=["-pthread"],
    language="c++",
)

# The op library carries its own copy of the native core, hidden: it exports
# no third-party or tf_dlt symbols, so nothing clashes with what TF exports.
dlt_ops = Extension(
    OPS_LIBRARY,
    sources=NATIVE_CORE_SOURCES + TF_OPS_SOURCES,
    include_dirs=[ROOT],
    extra_compile_args=NATIVE_FLAGS + ["-Wno-sign-compare"],
    extra_link_args=["-pthread", "-Wl,--exclude-libs,ALL", "-Wl,--no-undefined"],
    language="c++",
)

setup(
    name="tf-dlt",
    version=_version(),
    description="Distributed embedding lookup table for TensorFlow 2 / Keras 3",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_dlt", "tf_dlt.*"]) + ["tf_dlt.layers", "tf_dlt.transpiler"],
    package_dir={
        "tf_dlt": "tf_dlt",
        "tf_dlt.layers": "keras_layers",
        "tf_dlt.transpiler": "transpiler",
    },
    package_data={"tf_dlt.proto": ["*.proto", "*.pyi"], "tf_dlt.tools": ["data/*.json"]},
    ext_modules=[native, dlt_ops],
    cmdclass={"build_ext": BuildExt},
    install_requires=[
        "numpy>=1.26",
        "grpcio>=1.70",
        "grpcio-health-checking>=1.70",
        "grpcio-reflection>=1.70",
        "protobuf>=5.29",
        "h5py>=3.10",
        "fsspec>=2024.2",
        "prometheus_client>=0.20",
        "PyYAML>=6",
    ],
    extras_require={
        "tf": ["tensorflow==2.21.0"],
        "s3": ["s3fs"],
        "hdfs": ["pyarrow"],
    },
    entry_points={"console_scripts": ["tf-dlt=tf_dlt.tools.cli:main"]},
)
