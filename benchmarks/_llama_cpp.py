"""llama.cpp's ``llama-bench``, the decoding peer of ``pretrained_speed.py`` (not a dependency).

llama.cpp is what people run to decode a GGUF on a CPU. Its source ships inside the
``llama-cpp-python`` sdist on PyPI (``vendor/llama.cpp``); this helper downloads that sdist
with pip, builds the tools the benchmarks run (``llama-bench``, ``llama-completion``,
``llama-simple``, ``llama-server``) with CMake, all of a build's tools in one compile (~10 minutes
on 2 cores, once per build) into ``$QKV_CACHE_DIR/llama.cpp`` (default ``~/.cache/qkv/llama.cpp``),
and runs them on a GGUF. A build whose CMake options equal another's already built (the portable
and AVX2 builds on a CPU without AVX-512) is copied from it, not compiled again.

Build flags: a portable build (``GGML_NATIVE=OFF``) with AVX2/FMA/F16C, AVX-512 where the CPU
has it, and AMX off; and, asked for (``native=True``), llama.cpp at its best on this CPU, in
``llama.cpp/native/``: ``GGML_NATIVE=ON`` (``-march=native``) on every CPU. On an AMX Xeon this
also builds ggml's AMX backend, which repacks the Q4_1/Q8_0 weights at load: measured on an
Intel Xeon (family 6 model 207, 2026-12-06) at 224-297 tok/s on SmolLM2 q4, against 84-117
for the build that named each instruction set but left AMX and ``-march=native`` out (this
helper's native build until then, chosen after an earlier llama.cpp's native build died with
an illegal instruction, issue 14; the version pinned below runs).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the sdist whose vendor/llama.cpp is built
# the tools every build compiles at once (a build is mostly ggml and llama, which they share)
TOOLS = ("llama-bench", "llama-completion", "llama-simple", "llama-server")


def _root() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from qkv.paths import cache_root

    root = cache_root() or Path(tempfile.gettempdir()) / "qkv-cache"
    return root / "llama.cpp"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_flags(native: bool = False, server: bool = False, avx2: bool = False) -> list[str]:
    """CMake options of a build; ``server``: also configure ``llama-server`` (its HTTP server);
    ``avx2``: the portable build with AVX-512 off, what an AVX2-only CPU (AMD Zen 3) runs."""
    common = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
              f"-DLLAMA_BUILD_SERVER={'ON' if server else 'OFF'}"]
    if native:
        return [*common, "-DGGML_NATIVE=ON"]
    flags = _cpu_flags()
    avx512 = all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")) and not avx2
    return [
        *common, "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
        f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ]


def llama_bench(build: bool = True, log=print, native: bool = False,
                avx2: bool = False) -> tuple[Path | None, str]:
    """(path of llama-bench, how it was found), or (None, why it is not available); ``native``:
    the build for this CPU (kept apart, in ``native/``), ``avx2``: the portable one without
    AVX-512 (in ``avx2/``; see :func:`cmake_flags`)."""
    return llama_tool("llama-bench", build, log, native=native, avx2=avx2)


def llama_bench_builds(build: bool = False, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Every llama-bench build found (or, with ``build``, built): "llama.cpp AVX2", "llama.cpp
    portable", "llama.cpp native" -> its path; each one's line (how it was found, or why not) logged."""
    found: dict[str, Path] = {}
    for label, kw in (("llama.cpp AVX2", {"avx2": True}), ("llama.cpp portable", {}),
                      ("llama.cpp native", {"native": True})):
        binary, how = llama_bench(build=build, log=log, **kw)
        log(f"{label}: {how}")
        if binary is not None:
            found[label] = binary
    return found


def llama_cpp_source(log=print) -> tuple[Path | None, str]:
    """(llama.cpp's source folder, how it was found): the ``vendor/llama.cpp`` of the
    llama-cpp-python sdist, downloaded with pip once and kept in the cache; or (None, why not)."""
    keep = _root() / "src"
    src = next(keep.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is not None:
        return src, f"cached source in {keep}"
    with tempfile.TemporaryDirectory(prefix="qkv-llama-") as tmp:
        tmp_path = Path(tmp)
        log(f"llama.cpp: downloading the {LLAMA_CPP_PYTHON} sdist ...")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            "-d", tmp, LLAMA_CPP_PYTHON], capture_output=True, text=True)
        sdists = list(tmp_path.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not sdists:
            return None, f"pip could not download {LLAMA_CPP_PYTHON}: {(r.stderr or r.stdout).strip()[-300:]}"
        unpacked = tmp_path / "src"
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(unpacked, filter="data")
        if next(unpacked.glob("llama_cpp_python-*/vendor/llama.cpp"), None) is None:
            return None, "the sdist has no vendor/llama.cpp"
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(keep, ignore_errors=True)
        shutil.move(str(unpacked), keep)
    src = next(keep.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return src, f"downloaded {LLAMA_CPP_PYTHON} into {keep}"


def convert_hf_to_gguf(folder: Path, out: Path, outtype: str = "f32", log=print) -> str | None:
    """Convert a Hugging Face checkpoint folder to ``out`` with llama.cpp's own converter
    (``convert_hf_to_gguf.py`` of the same source; needs ``sentencepiece``); None when it
    worked, else why not (one line)."""
    src, how = llama_cpp_source(log)
    if src is None:
        return how
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder),
                        "--outfile", str(out), "--outtype", outtype], capture_output=True, text=True)
    if r.returncode != 0 or not out.is_file():
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        return f"llama.cpp's converter failed: {(lines or ['no output'])[-1][:300]}"
    return None


