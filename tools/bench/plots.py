"""PNG charts of the results (matplotlib, headless). One figure per scenario."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .common import Result, percentile, spread

STATUS_OK = 0


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ms_axis(ax, which: str = "y", label: str = "latency (ms)") -> None:
    """A log axis in plain milliseconds (0.1, 1, 10 … rather than 10⁻¹, 10⁰ …)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda _v, _pos: ""))
    (ax.set_ylabel if which == "y" else ax.set_xlabel)(label)


def _p99(values: list[float]) -> float | None:
    return percentile(values, 99)  # as the tables compute it


def _cdf(ax, values: list[float], label: str, color: str | None = None) -> None:
    """The cumulative distribution, with its p99 marked by a dotted line of the same colour."""
    v = sorted(values)
    if v:
        line, = ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], color=color,
                        label=f"{label} (n={len(v)})")
        p99 = _p99(v)
        ax.axvline(p99, color=line.get_color(), ls=":", lw=1, label=f"{label}: p99 {p99:.2f} ms")


def _cdf_panel(ax, series: list[tuple[list[float], str, str]], budget: tuple[float, str], xlabel: str,
               title: str) -> None:
    """CDFs of latency samples (values, label, colour) against a budget line, on one panel."""
    for values, label, color in series:
        _cdf(ax, values, label, color)
    ax.axvline(budget[0], color="r", ls="--", lw=0.9, label=budget[1])
    _ms_axis(ax, "x", xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def _bars(ax, labels: list[str], spreads: list[dict], ylabel: str, title: str,
          budget: tuple[float, str] | None = None) -> None:
    """Medians with min–max whiskers; ``budget`` (value, label): a dashed red line across."""
    med = [s.get("median") or 0 for s in spreads]
    lo = [m - (s.get("min") or m) for m, s in zip(med, spreads)]
    hi = [(s.get("max") or m) - m for m, s in zip(med, spreads)]
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=["#888", "#3a7", "#37a", "#a73"][:len(labels)],
           label="median, whiskers min–max over repetitions")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for i, m in enumerate(med):
        ax.annotate(f"{m:.0f}", (i, m), ha="center", va="bottom", fontsize=8)
    if budget is not None and budget[0]:
        ax.axhline(budget[0], color="r", ls="--", lw=0.9, label=budget[1])
    ax.legend(fontsize=8, loc="lower right")


def _window_ok(r: dict, key: str) -> list[tuple[float, float]]:
    """(t, ms) of a round's answered polls (``key``: "polls" columns or "remote_polls" rows) in its window."""
    a, b = r["window"]
    if key == "polls":
        p = r["polls"]
        rows = zip(p["t"], p["ms"], p["status"])
    else:
        rows = r.get(key) or []
    return [(t, ms) for t, ms, st in rows if st == STATUS_OK and a <= t < b]


def meta_under_decode(res: Result, plt) -> object:
    rounds = res.samples["rounds"]
    busy = next(r for r in rounds if r["kind"] == "busy")
    idle = next(r for r in rounds if r["kind"] == "idle")
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for r, color, what in ((idle, "#888", "idle server (baseline)"), (busy, "#37a", "while slot 0 decodes")):
        pts = _window_ok(r, "remote_polls")
        a.scatter([t for t, _ in pts], [ms for _, ms in pts], s=4, color=color,
                  label=f"STATE_META round trip, remote-like poller, {what}")
    local = _window_ok(busy, "polls")
    a.scatter([t for t, _ in local], [ms for _, ms in local], s=3, color="#c9c", marker="x",
              label="the same, a normal-priority poller on this host (no budget)")
    ok = [ms for _, ms in _window_ok(busy, "remote_polls")]
    if ok:
        a.axhline(_p99(ok), color="#37a", ls=":", lw=1, label=f"p99 while decoding {_p99(ok):.2f} ms (remote-like)")
    a.axhline(1.0, color="r", ls="--", lw=0.9, label="budget: p99 < 1 ms")
    _ms_axis(a, "y", "STATE_META latency (ms)")
    a.set_xlabel("seconds since the round started")
    t2 = a.twinx()
    tl = busy.get("tokens_per_s") or []
    t2.plot([x for x, _ in tl], [y for _, y in tl], color="#a73", lw=1.2, label="decode tok/s (100 ms bins)")
    t2.set_ylabel("decode tokens/s")
    t2.set_ylim(bottom=0)
    a.set_title("STATE_META about slot 0 while slot 0 decodes (one round of each kind)", fontsize=10)
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = t2.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right", markerscale=3)
    series = [([ms for r in rounds if r["kind"] == kind for _, ms in _window_ok(r, key)], label, color)
              for kind, key, label, color in (("idle", "remote_polls", "idle server (remote-like)", "#888"),
                                              ("busy", "remote_polls", "slot decoding (remote-like)", "#37a"),
                                              ("busy", "polls", "slot decoding (poller on this host)", "#c9c"))]
    _cdf_panel(b, series, (1.0, "budget: p99 < 1 ms"), "STATE_META latency (ms)",
               "all rounds: idle server vs slot decoding")
    return fig


