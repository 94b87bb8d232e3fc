import subprocess
import sys


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("serve", "call", "inspect", "fuzz", "bench"):
        assert name in out


def test_codec_bench_runs():
    import json

    out = subprocess.run([sys.executable, "-m", "tools.codec_bench", "--n", "2000", "--reps", "1", "--json"],
                         capture_output=True, text=True, check=True).stdout
    res = json.loads(out)
    assert res["struct_round_trips_per_s"] > 0 and res["construct_round_trips_per_s"] > 0
