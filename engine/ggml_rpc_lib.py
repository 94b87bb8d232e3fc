"""ggml RPC through llama-cpp-python's own shared libraries (ctypes).

* :func:`register_rpc_server` adds a remote ``ggml-rpc-server`` to the backend registry that
  libllama uses, so a later model load with ``n_gpu_layers > 0`` offloads layers to it.
  Registration is process-global and cannot be undone (no unregister API).
* :func:`list_devices` lists the registry's devices (CPU, RPC0, ...).
* :func:`start_server_blocking` runs llama.cpp's own RPC server (the code behind
  ``ggml-rpc-server``) on the calling thread; hydra_rpc/ggml/child.py runs it as a process of
  its own, which is the only way this project runs it (its crashes must not be ours).

Pitfall: the wheel ships ``libggml.so``, ``libggml.so.0`` and ``libggml.so.0.x`` as separate
file *copies*. libllama links ``libggml.so.0``; opening ``libggml.so`` (what
``llama_cpp._ggml`` does) maps a second libggml with its own, separate registry. We
therefore always open ``llama_cpp/lib/libggml.so.0`` — found without importing llama_cpp, so a
child process that only serves ggml RPC starts in tens of milliseconds.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import socket
import threading
from typing import Any

from codec import ggml as G
from codec.errors import CodecError

__all__ = [
    "libggml",
    "register_rpc_server",
    "registered_servers",
    "list_devices",
    "start_server_blocking",
    "find_free_port",
    "probe_rpc_server",
    "hello",
    "open_session",
    "RpcServerError",
    "client_proto_version",
]

_FALLBACK_PROTO = (7, 0, 0)  # llama-cpp-python 0.3.36
_DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_registered: dict[str, str] = {}  # endpoint -> first device name it added
_ADD_SERVER_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
# void ggml_backend_rpc_start_server(const char *endpoint, const char *cache_dir,
#                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t *devices)
_START_SERVER_T = ctypes.CFUNCTYPE(
    None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
)


def _package_dir() -> str:
    """llama_cpp's directory, without importing it (numpy and libllama are not needed here)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed")
    return spec.submodule_search_locations[0]


def lib_dir() -> str:
    """Where the wheel keeps llama.cpp's shared libraries (``llama_cpp/lib``)."""
    return os.path.join(_package_dir(), "lib")


def libggml() -> ctypes.CDLL:
    """The libggml that libllama itself uses (``llama_cpp/lib/libggml.so.0``)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = os.path.join(lib_dir(), "libggml.so.0")
        if not os.path.exists(path):
            raise RuntimeError(f"llama-cpp-python has no {path}; unexpected wheel layout")
        g = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        g.ggml_backend_reg_by_name.restype = vp
        g.ggml_backend_reg_by_name.argtypes = [cp]
        g.ggml_backend_reg_get_proc_address.restype = vp
        g.ggml_backend_reg_get_proc_address.argtypes = [vp, cp]
        g.ggml_backend_register.restype = None
        g.ggml_backend_register.argtypes = [vp]
        g.ggml_backend_dev_count.restype = sz
        g.ggml_backend_dev_count.argtypes = []
        g.ggml_backend_dev_get.restype = vp
        g.ggml_backend_dev_get.argtypes = [sz]
        g.ggml_backend_dev_by_name.restype = vp
        g.ggml_backend_dev_by_name.argtypes = [cp]
        g.ggml_backend_dev_name.restype = cp
        g.ggml_backend_dev_name.argtypes = [vp]
        g.ggml_backend_dev_description.restype = cp
        g.ggml_backend_dev_description.argtypes = [vp]
        g.ggml_backend_dev_type.restype = ctypes.c_int
        g.ggml_backend_dev_type.argtypes = [vp]
        _lib = g
        return g


def _rpc_proc(name: str) -> int:
    g = libggml()
    reg = g.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RuntimeError("the ggml backend registry has no 'RPC' backend: llama-cpp-python was built without "
                           "-DGGML_RPC=ON (see scripts/install_llama_cpp.sh)")
    addr = g.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not addr:
        raise RuntimeError(f"the RPC backend does not export {name}")
    return addr


def _dev_info(g: ctypes.CDLL, dev: int) -> dict[str, Any]:
    return {
        "name": (g.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
        "description": (g.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
        "type": _DEV_TYPES.get(int(g.ggml_backend_dev_type(dev)), str(int(g.ggml_backend_dev_type(dev)))),
    }


def list_devices() -> list[dict[str, Any]]:
    """Devices of libllama's ggml registry: ``[{"name", "description", "type"}, ...]``."""
    g = libggml()
    return [_dev_info(g, g.ggml_backend_dev_get(i)) for i in range(int(g.ggml_backend_dev_count()))]


def client_proto_version() -> tuple[int, int, int]:
    """The ggml RPC protocol version this llama-cpp-python build speaks (from its ggml-rpc.h)."""
    import re

    site = os.path.dirname(_package_dir())
    try:
        with open(os.path.join(site, "include", "ggml-rpc.h"), encoding="utf-8") as f:
            text = f.read()
        v = [int(re.search(rf"#define\s+RPC_PROTO_{k}_VERSION\s+(\d+)", text).group(1))  # type: ignore[union-attr]
             for k in ("MAJOR", "MINOR", "PATCH")]
        return v[0], v[1], v[2]
    except (OSError, AttributeError):
        return _FALLBACK_PROTO


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"RPC endpoint must be 'host:port', not {endpoint!r}")
    return host, int(port)


