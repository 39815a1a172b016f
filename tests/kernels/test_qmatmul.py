"""qkv's quantised products (qkv/kernels/qmatmul.cpp: 4-bit and 8-bit groups) on every code
path it has (AVX512-VNNI, AVX2 with and without AVX-VNNI, plain C++), against two references
written here: the kernel's arithmetic emulated in float64 from its definition (activations to
int8 plus an int8 residual per group of 32, the weights' float16 scales), and the exact float64
product x·Wᵀ within the bound the activations' rounding allows, derived by hand. Plus the build:
keyed, checked, rebuilt when damaged, and PyTorch's kernels where qkv's are switched off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cpu_flags, kernel_builds, loaded_kernels, run_folder, sampling_intervals

import qkv.kernels as K
from qkv.kernels import compile_library, pack_int4
from qkv.native import NativeError, compiler

pytestmark = pytest.mark.skipif(compiler() is None or K.int4_op() is None,
                                reason=f"qkv's kernels are not available here: {K.int4_status()}")


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every code path's namespace: this CPU's library ("native": ``qkv``) and the other builds'
    (helpers.kernel_builds)."""
    assert K.int4_op() is not None, K.int4_status()
    return {"native": "qkv", **kernel_builds(run_folder(tmp_path_factory, "kernel-builds"))}


@pytest.fixture(scope="module")
def paths(namespaces: dict[str, str]) -> dict[str, object]:
    """Every code path as its own op: this CPU's (the library qkv builds and loads), AVX2 and
    plain C++ (built here for older CPUs under namespaces of their own; AVX2 is this CPU's own
    library where that takes the AVX2 path)."""
    return {name: getattr(torch.ops, ns).int4_mm for name, ns in namespaces.items()}


def every_namespace(namespaces: dict[str, str]) -> list[str]:
    """Each build's namespace once (the AVX2 build may be this CPU's own library)."""
    return list(dict.fromkeys(namespaces.values()))


def test_each_build_runs_the_code_path_it_names(paths: dict[str, object], namespaces: dict[str, str]) -> None:
    for name, path in (("avx2", "avx2"), ("avx2_vnni", "avx2-vnni"), ("scalar", "scalar")):
        assert name not in namespaces or getattr(torch.ops, namespaces[name]).int4_path() == path
    assert "scalar" in namespaces
    flags = cpu_flags()
    want = ("avx512-vnni" if {"avx512_vnni", "avx512bw", "avx512f"} <= flags
            else "avx2" if {"avx2", "f16c", "fma"} <= flags else "scalar")
    if want == "avx512-vnni" and {"amx_tile", "amx_int8"} <= flags:
        want += "+amx"  # several rows' 4-bit products on AMX tiles
    got = torch.ops.qkv.int4_path()
    if want == "avx2" and "avx_vnni" in flags and got == "avx2-vnni":
        want = got  # -march=native with AVX-VNNI (a compiler that knows it: GCC 11 and later)
    assert got == want
    assert K.int4_status() == f"qkv's ({want})"


