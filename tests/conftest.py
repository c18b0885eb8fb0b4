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
