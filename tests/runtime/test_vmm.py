"""distmoe.runtime.vmm.TieredRange: one virtual range, pieces in the device or host tier.

CPU: the layout (pieces in order, each rounded to the granularity: 1 on a CPU), the bytes per
tier and the argument checks. GPU: the driver maps device and pinned-host pieces into one
range, a kernel writes and reads every byte through it (bit-exact), the driver reports each
piece's tier, and closing returns the device memory."""

import pytest
import torch

from distmoe.runtime.vmm import TieredRange, vmm_granularity

MiB = 1 << 20


def test_layout_and_tiers_on_cpu():
    r = TieredRange([(3000, "device"), (5000, "host"), (700, "device")], "cpu")
    assert [(p.offset, p.num_bytes, p.tier) for p in r.pieces] == [
        (0, 3000, "device"), (3000, 5000, "host"), (8000, 700, "device")]
    assert r.tier_bytes == {"device": 3700, "host": 5000} and r.tensor.numel() == 8700
    assert [r.location_of(o) for o in (0, 2999, 3000, 7999, 8000, 8699)] == [
        "device", "device", "host", "host", "device", "device"]
    with pytest.raises(ValueError, match="offset"):
        r.location_of(8700)
    r.close()
    r.close()  # idempotent
    for bad, match in (([(10, "disk")], "tier"), ([(0, "host")], "positive"),
                       ([(1.5, "host")], "positive")):
        with pytest.raises(ValueError, match=match):
            TieredRange(bad, "cpu")


def _free(dev):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks torch caches are not the range's memory
    return torch.cuda.mem_get_info(dev)[0]


def _exercise(dev, gran):
    """Map a device-host-device range, write and read every byte through it, close it; returns
    the free device memory while it was mapped."""
    r = TieredRange([(4 * MiB, "device"), (6 * MiB + 1, "host"), (2 * MiB, "device")], dev)
    free_mapped = _free(dev)
    sizes = [p.num_bytes for p in r.pieces]
    assert all(s % gran == 0 for s in sizes) and sizes[1] >= 6 * MiB + 1
    assert r.tier_bytes == {"device": sizes[0] + sizes[2], "host": sizes[1]}
    for p in r.pieces:  # the driver's own record of each piece's location
        assert r.location_of(p.offset) == p.tier and r.location_of(
            p.offset + p.num_bytes - 1) == p.tier
    t = r.tensor
    assert t.device == dev and t.numel() == sum(sizes) and t.data_ptr() % gran == 0
    g = torch.Generator(device=dev).manual_seed(3)
    want = torch.randint(0, 256, (t.numel(),), generator=g, device=dev, dtype=torch.int32)
    t.fill_(0xA5)  # poison, then a kernel writes every byte across the tiers
    t.copy_(want.to(torch.uint8))
    assert torch.equal(t.to(torch.int32), want)
    words = t.view(torch.int32)  # a kernel reading across a tier boundary
    assert int(words.sum()) == int(want.to(torch.uint8).view(torch.int32).sum())
    torch.cuda.synchronize()
    del t, words
    r.close()
    return free_mapped, r.tier_bytes["device"]


@pytest.mark.gpu
def test_device_and_host_pieces_in_one_range():
    pytest.importorskip("cuda.bindings")
    dev = torch.device("cuda", torch.cuda.current_device())
    gran = vmm_granularity(dev)
    assert gran >= 4096 and gran & (gran - 1) == 0
    _exercise(dev, gran)  # first: loads the kernels' modules (device memory of their own)
    free_before = _free(dev)
    free_mapped, device_bytes = _exercise(dev, gran)
    # the device pieces take device memory while mapped, and closing gives it back
    assert free_mapped <= free_before - device_bytes
    assert _free(dev) >= free_before - 2 * gran
