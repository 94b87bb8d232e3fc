"""One scheduler step, run on the inference thread.

The actor hands the stepper the running jobs; the stepper builds ONE llama_batch
from all of them (a prefill chunk or the next token of each), decodes, samples,
and — while the time slice is not used up — repeats, prompt chunks and decodes
alike, as llama-server's loop goes on to the next batch with no hand-off between:
the hop to the event loop and back (0.3–0.7 ms on the project's slower 2-core host)
would otherwise sit between a prompt's chunks and between small models' tokens. It returns
to the actor after at most ``time_slice`` seconds of model work, or at once when
the actor has mail (``should_yield``: a new request, a state transfer, an erase, a
CONFIGURE or a client that stopped reading waits one decode); a cancelled job is not
fed from the next decode on.
While it repeats it hands the tokens made so far to the actor (``hand_over``, at
most every ``HAND_OVER_EVERY``): they go to their streams while the next decode
runs, instead of the loop's per-token work waiting between two decodes. A job whose
client reads only its result (``GenRequest.stream`` False) keeps its tokens until the step ends.

The stepper mutates ``Running``/``Slot`` objects; the actor never touches them
while a step is in flight (it is awaiting the step), so there is one owner at a time.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from .backend import BatchItem, ModelBackend
from .chat.formats import generation_opens_reasoning
from .chat.turns import last_user_message_start
from .checkpoints import Checkpoints
from .jobs import BadInput, GenJob, GenRequest, KvCacheFull, TokenEvent
from .prompt_cache import PromptCache
from .reasoning_budget import BudgetTracker, tracker_for
from .sampling import GrammarExhausted, SamplerParams
from .slots import Slot


@dataclass(eq=False)
class Running:
    job: GenJob
    slot: Slot
    generation: int
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    sampler: Any = None  # the backend's sampler handle while the job generates
    last: int | None = None  # sampled token to feed next
    n_generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stop_reason: str | None = None
    error: BaseException | None = None
    events: list[TokenEvent] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    t_start: float = 0.0
    t_prefill_done: float = 0.0
    prompt_counted: bool = False  # its prompt is in the engine's prompt counters (scheduler)
    state: bytes | None = None
    logits: bytes | None = None
    admitted: bool = False
    logits_given: bool = False  # the slot's last token came with its logits: sample without a decode
    budget: BudgetTracker | None = None  # the job's reasoning budget, while it has one
    user_turn: int | None = None  # a chat prompt's last user turn starts here: a checkpoint (engine.chat.turns)
    diverged: int | None = None  # the prompt parted from the slot's tokens here: a checkpoint (Checkpoints.diverged)

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None or self.error is not None

    @property
    def decoding(self) -> bool:
        return not self.pending and self.last is not None and not self.finished

    @property
    def first_token_out(self) -> bool:
        """Its first token was just sampled and its client reads tokens as they come: the step
        hands it back at once, and the next one gives way to that reader (executors.give_way).
        A client that reads only the result (``GenRequest.stream`` False) has no use for it yet."""
        return self.n_generated == 1 and self.job.request.stream


def job_input(model: ModelBackend, job: GenJob, slot_has_tokens: bool) -> list[int] | None:
    """The job's new tokens (None: it has no input and continues its slot). Raises BadInput."""
    if job.tokenized is not None and job.tokenized[0] is model:
        return job.tokenized[1]  # made by this function for this model: checked then
    if job.request.messages is not None:
        text = model.render_chat(job.request.messages, **(job.request.template_vars or {}))
        job.opens_reasoning = generation_opens_reasoning(text, model.chat_syntax)
        return model.chat_text_tokens(text)
    if job.request.prompt is not None:
        return model.tokenize(job.request.prompt, add_special=not job.request.append or not slot_has_tokens)
    if job.request.tokens is None:
        return None
    new = list(job.request.tokens)  # the client's ids; the tokenizer's are in range
    if new and (min(new) < 0 or max(new) >= model.n_vocab):  # two passes at C speed, not one in Python
        raise BadInput(f"token id out of range 0..{model.n_vocab - 1}")
    return new