def decode_overhead(res: Result, plt) -> object:
    s = res.summary
    variants = [v for v in ("bare", "pin", "v3") if v in s]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = lambda v: "e2e_rate" if v == "v3" else "decode_rate"  # noqa: E731
    goal = next((r.limit for r in res.rows if r.limit), None)
    bare = (s["bare"]["decode_rate"].get("median") or 0) * (goal or 0)
    _bars(ax, [{"bare": "bare loop (baseline)", "pin": "PIN stream", "v3": "v3 + HTTP (e2e)"}[v] for v in variants],
          [s[v][key(v)] for v in variants], "tokens/s", "decode throughput, same model and threads",
          (bare, f"budget: {goal:.0%} of the bare loop") if goal else None)
    return fig


def slots_scaling(res: Result, plt) -> object:
    names = list(res.summary)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        agg = res.summary[name]["aggregate_tok_s"]
        bare = res.summary[name].get("bare_aggregate_tok_s") or {}
        ks = sorted(agg, key=int)
        x = list(range(len(ks)))
        w = 0.38
        for off, data, color, label in ((-w / 2, agg, "#37a", "server, k slots streaming"),
                                        (w / 2, bare, "#888", "bare loop, k sequences per llama_decode")):
            if not data:
                continue
            med = [data[k].get("median") or 0 for k in ks]
            err = [[m - (data[k].get("min") or m) for m, k in zip(med, ks)],
                   [(data[k].get("max") or m) - m for m, k in zip(med, ks)]]
            ax.bar([i + off for i in x], med, w, yerr=err, capsize=3, color=color, label=label)
            for i, m in zip(x, med):
                ax.annotate(f"{m:.0f}", (i + off, m), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [f"{k} slot{'s' if k != '1' else ''}" for k in ks])
        ax.set_ylabel("aggregate tokens/s (median, whiskers min–max)")
        ax.set_title(f"{name}: aggregate tok/s (continuous batching)", fontsize=10)
        budget = next((r.limit for r in res.rows if r.limit and f"({name})" in r.metric), None)
        if "4" in ks and budget:
            i = ks.index("4")
            ax.hlines((agg["1"]["median"] or 0) * budget, i - 0.4, i + 0.4, colors="r", linestyles="--",
                      label=f"budget: 4 slots at {budget}× of 1")
        ax.legend(fontsize=8, loc="lower left")
    return fig


