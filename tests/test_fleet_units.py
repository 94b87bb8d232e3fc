"""The pieces of the fleet drop-in, in process: serve's llama.cpp vocabulary and its v1 names,
settings → ModelParams, the KV cache a context reports and checks states against, CONFIGURE
refusing contexts llama.cpp could not build, the HTTP endpoints' switches, INFO's quant_swap."""
from __future__ import annotations

import argparse

import aiohttp
import pytest

from codec.errors import MalformedPayload, Truncated
from engine.kv_cache import KvStateMismatch
from hydra_rpc.cli import build_parser
from hydra_rpc.cli.llama_argv import parse_llama_argv
from hydra_rpc.cli.llama_cli import model_params
from hydra_rpc.cli.serve import serve_settings


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


# ---------------------------------------------------------------------- one vocabulary
def test_serve_takes_llama_cpp_arguments_in_order_with_llama_cpp_meanings():
    args = serve_args("--port", "9000", "-c", "8192", "-np", "2", "--kv-unified", "-fa", "on", "-ctk", "q8_0",
                      "--cache-type-v=q8_0", "--temp", "0.5", "--cont-batching", "-m", "tiny")
    assert args.port == 9000 and args.model == "tiny" and args.deprecated == []
    s = serve_settings(args, env={})
    assert (s.n_ctx, s.n_parallel, s.kv_unified, s.flash_attn, s.cache_type_k, s.cache_type_v) == \
        (8192, 2, True, "on", "q8_0", "q8_0")
    assert s.t1 == {"sampling.temp": 0.5} and [a.name for a in s.ignored_args] == ["--cont-batching"]
    p = model_params(s, "m.gguf")
    assert (p.n_ctx, p.n_slots, p.kv_unified, p.n_ctx_slot_cap, p.n_batch) == (8192, 2, True, 0, 512)


def test_serve_defaults_and_the_deprecated_v1_names(capsys):
    d = model_params(serve_settings(serve_args(), env={}), "m")  # v1: 4 slots of 4096 tokens in one pool
    assert (d.n_ctx, d.n_slots, d.kv_unified, d.n_ctx_slot_cap, d.n_batch) == (16384, 4, True, 4096, 512)
    args = serve_args("--ctx", "2048", "--slots", "2", "--batch", "256", "--rpc-servers", "127.0.0.1:50052")
    assert args.llama_argv == ["--kv-unified-per-slot", "2048", "--parallel", "2", "--batch-size", "256", "--rpc",
                               "127.0.0.1:50052"]
    assert len(args.deprecated) == 4 and "use --ctx-size TOTAL" in args.deprecated[0]
    p = model_params(serve_settings(args, env={}), "m")
    assert (p.n_ctx, p.n_slots, p.n_ctx_slot_cap, p.n_batch, p.rpc_servers) == (4096, 2, 2048, 256,
                                                                                ("127.0.0.1:50052",))
    # the command line wins over the environment, which wins over serve's defaults
    s = serve_settings(serve_args("-b", "64"), env={"LLAMA_ARG_BATCH": "128", "LLAMA_ARG_CTX_SIZE": "1024"})
    assert (s.n_batch, s.n_ctx, s.kv_unified_per_slot) == (64, 1024, 0)


def test_prompt_cache_arguments_reach_the_engine(tmp_path):
    from hydra_rpc.cli.llama_cli import engine_config
    from hydra_rpc.cli.usage import UsageError

    d = engine_config(serve_settings(serve_args(), env={}), "m")  # llama-server's defaults
    assert (d.model.cache_prompt, d.model.cache_reuse) == (True, 0)
    assert (d.slot_prompt_similarity, d.cache_ram_mib, d.slot_save_path) == (0.1, 8192, None)
    args = serve_args("--no-cache-prompt", "--cache-reuse", "32", "-sps", "0.5", "-cram", "-1", "--slot-save-path",
                      str(tmp_path))
    c = engine_config(serve_settings(args, env={}), "m")
    assert (c.model.cache_prompt, c.model.cache_reuse) == (False, 32)
    assert (c.slot_prompt_similarity, c.cache_ram_mib, c.slot_save_path) == (0.5, -1, str(tmp_path))
    assert serve_settings(args, env={}).ignored_args == ()
    with pytest.raises(UsageError, match="--slot-save-path.*not a directory"):  # llama.cpp's check
        serve_settings(serve_args("--slot-save-path", str(tmp_path / "missing")), env={})
    with pytest.raises(UsageError, match="slot_prompt_similarity"):
        serve_settings(serve_args("--slot-prompt-similarity", "1.5"), env={})