def test_the_avx_vnni_build_gives_the_avx2_builds_numbers(namespaces: dict[str, str], tmp_path) -> None:
    """AVX2 with AVX-VNNI (``-mavxvnni``; what ``-march=native`` compiles on Intel's Alder Lake and
    later cores): one vpdpbusd or vpdpwssd where AVX2 takes vpmaddubsw, vpmaddwd and an add, the
    same integers, so int4_mm and q8_mm give the AVX2 build's floats bit for bit, one row (8-bit
    products) and several (16-bit ones). Built and named on any x86-64 CPU with AVX2; its products
    run where this CPU has AVX-VNNI (elsewhere they would be illegal instructions)."""
    flags = cpu_flags()
    assert {"avx2", "f16c", "fma"} <= flags and "avx2" in namespaces  # every CPU qkv is tested on
    if "avx2_vnni" not in namespaces:  # (kernel_builds builds it where this CPU runs it) built, named
        # its products are not run here: -O0 (after the -O3 it overrides) halves the compile (~11 s)
        compile_library(tmp_path / "vnni.so", ("-march=haswell", "-mavxvnni", "-O0"), namespace="vnni_check")
        torch.ops.load_library(str(tmp_path / "vnni.so"))
        assert torch.ops.vnni_check.int4_path() == "avx2-vnni"
        assert "avx_vnni" not in flags
        return
    avx2, vnni = (getattr(torch.ops, namespaces[n]) for n in ("avx2", "avx2_vnni"))
    assert (avx2.int4_path(), vnni.int4_path()) == ("avx2", "avx2-vnni")
    g = torch.Generator().manual_seed(5)
    for N, Kd in ((64, 576), (96, 1536)):
        q, d, m, _ = _problem(N, Kd, 1, seed=N + Kd)
        w, dm = pack_int4(q, d, m)
        w8, s8 = K.pack_q8(torch.randint(-127, 128, (N, Kd), generator=g), d)
        for M in (1, 2, 5, 17):
            x = torch.randn(M, Kd, generator=g)
            x[:, ::37] *= 40
            assert torch.equal(vnni.int4_mm(x, w, dm), avx2.int4_mm(x, w, dm)), (N, Kd, M)
            assert torch.equal(vnni.q8_mm(x, w8, s8), avx2.q8_mm(x, w8, s8)), (N, Kd, M)