class RpcServerError(ConnectionError):
    """A ggml RPC server is unreachable, busy, not a ggml RPC server, or incompatible."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RpcServerError("connection closed during the HELLO handshake")
        buf += chunk
    return buf


def hello(sock: socket.socket, legacy: bool = False) -> G.HelloResponse:
    """HELLO on a fresh connection (zero conn_caps: TCP only); the server's reply.

    Raises RpcServerError when the reply is not a HELLO reply (wrong size, or a close)."""
    sock.sendall(G.encode_hello_request(legacy=legacy))
    size = G.RESPONSE_HEADER_STRUCT.unpack(_recv_exact(sock, G.RESPONSE_HEADER_STRUCT.size))[0]
    if size not in (3, 28):
        raise RpcServerError(f"unexpected HELLO reply size {size}")
    try:
        return G.parse_hello_response(_recv_exact(sock, size))
    except CodecError as e:
        raise RpcServerError(str(e)) from None


def open_session(host: str, port: int, timeout: float) -> tuple[socket.socket, G.HelloResponse]:
    """A blocking, TCP_NODELAY connection to a ggml RPC server with its HELLO done.

    ``timeout`` bounds the connect and the HELLO (a server busy with another client does not
    answer); the returned socket has no timeout."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reply = hello(sock, legacy=client_proto_version()[0] < 4)
        sock.settimeout(None)
        return sock, reply
    except BaseException:
        sock.close()
        raise


def probe_rpc_server(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """HELLO handshake with a ggml RPC server; returns its (major, minor, patch).

    Raises ConnectionError if it is unreachable, busy with another client (it serves one at a
    time) for longer than ``timeout``, not a ggml RPC server, or of an incompatible version
    (llama.cpp's client would abort the whole process in these cases instead of failing).
    """
    host, port = _split_endpoint(endpoint)
    mine = client_proto_version()
    try:
        sock, reply = open_session(host, port, timeout)
        sock.close()
        theirs = reply.version
    except RpcServerError as e:
        raise RpcServerError(f"ggml RPC server {endpoint} is not usable: {e}") from None
    except (OSError, ValueError) as e:  # refused, timeout (busy server), reset ...
        raise RpcServerError(f"ggml RPC server {endpoint} is unreachable or busy: {e}") from e
    if theirs[0] != mine[0] or theirs[1] > mine[1]:
        raise RpcServerError(
            f"ggml RPC server {endpoint} speaks protocol {'.'.join(map(str, theirs))}, "
            f"this client {'.'.join(map(str, mine))} (major must match, server minor <= client minor)"
        )
    return theirs


def register_rpc_server(endpoint: str) -> str:
    """Connect to a ggml RPC server ("host:port") and register its devices for libllama.

    Returns the name of the (first) new device, e.g. "RPC0". Cached per endpoint: a second
    call returns the same name. Raises ConnectionError if the server is unreachable, busy or
    speaks another protocol version (checked first with :func:`probe_rpc_server`, because
    llama.cpp itself aborts the process on a failed connect). Process-global and irreversible;
    register before loading models. Note that llama.cpp also aborts the process if a
    registered server dies while a model uses it.
    """
    with _lock:
        if endpoint in _registered:
            return _registered[endpoint]
    add = _ADD_SERVER_T(_rpc_proc("ggml_backend_rpc_add_server"))
    g = libggml()
    with _lock:
        if endpoint in _registered:
            return _registered[endpoint]
        probe_rpc_server(endpoint)
        before = {d["name"] for d in list_devices()}
        reg = add(endpoint.encode())
        if not reg:
            raise RpcServerError(
                f"ggml RPC server {endpoint} is unreachable or incompatible (ggml_backend_rpc_add_server returned NULL)"
            )
        g.ggml_backend_register(reg)
        new = [d for d in list_devices() if d["name"] not in before]
        name = new[0]["name"] if new else next(
            (d["name"] for d in list_devices() if d["description"] == endpoint), "RPC?"
        )
        _registered[endpoint] = name
        return name


def registered_servers() -> dict[str, str]:
    """Endpoints registered by this process -> device name."""
    with _lock:
        return dict(_registered)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _cpu_device() -> int:
    g = libggml()
    dev = g.ggml_backend_dev_by_name(b"CPU")
    if not dev:
        for i in range(int(g.ggml_backend_dev_count())):
            d = g.ggml_backend_dev_get(i)
            if int(g.ggml_backend_dev_type(d)) == 0:
                return d
        raise RuntimeError("no CPU device in the ggml registry")
    return dev


def start_server_blocking(host: str, port: int, n_threads: int) -> None:
    """Run llama.cpp's ggml RPC server (CPU device) on this thread until its accept fails.

    It serves one client at a time, prints its banner to the C stdout, cannot be stopped from
    outside and aborts the process on several malformed inputs: run it in a process of its own
    (hydra_rpc/ggml/child.py). Returns at once if it cannot listen (e.g. the port is taken)."""
    start = _START_SERVER_T(_rpc_proc("ggml_backend_rpc_start_server"))
    devices = (ctypes.c_void_p * 1)(_cpu_device())
    start(f"{host}:{port}".encode(), None, int(n_threads), 1, devices)
