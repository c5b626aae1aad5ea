#!/usr/bin/env python3
"""Run 57's probe (for the next session): does the W13 forward lose its DRAM rate to its
gathered rows? The Gluon W13 forward alone (the heuristic's DeepSeek-V3 config: cooperative
128 x 128 tiles, 4 stages, producers in lockstep) over the same 15 GB of weights, its
gathered rows' addresses drawn three ways:

  routed  each expert's 128 rows are 128 distinct random tokens of x [4096, D], every token
          in 8 experts (exact routing, as in the layer)
  sorted  rows already gathered into one buffer in expert order (row r at r: each expert's
          rows contiguous, the DRAM-friendliest reads of the same bytes)
  hot     every row one of x's first 128 (the rows stay in L2: almost no DRAM bytes for A)

each in inference (h2 only) and training (h1 and the rows saved too), against TMA alone
streaming the weights in the forward's order (run 56's ``tma_stream.py``, ``fwd/4``).
Reading: if ``hot`` and ``sorted`` run at ``routed``'s rate, the rows' DRAM reads are not the
gap and the cp.async path or the consumers are; if they run near TMA's rate, the rows'
reads are. Prints ms and the weights' GB/s; ``--check`` first compares a small routed case
with torch (fp32) on random inputs.

    PYTHONPATH=src python3 docs/perf/2026-12-06-run57/w13_rows_probe.py [--check]
"""
import argparse

import torch
import triton.testing

from distmoe.kernels.w13_gluon import gluon_w13_reason, launch_gluon_w13

BLOCK = 128


def inputs(experts: int, tokens: int, top_k: int, hidden: int, ffn: int, seed: int = 0):
    """x [tokens, hidden], w13 [E, 2, F, D] and the exact routing's token of each row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2, ffn, hidden, device="cuda", generator=g,
                       dtype=torch.bfloat16) / hidden**0.5)
    rows = tokens * top_k // experts
    # every token in top_k experts, each expert's rows distinct tokens: a shuffled token
    # order dealt round-robin keeps each expert's rows distinct when rows <= tokens
    order = torch.randperm(tokens, device="cuda", generator=g)
    tok = torch.stack([order.roll(k * rows) for k in range(top_k)]).reshape(experts, rows)
    return x, w13, tok, rows


def addresses(base: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """int64 addresses of rows ``idx`` of the 2-D bf16 tensor ``base``."""
    return base.data_ptr() + idx.to(torch.int64) * base.stride(0) * base.element_size()


def run_case(x, w13, tok, rows, pattern: str, training: bool, lockstep: bool = True):
    experts, _, ffn, hidden = w13.shape
    n = experts * rows
    offsets = torch.arange(0, n + 1, rows, device="cuda", dtype=torch.int32)
    keep = []
    if pattern == "routed":
        ptrs = addresses(x, tok.reshape(-1))
    elif pattern == "sorted":
        xg = x[tok.reshape(-1)]  # the same rows, gathered once in expert order
        keep.append(xg)
        ptrs = addresses(xg, torch.arange(n, device="cuda"))
    elif pattern == "hot":
        ptrs = addresses(x, torch.arange(n, device="cuda") % BLOCK)
    else:
        raise ValueError(f"pattern must be routed, sorted or hot, got {pattern!r}")
    h2 = torch.empty(n, ffn, device="cuda", dtype=torch.bfloat16)
    h1 = torch.empty(n, 2 * ffn, device="cuda", dtype=torch.bfloat16) if training else None
    xo = torch.empty(n, hidden, device="cuda", dtype=torch.bfloat16) if training else None

    def launch():
        launch_gluon_w13(ptrs, offsets, offsets, w13, h2, h1_out=h1, x_out=xo,
                         out_offsets=None, enable=None, block_n=128, stages=4, group_m=8,
                         warps=8, lockstep=lockstep)
    return launch, (h2, h1, xo, keep)


def check(seed: int = 1) -> None:
    """A small routed case against torch in fp32 (h2 within bf16 rounding of the fp32
    result, h1 likewise, the saved rows bit-exact)."""
    x, w13, tok, rows = inputs(16, 512, 4, 1024, 768, seed)
    launch, (h2, h1, xo, _) = run_case(x, w13, tok, rows, "routed", True, lockstep=False)
    for t in (h2, h1, xo):
        t.fill_(float("nan"))  # poisoned: an unwritten row fails
    launch()
    xs = x[tok.reshape(-1)]
    assert torch.equal(xo, xs), "saved rows differ from the gathered rows"
    xe = xs.float().view(tok.shape[0], rows, -1)  # expert e's rows
    g = torch.bmm(xe, w13[:, 0].float().transpose(1, 2)).reshape(xs.shape[0], -1)
    u = torch.bmm(xe, w13[:, 1].float().transpose(1, 2)).reshape(xs.shape[0], -1)
    ref = torch.nn.functional.silu(g) * u
    # bf16 outputs of fp32 accumulations over D = 1024: a few bf16 ulps of |ref|
    for name, got, want in (("h1", h1.float(), torch.cat([g, u], 1)), ("h2", h2.float(), ref)):
        err = ((got - want).abs() / (want.abs() + 1e-2)).max().item()
        assert err < 2e-2, f"{name}: max relative error {err:.3g}"
    print("check: routed case matches torch (h2, h1 within 2e-2 relative; rows bit-exact)")


def time_ms(fn) -> float:
    """Median ms of ``fn`` (triton's ``do_bench``: L2 flushed before each run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="a small correctness check first")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    reason = gluon_w13_reason(dev, hidden=args.hidden, ffn=args.ffn, block_m=BLOCK,
                              block_n=128, block_k=64, stages=4, warps=8)
    if reason is not None:
        raise SystemExit(f"the Gluon W13 cannot run here: {reason}")
    if args.check:
        check()
    x, w13, tok, rows = inputs(args.experts, args.tokens, args.top_k, args.hidden, args.ffn)
    gb = w13.numel() * 2 / 1e9
    print(f"{torch.cuda.get_device_name(0)}: {gb:.2f} GB of W13 weights, {rows} rows per expert")
    cases = {}
    for pattern in ("routed", "sorted", "hot"):
        for training in (False, True):
            name = f"{pattern}/{'train' if training else 'infer'}"
            cases[name] = run_case(x, w13, tok, rows, pattern, training)
    cases["routed/infer/free"] = run_case(x, w13, tok, rows, "routed", False, lockstep=False)
    best = {name: float("inf") for name in cases}
    for _ in range(args.rounds):  # rounds rotate over the cases
        for name, (fn, _) in cases.items():
            best[name] = min(best[name], time_ms(fn))
    for name, ms in best.items():
        print(f"{name:18s} {ms:7.3f} ms  {gb / ms * 1e3:6.0f} GB/s of weights")


if __name__ == "__main__":
    main()
