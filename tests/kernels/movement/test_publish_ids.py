"""publish_ids: the token count and the int16 ids of a forward in one launch; ids outside
[-1, E) become -2 (never wrapped into valid ones), every integer dtype, T = 0 writes T only.
Compared bit for bit with the rule computed in torch; the buffer past T*K keeps its poison."""

import pytest
import torch

from distmoe.kernels.movement.publish_ids import publish_ids

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
E = 7


def _ids(dtype, T, K, gen):
    if dtype == torch.uint8:
        vals = torch.randint(0, 256, (T, K), generator=gen)
    elif dtype == torch.int8:
        vals = torch.randint(-128, 128, (T, K), generator=gen)
    else:
        info = torch.iinfo(dtype)
        wide = torch.tensor([65537, -65535, 2**31 - 1, -(2**31), 32767, -32768, 65535, E, -2])
        vals = torch.randint(-3, E + 3, (T, K), generator=gen)
        pick = torch.rand(T, K, generator=gen) < 0.3
        extra = wide[torch.randint(0, len(wide), (T, K), generator=gen)]
        extra = extra.clamp(max(info.min, -(2**31)), min(info.max, 2**31 - 1))
        vals = torch.where(pick, extra, vals)
    return vals.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64])
@pytest.mark.parametrize("T", [0, 1, 37, 300])
def test_publish_ids(dtype, T):
    K, T_max = 3, 320
    gen = torch.Generator().manual_seed(T * 10 + dtype.itemsize)
    ids = _ids(dtype, T, K, gen)
    out = torch.full((T_max, K), 12345, dtype=torch.int16, device=DEVICE)
    header = torch.full((32,), -7, dtype=torch.int32, device=DEVICE)
    publish_ids(ids, out, header, num_experts=E)
    wide = ids.to(torch.int64).cpu()
    want = torch.where((wide < -1) | (wide >= E), -2, wide).to(torch.int16)
    assert torch.equal(out[:T].cpu(), want)
    assert (out[T:] == 12345).all()  # past T*K: untouched
    assert header[0].item() == T and (header[1:] == -7).all()
    if T >= 37:  # the rule was exercised on both sides
        assert (want == -2).any() or dtype in (torch.int8, torch.uint8)


def test_publish_ids_refuses_bad_buffers():
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    header = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="out must be int16 and header int32"):
        publish_ids(ids, torch.zeros(8, dtype=torch.int32, device=DEVICE), header,
                    num_experts=4)
    with pytest.raises(ValueError, match=r"out \(6 elements\) must hold ids \(8\)"):
        publish_ids(ids, torch.zeros(6, dtype=torch.int16, device=DEVICE), header,
                    num_experts=4)
    with pytest.raises(ValueError, match=r"num_experts \(40000\) must be in \[1, 32767\]"):
        publish_ids(ids, torch.zeros(8, dtype=torch.int16, device=DEVICE), header,
                    num_experts=40000)
