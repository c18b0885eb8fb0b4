"""A pool client that fails under load: four threads put and get 8 MiB batches through one
``GuardedClient`` whose every call counts as too slow (``timeout_s=0``), so each call retires
the client while the other threads are still inside theirs, and the next one reconnects.

``python -m tests.e2e.pool_churn <mooncake url> <seconds>``: exits 0 and prints what it did,
or dies as the process would (a client closed under a batch call crashes Mooncake)."""

import json
import sys
import threading
import time

import numpy as np

from kvtier.tiers.mooncake import MooncakeClient
from kvtier.tiers.pool import GuardedClient


def main(url: str, seconds: float) -> None:
    guarded = GuardedClient(url, lambda: MooncakeClient(url, 5.0), timeout_s=0.0, retry_s=0.001)
    per_thread, size = 8, 1 << 20
    headers = np.zeros((4 * per_thread, 64), np.uint8)
    payloads = np.random.default_rng(0).integers(0, 255, (4 * per_thread, size), np.uint8)
    guarded.register(headers.ctypes.data, headers.nbytes)
    guarded.register(payloads.ctypes.data, payloads.nbytes)
    calls = [0] * 4

    def work(thread: int) -> None:
        rows = range(thread * per_thread, (thread + 1) * per_thread)
        names = [f"churn/{thread}/{row}" for row in rows]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for method in ("put", "get_into"):
                guarded.call(method, names, [memoryview(headers[r]) for r in rows],
                             [memoryview(payloads[r]) for r in rows])
                calls[thread] += 1

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    in_flight = guarded.calls_in_flight
    guarded.close()
    print(json.dumps({"calls": sum(calls), "failures": guarded.num_failures, "in_flight": in_flight}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
