import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._native import copy_runs
from kvtier.common.entry import checksum
from kvtier.common.layout import LayoutError, TensorInfo, coalesce, detect_layout
from kvtier.worker import tensor_info

NB, BS = 10, 4


def infos(tensors):
    return [tensor_info(t) for t in tensors]


@pytest.mark.parametrize("shape", [(NB, 4, BS, 2 * 16), (NB, 1, BS, 2 * 16), (NB, 2, BS, 3, 8)])
def test_vllm_cpu_and_flashinfer_layouts_are_one_run_per_block_per_layer(shape):
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_size]; FlashInfer: [num_blocks, 2, block_size, h, d]
    tensors = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
    layout = detect_layout(infos(tensors), NB, BS)
    assert layout.kind == "blocks_first" and len(layout.segments) == 3
    assert layout.slot_bytes == 3 * (torch.zeros(shape)[0].numel()) * 2


def test_flash_attention_layout_has_k_and_v_runs():
    tensors = [torch.zeros(2, NB, BS, 3, 8, dtype=torch.float16) for _ in range(2)]
    layout = detect_layout(infos(tensors), NB, BS)
    assert layout.kind == "kv_first" and len(layout.segments) == 4
    v_segment = layout.segments[1]
    assert v_segment.offset == NB * BS * 3 * 8 * 2


def test_mla_and_cross_layer_layouts():
    assert detect_layout(infos([torch.zeros(NB, BS, 7) for _ in range(2)]), NB, BS).kind == "mla"
    cross = detect_layout(infos([torch.zeros(NB, 5, 2, BS, 8)]), NB, BS, kind="cross_layer")
    assert cross.kind == "cross_layer" and cross.num_layers == 5 and len(cross.segments) == 1


def test_unknown_shape_is_named():
    with pytest.raises(LayoutError, match=r"\(3, 3\)"):
        detect_layout(infos([torch.zeros(3, 3)]), NB, BS)
    with pytest.raises(LayoutError, match="ambiguous"):
        detect_layout(infos([torch.zeros(2, 2, BS, 8)]), 2, BS)
    with pytest.raises(LayoutError, match="overlaps itself within a block"):
        detect_layout([TensorInfo((NB, 2, BS, 8), (1, 1, 1, 1), 2, 0)], NB, BS)
    with pytest.raises(LayoutError, match="differ in strides"):
        detect_layout([TensorInfo((NB, 2, BS, 8), (64, 32, 8, 1), 2, 0), TensorInfo((NB, 2, BS, 8), (64, 8, 16, 1), 2, 0)],
                      NB, BS)


def test_vllm_033_layouts_are_read_from_their_strides_and_key_entries_of_their_own():
    from test_tiering import VLLM_LAYOUTS, vllm_layer_views

    natural = detect_layout(infos(vllm_layer_views("BLHNC", 3, 2, 6, NB)), NB, BS)
    described = {}
    for name in VLLM_LAYOUTS:
        layout = detect_layout(infos(vllm_layer_views(name, 3, 2, 6, NB)), NB, BS)
        assert layout.kind == "blocks_first" and layout.slot_bytes == natural.slot_bytes
        # Heads outside blocks: a run per head and layer; else one per layer.
        assert len(layout.segments) == (6 if name in ("LHBNC", "BHLNC") else 3)
        described[name] = layout.describe()
    # A slot holds a block's runs in memory order: heads inside tokens is another byte order, whose
    # entries are its own; heads outside blocks leave a block's bytes in the natural order.
    assert described["LBNHC"] == described["BLNHC"] != natural.describe()
    assert described["LHBNC"] == described["BHLNC"] == described["BLHNC"] == natural.describe()



def test_adjacent_runs_are_coalesced():
    dst = np.array([0, 10, 20, 100], dtype=np.int64)
    src = np.array([50, 60, 70, 80], dtype=np.int64)
    lengths = np.array([10, 10, 10, 10], dtype=np.int64)
    d, s, n = coalesce(dst, src, lengths)
    assert d.tolist() == [0, 100] and s.tolist() == [50, 80] and n.tolist() == [30, 10]


def test_cross_layer_consecutive_blocks_move_in_one_run():
    tensor = torch.zeros(NB, 5, 2, BS, 8)
    layout = detect_layout(infos([tensor]), NB, BS, kind="cross_layer")
    dst, src, lengths = layout.copy_runs([tensor.data_ptr()], 1 << 20, np.array([2, 3, 4]), np.array([0, 1, 2]), True)
    assert len(lengths) == 1 and lengths[0] == 3 * layout.slot_bytes


