"""ggml-RPC wire format, sans-IO: llama.cpp's RPC protocol as the engine port carries it.

* :mod:`.tensor` — the packed ``rpc_tensor``;
* :mod:`.commands` — commands, versions and forks: who carries what and who answers;
* :mod:`.framing` — headers, HELLO, first-byte classification;
* :mod:`.decoders` — streaming decoders for both directions (inspector, fuzzer, tests);
* :mod:`.payloads` — GRAPH_COMPUTE, the SET_TENSOR head, fixed-layout payloads;
* :mod:`.tables` — ggml's type and op enums per version;
* :mod:`.guard` — what a session may send to a fragile rpc-server (the passthrough's guard).

docs/ggml.md describes the protocol and what the guard refuses.
"""
from __future__ import annotations

from .commands import (
    CONN_CAPS_SIZE,
    FORKS,
    HELLO_REQUEST,
    HELLO_RESPONSE,
    HELLO_RESPONSE_LEGACY,
    RESOLVE_TENSOR,
    RESOLVE_TENSOR_REQUEST,
    RESOLVE_TENSOR_RESPONSE,
    SUPPORT_OP,
    V0_PRE_HASH_NAMES,
    Cmd,
    CommandInfo,
    Version,
    at_least,
    command_name,
    command_table,
    layout_fields,
    normalize_version,
    request_layout,
    response_layout,
)
from .decoders import (
    DEFAULT_MAX_BUFFERED,
    GgmlRequestDecoder,
    GgmlResponseDecoder,
    PayloadChunk,
    RequestComplete,
    RequestHeader,
    ResponseComplete,
    ResponseHeader,
)
from .framing import (
    REQUEST_HEADER,
    REQUEST_HEADER_STRUCT,
    RESPONSE_HEADER,
    RESPONSE_HEADER_STRUCT,
    FirstBytesKind,
    HelloResponse,
    classify_first_bytes,
    classify_ggml_hello,
    encode_hello_request,
    encode_hello_response,
    encode_request,
    encode_request_header,
    encode_response,
    parse_hello_request,
    parse_hello_response,
)
from .payloads import (
    GRAPH_COMPUTE,
    GRAPH_COMPUTE_PRE3,
    SET_TENSOR_HEAD,
    SET_TENSOR_HEAD_V7,
    GraphCompute,
    SetTensorHeader,
    encode_graph_compute,
    encode_set_tensor,
    parse_graph_compute,
    parse_graph_compute_construct,
    parse_request_payload,
    parse_response_payload,
    parse_set_tensor_header,
    parse_set_tensor_header_construct,
    set_tensor_header_size,
)
from .tables import GgmlEnums, TypeTraits, enums_for, op_name, type_name
from .tensor import (
    GGML_MAX_DIMS,
    GGML_MAX_NAME,
    GGML_MAX_OP_PARAMS_I32,
    GGML_MAX_SRC,
    RPC_TENSOR,
    RPC_TENSOR_SIZE,
    RPC_TENSOR_STRUCT,
    RpcTensor,
    encode_rpc_tensor,
    parse_rpc_tensor,
    parse_rpc_tensor_construct,
)
