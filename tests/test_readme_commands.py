"""Every block marked ``bash runnable`` in README.md and docs/ runs as written, against a generated model.

A block runs from a folder of its own with ``.venv`` beside it, ``.venv/bin`` on
``PATH``, ``MODEL`` set to a generated model with a tokenizer and ``VLLM_ARGS`` to
this machine's flags. Whatever it left running (servers in the background) is
stopped when it ends: SIGINT, then SIGTERM, then SIGKILL. Its output must show what
its ``# expect: REGEX`` line says; a block without one must show a completion.
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [block for page in PAGES for block in re.findall(r"^```bash runnable\n(.*?)^```", page.read_text(), re.S | re.M)]
NAMES = [f"{page.name}-{i}" for page in PAGES
         for i, _ in enumerate(re.findall(r"^```bash runnable\n", page.read_text(), re.M))]
VLLM_ARGS = "--gpu-memory-utilization 0.3 --max-model-len 4096 --max-num-seqs 8 --enforce-eager"


def test_the_readme_has_runnable_blocks():
    readme = (ROOT / "README.md").read_text()
    assert len(re.findall(r"^```bash runnable\n", readme, re.M)) >= 2 and len(BLOCKS) >= 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvtier.cli.demo.model import make_model
    return str(make_model(tmp_path_factory.mktemp("readme") / "model", num_layers=2, hidden_size=256, num_heads=4,
                          num_kv_heads=4))


def _stop(group: int) -> None:
    for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=NAMES)
def test_a_readme_block_runs_as_written(index, model, tmp_path):
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    env = {**os.environ, "MODEL": model, "VLLM_ARGS": VLLM_ARGS, "VLLM_CPU_KVCACHE_SPACE": "1",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    log_path = tmp_path / "output.log"
    with open(log_path, "w") as log:  # a file, not a pipe: the servers it leaves running hold their copy open
        proc = subprocess.Popen(["bash", "-eu", "-c", BLOCKS[index]], cwd=tmp_path, env=env, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=480)
    except subprocess.TimeoutExpired:
        pytest.fail(f"block {index} did not finish in 480 s:\n{log_path.read_text()[-4000:]}")
    finally:
        _stop(proc.pid)  # the servers it started in the background
    output = log_path.read_text()
    assert proc.returncode == 0, output[-4000:]
    expect = re.search(r"^# expect: (.+)$", BLOCKS[index], re.M)
    if "kvtier doctor" in BLOCKS[index]:  # a check: every tier it names must work
        assert "kvtier doctor: every configured tier works" in output, output[-4000:]
        if not expect:
            return
    if expect:
        assert re.search(expect.group(1), output), f"no {expect.group(1)!r} in the output:\n{output[-4000:]}"
        return
    assert re.search(r'"choices":\s*\[\{.*?"text":', output), f"no completion came back:\n{output[-4000:]}"
