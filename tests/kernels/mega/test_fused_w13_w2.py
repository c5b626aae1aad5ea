"""W13 and W2 fused into one kernel (:mod:`distmoe.kernels.mega.gluon`): its W13 tiles count
each 128-row block's stored h2 tiles (``done``) and its W2 tiles wait per block for that
count before their loads, inside one launch.

What must hold, and how each test can fail: h2 and the scattered rows are bit for bit those
of the two kernels with the same tiles (h2 poisoned with NaN first, so a W2 tile that read
its rows early stores NaN rows), the done counts exact and the counters past the call's
blocks untouched; bad arguments and configs raise before anything runs, and a device
without the Gluon kernels is refused with the reason.
"""

from distmoe.kernels.base.interpreter import use_interpreter_if_no_gpu

use_interpreter_if_no_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.kernels.base.device import num_sms  # noqa: E402
from distmoe.kernels.mega.gluon import FusedConfig, fused_reason, fused_w13_w2  # noqa: E402
from distmoe.kernels.w2_forward.config import W2Config  # noqa: E402
from distmoe.kernels.w2_forward.triton import w2_scatter  # noqa: E402
from distmoe.kernels.w13_forward.config import W13Config  # noqa: E402
from distmoe.kernels.w13_forward.triton import gather_w13_swiglu  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BM = 128
# rows per expert: several blocks, a one-row expert, an empty one, exact multiples of 128
COUNTS = [700, 1, 0, 256, 383, 1024, 90, 512]


def _problem(D: int, F: int, seed: int):
    """Gather table into random tokens (``x``, kept in the dict: the table holds raw
    addresses into it), padded offsets, live offsets, weights and the scatter table (a
    permutation of the output rows, some rows skipped)."""
    g = torch.Generator().manual_seed(seed)
    T = 600
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
    ptrs, padded, live = [], [0], [0]
    for n in COUNTS:
        tok = torch.randint(0, T, (n,), generator=g)
        seg = -(-n // BM) * BM
        ptrs += (x.data_ptr() + tok * D * 2).tolist() + [0] * (seg - n)
        padded.append(padded[-1] + seg)
        live.append(live[-1] + n)
    r_cap = padded[-1] + 3 * BM  # blocks past the call
    ptrs += [0] * (r_cap - len(ptrs))
    n_act = live[-1]
    E = len(COUNTS)
    w13 = (torch.randn(E, 2, F, D, generator=g) / D ** 0.5).to(torch.bfloat16).to(DEVICE)
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(torch.bfloat16).to(DEVICE)
    out = torch.empty(n_act, D, dtype=torch.bfloat16, device=DEVICE)
    dest = torch.randperm(n_act, generator=g)
    scatter = torch.zeros(r_cap, dtype=torch.int64)
    for e, n in enumerate(COUNTS):
        rows = torch.arange(n) + live[e]
        addrs = out.data_ptr() + dest[rows] * D * 2
        addrs[::7] = 0  # skipped rows
        scatter[padded[e]:padded[e] + n] = addrs
    as32 = dict(dtype=torch.int32, device=DEVICE)
    return dict(x=x, ptrs=torch.tensor(ptrs, dtype=torch.int64, device=DEVICE),
                po=torch.tensor(padded, **as32), ro=torch.tensor(live, **as32), w13=w13,
                w2=w2, out=out, scatter=scatter.to(DEVICE), n_act=n_act, r_cap=r_cap,
                blocks=padded[-1] // BM)


# the fused cooperative kernel's W13 tile as the W13 kernel's config
COOP13 = W13Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8,
                   persistent=True, gluon=True)
W2_GLUON = [W2Config(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                     group_m=8, persistent=True, gluon=True),
            W2Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                     group_m=8, persistent=True, gluon=True)]


def _sequential(p, w13c, w2c):
    F = p["w13"].shape[2]
    h2 = torch.full((p["n_act"], F), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    p["out"].fill_(float("nan"))
    gather_w13_swiglu(p["ptrs"], p["po"], p["ro"], p["w13"], h2, config=w13c)
    w2_scatter(h2, p["po"], p["ro"], p["w2"], p["scatter"], config=w2c)
    torch.cuda.synchronize()
    return p["out"].clone()


def _small():
    E, D, F, r_cap = 2, 32, 32, 256
    return dict(ptrs=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE),
                po=torch.tensor([0, 128, 128], dtype=torch.int32, device=DEVICE),
                ro=torch.tensor([0, 3, 3], dtype=torch.int32, device=DEVICE),
                w13=torch.zeros(E, 2, F, D, dtype=torch.bfloat16, device=DEVICE),
                w2=torch.zeros(E, D, F, dtype=torch.bfloat16, device=DEVICE),
                h2=torch.zeros(4, F, dtype=torch.bfloat16, device=DEVICE),
                scatter=torch.zeros(r_cap, dtype=torch.int64, device=DEVICE))


# the fused ping-pong kernel's W13 tile as the W13 kernel's config (its ring depth)
PP13_S6 = W13Config(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=6,
                    group_m=8, persistent=True, gluon=True)
