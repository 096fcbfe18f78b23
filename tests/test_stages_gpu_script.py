"""scripts/gpu_stages.py runs end to end on CPU (--tiny), imported the way the GPU machine
imports the package: a ``hedgecats`` symlink to src/ on PYTHONPATH, nothing installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_stages_script_tiny(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "hedgecats").symlink_to(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": str(pkg), "OUT": str(tmp_path / "out"),
           "PYTHONWARNINGS": "ignore"}
    code = ("import runpy, sys, hedgecats; print('PKG', hedgecats.__file__); "
            f"sys.argv = ['gpu_stages.py', '--tiny']; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'gpu_stages.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"PKG {pkg}" in proc.stdout  # the symlinked source, not an installed copy
    res = json.loads((tmp_path / "out" / "gpu_stages.json").read_text())
    assert [s["stage"] for s in res["stages"]] == ["transfer", "finetune"]
    for s in res["stages"]:
        assert s["tokens_per_s"] > 0 and s["steps_timed"] == 2 and len(s["losses"]) == 3
        assert s["trainable_params"] > 0
