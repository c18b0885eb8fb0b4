"""Running ``kvtier.demo.runner`` as a separate process from a test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_app(workdir: Path, name: str, spec: dict, expect_failure: bool = False, env: dict | None = None,
            timeout: float = 600):
    """Run one engine process on ``spec``; its JSON result, or its output if it must fail.
    Checks that no process the run started outlives it (kvtier's I/O processes included)."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    marker = f"{workdir}/{name}"  # the full path: runs of two test sessions at once differ
    proc = subprocess.run([sys.executable, "-m", "kvtier.demo.runner", str(spec_path), str(out_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "KVT_TEST_RUN": marker})
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)  # kept for a failing test's reader
    left = survivors(marker)
    assert not left, f"processes of run {name} outlived it: {left}"
    if expect_failure:
        assert proc.returncode != 0, "vLLM started although the configuration is invalid"
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_path.read_text())


def marked(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes started by the run marked ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if f"KVT_TEST_RUN={marker}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")))
        except OSError:
            continue
    return found


def survivors(marker: str, grace_s: float = 5.0) -> list[str]:
    """Command lines of live processes started by the run marked ``marker``, after a grace period."""
    deadline = time.monotonic() + grace_s
    while True:
        found = [cmdline for _, cmdline in marked(marker)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def wait_for_file(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