@settings(max_examples=100, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["blocks_first", "kv_first", "mla", "cross_layer"]), to_host=st.booleans())
def test_native_block_copy_moves_the_bytes_of_the_planned_runs(data, kind, to_host):
    """copy_blocks (addresses computed in C, runs merged on the fly) moves exactly the
    bytes that the run list of copy_runs describes, for any ids and layer subset."""
    shapes = {"blocks_first": [(NB, 2, BS, 2 * 8)] * 3, "kv_first": [(2, NB, BS, 2, 8)] * 2,
              "mla": [(NB, BS, 24)] * 2, "cross_layer": [(NB, 3, 2, BS, 8)]}[kind]
    tensors = [torch.randint(-2**15, 2**15, shape, dtype=torch.int16) for shape in shapes]
    layout = detect_layout(infos(tensors), NB, BS, "cross_layer" if kind == "cross_layer" else None)
    num_slots = 3 * NB
    count = data.draw(st.integers(0, NB))
    block_ids = np.array(data.draw(st.permutations(range(NB)))[:count], dtype=np.int64)
    consecutive = data.draw(st.booleans())  # adjacent slots let runs merge
    slot_ids = np.arange(count) if consecutive else np.array(data.draw(st.permutations(range(num_slots)))[:count])
    slot_ids = slot_ids.astype(np.int64)
    subset = data.draw(st.sampled_from([None] + [(i,) for i in range(len(tensors))]))
    host = [torch.randint(0, 256, (num_slots * layout.slot_bytes,), dtype=torch.uint8) for _ in range(2)]
    devices = [[t.clone() for t in tensors] for _ in range(2)]
    addresses = [[t.data_ptr() for t in device] for device in devices]
    host[1].copy_(host[0])
    dst, src, lengths = layout.copy_runs(addresses[0], host[0].data_ptr(), block_ids, slot_ids, to_host, subset)
    copy_runs.copy(dst, src, lengths)
    copied = copy_runs.copy_blocks(layout.segment_table(addresses[1], subset), block_ids, slot_ids,
                                   host[1].data_ptr(), layout.slot_bytes, NB, num_slots, to_host)
    assert copied == int(lengths.sum())
    assert torch.equal(host[0], host[1])
    assert all(torch.equal(a, b) for a, b in zip(devices[0], devices[1]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), head=st.sampled_from([0, 8, 64, 4096]), to_host=st.booleans())
def test_native_block_copy_with_heads_between_slots_moves_the_same_bytes_and_leaves_the_heads(data, head, to_host):
    """With ``slot_pitch`` (each slot after a head, as a CPU worker's host pool), every slot gets or
    gives exactly the bytes of back-to-back slots, and no copy touches a head."""
    tensors = [torch.randint(-2**15, 2**15, (NB, 2, BS, 2 * 8), dtype=torch.int16) for _ in range(2)]
    layout = detect_layout(infos(tensors), NB, BS)
    num_slots, pitch = 2 * NB, head + layout.slot_bytes
    count = data.draw(st.integers(0, NB))
    block_ids = np.array(data.draw(st.permutations(range(NB)))[:count], dtype=np.int64)
    consecutive = data.draw(st.booleans())
    slot_ids = (np.arange(count) if consecutive else
                np.array(data.draw(st.permutations(range(num_slots)))[:count])).astype(np.int64)
    flat = torch.randint(0, 256, (num_slots, layout.slot_bytes), dtype=torch.uint8)
    headed = torch.randint(0, 256, (num_slots, pitch), dtype=torch.uint8)
    headed[:, head:] = flat
    heads_before = headed[:, :head].clone()
    devices = [[t.clone() for t in tensors] for _ in range(2)]
    for device, host, step, start in ((devices[0], flat, layout.slot_bytes, 0), (devices[1], headed, pitch, head)):
        copied = copy_runs.copy_blocks(layout.segment_table([t.data_ptr() for t in device]), block_ids, slot_ids,
                                       host.data_ptr() + start, layout.slot_bytes, NB, num_slots, to_host, step)
        assert copied == count * layout.slot_bytes
    assert torch.equal(headed[:, head:], flat) and torch.equal(headed[:, :head], heads_before)
    assert all(torch.equal(a, b) for a, b in zip(devices[0], devices[1]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["blocks_first", "kv_first", "mla", "cross_layer"]),
       head=st.sampled_from([0, 64]), threads=st.integers(1, 3))
