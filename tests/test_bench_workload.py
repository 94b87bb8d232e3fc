"""The HTTP workload ``vs-llama-server`` runs (tools/bench/openai_workload.py) against a real
server of ours: completions, chat completions and the prompt-cache phase are counted the way
the bench reports them, and the scenario's chart draws from a scripted result."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from tools.bench import openai_workload as w

SERVER_ARGS = ("--model", "tiny", "--slots", "4", "--threads", "1", "--log-level", "WARNING")
pytestmark = pytest.mark.timeout(120)


@pytest_asyncio.fixture
async def session():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        yield s


def base(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def test_a_chunk_is_counted_by_its_text_whichever_endpoint_sent_it():
    assert w._chunk_text({"text": "a"}) == "a"
    assert w._chunk_text({"delta": {"content": "b"}}) == "b"
    assert w._chunk_text({"delta": {"reasoning_content": "c"}}) == "c"
    call = {"index": 0, "function": {"name": "read_file", "arguments": ""}}
    assert w._chunk_text({"delta": {"tool_calls": [call]}}) == "read_file"
    assert w._chunk_text({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"p"}}]}}) == '{"p'
    assert w._chunk_text({"delta": {"role": "assistant"}}) == "" and w._chunk_text({"text": ""}) == ""


@pytest.mark.asyncio
async def test_completion_and_chat_streams_are_timed_per_chunk(server, session):
    one = await w.completion(session, base(server), w.story(1), 12)
    chat = await w.chat(session, base(server), 1, 12)
    for r in (one, chat):
        assert 1 <= r["chunks"] <= 12 and len(r["times"]) == r["chunks"], r
        assert r["ttft_ms"] > 0 and r["times"] == sorted(r["times"]) and r["finish"] in ("length", "stop")
        assert r["completion_tokens"] >= r["chunks"]
    four = await w.concurrent(session, base(server), [2, 3, 4, 5], 12, use_chat=True)
    assert len(four) == 4 and all(r["chunks"] for r in four)
    stripped = w.strip(one)
    assert "times" not in stripped and len(stripped["chunk_ms"]) == one["chunks"]


@pytest.mark.asyncio
async def test_the_shared_document_fits_its_token_limit_and_is_asked_cold_then_cached(server, session):
    doc = await w.shared_document(session, base(server), 7, 150)
    tokens = await w.count_tokens(session, base(server), doc)
    assert 100 < tokens <= 151  # the longest prefix of whole lines within the limit (+ the newline)
    assert doc == await w.shared_document(session, base(server), 7, 150)  # the same text for both servers
    phase = await w.prompt_cache_phase(session, base(server), 7, 150)
    assert phase["prefix_tokens"] > tokens and len(phase["cached"]) == w.CACHED_REQUESTS
    assert phase["cold_ttft_ms"] > 0 and phase["cached_ttft_ms"] > 0


@pytest.mark.asyncio
async def test_slots_under_load_reads_slots_while_four_longer_streams_decode(server, session):
    from tools.bench import vs_llama_server as vs

    # a phase of 0.2 s for 200 tokens asks for 1.5 s: 1,500 tokens; a long one changes nothing
    assert vs.slots_phase_tokens(200, 0.2) == 1500 and vs.slots_phase_tokens(200, 8.0) == 200
    assert vs.slots_phase_tokens(200, 0.0) == vs.SLOTS_LOAD_MAX_TOKENS
    phase, answers = await vs.slots_under_load(session, base(server), 7, 4, 10.0, 3, want=1)  # 4 tokens a stream
    assert phase["max_tokens"] == 4 and phase["four_phase_answers"] == 3 and phase["tokens"] > 0
    assert phase["repeats"] == 1 and answers and all(ms > 0 for ms in answers)  # the first read is at once
    # too few answers: four new streams again, up to the bound
    phase, more = await vs.slots_under_load(session, base(server), 7, 4, 10.0, 3, want=10_000)
    assert phase["repeats"] == vs.SLOTS_LOAD_REPEATS and len(more) >= vs.SLOTS_LOAD_REPEATS


@pytest.mark.asyncio
async def test_the_slots_poller_answers_latencies_and_a_refusal_stops_the_bench():
    """``/slots`` is read by ``tools/bench/slots_poll.py`` in a process of its own (the bench's
    loop parses the streams meanwhile): its answers come back as latencies, a non-200 answer as
    the bench's error."""
    from tools.bench.common import BenchError

    def answering(status: int):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\n[]".encode())
            await writer.drain()
            writer.close()
        return handle

    for status in (200, 503):
        server = await asyncio.start_server(answering(status), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        work = asyncio.sleep(0.05, result="done")  # the poller reads at once, then every 10 ms
        try:
            if status == 200:
                result, answers = await w.while_polling_slots(f"http://127.0.0.1:{port}", work, 0.01)
                assert result == "done" and answers and all(ms > 0 for ms in answers)
            else:
                with pytest.raises(BenchError, match="/slots answered 503"):
                    await w.while_polling_slots(f"http://127.0.0.1:{port}", work, 0.01)
        finally:
            server.close()
            await server.wait_closed()


def test_the_chart_draws_every_figure_as_an_advantage(tmp_path):
    from tools.bench.common import Result
    from tools.bench.plots import draw_all
    from tools.bench.vs_llama_server_figures import FIGURES, report

    def rnd(variant, i):
        r = {key: 10.0 + i for key, *_ in FIGURES}
        r.update(variant=variant, round=i, peak_rss_mib=410.0, startup_s=1.0, slots_ms=[1.0, 2.0, 3.0],
                 cpu_four={"cores_busy": 1.5, "cpu_ms_per_token": 20.0, "main_thread_s": 1.0, "cpu_s": 10.0},
                 requests={k: {"finish": "length"} for k in ("single", "four", "eight", "chat_one", "chat_four")})
        return r

    res = Result("vs-llama-server")
    res.samples = {"rounds": [rnd(v, i) for i in range(2) for v in ("llama-server", "hydra")],
                   "pairs": {"one": [{"pair": 0, "llama-server": 40.0, "hydra": 41.0,
                                      "llama-server_finish": "length", "hydra_finish": "length"}]}}
    res.samples["rounds"][0]["slots_phase"] = {"max_tokens": 1500, "four_phase_answers": 4}
    control = {"one": [{"pair": 0, "llama-server": 40.0, "llama-server-2": 40.4}]}
    report(res, res.samples["rounds"], 2, res.samples["pairs"], control)
    assert res.summary["control"]["one_paired_tok_s"]["ratios"] == [1.01]
    assert any("four streams of up to 1500 tokens" in n for n in res.notes)
    skipped = Result("vs-llama-server")
    skipped.summary = {"skipped": "not built"}
    assert [p.name for p in draw_all([res], tmp_path)] == ["vs-llama-server.png"]
    assert (tmp_path / "vs-llama-server.png").stat().st_size > 1000
    (tmp_path / "vs-llama-server.png").unlink()
    assert draw_all([skipped], tmp_path) == [] and not (tmp_path / "vs-llama-server.png").exists()


def _bare_gguf(path, arch: str) -> str:
    """A GGUF file with an architecture and no chat template (no tensors: only its header is read)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_model_file_without_a_chat_template_gets_one_template_for_both_servers(tmp_path, tiny_model_path):
    """Left to themselves llama-server would render ChatML and this server Gemma turns (Gemma 3
    270M's file has no template): vs-llama-server gives both the same file, and the Gemma one
    renders what this server's own fallback renders."""
    from engine.llama_backend.chat_template import ChatTemplate
    from tools.bench import vs_llama_server as vs

    assert vs.chat_template_args(tiny_model_path) == ()  # the file's own template serves both
    gemma = vs.chat_template_args(_bare_gguf(tmp_path / "g.gguf", "gemma3"))
    assert vs._shown(gemma) == ["--chat-template-file", "tools/bench/templates/gemma-turns.jinja"]
    assert vs._shown(vs.chat_template_args(_bare_gguf(tmp_path / "l.gguf", "llama"))) == [
        "--chat-template-file", "tools/bench/templates/chatml.jinja"]
    argv = vs.llama_argv("M", 1, 4, 2, gemma)
    assert argv[-2:] == list(gemma) and argv[:2] == ["-m", "M"]

    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]
    own = ChatTemplate(None, "gemma3").render(conversation, True, bos_token="<bos>", eos_token="<eos>")
    bench = ChatTemplate(Path(gemma[1]).read_text(), "gemma3").render(conversation, True, bos_token="<bos>",
                                                                  eos_token="<eos>")
    assert bench == own == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello"
                            "<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    chatml = ChatTemplate((vs.TEMPLATES / "chatml.jinja").read_text(), "llama").render(
        conversation[1:2], True, bos_token="<s>", eos_token="</s>")
    assert chatml == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_idle_gap_client_times_a_real_first_token(server):
    """tools/bench/ttft_gaps.py's blocking client against a real server: a first token per
    request, a block per gap and server, the uncounted first request left out."""
    from tools.bench.ttft_gaps import first_token_ms, measure, summarize_gaps

    assert first_token_ms(server.http_port, "Once upon a time") > 0
    samples = measure({"ours": server.http_port}, [0.0, 1.0], 2, 1)
    assert {gap: len(by["ours"]) for gap, by in samples.items()} == {"0.0": 2, "1.0": 2}
    assert all(ms > 0 for by in samples.values() for ms in by["ours"])
    assert summarize_gaps(samples, base="ours")["1.0"]["ours"]["ratio"] == 1.0