def llama_tool(target: str, build: bool = True, log=print, native: bool = False,
               avx2: bool = False) -> tuple[Path | None, str]:
    """(path of llama.cpp's ``target`` binary, e.g. ``llama-bench`` or ``llama-simple`` (greedy
    decoding of a prompt), how it was found), or (None, why it is not available)."""
    binary = (_root() / "native" if native else _root() / "avx2" if avx2 else _root()) / target
    flags = cmake_flags(native, server=True, avx2=avx2)
    if binary.is_file():
        return binary, f"cached build in {binary.parent}"
    for twin in (_root(), _root() / "avx2", _root() / "native"):  # the same options built already
        try:
            same = json.loads((twin / "build.json").read_text()).get("cmake_flags") == flags
        except (OSError, ValueError):
            same = False
        if twin != binary.parent and same and (twin / target).is_file():
            binary.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(twin / target, binary)
            (binary.parent / "build.json").write_text((twin / "build.json").read_text())
            return binary, f"copied from {twin}, built with the same CMake options"
    if not build:
        return None, f"not built (run with --build-llama-cpp to build it into {binary.parent})"
    if not shutil.which("cmake") or not (shutil.which("c++") or shutil.which("g++")):
        return None, "cmake or a C++ compiler is missing (apt-get install cmake g++)"
    src, how = llama_cpp_source(log)
    if src is None:
        return None, how
    with tempfile.TemporaryDirectory(prefix="qkv-llama-") as tmp:
        tmp_path = Path(tmp)
        build_dir = tmp_path / "build"
        targets = sorted({target, *TOOLS})
        log(f"llama.cpp: configuring (cmake) and building {', '.join(targets)} (~10 minutes on 2 cores) ...")
        for cmd in (["cmake", "-S", str(src), "-B", str(build_dir), *flags],
                    ["cmake", "--build", str(build_dir), "--target", *targets, "-j", "2"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                return None, f"{' '.join(cmd[:3])} failed: {(r.stderr or r.stdout).strip()[-500:]}"
        binary.parent.mkdir(parents=True, exist_ok=True)
        for name in targets:
            built = next((p for p in build_dir.rglob(name) if p.is_file()), None)
            if built is not None:
                shutil.copy2(built, binary.parent / name)
        if not binary.is_file():
            return None, f"the build produced no {target} binary"
        (binary.parent / "build.json").write_text(json.dumps(
            {"source": LLAMA_CPP_PYTHON, "cmake_flags": flags}, indent=1))
    return binary, f"built now from {LLAMA_CPP_PYTHON} into {binary.parent}"


def simple_text(binary: Path, gguf: Path, prompt: str, n_new: int) -> str:
    """llama-simple's greedy text for ``prompt`` (the prompt, then up to ``n_new`` tokens; a
    leading bos token's text dropped), or "(failed: ...)"."""
    r = subprocess.run([str(binary), "-m", str(gguf), "-n", str(n_new), prompt], capture_output=True,
                       text=True, errors="replace", timeout=300)  # it prints byte tokens one by one
    if r.returncode != 0:
        return f"(failed: {r.stderr.strip()[-300:]})"
    text = r.stdout.rstrip("\n")
    for marker in ("<bos>", "<s>"):  # it prints the prompt's tokens, bos included
        text = text.removeprefix(marker)
    return text


def run_llama_bench(binary: Path, gguf: Path, threads: int = 2, prompt: int = 32, new: int = 128,
                    reps: int = 3) -> dict:
    """Prefill and decode tokens/s of ``gguf`` (llama-bench's own averages over ``reps``; its
    decode test starts from an empty cache, apart from the prefill test). Where the prefill test
    kills llama-bench (the native build's AMX prefill on an AMX Xeon: SIGILL at its first
    ``tileloadd``, seen 2026-12-06 on family 6 model 207), the decode test runs alone and
    ``prefill`` says why it is missing."""
    def bench(p: int) -> subprocess.CompletedProcess:
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(p), "-n", str(new),
               "-r", str(reps), "-o", "json"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900)

    r, crashed = bench(prompt), None
    if r.returncode < 0 and prompt > 0:  # killed by a signal: try the decode test alone
        crashed = f"llama-bench -p {prompt} died (signal {-r.returncode}); decode measured alone with -p 0"
        r = bench(0)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}")
    rows = json.loads(r.stdout)
    out: dict = {"command": " ".join(r.args[1:]), "build": str(binary)}
    if crashed:
        out["prefill"] = {"tokens_per_s": None, "failed": crashed}
    for row in rows:
        kind = "prefill" if row.get("n_prompt", 0) > 0 else "decode"
        out[kind] = {"tokens_per_s": round(float(row["avg_ts"]), 1),
                     "stdev": round(float(row.get("stddev_ts", 0.0)), 1),
                     "samples_ts": row.get("samples_ts")}
    return out
