"""vs-llama-server's figures: what is compared, the budgets, and how the rounds and the
alternating pairs become rows (ours / llama-server's, per round or pair). A row's value is the
median of the rounds', except ``/slots`` p99: the p99 of every answer of the run's rounds for
each server (a round gives a few hundred answers, whose p99 is one of its slowest two or three).

The **floor**: each server's RSS after the same requests one at a time, beside a bare Python
server on the same bindings (:mod:`tools.bench.bare_completion`), since on a small model most of
ours' RSS is the interpreter's.

The **control** pairs the same alternating requests between llama-server and a second
llama-server process started with the same argv. Two identical servers differ only by the
host's noise, so the control's per-pair ratios are the measurement's own spread: a figure of
ours inside it is parity as far as this host can tell, one outside it is a difference.
"""
from __future__ import annotations

from typing import Any

from .common import Result, Row, ratio, spread, summarize

NAME = "vs-llama-server"  # the scenario
VARIANTS = ["llama-server", "hydra"]
OURS = VARIANTS[1]
CONTROL = "llama-server-2"  # the control's second llama-server process
FLOOR = "bare Python"  # tools.bench.bare_completion: the least a Python server on these bindings holds
LABEL = "llama-server"
SLOTS = 4
SLOTS_WIDE = 8
SLOTS_MIN_ANSWERS = 100  # fewer /slots answers than this make no p99: measured again, longer
SLOTS_LOAD_POLL_S = 0.01
# what the longer phase collects in a round (four longer streams again, at most SLOTS_LOAD_REPEATS
# times): a p99 of ~200 answers is their second slowest, one hiccup of the host
SLOTS_LOAD_ANSWERS = 500
SLOTS_LOAD_REPEATS = 6
BUDGETS = {  # figure → (budget text, limit on ours/llama-server, kind)
    "one": ("≥ 1.0× llama-server", 1.0, "min"),
    "ttft": ("≤ 1.0× llama-server", 1.0, "max"),
    "four": ("≥ 1.0× llama-server", 1.0, "min"),
    "eight": ("≥ 1.0× llama-server", 1.0, "min"),
    "slots_p99": ("below llama-server's", 1.0, "max"),
    "rss": ("≤ 1.1× llama-server", 1.1, "max"),
    "rss_floor": ("≤ 1.1× a bare Python server's", 1.1, "max"),
    "whole": ("≤ 1.0× llama-server", 1.0, "max"),
}
WHOLE_TOKENS = 16  # a completion not streamed: a short answer, its whole time the figure
SLOTS_LABEL = f"/slots p99 while {SLOTS} streams decode, over the run's answers"
CONTROL_PREFIX = "control: "  # a row of the control: llama-server against a second llama-server


