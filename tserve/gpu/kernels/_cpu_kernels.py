"""Fused fp32 CPU kernels for :class:`~tserve.gpu.forward._llama.PagedLlama`, built on first use.

A decode step of a small model on one CPU core is a few hundred torch calls
besides its matrix products: each RMSNorm is five, RoPE eight, writing K/V
two, and decode attention a gather of every sequence's keys and values plus
two batched products and a softmax. Measured on SmolLM2 with the products
stubbed out, that glue cost 6 ms of a 1-sequence step and 35 ms of a
16-sequence one. ``_cpu_kernels.c`` does each of those in one pass:

* ``add_rms_norm``: the residual add and the RMSNorm;
* ``silu_mul``: the MLP's ``silu(gate) * up``;
* ``rope_store``: RoPE on the Q and K heads in place, and K and V written
  into the pool at their slots;
* ``paged_decode``: one query per sequence over its keys and values read
  where they lie in the paged pool (no gather), softmax included.

The KV pool may hold fp32, fp16 or bf16 (``--kv-cache-dtype``): the two
kernels that touch it compute in fp32, widening each key and value row as
they read it and rounding to nearest even as they write it (torch's casts,
bit for bit), with F16C where the CPU has it.

The C sources (this file's ``_cpu_kernels.c`` and the quantized products'
``_quant_kernels.c`` and ``_kquant_kernels.c``) are compiled into one shared library, ``_kernels``,
when the package is installed, and loaded with ctypes
(:func:`~tserve.gpu.kernels._library.kernel_library`). The library is built for any
x86-64 CPU and picks its instructions at run time from the CPU's flags
(AVX-512, AVX2, or plain x86-64). :func:`kernel_library` returns None where
it was not built (a source tree never installed: logged once); the forward
pass then runs on torch alone, with the same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Final

import torch
import torch.nn.functional as F

from tserve.gpu.kernels._decoder_abi import add_rms_norm
from tserve.gpu.kernels._library import KV_CODES, kernel_library
from tserve.gpu.kernels._library import declare as _declare
from tserve.gpu.kernels._quant_abi import Isa, quant_library

__all__ = ["KV_TYPES", "LINEAR_PANEL", "CpuKernels", "cpu_kernels"]

LINEAR_PANEL: Final = 32  # PANEL in _cpu_kernels.c

_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p

KV_TYPES: Final = {
    torch.float32: KV_CODES["fp32"],
    torch.float16: KV_CODES["fp16"],
    torch.bfloat16: KV_CODES["bf16"],
}
"""The KV pool dtypes the kernels read and write: their ``KV_*`` codes in ``_cpu_kernels.c``."""


class _BoundLinear:
    """``x [..., K] -> [..., n]`` over one panel-packed weight (:meth:`CpuKernels.bound_linear`)."""

    __slots__ = ("_bias", "_call", "_isa", "_n", "_offset", "_packed", "_weights")

    def __init__(
        self, call: Callable[..., None], isa: Isa, packed: torch.Tensor, bias: torch.Tensor | None,
        n: int,
    ) -> None:  # fmt: skip
        self._call, self._isa, self._n = call, isa, n
        self._packed, self._bias = packed, bias  # held: the pointers below point into them
        self._weights = packed.data_ptr()
        self._offset = 0 if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        shape = x.shape
        k, n = shape[-1], self._n
        out = torch.empty((*shape[:-1], n))
        self._call(self._isa, x.data_ptr(), x.numel() // k, k, self._weights, self._offset, n,
                   out.data_ptr())  # fmt: skip
        return out


class CpuKernels:
    """The loaded kernels; every tensor argument is CPU fp32 (int64 for
    indices; a KV pool of one of ``KV_TYPES``) and contiguous unless its
    stride is an argument. Callers hold these rules; the kernels do not
    check them."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr = _I64, _PTR
        self._add_rms_norm = add_rms_norm(library)
        self._rope_store = _declare(
            library.tserve_rope_store, ptr, i64, i64, i64, i64, i64,
            ptr, ptr, ptr, ptr, ptr, ptr, i64, _INT,
        )  # fmt: skip
        self._silu_mul = _declare(library.tserve_silu_mul, ptr, i64, i64, ptr, ptr)
        self._gelu_tanh_mul = _declare(library.tserve_gelu_tanh_mul, ptr, i64, i64, ptr, ptr)
        self._paged_decode = _declare(
            library.tserve_paged_decode, ptr, i64, ptr, ptr, i64, ptr, i64, ptr,
            i64, i64, i64, i64, i64, _F32, i64, _F32, ptr, ptr, _INT,
        )  # fmt: skip
        self._linear = _declare(library.tserve_linear, _INT, ptr, i64, i64, ptr, ptr, i64, ptr)
        quant = quant_library()
        self.linear_isa: Isa = 0 if quant is None else quant.best_isa
        """The variant :meth:`linear` runs by default: the quantized products'
        best (``TSERVE_MAX_ISA`` caps it): 2 AVX-512, 1 AVX2 + FMA."""
        self.linear_available = self.linear_isa >= 1
        """Whether :meth:`linear` runs here (this CPU has AVX2 and FMA, at least)."""

    def add_rms_norm(
        self, residual: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += hidden`` (unless None), then RMSNorm of it times ``weight``: a new tensor.

        ``residual`` and ``hidden`` are ``[T, dim]``.
        """
        rows, dim = residual.shape
        out = torch.empty_like(residual)
        self._add_rms_norm(
            residual.data_ptr(),
            0 if hidden is None else hidden.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            hidden is not None,
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> None:
        """RoPE on the Q and K heads of ``qkv [T, (heads + 2 kv_heads) * D]`` in
        place, then each token's K and V into ``k_pool``/``v_pool`` ``[kv_heads,
        slots, D]`` (fp32, fp16 or bf16, both alike) at ``slots [T]``, rounded to
        their dtype; ``cos``/``sin`` are ``[positions, D/2]``."""
        tokens, width = qkv.shape
        head_dim = k_pool.shape[-1]
        self._rope_store(
            qkv.data_ptr(),
            tokens,
            width,
            heads,
            kv_heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            k_pool.shape[1],
            KV_TYPES[k_pool.dtype],
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [T, 2 I]`` (gate first): a new ``[T, I]``."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        scratch = torch.empty(width // 2)
        self._silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), scratch.data_ptr())
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of ``gate_up [T, 2 I]`` (gate first): a new ``[T, I]``."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        scratch = torch.empty(width // 2)
        self._gelu_tanh_mul(
            gate_up.data_ptr(), rows, width // 2, out.data_ptr(), scratch.data_ptr()
        )
        return out

    @staticmethod
    def pack_linear(weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` in :meth:`linear`'s layout: column panels of
        :data:`LINEAR_PANEL`, each k-major, zero padded (a copy)."""
        n, k = weight.shape
        padded = F.pad(weight.detach(), (0, 0, 0, -n % LINEAR_PANEL))
        return padded.view(-1, LINEAR_PANEL, k).transpose(1, 2).contiguous()

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        *,
        isa: Isa | None = None,
    ) -> torch.Tensor:
        """``x [..., K] @ W.T (+ bias)`` with ``packed`` from :meth:`pack_linear`
        of ``W [n, K]``: a new ``[..., n]``. Reads the weight once whatever the
        row count; meant for few rows (it is not blocked for the caches as a
        large GEMM is). Only where :attr:`linear_available`; ``isa`` (1 or 2,
        at most :attr:`linear_isa`) picks a variant, else the best."""
        variant = self.linear_isa if isa is None else isa
        if not 1 <= variant <= self.linear_isa:
            raise ValueError(f"isa {variant}: this CPU runs linear at 1..{self.linear_isa}")
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(rows.shape[0], n)
        self._linear(
            variant,
            rows.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            packed.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            n,
            out.data_ptr(),
        )
        return out.view(*x.shape[:-1], n)

    def bound_linear(
        self, packed: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`linear` over one weight, at :attr:`linear_isa`, with its
        pointers read once (a decode step makes a hundred such calls: 4 us
        each instead of 6.4, over a tiny weight). The returned function holds
        ``packed`` and ``bias``; neither may be replaced or resized after
        (inference weights)."""
        if not self.linear_available:
            raise ValueError("linear does not run on this CPU (no AVX2)")
        return _BoundLinear(self._linear, self.linear_isa, packed, bias, n)

    def paged_decode(
        self,
        q: torch.Tensor,
        heads: int,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        max_len: int,
        block_size: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of ``q`` (``[B, >= heads * D]`` rows, any row stride, unit
        column stride) over each sequence's ``lens[b]`` keys in the pool (fp32,
        fp16 or bf16, both alike; with a sliding ``window`` > 0, its last
        ``window`` keys; ``softcap`` > 0: scores capped to it by tanh), its
        blocks ``tables [B, width]``: fp32 ``[B, heads, D]``."""
        batch = q.shape[0]
        kv_heads, num_slots, head_dim = k_pool.shape
        out = torch.empty(batch, heads, head_dim)
        scores = torch.empty((heads // kv_heads) * max_len)
        self._paged_decode(
            q.data_ptr(),
            q.stride(0),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            num_slots,
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            block_size,
            batch,
            heads,
            kv_heads,
            head_dim,
            scale,
            window,
            softcap,
            out.data_ptr(),
            scores.data_ptr(),
            KV_TYPES[k_pool.dtype],
        )
        return out


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The fused fp32 kernels, or None without :func:`kernel_library`."""
    library = kernel_library()
    return None if library is None else CpuKernels(library)
