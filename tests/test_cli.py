import subprocess
import sys


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "hydra_rpc.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for name in ("serve", "call", "inspect", "fuzz", "bench"):
        assert name in out
