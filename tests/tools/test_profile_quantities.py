"""The kernel-profile quantities (distmoe.tools.profile_quantities): every kernel the layer
launches lands in the phase its name says, the sums and rates by hand, and the profile
command's --quantities / --json on the CPU."""

import json

import pytest
import torch

from distmoe.tools.profile_quantities import padded_rows, phase_of, quantities

# (kernel name as the CUDA profiler shows it, phase)
NAMES = [
    ("_gather_w13_swiglu_kernel", "grouped GEMM"),
    ("_gluon_w13_kernel", "grouped GEMM"),
    ("_w2_scatter_kernel", "grouped GEMM"),
    ("_gluon_w2_dgrad_split_kernel", "grouped GEMM"),
    ("_w13_dgrad_scatter_kernel", "grouped GEMM"),
    ("_gluon_scaled_kernel", "grouped GEMM"),
    ("_nvfp4_weight_grouped_mm_kernel", "grouped GEMM"),
    ("_fused_kernel", "grouped GEMM"),
    ("_gluon_wgrad_ws_kernel", "weight gradient, bf16"),
    ("_grouped_wgrad_kernel", "weight gradient, bf16"),
    ("_gluon_scaled_wgrad_kernel", "weight gradient, FP8"),
    ("_gather_quant_kernel", "FP8 quantisation"),
    ("_swiglu_quant_kernel", "FP8 quantisation"),
    ("_dequant_rows_kernel", "FP8 quantisation"),
    ("_pull_tokens_kernel", "GET (pull, gather)"),
    ("_regather_kernel", "GET (pull, gather)"),
    ("_rowwise_combine_get_kernel", "GET (pull, gather)"),
    ("_push_route_grads_kernel", "PUT (dispatch, scatter)"),
    ("_publish_ids_kernel", "PUT (dispatch, scatter)"),
    ("_scatter_rows_kernel", "PUT (dispatch, scatter)"),
    ("_combine_kernel", "combine reduce"),
    ("_reduce_routes_kernel", "combine reduce"),
    ("_route_grads_kernel", "combine reduce"),
    ("_routing_tables_kernel", "routing"),
    ("_local_routes_kernel", "routing"),
    ("_begin_layer_kernel", "routing"),
    ("_device_barrier_kernel", "barrier"),
    ("ncclDevKernel_AllGather_RING_LL", "collective (NCCL)"),
    ("Memcpy DtoD (Device -> Device)", "copies (memcpy / memset)"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "PyTorch kernels"),
    ("some_new_kernel", "other"),
]


@pytest.mark.parametrize("name, phase", NAMES)
def test_phase_of_each_kernel(name, phase):
    assert phase_of(name) == phase


def test_sums_rate_and_padding():
    rows = [(2.0, 2, "_gluon_w13_kernel"), (1.0, 1, "_w2_scatter_kernel"),
            (1.0, 2, "_gluon_wgrad_ws_kernel"), (0.5, 3, "_combine_kernel"),
            (0.25, 1, "some_new_kernel")]
    q = quantities(rows, useful_tflop=2.0, counts=[100, 128, 0, 1], row_block=128,
                   peak_gib={"forward": 1.5})
    assert (q.launches, q.total_ms) == (9, 4.75)
    assert q.phases["grouped GEMM"]["ms"] == 3.0 and q.phases["grouped GEMM"]["launches"] == 3
    assert q.gemm_tflops == pytest.approx(2.0 / 4e-3)  # 2 TFLOP over 4 ms of GEMMs
    assert (q.live_rows, q.padded_rows) == (229, 384)
    assert q.padding_overhead == pytest.approx(384 / 229 - 1)
    assert padded_rows([0, 1, 128, 129], 128) == 0 + 128 + 128 + 256
    assert "rowwise stream wait under TBO" in q.not_applicable


def test_profile_command_writes_the_quantities(tmp_path, distmoe_cli):
    if torch.cuda.is_available():
        pytest.skip("the CPU view needs a machine without CUDA")
    out = tmp_path / "q.json"
    r = distmoe_cli("profile", "--shape", "smoke", "--tokens", "16", "--mode", "fwd",
                    "--steps", "1", "--rows", "2", "--quantities", "--json", str(out),
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quantities per step (rank 0):" in r.stdout
    assert "padding: " in r.stdout and "peak allocated, forward: n/a" in r.stdout
    data = json.loads(out.read_text())
    q = data["quantities"]
    assert q["launches"] > 0 and q["live_rows"] == 16 * 2  # T * K routes, all executed
    assert data["kernels"] and data["shape"] == "smoke" and data["environment"]["torch"]
