"""A short coverage-guided atheris run over every codec decoder (skipped if atheris is absent)."""
import subprocess
import sys

import pytest

pytest.importorskip("atheris")


def test_atheris_codec_short_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.atheris_codec", "-runs=5000", "-seed=1",
                          f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Done 5000 runs" in out.stderr
