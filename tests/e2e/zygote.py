"""Engine runs forked from a process that has imported vLLM and kvtier once.

Importing vLLM takes about 6 s here, more than most runs' own work. This process
imports what ``kvtier.cli.demo.runner`` imports, runs nothing, and forks one child per
run: each child is a new process (its own engine, its own kvtier, its own I/O
process), as ``python -m kvtier.cli.demo.runner`` would be, without the import. A child
leads a process group of its own, so that processes it forks are found after it.

Protocol, one JSON object per line: the test writes ``{"id", "spec", "out", "log",
"cwd", "env", "finalize"}`` on stdin; this process answers on its stdout, which nothing else writes
to (what an import prints goes to stderr), ``{"id", "pid"}`` once the child runs and
``{"id", "status"}`` (as ``subprocess``'s returncode) once it has ended. Once its stdin
closes it takes no new run, and exits when its runs have ended.
"""

import importlib
import json
import os
import select
import sys


_ANSWERS = -1  # this process's own stdout, kept for the answers


def _report(message: dict) -> None:
    os.write(_ANSWERS, (json.dumps(message) + "\n").encode())  # unbuffered: a child inherits nothing unwritten


def _child(request: dict) -> None:
    """The run itself, in the forked child: its own group, output, directory and environment."""
    os.close(_ANSWERS)
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
    from kvtier.cli.demo import runner

    runner.main(request["spec"], request["out"])
    if not request.get("finalize"):
        _leave()


def _leave() -> None:
    """Exit as the interpreter does (its other threads joined, then its atexit handlers, where vLLM
    stops its engine and kvtier drains), without the module teardown after them: about 2.4 s of
    garbage collection over vLLM's modules per run here, with or without kvtier. A run that tests
    what happens at exit asks for the whole of it (``finalize``)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    global _ANSWERS
    _ANSWERS = os.dup(1)
    os.dup2(2, 1)  # what vLLM prints on import (to stdout, in some releases) must not mix with the answers
    # What a run imports, imported once; the run's own work (the engine, kvtier's threads and
    # processes, the AMX permission) starts in each child.
    for module in ("vllm", "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.config", "kvtier.cli.demo.engine",
                   "kvtier.cli.demo.runner", "kvtier.integrations.vllm", "kvtier.integrations.vllm.cpu_features"):
        importlib.import_module(module)

    _report({"ready": os.getpid()})
    running: dict[int, str] = {}
    pending = b""
    closing = False
    while True:
        readable, _, _ = select.select([] if closing else [0], [], [], 0.1)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _report({"id": running.pop(pid), "status": os.waitstatus_to_exitcode(status)})
        if closing:  # the test session has ended, or started another zygote: end once the runs have
            if not running:
                return
            continue
        if not readable:
            continue
        data = os.read(0, 1 << 16)  # unbuffered: select must see every request not yet read
        if not data:
            closing = True
            continue
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                # The child leaves this loop: it runs, then exits (``_leave``), or, with ``finalize``,
                # as a process that ran the runner does (SystemExit unwinds to the interpreter, which
                # joins threads, runs atexit handlers and tears its modules down).
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
