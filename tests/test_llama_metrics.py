"""llama-server's ``llamacpp:*`` families on ``GET /metrics``, scraped from a real server
during a decode and parsed with prometheus-client's own parser.

The reference list is llama-server's source: ``tests/data/llama_server_metrics.cpp`` is the
``to_metrics`` function of the pinned llama.cpp (``LLAMA_CPP_SRC=<llama.cpp checkout>`` reads
the full ``tools/server/server-task.cpp`` instead).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import long_chat

SERVER_ARGS = ("--model", "tiny", "--parallel", "2", "--threads", "1", "--log-level", "WARNING")
pytestmark = pytest.mark.timeout(120)

# what the fleet's Grafana dashboard queries
DASHBOARD = ("llamacpp_kv_cache_usage_ratio", "llamacpp_prompt_tokens_total", "llamacpp_requests_processing",
             "llamacpp_tokens_predicted_total")
OLDER_BUILDS = {"kv_cache_usage_ratio": "gauge", "kv_cache_tokens": "gauge"}


def source_list() -> dict[str, tuple[str, str]]:
    """name → (type, help) from llama-server's ``to_metrics``."""
    src = os.environ.get("LLAMA_CPP_SRC")
    path = (Path(src) / "tools/server/server-task.cpp" if src
            else Path(__file__).parent / "data" / "llama_server_metrics.cpp")
    text = path.read_text()
    body = text[text.index("server_task_result_metrics::to_metrics"):]
    out = {}
    for kind, block in (("counter", "counters"), ("gauge", "gauges")):
        part = body[body.index(f"metric_item> {block}"):]
        part = part[:part.index("};")]
        for name, doc in re.findall(r'\{\s*"(\w+)",\s*"([^"]*)"', part):
            out[name] = (kind, doc)
    assert len(out) >= 15, "the source's metric list was not found"
    return out


def families(text: str) -> dict[str, tuple[str, str, list]]:
    """family name and sample name → (type, help, samples) of every family in the scrape
    (the parser names a counter's family without ``_total`` and its sample with it)."""
    out: dict[str, tuple[str, str, list]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, fam.documentation, fam.samples)
        for s in fam.samples:
            out.setdefault(s.name, (fam.type, fam.documentation, []))
            if out[s.name][2] is not fam.samples:
                out[s.name][2].append(s)
    out["_text"] = ("", text, [])
    return out


async def scrape(http) -> dict:
    async with http.get("/metrics") as r:
        assert r.status == 200
        return families(await r.text())


def family_name(name: str, kind: str) -> str:
    return name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name


@pytest.mark.asyncio
async def test_llamacpp_families_match_llama_server_during_a_decode(http):
    want = source_list()
    async with long_chat(http, 0):
        # the tokens counter moves while the decode runs: poll two scrapes apart
        first = await scrape(http)
        for _ in range(2000):
            got = await scrape(http)
            if got["llamacpp:tokens_predicted_total"][2][0].value > first["llamacpp:tokens_predicted_total"][2][0].value:
                break
        else:
            raise AssertionError("llamacpp:tokens_predicted_total did not move during a decode")
        for name, (kind, doc) in want.items():
            full = "llamacpp:" + family_name(name, kind)
            assert full in got, f"{full} missing"
            assert got[full][:2] == (kind, doc), full
            # written exactly as llama-server writes it (the parser adds _total to a counter)
            assert f"\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} " in got["_text"][1], name
        for name, kind in OLDER_BUILDS.items():
            assert got["llamacpp:" + name][0] == kind
        # the dashboard's four queries each find a series, and the busy slot shows
        for name in DASHBOARD:
            assert name in got and len(got[name][2]) == 1, name
        assert got["llamacpp_requests_processing"][2][0].value == 1
        assert got["llamacpp:requests_processing"][2][0].value == 1
        assert 0 < got["llamacpp_kv_cache_usage_ratio"][2][0].value <= 1
        assert got["llamacpp_prompt_tokens_total"][2][0].value >= 1
        assert got["llamacpp:n_decode_total"][2][0].value >= 1
        assert got["llamacpp:n_busy_slots_per_decode"][2][0].value >= 1
        assert got["llamacpp:predicted_tokens_seconds"][2][0].value >= 0
    # our own families are still there beside them
    after = await scrape(http)
    assert "hydra_tokens_generated_total" in after
    assert after["llamacpp:requests_processing"][2][0].value == 0
    assert after["llamacpp:n_tokens_max"][2][0].value >= 2


def test_the_underscore_twins_follow_the_setting(monkeypatch):
    from types import SimpleNamespace

    from hydra_rpc.config import ServerConfig
    from hydra_rpc.observability.metrics_llama import LlamaMetrics

    stats = dict.fromkeys(("prompt_tokens", "prompt_seconds", "tokens_generated", "predicted_seconds",
                           "prompt_tokens_cached", "n_decode", "n_tokens_max", "n_busy_slots"), 0)
    engine = SimpleNamespace(ready=True, stats=stats, snapshots=(), kv_cache=None, queued_unassigned=0,
                             erases_waiting=0)
    monkeypatch.setenv("HYDRA_METRICS_UNDERSCORE", "0")
    assert ServerConfig().metrics_underscore is False  # read when the settings are built
    monkeypatch.delenv("HYDRA_METRICS_UNDERSCORE")
    assert ServerConfig().metrics_underscore is True
    both, colons = LlamaMetrics(True).render(engine), LlamaMetrics(False).render(engine)
    assert "llamacpp_requests_processing 0" in both and "llamacpp:requests_processing 0" in both
    assert "llamacpp_" not in colons and "llamacpp:requests_processing 0" in colons
