"""Run one case against the target and judge it: send, read the replies, probe, check liveness.

``run_case`` is what the run loop, the minimizer and ``--replay`` all call, so a saved case
is judged exactly as it was when it was found.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from .cases import Case, Message, Outcome
from .oracles import (Baseline, Hang, Plan, SentFrame, Slow, after_case, await_reply, check_log, followup_probe,
                      judge, plan_frames)
from .responses import Closed, Inbox, Malformed, Stalled, read_response, reset_close
from .target import Target


@dataclass
class RunConfig:
    deadline: float = 2.0  # idle deadline for every reply / close
    grace: float = 0.0  # wait this long for a close before sending the follow-up INFO
    max_stream: float = 6.0  # give up (not a finding) on a PIN stream still flowing after this
    max_wait: float = 20.0  # give up (not a finding) on a generation still making progress after this
    slots: int = 2
    max_rss_growth_mb: int = 1024  # spawn mode: a bigger peak-RSS jump in one case is a finding


async def run_case(case: Case, target: Target, baseline: Baseline | None, cfg: RunConfig) -> Outcome:
    t0 = time.perf_counter()
    rss0 = target.peak_rss_kb() if target is not None else None
    log0 = target.log_offset() if target is not None else None
    checks = dict(rss_before=rss0, max_rss_growth_kb=cfg.max_rss_growth_mb * 1024)
    if case.protocol == "codec":
        from .codec_mode import run_codec_case

        out = run_codec_case(case)
    elif case.protocol == "ggml":
        from .ggml_mode import run_ggml_case

        out = await run_ggml_case(case, target, baseline, cfg)
    elif case.program is not None:
        from .stateful import run_program

        out = await run_program(case.program, target, baseline, cfg)
        await after_case(target, baseline, cfg.deadline, out, **checks)
    else:
        out = await run_messages(case, target, baseline, cfg)
        await after_case(target, baseline, cfg.deadline, out, **checks)
    if case.protocol != "codec" and target is not None:
        check_log(target, log0, out)
    out.elapsed = time.perf_counter() - t0
    return out


async def _send(writer: asyncio.StreamWriter, messages: list[Message], deadline: float) -> str:
    """"sent", "closed" (the peer closed/reset while we wrote), "stalled" (it stopped reading),
    or "fin"/"rst" when a message asked us to close the connection ourselves."""
    try:
        for m in messages:
            if m.mode == "dribble":
                for i in range(0, len(m.data), max(1, m.chunk)):
                    writer.write(m.data[i:i + max(1, m.chunk)])
                    await asyncio.wait_for(writer.drain(), deadline)
                    if m.delay_ms:
                        await asyncio.sleep(m.delay_ms / 1000)
            else:
                writer.write(m.data)
                await asyncio.wait_for(writer.drain(), deadline)
            if m.then == "rst":
                reset_close(writer)
                return "rst"
            if m.then == "fin":
                writer.close()
                return "fin"
    except (TimeoutError, asyncio.TimeoutError):
        return "stalled"
    except (ConnectionError, OSError):
        return "closed"
    return "sent"


async def run_messages(case: Case, target: Target, baseline: Baseline, cfg: RunConfig) -> Outcome:
    out = Outcome(sent=[m.data for m in case.messages])
    plan = plan_frames(b"".join(m.data for m in case.messages))
    try:
        reader, writer = await target.connect(cfg.deadline)
    except (OSError, TimeoutError):
        return out  # after_case tells a dead target from a slow one
    inbox = Inbox(reader)
    try:
        sent = await _send(writer, case.messages, cfg.deadline)
        if sent in ("rst", "fin"):
            await asyncio.sleep(0.01)  # let the server see the close before liveness is probed
            return out
        if plan.tail != "clean" or sent != "sent":
            try:
                if writer.can_write_eof():
                    writer.write_eof()  # nothing more is coming: the server must finish or close
            except (OSError, RuntimeError):
                pass
        await _judge_stream(plan, sent, inbox, writer, target, baseline, cfg, out)
    finally:
        out.received = bytes(inbox.raw)
        try:
            writer.close()
        except (OSError, RuntimeError):
            pass
        await inbox.close()
    return out


async def _judge_stream(plan: Plan, sent: str, inbox: Inbox, writer, target: Target, baseline: Baseline,
                        cfg: RunConfig, out: Outcome) -> None:
    loop = asyncio.get_running_loop()
    for frame in plan.frames:
        verdict = await _one_reply(inbox, frame, target, baseline, cfg, out, loop.time() + cfg.max_stream)
        if verdict != "next":
            return
    if plan.tail == "clean" and sent == "sent":
        state = await inbox.settle(cfg.grace)
        if state == "eof":
            return  # a close after the replies is legal
        if state == "data":
            extra = await _describe_extra(inbox, cfg.deadline)
            out.fail("desync", f"{len(plan.frames)} request(s) sent, got more replies than that: {extra}",
                     rule="extra")
            return
        await followup_probe(inbox, writer, baseline, cfg.deadline, out)
        return
    # Partial or garbage tail (or a send the server cut short): at most one early refusal, then a close.
    what = {"partial": "an unfinished request", "garbage": "bytes that are not a request (bad magic)"}.get(
        plan.tail, "a request the server stopped reading")
    if plan.tail != "garbage":
        try:
            r = await read_response(inbox, cfg.deadline)
            out.responses.append(r.summary())
            judge(r, None, baseline, out)
        except Closed:
            return
        except Malformed as e:
            out.fail("malformed", str(e))
            return
        except Stalled:
            out.fail("hang", f"after {what} and our half-close, no reply and no close within {cfg.deadline}s")
            return
    state = await inbox.wait_eof(cfg.deadline)
    if state == "timeout":
        out.fail("hang", f"after {what} and our half-close, the connection stayed open for {cfg.deadline}s")
    elif state == "data":
        extra = await _describe_extra(inbox, cfg.deadline)
        out.fail("desync", f"the server answered {what}: {extra}", rule="answered-garbage")


async def _one_reply(inbox: Inbox, frame: SentFrame, target: Target, baseline: Baseline, cfg: RunConfig,
                     out: Outcome, until: float) -> str:
    """"next" when a reply came and the connection is still usable, else "stop"."""
    try:
        r = await await_reply(inbox, frame, target, cfg.deadline, cfg.max_wait, until=until)
    except Closed:
        out.notes.append("closed instead of replying")
        return "stop"
    except Malformed as e:
        out.fail("malformed", str(e))
        return "stop"
    except Hang as e:
        out.fail("hang", str(e))
        return "stop"
    except Slow as e:
        out.notes.append(str(e))
        return "stop"
    out.responses.append(r.summary())
    judge(r, frame, baseline, out)
    if r.pieces is not None:  # a PIN stream ends with the close
        if r.stream_unfinished:
            out.notes.append("slow: PIN stream still running; gave up")
        return "stop"
    return "next"


async def _describe_extra(inbox: Inbox, deadline: float) -> str:
    try:
        r = await read_response(inbox, min(deadline, 0.5))
        return f"{r.summary()}"
    except (Closed, Stalled, Malformed) as e:
        return f"{bytes(inbox.buf[:32]).hex(' ')} ({type(e).__name__})"