def test_a_copy_to_the_host_takes_each_slots_xxh3_as_it_writes_it(data, kind, head, threads):
    """With ``sums``, each slot's xxh3-64 comes out of the copy that wrote it (the checksum every
    tier's entry header carries), and the slots hold the same bytes as a copy without sums.
    Split over threads as ``CpuCopier`` splits a job, each part fills its own sums."""
    shapes = {"blocks_first": [(NB, 2, BS, 2 * 8)] * 3, "kv_first": [(2, NB, BS, 2, 8)] * 2,
              "mla": [(NB, BS, 24)] * 2, "cross_layer": [(NB, 3, 2, BS, 8)]}[kind]
    tensors = [torch.randint(-2**15, 2**15, shape, dtype=torch.int16) for shape in shapes]
    layout = detect_layout(infos(tensors), NB, BS, "cross_layer" if kind == "cross_layer" else None)
    num_slots, pitch = 2 * NB, head + layout.slot_bytes
    count = data.draw(st.integers(0, NB))
    block_ids = np.array(data.draw(st.permutations(range(NB)))[:count], dtype=np.int64)
    slot_ids = np.array(data.draw(st.permutations(range(num_slots)))[:count], dtype=np.int64)
    table = layout.segment_table([t.data_ptr() for t in tensors])
    plain, summed = (torch.randint(0, 256, (num_slots, pitch), dtype=torch.uint8) for _ in range(2))
    summed.copy_(plain)
    sums = np.full(count, 7, np.uint64)
    copy_runs.copy_blocks(table, block_ids, slot_ids, plain.data_ptr() + head, layout.slot_bytes, NB, num_slots,
                          True, pitch)
    for part in np.array_split(np.arange(count), threads):
        part = slice(part[0], part[-1] + 1) if part.size else slice(0, 0)
        copied = copy_runs.copy_blocks(table, block_ids[part], slot_ids[part], summed.data_ptr() + head,
                                       layout.slot_bytes, NB, num_slots, True, pitch, sums[part])
        assert copied == len(block_ids[part]) * layout.slot_bytes
    assert torch.equal(plain, summed)
    assert sums.tolist() == [checksum(summed[s, head:].numpy()) for s in slot_ids]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["blocks_first", "kv_first", "mla", "cross_layer"]),
       head=st.sampled_from([0, 64]), threads=st.integers(1, 3))
def test_a_copy_from_the_host_takes_each_slots_xxh3_as_it_reads_it(data, kind, head, threads):
    """A load with ``sums`` leaves each slot's xxh3-64 as it read it (what the load compares with
    its entry's checksum), and writes the device the same bytes as a load without sums."""
    shapes = {"blocks_first": [(NB, 2, BS, 2 * 8)] * 3, "kv_first": [(2, NB, BS, 2, 8)] * 2,
              "mla": [(NB, BS, 24)] * 2, "cross_layer": [(NB, 3, 2, BS, 8)]}[kind]
    devices = [[torch.randint(-2**15, 2**15, shape, dtype=torch.int16) for shape in shapes]]
    devices.append([t.clone() for t in devices[0]])
    layout = detect_layout(infos(devices[0]), NB, BS, "cross_layer" if kind == "cross_layer" else None)
    num_slots, pitch = 2 * NB, head + layout.slot_bytes
    count = data.draw(st.integers(0, NB))
    block_ids = np.array(data.draw(st.permutations(range(NB)))[:count], dtype=np.int64)
    slot_ids = np.array(data.draw(st.permutations(range(num_slots)))[:count], dtype=np.int64)
    host = torch.randint(0, 256, (num_slots, pitch), dtype=torch.uint8)
    before = host.clone()
    sums = np.full(count, 7, np.uint64)
    copy_runs.copy_blocks(layout.segment_table([t.data_ptr() for t in devices[0]]), block_ids, slot_ids,
                          host.data_ptr() + head, layout.slot_bytes, NB, num_slots, False, pitch)
    table = layout.segment_table([t.data_ptr() for t in devices[1]])
    for part in np.array_split(np.arange(count), threads):
        part = slice(part[0], part[-1] + 1) if part.size else slice(0, 0)
        copied = copy_runs.copy_blocks(table, block_ids[part], slot_ids[part], host.data_ptr() + head,
                                       layout.slot_bytes, NB, num_slots, False, pitch, sums[part])
        assert copied == len(block_ids[part]) * layout.slot_bytes
    assert all(torch.equal(a, b) for a, b in zip(*devices)) and torch.equal(host, before)
    assert sums.tolist() == [checksum(host[s, head:].numpy()) for s in slot_ids]


