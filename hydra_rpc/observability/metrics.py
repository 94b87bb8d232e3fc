"""Prometheus metrics for ``GET /metrics``.

Two kinds of series:

* **event series**, observed when something happens: Hydra requests (by op and status,
  duration histogram per op, payload bytes), HTTP requests (by route, method, code) and
  HTTP generations (by finish reason). The Hydra server calls :meth:`Metrics.observe_request`
  once per request; the HTTP side calls :meth:`observe_http` / :meth:`observe_generation`.
* **llama-server's** ``llamacpp:*`` families (``metrics_llama.py``), appended to the text.
* **state series**, read from the shared services at scrape time by :class:`_StateCollector`: tokens
  generated (the engine's own counter, so RPC and HTTP work both count), slots busy/queued,
  reload state and timings, open connections, ggml-RPC passthrough bytes. Reading at scrape
  time means nothing has to remember to update a gauge, and a scrape never enters the
  engine's mailbox (snapshots and plain attributes only).

Each ``Metrics`` has its own ``CollectorRegistry`` rather than the process-global one, so
several apps (tests run many in one process) never collide on metric names.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from codec.enums import Op

from hydra_rpc.observability.metrics_llama import LlamaMetrics

# Latency buckets from 100 µs (a STATE_META on loopback) to 5 min (a long DECODE).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RELOAD_STATES = ("idle", "loading", "draining", "swapped", "failed", "dropped")
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Every opcode byte a client may send would otherwise become its own series: a fuzzer could
# create 256 per metric. Opcodes the protocol never defined share one label value.
KNOWN_OPS = frozenset(o.name for o in Op)
UNKNOWN_OP = "unknown"
MAX_CACHED_SERIES = 512  # (op, status) pairs whose series are kept at hand (every real pair fits)


def _series(cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    """The labelled children of one request kind, made once: ``labels()`` takes a lock and
    builds a key on every call. The keys come from bounded sets; the cache is capped anyway."""
    series = cache.get(key)
    if series is None:
        series = make()
        if len(cache) < MAX_CACHED_SERIES:
            cache[key] = series
    return series


class Metrics:
    def __init__(self, llama_underscore: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("hydra_requests", "Hydra RPC requests answered, by opcode and status",
                                ["op", "status"], registry=r)
        self.duration = Histogram("hydra_request_duration_seconds",
                                  "Hydra RPC request duration (header read to last response byte), by opcode",
                                  ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.payload_bytes = Counter("hydra_request_payload_bytes", "Hydra RPC payload bytes, by opcode and direction",
                                     ["op", "direction"], registry=r)
        self.http_requests = Counter("hydra_http_requests", "HTTP requests answered, by route, method and code",
                                     ["route", "method", "code"], registry=r)
        self.http_duration = Histogram("hydra_http_request_duration_seconds",
                                       "HTTP request duration (a stream counts until its last chunk), by route",
                                       ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.generations = Counter("hydra_http_generations",
                                   "HTTP completions finished, by endpoint and finish reason (cancelled: the "
                                   "client went away)", ["endpoint", "reason"], registry=r)
        self._collector: _StateCollector | None = None
        self.llama = LlamaMetrics(llama_underscore)  # llama-server's llamacpp:* families, appended as it renders them
        # (op, status) → that request's series: ``labels()`` takes a lock and builds a key on
        # every call, a noticeable share of a STATE_META's server CPU; the op set is bounded
        self._request_series: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        self._http_series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    # ---------------------------------------------------------------- observers
    def observe_request(self, op_name: str, status_name: str, seconds: float, req_bytes: int,
                        resp_bytes: int) -> None:
        """Called by the Hydra connection loop once per answered request."""
        op = op_name if op_name in KNOWN_OPS else UNKNOWN_OP
        count, duration, bytes_in, bytes_out = _series(
            self._request_series, (op, status_name),
            lambda: (self.requests.labels(op, status_name), self.duration.labels(op),
                     self.payload_bytes.labels(op, "in"), self.payload_bytes.labels(op, "out")))
        count.inc()
        duration.observe(seconds)
        if req_bytes:
            bytes_in.inc(req_bytes)
        if resp_bytes:
            bytes_out.inc(resp_bytes)

    def observe_http(self, route: str, method: str, code: int, seconds: float) -> None:
        """``route``, ``method`` and ``code`` come from bounded sets (the routes' patterns, the
        known methods, the statuses this server answers): their series are kept as for requests."""
        count, duration = _series(self._http_series, (route, method, code),
                                  lambda: (self.http_requests.labels(route, method, str(code)),
                                           self.http_duration.labels(route)))
        count.inc()
        duration.observe(seconds)

    def observe_generation(self, endpoint: str, reason: str) -> None:
        self.generations.labels(endpoint, reason).inc()

    # ---------------------------------------------------------------- state at scrape time
    def bind(self, services: Any, http_connections: Callable[[], int] | None = None) -> None:
        """Read engine/server state from ``services`` (hydra_rpc.services) at every scrape (idempotent)."""
        if self._collector is None:
            self._collector = _StateCollector(services, http_connections)
            self.registry.register(self._collector)
        else:
            self._collector.services, self._collector.http_connections = services, http_connections

    def render(self) -> bytes:
        engine = self._collector.services.engine if self._collector is not None else None
        return generate_latest(self.registry) + self.llama.render(engine).encode()


class _StateCollector:
    """Gauges and engine-owned counters computed from the shared services when scraped.

    HTTP comes up before the engine finishes loading and before the Hydra server listens:
    the engine's reads answer for an engine that has no model yet, the server may be None.
    """

    def __init__(self, services: Any, http_connections: Callable[[], int] | None):
        self.services = services
        self.http_connections = http_connections

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time: the app may not be running yet

    def collect(self) -> Iterable[Metric]:
        server = self.services.hydra
        yield from self._engine(self.services.engine)
        conns = GaugeMetricFamily("hydra_connections_open", "Open client connections, by port", labels=["port"])
        if server is not None:
            conns.add_metric(["engine"], len(server.connections))
        if self.http_connections is not None:
            conns.add_metric(["http"], self.http_connections())
        yield conns
        if server is not None:
            pt = server.passthrough
            b = CounterMetricFamily("hydra_passthrough_bytes", "ggml-RPC passthrough bytes copied, by direction",
                                    labels=["direction"])
            b.add_metric(["up"], pt.bytes_up)
            b.add_metric(["down"], pt.bytes_down)
            yield b
            s = CounterMetricFamily("hydra_passthrough_sessions", "ggml-RPC passthrough sessions started")
            s.add_metric([], pt.sessions)
            yield s
            acc = CounterMetricFamily("hydra_engine_port_connections",
                                      "Engine-port connections: accepted, then by first bytes (hydra, ggml, "
                                      "closed_unknown) or refusal (refused_limit, refused_allow)", labels=["kind"])
            for kind, n in server.stats.items():
                acc.add_metric([kind], n)
            yield acc
        g = GaugeMetricFamily("hydra_decode_results_stored", "Merged DECODE results kept for GET /v1/decode/{id}")
        g.add_metric([], len(self.services.decode_results))
        yield g

    @staticmethod
    def _engine(engine: Any) -> Iterable[Metric]:
        stats = engine.stats
        for name, key, doc in (("hydra_tokens_generated", "tokens_generated", "Tokens generated (RPC and HTTP)"),
                               ("hydra_prompt_tokens", "prompt_tokens", "Prompt tokens decoded (cache hits excluded)"),
                               ("hydra_engine_steps", "steps", "Batched decode steps run"),
                               ("hydra_engine_jobs", "jobs", "Generation/prefill jobs admitted")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], stats.get(key, 0))
            yield c
        snaps = engine.snapshots
        slots = GaugeMetricFamily("hydra_slots", "Slots, by state (busy: generating or transferring state)",
                                  labels=["state"])
        busy = sum(1 for s in snaps if s.is_processing or s.is_transferring)
        slots.add_metric(["total"], len(snaps))
        slots.add_metric(["busy"], busy)
        slots.add_metric(["idle"], len(snaps) - busy)
        yield slots
        q = GaugeMetricFamily("hydra_slots_queued_jobs", "Generation jobs waiting for a busy slot (or for any)")
        q.add_metric([], sum(s.queued for s in snaps) + engine.queued_unassigned)
        yield q
        gen = GaugeMetricFamily("hydra_config_generation", "Config generation being served")
        gen.add_metric([], engine.generation)
        yield gen
        rl = engine.reload
        st = GaugeMetricFamily("hydra_reload_state", "Reload state (1 for the current one)", labels=["state"])
        for name in RELOAD_STATES:
            st.add_metric([name], 1.0 if rl.state == name else 0.0)
        yield st
        for name, value, doc in (
                ("hydra_reload_last_load_seconds", rl.load_ms / 1000, "Load time of the latest reload's new model"),
                ("hydra_reload_last_swap_seconds", rl.swap_ms / 1000, "Swap time of the latest reload"),
                ("hydra_reload_pending_seconds", (time.time() - rl.started_at) if rl.pending else 0.0,
                 "How long the pending reload has been pending (0: none)")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        up = GaugeMetricFamily("hydra_model_loaded", "1 when a model is loaded and serving")
        up.add_metric([], 1.0 if engine.startup_stage == "ready" else 0.0)
        yield up
        yield from _prompt_cache(engine.prompt_cache_info())
        yield from _compute_threads(engine.compute_threads_info())


def _compute_threads(ct: Any) -> Iterable[Metric]:
    """Fewer compute threads than configured is what a busy host costs decode (docs/performance.md,
    "A busy host"): how often and how long is what tells a slow node from a slow model."""
    threads = GaugeMetricFamily("hydra_compute_threads", "Compute threads per decode step: configured, and "
                                "what the last step used (fewer while other processes keep cores busy or a "
                                "model loads beside it)", labels=["kind"])
    threads.add_metric(["configured"], ct.configured)
    threads.add_metric(["current"], ct.current)
    yield threads
    others = GaugeMetricFamily("hydra_other_processes_cores", "Cores other processes kept busy in the last "
                               "sample the compute-thread count followed")
    others.add_metric([], ct.others_cores)
    yield others
    lowered = CounterMetricFamily("hydra_compute_threads_lowered", "Times a step's compute-thread count went down")
    lowered.add_metric([], ct.lowered)
    yield lowered
    reduced = CounterMetricFamily("hydra_compute_threads_reduced_seconds",
                                  "Seconds of decode stepped with fewer compute threads than configured")
    reduced.add_metric([], ct.reduced_seconds)
    yield reduced


def _prompt_cache(pc: Any) -> Iterable[Metric]:
    hits = CounterMetricFamily("hydra_prompt_cache_hits", "Prompts that reused cached tokens, by where they "
                               "came from (own: the slot's KV, shared: another slot's, host: the RAM tier, "
                               "checkpoint: a context checkpoint of the slot)", labels=["source"])
    for source in ("own", "shared", "host", "checkpoint"):
        hits.add_metric([source], getattr(pc, f"from_{source}"))
    yield hits
    C, G = CounterMetricFamily, GaugeMetricFamily
    for family, name, value, doc in (
            (C, "hydra_prompt_cache_lookups", pc.lookups, "Prompts lined up with a slot's KV cache"),
            (C, "hydra_prompt_cache_tokens_saved", pc.tokens_saved, "Prompt tokens reused instead of computed"),
            (C, "hydra_prompt_cache_chunks_shifted", pc.chunks_shifted, "--cache-reuse chunks shifted into place"),
            (C, "hydra_prompt_cache_tokens_recomputed", pc.tokens_recomputed,
             "Prompt tokens a slot held but computed again: its memory could not be cut back to them"),
            (G, "hydra_prompt_cache_checkpoints", pc.checkpoints, "Context checkpoints kept, all slots"),
            (C, "hydra_prompt_cache_ram_saves", pc.ram_saves, "Slot states kept in the RAM tier"),
            (C, "hydra_prompt_cache_ram_restores", pc.ram_restores, "RAM tier states loaded back into a slot"),
            (C, "hydra_prompt_cache_ram_evictions", pc.ram_evictions, "RAM tier states dropped to make room"),
            (C, "hydra_prompt_cache_ram_invalidated", pc.ram_invalidated,
             "RAM tier states dropped because their model was replaced"),
            (G, "hydra_prompt_cache_ram_bytes", pc.ram_bytes, "Bytes held by the RAM tier"),
            (G, "hydra_prompt_cache_ram_entries", pc.ram_entries, "States held by the RAM tier"),
            (G, "hydra_prompt_cache_ram_limit_bytes", pc.ram_limit_bytes, "The RAM tier's limit (-1: none, 0: off)"),
            (C, "hydra_prompt_cache_disk_spills", pc.disk_spills, "RAM tier evictions written to the disk tier"),
            (C, "hydra_prompt_cache_disk_restores", pc.disk_restores, "Of the RAM tier's restores, those read from disk"),
            (G, "hydra_prompt_cache_disk_bytes", pc.disk_bytes, "Bytes held by the disk tier"),
            (G, "hydra_prompt_cache_disk_entries", pc.disk_entries, "States held by the disk tier")):
        m = family(name, doc)
        m.add_metric([], value)
        yield m
