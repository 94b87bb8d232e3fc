"""llama-server's ``llamacpp:*`` metrics, beside our ``hydra_*`` ones on ``GET /metrics``.

Same names, types, help text and meaning as ``server_task_result_metrics::to_metrics`` in the
pinned llama.cpp (tools/server/server-task.cpp), rendered as that function renders them — by
hand, because prometheus-client would append ``_total`` to every counter, and llama-server's
``llamacpp:n_tokens_max`` is a counter without it. Values come from the engine's own counters
(``EngineApi.stats``, filled by the scheduler and the stepper) and its published snapshots, so a
scrape never enters the engine's mailbox.

Two families older llama-server builds exported are added, because dashboards still read them:
``kv_cache_usage_ratio`` (cells in use / cells of the context) and ``kv_cache_tokens``.

**Underscore twins.** Prometheus keeps ``:`` in a name, but pipelines that translate metrics
(the OpenTelemetry Collector's Prometheus receiver and exporters, hosted agents) rewrite every
character outside ``[a-zA-Z0-9_]`` to ``_``: ``llamacpp:prompt_tokens_total`` arrives as
``llamacpp_prompt_tokens_total``, the name the fleet dashboard queries. Each family is
therefore also exported under that spelling, so the dashboard's queries work on a plain
Prometheus scrape too. ``HYDRA_METRICS_UNDERSCORE=0`` turns the twins off (a translating
pipeline would otherwise see every series twice).
"""
from __future__ import annotations

from typing import Any

# (name, help) in llama-server's order; ``value`` reads them from a sample of the engine
COUNTERS = (
    ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "Total time spent processing prompts"),
    ("tokens_predicted_total", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("n_decode_total",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
)
GAUGES = (
    ("prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("requests_processing", "Number of requests processing"),
    ("requests_deferred", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
    # older builds (b3xxx–b5xxx), still read by dashboards
    ("kv_cache_usage_ratio", "KV-cache usage. 1 = 100 percent usage."),
    ("kv_cache_tokens", "KV-cache tokens."),
)


class LlamaMetrics:
    """Renders the families; remembers the previous scrape for the two throughput gauges,
    which llama-server averages over the "bucket" its own ``/metrics`` call resets."""

    def __init__(self, underscore: bool = True) -> None:
        self.underscore = underscore  # also render llamacpp_* twins (ServerConfig.metrics_underscore)
        self._bucket = (0, 0.0, 0, 0.0)  # prompt tokens, prompt s, predicted tokens, predicted s

    def values(self, engine: Any) -> dict[str, float]:
        st = engine.stats
        snaps = engine.snapshots
        prompt_n, prompt_s = st["prompt_tokens"], st["prompt_seconds"]
        pred_n, pred_s = st["tokens_generated"], st["predicted_seconds"]
        b = self._bucket
        self._bucket = (prompt_n, prompt_s, pred_n, pred_s)
        used = sum(s.n_past for s in snaps)
        kv = engine.kv_cache
        n_ctx = kv.n_ctx if kv is not None else 0
        return {
            "prompt_tokens_total": prompt_n,
            "prompt_tokens_cached_total": st["prompt_tokens_cached"],
            "prompt_seconds_total": prompt_s,
            "tokens_predicted_total": pred_n,
            "tokens_predicted_seconds_total": pred_s,
            "n_decode_total": st["n_decode"],
            "n_tokens_max": max([st["n_tokens_max"], *(s.n_past for s in snaps)]),
            "spec_decode_num_draft_tokens_total": 0,  # no speculative decoding here
            "spec_decode_num_accepted_tokens_total": 0,
            "spec_decode_num_drafts_total": 0,
            "prompt_tokens_seconds": _per_s(prompt_n - b[0], prompt_s - b[1]),
            "predicted_tokens_seconds": _per_s(pred_n - b[2], pred_s - b[3]),
            "requests_processing": sum(1 for s in snaps if s.is_processing),
            # jobs waiting for a slot, and erases waiting for a busy one (engine/erase.py)
            "requests_deferred": (sum(s.queued for s in snaps) + engine.queued_unassigned
                                  + engine.erases_waiting),
            "n_busy_slots_per_decode": st["n_busy_slots"] / max(st["n_decode"], 1),
            "kv_cache_usage_ratio": used / n_ctx if n_ctx else 0.0,
            "kv_cache_tokens": used,
        }

    def render(self, engine: Any) -> str:
        if engine is None or not engine.ready:
            return ""  # llama-server has no /metrics before its model is loaded either
        v = self.values(engine)
        prefixes = ("llamacpp:", "llamacpp_") if self.underscore else ("llamacpp:",)
        out: list[str] = []
        for prefix in prefixes:
            for kind, items in (("counter", COUNTERS), ("gauge", GAUGES)):
                for name, doc in items:
                    out.append(f"# HELP {prefix}{name} {doc}\n# TYPE {prefix}{name} {kind}\n"
                               f"{prefix}{name} {_num(v[name])}\n")
        return "".join(out)


def _per_s(n: float, seconds: float) -> float:
    return n / seconds if n > 0 and seconds > 0 else 0.0


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))
