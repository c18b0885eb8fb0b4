"""Real server processes on loopback for the end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from kvtier.cli.servers import free_port


def http_json(url: str, payload: dict | None = None, timeout: float = 120, headers: dict | None = None) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def stream_completion(url: str, request: dict, headers: dict | None = None, on_open=None,
                      timeout: float = 300) -> dict:
    """POST a streamed completion; its text, whether ``[DONE]`` came, and its error events.
    ``on_open`` runs once the answer's headers are in, before its body is read. The body is
    read with ``read1``: a connection cut before the last chunk raises
    ``http.client.IncompleteRead`` (iterating over the lines would end as if the stream were whole)."""
    post = urllib.request.Request(url + "/v1/completions", data=json.dumps(request).encode(),
                                  headers={"Content-Type": "application/json", **(headers or {})})
    text, done, errors, pending = "", False, [], b""
    with urllib.request.urlopen(post, timeout=timeout) as reply:
        if on_open is not None:
            on_open()
        while chunk := reply.read1(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                text += event["choices"][0]["text"]
    return {"text": text, "done": done, "errors": errors}


def http_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def kvtier_metrics(server: str) -> dict[str, float]:
    """kvtier's values on a server's /metrics, summed over labels but ``tier`` and ``phase``: per-tier
    ones are keyed "<name>|<tier>", per-phase ones "<name>|<phase>"."""
    values: dict[str, float] = {}
    for line in http_text(server + "/metrics").splitlines():
        if line.startswith("vllm:kvtier_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            for label in ("tier", "phase"):
                if f'{label}="' in line:
                    name += "|" + line.split(f'{label}="')[1].split('"')[0]
            values[name] = values.get(name, 0) + value
    return values


@contextlib.contextmanager
def vllm_server(model: str, kv_transfer_config: dict | None, log_path, port: int | None = None,
                extra_args: tuple[str, ...] = (), env: dict | None = None, startup_timeout: float = 300,
                procs: list | None = None):
    """``vllm serve`` on 127.0.0.1; yields its base URL and stops it on exit. ``procs``, if given,
    gets its process (the leader of a process group of its own)."""
    port = port or free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--block-size", "32", "--max-model-len", "4096", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--dtype", "float32", "--no-enable-prefix-caching",
            "--max-num-seqs", "16", *extra_args]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log_path}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vllm serve did not start in {startup_timeout} s; see {log_path}")
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def kvtier_proxy(prefill: str, decode: str, log_path):
    """``kvtier proxy`` in front of one prefill and one decode instance, a process of its own; yields its URL."""
    from tests.e2e.apps import ROOT

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "proxy", "--prefill", prefill, "--decode", decode,
                             "--port", str(port)], cwd=ROOT, start_new_session=True,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the proxy did not start"
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
