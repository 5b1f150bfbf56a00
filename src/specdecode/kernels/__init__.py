"""specdecode's own CPU kernels (cpu.cpp): quantized linear layers and tree attention whose output rows are each
computed exactly as a one-row forward would compute them, so that verifying N drafted tokens in one forward gives
bit for bit what N plain decoding steps give.

The extension is compiled once per machine kind on first use (torch's cpp_extension, g++), cached under
~/.cache/specdecode/kernels/, and picks its code path at run time from the CPU's flags: AMX (passes of 32 rows and
more; AVX-512 VNNI for the rest; a prompt's decoder layers in bfloat16 tiles, `prompt_arithmetic`), AVX-512 VNNI, AVX2 (vpmaddubsw), or a scalar path that computes the same numbers.
Where it cannot be built (no compiler), `native()` returns None with the reason in `status()`, and the model files
fall back to torch's kernels (rows then round differently, and the speed of tree verification is torch's).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.cpp")
ISAS = ("scalar", "avx2", "avx512-vnni", "avx512-bf16", "avx512-amx")  # index = the code the C++ side takes
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
_ISA_FLAGS = {
    "avx512-amx": _AVX512 | {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"},
    "avx512-bf16": _AVX512 | {"avx512_bf16"},  # VNNI + BF16: an int8 cache's value sums in bfloat16 pairs
    "avx512-vnni": _AVX512,
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}
_lock = threading.Lock()
_arithmetic = threading.local()  # .prompt: this thread is prefilling a prompt (prompt_arithmetic)


@contextmanager
def prompt_arithmetic(on: bool = True):
    """Within it, this thread's quantized decoder layers run in the prompt arithmetic where the CPU has AMX
    (bfloat16 tiles, cpu.cpp: prompt_linear_amx), several times faster on a prompt's many rows. Its rows are exact
    among themselves (a prompt in any chunks, or restored from the prefix cache, gives the same bits) but differ
    from the int8 arithmetic of decoding and verification, so only a prompt's prefill, which plain and speculative
    decoding share, may use it. Elsewhere it changes nothing."""
    before = getattr(_arithmetic, "prompt", False)
    _arithmetic.prompt = on
    try:
        yield
    finally:
        _arithmetic.prompt = before


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bfloat16_native() -> bool:
    """Does this CPU do bfloat16 arithmetic in hardware (AVX512_BF16 or AMX)? Elsewhere torch emulates it."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isas() -> list[str]:
    """The code paths this CPU runs, slowest first."""
    flags = cpu_flags()
    return [isa for isa in ISAS if _ISA_FLAGS[isa] <= flags and (isa != "avx512-amx" or _amx_permitted())]