def reload_stall(res: Result, plt) -> object:
    runs = res.samples["runs"]
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    defaults = res.samples.get("defaults") or []
    n = len(variants) + (1 if defaults else 0)
    fig, axes = plt.subplots(n, 1, figsize=(12, 3.8 * n), squeeze=False)
    for ax, v in zip(axes[:, 0], variants):
        r = next(x for x in runs if x["variant"] == v)
        p = r["polls"]
        for gen, color in ((r["generation_before"], "#37a"), (r["generation_after"], "#3a7")):
            pts = [(t, ms) for t, ms, g, st in zip(p["t"], p["ms"], p["generation"], p["status"])
                   if g == gen and st == STATUS_OK]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=4, color=color,
                       label=f"INFO/META round trip, config_generation {gen}")
        bad = [(t, ms) for t, ms, st in zip(p["t"], p["ms"], p["status"]) if st != STATUS_OK]
        if bad:
            ax.scatter([x for x, _ in bad], [y for _, y in bad], s=12, marker="x", color="r", label="failed poll")
        rq = r["requests"]["rows"]
        busy = [(t, ms) for t, ms, st, _g in rq if st == 4]
        if busy:
            ax.scatter([x for x, _ in busy], [y for _, y in busy], s=10, marker="|", color="#a37",
                       label="E1 DECODE answered BUSY (its latency)")
        served = [(t, ms) for t, ms, st, _g in rq if st == STATUS_OK]
        ax.scatter([x for x, _ in served], [y for _, y in served], s=10, marker="^", color="#777",
                   label="E1 DECODE served (its latency)")
        ax.axhline(10, color="r", ls="--", lw=0.9, label="budget: INFO/META p99 < 10 ms")
        _ms_axis(ax, "y", "latency (ms)")
        for name, t in r["marks"].items():
            ax.axvline(t, color="k", lw=0.6, ls=":")
            ax.annotate(name.replace("_", " "), (t, 1), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="top", ha="right")
        t2 = ax.twinx()
        tl = r["tokens_per_s"]
        t2.plot([x for x, _ in tl], [y for _, y in tl], color="#a73", lw=1.2,
                label="old-config decode tok/s (100 ms bins, right axis)")
        t2.set_ylabel("decode tokens/s", color="#a73")
        t2.set_ylim(bottom=0)
        load = r.get("load_ms") or 0
        what = "blocking emulation of the C++ (baseline)" if v == "blocking" else f"--reload-policy {v}, --threads 1"
        ax.set_title(f"{what}: T3 reload at t=0 (load {load:.0f} ms, swap at {r['marks']['swapped']:.2f} s)",
                     fontsize=10)
        ax.set_xlabel("seconds since the CONFIGURE")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = t2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", markerscale=2)
    if defaults:
        _reload_defaults(axes[-1, 0], defaults[0], res.summary.get("defaults") or {})
    return fig


