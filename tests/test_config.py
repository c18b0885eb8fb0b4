import pytest

from kvtier.common.config import ConfigError, KVTierConfig, parse_bytes


def test_defaults_need_no_input():
    config = KVTierConfig.from_sources({}, environ={})
    assert config.host_bytes == 1 << 30
    assert config.disk_bytes == 16 << 30
    assert config.load_failure_policy == "recompute"


def test_sizes_accept_integers_and_units():
    assert parse_bytes(4096) == 4096
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1.5KiB") == 1536


def test_later_sources_win(tmp_path):
    yaml_file = tmp_path / "kvtier.yaml"
    yaml_file.write_text("host_bytes: 1MiB\ndisk_bytes: 2MiB\nblock_size: 16\n")
    config = KVTierConfig.from_sources(
        {"config_file": str(yaml_file), "disk_bytes": "3MiB"},
        environ={"KVTIER_BLOCK_SIZE": "64", "KVTIER_DISK_BYTES": "9MiB"})
    assert config.host_bytes == 1 << 20  # from YAML
    assert config.block_size == 64  # env over YAML
    assert config.disk_bytes == 3 << 20  # the engine's dict over env


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'host_byte'.*did you mean 'host_bytes'"):
        KVTierConfig.from_sources({"host_byte": 1}, environ={})


def test_unknown_environment_variable_is_named():
    with pytest.raises(ConfigError, match="unknown key 'hostbytes' in environment"):
        KVTierConfig.from_sources({}, environ={"KVTIER_HOSTBYTES": "1"})


@pytest.mark.parametrize("key, value, allowed", [
    ("host_bytes", -5, "byte count > 0"),
    ("host_bytes", "lots", "byte count > 0"),
    ("disk_io_threads", 0, "from 1 to 64"),
    ("store_partial_block", "maybe", "true or false"),
    ("load_failure_policy", "ignore", "'recompute' or 'fail'"),
    ("config_file", "/no/such/file.yaml", "existing YAML file"),
    ("remote_answer_s", 0, "seconds in (0, 3600]"),
])
def test_bad_values_name_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as error:
        KVTierConfig.from_sources({key: value}, environ={})
    message = str(error.value)
    assert f"'{key}'" in message and repr(value) in message and allowed in message


def test_yaml_with_unknown_key_is_rejected(tmp_path):
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("host_bytes: 1MiB\nnope: 1\n")
    with pytest.raises(ConfigError, match=f"unknown key 'nope' in {yaml_file}"):
        KVTierConfig.from_sources({}, environ={"KVTIER_CONFIG": str(yaml_file)})


def test_null_disk_dir_disables_disk():
    assert KVTierConfig.from_sources({"disk_dir": None}, environ={}).disk_dir is None


def test_the_shared_tiers_answer_stands_as_long_as_configured(tmp_path):
    from kvtier.tiers.registry import make_index, tier_specs

    config = KVTierConfig.from_sources({"disk_dir": None, "remote_url": f"file://{tmp_path}",
                                       "remote_answer_s": 7.5}, environ={})
    index = make_index(tier_specs(config)[0], 4096, [bytes(8)])
    try:
        assert index.answer_s == 7.5
    finally:
        index.close()
