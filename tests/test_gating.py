"""gdn_gating: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), fused (Triton) and in PyTorch.

CPU: the PyTorch path against float64 formulas and torch.autograd.gradcheck; the Triton kernel under the
interpreter (``TRITON_INTERPRET=1``, set by conftest) against the same; bad inputs raise naming the argument.
GPU (``gpu`` marker): the kernel on CUDA, bf16 projections.
"""

from __future__ import annotations

import pytest
import torch

import flashqla
from flashqla.gating import gdn_gating_ref


def _inputs(B=2, T=37, Hv=6, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    A_log = (torch.rand(Hv, generator=gen) * 2.7726).to(dtype)           # up to log 16 (strong decay)
    dt_bias = torch.randn(Hv, generator=gen).to(dtype)
    a = (torch.randn(B, T, Hv, generator=gen) * 4).to(dtype)
    if T >= 2 and Hv >= 2:
        a[0, 0, 0] = 30.0                                                 # softplus past its threshold
        a[0, 1, 1] = -40.0
    b = (torch.randn(B, T, Hv, generator=gen) * 3).to(dtype)
    return [t.to(device) for t in (A_log, a, dt_bias, b)]


def _exact(A_log, a, dt_bias, b):
    x = a.double() + dt_bias.double()
    g = -torch.exp(A_log.double()) * torch.nn.functional.softplus(x)
    return g, torch.sigmoid(b.double())


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_float64(impl, dtype):
    A_log, a, dt_bias, b = _inputs(dtype=dtype)
    g, beta = flashqla.gdn_gating(A_log, a, dt_bias, b, impl=impl)
    gx, bx = _exact(A_log, a, dt_bias, b)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == a.shape
    assert torch.isfinite(g).all()
    assert torch.allclose(g.double(), gx, rtol=1e-5, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert torch.allclose(beta.double(), bx, rtol=0, atol=tol)
    g2, beta2 = flashqla.gdn_gating(A_log, a, dt_bias, b, impl=impl, beta_dtype=torch.float32)
    assert beta2.dtype == torch.float32 and torch.allclose(beta2.double(), bx, atol=1e-6)


def test_triton_kernel_equals_torch_path():
    A_log, a, dt_bias, b = _inputs(B=1, T=2000, Hv=8)        # several programs, a partial last block
    gt, bt = flashqla.gdn_gating(A_log, a, dt_bias, b, impl="triton")
    gr, br = flashqla.gdn_gating(A_log, a, dt_bias, b, impl="torch")
    assert torch.allclose(gt, gr, rtol=1e-6, atol=1e-6) and torch.allclose(bt, br, atol=1e-7)


def test_gradients_gradcheck_float64():
    A_log, a, dt_bias, b = [t.double().requires_grad_() for t in _inputs(B=1, T=5, Hv=3)]
    assert torch.autograd.gradcheck(lambda *x: flashqla.gdn_gating(*x), (A_log, a, dt_bias, b))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gradients_match_autograd_of_the_formulas(impl):
    leaves = [t.requires_grad_() for t in _inputs()]
    g, beta = flashqla.gdn_gating(*leaves, impl=impl)
    dg, dbeta = torch.randn_like(g), torch.randn_like(beta)
    got = torch.autograd.grad([g, beta], leaves, [dg, dbeta])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    gr, br = gdn_gating_ref(*ref_leaves)
    want = torch.autograd.grad([gr, br], ref_leaves, [dg.double(), dbeta.double()])
    for n, x, y in zip(("A_log", "a", "dt_bias", "b"), got, want):
        assert torch.allclose(x.double(), y, rtol=1e-4, atol=1e-5), n
    # only one output used: the other's gradient is None, not an error
    (da,) = torch.autograd.grad(flashqla.gdn_gating(*leaves, impl=impl)[1].sum(), [leaves[3]])
    assert torch.isfinite(da).all()


def test_empty_and_2d_inputs():
    A_log, a, dt_bias, b = _inputs(B=1, T=0, Hv=4)
    g, beta = flashqla.gdn_gating(A_log, a, dt_bias, b)
    assert g.shape == (1, 0, 4) and beta.shape == (1, 0, 4)
    A_log, a, dt_bias, b = _inputs(B=1, T=9, Hv=4)
    g2, _ = flashqla.gdn_gating(A_log, a[0], dt_bias, b[0])               # [T, Hv] (packed varlen layout)
    assert torch.allclose(g2, flashqla.gdn_gating(A_log, a, dt_bias, b)[0][0])


def test_bad_inputs_name_the_argument():
    A_log, a, dt_bias, b = _inputs(Hv=4)
    with pytest.raises(ValueError, match="A_log must be \\[Hv\\]"):
        flashqla.gdn_gating(A_log[:3], a, dt_bias, b)
    with pytest.raises(ValueError, match="dt_bias"):
        flashqla.gdn_gating(A_log, a, dt_bias[None], b)
    with pytest.raises(ValueError, match="same shape"):
        flashqla.gdn_gating(A_log, a, dt_bias, b[:, :5])
    with pytest.raises(TypeError, match="b must be a floating"):
        flashqla.gdn_gating(A_log, a, dt_bias, b.to(torch.int32))
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        flashqla.gdn_gating(A_log, [1.0], dt_bias, b)
    with pytest.raises(ValueError, match="impl"):
        flashqla.gdn_gating(A_log, a, dt_bias, b, impl="cuda")


def test_output_feeds_the_op():
    # the intended use: gating then the chunk op, gradients through both
    A_log, a, dt_bias, b = [t.requires_grad_() for t in _inputs(B=1, T=70, Hv=2)]
    q = torch.nn.functional.normalize(torch.randn(1, 70, 1, 32), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, 70, 1, 32), dim=-1)
    v = torch.randn(1, 70, 2, 32)
    g, beta = flashqla.gdn_gating(A_log, a, dt_bias, b)
    o, _ = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, backend="reference")
    grads = torch.autograd.grad(o.square().sum(), [A_log, a, dt_bias, b])
    assert all(torch.isfinite(x).all() for x in grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_bf16():
    A_log, a, dt_bias, b = _inputs(B=2, T=4096, Hv=32, dtype=torch.bfloat16, device="cuda")
    g, beta = flashqla.gdn_gating(A_log, a, dt_bias, b)
    gx, bx = _exact(A_log, a, dt_bias, b)
    assert torch.allclose(g.double(), gx, rtol=1e-5, atol=1e-5)
    assert torch.allclose(beta.double(), bx, atol=4e-3)


@pytest.mark.compile
def test_kernel_compiles_for_sm90_and_sm80():
    # the real compiler (not the interpreter), in a subprocess without TRITON_INTERPRET
    import os
    import subprocess
    import sys

    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("the triton wheel ships no ptxas here")
    code = (
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from flashqla.gating import _get_kernel\n"
        "sig = {'A_log_ptr': '*fp32', 'a_ptr': '*bf16', 'dt_ptr': '*fp32', 'b_ptr': '*bf16', 'g_ptr': '*fp32',\n"
        "       'beta_ptr': '*bf16', 'numel': 'i64', 'Hv': 'i32', 'threshold': 'fp32', 'BLOCK': 'constexpr'}\n"
        "for arch in (90, 80):\n"
        "    ck = triton.compile(ASTSource(_get_kernel(), sig, constexprs={'BLOCK': 1024}),\n"
        "                        target=GPUTarget('cuda', arch, 32), options=dict(num_warps=4))\n"
        "    print(arch, 'ok', len(ck.asm['cubin']))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(" ok ") == 2, proc.stdout