def _reload_defaults(ax, r: dict, s: dict) -> None:
    """Default flags: the decode's tok/s through the load, the chats fired during it."""
    tl = r["tokens_per_s"]
    ax.plot([x for x, _ in tl], [y for _, y in tl], color="#a73", lw=1.2, label="old-config decode tok/s (100 ms bins)")
    before = r["tok_s_before"]
    ax.axhline(before, color="#777", ls=":", lw=1, label=f"before the CONFIGURE: {before:.0f} tok/s (baseline)")
    ax.axhline(0.75 * before, color="r", ls="--", lw=0.9, label="budget: ≥ 75 % of before during the load")
    ax.axvspan(0, r["marks"]["load_end"], color="#fc8", alpha=0.3,
               label=f"the load: {r['load_decode_ms']:.0f} ms (idle: {r['load_idle_ms']:.0f} ms)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("decode tokens/s")
    ax.set_xlabel("seconds since the CONFIGURE")
    idle = sorted(r["chat_idle_ms"])[len(r["chat_idle_ms"]) // 2]
    chats = ", ".join(f"{ms:.0f}" for ms in r["chat_during_ms"])
    ax.set_title(f"default flags ({s.get('model', '').rsplit('/', 1)[-1]}): decode through a reload; chats during "
                 f"another reload took {chats} ms (idle {idle:.0f} ms; budget ≤ 1.5× idle)", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")


def state_transfer(res: Result, plt) -> object:
    sizes = res.samples["sizes"]
    mib = [s["state_bytes"] / (1 << 20) for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for op, style in (("get", "-o"), ("put", "-s"), ("raw-get", "--o"), ("raw-put", "--s")):
        a.plot(mib, [s["summary"][op]["mb_s"]["median"] for s in sizes], style, label=op)
    for op, color in (("get", "C0"), ("put", "C1")):
        raw = sizes[-1]["summary"][f"raw-{op}"]["mb_s"]["median"]
        if raw:
            a.plot([mib[-1]], [0.9 * raw], marker="_", ms=30, mew=2, color=color, ls="none",
                   label=f"budget at 256 MiB: {op} ≥ 0.9× raw-{op}")
    a.set_xscale("log", base=2)
    a.set_xlabel("state size (MiB)")
    a.set_ylabel("MB/s (median of the repetitions)")
    a.set_title("STATE_GET / STATE_PUT vs a raw loopback copy (raw-*: the baseline)", fontsize=10)
    a.legend(fontsize=8)
    for op in ("get", "put"):
        b.plot(mib, [s["summary"][op]["rss_growth_x"]["median"] for s in sizes], "-o", label=op)
    b.axhline(1.2, color="r", ls="--", lw=0.8, label="budget 1.2×")
    b.set_xscale("log", base=2)
    b.set_xlabel("state size (MiB)")
    b.set_ylabel("server peak RSS growth / state size")
    b.set_title("server memory per transfer", fontsize=10)
    b.legend(fontsize=8)
    return fig


def passthrough(res: Result, plt) -> object:
    s = res.summary
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    tok, mbs = s["decode_tok_s"], s["bulk_mb_s"]
    _bars(a, ["direct (baseline)", "through our port"], [tok["direct"], tok["proxy"]], "tokens/s",
          "llama.cpp ggml-RPC client decode", ((tok["direct"].get("median") or 0) * 0.9, "budget: 90 % of direct"))
    _bars(b, ["direct (baseline)", "through our port"], [mbs["direct"], mbs["proxy"]], "MB/s",
          f"one SET_TENSOR of {res.config.get('bulk_bytes', 0) >> 20} MiB",
          ((mbs["direct"].get("median") or 0) * 0.8, "budget: 80 % of direct"))
    return fig


def connections(res: Result, plt) -> object:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, label, color in (("baseline", "1 poller (baseline)", "#888"),
                               ("loaded", "100 pollers + 1,000 idle connections", "#37a")):
        _cdf(ax, [v for r in res.samples["rounds"] if r["kind"] == kind for v in r["latencies_ms"]], label, color)
    ax.axvline(5, color="r", ls="--", lw=0.9, label="budget: p99 < 5 ms")
    _ms_axis(ax, "x", "STATE_META latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=7)
    return fig


def busy_host(res: Result, plt) -> object:
    s = res.summary
    variants = list(s["meta_ms"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = ["bare loop (baseline)"] + [v.replace("-", " ") for v in variants]
    _bars(a, names, [s["decode_tok_s"]["bare"]] + [s["decode_tok_s"][v] for v in variants], "decode tokens/s",
          f"decode with {res.config['hogs']} CPU-bound processes beside it",
          ((s["decode_tok_s"]["bare"].get("median") or 0) * 0.8, "budget: defaults ≥ 80 % of the bare loop"))
    a.tick_params(axis="x", labelsize=7, rotation=15)
    series = [([x for r in res.samples["runs"] if r["variant"] == v for x in r["meta_samples"]],
               v.replace("-", " "), f"C{i}") for i, v in enumerate(variants)]
    _cdf_panel(b, series, (5, "budget (defaults): p99 < 5 ms"), "STATE_META latency while decoding (ms)",
               "STATE_META about the decoding slot, same contention")
    return fig


def prompt_cache(res: Result, plt) -> object:
    s = res.summary
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    _bars(a, ["with the cache", "--no-cache-prompt"], [s["cache"]["prefill_total_ms"], s["no-cache"]["prefill_total_ms"]],
          "ms (median, min–max)", "total prefill time of all turns")
    turns = [t for t in res.samples["turns"] if t["rep"] == 0]
    for v, style in (("cache", "-o"), ("no-cache", "--s")):
        pts = [t["ttft_ms"] for t in turns if t["variant"] == v]
        b.plot(range(1, len(pts) + 1), pts, style, label=v)
    b.set_yscale("log")
    b.set_xlabel("request (A1 B1 C1 D1 A2 …), first repetition")
    b.set_ylabel("time to first token (ms)")
    b.set_title("TTFT per turn: shared system prompt, then returning conversations", fontsize=10)
    b.legend(fontsize=8)
    return fig


def vs_llama_server(res: Result, plt) -> object | None:
    """Every figure as this server's advantage over llama-server per round (> 1: ours is better;
    a latency's ratio is inverted so the axis reads one way), the control's (llama-server against
    itself) in grey, and the /slots latency CDFs."""
    from .vs_llama_server_figures import BUDGETS, CONTROL_PREFIX, FIGURES, PAIRED

    s = res.summary
    if "skipped" in s:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    labels, med, lo, hi, colors = [], [], [], [], []
    paired = [figure for _, figure in PAIRED]
    bars = [(label, s.get(key, {}), budget) for key, label, _unit, budget in [*FIGURES, *paired]]
    bars += [(CONTROL_PREFIX + label, s.get("control", {}).get(key, {}), budget) for key, label, _unit, budget in paired]
    for label, fig_s, budget in bars:
        ratios = [q for q in fig_s.get("ratios", []) if q]
        if not ratios:
            continue
        adv = spread(1 / q if BUDGETS[budget][2] == "max" else q for q in ratios)
        labels.append(label)
        med.append(adv["median"])
        lo.append(adv["median"] - adv["min"])
        hi.append(adv["max"] - adv["median"])
        colors.append("#999" if label.startswith(CONTROL_PREFIX) else "#3a7" if adv["median"] >= 1 else "#a73")
    y = list(range(len(labels)))
    a.barh(y, med, xerr=[lo, hi], capsize=3, color=colors)
    a.axvline(1.0, color="r", ls="--", lw=0.9, label="parity with llama-server")
    a.set_yticks(y, labels, fontsize=7)
    a.invert_yaxis()
    a.set_xlabel("advantage over llama-server, per round or pair (median, min–max); > 1 is better")
    a.legend(fontsize=8)
    rounds = res.samples["rounds"]
    series = [([x for r in rounds if r["variant"] == v for x in r["slots_ms"]], v, f"C{i}")
              for i, v in enumerate(("llama-server", "hydra"))]
    for values, label, color in series:
        _cdf(b, values, label, color)
    _ms_axis(b, "x", "GET /slots latency while four streams decode (ms)")
    b.set_ylabel("fraction of requests")
    b.legend(fontsize=7)
    return fig


DRAW: dict[str, Callable] = {
    "meta-under-decode": meta_under_decode, "decode-overhead": decode_overhead, "slots-scaling": slots_scaling,
    "reload-stall": reload_stall, "state-transfer": state_transfer, "passthrough": passthrough,
    "connections": connections, "prompt-cache": prompt_cache, "busy-host": busy_host,
    "vs-llama-server": vs_llama_server,
}


def draw_all(results: list[Result], out: Path) -> list[Path]:
    """One PNG per successful scenario; a chart that fails is reported, not fatal."""
    plt = _plt()
    paths = []
    for res in results:
        draw = DRAW.get(res.scenario)
        if draw is None or res.error:
            continue
        try:
            fig = draw(res, plt)
            if fig is None:  # nothing to draw (a skipped scenario)
                continue
        except Exception as e:  # a chart must never lose the measurements already written
            print(f"hydra-rpc bench: no chart for {res.scenario}: {type(e).__name__}: {e}")
            continue
        fig.suptitle(f"hydra-rpc bench — {res.scenario}", fontsize=11)
        fig.tight_layout()
        path = out / f"{res.scenario}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
