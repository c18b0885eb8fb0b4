"""What kvtier says about vLLM's CPU reservation: in its start-up log and in ``kvtier doctor``."""

from kvtier.integrations.vllm.cpu_reservation import advice, reserved_by_vllm


def test_vllm_reserves_one_more_core_per_rank_with_a_connector_unless_told():
    assert reserved_by_vllm(1, connector=False, env={}) == (1, False)
    assert reserved_by_vllm(2, connector=True, env={}) == (4, False)
    assert reserved_by_vllm(2, connector=True, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}) == (3, True)


def test_default_layout_with_vllms_default_reservation_is_told_what_to_set():
    line = advice(1, 2, env={})
    assert "reserves 2 cores" in line and "1 more than without one" in line
    assert "computes on 2 CPUs" in line
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in line


def test_the_reservation_kvtier_advises_is_acknowledged():
    line = advice(2, 6, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"})
    assert "reserves 2 cores" in line and line.endswith("as kvtier advises")
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=" not in line.split(";")[-1]


def test_one_process_layout_has_nothing_to_set():
    line = advice(1, None, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert "one-process layout" in line and "nothing to set" in line and "unknown" in line
