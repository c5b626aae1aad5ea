"""distmoe.rowwise's MXFP8 calls (dispatch_put_scaled, combine_get_scaled) on CPU ranks (gloo,
the CPU heap, Triton's interpreter), EP 1 to 3; EP 1 and 2 also as GPU ranks sharing GPU 0.

* The scaled PUT moves qdata and scale rows bit for bit (destinations poisoned first; rows no
  route names keep the poison), with invalid routes skipped and bad ones counted.
* The scaled combine equals the plain-PyTorch reference bit for bit: the dequantised values
  are exact in fp32 and both sum them in fp32 in k order; the kept routes are the exact
  dequantised rows (zeros where not read).
* The probabilities' gradient: fp32 dots over D of exact values against float64 dots,
  ``rtol = 1e-5`` (a few fp32 ulps of a sum of D = 64 terms in another order).
"""

import functools

import pytest
import torch
from rowwise_cases import make_problem, on_device, to_cpu

import distmoe
import distmoe.rowwise as rw
from distmoe.kernels.movement.rowwise_put import rowwise_put_ref
from distmoe.quant import mxfp8_quantize, mxfp8_quantize_ref
from distmoe.rowwise.scaled import combine_get_scaled_ref

# one xdist worker runs the group (./run test: --dist loadgroup), so that the launches
# its fixtures share run once, not once per worker
pytestmark = pytest.mark.xdist_group("rowwise_scaled")

SEED, BAD_SEED, D = 15, 16, 64
POISON_BYTE = 0x5A  # a finite E4M3 value and an E8M0 byte no quantiser here produces


def _grad_y(rank, n, device):
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(n, D, generator=g).bfloat16().to(device)


def _rank(rank, world, device="cpu"):
    backend = "cpu" if device == "cpu" else "auto"
    res = {}
    for key, seed, bad in (("good", SEED, False), ("bad", BAD_SEED, True)):
        p = on_device(make_problem(world, seed, hidden=D, bad=bad), device)
        q, s = mxfp8_quantize(p.x[rank], dim=-1)
        with rw.Buffers(None, p.rows_per_rank, D, backend=backend, grad=False,
                        scaled=True) as bufs:
            bufs.out_q.view(torch.uint8).fill_(POISON_BYTE)
            bufs.out_s.fill_(POISON_BYTE)
            bufs.barrier()
            out_q, out_s = rw.dispatch_put_scaled(q, s, p.ranks[rank], p.rows[rank], bufs.out_q)
            assert out_q is bufs.out_q and out_s is bufs.out_s
            res[key + "_out"] = (out_q.view(torch.uint8).clone(), out_s.clone())
            # expert rows: this rank's sources, quantised
            eq, es = mxfp8_quantize(p.src[rank], dim=-1)
            bufs.expert_out_q.copy_(eq)
            bufs.expert_out_s.copy_(es)
            res[key + "_src"] = (eq.view(torch.uint8).clone(), es.clone())
            y, routes = rw.combine_get_scaled(bufs.expert_out_q, p.ranks[rank], p.rows[rank],
                                              keep_routes=True)
            yw = rw.combine_get_scaled(bufs.expert_out_q, p.ranks[rank], p.rows[rank],
                                       p.probs[rank])
            probs = p.probs[rank].clone().requires_grad_(True)
            yg = rw.combine_get_scaled(bufs.expert_out_q, p.ranks[rank], p.rows[rank], probs)
            (yg.float() * _grad_y(rank, yg.shape[0], device).float()).sum().backward()
            res[key + "_combine"] = (y, routes, yw, yg.detach(), probs.grad)
            res[key + "_stats"] = bufs.stats()
    return to_cpu(res)


GROUPS = [pytest.param((w, "cpu"), id=f"ep{w}") for w in (1, 2, 3)] + [
    pytest.param((w, "cuda"), id=f"gpu-ep{w}", marks=pytest.mark.gpu) for w in (1, 2)]


@pytest.fixture(scope="module", params=GROUPS)
def group(request):
    world, device = request.param
    return world, _group_runs(world, device)


@functools.cache
def _group_runs(world, device):
    # cached in the process: pytest-xdist may set a module fixture up again on the same
    # worker (its items of one module need not arrive together), and a launch costs seconds
    # in Triton's interpreter; the tests only read the results
    return distmoe.launch(_rank, world, device=device, gpus=[0] if device == "cuda" else None,
                          timeout=180, args=(device,))


