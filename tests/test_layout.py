import pytest
import torch

import kvmulti
from kvmulti import reference


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("num_blocks,block_size,num_kv_heads", [(1, 4, 2), (2, 2, 2), (2, 16, 1), (3, 1, 4)])
def test_views_are_zero_copy(order, num_blocks, block_size, num_kv_heads):
    layout = kvmulti.KVCacheLayout(num_blocks, block_size, num_kv_heads, head_size=8, head_size_v=6,
                                   dtype=torch.float32, order=order)
    cache = layout.allocate()
    assert cache.shape == (num_blocks, block_size, num_kv_heads, 14)
    k, v = layout.keys(cache), layout.values(cache)
    assert k.shape == (num_blocks, block_size, num_kv_heads, 8) and v.shape == (num_blocks, block_size, num_kv_heads, 6)
    assert k.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert v.data_ptr() == cache.data_ptr() + 8 * cache.element_size()
    s = layout.strides(cache)
    # The named strides locate every element: write through a view, find it at the computed offset.
    flat = cache.as_strided((cache.numel(),), (1,))
    for blk in range(num_blocks):
        for tok in range(block_size):
            for h in range(num_kv_heads):
                v[blk, tok, h, 3] = 1000 * blk + 100 * tok + 10 * h + 7
                assert flat[blk * s.block + tok * s.token + h * s.head + (8 + 3) * s.dim] == 1000 * blk + 100 * tok + 10 * h + 7


def test_hnd_memory_order_is_block_head_token():
    layout = kvmulti.KVCacheLayout(2, 4, 3, head_size=2, dtype=torch.float32, order="HND")
    cache = layout.allocate()
    s = layout.strides(cache)
    assert s == (4 * 3 * 4, 4, 4 * 4, 1)
    nhd = kvmulti.KVCacheLayout(2, 4, 3, head_size=2, dtype=torch.float32, order="NHD").strides(
        kvmulti.KVCacheLayout(2, 4, 3, head_size=2, dtype=torch.float32, order="NHD").allocate())
    assert nhd == (4 * 3 * 4, 3 * 4, 4, 1)


