"""llama-server's own endpoints, on the same engine as everything else.

    POST /completion       llama-server's native completion (streamed or not)
    GET  /props            server properties (POST /props: 501, as llama-server without --props)
    POST /tokenize         {"content", "add_special", "parse_special", "with_pieces"} → {"tokens"}
    POST /detokenize       {"tokens"} → {"content"}
    POST /apply-template   {"messages", …} → {"prompt"}: the chat template, no inference

Request and response fields are llama-server's (tools/server/README.md of the pinned
llama.cpp; ``server_task_result_cmpl_*::to_json_non_oaicompat``). A completion is parsed and
refused exactly as ``/v1/completions`` is (``http.openai_request.parse_completion_request``: same
fields, same limits, same 400s) and runs as one job in the same scheduler. Tokenizing and
rendering run on the inference thread between two steps (``EngineApi.with_model``), so a reload
cannot free the model under them.
"""
from __future__ import annotations

import codecs
from typing import Any

from engine.jobs import BadInput, EngineBusy, EngineUnavailable, GenRequest, GenResult, JobHandle

from hydra_rpc.http.errors import ApiError, engine_error, json_response, read_json_object, require_ready
from hydra_rpc.http.openai import StopFilter, cut_at_stop, outcome, timings_of
from hydra_rpc.http.openai_request import parse_completion_request, select_model
from hydra_rpc.http.sse import SseStream
from hydra_rpc.services import Services
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.http.server.router import Router

MAX_TOKENS = 1 << 20  # a /detokenize list longer than any context is a mistake, not a request
STOP_TYPE = {"eos": "eos", "length": "limit", "ctx_full": "limit", "stop": "word"}


class LlamaRoutes:
    def __init__(self, services: Services, metrics: Any):
        self.services, self.metrics = services, metrics

    def add_to(self, router: Router) -> None:
        router.add_post("/completion", self.completion)
        router.add_get("/props", self.props)
        router.add_post("/props", self.post_props)
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)
        router.add_post("/apply-template", self.apply_template)

    @property
    def engine(self) -> Any:
        return self.services.engine

    async def _body(self, request: Request) -> dict[str, Any]:
        require_ready(self.engine)
        return await read_json_object(request)

    async def _with_model(self, fn: Any) -> Any:
        try:
            return await self.engine.with_model(fn)
        except (EngineBusy, EngineUnavailable) as e:
            raise engine_error(e) from None

    # ---------------------------------------------------------------- properties
    async def props(self, request: Request) -> Response:
        eng = self.engine
        require_ready(eng)
        p = eng.params
        kv = eng.kv_cache
        ident = eng.identity
        info = eng.info()
        return json_response({
            "default_generation_settings": {"params": settings(eng, eng.sampling_for(), eng.default_n_predict, [],
                                                               False),
                                            "n_ctx": eng.n_ctx_slot},
            "total_slots": eng.n_slots,
            "model_alias": ident.model_alias or ident.model_name,
            "model_path": p.model_path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": self.services.settings.http_slots,
            "endpoint_props": False,
            "endpoint_metrics": self.services.settings.http_metrics,
            "chat_template": p.chat_template or "",
            "build_info": kv.build if kv is not None else "",
            "is_sleeping": False,
            # ours: where the layers run (a GPU build offloads --n-gpu-layers of them)
            "devices": list(info.devices),
            "backend_devices": [dict(d) for d in info.backend_devices],
            "n_gpu_layers": p.gpu_layers,
            "gpu_offload": dict(info.gpu_offload) if info.gpu_offload is not None else None,
        })

    async def post_props(self, request: Request) -> Response:
        raise ApiError(501, "This server does not support changing global properties. Start it with `--props`")

    # ---------------------------------------------------------------- tokens
    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        content = body.get("content")
        if content is None:
            return json_response({"tokens": []})  # as llama-server answers a body without content
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        flags = {}
        for key, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
            v = body.get(key, default)
            if not isinstance(v, bool):
                raise ApiError(400, f"'{key}' must be a boolean", param=key)
            flags[key] = v

        def run(model: Any) -> list[Any]:
            ids = model.tokenize(content, add_special=flags["add_special"], parse_special=flags["parse_special"])
            if not flags["with_pieces"]:
                return ids
            return [{"id": t, "piece": piece_json(model.token_to_piece(t, special=True))} for t in ids]

        return json_response({"tokens": await self._with_model(run)})

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request)
        tokens = body.get("tokens", [])
        n_vocab = self.engine.n_vocab
        if (not isinstance(tokens, list) or len(tokens) > MAX_TOKENS
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise ApiError(400, "'tokens' must be an array of token ids", param="tokens")
        bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})", param="tokens")

        def run(model: Any) -> str:
            return b"".join(model.token_to_piece(t) for t in tokens).decode("utf-8", "replace")

        return json_response({"content": await self._with_model(run)})

    async def apply_template(self, request: Request) -> Response:
        body = await self._body(request)
        creq = parse_completion_request(body, "chat", self.engine)  # the same checks as a chat request
        messages, extra = creq.messages, (creq.chat.template_vars if creq.chat else {})
        try:
            prompt = await self._with_model(lambda model: model.render_chat(messages, **extra))
        except ApiError:
            raise
        except Exception as e:
            raise engine_error(e) from None
        return json_response({"prompt": prompt})

    # ---------------------------------------------------------------- /completion
    async def completion(self, request: Request) -> StreamResponse:
        engine = self.engine
        body = await self._body(request)
        creq = parse_completion_request(body, "text", engine)
        return_tokens = body.get("return_tokens") is True
        choice = await select_model(engine, creq.model)
        sampling = engine.sampling_for(creq.sampling, grammar=creq.grammar, logit_bias=creq.logit_bias,
                                       n_probs=creq.n_probs)
        gen_request = GenRequest(creq.slot, prompt=creq.prompt, tokens=creq.tokens, n_predict=creq.n_predict,
                                 sampling=sampling, stop=creq.stop, params=choice.params, stream=creq.stream)
        try:
            job = engine.submit(gen_request)
        except (EngineBusy, BadInput, EngineUnavailable) as e:
            raise engine_error(e) from None
        reason = "cancelled"
        try:
            if creq.stream:
                resp, reason = await self._stream(request, creq, job, choice.name)
                return resp
            res = await outcome(job)
            if res is None:
                raise ApiError(503, "generation cancelled: the engine is stopping")
            text, hit = cut_at_stop(res.text.decode("utf-8", "replace"), creq.stop)
            reason = "stop" if hit else res.stop_reason
            return json_response(final_object(engine, creq, job, res, choice.name, text, hit, return_tokens))
        except ApiError:
            reason = "error"
            raise
        finally:
            job.cancel()  # no-op once finished; otherwise frees the slot before the next step
            if self.metrics is not None:
                self.metrics.observe_generation("completion", reason)

    async def _stream(self, request: Request, creq: Any, job: JobHandle,
                      model: str) -> tuple[StreamResponse, str]:
        ev = await job.next_event()  # the headers wait for the first token: a refusal keeps its status
        res = await outcome(job) if ev is None else None
        stream = SseStream(request, job)
        await stream.start()
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopFilter(creq.stop)
        n = 0
        while ev is not None:
            n += 1
            text = stops.feed(utf8.decode(ev.piece))
            stream.event({"index": 0, "content": text, "tokens": [ev.token], "stop": False, "id_slot": -1,
                          "tokens_predicted": n, "tokens_evaluated": 0})
            if stops.hit:
                job.cancel()
                break
            if stream.burst_over():
                await stream.flush()
            ev = await job.next_event()
        tail = stops.feed(utf8.decode(b"", final=True)) + stops.flush()
        try:
            res = res or await outcome(job)
        except ApiError as e:  # the headers are out: in-band, as llama-server reports it
            stream.event(e.body())
            await stream.flush()
            return stream.resp, "error"
        if res is not None:
            last = final_object(self.engine, creq, job, res, model, tail, stops.hit, False)
            last["tokens"] = []
            stream.event(last)
        # llama-server's /completion sends no [DONE]
        return await stream.end(), ("stop" if stops.hit else (res.stop_reason if res else "cancelled"))


