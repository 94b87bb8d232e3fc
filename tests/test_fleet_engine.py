"""``hydra-llama-engine`` started exactly as a Hydra node agent starts llama-engine, with the
fleet's parameters, and KV state moving between engines (issue 12); values checked before
llama.cpp sees them and the position bomb (issue 13 items 1, 4 and 13). Real processes, a
real tiny model, real sockets on 127.0.0.1."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from codec.enums import Op, Status
from codec.kvblob import parse_kv_blob
from engine.ggml_rpc_lib import find_free_port, probe_rpc_server
from hydra_rpc.client import HydraClient
from tests.fleet import FLEET_GLOBAL, FLEET_NODE, node_agent_argv
from tests.helpers import poll_until
from tools.spawn import HYDRA_HTTP, HYDRA_LISTENING, ROOT, ChildProcess, child_env

# a chat template of our own: the kwargs the node passes (preserve_thinking) and --reasoning on
# (enable_thinking) show up in the prompt as markers
TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{%- if preserve_thinking %}[preserve]{% endif %}{%- if enable_thinking %}[think]{% endif %}"
            "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hello there"}]
# the fleet's params with this host's model, template, context and ports
FLEET = {**FLEET_GLOBAL, **FLEET_NODE, "ctx-size": 8192}
# --log-verbosity is applied (hydra-llama-engine maps it onto --log-level)
NO_EFFECT = {"--cont-batching", "--perf", "--rpc-engine", "--yarn-orig-ctx"}


class LlamaEngine(ChildProcess):
    """``python -m hydra_rpc.cli.llama_engine ARGV``: ready once both ports are announced."""

    def __init__(self, argv: list[str]):
        super().__init__([sys.executable, "-m", "hydra_rpc.cli.llama_engine", *argv], "hydra-llama-engine")
        self.port = int(self.wait_for(HYDRA_LISTENING, 120).group(2))
        self.http_port = int(self.wait_for(HYDRA_HTTP, 120).group(2))


def start_engine(model: str, template: str, **overrides) -> tuple[LlamaEngine, int]:
    params = {**FLEET, "model": model, "chat-template-file": template, "ggml-rpc-port": find_free_port(),
              **overrides}
    params = {k: v for k, v in params.items() if v is not None}
    return LlamaEngine(node_agent_argv("127.0.0.1", find_free_port(), find_free_port(), params)), params[
        "ggml-rpc-port"]


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def engines(tiny_model_b_path, template_file):
    """Two engines with the fleet's settings (A, B) and one whose cache type differs (C)."""
    started = []
    try:
        for overrides in ({}, {}, {"cache-type-k": "f16", "cache-type-v": "f16"}):
            started.append(start_engine(tiny_model_b_path, template_file, **overrides))
        yield started
    finally:
        for eng, _ in started:
            assert eng.stop() == 0, eng.log
            assert "Traceback" not in eng.log, eng.log


async def connect(eng: LlamaEngine) -> HydraClient:
    return await HydraClient.connect("127.0.0.1", eng.port)


# ---------------------------------------------------------------------- the launch contract
@pytest.mark.asyncio
async def test_the_node_agents_command_line_starts_the_engine(engines, tiny_model_b_path):
    eng, ggml_port = engines[0]
    status, body = http_get(eng.http_port, "/slots")  # HTTP on --port: the agent's health probe
    assert status == 200 and len(json.loads(body)) == 2
    assert http_get(eng.http_port, "/metrics")[0] == 200  # --metrics
    assert probe_rpc_server(f"127.0.0.1:{ggml_port}")[0] >= 1  # ggml-RPC HELLO on --ggml-rpc-port
    async with await connect(eng) as c:  # Hydra on --rpc-port
        info = (await c.request(Op.INFO)).meta
    kv = info["kv_cache"]
    assert (kv["flash_attn"], kv["type_k"], kv["type_v"], kv["kv_unified"]) == ("on", "q8_0", "q8_0", True)
    assert kv["rope"]["scaling"] == "yarn" and kv["rope"]["freq_scale"] == pytest.approx(0.2)
    assert (kv["v_trans"], kv["n_stream"], kv["n_ctx"], kv["n_ctx_slot"]) == (False, 1, 8192, 8192)
    assert info["n_ctx_slot"] == 8192 and info["slots_total"] == 2
    ignored = {a["arg"]: a for a in info["ignored_args"]}
    assert set(ignored) == NO_EFFECT and all(a["reason"] for a in ignored.values())
    for name in NO_EFFECT:  # listed once at startup too
        assert eng.log.count(f"{name} ") == 1, eng.log
    p = info["params"]
    assert p["n_gpu_layers"] == "all" and p["n_cpu_moe"] == 8 and len(p["override_tensor"]) == 3
    # the fleet's prompt cache flags are the engine's (--cache-ram not given: llama-server's 8192 MiB)
    pc = info["prompt_cache"]
    assert (pc["cache_prompt"], pc["cache_reuse"], pc["ram_limit_bytes"]) == (True, 64, 8192 << 20)