# Tokenizing this much text takes at most ~0.1 ms (Gemma 3's vocabulary: a 30-character prompt
# 19 µs, 1,000 characters 260 µs): less than a hop to the inference thread and back
LOOP_TOKENIZE_CHARS = 512
# With no job running the loop has no stream to serve meanwhile, and the hop (~250 µs on a
# 2-core host, a cold ~1,200-token prompt's first token 0.7 % of its time) is the only cost
# left: the loop tokenizes up to this much (Gemma's vocabulary ~4 ms), a longer input still
# goes to the inference thread so that /health and /slots stay answered.
IDLE_LOOP_TOKENIZE_CHARS = 16384
MESSAGE_MARKUP_CHARS = 16  # what the chat template adds around each message, roughly


def tokenize_on_loop(request: GenRequest, idle: bool = False) -> bool:
    """Whether the request's input is cheap enough to tokenize on the event loop where the
    slot is chosen, instead of a round trip through the inference thread that costs a short
    request's time to first token more than the tokenizing does (``idle``: no job runs, so a
    longer input is cheap enough too). llama.cpp's tokenizer only reads the vocabulary
    (llama-server tokenizes on its HTTP threads while it decodes), and a live model is never
    freed (the reloader frees only the one it replaced).

    A chat's size is what its template renders: the messages' text, the calls an assistant
    made, and the tool definitions (rendering them is tens of µs, tokenizing what they render
    the cost). With tools it is never short: only an idle loop takes one, an agent's next turn
    on an otherwise quiet engine."""
    budget = IDLE_LOOP_TOKENIZE_CHARS if idle else LOOP_TOKENIZE_CHARS
    if request.messages is not None:
        tools = request.template_vars.get("tools") if request.template_vars else None
        if tools and not idle:
            return False
        left = budget - (_json_chars(tools) if tools else 0)
        for m in request.messages:  # stops at the first message past the budget, however many follow
            size = _rendered_chars(m)
            if size is None:
                return False  # content parts: left to the inference thread
            left -= size + MESSAGE_MARKUP_CHARS
            if left < 0:
                return False
        return True
    if request.prompt is not None:
        return len(request.prompt) <= budget
    return True  # token ids, or nothing: no tokenizer at all


def _json_chars(value: Any) -> int:
    # a part of the request body, written again at C speed: less than its parsing cost the loop
    return len(json.dumps(value, default=str))


def _rendered_chars(message: Any) -> int | None:
    """About what a message renders to (None: content parts, whose size is not a string's)."""
    if not isinstance(message, dict):
        return 0
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return None
    reasoning = message.get("reasoning_content")
    calls = message.get("tool_calls")
    return (len(content or "") + (len(reasoning) if isinstance(reasoning, str) else 0)
            + (_json_chars(calls) if calls else 0))


def sampling_for_output(model: ModelBackend, job: GenJob) -> SamplerParams:
    """The job's sampling; a grammar waits for the think block to close when the prompt opened one."""
    grammar = job.request.sampling.grammar
    if grammar is None or not job.opens_reasoning or not grammar.after_think:
        return job.request.sampling
    from .chat.tool_grammar import after_reasoning

    close = model.chat_syntax.think_close or "</think>"
    return replace(job.request.sampling, grammar=after_reasoning(grammar, close))