def _problem(N: int, Kd: int, M: int, seed: int, outliers: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, Kd), generator=g)
    d = torch.rand(N, Kd // 32, generator=g) * 0.05 + 0.005
    m = torch.randn(N, Kd // 32, generator=g) * 0.1
    x = torch.randn(M, Kd, generator=g)
    if outliers:  # a real model's activations: a few channels far larger than the rest
        x[:, :: 37] *= 40
    if M > 1:
        x[-1, :32] = 0  # a group of zeros (scale 0)
    return q, d, m, x


def _emulate(q: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor, x: torch.Tensor):
    """The kernel's definition in float32 steps where it rounds, summed in float64."""
    M, Kd = x.shape
    G = Kd // 32
    xg = x.float().view(M, G, 32)
    dx = xg.abs().amax(-1) / 127  # float32, as the kernel
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    u = xg * inv[..., None]
    c = torch.round(u)  # half to even, as nearbyint
    r = torch.clamp(torch.round((u - c) * 256), -127, 127)
    sx = xg.double().sum(-1)  # (M, G)
    qg = q.double().view(-1, G, 32)  # (N, G, 32)
    dot = torch.einsum("ngi,mgi->mng", qg, c.double() * 256 + r.double())  # exact integers
    y = (dot * (d16.double() * (dx.double() / 256)[:, None, :])).sum(-1)
    y = y + (m16.double() * sx[:, None, :]).sum(-1)
    return y, dx


@pytest.mark.parametrize("path", ["native", "avx2", "scalar"])
@pytest.mark.parametrize(("N", "Kd", "M"), [(16, 32, 1), (48, 64, 3), (96, 576, 1), (32, 1536, 17),
                                            (64, 576, 37)])
@pytest.mark.parametrize("outliers", [False, True])
def test_int4_mm_is_its_definition_and_close_to_the_exact_product(
        paths: dict[str, object], path: str, N: int, Kd: int, M: int, outliers: bool) -> None:
    if path not in paths:
        pytest.skip("this CPU cannot run the AVX2 build")
    q, d, m, x = _problem(N, Kd, M, seed=N + Kd + M, outliers=outliers)
    w, dm = pack_int4(q, d, m)
    y = paths[path](x, w, dm).double()
    assert y.shape == (M, N)
    d16, m16 = d.half(), m.half()
    ref, dx = _emulate(q, d16, m16, x)
    W = (q.double().view(N, -1, 32) * d16.double()[..., None] + m16.double()[..., None]).view(N, Kd)
    scale = x.double().abs() @ W.abs().T  # (M, N): the size of the sums, for float32 rounding
    assert ((y - ref).abs() <= 2e-6 * scale + 1e-9).all(), (y - ref).abs().max()
    # The exact product of x with the float16 d, m matrix: each activation is carried to within
    # dx/256 of its group's scale (dx/512 unless the residual is clipped at ±127).
    exact = x.double() @ W.T
    bound = (W.abs().view(N, -1, 32).sum(-1) @ (dx.double() / 256).T).T  # (M, N)
    assert ((y - exact).abs() <= bound + 2e-6 * scale + 1e-9).all()
    assert (bound <= 0.01 * scale + 1e-9).all()  # and that bound is small: ~2^-8 of the sums


@pytest.mark.parametrize("path", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("op", ["int4_mm", "q8_mm"])
def test_each_row_of_a_batched_product_is_that_row_alone_bit_for_bit(
        namespaces: dict[str, str], path: str, op: str) -> None:
    """A running batch decodes each row as it would alone: the AVX2 path multiplies several rows
    by 16-bit products (256·xq + xr in one) and one row by 8-bit ones; on an AMX Xeon, 12 rows
    and more take tiles (16-row chunks, the last padded); the integers, and so the floats, must be
    the same."""
    if path not in namespaces:
        pytest.skip("this CPU cannot run the AVX2 build")
    q, d, m, x = _problem(64, 1536, 37, seed=7, outliers=True)
    x[2] = 0  # a row of zeros beside the others
    if op == "int4_mm":
        w, scales = pack_int4(q, d, m)
    else:
        w, scales = K.pack_q8(q - 8, d)  # codes -8..7 stand in for Q8_0's -127..127 here
        codes = torch.randint(-127, 128, (64, 1536), generator=torch.Generator().manual_seed(3))
        w8, s8 = K.pack_q8(codes, d)
    f = getattr(getattr(torch.ops, namespaces[path]), op)
    pairs = [(w, scales)] if op == "int4_mm" else [(w, scales), (w8, s8)]
    for wp, sp in pairs:
        together = f(x, wp, sp)
        for M in (2, 3, 8, 12, 16, 17):  # AVX2's 16-bit and AVX-512's rows, AMX's tiles (16-row chunks)
            assert torch.equal(f(x[:M].contiguous(), wp, sp), together[:M])
        for i in range(len(x)):
            assert torch.equal(f(x[i : i + 1].contiguous(), wp, sp)[0], together[i]), i


def test_bf16_activations_are_read_as_their_float_values(paths: dict[str, object]) -> None:
    q, d, m, x = _problem(32, 64, 2, seed=7)
    w, dm = pack_int4(q, d, m)
    for op in paths.values():
        torch.testing.assert_close(op(x.bfloat16(), w, dm), op(x.bfloat16().float(), w, dm), rtol=0, atol=0)


def test_the_kernel_refuses_what_it_cannot_read(paths: dict[str, object]) -> None:
    q, d, m, x = _problem(32, 64, 1, seed=8)
    w, dm = pack_int4(q, d, m)
    op = paths["native"]
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.randn(1, 32), w, dm)
    with pytest.raises(RuntimeError, match="float16"):
        op(x, w, dm.float())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.double(), w, dm)
    with pytest.raises(ValueError, match="N % 16"):
        pack_int4(q[:8], d[:8], m[:8])


def test_pack_int4_puts_each_code_where_the_layout_says() -> None:
    """Byte 4j + b of chunk c of group g of block nb: row 16·nb + j, input 32g + 8c + b in the
    low nibble and 32g + 8c + 4 + b in the high one (qmatmul.cpp's layout, read back by hand)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=g)
    d, m = torch.rand(32, 2, generator=g), torch.randn(32, 2, generator=g)
    w, dm = pack_int4(q, d, m)
    assert w.shape == (2, 2, 4, 64) and dm.shape == (2, 2, 2, 16) and dm.dtype == torch.float16
    for nb, gi, c, j, b in [(0, 0, 0, 0, 0), (1, 1, 3, 15, 3), (0, 1, 2, 7, 1), (1, 0, 1, 9, 2)]:
        byte = int(w[nb, gi, c, 4 * j + b])
        n, k = 16 * nb + j, 32 * gi + 8 * c + b
        assert byte & 0xF == int(q[n, k]) and byte >> 4 == int(q[n, k + 4])
        assert dm[nb, gi, 0, j] == d[n, gi].half() and dm[nb, gi, 1, j] == m[n, gi].half()


def test_the_library_is_built_once_checked_and_rebuilt_when_damaged(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In an empty cache: compiled once, found the next time, and refused and compiled again when
    damaged. What the compiler gives is the library this process loaded (compiled for real with
    -march=native, K.int4_op()), copied: two more compiles would add ~40 s on a Zen 3."""
    assert K.int4_op() is not None
    built = loaded_kernels()
    assert built is not None
    made_by_the_session = built / K.LIBRARY
    compiled: list[tuple[str, ...]] = []

    def compile_(out: Path, flags: tuple[str, ...] = (), **kwargs: object) -> None:
        compiled.append(tuple(flags))
        out.write_bytes(made_by_the_session.read_bytes())

    monkeypatch.setattr(K, "compile_library", compile_)
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    lib = K.build()
    assert compiled == [("-march=native",)]
    assert lib.parent.parent == tmp_path / "kernels" and (tmp_path / "kernels").stat().st_mode & 0o077 == 0
    meta = json.loads((lib.parent / K.META).read_text())
    assert meta["info"]["cpu"]["flags"] and meta["info"]["torch"] == torch.__version__
    made = lib.stat().st_mtime_ns
    assert K.build() == lib and lib.stat().st_mtime_ns == made and len(compiled) == 1  # found, not rebuilt
    lib.write_bytes(lib.read_bytes()[:1000])  # damaged: refused, rebuilt
    assert K.build() == lib and lib.stat().st_size > 1000 and len(compiled) == 2
    assert K.sha256(lib) == json.loads((lib.parent / K.META).read_text())["sha256"]


def test_without_the_kernel_the_layer_uses_pytorchs(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.layers.quant import Int4Linear

    monkeypatch.setattr(K, "_state", {"op": None, "status": None})
    monkeypatch.setenv("QKV_INT4_KERNEL", "off")
    assert K.int4_op() is None and K.int4_status() == "PyTorch's (QKV_INT4_KERNEL=off)"
    q, d, m, _ = _problem(32, 64, 1, seed=9)
    assert Int4Linear(q, d, m + 8 * d, 32).kernel == "aten"
    with pytest.raises(ValueError, match="not available"):
        Int4Linear(q, d, m + 8 * d, 32, kernel="qkv")
    monkeypatch.setattr(K, "_state", {"op": None, "status": None})
    monkeypatch.setenv("QKV_INT4_KERNEL", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", "off")
    monkeypatch.setattr(K, "_loaded", lambda: False)  # as in a fresh process
    op, status = K._load()
    assert op is None and status.startswith("PyTorch's (qkv's could not be built: qkv's cache is off")


def test_a_compiler_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K, "SOURCE", tmp_path / "broken.cpp")
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    with pytest.raises(NativeError, match="the compiler failed"):
        compile_library(tmp_path / "x.so")


# ---------------------------------------------------------------- 8-bit groups (GGUF's Q8_0)


def _emulate8(q: torch.Tensor, d16: torch.Tensor, x: torch.Tensor):
    M, Kd = x.shape
    G = Kd // 32
    xg = x.float().view(M, G, 32)
    dx = xg.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    u = xg * inv[..., None]
    c = torch.round(u)
    r = torch.clamp(torch.round((u - c) * 256), -127, 127)
    dot = torch.einsum("ngi,mgi->mng", q.double().view(-1, G, 32), c.double() * 256 + r.double())
    return (dot * (d16.double() * (dx.double() / 256)[:, None, :])).sum(-1), dx


@pytest.mark.parametrize("path", ["native", "avx2", "scalar"])
@pytest.mark.parametrize(("N", "Kd", "M"), [(16, 32, 1), (48, 64, 3), (96, 576, 1), (32, 1536, 17),
                                            (64, 576, 37)])
def test_q8_mm_is_its_definition_and_close_to_the_exact_product(
        namespaces: dict[str, str], path: str, N: int, Kd: int, M: int) -> None:
    if path not in namespaces:
        pytest.skip("this CPU cannot run the AVX2 build")
    g = torch.Generator().manual_seed(N * Kd + M)
    q = torch.randint(-127, 128, (N, Kd), generator=g)
    q[0, :32] = -127  # the extremes of the codes
    q[-1, -32:] = 127
    d = torch.rand(N, Kd // 32, generator=g) * 0.01 + 1e-4
    x = torch.randn(M, Kd, generator=g)
    x[:, ::37] *= 40
    op = getattr(torch.ops, namespaces[path]).q8_mm
    w, ds = K.pack_q8(q, d)
    y = op(x, w, ds).double()
    d16 = d.half()
    ref, dx = _emulate8(q, d16, x)
    W = (q.double().view(N, -1, 32) * d16.double()[..., None]).view(N, Kd)
    scale = x.double().abs() @ W.abs().T
    assert ((y - ref).abs() <= 2e-6 * scale + 1e-9).all(), (y - ref).abs().max()
    bound = (W.abs().view(N, -1, 32).sum(-1) @ (dx.double() / 256).T).T
    assert ((y - x.double() @ W.T).abs() <= bound + 2e-6 * scale + 1e-9).all()


def test_q8_linear_holds_a_q8_0_files_own_blocks() -> None:
    """gguf's own Q8_0 quantiser and dequantiser as the reference: the layer built from the
    dequantised matrix holds its codes and float16 scales bit for bit."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from qkv.layers.quant import Q8Linear

    kind = gguf.GGMLQuantizationType.Q8_0
    a = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    raw = gguf.quants.quantize(a, kind)
    w = gguf.quants.dequantize(raw, kind)
    layer = Q8Linear.from_float(torch.from_numpy(w))
    np.testing.assert_array_equal(layer.dequantize().numpy(), w)
    blocks = raw.reshape(-1, 34)  # [d f16][32 int8]
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    np.testing.assert_array_equal(layer.ds.permute(0, 2, 1).reshape(-1).numpy(), d)
    x = torch.randn(3, 128)
    W = torch.from_numpy(w).double()
    exact = x.double() @ W.T
    dx = x.double().view(3, 4, 32).abs().amax(-1) / 127  # each group's activation step
    bound = (W.abs().view(64, 4, 32).sum(-1) @ (dx / 256).T).T  # (3, 64): to dx/256 per value
    assert ((layer(x).double() - exact).abs() <= bound + 1e-6 * (x.double().abs() @ W.abs().T)).all()


def test_a_nan_or_inf_activation_gives_nan_not_a_number_that_looks_right(namespaces: dict[str, str]) -> None:
    """A float product with a NaN (or an inf) in x is NaN where that value counts; so is this one's,
    on both kernels and every path (a NaN must not be rounded to a plausible int8 code)."""
    q, d, m, x = _problem(32, 64, 3, seed=11)
    w4, dm = pack_int4(q, d, m)
    w8, ds = K.pack_q8(q.to(torch.int64) - 8, d)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    for name in namespaces:
        ns = getattr(torch.ops, namespaces[name])
        for y in (ns.int4_mm(x, w4, dm), ns.q8_mm(x, w8, ds)):
            assert y[0].isnan().all() and y[1].isnan().all() and y[2].isfinite().all(), name


def _argmax_rows_cases() -> torch.Tensor:
    """Rows where a maximum-then-find argmax could go wrong: ties (the first wins), NaN (torch.argmax
    takes the first NaN as the largest, also after a larger value), +inf beside -inf (their sum is
    NaN, no NaN present), all -inf, the maximum in the tail after the vector lanes."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 1000, generator=g)  # 1000 = 62 vectors of 16 and a tail of 8
    x[0, [3, 700, 999]] = 50.0
    x[1, [20, 21]] = 50.0
    x[2, 500] = float("nan")
    x[2, 100] = float("inf")
    x[3, [10, 600]] = float("nan")
    x[4, 7] = float("inf")
    x[4, 8] = float("-inf")
    x[5] = float("-inf")
    x[6, 997] = 60.0
    x[7, 0] = float("nan")
    x[8] = 0.5
    return x


def test_argmax_rows_is_torch_argmax_on_every_path(namespaces: dict[str, str]) -> None:
    """qkv::argmax_rows (greedy decoding's choice) on each build: the index torch.argmax gives."""
    x = _argmax_rows_cases()
    want = x.argmax(dim=-1)
    assert want.tolist()[:4] == [3, 20, 500, 10]  # the cases are what they say
    for ns in every_namespace(namespaces):
        got = getattr(torch.ops, ns).argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, want), ns
        for row in range(x.shape[0]):  # one row at a time, and rows of every length up to 40
            assert int(getattr(torch.ops, ns).argmax_rows(x[row : row + 1])[0]) == int(want[row]), (ns, row)
        for n in range(1, 41):
            y = torch.randn(2, n, generator=torch.Generator().manual_seed(n))
            assert torch.equal(getattr(torch.ops, ns).argmax_rows(y), y.argmax(dim=-1)), (ns, n)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.qkv.argmax_rows(x.double())


def _sampling_cases() -> list[tuple[str, torch.Tensor, float, int, float | None]]:
    """(name, row, temperature, top_k (0: off), top_p): each branch of qkv::sample_rows."""
    g = torch.Generator().manual_seed(9)
    ties = (torch.randint(0, 8, (640,), generator=g) / 2).float()  # many logits equal at the k-th
    masked = torch.randn(300, generator=g)
    masked[::7] = float("-inf")  # never drawn
    huge_t = torch.zeros(256)  # at T 1e10: z of 1e-10, 0 and -0 (a tie), below the pre-filter's old bound
    huge_t[:128], huge_t[0] = -5e-36, 1.0
    huge_t_b = torch.full((256,), -5e-36)
    huge_t_b[:128], huge_t_b[0] = -1.0, 1.0
    overflow = torch.zeros(128)  # finite, but a vector lane's sum overflows to +inf and another's to -inf
    overflow[[0, 16]], overflow[[1, 17]] = 3e38, -3e38
    return [
        ("no filter, V not whole blocks", torch.randn(1000, generator=g), 0.7, 0, None),
        ("top-k past the blocks' count", torch.randn(1000, generator=g), 1.3, 50, None),
        ("top-k from block maxima, SmolLM2's V", torch.randn(49152, generator=g) * 2, 0.8, 200, None),
        ("top-k then top-p", torch.randn(49152, generator=g) * 2, 0.8, 200, 0.9),
        ("top-k 5 of 32 blocks", torch.randn(4096, generator=g), 1.0, 5, None),
        ("ties at the k-th and at top-p's end", ties, 1.0, 37, 0.5),
        ("peaked top-p, no top-k", torch.randn(5000, generator=g) * 8, 1.0, 0, 0.95),
        ("flat top-p, no top-k", torch.randn(3000, generator=g) * 0.1, 1.0, 0, 0.3),
        ("-inf logits", masked, 1.0, 0, None),
        ("-inf logits and top-k", masked, 1.0, 290, None),
        ("top-k V-1", torch.randn(129, generator=g), 2.0, 128, 0.99),
        ("top-k >= V is off", torch.randn(5, generator=g), 1.0, 7, None),
        ("one logit", torch.tensor([3.0]), 1.0, 1, 0.5),
        ("top-p's mass reached exactly: the rest dropped", torch.zeros(4), 1.0, 0, 0.5),
        ("-0 and +0 tie at top-p's end (lower ids first)", torch.tensor([-0.0, 0.0, -0.0, 0.0]), 1.0, 0, 0.5),
        ("T 1e10: -0, 0 and a denormal z, all ties kept", huge_t, 1e10, 2, None),
        ("T 1e10: the k-th is -0, 128 ties", huge_t_b, 1e10, 2, None),
        ("lanes' sums overflowing in a finite row", overflow, 1.0, 0, None),
    ]


def test_sample_rows_draws_each_u_from_its_interval_on_every_path(namespaces: dict[str, str]) -> None:
    """qkv::sample_rows (sampling's filter and draw in one call) on each build, against the
    intervals of [0, 1) each kept token owns, computed in float64 from the definitions: a grid of u
    and each interval's middle draw the id whose interval holds u (u within 1e-6 of an end may go
    either way: the kernel's weights are float32), and no dropped id is ever drawn."""
    for ns in every_namespace(namespaces):
        op = getattr(torch.ops, ns).sample_rows
        for name, row, T, k, p in _sampling_cases():
            ids, ends = sampling_intervals(row, T, k, p)
            starts = [0.0, *ends[:-1]]
            middles = ((a + b) / 2 for a, b in zip(starts, ends, strict=True))
            u = torch.tensor(sorted({*(i / 2048 for i in range(2048)), *middles, 1.0 - 2.0**-53}),
                             dtype=torch.float64)
            got = op(row.expand(len(u), -1).contiguous(), T, k, 1.0 if p is None else p, u).tolist()
            at = torch.searchsorted(torch.tensor(ends, dtype=torch.float64), u, right=True).tolist()
            for ui, g_id, j in zip(u.tolist(), got, at, strict=True):
                near = min(abs(ui - e) for e in (starts[j], ends[j]))
                assert g_id == ids[j] or (near < 1e-6 and g_id in ids), (ns, name, ui, g_id, ids[j])
            wide = [i for i, a, b in zip(ids, starts, ends, strict=True) if b - a > 1e-5]
            assert set(wide) <= set(got), (ns, name)  # each kept id of any weight is drawn


def test_sample_rows_refuses_what_is_no_distribution(namespaces: dict[str, str]) -> None:
    """A NaN, +inf (alone or beside -inf), every logit -inf, or logits / T past float32's range:
    PyTorch's softmax is NaN there, and the op says so (sample_next then takes PyTorch's path,
    whose error names the problem); bad shapes and types are refused."""
    u = torch.zeros(1, dtype=torch.float64)
    rows = {"nan": [0.0, float("nan"), 1.0], "+inf": [0.0, float("inf"), 1.0],
            "+inf beside -inf": [float("-inf"), float("inf")], "all -inf": [float("-inf")] * 3,
            "overflow": [3e38, 0.0]}
    for ns in every_namespace(namespaces):
        op = getattr(torch.ops, ns).sample_rows
        for name, row in rows.items():
            for k, p in ((0, 1.0), (1, 1.0), (0, 0.5)):
                T = 0.5 if name == "overflow" else 1.0
                with pytest.raises(ValueError, match="not a distribution"):
                    op(torch.tensor([row]), T, k, p, u)
                    pytest.fail(f"{ns} {name} {k} {p}")
        x = torch.zeros(2, 4)
        u2 = torch.zeros(2, dtype=torch.float64)
        for bad in ((x.double(), 1.0, u2), (x, 1.0, u), (x, 0.0, u2), (x[:, ::2], 1.0, u2)):
            with pytest.raises(RuntimeError, match="sample_rows"):
                op(bad[0], bad[1], 0, 1.0, bad[2])


def test_greedy_argmax_takes_the_kernel_where_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """qkv.nn.top.argmax_last calls the loaded library's op (counted), and gives torch.argmax's
    index either way; a float64 row takes PyTorch's."""
    import qkv.nn.top as top

    calls = []
    real = K.argmax_op()
    assert real is not None
    monkeypatch.setattr(top, "argmax_op", lambda: lambda x: calls.append(x) or real(x))
    x = _argmax_rows_cases()
    assert torch.equal(top.argmax_last(x), x.argmax(dim=-1)) and len(calls) == 1
    assert torch.equal(top.argmax_last(x.double()), x.double().argmax(dim=-1)) and len(calls) == 1