@pytest.mark.asyncio
async def test_prefill_messages_use_the_template_file_and_its_kwargs(engines, tiny_model_b_path):
    from engine.llama_backend import LoadedModel

    eng, _ = engines[0]
    async with await connect(eng) as c:
        r = await c.request(Op.PREFILL, "1", json.dumps({"messages": MESSAGES}).encode())
    assert r.ok
    kwargs = {"preserve_thinking": True, "enable_thinking": True}
    with LoadedModel(tiny_model_b_path, n_ctx=256, n_seq_max=1, n_threads=1, chat_template=TEMPLATE,
                     chat_kwargs=kwargs) as m:
        assert m.apply_chat_template(MESSAGES).endswith("[preserve][think]<|assistant|>\n")
        assert r.meta["n_past"] == len(m.chat_tokens(MESSAGES))
        m.chat_kwargs = {}
        assert r.meta["n_past"] > len(m.chat_tokens(MESSAGES))  # the markers made it longer


@pytest.mark.parametrize("via", [["-m", "hydra_rpc.cli.llama_engine"], ["-m", "hydra_rpc.cli", "llama-engine"]])
def test_an_unknown_argument_exits_non_zero_naming_it(tiny_model_b_path, via):
    out = subprocess.run([sys.executable, *via, "--model", tiny_model_b_path, "--port", "0", "--frobnicate", "3"],
                         capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT)
    assert out.returncode == 1 and "invalid argument: --frobnicate" in out.stderr and "Traceback" not in out.stderr
    refused = subprocess.run([sys.executable, *via, "--model", tiny_model_b_path, "--api-key", "k"],
                             capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT)
    assert refused.returncode == 1 and "--api-key" in refused.stderr and "serve without auth" in refused.stderr


# ---------------------------------------------------------------------- KV state between engines
async def greedy_decode(c: HydraClient, slot: str, n: int = 12) -> bytes:
    """E1 DECODE ``[i32 n_predict]``: continue the slot greedily; the reply is the text."""
    r = await c.request(Op.DECODE, slot, struct.pack("<i", n), timeout=60)
    assert r.ok and r.meta["tokens_generated"] == n, r
    return r.payload


@pytest.mark.asyncio
async def test_prefill_on_a_state_put_on_b_decodes_as_a_would(engines):
    (a, _), (b, _) = engines[0], engines[1]
    async with await connect(a) as ca, await connect(b) as cb:
        pre = await ca.request(Op.PREFILL, "0", json.dumps({"prompt": "The quick brown fox jumps"}).encode())
        assert pre.ok
        put = await cb.request(Op.STATE_PUT, "0", pre.payload)  # the PREFILL payload: v3 blob + logits
        assert put.ok and put.meta["restored"] and put.meta["n_past"] == pre.meta["n_past"], put.meta
        assert put.meta["logits_tail"] is True
        on_b = await greedy_decode(cb, "0")
        on_a = await greedy_decode(ca, "0")
    assert on_a == on_b and on_a


@pytest.mark.asyncio
async def test_state_of_another_cache_layout_is_refused_naming_the_field(engines):
    (a, _), (c_eng, _) = engines[0], engines[2]
    async with await connect(a) as ca, await connect(c_eng) as cc:
        pre = await ca.request(Op.PREFILL, "0", json.dumps({"prompt": "Pack my box with five"}).encode())
        r = await cc.request(Op.STATE_PUT, "0", pre.payload)
        assert r.status == Status.BAD_REQUEST
        assert r.meta == {"error": "kv_state_mismatch", "field": "type_k", "got": "q8_0", "want": "f16"}
        await fresh_prefill_works(cc, "0")
        # llama.cpp cannot build a quantized V cache without flash attention: refused up front
        cfg = await cc.request(Op.CONFIGURE, "", json.dumps({"cache_type_v": "q8_0", "flash_attn": "off"}).encode())
        assert cfg.ok and set(cfg.meta["rejected_keys"]) == {"cache_type_v", "flash_attn"}, cfg.meta
        assert "needs flash attention" in cfg.meta["rejected_keys"]["flash_attn"] and not cfg.meta["deferred_keys"]
        # flash attention off (f16 stays): V is stored transposed
        cfg = await cc.request(Op.CONFIGURE, "", json.dumps({"flash_attn": "off"}).encode())
        assert cfg.ok and cfg.meta["rejected_keys"] == {} and cfg.meta["tier"] == "T4", cfg.meta
        await wait_swapped(cc, cfg.meta["config_generation"])
        assert (await cc.request(Op.STATE_META, "0")).meta["kv_cache"]["v_trans"] is True
        r = await cc.request(Op.STATE_PUT, "0", pre.payload)
        assert r.status == Status.BAD_REQUEST and r.meta["field"] == "v_trans" and (r.meta["got"], r.meta["want"]) \
            == (0, 1), r.meta
        await fresh_prefill_works(cc, "0")


