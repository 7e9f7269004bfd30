"""The glue between a step's products, as one interface with a torch implementation.

:class:`PagedLlama <tserve.gpu.forward._llama.PagedLlama>` runs its products
itself; what lies between them (the residual add and RMSNorm, RoPE and the
K/V write, the MLP's activation, decode attention) goes through a
:class:`StepOps` the model runner picks once from the device and dtype: the
fused CPU kernels (:class:`~tserve.gpu.kernels._cpu_kernels.CpuKernels`, fp32
on CPU) or :data:`TORCH_OPS`, torch calls for any device and dtype and the
reference the kernels are tested against.
"""

from __future__ import annotations

from typing import Final, Protocol

import torch
import torch.nn.functional as F

__all__ = ["TORCH_OPS", "StepOps", "TorchOps", "rms_norm", "rotate"]


class StepOps(Protocol):
    """The glue between a step's products; every tensor is on the model's device."""

    def add_rms_norm(
        self, residual: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += hidden`` in place (unless None); its RMSNorm times ``weight``, new."""
        ...

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
        """RoPE on the Q and K heads of ``qkv [T, (heads + 2 kv_heads) * D]`` in place,
        then K and V into the pools ``[kv_heads, slots, D]`` at ``slots [T]``, cast
        to the pools' dtype (which may differ from ``qkv``'s)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [T, 2 I]`` (gate first): a new ``[T, I]``."""
        ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of ``gate_up [T, 2 I]`` (gate first): a new ``[T, I]``."""
        ...

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
    ) -> torch.Tensor | None:
        """Decode attention read where the keys lie (``[B, heads, D]``; with a
        sliding ``window`` > 0, over the last ``window`` keys; ``softcap`` > 0:
        scores capped by tanh), or None: the group goes through
        :func:`~tserve.gpu.forward._attention.attend_groups`' own."""
        ...


class TorchOps:
    """:class:`StepOps` in torch calls, for any device and dtype."""

    def add_rms_norm(
        self, residual: torch.Tensor, hidden: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if hidden is not None:
            residual.add_(hidden)
        return rms_norm(residual, weight, eps)

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
        split = qkv.view(qkv.shape[0], heads + 2 * kv_heads, -1)
        c = cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        s = sin.index_select(0, positions).unsqueeze(1)
        split[:, : heads + kv_heads] = rotate(split[:, : heads + kv_heads], c, s)
        keys, values = split[:, heads : heads + kv_heads], split[:, heads + kv_heads :]
        k_pool.index_copy_(1, slots, keys.transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(1, slots, values.transpose(0, 1).to(v_pool.dtype))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

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
    ) -> torch.Tensor | None:
        return None


TORCH_OPS: Final = TorchOps()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, 1, D/2]``: a new tensor.

    The same products and sums as transformers' ``x * cos + rotate_half(x) * sin``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: statistics in fp32, the weight applied in ``x``'s dtype.

    In fp32 that is torch's own ``rms_norm`` with the weight (one call, the
    same values); other dtypes normalize in fp32 and scale after the cast back.
    """
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)
