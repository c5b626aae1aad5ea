import sys
sys.path.insert(0, "tests/kernels"); sys.path.insert(0, "src")
import torch
import test_w2_beside as t
from distmoe.kernels.w13_gather_swiglu import gather_w13_swiglu, gather_w13_swiglu_ref
p = t._problem(512, 384, seed=1)
F = p["w13"].shape[2]
for cfg in t.W13_GLUON:
    h2 = torch.full((p["n_act"], F), float("nan"), dtype=torch.bfloat16, device="cuda")
    gather_w13_swiglu(p["ptrs"], p["po"], p["ro"], p["w13"], h2, config=cfg)
    torch.cuda.synchronize()
    bad = torch.isnan(h2.float())
    rows = bad.any(1).nonzero().flatten().tolist()
    print(cfg.block_n, cfg.num_warps, "nan rows", len(rows), rows[:10], "cols of first",
          bad[rows[0]].nonzero().flatten().tolist()[:5] if rows else None)
    ref = torch.full_like(h2, float("nan"))
    x = torch.empty(0)
    print("  po", p["po"].tolist(), "ro", p["ro"].tolist())