@pytest.mark.parametrize("key,seed,bad", [("good", SEED, False), ("bad", BAD_SEED, True)])
def test_scaled_put_moves_bytes_and_counts_bad_routes(group, key, seed, bad):
    world, results = group
    p = make_problem(world, seed, hidden=D, bad=bad)
    outs_q = [torch.full((p.rows_per_rank, D), POISON_BYTE, dtype=torch.uint8)
              for _ in range(world)]
    outs_s = [torch.full((p.rows_per_rank, D // 32), POISON_BYTE, dtype=torch.uint8)
              for _ in range(world)]
    for s in range(world):
        q, sc = mxfp8_quantize_ref(p.x[s], dim=-1)  # the same bits, any device
        bad_q = rowwise_put_ref(q.view(torch.uint8), p.ranks[s], p.rows[s], outs_q)
        rowwise_put_ref(sc, p.ranks[s], p.rows[s], outs_s)
        assert results[s][key + "_stats"]["bad_put_routes"] == bad_q == p.bad[s]
    for r in range(world):
        got_q, got_s = results[r][key + "_out"]
        assert torch.equal(got_q, outs_q[r]), f"rank {r}: qdata rows"
        assert torch.equal(got_s, outs_s[r]), f"rank {r}: scale rows"


@pytest.mark.parametrize("key,seed,bad", [("good", SEED, False), ("bad", BAD_SEED, True)])
def test_scaled_combine_matches_reference_bits(group, key, seed, bad):
    world, results = group
    p = make_problem(world, seed, hidden=D, bad=bad)
    src_q = [results[r][key + "_src"][0].view(torch.float8_e4m3fn) for r in range(world)]
    src_s = [results[r][key + "_src"][1] for r in range(world)]
    for s in range(world):
        y, routes, yw, yg, grad_p = results[s][key + "_combine"]
        y_ref, routes_ref = combine_get_scaled_ref(src_q, src_s, p.ranks[s], p.rows[s])
        yw_ref, _ = combine_get_scaled_ref(src_q, src_s, p.ranks[s], p.rows[s], p.probs[s])
        assert torch.equal(y.view(torch.int16), y_ref.view(torch.int16)), f"rank {s}: y"
        assert torch.equal(routes.view(torch.int16), routes_ref.view(torch.int16))
        assert torch.equal(yw.view(torch.int16), yw_ref.view(torch.int16)), f"rank {s}: yw"
        assert torch.equal(yg.view(torch.int16), yw.view(torch.int16))
        # 1 GET per call (three calls) for every bad route
        assert results[s][key + "_stats"]["bad_get_routes"] == 3 * p.bad[s]
        # d loss / d probs[t, k] = dot(grad_y[t], route(t, k)); 0 where the route is not read
        gy = _grad_y(s, y.shape[0], "cpu").double()
        want = torch.einsum("nkd,nd->nk", routes_ref.double(), gy)
        assert grad_p.dtype == p.probs[s].dtype
        assert torch.allclose(grad_p.double(), want, rtol=1e-5, atol=1e-6), f"rank {s}"


def test_scaled_refusals():
    with pytest.raises(ValueError, match=r"hidden \(48\) must be a multiple of 32 with "
                                         r"scaled=True"):
        rw.Buffers(None, 4, 48, backend="cpu", scaled=True)
    with rw.Buffers(None, 4, D, backend="cpu", grad=False) as bufs:
        q, s = mxfp8_quantize(torch.randn(2, D).bfloat16(), dim=-1)
        ranks = torch.zeros(2, 1, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"out_q must be the .out_q or .expert_out_q "
                                             r"tensor of a distmoe.rowwise.Buffers\(scaled"):
            rw.dispatch_put_scaled(q, s, ranks, ranks, bufs.out)
    with rw.Buffers(None, 4, D, backend="cpu", grad=False, scaled=True) as bufs:
        with pytest.raises(TypeError, match=r"qdata must have dtype float8_e4m3fn"):
            rw.dispatch_put_scaled(q.view(torch.uint8), s, ranks, ranks, bufs.out_q)
        with pytest.raises(ValueError, match=r"scales must be contiguous \[2, 2\]"):
            rw.dispatch_put_scaled(q, s[:, :1].contiguous(), ranks, ranks, bufs.out_q)
        with pytest.raises(ValueError, match=r"expert_out_q must be the .out_q"):
            rw.combine_get_scaled(bufs.expert_out, ranks, ranks)
        with pytest.raises(TypeError, match=r"keep_routes must be a bool"):
            rw.combine_get_scaled(bufs.expert_out_q, ranks, ranks, keep_routes=1)
