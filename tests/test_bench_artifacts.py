"""Every figure of docs/performance.md's bench table comes from a committed raw result:
``hydra-rpc bench --docs`` copies each run's ``<scenario>.json`` next to its charts."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from tools.bench import cli
from tools.bench.common import Result, Row, home_as_tilde
from tools.bench.report import (
    TABLE_END, TABLE_START, combined_table, load_results, numbers_without_artifact, table_block, write_docs_json,
)

REPO = Path(__file__).resolve().parent.parent
DOCS_RUNS = REPO / "docs" / "performance"


def _run(i: int) -> list[Result]:
    meta = Result("meta-under-decode", samples={"latency_ms": [0.1 * k for k in range(50)]},
                  machine={"git_commit": "abc"}, rows=[
                      Row("STATE_META p99", 0.81 + i / 10, "ms", baseline=0.9, budget="p99 < 1 ms", limit=1.0,
                          kind="max", lo=0.7, hi=1.2 + i),
                      Row("STATE_META p50", 0.4, "ms")])
    decode = Result("decode-overhead", rows=[Row("PIN tok/s", 1391.4 + 100 * i, "tok/s", baseline=1800.0,
                                                 budget="≥ 95%", limit=0.95, on="ratio")])
    return [meta, decode]


def _committed_runs(folder: Path) -> list[list[Result]]:
    dirs = sorted(folder.glob("run-*"), key=lambda p: int(p.name.split("-")[1]))
    return [load_results(d) for d in dirs] or [load_results(folder)]


def test_docs_copies_each_runs_raw_results_and_the_table_is_made_of_them(tmp_path, monkeypatch):
    out, docs = tmp_path / "bench-results", tmp_path / "docs" / "performance"
    page = tmp_path / "docs" / "performance.md"
    docs.mkdir(parents=True)
    page.write_text(f"# Performance\n\n{TABLE_START}\nold\n{TABLE_END}\n")
    (docs / "run-2").mkdir()
    (docs / "run-2" / "stale.json").write_text("{}")
    monkeypatch.setattr(cli, "DOCS_PAGE", page)
    monkeypatch.setattr(cli, "DOCS_IMAGES", docs)
    runs = [_run(i) for i in range(3)]
    for i, results in enumerate(runs):
        (out / f"run-{i + 1}").mkdir(parents=True)
        for res in results:
            res.write(out / f"run-{i + 1}")
    cli._to_docs(runs, out, 3)

    for i in range(3):
        names = sorted(p.name for p in (docs / f"run-{i + 1}").glob("*.json"))
        assert names == ["decode-overhead.json", "meta-under-decode.json"]  # the stale one is gone
        raw = json.loads((docs / f"run-{i + 1}" / "meta-under-decode.json").read_text())
        assert raw["samples"]["latency_ms"] and raw["machine"]["git_commit"] == "abc"
    block = table_block(page)
    committed = _committed_runs(docs)
    assert block == combined_table(runs)
    assert sorted(block.splitlines()) == sorted(combined_table(committed).splitlines())  # file order, not run order
    assert numbers_without_artifact(block, committed) == []
    # a figure edited by hand, or one of a run whose JSON is not committed, is found
    assert numbers_without_artifact(block.replace("1391", "1392"), committed) == ["decode-overhead | PIN tok/s: 1392"] * 2
    assert numbers_without_artifact(block, committed[:2]) != []


def test_a_large_result_is_thinned_not_cut(tmp_path):
    res = Result("big", samples={"ms": [float(k) for k in range(200_000)], "n": 3},
                 rows=[Row("p99", 1.5, "ms")], machine={"git_commit": "abc"})
    src = res.write(tmp_path)
    dst = write_docs_json(src, tmp_path / "docs-big.json", limit=200_000)
    data = json.loads(dst.read_text())
    assert dst.stat().st_size <= 200_000
    assert data["rows"] == json.loads(src.read_text())["rows"] and data["machine"]["git_commit"] == "abc"
    ms = data["samples"]["ms"]
    assert len(ms) == data["samples_thinned_to"] and ms[0] == 0.0 and ms[-1] == 199_999.0
    small = Result("small", samples={"ms": [1.0, 2.0]}, rows=[Row("p99", 1.5, "ms")]).write(tmp_path)
    assert write_docs_json(small, tmp_path / "small-docs.json").read_text() == small.read_text()  # as is


def test_every_number_in_the_docs_table_is_in_a_committed_json():
    block = table_block(REPO / "docs" / "performance.md")
    assert block
    assert numbers_without_artifact(block, _committed_runs(DOCS_RUNS)) == []


def test_a_result_names_files_under_home_from_the_tilde(tmp_path):
    model = Path.home() / ".cache" / "hydra-rpc" / "models" / "m.gguf"
    res = Result("paths", config={"model": model, "server": str(Path.home() / "bin" / "llama-server"),
                                  "other": "/opt" + str(Path.home())})
    data = json.loads(res.write(tmp_path).read_text())
    assert data["config"] == {"model": "~/.cache/hydra-rpc/models/m.gguf", "server": "~/bin/llama-server",
                              "other": "/opt" + str(Path.home())}  # only a path that starts there
    assert home_as_tilde('{"a": "/home/u/x", "b": "/home/user/y"}', "/home/u") == '{"a": "~/x", "b": "/home/user/y"}'
    assert home_as_tilde('{"a": "/x"}', "/") == '{"a": "/x"}'


def test_no_committed_result_names_a_home_directory():
    for path in DOCS_RUNS.rglob("*.json"):
        assert not re.search(r'"/(root|home/[^/"]+|Users/[^/"]+)/', path.read_text()), path


@pytest.mark.parametrize("folder_name, n_rows", [
    ("vs-llama-server", 14), ("vs-llama-server-064a559", 14), ("vs-llama-server-tiny", 14),
    ("vs-llama-server-tiny-cc8cb5c", 16), ("vs-llama-server-2bf7eb4", 16), ("vs-llama-server-0fbacc3", 17),
    ("vs-llama-server-tiny-0fbacc3", 17), ("vs-llama-server-75443f2", 21), ("vs-llama-server-tiny-75443f2", 21),
    ("vs-llama-server-tiny-75443f2-as-array", 21), ("vs-llama-server-9c29522", 21), ("vs-llama-server-2269a8d", 21),
    ("vs-llama-server-tiny-2269a8d", 21), ("vs-llama-server-ee20f51", 21), ("vs-llama-server-tiny-ee20f51", 21),
    ("vs-llama-server-fbf3a83", 21), ("vs-llama-server-9af7eee", 21), ("vs-llama-server-tiny-9af7eee", 21),
    ("vs-llama-server-aec5974", 21), ("vs-llama-server-tiny-aec5974", 21),
    ("vs-llama-server-d665156", 21), ("vs-llama-server-tiny-d665156", 21),
    ("vs-llama-server-b459344", 21), ("vs-llama-server-tiny-b459344", 21), ("vs-llama-server-tiny-b241cd7", 21),
    ("vs-llama-server-13479e7", 21), ("vs-llama-server-tiny-a6852c5", 21),
    ("vs-llama-server-969389d", 21), ("vs-llama-server-tiny-a04a314", 21), ("kinds/tiny-hybrid-wide/vs-llama-server-f4e129f", 21),
    ("vs-llama-server-tiny-72633c1", 21), ("vs-llama-server-tiny-72633c1-b", 21), ("vs-llama-server-72633c1", 21),
    ("vs-llama-server-tiny-145dd16", 21), ("vs-llama-server-tiny-246eaa2", 21), ("vs-llama-server-246eaa2", 21),
    ("vs-llama-server-bde2182", 21), ("vs-llama-server-tiny-af5ab6a", 21), ("vs-llama-server-tiny-05ca431", 24),
    ("vs-llama-server-05ca431", 24), ("kinds/tiny-moe/vs-llama-server-b4eae21", 24),
    ("kinds/tiny-moe/vs-llama-server-b4eae21-b", 24), ("kinds/tiny-hybrid-wide/vs-llama-server-c1e58b3", 24),
    ("kinds/tiny-hybrid-wide/vs-llama-server-7d97bd8", 24), ("vs-llama-server-a5348d4", 24),
    ("kinds/tiny-moe/vs-llama-server-9a5a43d", 24), ("kinds/tiny-moe/vs-llama-server-9a5a43d-b", 24),
    ("kinds/tiny-moe/vs-llama-server-883a5bd", 24), ("kinds/tiny-moe/vs-llama-server-afba993", 24),
    ("kinds/tiny-moe/vs-llama-server-3097a91", 24), ("kinds/tiny-moe/vs-llama-server-3097a91-b", 24),
    ("vs-llama-server-3097a91", 24), ("vs-llama-server-tiny-d9f8b58", 24),
    ("vs-llama-server-tiny-c0d10b2", 24), ("kinds/tiny-moe/vs-llama-server-c0d10b2", 24),
    ("vs-llama-server-c0d10b2", 24), ("vs-llama-server-ee8da8f", 24),
    ("kinds/tiny-moe/vs-llama-server-87a7005", 24), ("kinds/tiny-moe/vs-llama-server-747739a", 24),
    ("kinds/tiny-moe/vs-llama-server-a8e4f02", 24), ("vs-llama-server-4e0cd3f", 24),
    ("kinds/tiny-moe/vs-llama-server-a3952b9", 26), ("vs-llama-server-d546ac3", 26),
    ("vs-llama-server-4aafbc2", 26), ("vs-llama-server-9a9aee3", 30), ("kinds/tiny-moe/vs-llama-server-9a9aee3", 30),
    ("kinds/tiny-moe/vs-llama-server-9a9aee3-b", 30), ("vs-llama-server-tiny-9a9aee3", 30),
    ("kinds/tiny-moe/vs-llama-server-9fcd246", 30), ("vs-llama-server-9fcd246", 30),
    ("kinds/tiny-moe/vs-llama-server-5cc3d69", 30), ("kinds/tiny-moe/vs-llama-server-5cc3d69-b", 30),
    ("kinds/tiny-hybrid-wide/vs-llama-server-5cc3d69", 30), ("kinds/tiny-moe/vs-llama-server-da9241a", 30),
    ("kinds/tiny-hybrid-wide/vs-llama-server-325dad6", 30)])
def test_the_llama_server_comparison_in_the_docs_is_made_of_its_committed_runs(tmp_path, folder_name, n_rows):
    """docs/performance/vs-llama-server/run-N.json are the runs of "Three runs on Gemma 3 270M",
    vs-llama-server-064a559/ those of "Again on Gemma 3 270M", vs-llama-server-tiny/ those of
    "Three runs on the tiny model", the -cc8cb5c and -2bf7eb4 ones those of "Request by
    request, and one chat template for both", the -0fbacc3 ones those of "One stream on Gemma:
    the path between two tokens", the -75443f2 ones (and -as-array) those of "A control:
    llama-server against itself", the -9c29522 ones those of "Pooled: what the pairs
    resolve", the -2269a8d ones those of "At 2269a8d, on the faster host", the -ee20f51 ones
    and -fbf3a83 ones those of "At ee20f51: the step that hands its tokens over, kept", the -9af7eee
    ones those of "At 9af7eee: the step after a first token gives way", the -aec5974 ones those of
    "At aec5974", the -d665156 and -b459344 ones those of "At d665156" and "At b459344", -tiny-b241cd7
    those of "The HTTP side alone, and libuv's own accepts", -13479e7 those of "Gemma 3 270M at
    13479e7", -tiny-a6852c5 those of "Our own HTTP server", -969389d those of "Gemma 3 270M at
    969389d", -tiny-a04a314 those of "Again on tiny-small, at a04a314", kinds/tiny-hybrid-wide/…-f4e129f those
    of "Three runs on tiny-hybrid-wide", -tiny-72633c1 (and -b) those of "The floor under a first token", -72633c1 those of "Gemma 3
    270M at 72633c1", -tiny-145dd16 and -tiny-246eaa2 those of "On a slower host of the same kind", -246eaa2
    those of "Gemma 3 270M on the slower host", -bde2182 those of "Gemma 3 270M at bde2182, on the
    slower host", -tiny-af5ab6a those of "Tiny-small at af5ab6a, on the slower host", -05ca431 and
    -tiny-05ca431 those of "The long cold prompt paired, and the floor of RSS", kinds/tiny-moe/…-b4eae21
    (and -b) those of "The fleet's kind again: tiny-moe at b4eae21", kinds/tiny-hybrid-wide/…-c1e58b3
    those of "tiny-hybrid-wide at c1e58b3", kinds/tiny-hybrid-wide/…-7d97bd8 those of "tiny-hybrid-wide
    again at 7d97bd8", -a5348d4 those of "Gemma 3 270M at a5348d4", kinds/tiny-moe/…-9a5a43d (and -b)
    those of "tiny-moe at 9a5a43d", kinds/tiny-moe/…-883a5bd and …-afba993 those of "tiny-moe at
    883a5bd and afba993", kinds/tiny-moe/…-3097a91 (and -b) those of "tiny-moe at 3097a91",
    -3097a91 those of "Gemma 3 270M at 3097a91", -tiny-d9f8b58 those of "tiny-small at d9f8b58",
    -tiny-c0d10b2 those of "`/slots` p99 over a run's answers", kinds/tiny-moe/…-c0d10b2 those of
    "tiny-moe at c0d10b2", -c0d10b2 those of "Gemma 3 270M at c0d10b2", -ee8da8f those of
    "Gemma 3 270M at ee8da8f", kinds/tiny-moe/…-87a7005 and …-747739a those of "A checkpoint where
    a prompt parts", kinds/tiny-moe/…-a8e4f02 those of "tiny-moe at a8e4f02, on an AMD EPYC host",
    -4e0cd3f those of "Gemma 3 270M at 4e0cd3f, on an AMD EPYC host", kinds/tiny-moe/…-a3952b9
    those of "tiny-moe at a3952b9, with completions not streamed", -d546ac3 those of "Gemma 3 270M at
    d546ac3, with completions not streamed", -4aafbc2 those of "Gemma 3 270M at 4aafbc2, ggml-cpu's
    tables hidden", -9a9aee3, -tiny-9a9aee3 and kinds/tiny-moe/…-9a9aee3 (and -b) those of "Four
    streams request by request, and each run beside the control", kinds/tiny-moe/…-9fcd246 and
    -9fcd246 those of "Pairs in one order", kinds/tiny-moe/…-5cc3d69 (and -b),
    kinds/tiny-hybrid-wide/…-5cc3d69 and kinds/tiny-moe/…-da9241a those of "The fleet's kinds at
    5cc3d69, and a save llama-server does not make", kinds/tiny-hybrid-wide/…-325dad6 those of
    "tiny-hybrid-wide at 325dad6: where four streams' time goes": the
    table built
    from them is combined.md's, and each of its rows is in the page."""
    folder = DOCS_RUNS / folder_name
    runs = []
    for path in sorted(folder.glob("run-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        run_dir = tmp_path / path.stem
        run_dir.mkdir()
        (run_dir / "vs-llama-server.json").write_text(path.read_text())
        runs.append(load_results(run_dir))
    assert len(runs) == 3
    rows = [line for line in combined_table(runs).splitlines() if line.startswith("| vs-llama-server |")]
    assert len(rows) == n_rows  # every figure, the alternating pairs, the control's, scaling, CPU per token (and the floor)
    combined = (folder / "combined.md").read_text().splitlines()
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    assert [line for line in rows if line not in combined] == []
    assert [line for line in rows if line not in page] == []


def test_the_binary_port_table_in_the_docs_is_made_of_its_committed_runs():
    """"The binary port's budgets again, at 9d34715": the table built from the committed runs of
    busy-host, decode-overhead, meta-under-decode and connections, each row in the page."""
    folder = DOCS_RUNS / "binary-port-9d34715"
    runs = [load_results(folder / f"run-{r}") for r in (1, 2, 3)]
    assert all(len(run) == 4 for run in runs)
    rows = _table_rows(runs)
    assert len(rows) == 15
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    assert [line for line in rows if line not in page] == []


def _table_rows(runs: list) -> list[str]:
    """The figure rows of the combined table of ``runs`` (its header lines left out)."""
    return [line for line in combined_table(runs).splitlines()
            if line.startswith("| ") and not line.startswith("| scenario |")]


def test_the_default_flags_reload_tables_in_the_docs_are_made_of_their_committed_runs():
    """"The default-flags reload on this host, the old tree beside the new": for each tree, the
    table built from its two committed reload-stall runs, each row in the page."""
    folder = DOCS_RUNS / "reload-stall-3418ac1-vs-e1ed976"
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    for commit in ("3418ac1", "e1ed976"):
        runs = [load_results(folder / commit / f"run-{r}") for r in (1, 2)]
        assert all(run[0].scenario == "reload-stall" and run[0].machine["git_commit"] == commit for run in runs)
        rows = _table_rows(runs)
        assert len(rows) == 9
        assert [line for line in rows if line not in page] == []


@pytest.mark.parametrize("folder_name", ["vs-llama-server-75443f2", "vs-llama-server-9c29522",
                                         "vs-llama-server-tiny-75443f2", "vs-llama-server-2269a8d",
                                         "vs-llama-server-tiny-2269a8d", "vs-llama-server-ee20f51",
                                         "vs-llama-server-tiny-ee20f51", "vs-llama-server-fbf3a83",
                                         "kinds/tiny-hybrid/vs-llama-server-64ad51d",
                                         "kinds/tiny-moe/vs-llama-server-64ad51d", "vs-llama-server-9af7eee",
                                         "vs-llama-server-tiny-9af7eee", "vs-llama-server-aec5974",
                                         "vs-llama-server-tiny-aec5974", "vs-llama-server-d665156",
                                         "vs-llama-server-tiny-d665156", "vs-llama-server-b459344",
                                         "vs-llama-server-tiny-b459344", "vs-llama-server-tiny-b241cd7",
                                         "vs-llama-server-13479e7", "vs-llama-server-tiny-a6852c5",
                                         "vs-llama-server-969389d", "vs-llama-server-tiny-a04a314",
                                         "kinds/tiny-hybrid-wide/vs-llama-server-f4e129f",
                                         "vs-llama-server-tiny-72633c1", "vs-llama-server-tiny-72633c1-b",
                                         "vs-llama-server-72633c1", "vs-llama-server-tiny-145dd16",
                                         "vs-llama-server-tiny-246eaa2", "vs-llama-server-246eaa2",
                                         "vs-llama-server-bde2182", "vs-llama-server-tiny-af5ab6a",
                                         "vs-llama-server-tiny-05ca431", "vs-llama-server-05ca431",
                                         "kinds/tiny-hybrid-wide/vs-llama-server-c1e58b3",
                                         "kinds/tiny-hybrid-wide/vs-llama-server-7d97bd8",
                                         "vs-llama-server-a5348d4", "vs-llama-server-3097a91",
                                         "vs-llama-server-tiny-d9f8b58", "vs-llama-server-tiny-c0d10b2",
                                         "kinds/tiny-moe/vs-llama-server-c0d10b2", "vs-llama-server-c0d10b2",
                                         "vs-llama-server-ee8da8f", "kinds/tiny-moe/vs-llama-server-87a7005",
                                         "kinds/tiny-moe/vs-llama-server-747739a",
                                         "kinds/tiny-moe/vs-llama-server-a8e4f02",
                                         "vs-llama-server-4e0cd3f", "kinds/tiny-moe/vs-llama-server-a3952b9",
                                         "vs-llama-server-d546ac3", "vs-llama-server-4aafbc2",
                                         "vs-llama-server-9a9aee3", "vs-llama-server-tiny-9a9aee3",
                                         "kinds/tiny-moe/vs-llama-server-9fcd246", "vs-llama-server-9fcd246",
                                         "kinds/tiny-hybrid-wide/vs-llama-server-5cc3d69",
                                         "kinds/tiny-moe/vs-llama-server-da9241a",
                                         "kinds/tiny-hybrid-wide/vs-llama-server-325dad6"])
def test_the_pooled_tables_in_the_docs_are_made_of_the_committed_runs(folder_name):
    """"Pooled: what the pairs resolve", "At 2269a8d", "At ee20f51", "At 9af7eee", "At aec5974", "At d665156", "At b459344" and
    "Three runs on tiny-hybrid-wide" quote tools/bench/pooled.py on these sets, row for row."""
    from tools.bench import pooled

    samples = pooled.load([DOCS_RUNS / folder_name])
    assert len(samples) == 3
    table = pooled.markdown(pooled.pool(samples), 3).splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| figure |")]
    later = sum(key in samples[0]["pairs"] for key in ("cold", "whole", "four", "chat_four"))  # figures paired since
    assert len(rows) == 5 + later  # four paired figures (and the later ones) and /slots p99
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    assert [line for line in rows if line not in page] == []


@pytest.mark.parametrize("folders", [("vs-llama-server-tiny-72633c1", "vs-llama-server-tiny-72633c1-b"),
                                     ("vs-llama-server-tiny-145dd16", "vs-llama-server-tiny-246eaa2"),
                                     ("kinds/tiny-moe/vs-llama-server-b4eae21",
                                      "kinds/tiny-moe/vs-llama-server-b4eae21-b"),
                                     ("kinds/tiny-moe/vs-llama-server-9a5a43d",
                                      "kinds/tiny-moe/vs-llama-server-9a5a43d-b"),
                                     ("kinds/tiny-moe/vs-llama-server-883a5bd",
                                      "kinds/tiny-moe/vs-llama-server-afba993"),
                                     ("kinds/tiny-moe/vs-llama-server-3097a91",
                                      "kinds/tiny-moe/vs-llama-server-3097a91-b"),
                                     ("kinds/tiny-moe/vs-llama-server-9a9aee3",
                                      "kinds/tiny-moe/vs-llama-server-9a9aee3-b"),
                                     ("kinds/tiny-moe/vs-llama-server-5cc3d69",
                                      "kinds/tiny-moe/vs-llama-server-5cc3d69-b")])
def test_two_sets_pooled_in_the_docs_are_made_of_the_committed_runs(folders):
    """"The floor under a first token", "On a slower host of the same kind", "The fleet's kind
    again", "tiny-moe at 9a5a43d", "tiny-moe at 883a5bd and afba993" and "tiny-moe at 3097a91"
    pool two sets of three runs each: ``tools/bench/pooled.py`` on both, row for row."""
    from tools.bench import pooled

    samples = pooled.load([DOCS_RUNS / f for f in folders])
    assert len(samples) == 6
    table = pooled.markdown(pooled.pool(samples), 6).splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| figure |")]
    later = sum(key in samples[0]["pairs"] for key in ("cold", "whole", "four", "chat_four"))  # figures paired since
    assert len(rows) == 5 + later
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    assert [line for line in rows if line not in page] == []


@pytest.mark.parametrize("folders", [("vs-llama-server-9a9aee3",), ("vs-llama-server-tiny-9a9aee3",),
                                     ("kinds/tiny-moe/vs-llama-server-9fcd246",), ("vs-llama-server-9fcd246",),
                                     ("kinds/tiny-moe/vs-llama-server-9a9aee3",
                                      "kinds/tiny-moe/vs-llama-server-9a9aee3-b"),
                                     ("kinds/tiny-hybrid-wide/vs-llama-server-5cc3d69",),
                                     ("kinds/tiny-moe/vs-llama-server-da9241a",),
                                     ("kinds/tiny-hybrid-wide/vs-llama-server-325dad6",),
                                     ("kinds/tiny-moe/vs-llama-server-5cc3d69",
                                      "kinds/tiny-moe/vs-llama-server-5cc3d69-b")])
def test_the_run_by_run_tables_in_the_docs_are_made_of_the_committed_runs(folders):
    """"Four streams request by request, and each run beside the control" and "Pairs in one
    order" judge each paired figure's budget run by run, ours and the control's:
    ``tools/bench/pooled.py`` on these sets, row for row, four streams and four chats among them."""
    from tools.bench import pooled

    samples = pooled.load([DOCS_RUNS / f for f in folders])
    assert len(samples) == 3 * len(folders)
    verdicts = pooled.run_verdicts(samples)
    assert {"four", "chat_four"} <= {key for key, (_, label, *_) in pooled.PAIRED if label in
                                     {v.label for v in verdicts}}
    rows = pooled.run_verdicts_markdown(verdicts).splitlines()[4:]
    assert len(rows) == 8 and all(len(v.ours) == len(v.control) == len(samples) for v in verdicts)
    page = (REPO / "docs" / "performance.md").read_text().splitlines()
    assert [line for line in rows if line not in page] == []


@pytest.mark.parametrize("folder, model", [
    ("tiny", "tiny"), ("tiny-hybrid", "tiny-hybrid"), ("gemma-270m", "gemma-270m"), ("give-way-ab", "tiny"),
    ("9af7eee/tiny", "tiny"), ("9af7eee/tiny-hybrid", "tiny-hybrid"), ("9af7eee/gemma-270m", "gemma-270m"),
    ("snapshots-after-turn-ab", "tiny"), ("d521421", "tiny"), ("b241cd7", "tiny"), ("a6852c5", "tiny"),
    ("ab-1fcd89d", "tiny"), ("ab-a6852c5", "tiny"), ("72633c1", "tiny"), ("ab-2d1739c", "tiny"),
    ("aa-16b7882", "tiny"), ("ab-1bd8cb1", "tiny"), ("aa-246eaa2", "tiny"), ("ab-e69df33", "tiny"),
    ("aa-3ea5ed1", "tiny")])
def test_the_idle_gap_tables_in_the_docs_are_made_of_their_committed_runs(folder, model):
    """docs/performance/ttft-gaps/MODEL/run-N.json are the runs of "Short requests a few
    milliseconds apart", give-way-ab/ and 9af7eee/MODEL/ those of "A step that kept the core",
    snapshots-after-turn-ab/ those of "After a step: the streams' turn first", d521421/ that of
    "A short request's path, stage by stage", b241cd7/ those of "The HTTP side alone", a6852c5/
    and ab-*/ those of "Our own HTTP server", 72633c1/, ab-2d1739c/ and aa-16b7882/ those of "The floor under a first token",
    ab-1bd8cb1/ and aa-246eaa2/ those of "On a slower host of the same kind", ab-e69df33/ and
    aa-3ea5ed1/ those of "At e69df33, on the slower host":
    the table built from them (``ttft_gaps --table``) is the page's."""
    from tools.bench.common import load_runs
    from tools.bench.ttft_gaps import runs_table

    runs = load_runs(DOCS_RUNS / "ttft-gaps" / folder)
    assert runs and all(r["model"] == model for r in runs)
    page = (REPO / "docs" / "performance.md").read_text()
    assert runs_table(runs) in page


def test_the_idle_decode_figures_in_the_docs_are_those_of_the_committed_runs():
    """docs/performance/idle-decode/run-N.json back "At e69df33, on the slower host": with the
    servers' two threads, a decode after 10 ms of idleness costs over twice one right after
    another, and spinning 300 µs before it does not bring it back."""
    rows = [json.loads(p.read_text())["rows"] for p in sorted((DOCS_RUNS / "idle-decode").glob("run-*.json"))]
    assert len(rows) == 3

    def ratio(run, gap, busy):
        return next(r["ratio"] for r in run if (r["threads"], r["gap_ms"], r["busy_before_us"]) == (2, gap, busy))

    page = (REPO / "docs" / "performance.md").read_text()
    for gap, busy in ((2.0, 0.0), (10.0, 0.0), (10.0, 300.0)):
        got = [ratio(run, gap, busy) for run in rows]
        assert f"{min(got):.2f}–{max(got):.2f}×" in page, (gap, busy, got)
    assert min(ratio(run, 10.0, 300.0) for run in rows) > 2


@pytest.mark.parametrize("folder", ["41eb3a0", "b241cd7", "a6852c5"])
def test_the_http_floor_tables_in_the_docs_are_made_of_their_committed_runs(folder):
    """docs/performance/http-floor/COMMIT/run-N.json are the runs of "The HTTP side alone, and
    libuv's own accepts", before and after the change, and of "Our own HTTP server": ``http_floor --table``
    of each is the page's."""
    from tools.bench.common import load_runs
    from tools.bench.http_floor import runs_table

    runs = load_runs(DOCS_RUNS / "http-floor" / folder)
    assert len(runs) == 3 and all(r["model"] == "tiny" and r["machine"]["git_commit"].startswith(folder) for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()


def test_the_checkpoint_copy_table_in_the_docs_is_made_of_its_committed_runs():
    """docs/performance/checkpoints/run-N.json are the runs of "Checkpoints of the fleet model's
    recurrent state"; ab-run-N.json its request-by-request A/B and agent-run-N.json its agent
    turns, whose medians the page quotes."""
    import statistics

    from tools.bench.checkpoint_copy import runs_table
    from tools.bench.common import load_runs

    folder = DOCS_RUNS / "checkpoints"
    runs = load_runs(folder)
    assert len(runs) == 3 and all(r["model"] == "tiny-hybrid-wide" for r in runs)
    page = (REPO / "docs" / "performance.md").read_text()
    assert runs_table(runs) in page
    for i, path in enumerate(sorted(folder.glob("ab-run-*.json")), 1):
        pairs = json.loads(path.read_text())["samples"]
        old, new = (statistics.median(x["prompt_ms"] for x in pairs[k]) for k in ("old", "new"))
        ratio = statistics.median(b["total_ms"] / a["total_ms"] for a, b in zip(pairs["old"], pairs["new"]))
        assert f"| {i} | {old:.0f} | {new:.0f} | {ratio:.3f} |" in page
    for i, path in enumerate(sorted(folder.glob("agent-run-*.json")), 1):  # the fleet's agent turns
        turns = json.loads(path.read_text())["turns"]
        ls, old, new = ([t["ttft_ms"] for t in turns[k]] for k in ("llama-server", "old", "new"))
        ratios = [statistics.median(a / b for a, b in zip(x, y)) for x, y in ((old, ls), (new, ls), (new, old))]
        medians = " | ".join(f"{statistics.median(v):.0f}" for v in (ls, old, new))
        assert f"| {i} | {medians} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |" in page


def test_idle_gap_summary_takes_medians_and_ratios_to_llama_server():
    from tools.bench.ttft_gaps import runs_table, summarize_gaps

    samples = {"2.0": {"llama-server": [1.0, 2.0, 3.0], "ours": [2.0, 4.0, 6.0]}}
    summary = summarize_gaps(samples)
    assert summary["2.0"]["ours"]["median"] == 4.0 and summary["2.0"]["ours"]["ratio"] == 2.0
    assert summary["2.0"]["llama-server"]["n"] == 3
    table = runs_table([{"summary": summary}, {"summary": summarize_gaps({"2.0": {"llama-server": [2.0],
                                                                                   "ours": [3.0]}})}])
    assert "| 2 ms | 2.00 | 3.00–4.00; 1.50–2.00× |" in table
    other_gaps = {"summary": summarize_gaps({"0.0": {"llama-server": [1.0], "ours": [1.0]}, **samples})}
    assert runs_table([other_gaps, {"summary": summary}]).splitlines()[2:] == [
        "| 2 ms | 2.00 | 4.00; 2.00× |"]  # only the gaps every run has


def test_agent_turn_summary_takes_per_turn_ratios_to_llama_server():
    from tools.bench.agent_turns import runs_table, summarize_turns

    def turn(wall: float, ttfts: list[float]) -> dict:
        return {"wall_ms": wall, "ttft_ms": ttfts, "prompt_n": [300] * len(ttfts)}

    samples = {"llama-server": [turn(100, [10, 30]), turn(200, [40, 40])],
               "ours": [turn(90, [20, 20]), turn(240, [30, 50])]}
    summary = summarize_turns(samples)
    assert summary["wall_ms"]["ours"] == {"median": 165.0, "ratio": 1.05, "ratio_min": 0.9, "ratio_max": 1.2}
    assert summary["ttft_ms"]["ours"]["ratio"] == 1.0  # the agents' median first token per turn: 20/20, 40/40
    assert summary["prompt_n"] == [300, 300]
    table = runs_table([{"summary": {"2": summary}}])
    assert "| 2 | turn, send to last reply's end | 150 | 165 | 1.050 (0.90–1.20) |" in table


@pytest.mark.parametrize("folder, same_prompts_from, model, until", [
    ("tiny-hybrid-wide", 0, "tiny-hybrid-wide", None), ("tiny-hybrid-wide-4-agents", 3, "tiny-hybrid-wide", None),
    ("tiny-moe", 0, "tiny-moe", 11), ("tiny-moe-before-bafa853", 0, "tiny-moe", 11),
    ("tiny-hybrid-wide-bafa853", 0, "tiny-hybrid-wide", 11), ("tiny-moe-87a7005", 0, "tiny-moe", 11),
    ("tiny-moe-d38eba7", 0, "tiny-moe", 11), ("tiny-hybrid-wide-fd4466a", 0, "tiny-hybrid-wide", 11),
    ("tiny-moe-bafc66b", 0, "tiny-moe", 11)])
def test_the_agent_turns_tables_in_the_docs_are_made_of_their_committed_runs(folder, same_prompts_from, model, until):
    """docs/performance/agent-turns/FOLDER/run-N.json are the runs of "Agents' turns against
    llama-server" (and of "More agents than slots" there, of "An agent's turn cut where
    llama-server cuts it", of "A chat with tools that answers in text", of "tiny-hybrid-wide's agents at fd4466a" and of "The
    agents' turns on the AMD EPYC host"): the table built from them (``agent_turns --table``) is the page's,
    and both servers computed the same prompts (with four agents, from the fourth turn on:
    llama-server recomputes some before; since bafa853 but the two agents' last turn, where ours
    finds the first agent's prompt cached from the one-agent phase but 4 tokens)."""
    from tools.bench.agent_turns import runs_table
    from tools.bench.common import load_runs

    runs = load_runs(DOCS_RUNS / "agent-turns" / folder)
    assert len(runs) == 3 and all(r["model"] == model for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()
    for run in runs:
        for turns in run["samples"].values():
            ours, theirs = ([t["prompt_n"] for t in turns[k][same_prompts_from:until]] for k in ("ours", "llama-server"))
            assert ours == theirs


def test_with_a_small_ram_tier_the_agents_come_back_from_the_disk_tier():
    """The runs of "A RAM tier smaller than the agents' conversations": their table is the
    page's; ours computed only each turn's new step, its conversations going through the disk
    tier, while the run from before the checkpoints went to disk recomputed them."""
    from tools.bench.agent_turns import runs_table
    from tools.bench.common import load_runs

    folder = DOCS_RUNS / "agent-turns" / "tiny-hybrid-wide-4-agents-cache-ram-300"
    runs = load_runs(folder)
    assert len(runs) == 3 and all(r["cache_ram_mib"] == 300 for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()
    for run in runs:
        assert {n for t in run["samples"]["4"]["ours"] for n in t["prompt_n"]} == {589, 597}
        assert 'hydra_prompt_cache_disk_spills_total 32.0' in run["ours_prompt_cache"]["4"]
    assert 'hydra_prompt_cache_disk_restores_total 31.0' in runs[2]["ours_prompt_cache"]["4"]
    before = json.loads((folder / "before-ef38797.json").read_text())
    assert max(n for t in before["samples"]["4"]["ours"] for n in t["prompt_n"]) == 6130
    assert before["summary"]["4"]["wall_ms"]["ours"]["ratio"] == 1.727
    mapped = json.loads((folder / "mapped-bdf97fe.json").read_text())
    assert mapped["summary"]["4"]["wall_ms"]["ours"]["ratio"] == 0.371
    assert 'hydra_prompt_cache_disk_restores_total 31.0' in mapped["ours_prompt_cache"]["4"]


def test_before_the_hand_over_four_agents_recomputed_from_the_system_prompt():
    """The run quoted in "More agents than slots" from before checkpoints went to the RAM tier."""
    run = json.loads((DOCS_RUNS / "agent-turns" / "tiny-hybrid-wide-4-agents" / "before-9d97c2f.json").read_text())
    ours = run["samples"]["4"]["ours"]
    assert {n for t in ours for n in t["cache_n"]} == {870}
    assert run["summary"]["4"]["wall_ms"]["ours"]["ratio"] == 1.629


def test_a_swap_stall_round_counts_the_streams_gaps_inside_the_agents_window():
    """Only tokens between the first turn's send and the last turn's end count: the gaps
    before the agents begin (the stream's warm start) and after are not the agents' doing."""
    from tools.bench.common import BenchError
    from tools.bench.swap_stall import runs_table, summarize, window_figures

    times = [0.0, 0.5, 1.0, 1.01, 1.02, 3.02, 3.03, 9.0]
    got = window_figures(times, 0.9, 3.5, [100.0, 300.0, 200.0])
    assert got["gap_max_ms"] == 2000.0 and got["gap_median_ms"] == 10.0 and got["tokens_in_window"] == 5
    assert got["turn_ms"] == 200.0 and got["stream_covered"] and got["stream_tok_s"] == round(4 / 2.03, 2)
    assert not window_figures(times[:7], 0.9, 9.0, [1.0])["stream_covered"]  # the stream ended first
    with pytest.raises(BenchError):
        window_figures(times, 4.0, 8.0, [1.0])  # no two tokens in the window
    rounds = {"llama-server": [dict(got, gap_max_ms=4000.0)], "ours": [got]}
    summary = summarize(rounds)
    assert summary["gap_max_ms"]["ours"] == {"median": 2000.0, "ratio": 0.5}
    assert "| stream: longest gap between tokens (ms) | 4000.0 | 2000.0 | 0.500 |" in runs_table([{"summary": summary}])


@pytest.mark.parametrize("folder, new_agent_cached, batch", [("swap-stall-tiny-hybrid-wide", 874, None),
                                                              ("swap-stall-tiny-hybrid-wide-user-turns", 1295, None),
                                                              ("swap-stall-tiny-hybrid-wide-batch-256", 1295, 256)])
def test_the_swap_stall_tables_in_the_docs_are_made_of_their_committed_runs(folder, new_agent_cached, batch):
    """The runs of "A stream while agents take turns on the other slot": the page's tables, and
    what it says of them: llama-server computes every agent from the system prompt on (1,295
    tokens cached), ours restores each at its checkpoint; a new agent from 874 tokens before
    the checkpoint at the last user turn, from the system prompt's end (1,295) with it, and
    with ``-b 256`` too."""
    from tools.bench.common import load_runs
    from tools.bench.swap_stall import runs_table

    runs = load_runs(DOCS_RUNS / "agent-turns" / folder)
    assert len(runs) == 3 and all(r["model"] == "tiny-hybrid-wide" and r.get("batch") == batch for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()
    for run in runs:
        assert all(r["stream_covered"] for rs in run["rounds"].values() for r in rs)
        assert {n for r in run["rounds"]["llama-server"] for n in r["cache_n"][1:]} == {1295}
        assert {n for r in run["rounds"]["ours"] for n in r["cache_n"][1:]} == {new_agent_cached, 1386, 1991, 2596}


def test_the_behind_long_prompt_table_in_the_docs_is_made_of_its_committed_runs():
    """The runs of "A short request behind a long prompt": the page's table, and what it says of
    them: ours computes the short request beside the long prompt in every round, llama-server
    after all of it in the rounds where the long prompt sat on the slot before the short one,
    and this engine did too with the arrival order (the "before" run)."""
    from tools.bench.behind_long_prompt import runs_table, summarize
    from tools.bench.common import load_runs

    folder = DOCS_RUNS / "agent-turns" / "behind-long-prompt-tiny-hybrid-wide-batch-512"
    runs = load_runs(folder)
    assert len(runs) == 3 and all(r["batch"] == 512 and r["model"] == "tiny-hybrid-wide" for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()
    rounds = [r for run in runs for r in run["rounds"]["ours"]]
    theirs = [r for run in runs for r in run["rounds"]["llama-server"]]
    assert all(r["short_sent_before_long_ended"] for r in rounds + theirs)
    assert all(r["short_ms"] < r["long_ms"] / 3 for r in rounds)  # beside the long prompt, not after it
    assert any(r["short_ms"] > r["long_ms"] * 0.8 for r in theirs)
    before = json.loads((folder / "before-a4ca09d.json").read_text())
    assert all(r["short_ms"] > r["long_ms"] * 0.8 for r in before["rounds"]["ours"])
    made = summarize(before["rounds"])
    assert made["short_ms"]["llama-server"]["ratio"] == 1.0 and made["short_ms"]["ours"]["ratio"] > 3


@pytest.mark.parametrize("folder, model", [("gemma-270m-8e82c1e", "gemma-270m"),
                                           ("gemma-270m-188dcf3-bsymbolic", "gemma-270m"),
                                           ("gemma-270m-4aafbc2-hidden", "gemma-270m")])
def test_the_bindings_floor_tables_in_the_docs_are_made_of_their_committed_runs(folder, model):
    """docs/performance/bindings-floor/FOLDER/run-N.json are the runs of "The bindings' floor,
    measured by a bench", of "Shared libraries bound to themselves" and of "ggml-cpu's tables,
    hidden": the table built from
    them (``bindings_floor --table``) is the page's, and every round has each of the three's
    figures."""
    from tools.bench.bindings_floor import WHO, runs_table
    from tools.bench.common import load_runs

    runs = load_runs(DOCS_RUNS / "bindings-floor" / folder)
    assert len(runs) == 3 and all(r["model"] == model for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()
    for run in runs:
        assert len(run["samples"]) == run["rounds"]
        assert all(set(rnd) == set(WHO) and all(rnd[w]["prompt_ms"] > 0 and rnd[w]["tok_s"] > 0 for w in WHO)
                   for rnd in run["samples"])


def test_the_c_process_rounds_in_the_docs_are_the_committed_ones():
    """docs/performance/ggml-tables-hidden/c-process-rounds.json holds every round of "ggml-cpu's
    tables, hidden": each run's median ratio of the pairs the section reads is in it."""
    data = json.loads((DOCS_RUNS / "ggml-tables-hidden" / "c-process-rounds.json").read_text())
    page = (REPO / "docs" / "performance.md").read_text()
    section = page.split("### ggml-cpu's tables, hidden", 1)[1].split("\n### ", 1)[0]
    pairs = [("py", "shared"), ("cpy", "shared"), ("shared", "static"), ("symb", "myshared"),
             ("hid", "myshared"), ("hid", "static"), ("wnew", "wold"), ("wnew", "static"), ("wold", "static")]
    quoted = 0
    for run in data["runs"]:
        rounds = run["prompt_ms_per_round"]
        assert rounds and all(set(r) == set(run["participants"]) and all(v > 0 for v in r.values()) for r in rounds)
        for a, b in pairs:
            if a in run["participants"] and b in run["participants"]:
                assert f"{statistics.median(r[a] / r[b] for r in rounds):.3f}" in section, (a, b)
                quoted += 1
    assert quoted == 15 and set(data["participants"]) >= {p for pair in pairs for p in pair}


def test_the_ram_tier_table_in_the_docs_is_made_of_its_committed_runs():
    """docs/performance/ram-tier/run-N.json are the runs of "The RAM tier's lookup over many
    conversations", each beside the revision the page names."""
    from tools.bench.common import load_runs
    from tools.bench.ram_tier_lookup import runs_table

    runs = load_runs(DOCS_RUNS / "ram-tier")
    assert len(runs) == 3 and all(r["against"] == "3faba0e" and len(r["rounds"]) == 5 for r in runs)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()


def test_the_perf_breakdown_table_in_the_docs_is_made_of_its_committed_runs():
    """docs/performance/kinds/tiny-hybrid-wide/perf-breakdown-ebbf998/ are the runs of "tiny-hybrid-wide
    at 325dad6: where four streams' time goes": two rounds a server each, four streams that ran
    their 200 tokens, and the kinds of work summing to each server's samples."""
    from tools.bench.common import load_runs
    from tools.bench.perf_breakdown import SERVERS, runs_table

    runs = load_runs(DOCS_RUNS / "kinds" / "tiny-hybrid-wide" / "perf-breakdown-ebbf998")
    assert len(runs) == 3 and all(r["model"] == "tiny-hybrid-wide" for r in runs)
    for r in (r for run in runs for k in SERVERS for r in run["rounds"][k]):
        assert r["stream_tokens"] == [200] * 4 and sum(r["kinds"].values()) == pytest.approx(100, abs=1.5)
    assert runs_table(runs) in (REPO / "docs" / "performance.md").read_text()


def test_the_huge_pages_tables_in_the_docs_are_made_of_their_committed_runs():
    """docs/performance/checkpoints-huge-pages/{before,after}/ are the runs of "New checkpoints
    in huge pages": tools.bench.checkpoint_copy at 325dad6 and after ebbf998."""
    from tools.bench.checkpoint_copy import runs_table
    from tools.bench.common import load_runs

    page = (REPO / "docs" / "performance.md").read_text()
    for side, commit in (("before", "325dad6"), ("after", "ebbf998")):
        runs = load_runs(DOCS_RUNS / "checkpoints-huge-pages" / side)
        assert len(runs) == 3 and all(r["machine"]["git_commit"].startswith(commit) for r in runs)
        assert runs_table(runs) in page