FIGURES = [  # key in a round, row label, unit, budget key
    ("one_tok_s", "one stream, decode tok/s", "tok/s", "one"),
    ("ttft_ms", "one stream, time to first token (median of 3 requests)", "ms", "ttft"),
    ("four_tok_s", f"{SLOTS} concurrent streams (after a history), aggregate tok/s", "tok/s", "four"),
    ("eight_tok_s", f"{SLOTS_WIDE} concurrent streams on -np {SLOTS_WIDE}, aggregate tok/s", "tok/s", "eight"),
    ("slots_p99_ms", SLOTS_LABEL, "ms", "slots_p99"),
    ("rss_mib", f"RSS after {SLOTS} streams", "MiB", "rss"),
    ("cache_cold_ttft_ms", "long prompt, cold: time to first token", "ms", "ttft"),
    ("cache_warm_ttft_ms", "the same document cached: time to first token (median of 3)", "ms", "ttft"),
    ("chat_one_tok_s", "chat completions, one stream, decode tok/s", "tok/s", "one"),
    ("chat_ttft_ms", "chat completions, time to first token (median of 3 requests)", "ms", "ttft"),
    ("chat_four_tok_s", f"chat completions, {SLOTS} concurrent streams, aggregate tok/s", "tok/s", "four"),
]
PAIRED = [  # samples["pairs"] key, then as FIGURES
    ("one", ("one_paired_tok_s", "one stream, alternating request by request, decode tok/s", "tok/s", "one")),
    ("chat_one", ("chat_one_paired_tok_s", "chat, one stream, alternating, decode tok/s", "tok/s", "one")),
    ("four", ("four_paired_tok_s", f"{SLOTS} concurrent streams, alternating, aggregate tok/s", "tok/s", "four")),
    ("chat_four", ("chat_four_paired_tok_s", f"chat, {SLOTS} concurrent streams, alternating, aggregate tok/s",
                   "tok/s", "four")),
    ("ttft", ("ttft_paired_ms", "time to first token, alternating request by request (median)", "ms", "ttft")),
    ("cached", ("cache_warm_paired_ms", "cached document: time to first token, alternating (median)", "ms",
                "ttft")),
    ("cold", ("cache_cold_paired_ms", "long prompt, cold: time to first token, alternating (median)", "ms", "ttft")),
    ("whole", ("whole_paired_ms", f"a completion not streamed ({WHOLE_TOKENS} tokens): its time, alternating (median)",
               "ms", "whole")),
]
FLOOR_ROW = "RSS after the same requests one at a time, over a bare Python server on the same bindings"


def meets(q: float, budget_key: str) -> bool:
    """Whether the ratio ``q`` (ours / llama-server's) meets the budget ``BUDGETS[budget_key]``:
    "below" is strict (/slots p99); the other maxima are "≤", the minima "≥"."""
    _, limit, kind = BUDGETS[budget_key]
    if kind == "min":
        return q >= limit
    return q < limit if budget_key == "slots_p99" else q <= limit


def _compare(side: str, values: list, theirs: list, per_key: str) -> dict[str, Any]:
    """``side``'s values against llama-server's: both spreads and the ratio of each round or pair."""
    per = [ratio(a, b) for a, b in zip(values, theirs)]
    return {side: spread(values), "llama-server": spread(theirs), per_key: spread(per),
            "ratios": [None if q is None else round(q, 4) for q in per]}


def _ratio_note(rr: dict[str, Any], per: str) -> str:
    return f"per-{per} ratio {_span(rr)} over {rr['n']} {per}s" if rr["n"] else "no ratio"


def _figure(res: Result, s: dict[str, Any], figure: tuple[str, str, str, str], ours: list, theirs: list,
            per: str = "round", beside: str = "", whole: tuple[float | None, float | None] | None = None) -> None:
    """One figure: both sides' spread, the ratio of each round (or pair), its row and verdict;
    ``beside``: what the note adds (the control's ratio for a paired figure); ``whole``: the
    row's values when they are taken over every sample of the run rather than as the median
    of the rounds' (``/slots`` p99)."""
    key, label, unit, budget_key = figure
    s[key] = _compare("hydra", ours, theirs, "ratio_per_round")
    text, limit, kind = BUDGETS[budget_key]
    v, b = s[key]["hydra"]["median"], s[key]["llama-server"]["median"]
    if whole is not None:
        v, b = whole
        s[key]["whole_run"] = {"hydra": v, "llama-server": b}
    q = ratio(v, b)
    ok = None if q is None else meets(q, budget_key)
    rr = s[key]["ratio_per_round"]
    note = _ratio_note(rr, per) + beside
    res.rows.append(Row(label, v, unit, b, LABEL, text, ok, note, limit=limit, on="ratio", kind=kind)
                    .with_spread(s[key]["hydra"]))


def _control_row(res: Result, label: str, unit: str, c: dict[str, Any]) -> None:
    """A paired figure between two llama-server processes: no budget, its spread is the host's."""
    rr = c["ratio_per_pair"]
    note = _ratio_note(rr, "pair") + (", llama-server against a second llama-server" if rr["n"] else "")
    res.rows.append(Row(CONTROL_PREFIX + label, c[CONTROL]["median"], unit, c["llama-server"]["median"], LABEL,
                        note=note).with_spread(c[CONTROL]))


