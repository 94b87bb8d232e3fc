"""PNG charts of the results (matplotlib, headless). One figure per scenario."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .common import Result

STATUS_OK = 0


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"{label} (n={len(v)})")


def _bars(ax, labels: list[str], spreads: list[dict], ylabel: str, title: str) -> None:
    med = [s.get("median") or 0 for s in spreads]
    lo = [m - (s.get("min") or m) for m, s in zip(med, spreads)]
    hi = [(s.get("max") or m) - m for m, s in zip(med, spreads)]
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=["#888", "#3a7", "#37a", "#a73"][:len(labels)])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for i, m in enumerate(med):
        ax.annotate(f"{m:.0f}", (i, m), ha="center", va="bottom", fontsize=8)


def meta_under_decode(res: Result, plt) -> object:
    rounds = res.samples["rounds"]
    busy = next(r for r in rounds if r["kind"] == "busy")
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    p = busy["polls"]
    a.scatter(p["t"], p["ms"], s=4, label="STATE_META round trip (ms)")
    a.set_yscale("log")
    a.set_xlabel("seconds")
    a.set_ylabel("META latency (ms)")
    a.axhline(1.0, color="r", ls="--", lw=0.8, label="budget p99 1 ms")
    t2 = a.twinx()
    tl = busy.get("tokens_per_s") or []
    t2.plot([x for x, _ in tl], [y for _, y in tl], color="#a73", lw=1.2, label="decode tok/s (100 ms bins)")
    t2.set_ylabel("tokens/s")
    a.set_title("STATE_META about slot 0 while slot 0 decodes (one round)", fontsize=10)
    h1, l1 = a.get_legend_handles_labels()
    h2, l2 = t2.get_legend_handles_labels()
    a.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    for kind in ("idle", "busy"):
        vals = [ms for r in rounds if r["kind"] == kind
                for t, ms, st in zip(r["polls"]["t"], r["polls"]["ms"], r["polls"]["status"])
                if st == STATUS_OK and r["window"][0] <= t < r["window"][1]]
        _cdf(b, vals, kind)
    b.set_xscale("log")
    b.set_xlabel("META latency (ms)")
    b.set_title("all rounds: idle server vs slot decoding", fontsize=10)
    b.legend(fontsize=8)
    return fig


def decode_overhead(res: Result, plt) -> object:
    s = res.summary
    variants = [v for v in ("bare", "pin", "v3") if v in s]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = lambda v: "e2e_rate" if v == "v3" else "decode_rate"  # noqa: E731
    _bars(ax, [{"bare": "bare loop", "pin": "PIN stream", "v3": "v3 + HTTP (e2e)"}[v] for v in variants],
          [s[v][key(v)] for v in variants], "tokens/s (median, min–max)", "decode throughput, same model and threads")
    return fig


def slots_scaling(res: Result, plt) -> object:
    names = list(res.summary)
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        agg = res.summary[name]["aggregate_tok_s"]
        ks = sorted(agg, key=int)
        _bars(ax, [f"{k} slot{'s' if k != '1' else ''}" for k in ks], [agg[k] for k in ks], "aggregate tokens/s",
              f"{name}: aggregate tok/s (continuous batching)")
        if "4" in ks:
            i = ks.index("4")
            ax.hlines((agg["1"]["median"] or 0) * 2.5, i - 0.4, i + 0.4, colors="r", linestyles="--",
                      label="4 slots at 2.5× of 1")
            ax.legend(fontsize=8, loc="lower left")
    return fig


def reload_stall(res: Result, plt) -> object:
    runs = res.samples["runs"]
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    fig, axes = plt.subplots(len(variants), 1, figsize=(12, 3.6 * len(variants)), sharex=True, squeeze=False)
    for ax, v in zip(axes[:, 0], variants):
        r = next(x for x in runs if x["variant"] == v)
        p = r["polls"]
        for gen, color in ((r["generation_before"], "#37a"), (r["generation_after"], "#3a7")):
            pts = [(t, ms) for t, ms, g, st in zip(p["t"], p["ms"], p["generation"], p["status"])
                   if g == gen and st == STATUS_OK]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=4, color=color,
                       label=f"INFO/META latency, config_generation {gen}")
        bad = [(t, ms) for t, ms, st in zip(p["t"], p["ms"], p["status"]) if st != STATUS_OK]
        if bad:
            ax.scatter([x for x, _ in bad], [y for _, y in bad], s=12, marker="x", color="r", label="failed poll")
        rq = r["requests"]["rows"]
        busy = [(t, ms) for t, ms, st, _g in rq if st == 4]
        if busy:
            ax.scatter([x for x, _ in busy], [y for _, y in busy], s=10, marker="|", color="#a37",
                       label="E1 DECODE answered BUSY")
        served = [(t, ms) for t, ms, st, _g in rq if st == STATUS_OK]
        ax.scatter([x for x, _ in served], [y for _, y in served], s=10, marker="^", color="#777",
                   label="E1 DECODE served (latency)")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.axhline(10, color="r", ls="--", lw=0.8)
        for name, t in r["marks"].items():
            ax.axvline(t, color="k", lw=0.6, ls=":")
            ax.annotate(name.replace("_", " "), (t, 1), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="top", ha="right")
        t2 = ax.twinx()
        tl = r["tokens_per_s"]
        t2.plot([x for x, _ in tl], [y for _, y in tl], color="#a73", lw=1.2)
        t2.set_ylabel("old-config decode tok/s", color="#a73")
        load = r.get("load_ms") or 0
        ax.set_title(f"{v}: T3 reload at t=0 (load {load:.0f} ms, swap at {r['marks']['swapped']:.2f} s)",
                     fontsize=10)
        ax.legend(fontsize=7, loc="upper left", markerscale=2)
    axes[-1, 0].set_xlabel("seconds since CONFIGURE")
    return fig


def state_transfer(res: Result, plt) -> object:
    sizes = res.samples["sizes"]
    mib = [s["state_bytes"] / (1 << 20) for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for op, style in (("get", "-o"), ("put", "-s"), ("raw-get", "--o"), ("raw-put", "--s")):
        a.plot(mib, [s["summary"][op]["mb_s"]["median"] for s in sizes], style, label=op)
    a.axhline(1000, color="r", ls="--", lw=0.8, label="budget 1 GB/s")
    a.set_xscale("log", base=2)
    a.set_xlabel("state size (MiB)")
    a.set_ylabel("MB/s (median)")
    a.set_title("STATE_GET / STATE_PUT vs a raw loopback copy", fontsize=10)
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
    _bars(a, ["direct", "through our port"], [s["decode_tok_s"]["direct"], s["decode_tok_s"]["proxy"]], "tokens/s",
          "llama.cpp ggml-RPC client decode")
    _bars(b, ["direct", "through our port"], [s["bulk_mb_s"]["direct"], s["bulk_mb_s"]["proxy"]], "MB/s",
          f"one SET_TENSOR of {res.config.get('bulk_bytes', 0) >> 20} MiB")
    return fig


def connections(res: Result, plt) -> object:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, label in (("baseline", "1 poller"), ("loaded", "100 pollers + 1,000 idle connections")):
        _cdf(ax, [v for r in res.samples["rounds"] if r["kind"] == kind for v in r["latencies_ms"]], label)
    ax.axvline(5, color="r", ls="--", lw=0.8, label="budget p99 5 ms")
    ax.set_xscale("log")
    ax.set_xlabel("STATE_META latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
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


DRAW: dict[str, Callable] = {
    "meta-under-decode": meta_under_decode, "decode-overhead": decode_overhead, "slots-scaling": slots_scaling,
    "reload-stall": reload_stall, "state-transfer": state_transfer, "passthrough": passthrough,
    "connections": connections, "prompt-cache": prompt_cache,
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
