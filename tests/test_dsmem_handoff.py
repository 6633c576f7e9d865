"""The DSMEM hand-off micro-kernel (``benchmarks/dsmem_handoff.py``, session 36): the measurement behind #8's
lever 3, the GVA pair sums passed between the two CTAs of a cluster.  On the CPU: it lowers for sm_90a as a 2-CTA
cluster kernel with the cluster-scope barrier operations; on a GPU: every tile arrives whole."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from test_backend_tilelang import needs_sm90

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.compile
def test_handoff_lowers_as_a_cluster_kernel():
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import dsmem_handoff
    kern = dsmem_handoff.compile_handoff()
    src = kern.get_kernel_source()
    for op in ("mapa.shared::cluster", "st.shared::cluster.v4.b32", "mbarrier.arrive.release.cluster.shared::cluster",
               "mbarrier.try_wait.parity.acquire.cluster", "fence.mbarrier_init.release.cluster",
               "barrier.cluster.arrive", "%cluster_nctarank"):
        assert op in src, op
    # the launch is a cluster launch of 2 CTAs along x
    assert '"cluster_dims": [2, 1, 1]' in kern.prim_func.script()


@pytest.mark.gpu
@needs_sm90
def test_gpu_handoff_tiles_arrive_whole(tmp_path):
    import json

    import dsmem_handoff
    out = tmp_path / "h.json"
    assert dsmem_handoff.main(["--pairs", "8", "--iters", "200", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] and all(r["cycles_per_handoff_median"] > 0 for r in res["rows"])
