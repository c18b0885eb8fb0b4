"""Running ``kvtier.cli.demo.runner`` as a separate process from a test."""

import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_app(workdir: Path, name: str, spec: dict, expect_failure: bool = False, env: dict | None = None,
            timeout: float = 600, finalize: bool = False):
    """Run one engine process on ``spec``; its JSON result, or its output if it must fail.
    Checks that no process the run started outlives it (kvtier's I/O processes included).

    The process is forked from the session's zygote (``tests.e2e.zygote``), which has imported
    vLLM and kvtier once; a run whose environment differs from the zygote's in anything a module
    may read at import starts ``python -m kvtier.cli.demo.runner`` itself instead. A forked run exits
    once its atexit handlers have run, without the interpreter's module teardown, unless
    ``finalize`` or a phase that ends without a drain (a test of what happens at exit) asks for
    the whole exit."""
    finalize = finalize or any(not phase.get("drain", True) for phase in spec.get("phases", []))
    spec_path, out_path, log_path = (workdir / f"{name}.{part}" for part in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    marker = f"{workdir}/{name}"  # the full path: runs of two test sessions at once differ
    run_env = {**os.environ, **(env or {}), "KVT_TEST_RUN": marker}
    group = None
    differs = _ZYGOTE.differs(run_env)
    if not differs:
        returncode, group = _ZYGOTE.run(spec_path, out_path, log_path, run_env, timeout, finalize)
        output = log_path.read_text(errors="replace")
    else:
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli.demo.runner", str(spec_path), str(out_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env=run_env)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
        # Kept for a failing test's reader, with why this run did not come from the zygote.
        log_path.write_text(f"started without the zygote: its environment differs in {sorted(differs)}\n{output}")
    left = survivors(marker, group)
    assert not left, f"processes of run {name} outlived it: {left}"
    if expect_failure:
        assert returncode != 0, "vLLM started although the configuration is invalid"
        return output
    assert returncode == 0, output[-6000:]
    return json.loads(out_path.read_text())


# What a run's environment may differ in from the zygote's: read when an engine starts, never at import.
_READ_AT_RUN = ("KVT_TEST_RUN", "KVTIER_", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "PYTEST_CURRENT_TEST")


class _Zygote:
    """The session's ``tests.e2e.zygote`` process. It is started at its first use with this process's
    environment, started anew when that environment has changed since (a test's own process may set
    variables, as Mooncake's client setup does), and ends with the session. A zygote replaced ends
    once its runs have."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._answers: dict[str, dict] = {}
        self._changed = threading.Condition()
        self._ids = itertools.count()

    def differs(self, run_env: dict) -> set[str]:
        """The variables, not read at run time only, in which ``run_env`` differs from the zygote's
        environment (empty: the zygote runs it), the zygote (re)started first where needed."""
        env = {key: value for key, value in os.environ.items() if not key.startswith(_READ_AT_RUN)}
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or env != self._env:
                self._start(env)
        return {key for key in run_env.keys() | self._env.keys()
                if run_env.get(key) != self._env.get(key) and not key.startswith(_READ_AT_RUN)}

    def _start(self, env: dict[str, str]) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # it takes no new run, and ends once its runs have
        self._env = env
        errors = os.path.join(tempfile.gettempdir(), f"kvtier-zygote-{os.getpid()}.log")
        with open(errors, "a") as log:  # the zygote holds its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote"], cwd=ROOT, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = proc.stdout.readline()
        assert ready.startswith('{"ready"'), f"the zygote did not start ({errors}): {ready!r}"
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        atexit.register(proc.stdin.close)  # it ends with the session
        self._proc = proc

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            message = json.loads(line)
            with self._changed:
                self._answers.setdefault(message["id"], {}).update(message)
                self._changed.notify_all()

    def _wait(self, request_id: str, key: str, timeout: float | None) -> int | None:
        """The run's ``key`` (its "pid", or its exit "status") once the zygote has told it; None past ``timeout``."""
        with self._changed:
            self._changed.wait_for(lambda: key in self._answers.get(request_id, {}), timeout)
            return self._answers.get(request_id, {}).get(key)

    def run(self, spec_path: Path, out_path: Path, log_path: Path, env: dict, timeout: float,
            finalize: bool) -> tuple[int, int]:
        """(returncode, process group) of one run; past ``timeout`` it is killed, as ``subprocess.run`` does."""
        request_id = str(next(self._ids))
        request = {"id": request_id, "spec": str(spec_path), "out": str(out_path), "log": str(log_path),
                   "cwd": str(ROOT), "env": env, "finalize": finalize}
        with self._lock:  # the zygote that ``differs`` checked, unless the environment changed in between
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        pid = self._wait(request_id, "pid", 60)
        assert pid is not None, "the zygote did not start the run"
        status = self._wait(request_id, "status", timeout)
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            self._wait(request_id, "status", 60)
            raise subprocess.TimeoutExpired(f"run {spec_path}", timeout)
        return status, pid


_ZYGOTE = _Zygote()


def marked(marker: str, group: int | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes started by the run marked ``marker``: those whose
    environment carries it, and those of process group ``group`` (a run forked by the zygote and the
    processes it forked in turn, which keep the zygote's original environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            if (group is not None and int(stat[2]) == group) or \
                    f"KVT_TEST_RUN={marker}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")))
        except OSError:
            continue
    return found


def survivors(marker: str, group: int | None = None, grace_s: float = 5.0) -> list[str]:
    """Command lines of live processes started by the run marked ``marker``, after a grace period."""
    deadline = time.monotonic() + grace_s
    while True:
        found = [cmdline for _, cmdline in marked(marker, group)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def wait_for_file(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
