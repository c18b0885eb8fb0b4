"""Running ``kvtier.demo.runner`` as a separate process from a test."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_app(workdir: Path, name: str, spec: dict, expect_failure: bool = False, env: dict | None = None):
    """Run one engine process on ``spec``; its JSON result, or its output if it must fail."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "kvtier.demo.runner", str(spec_path), str(out_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    if expect_failure:
        assert proc.returncode != 0, "vLLM started although the configuration is invalid"
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_path.read_text())
