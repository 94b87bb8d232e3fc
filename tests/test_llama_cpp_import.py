"""The server imports llama-cpp-python's binding without its high-level API
(engine/llama_cpp_import.py): in a fresh interpreter, and in the engine command's process
serving chats with a schema and tools."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from tests.test_cli_llama_engine import _ports, engine

FRESH = r"""
import json, sys
from engine.llama_cpp_import import defer_package_init
first, again = defer_package_init(), defer_package_init()
import llama_cpp.llama_cpp, llama_cpp.llama_grammar
import engine.llama_backend, engine.tensor_overrides, engine.chat.grammar
lean = sorted(m for m in ("llama_cpp.llama", "llama_cpp.llama_chat_format", "sqlite3") if m in sys.modules)
import llama_cpp
from llama_cpp import Llama  # the package's own __init__ runs here, on first need
print(json.dumps({"first": first, "again": again, "lean": lean, "version": llama_cpp.__version__,
                  "llama": Llama.__module__, "reexported": llama_cpp.llama_backend_init is llama_cpp.llama_cpp.llama_backend_init,
                  "loaded_after": "llama_cpp.llama" in sys.modules}))
"""

IMPORTED_FIRST = r"""
import json, llama_cpp
from engine.llama_cpp_import import defer_package_init
print(json.dumps({"deferred": defer_package_init(), "same": __import__("sys").modules["llama_cpp"] is llama_cpp}))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_the_binding_comes_without_the_high_level_api_until_something_asks_for_it():
    got = _run(FRESH)
    assert got["first"] and got["again"]
    assert got["lean"] == []  # not llama.py, its chat formats, or diskcache's sqlite3
    assert got["version"] == "0.3.36" and got["llama"] == "llama_cpp.llama" and got["reexported"]
    assert got["loaded_after"]


def test_a_package_already_imported_is_left_as_it_is():
    assert _run(IMPORTED_FIRST) == {"deferred": False, "same": True}


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_the_engine_command_serves_schemas_and_tools_without_the_high_level_api(tiny_model_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tool = {"type": "function", "function": {"name": "add", "parameters": schema}}
    with engine("--port", "0", "--log-summary", "0") as p:
        _, http = _ports(p)
        messages = [{"role": "user", "content": "hi"}]
        _post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "response_format":
                                             {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
        _post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "tools": [tool],
                                             "tool_choice": "required"})
        _post(http, "/completion", {"prompt": "hi", "n_predict": 4, "json_schema": schema})
        # llama_cpp.llama imports diskcache, which loads sqlite3's extension module
        assert "_sqlite3" not in _mapped_files(p.proc.pid)