@lru_cache(maxsize=1)
def _amx_permitted() -> bool:
    """Linux lends a process AMX's register state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); the kernels ask
    again, which is a no-op once granted."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


def unsupported_because(isa: str) -> str | None:
    """Why this CPU (its flags) or the OS (lending AMX) does not run a code path; None where it does."""
    if isa in supported_isas():
        return None
    missing = sorted(_ISA_FLAGS[isa] - cpu_flags())
    return f"this CPU lacks {missing}" if missing else "the OS does not lend this process AMX"


def best_isa() -> str:
    """The fastest code path this CPU runs; SPECDECODE_ISA=avx512-bf16|avx512-vnni|avx2|scalar forces a slower one
    (tests, comparisons)."""
    forced = os.environ.get("SPECDECODE_ISA")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"SPECDECODE_ISA={forced}: use one of {', '.join(ISAS)}")
        if unsupported_because(forced):
            raise ValueError(f"SPECDECODE_ISA={forced}: {unsupported_because(forced)}")
        return forced
    return supported_isas()[-1]


@dataclass(frozen=True)
class Kernels:
    """The compiled extension bound to one code path."""

    module: object
    isa: str

    def quant_linear(self, x: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
        """x [M, K] float32 -> [M, tiles * 16] float32 for weights packed by models/native/linear.py."""
        return self.module.quant_linear(x, packed, bits, ISAS.index(self.isa))

    def tree_attention(self, queries, keys, values, mask, n_keys: int, scale: float) -> torch.Tensor:
        """queries [B, Hq, q, D] float32, keys/values [B, Hkv, >=n_keys, D] float32 or bfloat16 (or int8 entries
        [..., D + 8], quantize_entries), mask [B, q, >=n_keys] bool or None -> [B, q, Hq*D] float32."""
        return self.module.tree_attention(
            queries, keys, values, _or_empty(mask, torch.bool), n_keys, scale, ISAS.index(self.isa)
        )

    def quantize_entries(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] float32 -> the int8 KV cache's entries [..., D + 8] int8: per row, D symmetric codes, then the
        float32 scale (value = scale * code) and 4 zero bytes."""
        return self.module.quantize_entries(x)


    def fused_linear(self, x: torch.Tensor, packed: torch.Tensor, bits: int, n_out: int, bias=None, norm=None,
                     act: str | None = None, post_norm=None, residual=None, eps: float = 0.0) -> torch.Tensor:
        """pre(x) @ W.T [+ bias] [-> rms_norm(., post_norm)] [added into residual in place], x [M, K'] float32 ->
        [M, n_out]; pre = rms_norm(x, norm), act(gate) * up for x = [gate, up] (act "silu" or "gelu"), or none.
        Inside prompt_arithmetic(), in the prompt arithmetic."""
        pre = 1 if norm is not None else {None: 0, "silu": 2, "gelu": 3}[act]
        return self.module.fused_linear(
            x, packed, bits, n_out, _or_empty(bias), pre, _or_empty(norm), _or_empty(post_norm), _or_empty(residual),
            eps, ISAS.index(self.isa), getattr(_arithmetic, "prompt", False),
        )

    def attention_step(self, qkv, hq: int, hkv: int, q_norm, k_norm, eps: float, cos, sin, keys, values, slots,
                       n_keys: int, mask, scale: float) -> torch.Tensor:
        """qkv [B*q, (Hq + 2 Hkv) D] float32 -> q/k norms (or None) -> rotary (cos, sin [B, q, D]) -> new keys and
        values written into keys/values [B, Hkv, C, D] (or int8 entries) at columns slots [B, q] -> attention over n_keys keys (mask
        [B, q, >=n_keys] bool or None) -> [B*q, Hq D] float32."""
        return self.module.attention_step(
            qkv, hq, hkv, _or_empty(q_norm), _or_empty(k_norm), eps, cos, sin, keys, values, slots, n_keys,
            _or_empty(mask, torch.bool), scale, ISAS.index(self.isa),
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [M, d] float32
        return self.module.rms_norm(x, weight, eps, ISAS.index(self.isa))

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, q, D] float32 (D contiguous), cos/sin [B, q, D] -> rotated [B, H, q, D] contiguous."""
        return self.module.rotary(x, cos, sin, ISAS.index(self.isa))

    def glu(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:  # [M, 2n] -> [M, n] float32
        return self.module.glu(gate_up, gelu, ISAS.index(self.isa))


def _or_empty(tensor: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An absent optional tensor as the empty tensor the extension takes for "none"."""
    return torch.empty(0, dtype=dtype) if tensor is None else tensor.contiguous()


_state: dict[str, object] = {}


def native() -> Kernels | None:
    """The compiled kernels for this CPU, building them on first use; None if they cannot be built here."""
    isa = best_isa()
    if isa in _state:
        return _state[isa]
    with _lock:
        if isa not in _state:
            _state[isa] = _build(isa)
    return _state[isa]


def status() -> str:
    """One line: which kernels run, or why torch's run instead."""
    kernels = native()
    if kernels is not None:
        return f"specdecode kernels ({kernels.isa})"
    return f"torch kernels ({_state.get('reason', 'unknown reason')})"


def _build(isa: str) -> Kernels | None:
    try:
        module = _compile()
    except Exception as exc:  # no compiler, missing headers, ...: fall back, and say why
        _state["reason"] = f"could not build cpu.cpp: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
        return None
    if isa == "avx512-amx" and not module.amx_built():  # a compiler without AMX's intrinsics built it
        isa = "avx512-bf16"
    return Kernels(module, isa)


@lru_cache(maxsize=1)
def build_id() -> str:
    """Names one build of cpu.cpp (its source, torch, the architecture): what its speed was measured with."""
    source = SOURCE.read_bytes()
    return hashlib.sha256(source + torch.__version__.encode() + platform.machine().encode()).hexdigest()[:12]


def import_built(path: Path):
    """The extension module compiled into `path` (its stem is the module's name), imported from that file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile():
    from torch.utils.cpp_extension import load

    from ..files import cache_root

    # the `ninja` that pip installed next to this Python, when the environment is not activated
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    digest = build_id()
    build = cache_root() / "kernels" / digest
    name = f"specdecode_cpu_{digest}"
    built = build / f"{name}.so"
    if built.exists():  # built before: import it, without torch's build lock (and its ninja run) in every process
        return import_built(built)
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )
