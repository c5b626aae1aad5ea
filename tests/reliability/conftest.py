"""The reliability tests share one launch per EP size and device: it runs every case of
that size (``fuzz_plan.fuzz_plan``: forward, training, determinism) in the same rank
processes, since starting ranks costs more than a small case in Triton's interpreter."""

import pytest
from fuzz_cases import suite_rank
from fuzz_plan import fuzz_plan

import distmoe as dm


def launch_options(device: str) -> dict:
    """``dm.launch`` options: CPU ranks, or every rank on GPU 0 (the ``cuda_ipc`` heap)."""
    return dict(device="cuda", gpus=[0], timeout=600) if device == "cuda" else {}


@pytest.fixture(scope="session")
def suite():
    """``suite(EP, device) -> (plan, per-rank results)``, launched once per session."""
    runs = {}

    def run(ep: int, device: str):
        if (ep, device) not in runs:
            plan = fuzz_plan(ep, device)
            per_rank = dm.launch(suite_rank, ep, args=(plan, device), **launch_options(device))
            runs[ep, device] = (plan, per_rank)
        return runs[ep, device]

    return run
