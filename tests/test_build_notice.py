"""The notice a long kernel build prints (flashqla/_build_notice.py), and its use by the tilelang compile cache."""

from __future__ import annotations

import io
import time

import pytest

from flashqla import _build_notice as bn


def test_long_build_prints_start_and_end(monkeypatch):
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "0.05")
    out = io.StringIO()
    with bn.build_notice("tilelang", "fwd_intra_sm90", ("bfloat16", 128), stream=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("flashqla: building tilelang kernel fwd_intra_sm90 ('bfloat16', 128)")
    assert "built after" in lines[1]


def test_short_build_quiet_and_off_switch(monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "5")
    with bn.build_notice("tilelang", "k", (), stream=out):
        pass
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "off")
    with bn.build_notice("tilelang", "k", (), stream=out):
        time.sleep(0.1)
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "0.01")
    with bn.quiet(), bn.build_notice("tilelang", "k", (), stream=out):
        time.sleep(0.1)
    time.sleep(0.05)   # a timer that was not cancelled would have printed by now
    assert out.getvalue() == ""


def test_failed_build_says_failed(monkeypatch):
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "0.02")
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with bn.build_notice("cutlass", "chunk_fwd", (1,), stream=out):
            time.sleep(0.15)
            raise RuntimeError("boom")
    assert "cutlass kernel chunk_fwd failed after" in out.getvalue()


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "soon")
    with pytest.raises(ValueError, match="FLASHQLA_BUILD_NOTICE_S"):
        bn.notice_delay()


def test_tilelang_compile_cache_announces_a_slow_build(monkeypatch, capsys):
    """tilelang's get_kernel wraps its builds in the notice (a stand-in builder and compile, no TileLang work)."""
    tilelang = pytest.importorskip("tilelang")
    from flashqla.backends.tilelang import _compile
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "0.02")

    def slow_compile(func, out_idx=None, target=None):
        time.sleep(0.2)
        return ("compiled", func)

    monkeypatch.setattr(tilelang, "compile", slow_compile)
    monkeypatch.setattr(_compile, "_KERNELS", {})
    kern = _compile.get_kernel("notice_probe", lambda *key: ("built", key), ("x", 1))
    assert kern == ("compiled", ("built", ("x", 1)))
    err = capsys.readouterr().err
    assert "building tilelang kernel notice_probe ('x', 1)" in err and "built after" in err


def test_triton_first_launch_of_a_signature_gets_the_notice(monkeypatch, capsys):
    """triton compiles inside a launch: the first launch of a (kernel, constexprs) pair is wrapped, later ones
    are not (a stand-in kernel whose first call is slow)."""
    ops = pytest.importorskip("flashqla.backends.triton.ops")
    monkeypatch.setenv("FLASHQLA_BUILD_NOTICE_S", "0.02")
    monkeypatch.setattr(ops, "interpreting", lambda: False)
    calls = []

    class FakeKernel:
        __name__ = "fake_chunk_kernel"

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(kwargs)
                if len(calls) == 1:
                    time.sleep(0.2)     # the compile
            return run

    k = FakeKernel()
    ops.launch(k, (1,), 1, 2, BV=64, num_warps=4)
    ops.launch(k, (1,), 1, 2, BV=64, num_warps=4)
    err = capsys.readouterr().err
    assert err.count("building triton kernel fake_chunk_kernel") == 1 and "built after" in err
    assert len(calls) == 2


def test_triton_compile_error_names_the_kernel_and_its_constexprs(monkeypatch):
    """#11 item 6 for triton, whose kernels compile inside the launch: a compile error becomes a
    KernelBuildError naming the backend, the kernel and its constexprs (dispatch adds the call's shape)."""
    import ast
    ops = pytest.importorskip("flashqla.backends.triton.ops")
    from triton.compiler.errors import CompilationError

    from flashqla.dispatch.registry import KernelBuildError
    monkeypatch.setattr(ops, "interpreting", lambda: False)

    class BrokenKernel:
        __name__ = "broken_chunk_kernel"

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise CompilationError(None, ast.parse("x").body[0], "unsupported tile shape")
            return run

    with pytest.raises(KernelBuildError) as ei:
        ops.launch(BrokenKernel(), (1,), 1, BV=48, num_warps=4)
    msg = str(ei.value)
    assert "triton kernel broken_chunk_kernel failed to compile" in msg and "('BV', 48)" in msg
    assert "unsupported tile shape" in msg