def test_sums_are_taken_only_of_whole_slots():
    """A checksum covers a whole slot: no sums for one layer's segments (either way), or into a buffer
    that is not one 64-bit item per block. Nothing is copied then."""
    tensors = [torch.ones(NB, 2, BS, 8, dtype=torch.int16) for _ in range(2)]
    layout = detect_layout(infos(tensors), NB, BS)
    host = torch.zeros(4 * layout.slot_bytes, dtype=torch.uint8)
    addresses = [t.data_ptr() for t in tensors]
    ids = np.array([0, 1], np.int64)
    for table, to_host, sums, why in [
            (layout.segment_table(addresses, (1,)), True, np.zeros(2, np.uint64), "tile the slot"),
            (layout.segment_table(addresses, (1,)), False, np.zeros(2, np.uint64), "tile the slot"),
            (layout.segment_table(addresses), True, np.zeros(3, np.uint64), "one item per block"),
            (layout.segment_table(addresses), False, np.zeros(3, np.uint64), "one item per block"),
            (layout.segment_table(addresses), True, np.zeros(2, np.int32), "64-bit")]:
        with pytest.raises(ValueError, match=why):
            copy_runs.copy_blocks(table, ids, ids, host.data_ptr(), layout.slot_bytes, NB, 4, to_host,
                                  layout.slot_bytes, sums)
        assert not host.any() and all(bool((t == 1).all()) for t in tensors)


def test_native_block_copy_refuses_a_pitch_shorter_than_a_slot():
    tensors = [torch.ones(NB, 2, BS, 8, dtype=torch.int16)]
    layout = detect_layout(infos(tensors), NB, BS)
    host = torch.zeros(4 * layout.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot_pitch >= slot_bytes"):
        copy_runs.copy_blocks(layout.segment_table([tensors[0].data_ptr()]), np.array([0], np.int64),
                              np.array([1], np.int64), host.data_ptr(), layout.slot_bytes, NB, 4, True,
                              layout.slot_bytes - 1)
    assert not host.any()


def test_native_block_copy_checks_every_id_before_moving_a_byte():
    tensors = [torch.ones(NB, 2, BS, 8, dtype=torch.int16)]
    layout = detect_layout(infos(tensors), NB, BS)
    host = torch.zeros(4 * layout.slot_bytes, dtype=torch.uint8)
    table = layout.segment_table([tensors[0].data_ptr()])
    for block_ids, slot_ids in [([0, NB], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, 4]), ([0, 1], [-1, 0])]:
        with pytest.raises(ValueError, match="out of range"):
            copy_runs.copy_blocks(table, np.array(block_ids, np.int64), np.array(slot_ids, np.int64),
                                  host.data_ptr(), layout.slot_bytes, NB, 4, True)
        assert not host.any()  # the valid first id was not copied either


def _layouts():
    from test_tiering import layouts
    return layouts()


@pytest.mark.parametrize("name, tensors", _layouts())
def test_the_cuda_copiers_views_hold_the_bytes_the_cpu_copier_moves(name, tensors):
    # The CUDA copier moves a block through one strided view per segment: on CPU tensors of every
    # layout (vLLM 0.33+'s views of one allocation among them), each view's row of a block is that
    # block's run, as the CPU copier's runs read it.
    from test_tiering import BS as TBS
    from test_tiering import NB as TNB
    from test_tiering import randomize

    from kvtier.transfer.cuda import segment_views
    randomize(tensors)
    layout = detect_layout(infos(tensors), TNB, TBS, "cross_layer" if name == "cross_layer" else None)
    views = segment_views(layout, tensors)
    for block in (0, 3, TNB - 1):
        host = np.zeros(layout.slot_bytes, np.uint8)
        dst, src, lengths = layout.copy_runs([t.data_ptr() for t in tensors], host.ctypes.data, np.array([block]),
                                             np.array([0]), True)
        copy_runs.copy(dst, src, lengths)
        assert torch.cat([view[block] for view in views]).numpy().tobytes() == host.tobytes()
