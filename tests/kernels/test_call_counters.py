"""count_call: the layer's five device counters from one call's routing-table counters, in one
program (or torch ops where neither CUDA nor the interpreter runs). Exact integer updates,
checked over several calls against plain Python arithmetic."""

from distmoe.kernels.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

import distmoe.kernels.call_counters as cc  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("way", ["kernel", "torch"])
def test_counters_follow_the_calls(way, monkeypatch):
    if way == "torch":
        if DEVICE.type == "cuda":
            pytest.skip("the torch ops run only off CUDA without the interpreter")
        monkeypatch.setattr(cc, "interpreter_active", lambda: False)
    g = torch.Generator().manual_seed(3)
    counters = torch.tensor([-5, 7, 11, 13, 17], dtype=torch.int64, device=DEVICE)
    want = counters.tolist()
    for dtype in (torch.int64, torch.int32, torch.int64):
        recv, dropped, invalid = (int(v) for v in torch.randint(0, 1 << 20, (3,), generator=g))
        cc.count_call(counters, *(torch.tensor(v, dtype=dtype, device=DEVICE)
                                  for v in (recv, dropped, invalid)))
        want = [recv, max(want[1], recv), want[2] + dropped, want[3] + invalid, want[4] + 1]
        assert counters.tolist() == want


def test_counters_arguments_are_checked():
    counters = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    one = torch.ones((), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="counters"):
        cc.count_call(counters[:4], one, one, one)
    with pytest.raises(TypeError, match="num_dropped_rows"):
        cc.count_call(counters, one, one.float(), one)
    with pytest.raises(ValueError, match="num_invalid_ids must hold one value"):
        cc.count_call(counters, one, one, torch.ones(2, dtype=torch.int64, device=DEVICE))
