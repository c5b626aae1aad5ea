"""Timing probe (results WRONG on purpose): W2 launched on a side stream at the same time as
W13, the two grids splitting the SMs (P1 + P2), W2 not waiting for W13's h2. If the EP=2
forward gets close to the EP=1 share this way, a W2 that waits per expert for W13's tiles
(PDL or one fused kernel) is worth building. Usage under torch.distributed.run:
    tools-like: --shape fine --rounds 15 --split 88,44 --split 92,40"""
import argparse
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "src")
sys.path.insert(0, "tools")
import distmoe.kernels._common as common  # noqa: E402
import distmoe.kernels.w2_scatter as w2mod  # noqa: E402
from distmoe.ops.context import MoEContext  # noqa: E402
from distmoe.tools.bench.layer_step import ep1_share, join_group, layer_step  # noqa: E402
from distmoe.tools.bench.timing import interleaved  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="fine")
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--split", action="append", default=[])
ap.add_argument("--share", action="store_true")
args = ap.parse_args()

STATE = {"split": None, "side": None, "ev": None}
orig_num_sms = common.num_sms
orig_run_w13 = MoEContext._run_w13
orig_w2 = w2mod.w2_scatter


def patched_sms(device):
    if STATE.get("force") is not None:
        return STATE["force"]
    return orig_num_sms(device)


common.num_sms = patched_sms


def run_w13(self, phased, gather_ptrs, po, ro, w13, **outputs):
    if STATE["split"] is None:
        return orig_run_w13(self, phased, gather_ptrs, po, ro, w13, **outputs)
    main = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    ev.record(main)
    STATE["ev"] = ev
    STATE["force"] = STATE["split"][0]
    try:
        return orig_run_w13(self, phased, gather_ptrs, po, ro, w13, **outputs)
    finally:
        STATE["force"] = None


def w2_scatter(*a, **k):
    if STATE["split"] is None:
        return orig_w2(*a, **k)
    main = torch.cuda.current_stream()
    side = STATE["side"]
    side.wait_event(STATE["ev"])
    STATE["force"] = STATE["split"][1]
    try:
        with torch.cuda.stream(side):
            orig_w2(*a, **k)
    finally:
        STATE["force"] = None
    done = torch.cuda.Event()
    done.record(side)
    main.wait_event(done)


MoEContext._run_w13 = run_w13
w2mod.w2_scatter = w2_scatter

joined = join_group(port=29557)
STATE["side"] = torch.cuda.Stream(device=joined.device)
ctx, step, T = layer_step(args.shape, "fwd", joined)
share = None
if args.share and joined.world > 1:
    share = layer_step(args.shape, "fwd", ep1_share(joined), share_of=joined.world)
splits = [tuple(int(v) for v in s.split(",")) for s in args.split]


def runner(split):
    def run():
        STATE["split"] = split
        try:
            step()
        finally:
            STATE["split"] = None
    return run


with ctx:
    fns = {"base": runner(None)}
    for sp in splits:
        fns[f"conc{sp[0]}+{sp[1]}"] = runner(sp)
    if share is not None:
        fns["ep1share"] = share[1]
        for sp in splits:
            sctx, sstep = share[0], share[1]

            def srun(sp=sp, sstep=sstep):
                STATE["split"] = sp
                try:
                    sstep()
                finally:
                    STATE["split"] = None
            fns[f"share.conc{sp[0]}+{sp[1]}"] = srun
    stats = interleaved(fns, rounds=args.rounds, iters=10, warmup=3, device=joined.device,
                        group=joined.group)
    if share is not None:
        share[0].close()
if joined.rank == 0:
    base = list(stats["base"].window_ms)
    print(f"{args.shape} fwd T={T} EP={joined.world}: ms per step (median, min-max); ratio base/variant")
    for name, st in stats.items():
        r = statistics.median(b / m for b, m in zip(base, st.window_ms))
        print(f"  {name:>20} {st.iter_ms:8.3f} ({st.min_ms:.3f}-{st.max_ms:.3f})  x{r:.4f}")
dist.destroy_process_group()