FUSED = [  # (fused config, the two kernels' configs with the same tiles)
    (FusedConfig(block_n=128, warps=8, stages=4, lag=2, dynamic=True), COOP13, W2_GLUON[1]),
    (FusedConfig(block_n=128, warps=8, stages=4, lag=1, dynamic=False), COOP13, W2_GLUON[1]),
    (FusedConfig(block_n=64, warps=4, stages=6, lag=3, dynamic=True), PP13_S6, W2_GLUON[0]),
    (FusedConfig(block_n=64, warps=4, stages=6, lag=1, dynamic=False), PP13_S6, W2_GLUON[0]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fc, w13c, w2c", FUSED,
                         ids=["coop-lag2", "coop-lag1-static", "pp-lag3", "pp-lag1-static"])
def test_fused_w13_w2_matches_the_two_kernels(fc, w13c, w2c):
    """h2 and the scattered rows bit for bit those of W13 then W2 with the same tiles
    (poisoned first: h2 NaN, so a W2 tile that read its rows early stores NaN), the done
    counts exact and the counters past the call's blocks untouched, on every SM and on 7
    programs (many tiles each, long waits across programs); with tiles handed out at run
    time, every schedule position taken once (the hand-out counter ends at the tile count
    plus one look past the end per program)."""
    p = _problem(2048, 768, seed=4)
    F, D = p["w13"].shape[2], p["w13"].shape[3]
    want = _sequential(p, w13c, w2c)
    want_h2 = torch.full((p["n_act"], F), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gather_w13_swiglu(p["ptrs"], p["po"], p["ro"], p["w13"], want_h2, config=w13c)
    tiles = p["blocks"] * (F // fc.block_n + D // (2 * fc.block_n))
    for programs in (None, 7):
        h2 = torch.full((p["n_act"], F), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        p["out"].fill_(float("nan"))
        counters = torch.full((p["r_cap"] // BM + 1,), -5, dtype=torch.int32, device=DEVICE)
        counters[:p["blocks"]] = 0
        counters[-1] = 0
        fused_w13_w2(p["ptrs"], p["po"], p["ro"], p["w13"], p["w2"], h2, p["scatter"],
                     counters, config=fc, programs=programs)
        torch.cuda.synchronize()
        assert torch.equal(h2.view(torch.int16), want_h2.view(torch.int16)), programs
        assert torch.equal(p["out"].view(torch.int16), want.view(torch.int16)), programs
        got = counters.tolist()
        assert got[:p["blocks"]] == [fc.done_count(F)] * p["blocks"]
        assert got[p["blocks"]:-1] == [-5] * (len(got) - 1 - p["blocks"])
        grid = min(num_sms(DEVICE) if programs is None else programs, tiles)
        assert got[-1] == (tiles + grid if fc.dynamic else 0)


def _fused_call(s, **kwargs):
    args = dict(counters=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    args.update(kwargs)
    fused_w13_w2(s["ptrs"], s["po"], s["ro"], s["w13"], s["w2"], s["h2"], s["scatter"],
                 args.pop("counters"), **args)


@pytest.mark.parametrize("change, error, match", [
    (dict(counters=None), TypeError, "counters must be a torch.Tensor"),
    (dict(counters="short"), ValueError, r"counters must have shape \[3\]"),
    (dict(w2="wide"), ValueError, r"w2 must have shape \[E_local=2, D=32, F=32\]"),
    (dict(config="cfg"), TypeError, "config must be a FusedConfig"),
    (dict(programs=0), ValueError, "programs must be None or an int >= 1"),
])
def test_fused_rejects_bad_arguments(change, error, match):
    s = _small()
    s["scatter"].fill_(-1)  # nothing may run: a launch would fault on these addresses
    kwargs = {}
    for name, value in change.items():
        if name == "counters":
            kwargs["counters"] = (None if value is None
                                  else torch.zeros(2, dtype=torch.int32, device=DEVICE))
        elif name == "w2":
            s["w2"] = torch.zeros(2, 64, 32, dtype=torch.bfloat16, device=DEVICE)
        else:
            kwargs[name] = value
    with pytest.raises(error, match=match):
        _fused_call(s, **kwargs)


@pytest.mark.parametrize("fields, match", [
    (dict(block_n=128, warps=4), r"\(block_n, warps\) must be \(128, 8\)"),
    (dict(lag=0), "FusedConfig.lag must be an int >= 1"),
    (dict(stages=True), "FusedConfig.stages must be an int >= 1"),
    (dict(block_n=128, warps=8, stages=5), "exceed the ring's"),
    (dict(dynamic=1), "FusedConfig.dynamic must be a bool"),
])
def test_fused_config_rules(fields, match):
    with pytest.raises(ValueError, match=match):
        FusedConfig(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a device without Gluon")
def test_fused_needs_a_hopper_gpu():
    with pytest.raises(ValueError, match="the fused W13 \\+ W2 kernel cannot run here"):
        _fused_call(_small())
    reason = fused_reason(torch.device("cuda"), hidden=2048, ffn=700, config=FusedConfig())
    assert reason is not None
