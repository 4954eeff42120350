"""Building and loading the native kernels (kvjax.native): the build key follows the
jaxlib version and its XLA FFI headers, and a library whose first real call fails (or
gives a wrong answer) is refused at load time with a warning, so kvjax falls back to XLA
instead of failing at the first real call."""

import pathlib
import shutil
import subprocess

import jax.ffi
import jaxlib
import pytest

from kvjax import native
from kvjax.native import prefill, rows_matmul

BAD_SOURCE = r"""
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
// Loads and registers, then fails at its first call (as a library built for another
// jaxlib's FFI can) or, for rows_matmul, returns zeros (a wrong answer).
static ffi::Error Fail() { return ffi::Error(ffi::ErrorCode::kInternal, "bad build"); }
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDecodeAttention, Fail, ffi::Ffi::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPagedDecodeAttention, Fail, ffi::Ffi::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxPrefillAttention, Fail, ffi::Ffi::Bind());
static ffi::Error Zeros(ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                        ffi::ResultBuffer<ffi::F32> out, int64_t, int64_t, int64_t, int64_t) {
  for (size_t i = 0; i < out->element_count(); ++i) out->typed_data()[i] = 0.f;
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmul, Zeros,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("w_nk").Attr<int64_t>("threads")
        .Attr<int64_t>("split").Attr<int64_t>("lanes"));
static ffi::Error Zeros8(ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S8>,
                         ffi::ResultBuffer<ffi::F32> out, int64_t, int64_t) {
  for (size_t i = 0; i < out->element_count(); ++i) out->typed_data()[i] = 0.f;
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmulInt8, Zeros8,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S8>>()
        .Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("q_nk").Attr<int64_t>("threads"));
static ffi::Error ZerosNorm(ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                            ffi::Buffer<ffi::F32>, ffi::ResultBuffer<ffi::F32> out, int64_t,
                            int64_t, int64_t, int64_t, float) {
  for (size_t i = 0; i < out->element_count(); ++i) out->typed_data()[i] = 0.f;
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxRowsMatmulNorm, ZerosNorm,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("w_nk")
        .Attr<int64_t>("threads").Attr<int64_t>("split").Attr<int64_t>("lanes")
        .Attr<float>("eps"));
"""


def _keyed_path(monkeypatch, tmp_path) -> pathlib.Path:
    """build_library's output path for rows_matmul.cc, with the compile stubbed out."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_build", lambda out, cxx, source, flags=(): None)
    monkeypatch.setattr(native, "_compiler", lambda: "/usr/bin/true")
    return native.build_library(rows_matmul.SOURCE, "kvjax_rows_matmul")


def test_build_key_follows_the_jaxlib_version_and_its_ffi_headers(monkeypatch, tmp_path):
    base = _keyed_path(monkeypatch, tmp_path)
    assert _keyed_path(monkeypatch, tmp_path) == base  # stable when nothing changes
    with monkeypatch.context() as m:
        m.setattr(jaxlib, "__version__", jaxlib.__version__ + ".other")
        other_version = _keyed_path(monkeypatch, tmp_path)
    assert other_version != base and other_version.name == base.name
    # the same jaxlib version string, FFI headers of another build
    headers = tmp_path / "include"
    shutil.copytree(jax.ffi.include_dir(), headers)
    assert _keyed_path(monkeypatch, tmp_path) == base
    ffi_h = next(headers.rglob("ffi.h"))
    with monkeypatch.context() as m:
        m.setattr(jax.ffi, "include_dir", lambda: str(headers))
        assert _keyed_path(monkeypatch, tmp_path) == base  # a faithful copy: same key
        ffi_h.write_text(ffi_h.read_text() + "\n// another jaxlib\n")
        other_headers = _keyed_path(monkeypatch, tmp_path)
    assert other_headers not in (base, other_version)
    assert len({p.parent.name for p in (base, other_version, other_headers)}) == 3


@pytest.fixture(scope="module")
def bad_library(tmp_path_factory) -> pathlib.Path:
    cxx = native._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("bad")
    (d / "bad.cc").write_text(BAD_SOURCE)
    out = d / "libbad.so"
    subprocess.run([cxx, "-O1", "-fPIC", "-shared", "-std=c++17", "-w",
                    f"-I{jax.ffi.include_dir()}", str(d / "bad.cc"), "-o", str(out)],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.parametrize("module,what", [
    (native, r"kvjax native kernels unavailable \(its smoke call failed: .*bad build"),
    (prefill, r"kvjax native prefill attention unavailable \(its smoke call failed: "
              r".*bad build"),
    (rows_matmul, r"kvjax rows_matmul unavailable \(its smoke call failed: rows_matmul's "
                  r"smoke call \(kn\) gave \[0.0"),
], ids=["decode_attention", "prefill", "rows_matmul"])
def test_a_library_whose_smoke_call_fails_is_not_used(module, what, bad_library,
                                                      monkeypatch):
    monkeypatch.setenv("KVJAX_NATIVE", "1")
    monkeypatch.setattr(module, "library_path", lambda: bad_library)
    monkeypatch.setattr(module, "_state", {})
    # a fresh FFI target name: the real kernel may be registered in this process already
    monkeypatch.setattr(module, "TARGET", f"kvjax_test_bad_{module.__name__.split('.')[-1]}")
    if module is native:
        monkeypatch.setattr(module, "PAGED_TARGET", "kvjax_test_bad_paged")
    if module is rows_matmul:
        monkeypatch.setattr(module, "TARGET_INT8", "kvjax_test_bad_rows_matmul_int8")
        monkeypatch.setattr(module, "TARGET_NORM", "kvjax_test_bad_rows_matmul_norm")
    with pytest.warns(UserWarning, match=what):
        assert module.load() is False
    assert module.load() is False  # the answer is kept: one warning per process
    if module is rows_matmul:
        import jax.numpy as jnp  # noqa: PLC0415
        with pytest.raises(RuntimeError, match="could not be built or loaded"):
            rows_matmul.rows_matmul(jnp.ones((2, 8)), jnp.ones((8, 4)))


def test_the_real_libraries_pass_their_smoke_calls(monkeypatch, tmp_path):
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    import warnings  # noqa: PLC0415
    monkeypatch.setenv("KVJAX_NATIVE", "1")
    monkeypatch.setattr(rows_matmul, "_state", {})
    ran = []
    smoke = rows_matmul._smoke
    monkeypatch.setattr(rows_matmul, "_smoke", lambda: (ran.append(1), smoke()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rows_matmul.load() is True
    assert ran == [1]
