import sys, torch, triton.testing
from distmoe.kernels.w2_backward import W2DgradConfig, w2_dgrad_swiglu_bwd
from distmoe.tools.bench.workloads import SHAPES
dev = torch.device("cuda")
torch.manual_seed(0)
for name in ("issue-a", "fine"):
    s = SHAPES[name]; T, D, F, E, K = s.tokens, s.hidden, s.ffn, s.num_experts, s.top_k
    R = T * K
    counts = torch.full((E,), R // E)
    ro = torch.zeros(E + 1, dtype=torch.int32); ro[1:] = counts.cumsum(0)
    po = torch.zeros(E + 1, dtype=torch.int32); po[1:] = ((counts + 127) // 128 * 128).cumsum(0)
    ro, po = ro.to(dev), po.to(dev)
    combine = torch.randn(R, D, device=dev).bfloat16()
    combine.view(torch.float32)[:, 0] = torch.rand(R, device=dev)
    perm = torch.randperm(R, device=dev)
    ptrs = combine.data_ptr() + perm.long() * D * 2
    w2 = (torch.randn(E, D, F, device=dev) / D**0.5).bfloat16()
    h1 = torch.randn(R, 2 * F, device=dev).bfloat16()
    gh1 = torch.empty_like(h1); h2 = torch.empty(R, F, device=dev, dtype=torch.bfloat16)
    rows = torch.randn(R, D, device=dev).bfloat16()
    cfg = W2DgradConfig.from_heuristic(hidden=D, ffn=F, rows_per_expert=R // E, device=dev)
    res = []
    for rep in range(3):
        for scored in (False, True):
            ms = triton.testing.do_bench(lambda: w2_dgrad_swiglu_bwd(
                ptrs, po, ro, w2, h1, gh1, h2_out=h2, grad_h3_rows=rows, scored_rows=scored,
                config=cfg), warmup=10, rep=100)
            res.append((scored, ms))
    print(sys.argv[1], name, cfg.gluon, " ".join(f"{'S' if s else 'u'}={ms:.3f}" for s, ms in res), flush=True)