def admit(model: ModelBackend, r: Running, n_ctx_slot: int, cache: PromptCache) -> None:
    """Tokenize the job's input and line its slot's KV cache up with it (inference thread)."""
    job, slot = r.job, r.slot
    r.t_start = time.perf_counter()
    new = job_input(model, job, bool(slot.tokens))
    job.tokenized = None
    if new is None:
        target = slot.tokens + slot.tail
    elif job.request.append:
        target = slot.tokens + slot.tail + new
    else:
        target = new
    need_logits = job.request.n_predict > 0 or job.request.capture_state
    if not target and need_logits:
        target = [model.bos]
    if len(target) + (1 if job.request.n_predict > 0 else 0) > n_ctx_slot:
        raise BadInput(f"prompt of {len(target)} tokens does not fit the slot context of {n_ctx_slot}")
    if job.request.messages is not None and cache.checkpoints.wanted(model):  # only where checkpoints are taken
        # the last user message's turn, as llama-server's spans: not a tool result's user turn
        r.user_turn = last_user_message_start(target, model.user_turn_tokens, job.request.messages,
                                              model.tool_result_turns)
    # the last token must be decoded (again) to get its logits — unless they came with the state
    given, slot.last_logits = slot.last_logits, None
    given = given if need_logits and not slot.tail and target == slot.tokens else None
    max_keep = len(target) - 1 if need_logits and given is None else len(target)
    keep, r.diverged = cache.line_up(model, slot, target, max_keep, continuation=new is None or job.request.append)
    if given is not None and keep == len(target):
        model.set_logits(slot.id, given)
        r.logits_given = True
    slot.tail = []
    r.pending = target[keep:]
    r.cached_tokens = keep
    r.prompt_tokens = len(target)
    r.sampler = model.make_sampler(sampling_for_output(model, job)) if job.request.n_predict > 0 else None
    syntax = model.chat_syntax
    r.budget = tracker_for(job.request.reasoning_budget, job.opens_reasoning, syntax.think_open, syntax.think_close)
    r.admitted = True
    slot.begin("prefill" if r.pending else "decode", len(r.pending) + job.request.n_predict)


def _after_logits(model: ModelBackend, r: Running, n_ctx_slot: int, shift_keep: int | None) -> None:
    """The job's last fed token has logits: capture state and/or sample the next token. A
    full slot shifts its context when ``shift_keep`` (tokens kept at the start) is given."""
    job, slot = r.job, r.slot
    if not r.t_prefill_done:
        _prefill_done(model, r)
    if r.n_generated >= job.request.n_predict:
        r.stop_reason = r.stop_reason or ("none" if job.request.n_predict == 0 else "length")
        return
    n_probs = job.request.sampling.n_probs
    # the alternatives are read from the raw logits before sampling (sample() may change them)
    top = tuple((model.token_to_piece(t), p) for t, p in model.top_logprobs(slot.id, n_probs)) if n_probs else ()
    forced = r.budget.next_forced(model, r.text) if r.budget is not None else None
    try:
        if forced is not None:  # the reasoning budget is spent: its message and close tag are written
            tok, lp = forced, 0.0
            model.accept(r.sampler, tok)
        elif job.request.want_logprobs or n_probs:
            tok, lp = model.sample(slot.id, r.sampler, True)
        else:
            tok, lp = model.sample(slot.id, r.sampler), 0.0
    except GrammarExhausted:  # the grammar allows no token of this vocabulary: end, never hang
        r.stop_reason = "grammar"
        return
    r.n_generated += 1
    slot.n_decoded += 1
    slot.advance(1, time.monotonic())
    if model.is_eog(tok):
        r.stop_reason = "eos"
        return
    r.last = tok  # not in the KV yet: fed at the next step, or the slot's tail if the job ends (Scheduler.finish)
    piece = model.token_to_piece(tok)
    slot.has_new_line = b"\n" in piece
    r.generated.append(tok)
    r.events.append(TokenEvent(tok, piece, lp, top))
    r.text += piece
    if r.budget is not None:
        r.budget.observe(r.text, piece)
    if job.request.stop and _hit_stop(r, job.request.stop):
        r.stop_reason = "stop"
        return
    if r.n_generated >= job.request.n_predict:
        r.stop_reason = "length"
        return
    if len(slot.tokens) + 1 >= n_ctx_slot:
        if shift_keep is None or not _shift_context(model, slot, shift_keep):
            r.stop_reason = "ctx_full"


def _prefill_done(model: ModelBackend, r: Running) -> None:
    """The prompt is in the KV: capture the state it asked for, enter the decode phase."""
    job, slot = r.job, r.slot
    r.t_prefill_done = time.perf_counter()
    if job.request.capture_state:
        r.logits = model.logits(slot.id).tobytes()
        r.state = model.state_seq_get(slot.id)
        if job.request.n_predict == 0:
            # a PREFILL: the DECODE that continues this slot samples its first token from
            # them instead of decoding the last prompt token again (which a recurrent model
            # could do only from a checkpoint before it); a view of the reply's copy
            slot.last_logits = np.frombuffer(r.logits, dtype=np.float32)
    if job.request.n_predict > 0:
        slot.enter("decode", time.monotonic())


