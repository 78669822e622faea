"""gemmconv's autograd node in C++ (native_node.cpp), built where a process first needs it.

Eager calls that are one GEMM over views of their operands (a one-patch embedding such
as Qwen2-VL's, a channels-last 1x1 of stride 1) and need gradients run through it once
it is loaded: its backward runs on autograd's device thread without the GIL or any
Python, where gemmconv's Python node cost a synchronous Qwen2-VL embed forward+backward
29 us over the reshape + linear rewrite on an H100 (0.389 against 0.360 ms,
bench/results/h100_e2e.md at f1867b6).

Installing gemmconv needs no compiler. The first process that asks for the node (its
first eligible call) finds no library in the cache directory and compiles one from the
source with torch's cpp_extension in a background thread (about 25 s on a 2-core
machine), keeping the Python node itself: a process never switches nodes halfway, so
a seeded run keeps its numbers (the node computes the Python node's very GEMMs and
bits, tests/roads/test_native_node.py). Later processes load the library in
milliseconds, one per source, torch and Python. Wherever it cannot be built (no
compiler, no ninja, a failed build; said once in the dispatch log and by
``status()``), calls keep the Python node. A build runs in a private temporary
directory and reaches the cache by an atomic rename, so a process killed mid-build
leaves no lock a later one would wait on.

``$GEMMCONV_NATIVE_NODE`` says where it is used: ``auto`` (the default) for CUDA calls,
``1`` on every device, ``0`` nowhere. On an H100 (torch 2.11, at d858366) it took a
synchronous Qwen2-VL embed step with the weight's gradient from 266 to 248 us (the
rewrite's 243) and gave the Python node's bits in bf16, fp16 and fp64 there.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from gemmconv.selection import dispatch, finddb

SOURCE = Path(__file__).with_name("native_node.cpp")
ENVIRONMENT = "GEMMCONV_NATIVE_NODE"
_SETTINGS = {"auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}

# torch.ops.gemmconv_native.rows_gemm.default once the library is loaded, else None:
# the eager road reads it on every call that could use it.
rows_gemm = None

_lock = threading.Lock()
# "not requested", then "loaded", or "building" and then "built" or "unavailable".
_state = "not requested"
_reason = ""
_builder: threading.Thread | None = None


def setting() -> str:
    """``$GEMMCONV_NATIVE_NODE`` read: 'auto' (unset), 'on' or 'off'."""
    raw = os.environ.get(ENVIRONMENT, "auto").strip().lower()
    value = _SETTINGS.get(raw)
    if value is None:
        raise ValueError(
            f"{ENVIRONMENT}={os.environ[ENVIRONMENT]!r}: expected 'auto' (the node for CUDA "
            "calls, the default), '1' (every device) or '0' (never)"
        )
    return value


def wanted_on(device_type: str) -> bool:
    """Whether calls on ``device_type`` use the node, by the setting."""
    value = setting()
    return value == "on" or (value == "auto" and device_type == "cuda")


def request(device_type: str) -> None:
    """Where calls on ``device_type`` want the node: load it from the cache (a few
    milliseconds), or else start building it in the background for the processes
    that start after the build. A process never switches nodes halfway: a seeded run
    keeps the node it started with."""
    if _state == "not requested" and wanted_on(device_type):
        with _lock:
            if _state == "not requested" and not _load_cached():
                _start_build()


def build(timeout: float | None = None) -> bool:
    """Load the node in this process now, building it first if need be and waiting
    at most ``timeout`` seconds, whatever the setting; whether it is loaded. The
    benchmarks call it before timing anything."""
    with _lock:
        if _state == "not requested" and not _load_cached():
            _start_build()
        builder = _builder
    if rows_gemm is None and builder is not None:
        builder.join(timeout)
        with _lock:
            if _state == "built":
                _publish()
    return rows_gemm is not None


def status() -> str:
    """A sentence on the node: loaded, being built, or why it is not there."""
    if _state == "unavailable":
        return f"unavailable ({_reason}); calls take the Python node"
    if _state in ("building", "built"):
        return f"{_state} in the background; it serves the processes started after the build"
    return _state


def library_name() -> str:
    """The library's name: its source's hash with torch's and Python's versions, so a
    cached build is only ever loaded by the torch it was built against."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
    return f"gemmconv_native_{digest.hexdigest()[:16]}"


def cache_directory() -> Path:
    """Where built libraries are kept: gemmconv's cache folder's native/."""
    return finddb.cache_directory() / "native"


def _cached() -> Path:
    return cache_directory() / f"{library_name()}.so"


def _load_cached() -> bool:
    """Load the cached library, if there is one that loads; whether it did."""
    cached = _cached()
    if not cached.is_file():
        return False
    try:
        torch.ops.load_library(str(cached))
    except OSError as error:  # a file that is not a library: built again, replaced
        dispatch.log.info("gemmconv's C++ autograd node at %s did not load (%s): building "
                          "it again", cached, error)  # fmt: skip
        return False
    _publish()
    return True


def _publish() -> None:
    global rows_gemm, _state
    overload = torch.ops.gemmconv_native.rows_gemm.default
    # The overload's C++ entry point where torch has one: OpOverload.__call__ only
    # forwards to it outside Python dispatch modes, under which the eager road, the one
    # caller, never runs; the Python frame cost 1.5 of the op's 11 us on the CPU machine.
    rows_gemm = getattr(overload, "_op", overload)
    _state = "loaded"


def _start_build() -> None:
    global _state, _builder
    _state = "building"
    _builder = threading.Thread(target=_build, name="gemmconv-native-node", daemon=True)
    _builder.start()


def _build() -> None:
    global _state, _reason
    try:
        _compile_and_load(_cached())
        _state = "built"
    except Exception as error:  # no compiler, no ninja, a failed build
        lines = str(error).strip().splitlines()
        _reason = f"{type(error).__name__}: {lines[-1] if lines else ''}"
        _state = "unavailable"
        # Info, not a warning: the node is on by default and the Python node computes the
        # same bits, so a machine without a compiler loses a few us a call, nothing more.
        dispatch.log.info("gemmconv's C++ autograd node is %s", status())


def _compile_and_load(cached: Path) -> None:
    """Build the library in a private directory and load it; then copy it into the
    cache (a failure there costs later processes a build, never this call)."""
    from torch.utils import cpp_extension

    name = cached.stem
    with tempfile.TemporaryDirectory(prefix="gemmconv-native-") as build_directory:
        built = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            build_directory=build_directory,
            extra_cflags=["-O2"],
            is_python_module=False,
            verbose=False,
        )
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.partial")
            shutil.copyfile(built, partial)
            os.replace(partial, cached)
        except OSError as error:
            dispatch.log.info("gemmconv's C++ autograd node was not cached: %s", error)


__all__ = [
    "ENVIRONMENT",
    "SOURCE",
    "build",
    "cache_directory",
    "library_name",
    "request",
    "rows_gemm",
    "setting",
    "status",
    "wanted_on",
]
