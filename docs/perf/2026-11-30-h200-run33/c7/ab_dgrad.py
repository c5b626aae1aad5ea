"""Kernel A/B: the Gluon W2 DGRAD (scored, the layer's form) with the per-expert bounds held
in registers against reloaded per tile; outputs compared bit for bit first."""
import statistics
import sys

import torch

sys.path.insert(0, "tools")
from tune_gemm import _layout  # noqa: E402

from distmoe.kernels.w2_dgrad_gluon import launch_gluon_w2_dgrad  # noqa: E402
from distmoe.tools.bench.timing import interleaved  # noqa: E402
from distmoe.tools.bench.workloads import SHAPES  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(0)
for name in sys.argv[1:] or ["fine"]:
    s = SHAPES[name]
    T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    counts, ro, po, r_cap, token = _layout(T, K, E, dev)
    w2 = (torch.randn(E, D, F, device=dev) / F**0.5).bfloat16()
    combine = torch.randn(R, D, device=dev).bfloat16()
    combine.view(torch.float32)[:, 0] = torch.rand(R, device=dev)
    scatter = torch.zeros(r_cap, dtype=torch.int64)
    pos, starts = 0, po.tolist()
    for e in range(E):
        n = int(counts[e])
        scatter[starts[e]:starts[e] + n] = combine.data_ptr() + torch.arange(pos, pos + n) * D * 2
        pos += n
    scatter = scatter.to(dev)
    h1 = torch.randn(R, 2 * F, device=dev).bfloat16()
    gh3 = torch.randn(R, D, device=dev).bfloat16()
    outs = {}

    def make(reload, grad_h1, h2):
        def run():
            launch_gluon_w2_dgrad(scatter, po, ro, w2, gh3, h1, grad_h1, h1_offset=None,
                                  h2_out=h2, scored_rows=True, reload_bounds=reload)
        return run

    fns = {}
    for reload in (False, True):
        g, h = torch.full((R, 2 * F), float("nan"), device=dev, dtype=torch.bfloat16), \
            torch.full((R, F), float("nan"), device=dev, dtype=torch.bfloat16)
        saved = combine.clone()
        make(reload, g, h)()
        torch.cuda.synchronize()
        outs[reload] = (g.clone(), h.clone(), combine.clone())
        combine.copy_(saved)
        fns["reload" if reload else "hold"] = make(reload, g, h)
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(outs[False], outs[True]))
    live = int(ro[-1])
    nan = bool(torch.isnan(outs[True][0][:live].float()).any())
    res = interleaved(fns, rounds=21, iters=20)
    ratios = [a / b for a, b in zip(res["hold"].window_ms, res["reload"].window_ms)]
    print(f"{name}: E={E} same bits {same}, NaN in live grad_h1 rows {nan}; "
          f"hold {res['hold'].iter_ms * 1e3:.1f} us, reload {res['reload'].iter_ms * 1e3:.1f} us, "
          f"hold / reload per round median {statistics.median(ratios):.4f} (> 1: reload faster)",
          flush=True)
