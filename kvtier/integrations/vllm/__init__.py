"""kvtier as a vLLM KV connector.

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_bytes": "8GiB"}}'
"""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
