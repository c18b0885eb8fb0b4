import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.common.keys import KEY_BYTES, Namespace, block_keys

NS = Namespace(model="m", kv_dtype="bfloat16", layout="kv", geometry=(2, 64), num_layers=4, block_size=4)
FP = NS.fingerprint()


def test_one_key_per_full_block_and_optionally_the_partial_one():
    tokens = list(range(10))
    assert len(block_keys(FP, tokens, 4)) == 2
    keys = block_keys(FP, tokens, 4, include_partial=True)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert len(block_keys(FP, list(range(8)), 4, include_partial=True)) == 2  # no partial block


def test_keys_chain_over_the_prefix():
    a = block_keys(FP, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys(FP, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent


def test_partial_block_never_equals_a_full_block():
    full = block_keys(FP, [1, 2, 3, 4], 4)
    partial = block_keys(FP, [1, 2, 3], 4, include_partial=True)
    assert full[0] != partial[0]
    # A partial block of length n and a full block of the same tokens with a smaller block size differ too.
    assert block_keys(FP, [1, 2, 3], 3)[0] != partial[0]


def test_namespace_and_extra_keys_separate_caches():
    tokens = list(range(8))
    other = Namespace(model="m", kv_dtype="float16", layout="kv", geometry=(2, 64), num_layers=4, block_size=4)
    assert block_keys(FP, tokens, 4) != block_keys(other.fingerprint(), tokens, 4)
    assert block_keys(FP, tokens, 4) != block_keys(FP, tokens, 4, extra_keys=("lora:a",))
    assert NS.for_rank(0).fingerprint() != NS.for_rank(1).fingerprint() != FP


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 16))
def test_continuing_a_chain_equals_keying_all_at_once(tokens, block_size):
    whole = block_keys(FP, tokens, block_size)
    half = len(whole) // 2
    first = block_keys(FP, tokens[: half * block_size], block_size)
    rest = block_keys(FP, tokens, block_size, start_block=half, parent=first[-1] if first else None)
    assert first + rest == whole


def test_same_keys_in_another_process_whatever_the_hash_seed():
    code = ("from kvtier.common.keys import Namespace, block_keys;"
            "ns = Namespace('m', 'bfloat16', 'kv', (2, 64), 4, 4);"
            "print(b''.join(block_keys(ns.fingerprint(), list(range(50)), 4, ('salt',), True)).hex())")
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("0", "1", "12345")}
    assert len(outputs) == 1
    local = b"".join(block_keys(NS.fingerprint(), list(range(50)), 4, ("salt",), True)).hex()
    assert outputs == {local + "\n"}


def test_bad_tokens_are_rejected():
    with pytest.raises(ValueError):
        block_keys(FP, [-1], 4)


def test_a_models_fingerprint_follows_its_content_not_its_name_or_dates(tmp_path):
    import os
    import shutil

    from kvtier.common.model_identity import SAMPLE_BYTES, directory_fingerprint, model_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    weights = bytearray(os.urandom(40 * SAMPLE_BYTES))  # big enough to be sampled
    (model / "model.safetensors").write_bytes(weights)
    first = directory_fingerprint(model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    assert directory_fingerprint(copy) == first  # same content elsewhere, other dates
    weights[3] ^= 1  # a fine-tune changes the first bytes, among others
    (copy / "model.safetensors").write_bytes(weights)
    assert directory_fingerprint(copy) != first
    shutil.copytree(model, tmp_path / "again")
    (tmp_path / "again" / "config.json").write_text('{"hidden_size": 65}')
    assert directory_fingerprint(tmp_path / "again") != first
    assert model_fingerprint(str(model), None, {"quantization": None}) != model_fingerprint(
        str(model), None, {"quantization": "fp8"})
    assert model_fingerprint("org/m", "v1") != model_fingerprint("org/m", "v2")


def test_a_lora_adapter_reloaded_under_its_name_gets_new_keys(tmp_path):
    import os
    from types import SimpleNamespace

    from kvtier.integrations.vllm.namespace import adapter_fingerprint

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    request = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(adapter))
    first = adapter_fingerprint(request)
    assert adapter_fingerprint(request) == first
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    assert adapter_fingerprint(request) != first