def report(res: Result, rounds: list[dict[str, Any]], reps: int, pairs: dict[str, list] | None = None,
           control: dict[str, list] | None = None, floor: dict[str, dict[str, Any]] | None = None) -> None:
    """The rows and summary of a run: every figure over the rounds, then over the pairs, then
    the control's pairs (informational), scaling and CPU per token, then ours' RSS over the
    floor's (``floor``: each server's RSS after the same requests, :func:`rss_floor_row`)."""
    pairs, control = pairs or {}, control or {}

    def of(v: str, key: str) -> list:
        return [r[key] for r in sorted((r for r in rounds if r["variant"] == v), key=lambda r: r["round"])]

    def sides(found: list[dict[str, Any]], side: str) -> tuple[list, list]:
        return [p[side] for p in found], [p["llama-server"] for p in found]

    s: dict[str, Any] = {}
    answers = {v: [x for r in rounds if r["variant"] == v for x in r.get("slots_ms") or ()] for v in VARIANTS}
    for figure in FIGURES:
        whole, beside = None, ""
        if figure[0] == "slots_p99_ms" and all(answers.values()):  # a round's p99 is its 2nd-slowest of ~200
            ours, theirs = answers[OURS], answers["llama-server"]
            whole = summarize(ours)["p99"], summarize(theirs)["p99"]
            beside = f"; the row: the p99 of {len(ours)} and {len(theirs)} answers"
        _figure(res, s, figure, of(OURS, figure[0]), of("llama-server", figure[0]), beside=beside, whole=whole)
    controls = {skey: _compare(CONTROL, *sides(control[key], CONTROL), "ratio_per_pair")
                for key, (skey, *_) in PAIRED if control.get(key)}
    for key, figure in PAIRED:
        if pairs.get(key):
            c = controls.get(figure[0])  # a verdict read with the spread of two identical servers beside it
            beside = f"; the control's {_span(c['ratio_per_pair'])}" if c and c["ratio_per_pair"]["n"] else ""
            _figure(res, s, figure, *sides(pairs[key], "hydra"), per="pair", beside=beside)
    for _, (skey, label, unit, _) in PAIRED:
        if skey in controls:
            _control_row(res, label, unit, controls[skey])
    if controls:
        s["control"] = controls
    res.summary = s
    _where_the_time_goes(res, s, of)
    if floor:
        rss_floor_row(res, s, floor)
    longer = [r["slots_phase"] for r in rounds if "slots_phase" in r]
    if longer:
        res.notes.append(
            f"/slots p99: the four-stream phase gave {min(x['four_phase_answers'] for x in longer)}–"
            f"{max(x['four_phase_answers'] for x in longer)} answers (< {SLOTS_MIN_ANSWERS}) in {len(longer)} round(s); "
            f"there the figure is four streams of up to {max(x['max_tokens'] for x in longer)} tokens with /slots "
            f"read every {SLOTS_LOAD_POLL_S * 1000:.0f} ms, {max(x.get('repeats', 1) for x in longer)} time(s) at most "
            f"({min(len(r['slots_ms']) for r in rounds)}+ answers per round)")
    finishes = [r["finish"] for rnd in rounds for k in ("single", "four", "eight", "chat_one", "chat_four") for r in
                (rnd["requests"][k] if isinstance(rnd["requests"][k], list) else [rnd["requests"][k]])]
    finishes += [p[f"{v}_finish"] for k in ("one", "chat_one") for p in pairs.get(k, ()) for v in VARIANTS]
    finishes += [f for k in ("four", "chat_four") for p in pairs.get(k, ()) for v in VARIANTS
                 for f in p[f"{v}_finish"]]
    short = [f for f in finishes if f != "length"]
    if short:
        res.notes.append(f"{len(short)} measured request(s) ended before max_tokens (finish "
                         f"{sorted(set(short), key=str)}): the same prompts end alike on both "
                         "servers (greedy), so the ratios hold, over fewer tokens.")