def final_object(engine: Any, creq: Any, job: JobHandle, res: GenResult, model: str, text: str, hit: bool,
                 return_tokens: bool) -> dict[str, Any]:
    """``server_task_result_cmpl_final::to_json_non_oaicompat``, field for field."""
    stop_type = "word" if hit else STOP_TYPE.get(res.stop_reason, "none")
    word = next((s for s in creq.stop if s in res.text.decode("utf-8", "replace")), "") if hit else ""
    return {
        "index": 0, "content": text, "tokens": list(res.generated) if return_tokens else [], "id_slot": res.slot,
        "stop": True, "model": model, "tokens_predicted": res.tokens_generated,
        "tokens_evaluated": res.prompt_tokens,
        "generation_settings": {**settings(engine, job.request.sampling, creq.n_predict, creq.stop, creq.stream),
                                "n_ctx": engine.n_ctx_slot, "model": model},
        "prompt": creq.prompt if creq.prompt is not None else "", "has_new_line": "\n" in text,
        "truncated": res.stop_reason == "ctx_full", "stop_type": stop_type, "stopping_word": word,
        "tokens_cached": res.cached_tokens, "timings": timings_of(res),
        "config_generation": res.config_generation,  # ours
    }


def settings(engine: Any, p: Any, n_predict: int, stop: list[str], stream: bool) -> dict[str, Any]:
    """The sampling parameters a completion runs with, under llama-server's names."""
    return {"n_predict": n_predict, "seed": -1 if p.seed is None else p.seed, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_last_n": p.penalty_last_n,
            "repeat_penalty": p.penalty_repeat, "presence_penalty": p.penalty_present,
            "frequency_penalty": p.penalty_freq, "stop": list(stop), "max_tokens": n_predict,
            "n_keep": engine.n_keep, "stream": stream, "n_probs": p.n_probs,
            "grammar": p.grammar.text if getattr(p.grammar, "text", None) else ""}


def piece_json(piece: bytes) -> str | list[int]:
    """llama-server's ``with_pieces``: the text when it is valid UTF-8, else its bytes."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)