async def fresh_prefill_works(c: HydraClient, slot: str) -> None:
    r = await c.request(Op.PREFILL, slot, json.dumps({"prompt": "a fresh prompt"}).encode())
    assert r.ok and r.meta["n_past"] > 0
    assert await greedy_decode(c, slot, 4)


async def wait_swapped(c: HydraClient, generation: int) -> None:
    def live(info: dict) -> bool:
        if info["config_generation"] >= generation:
            return True
        assert info["reload"]["state"] in ("loading", "draining", "swapped"), info["reload"]
        return False

    async def fetch() -> dict:
        return (await c.request(Op.INFO)).meta

    await poll_until(fetch, live)


# ---------------------------------------------------------------------- issue 13: 4 and 1, 13
@pytest.mark.asyncio
@pytest.mark.parametrize("pos", [2**26, 2**31 - 1])
async def test_position_bomb_is_refused_without_a_big_allocation(engines, pos):
    eng, _ = engines[1]
    async with await connect(eng) as c:
        assert (await c.request(Op.PREFILL, "1", json.dumps({"prompt": "bomb material"}).encode())).ok
        blob = bytearray((await c.request(Op.STATE_GET, "1")).payload)
        layout = parse_kv_blob(blob, has_logits=False)
        off = layout.state_offset
        assert blob[off:off + 4] == b"\xd8\x3c\x14\xaf"
        n_cells = struct.unpack_from("<I", blob, off + 12)[0]  # magic, seq_id, n_stream, cell_count
        struct.pack_into("<i", blob, off + 16 + 12 * (n_cells - 1), pos)  # the last cell's position
        rss0 = eng.rss_kib()
        r = await c.request(Op.STATE_PUT, "0", bytes(blob))
        assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "seq.pos", r.meta
        assert eng.rss_kib() - rss0 < 64 << 10  # a token list padded to pos would be ≥ 512 MiB
        await fresh_prefill_works(c, "0")


@pytest.mark.asyncio
async def test_values_llama_cpp_would_assert_on_never_reach_it(engines):
    eng, _ = engines[1]
    async with await connect(eng) as c:
        gen = (await c.request(Op.INFO)).meta["config_generation"]
        r = await c.request(Op.CONFIGURE, "", json.dumps({"flash_attn": 7, "rope_scale": 0, "n_ctx": 2**31,
                                                         "cache_type_k": "q9"}).encode())
        assert r.ok and set(r.meta["rejected_keys"]) == {"flash_attn", "rope_scale", "n_ctx", "cache_type_k"}
        assert r.meta["deferred_keys"] == [] and r.meta["config_generation"] == gen
        p = await c.request(Op.PREFILL, "0", json.dumps({"prompt": "x", "hydra_config": {"flash_attn": 2}}).encode())
        assert p.ok  # the bad key is not applied; the prompt is served
        assert (await c.request(Op.INFO)).ok and eng.proc.poll() is None


@pytest.mark.asyncio
async def test_the_decode_v3_kv_segment_is_checked_like_state_put(engines):
    from codec import decode_v3 as V3

    (a, _), (c_eng, _) = engines[0], engines[2]
    async with await connect(a) as ca, await connect(c_eng) as cc:
        pre = await ca.request(Op.PREFILL, "1", json.dumps({"prompt": "The five boxing wizards"}).encode())
        kv = bytearray(pre.payload[:len(pre.payload) - pre.meta["logits_size"]])
        gen = {"n_predict": 4, "sampling": {"temp": 0}, "stop": [], "stream": False, "chat_syntax": "",
               "oaicompat_model": ""}
        r = await cc.request(Op.DECODE, "1", V3.encode_decode_v3({"generation": gen}, b"{}", bytes(kv)))
        assert r.status == Status.BAD_REQUEST and r.meta["error"] == "kv_state_mismatch", r.meta
        off = parse_kv_blob(kv, has_logits=False).state_offset
        struct.pack_into("<i", kv, off + 16, 2**26)  # the position bomb, in the merged DECODE
        r = await ca.request(Op.DECODE, "1", V3.encode_decode_v3({"generation": gen}, b"{}", bytes(kv)))
        assert r.status == Status.BAD_REQUEST and r.meta["rule"] == "seq.pos", r.meta
        await fresh_prefill_works(ca, "1")