def _shift_context(model: ModelBackend, slot: Slot, n_keep: int) -> bool:
    """llama-server's context shift: drop the older half of what follows the first ``n_keep``
    tokens and move the rest back; False when nothing can be dropped."""
    n_past = len(slot.tokens)
    n_discard = (n_past - n_keep) // 2
    if n_discard <= 0 or not model.seq_rm(slot.id, n_keep, n_keep + n_discard):
        return False
    model.seq_add(slot.id, n_keep + n_discard, n_past, -n_discard)
    del slot.tokens[n_keep:n_keep + n_discard]
    return True


def _hit_stop(r: Running, stops: list[str]) -> bool:
    tail = bytes(r.text[-256:]).decode("utf-8", "ignore")
    return any(s and s in tail for s in stops)


STATE_SIZE_EVERY = 0.05  # seconds between two measurements of a running slot's state size
# Seconds between two hand-overs: a small model's tokens go over in batches, not a wake-up each.
# A wake-up runs the loop (SCHED_RR) on a core a compute thread was using, and its partner
# spins at the next barrier meanwhile: every 2 ms, tiny-moe's one stream (a token each
# ~0.23 ms) made 5-10 % fewer tokens a second than every 5 ms, 10 ms ~1 % more than 5
# (docs/performance.md, "Hand-overs every 5 ms"). A model whose decode takes longer (Gemma 3
# 270M's ~10 ms) hands every token over as it comes.
HAND_OVER_EVERY = 0.005
HandOver = Callable[[list[tuple[Running, list]]], None]  # (job, its new token events) of a running step


def run_step(model: ModelBackend, running: list[Running], *, n_ctx_slot: int, token_budget: int,
             time_slice: float, cache: PromptCache, max_iters: int = 256, shift_keep: int | None = None,
             counters: dict[str, float] | None = None, hand_over: HandOver | None = None,
             should_yield: Callable[[], bool] | None = None, free_idle: Callable[[], bool] | None = None) -> None:
    """Advance every running job by one or more batched decodes (inference thread).
    ``counters`` (the engine's stats) gets ``n_decode`` and ``n_busy_slots`` per decode: what
    llama-server's ``llamacpp:n_decode_total`` / ``n_busy_slots_per_decode`` count.
    ``hand_over(batch)`` takes (job, its new token events) while the step goes on; the events
    left when it ends stay in ``Running.events`` for the actor. ``free_idle()`` gives up the KV
    of slots no job runs on when a batch finds the cache full (True if it freed any)."""
    t0 = handed = time.perf_counter()
    _admit_new(model, running, n_ctx_slot, cache, shift_keep)
    iters = 0
    ckpts = cache.checkpoints if cache.checkpoints.wanted(model) else None
    while True:
        items: list[BatchItem] = []
        fed: list[tuple[Running, list[int], bool]] = []
        _fill_batch(model, running, token_budget, ckpts, items, fed)
        if not items:
            break
        try:
            model.decode(items)
        except KvCacheFull:
            if free_idle is None or not free_idle():
                raise  # every job of the step fails with it, as llama-server fails them
            continue  # the same batch again, in the room the idle slots gave up
        if counters is not None:
            counters["n_decode"] += 1
            counters["n_busy_slots"] += len(items)
        _after_decode(model, fed, n_ctx_slot, shift_keep)
        iters += 1
        now = time.perf_counter()
        if iters >= max_iters or now - t0 >= time_slice:
            break
        if any(r.finished or (want and r.first_token_out) for r, _, want in fed):
            break  # a job's end, or a stream's first token: handed back at once
        if should_yield is not None and should_yield():
            break
        if hand_over is not None and now - handed >= HAND_OVER_EVERY:
            handed = now
            batch = [(r, r.events) for r, _, _ in fed if r.events and r.job.request.stream]
            for r, _ in batch:
                r.events = []
            if batch:
                hand_over(batch)
    _refresh_state_sizes(model, running)


