import os

import pytest

# Tests never read the developer's KVTIER_* settings.
for name in [n for n in os.environ if n.startswith("KVTIER_")]:
    del os.environ[name]


@pytest.fixture
def disk_dir(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    return str(path)


# ``make test`` runs the engine tests on two pytest-xdist workers. Each worker's engines compute on
# a core of their own: two engines whose OpenMP threads each spin on every core slow each other down.
# A run that names its own cores (tensor parallelism: "0|1") keeps them.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_worker.removeprefix("gw")) % len(_cores)])


# ``make test`` hands the engine tests to its two workers a file at a time, in collection order
# (``--no-loadscope-reorder``): the files that take longest go first, so that the last files to end, while
# the other worker may have nothing left, are short ones. The rest keep their order.
_LONGEST_FIRST = ("test_tiers_e2e.py", "test_vllm_e2e.py", "test_readme_commands.py", "test_pool_e2e.py",
                  "test_node_e2e.py", "test_bench_serve.py", "test_events_e2e.py", "test_bench.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file, as written


# kvtier's shared memory, by the names it gives its memory files.
_SHARED = ("/memfd:kvtier-host-pool", "/memfd:kvtier-node-pool")


def _mapped() -> set[str]:
    """kvtier's shared mappings in this process, each as its address range and name."""
    with open("/proc/self/maps") as maps:
        return {f"{line.split()[0]} {line.split()[-2]}" for line in maps if any(name in line for name in _SHARED)}


@pytest.fixture(autouse=True)
def nothing_mapped_after_the_test():
    """A test ends with every host pool and node arena it mapped unmapped, without the cyclic garbage
    collector: a worker, server or client that is closed and dropped gives its memory back."""
    before = _mapped()
    yield
    if left := sorted(_mapped() - before):
        pytest.fail(f"still mapped after the test: {left}", pytrace=False)