def _where_the_time_goes(res: Result, s: dict[str, Any], of: Any) -> None:
    """Scaling and CPU per token (informational rows), from each side's rounds (``of(side, key)``)."""
    for v in VARIANTS:
        scal = [ratio(a, b) for a, b in zip(of(v, "four_tok_s"), of(v, "one_tok_s"))]
        cpu = of(v, "cpu_four")
        s[v] = {"four_over_one": spread(scal),
                "cores_busy_four": spread(c["cores_busy"] for c in cpu),
                "cpu_ms_per_token_four": spread(c["cpu_ms_per_token"] for c in cpu),
                "main_thread_share_four": spread(ratio(c["main_thread_s"], c["cpu_s"]) for c in cpu),
                "peak_rss_mib": spread(of(v, "peak_rss_mib")), "startup_s": spread(of(v, "startup_s"))}
        reduced = [c["compute_threads"]["reduced_s"] for c in cpu if "reduced_s" in c.get("compute_threads", {})]
        if reduced:  # ours: seconds of each round's four-stream phase stepped on fewer compute threads
            s[v]["compute_threads_reduced_s_four"] = spread(reduced)
    h, ls = s["hydra"], s["llama-server"]
    res.rows.append(Row(f"{SLOTS} streams over one stream (scaling)", h["four_over_one"]["median"], "×",
                        ls["four_over_one"]["median"], LABEL).with_spread(h["four_over_one"]))
    res.rows.append(Row(f"server CPU per token, {SLOTS} streams", h["cpu_ms_per_token_four"]["median"], "ms",
                        ls["cpu_ms_per_token_four"]["median"], LABEL,
                        note=f"cores busy {h['cores_busy_four']['median']} vs {ls['cores_busy_four']['median']}; "
                             f"main thread's share {_pct(h['main_thread_share_four'])} vs "
                             f"{_pct(ls['main_thread_share_four'])}{_fewer_threads(h)}").with_spread(
                            h["cpu_ms_per_token_four"]))


def rss_floor_row(res: Result, s: dict[str, Any], floor: dict[str, dict[str, Any]]) -> None:
    """Ours' RSS over a bare Python server's on the same bindings after the same requests: on a
    small model RSS is mostly the interpreter's, which no Python server sheds, so "≤ 1.1×
    llama-server" cannot be met there and this budget says how much ours holds above that floor."""
    s["rss_floor"] = {v: floor[v]["rss_mib"] for v in (OURS, FLOOR, LABEL)}
    ours, bare, theirs = s["rss_floor"].values()
    text, limit, kind = BUDGETS["rss_floor"]
    q = ratio(ours, bare)
    note = f"llama-server {theirs} MiB (ours {ratio(ours, theirs):.2f}× it)" if theirs else ""
    res.rows.append(Row(FLOOR_ROW, ours, "MiB", bare, FLOOR, text, None if q is None else meets(q, "rss_floor"), note,
                        limit=limit, on="ratio", kind=kind))


def _span(sp: dict[str, Any]) -> str:
    """A ratio's median and min–max, as the notes give them."""
    return f"{sp['median']:.2f} ({sp['min']:.2f}–{sp['max']:.2f})"


def _pct(sp: dict[str, Any]) -> str:
    return "?" if sp.get("median") is None else f"{100 * sp['median']:.0f} %"


def _fewer_threads(side: dict[str, Any]) -> str:
    """A round whose four streams stepped on fewer compute threads than configured (ours judged
    the host busy) decodes slower for a reason of the host's: the CPU row says so."""
    reduced = side.get("compute_threads_reduced_s_four")
    if not reduced or not reduced["max"]:
        return ""
    return f"; fewer compute threads for up to {reduced['max']} s of a round's four streams"