@pytest.mark.parametrize("kind", ["tiny", "tiny-hybrid"])
def test_the_bare_completion_floor_streams_what_a_completion_streams(kind):
    """tools/bench/bare_completion.py, ttft_gaps' floor, in its own process on the tiny model:
    ready on ``GET``, then each streamed completion at most ``max_tokens`` SSE events of text and the
    ``[DONE]`` end, on a chunked body, the connection closed after it — twice, the second prompt
    sharing the first's prefix in the KV cache. On the hybrid (recurrent) model that prefix cannot
    be cut back to: the floor computes the prompt again (it hung, its inference thread gone)."""
    import json
    import socket

    from engine.model_files import resolve_model
    from tools.bench.ttft_gaps import bare_server, first_token_ms

    srv = bare_server(str(resolve_model(kind)), 1)
    def complete(prompt: str) -> tuple[bytes, bytes]:
        body = json.dumps({"prompt": prompt, "max_tokens": 3, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        return head, rest

    try:
        assert first_token_ms(srv.port, "Once upon a time") > 0
        # a prompt longer than the context fails on the inference thread: an error, and the next one served
        assert complete("word " * 9000)[0].startswith(b"HTTP/1.1 500")
        for prompt in ("Once upon a time there", "Once upon a time there was"):
            head, rest = complete(prompt)
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
            events = [ln[6:].rstrip(b"\n") for ln in rest.split(b"\r\n") if ln.startswith(b"data: ")]
            assert events[-1] == b"[DONE]" and 2 <= len(events) <= 4  # fewer: the model ended
            assert all("text" in json.loads(e)["choices"][0] for e in events[:-1])
            assert rest.endswith(b"0\r\n\r\n")
    finally:
        srv.stop()


@pytest.mark.asyncio
async def test_the_rss_floor_serves_the_same_requests_on_ours_and_a_bare_python_server(tiny_model_path, session):
    """vs-llama-server's floor: each server on a fresh process, the same requests (a long
    document among them, its text from ours' tokenizer), then its RSS — the bare Python server
    answers them all, so its figure is of the same work."""
    from tools.bench.common import BenchContext
    from tools.bench.models import model_set
    from tools.bench.vs_llama_server import rss_floor
    from tools.bench.vs_llama_server_figures import FLOOR, OURS

    ctx = BenchContext(quick=False, models=model_set("tiny"), reps=1, threads=1)  # a document > n_batch
    floor = await asyncio.wait_for(rss_floor(ctx, session, "", tiny_model_path, 8, (OURS, FLOOR)), 60)
    assert set(floor) == {OURS, FLOOR}
    for side in floor.values():
        assert side["rss_mib"] > 10 and side["peak_rss_mib"] >= side["rss_mib"]
        assert side["rss_detail_mib"]["Rss"] > 0 and "Anonymous" in side["rss_detail_mib"]


def test_the_idle_gap_bench_runs_ours_from_another_checkout(tiny_model_path):
    """``ttft_gaps --against TREE``: ours started from that tree (here this one), named by its
    commit, answers a streamed completion."""
    import re

    from tools.bench.common import git_commit
    from tools.bench.ttft_gaps import first_token_ms
    from tools.bench.vs_llama_server import start
    from tools.spawn import ROOT

    name = f"ours at {git_commit(ROOT, mark_dirty=False)}"
    assert re.fullmatch(r"ours at [0-9a-f]{7,}", name)
    srv = start("ours", "", tiny_model_path, 4, 1, root=ROOT)
    try:
        assert first_token_ms(srv.port, "Once upon a time") > 0
    finally:
        srv.stop()


def test_the_http_floor_bench_times_health_on_ours_and_on_its_minimal_servers(server):
    """tools/bench/http_floor.py: its blocking client against a real server of ours and each
    minimal server (its own processes): a block of requests each, with the server's CPU per
    request, summarized against one of them."""
    from types import SimpleNamespace

    from tools.bench import http_floor as hf
    from tools.bench.llama_server import servers_running

    ours = SimpleNamespace(port=server.http_port, pid=server.pid)  # what the bench reads of a server
    assert hf.health_us(server.http_port) > 0
    with servers_running({k: lambda k=k: hf._minimal(k) for k in hf.MINIMAL}) as minimal:
        samples = hf.measure({"ours": ours, **minimal}, 3, 1)
    assert {k: (len(s["wall_us"]), len(s["cpu_us"])) for k, s in samples.items()} == {
        k: (3, 1) for k in ("ours", *hf.MINIMAL)}
    assert all(min(s["wall_us"]) > 0 and s["cpu_us"][0] > 0 for s in samples.values())
    summary = hf.summarize(samples, base="ours")
    assert summary["ours"]["wall_ratio"] == summary["ours"]["cpu_ratio"] == 1.0
    assert "| our HTTP server |" in hf.runs_table([{"summary": summary}])


@pytest.mark.asyncio
async def test_the_agent_turns_bench_sends_growing_conversations_that_reuse_the_cache():
    """tools/bench/agent_turns.py against a real server of ours on a fleet kind (tiny-hybrid,
    Qwen 3.5's template): two agents at once, a reply each per turn, timed; from the second
    counted turn on, most of each prompt is served from the cache (a checkpoint on this kind)."""
    from tests.helpers import serving
    from tools.bench import agent_turns as at

    with serving("--model", "tiny-hybrid", "--parallel", "2", "--ctx-size", "16384",
                 "--chat-template-file", str(at.TEMPLATE), "--log-level", "WARNING") as sp:
        samples = await at.measure({"ours": f"http://127.0.0.1:{sp.http_port}"}, agents=2, turns=2, max_tokens=4)
    turns = samples["ours"]
    assert len(turns) == 2 and all(len(t["ttft_ms"]) == 2 and min(t["ttft_ms"]) > 0 for t in turns)
    assert all(t["wall_ms"] >= max(t["ttft_ms"]) and t["tokens"] == [4, 4] for t in turns)
    last = turns[-1]
    assert all(0 < n < cached for n, cached in zip(last["prompt_n"], last["cache_n"])), last
    summary = at.summarize_turns(samples, base="ours")
    assert summary["wall_ms"]["ours"]["ratio"] == 1.0 and summary["prompt_n"][0] > 0


@pytest.mark.asyncio
async def test_the_swap_stall_bench_times_a_stream_while_agents_take_the_other_slot():
    """tools/bench/swap_stall.py's round against a real server of ours (tiny-hybrid, Qwen 3.5's
    template, two slots): the stream's tokens keep coming through the agents' turns, which
    come back from the RAM tier at their checkpoints from their second step on."""
    from tests.helpers import serving
    from tools.bench import agent_turns as at
    from tools.bench.swap_stall import one_round

    with serving("--model", "tiny-hybrid", "--parallel", "2", "--ctx-size", "32768",
                 "--chat-template-file", str(at.TEMPLATE), "--log-level", "WARNING") as sp:
        got = await one_round(f"http://127.0.0.1:{sp.http_port}", 100, agents=2, steps=3)
    assert got["tokens_in_window"] > 2 and len(got["turns_ms"]) == 6
    assert 0 < got["gap_median_ms"] <= got["gap_p99_ms"] <= got["gap_max_ms"]
    later = got["cache_n"][2:]  # each agent's second and third steps
    assert all(n > earlier for n, earlier in zip(later[2:], later)), got["cache_n"]


@pytest.mark.asyncio
async def test_the_behind_long_prompt_bench_times_a_short_request_sent_during_a_long_one():
    """tools/bench/behind_long_prompt.py's round against a real server of ours (tiny-hybrid,
    two slots, ``-b 64``): both requests answer, the long prompt is the length the round asked
    for, and it was sent (and the short one after it) before either answered."""
    from tests.helpers import serving
    from tools.bench.behind_long_prompt import one_round

    with serving("--model", "tiny-hybrid", "--parallel", "2", "--ctx-size", "16384", "--batch-size", "64",
                 "--log-level", "WARNING") as sp:
        got = await asyncio.wait_for(one_round(f"http://127.0.0.1:{sp.http_port}", 7, words=60, delay=0.0), 120)
    assert got["long_prompt_tokens"] > 10 * 64 and got["short_ms"] > 0 and got["long_ms"] > 0
    assert got["short_sent_before_long_ended"]