def test_the_rpc_allow_list_is_rpc_plus_rpc_allow():
    from hydra_rpc.cli.llama_cli import engine_config
    from hydra_rpc.cli.usage import UsageError

    args = serve_args("--rpc", "127.0.0.1:50052", "--rpc-allow", "10.0.0.1:1,10.0.0.2:2", "--rpc-allow", "h:3")
    allow = engine_config(serve_settings(args, env={}), "m", rpc_allow=args.rpc_allow).rpc_allow
    assert allow.refusal(("127.0.0.1:50052", "10.0.0.2:2", "H:3")) is None
    assert "1.2.3.4:5" in allow.refusal(("1.2.3.4:5",))
    with pytest.raises(UsageError, match="--rpc-allow.*HOST:PORT"):
        engine_config(serve_settings(serve_args(), env={}), "m", rpc_allow=["no-port"])


def test_serve_refuses_what_llama_server_refuses():
    from hydra_rpc.cli.usage import UsageError

    with pytest.raises(UsageError, match="--api-key.*without auth"):
        serve_settings(serve_args("--api-key", "k"), env={})
    with pytest.raises(SystemExit):  # argparse: an argument no llama.cpp knows
        serve_args("--frobnicate")


def test_fleet_settings_become_the_engines_model_params():
    s = parse_llama_argv(["--ctx-size", "320000", "--parallel", "2", "--kv-unified", "--rope-scaling", "yarn",
                          "--rope-scale", "5", "-ngl", "all", "--n-cpu-moe", "8", "-ot", "a=CPU,b=CPU", "--threads",
                          "-1", "--reasoning", "on", "--chat-template-kwargs", '{"preserve_thinking": true}'], env={})
    p = model_params(s, "m.gguf")
    assert (p.n_ctx, p.n_slots, p.kv_unified, p.rope_scaling, p.rope_freq_scale) == (320000, 2, True, "yarn", 0.2)
    assert (p.gpu_layers, p.n_cpu_moe, p.override_tensor, p.n_threads) == ("all", 8, (("a", "CPU"), ("b", "CPU")),
                                                                          None)
    assert p.template_kwargs == {"preserve_thinking": True, "enable_thinking": True, "preserve_reasoning": True}


def test_sampling_arguments_become_the_t1_defaults():
    from engine.sampling import merge_sampling
    from hydra_rpc.cli.llama_cli import engine_config

    s = parse_llama_argv(["--temp", "0.86", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.1",
                          "--repeat-penalty", "1.06", "--seed", "7", "-n", "64", "--prio-batch", "1"], env={})
    cfg = engine_config(s, "m.gguf")
    sp = merge_sampling(cfg.defaults)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.penalty_repeat, sp.seed) == \
        (pytest.approx(0.86), 20, pytest.approx(0.95), pytest.approx(0.1), pytest.approx(1.06), 7)
    assert cfg.defaults["n_predict"] == 64 and cfg.thread_nice == -5  # --prio-batch 1: llama.cpp's medium


# ---------------------------------------------------------------------- a context's KV cache
@pytest.fixture(scope="module")
def fleet_model(tiny_model_b_path):
    from engine.llama_backend.build import load
    from engine.model_params import ModelParams

    m = load(ModelParams(tiny_model_b_path, n_ctx=512, n_slots=2, flash_attn="on", cache_type_k="q8_0",
                         cache_type_v="q8_0", n_threads=1))
    yield m
    m.close()


def state_of(m, prompt: str = "Sphinx of black quartz") -> bytearray:
    from engine.backend import BatchItem

    toks = m.tokenize(prompt)
    m.seq_clear(1)
    m.decode([BatchItem(1, toks, 0)])
    return bytearray(m.state_seq_get(1))


def test_a_context_describes_its_kv_cache_from_what_it_writes(fleet_model):
    kv = fleet_model.kv_cache
    d = kv.as_dict
    assert (d["type_k"], d["type_v"], d["flash_attn"], d["v_trans"], d["kv_unified"], d["n_stream"]) == \
        ("q8_0", "q8_0", "on", False, True, 1)
    assert (d["n_ctx"], d["n_ctx_slot"]) == (512, 512) and kv.head_dim == (32, 32)
    assert d["attn_rotation"] == {"k": False, "v": False}  # head dim 32: llama.cpp rotates only multiples of 64
    assert len(kv.layout.caches) == 1 and len(kv.layout.caches[0].n_embd_k) == 3
    assert kv.check_state(state_of(fleet_model)).cell_count > 3


def test_a_state_is_checked_against_the_context_before_llama_cpp_sees_it(fleet_model):
    kv, blob = fleet_model.kv_cache, state_of(fleet_model)
    off_cells = 16  # magic, seq_id, n_stream, cell_count
    bomb = bytearray(blob)
    bomb[off_cells:off_cells + 4] = (2**31 - 1).to_bytes(4, "little")  # first cell's position
    with pytest.raises(MalformedPayload) as e:
        kv.check_state(bomb)
    assert e.value.rule == "seq.pos"
    with pytest.raises(Truncated):
        kv.check_state(blob[:-7])
    f16 = bytearray(blob)
    n = int.from_bytes(blob[12:16], "little")
    k_type_at = off_cells + 12 * n + 8  # after the cells: v_trans, n_layer, then layer 0's K type
    f16[k_type_at:k_type_at + 4] = (1).to_bytes(4, "little")
    with pytest.raises(KvStateMismatch) as m:
        kv.check_state(f16)
    assert m.value.as_meta() == {"error": "kv_state_mismatch", "field": "type_k", "got": "f16", "want": "q8_0"}