def _admit_new(model: ModelBackend, running: list[Running], n_ctx_slot: int, cache: PromptCache,
               shift_keep: int | None) -> None:
    """Admit every job not admitted yet; a job whose whole input was cached and that generates
    nothing ends here (pure prefill hit), one whose last token's logits came with the slot's
    state samples from them at once. An admission error is the job's error."""
    for r in running:
        if not r.admitted and not r.finished:
            try:
                admit(model, r, n_ctx_slot, cache)
                if r.logits_given:
                    _after_logits(model, r, n_ctx_slot, shift_keep)
                elif not r.pending and r.last is None:
                    # Everything was cached and nothing to generate (pure prefill hit).
                    r.t_prefill_done = time.perf_counter()
                    if r.job.request.capture_state:
                        r.state = model.state_seq_get(r.slot.id)
                    r.stop_reason = "none"
            except Exception as e:
                r.error = e


def _fill_batch(model: ModelBackend, running: list[Running], token_budget: int, ckpts: Checkpoints | None,
                items: list[BatchItem], fed: list[tuple[Running, list[int], bool]]) -> None:
    """Append to ``items`` (and ``fed``: job, tokens, logits wanted) one prefill chunk or the
    next token of each live job, ``token_budget`` tokens in all: every decoding job's token,
    and prefill chunks in what is left (as llama-server fills a batch). A job admitted after
    one whose prompt takes whole batches may be decoding already (a DECODE continuing a
    PREFILL): its token must not push the batch past n_batch. (The batch's rows are written
    in sequence order whatever the order here: ``LlamaBatch.fill``.)

    The chunks go to the shortest remaining prompts first. llama-server feeds its slots in
    index order, and the first prompt takes whole batches until it is done: a short prompt
    that arrives behind a long one waits for all of it (minutes, for an agent's first turn
    on a large model). Shortest first, it is computed in the next batch and the long prompt
    loses that batch's share of one step."""
    live = [r for r in running if not (r.finished or r.job.cancelled)]
    decoding = [r for r in live if not r.pending and r.last is not None]
    for r in decoding:
        items.append(BatchItem(r.slot.id, [r.last], len(r.slot.tokens), True))
        fed.append((r, [r.last], True))
    budget = token_budget - len(decoding)
    for r in sorted((r for r in live if r.pending), key=lambda r: len(r.pending)):
        if budget <= 0:
            break
        n = min(budget, len(r.pending))
        if ckpts is not None:  # context checkpoints near the prompt's end (engine.checkpoints)
            held = len(r.slot.tokens)
            points = ckpts.points(held + len(r.pending), token_budget, model.n_ubatch, r.user_turn, r.diverged)
            ckpts.before_chunk(model, r.slot.id, r.slot.tokens, points)
            n = ckpts.chunk_len(held, n, points)
        chunk = r.pending[:n]
        want = len(chunk) == len(r.pending) and (r.job.request.n_predict > 0 or r.job.request.capture_state)
        items.append(BatchItem(r.slot.id, chunk, len(r.slot.tokens), want))
        fed.append((r, chunk, want))
        budget -= n


def _after_decode(model: ModelBackend, fed: list[tuple[Running, list[int], bool]], n_ctx_slot: int,
                  shift_keep: int | None) -> None:
    """The batch is decoded: its tokens are in each slot's KV cache; sample where logits were wanted."""
    for r, chunk, want in fed:
        r.slot.tokens.extend(chunk)
        if r.pending:
            del r.pending[:len(chunk)]
            r.slot.advance(len(chunk), time.monotonic())
        r.last = None
        if want:
            _after_logits(model, r, n_ctx_slot, shift_keep)
        elif not r.pending and not r.finished:  # prefill-only job without logits: done
            r.t_prefill_done = time.perf_counter()
            r.stop_reason = "none"


def _refresh_state_sizes(model: ModelBackend, running: list[Running]) -> None:
    # the size walks every KV cell (~10-50 µs): a snapshot figure, refreshed a few times a
    # second — and not right after a job's first token, which would wait for it: the next step
    # takes it (a finished job's is taken at once, as its result is read)
    now = time.monotonic()
    for r in running:
        if r.finished:
            due = r.admitted
        else:
            due = r.admitted and r.n_generated != 1 and now - r.slot.state_size_at >= STATE_SIZE_EVERY
        if due:
            r.slot.state_size = model.state_seq_size(r.slot.id)
            r.slot.state_size_at = now
