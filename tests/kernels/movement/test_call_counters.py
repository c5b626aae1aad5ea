"""count_call: the layer's six device counters from one call's routing-table counters and every
rank's published token count, in one program (or torch ops where neither CUDA nor the
interpreter runs). Exact integer updates, checked over several calls against plain Python
arithmetic; the headers are int32 tensors here, read through their addresses."""

from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

import distmoe.kernels.movement.call_counters as cc  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("way", ["kernel", "torch"])
def test_counters_follow_the_calls(way, monkeypatch):
    if way == "torch":
        if DEVICE.type == "cuda":
            pytest.skip("the torch ops run only off CUDA without the interpreter")
        monkeypatch.setattr(cc, "interpreter_active", lambda: False)
    g = torch.Generator().manual_seed(3)
    counters = torch.tensor([-5, 7, 11, 13, 17, 19], dtype=torch.int64, device=DEVICE)
    headers = [torch.full((32,), -9, dtype=torch.int32, device=DEVICE) for _ in range(3)]
    bases = torch.tensor([h.data_ptr() for h in headers], dtype=torch.int64, device=DEVICE)
    want = counters.tolist()
    for dtype, published in ((torch.int64, [40, 40, 40]), (torch.int32, [40, 39, 40]),
                             (torch.int64, [41, 40, 40]), (torch.int32, [40, 40, 40])):
        for h, t in zip(headers, published, strict=True):
            h[0] = t
        recv, dropped, invalid = (int(v) for v in torch.randint(0, 1 << 20, (3,), generator=g))
        cc.count_call(counters, *(torch.tensor(v, dtype=dtype, device=DEVICE)
                                  for v in (recv, dropped, invalid)),
                      header_bases=bases, headers=headers, tokens=40)
        want = [recv, max(want[1], recv), want[2] + dropped, want[3] + invalid, want[4] + 1,
                want[5] + int(published != [40, 40, 40])]
        assert counters.tolist() == want


def test_counters_arguments_are_checked():
    counters = torch.zeros(6, dtype=torch.int64, device=DEVICE)
    one = torch.ones((), dtype=torch.int64, device=DEVICE)
    header = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    kw = dict(header_bases=torch.tensor([header.data_ptr()], device=DEVICE), headers=[header],
              tokens=0)
    with pytest.raises(ValueError, match="counters"):
        cc.count_call(counters[:5], one, one, one, **kw)
    with pytest.raises(TypeError, match="num_dropped_rows"):
        cc.count_call(counters, one, one.float(), one, **kw)
    with pytest.raises(ValueError, match="num_invalid_ids must hold one value"):
        cc.count_call(counters, one, one, torch.ones(2, dtype=torch.int64, device=DEVICE), **kw)
    with pytest.raises(ValueError, match="headers must list one tensor per rank"):
        cc.count_call(counters, one, one, one, **dict(kw, headers=[]))
    with pytest.raises(ValueError, match="tokens"):
        cc.count_call(counters, one, one, one, **dict(kw, tokens=-1))
