"""Engine runs forked from a process that has imported vLLM and kvtier once.

Importing vLLM takes about 6 s here, more than most runs' own work. This process
imports what ``kvtier.demo.runner`` imports, runs nothing, and forks one child per
run: each child is a new process (its own engine, its own kvtier, its own I/O
process), as ``python -m kvtier.demo.runner`` would be, without the import. A child
leads a process group of its own, so that processes it forks are found after it.

Protocol, one JSON object per line: the test writes ``{"id", "spec", "out", "log",
"cwd", "env"}`` on stdin; this process answers ``{"id", "pid"}`` once the child runs
and ``{"id", "status"}`` (as ``subprocess``'s returncode) once it has ended. It exits
when its stdin closes.
"""

import importlib
import json
import os
import select
import sys


def _report(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()  # before any fork: a child must not inherit unwritten answers


def _child(request: dict) -> None:
    """The run itself, in the forked child: its own group, output, directory and environment."""
    os.setpgid(0, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # never read the requests meant for this process
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from kvtier.demo import runner

    runner.main(request["spec"], request["out"])


def main() -> None:
    # What a run imports, imported once; the run's own work (the engine, kvtier's threads and
    # processes, the AMX permission) starts in each child.
    for module in ("vllm", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.config", "kvtier.demo.engine",
                   "kvtier.demo.runner", "kvtier.integrations.vllm", "kvtier.integrations.vllm.cpu_features"):
        importlib.import_module(module)

    _report({"ready": os.getpid()})
    running: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _report({"id": running.pop(pid), "status": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        data = os.read(0, 1 << 16)  # unbuffered: select must see every request not yet read
        if not data:
            return  # the test session has ended
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                # The child leaves this loop: it runs, then exits as a process that ran the runner
                # does (SystemExit unwinds to the interpreter, which runs atexit handlers and joins
                # threads).
                try:
                    _child(request)
                except BaseException as error:
                    if not isinstance(error, SystemExit):
                        import traceback
                        traceback.print_exc()
                        sys.stderr.flush()
                        sys.exit(1)
                    raise
                sys.exit(0)
            running[pid] = request["id"]
            _report({"id": request["id"], "pid": pid})

if __name__ == "__main__":
    main()