def test_block_size_equal_heads_other_order_rejected():
    hnd = kvmulti.KVCacheLayout(2, 2, 2, head_size=4, dtype=torch.float16, order="HND")
    nhd = kvmulti.KVCacheLayout(2, 2, 2, head_size=4, dtype=torch.float16, order="NHD")
    with pytest.raises(ValueError, match="strides"):
        hnd.validate(nhd.allocate())
    with pytest.raises(ValueError, match="strides"):
        nhd.validate(hnd.allocate())


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_then_read_back(order):
    layout = kvmulti.KVCacheLayout(2, 4, 2, head_size=8, dtype=torch.float32, order=order)
    cache = layout.allocate()
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 7, -1, 4, 3])
    kvmulti.write_kv(key, value, cache, layout, slots)
    k, v = layout.keys(cache), layout.values(cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k[slot // 4, slot % 4], key[t]) and torch.equal(v[slot // 4, slot % 4], value[t])
    written = {0, 7, 4, 3}
    for slot in set(range(8)) - written:
        assert not k[slot // 4, slot % 4].any() and not v[slot // 4, slot % 4].any()


def test_all_padding_slots_write_nothing():
    layout = kvmulti.KVCacheLayout(1, 4, 1, head_size=4, dtype=torch.float32)
    cache = layout.allocate()
    kvmulti.write_kv(torch.ones(3, 1, 4), torch.ones(3, 1, 4), cache, layout, torch.full((3,), -1))
    assert not cache.any()


def test_latent_cache():
    layout = kvmulti.KVCacheLayout(2, 4, 1, head_size=16, head_size_v=0, dtype=torch.float32)
    cache = layout.allocate()
    assert cache.shape == (2, 4, 1, 16) and layout.page_size_bytes == 4 * 16 * 4
    with pytest.raises(ValueError, match="latent"):
        layout.values(cache)
    key = torch.randn(2, 1, 16)
    kvmulti.write_kv(key, None, cache, layout, torch.tensor([1, 6]))
    assert torch.equal(layout.keys(cache)[1, 2], key[1])


def test_page_size_and_bad_fields():
    layout = kvmulti.KVCacheLayout(4, 16, 2, head_size=64, head_size_v=32, dtype=torch.bfloat16)
    assert layout.page_size_bytes == 16 * 2 * 96 * 2
    with pytest.raises(ValueError, match="order"):
        kvmulti.KVCacheLayout(4, 16, 2, head_size=64, order="HDN")
    with pytest.raises(ValueError, match="block_size"):
        kvmulti.KVCacheLayout(4, 0, 2, head_size=64)
    with pytest.raises(TypeError, match="dtype"):
        kvmulti.KVCacheLayout(4, 16, 2, head_size=64, dtype=torch.int8)


def test_metadata_from_lens():
    table = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([3, 1], [6, 2], table, block_size=4)
    assert md.query_start_loc.tolist() == [0, 3, 4] and md.seq_lens.tolist() == [6, 2]
    # request 0: positions 3,4,5 -> block 3 off 3, block 1 off 0, block 1 off 1; request 1: position 1
    assert md.slot_mapping.tolist() == [15, 4, 5, 9]
    assert md.slot_mapping.dtype == torch.int64 and md.block_table.dtype == torch.int32
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (2, 4, 3, 6)
    with pytest.raises(ValueError, match="query_len 3 exceeds seq_len 2"):
        kvmulti.CommonAttentionMetadata.from_lens([3], [2], table[:1], block_size=4)
    with pytest.raises(ValueError, match="columns"):
        kvmulti.CommonAttentionMetadata.from_lens([1], [13], table[:1], block_size=4)
    with pytest.raises(TypeError, match="block_table"):
        kvmulti.CommonAttentionMetadata.from_lens([1], [2], table[:1].float(), block_size=4)


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds ``address`` (Linux /proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cpu_cache_in_huge_pages(order):
    from kvmulti import host_memory
    layout = kvmulti.KVCacheLayout(num_blocks=300, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                   order=order)                                  # 2.3 MiB
    cache = layout.allocate()
    layout.validate(cache)
    assert torch.count_nonzero(cache) == 0
    plain = layout.allocate(huge_pages=False)
    layout.validate(plain)
    if not host_memory.huge_pages_usable():
        with pytest.raises(RuntimeError, match="transparent huge pages"):
            layout.allocate(huge_pages=True)
        return
    assert cache.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(cache.data_ptr())                   # advised MADV_HUGEPAGE
    assert "hg" not in _vm_flags(plain.data_ptr())
    # Same contents and behaviour as an ordinary tensor: write through the layout, read back.
    keys = torch.randn(5, 2, 64).to(torch.bfloat16)
    slots = torch.tensor([0, 17, -1, 4000, 4799])
    for c in (cache, plain):
        kvmulti.write_kv(keys, keys, c, layout, slots)
    assert torch.equal(cache, plain)


def test_huge_pages_small_or_custom_allocations():
    layout = kvmulti.KVCacheLayout(num_blocks=4, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert torch.count_nonzero(layout.allocate()) == 0                        # under 2 MiB: an ordinary tensor
    with pytest.raises(RuntimeError, match="huge_pages=True"):
        layout.allocate(huge_pages=True)
    with pytest.raises(ValueError, match="custom allocator"):
        layout.allocate(allocator=lambda n, dt, dev: torch.empty(n, dtype=dt), huge_pages=True)


def test_thp_mode_unavailable(monkeypatch, tmp_path):
    from kvmulti import host_memory
    monkeypatch.setattr(host_memory, "_THP_MODE", tmp_path / "missing")
    assert host_memory.transparent_huge_pages() == "unavailable"
    assert host_memory.huge_page_empty(1 << 22, torch.float32) is None
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "_THP_MODE", mode)
    assert host_memory.transparent_huge_pages() == "never"
    layout = kvmulti.KVCacheLayout(num_blocks=512, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert torch.count_nonzero(layout.allocate()) == 0                        # falls back to an ordinary tensor


def test_madvise_refused_falls_back(monkeypatch):
    import mmap as mmap_module
    from kvmulti import host_memory
    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: "madvise")   # reach madvise on any host

    class Refusing(mmap_module.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(host_memory.mmap, "mmap", Refusing)
    assert host_memory.huge_page_empty(1 << 22, torch.float32) is None
    layout = kvmulti.KVCacheLayout(num_blocks=512, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert torch.count_nonzero(layout.allocate()) == 0