@pytest.mark.asyncio
async def test_configure_refuses_a_context_llama_cpp_could_not_build(tiny_model_path, monkeypatch):
    from engine import kv_layout
    from engine.api import EngineApi
    from engine.config import EngineConfig
    from engine.model_params import ModelParams

    eng = EngineApi(EngineConfig(model=ModelParams(tiny_model_path, n_ctx=512, n_slots=2, n_threads=1),
                              low_priority=False))
    await eng.start()
    try:
        gen = eng.generation
        out = await eng.configure({"cache_type_k": "q8_0"})  # this model's heads have 16 elements
        assert "multiple of 32 elements; this model's have 16" in out.rejected_keys["cache_type_k"]
        monkeypatch.setattr(kv_layout, "available_memory", lambda: 1 << 20)
        out = await eng.configure({"n_ctx": 1 << 20, "top_k": 5})
        assert "needs 256 MiB; 1 MiB of memory is available" in out.rejected_keys["n_ctx"], out.rejected_keys
        assert out.params_applied == {"sampling.top_k": 5} and out.reload_ticket is None and out.tier == "T1"
        assert eng.generation == gen + 1 and eng.n_ctx_slot == 512  # only the T1 key applied
    finally:
        await eng.stop()


def test_builtin_chat_formats_are_llama_cpps(tiny_model_path):
    from engine.llama_backend import LoadedModel

    msgs = [{"role": "user", "content": "hi"}]
    with LoadedModel(tiny_model_path, n_ctx=256, n_seq_max=1, n_threads=1, chat_template="chatml") as m:
        assert m.chat_format == "builtin"
        assert m.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------- HTTP switches, INFO
@pytest.mark.asyncio
async def test_disabled_endpoints_answer_501_as_llama_server(tiny_model_path):
    from engine.config import EngineConfig
    from engine.model_params import ModelParams
    from hydra_rpc.app import App
    from hydra_rpc.config import ServerConfig
    from hydra_rpc.http.app import start_http

    app = App(ServerConfig(host="127.0.0.1", port=0, http_metrics=False, http_slots=False),
              EngineConfig(model=ModelParams(tiny_model_path, n_ctx=256, n_slots=1)))
    http = await start_http(app.services, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{http.address[1]}") as s:
            for path, flag in (("/metrics", "--metrics"), ("/slots", "--slots")):
                async with s.get(path) as r:
                    body = await r.json()
                    assert r.status == 501 and flag in body["error"]["message"]
                    assert body["error"]["type"] == "not_supported_error"
    finally:
        await http.cleanup()


@pytest.mark.asyncio
async def test_quant_swap_is_advertised_only_with_a_model_alias():
    from hydra_rpc.hydra.engine_meta import info_meta
    from tests.engine_env import scripted_engine

    async with scripted_engine(aliases={}) as env:
        assert "quant_swap" not in info_meta(env.engine.info())["capabilities"]
    async with scripted_engine() as env:
        assert "quant_swap" in info_meta(env.engine.info())["capabilities"]


@pytest.mark.asyncio
async def test_context_shift_on_a_real_model(tiny_model_path):
    from engine.api import EngineApi
    from engine.config import EngineConfig
    from engine.jobs import GenRequest
    from engine.model_params import ModelParams
    from engine.sampling import GREEDY

    eng = EngineApi(EngineConfig(model=ModelParams(tiny_model_path, n_ctx=256, n_slots=1, n_threads=1,
                                                context_shift=True), low_priority=False))
    await eng.start()
    try:
        job = eng.submit(GenRequest(0, prompt="one two three", n_predict=600, sampling=GREEDY))
        res = await job.result()
        assert res.stop_reason == "length" and res.tokens_generated == 600 and res.n_past < 256
    finally:
        await eng.stop()


def test_a_context_that_cannot_be_built_is_refused_before_llama_cpp_allocates(tiny_model_path, monkeypatch):
    from engine.llama_backend import LlamaBackendError
    from engine.llama_backend import build
    from engine.model_params import ModelParams

    with pytest.raises(LlamaBackendError, match="do not fit this model's attention heads"):
        build.load(ModelParams(tiny_model_path, n_ctx=256, n_slots=1, cache_type_k="q8_0"))  # heads of 16
    monkeypatch.setattr(build, "available_memory", lambda: 1 << 20)
    with pytest.raises(LlamaBackendError, match=r"a KV cache of 65536 cells needs 16 MiB .* 1 MiB of memory"):
        build.load(ModelParams(tiny_model_path, n_ctx=65536, n_slots=1))
