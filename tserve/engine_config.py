"""How to start an engine process: :class:`EngineConfig`, handed to it as JSON.

A leaf beside :mod:`tserve.protocol` (which re-exports it): it imports only
the standard library and msgspec.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Literal, TypeAlias

import msgspec

__all__ = [
    "CpuGemm",
    "EngineConfig",
    "GgufActivations",
    "GgufRunner",
    "KvCacheDtype",
    "ModelImpl",
]


CpuGemm: TypeAlias = Literal["auto", "blas", "onednn", "panels"]
"""The library behind linear layers on CPU: measured per layer, or forced."""

ModelImpl: TypeAlias = Literal["auto", "hf"]
"""Whose forward pass runs the model: tserve's own where it covers the model, or transformers'."""

GgufActivations: TypeAlias = Literal["int8", "fp32"]
"""How a GGUF file's quantized products treat their activations (``tserve.gpu.forward._quant``)."""

GgufRunner: TypeAlias = Literal["auto", "native", "torch"]
"""What runs a GGUF file served as it is on CPU: the native runner (no torch,
``tserve.gpu.forward._native``) on CPU in float32, in any mix of formats, else
torch's forward pass; or one."""

KvCacheDtype: TypeAlias = Literal["auto", "fp32", "fp16", "bf16"]
"""What the KV cache stores: "auto" (see ``tserve.gpu.models._placement.kv_dtype``) or one."""


def physical_cores(cpus: set[int], sys_root: Path = Path("/sys")) -> int:
    """How many physical cores the logical ``cpus`` are: hyperthread siblings
    (the same package and core id in ``sys_root``'s CPU topology) count once.
    A CPU whose topology cannot be read counts as a core of its own."""
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def cgroup_cpus(sys_root: Path = Path("/sys")) -> int | None:
    """The CPUs a cgroup's quota allows this process, rounded up (cgroup v2's
    ``cpu.max``, else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), or
    None where there is no quota."""
    base = sys_root / "fs" / "cgroup"
    try:
        quota, period = (base / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = (base / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (base / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if not (quota.isdigit() and period.isdigit()) or int(quota) == 0 or int(period) == 0:
        return None  # "max" (v2) and -1 (v1): no quota
    return math.ceil(int(quota) / int(period))


def host_threads(cpus: set[int], sys_root: Path = Path("/sys")) -> int:
    """One fewer than the physical cores of ``cpus`` (capped by a cgroup's
    quota), at least one: :func:`default_threads` for a process that may run
    on ``cpus``."""
    cores = physical_cores(cpus, sys_root)
    quota = cgroup_cpus(sys_root)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores - 1)


@functools.cache
def default_threads() -> int:
    """``threads`` when none is given: one fewer than the physical cores this
    process may run on (its CPU affinity, capped by a cgroup's quota), at
    least one, so 1 on two cores. The core left over runs the API process, its
    grammar checks and the engine's mask thread. Hyperthread siblings count
    once: the kernels are bound by a core's multiply ports and its memory
    bandwidth, which its siblings share. Read once per process."""
    if hasattr(os, "sched_getaffinity"):
        return host_threads(os.sched_getaffinity(0))
    return max(1, (os.cpu_count() or 1) - 1)  # no affinity or topology to read


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to start an engine process; handed to it as JSON on its command line.

    ``model``: a local model directory or GGUF file, or "default"
    (SmolLM2-135M-Instruct's GGUF).
    ``kv_cache_tokens``: the KV budget in tokens, shared by all running
    requests; ``kv_cache_memory_bytes``, when set, replaces it with a budget
    in bytes (so a smaller ``kv_cache_dtype`` holds more tokens);
    ``max_model_len`` None = the model's own (capped by the KV budget).
    ``kv_cache_dtype``: what the KV cache stores ("fp32", "fp16", "bf16");
    "auto" = the model's dtype (fp32 on CPU, bf16 on CUDA). ``threads``: the
    engine's CPU threads (torch's and the C kernels'); by default
    :func:`default_threads` (1 on two cores). Several engines on one host
    (several models, an embedding model) each take that many.
    ``device``/``dtype`` "auto" = CUDA with bf16 when present, else CPU with
    fp32. ``cpu_gemm``: the library
    behind linear layers on CPU ("auto" measures BLAS, prepacked oneDNN
    and tserve's few-rows panel kernel per layer shape and row count;
    "blas", "onednn", "panels" force one).
    ``enable_prefix_caching`` keeps the K/V of full blocks after their request
    ends, for a later prompt that starts with the same tokens.
    ``max_decode_slowdown``: while requests decode, a step that also runs
    prompt tokens may cost at most this many times a decode-only step (the
    scheduler's token cost model), so streams never stall behind a long
    prompt; 0 = no bound. ``model_impl`` "auto": tserve's own forward pass for
    the architectures of ``tserve.gpu.models._architectures``, transformers' modules
    over the paged attention for others; "hf": transformers' modules for all.
    ``dequantize``: a GGUF file (the default model is one) is converted once
    (``tserve.gpu.gguf._convert``) to an fp32 directory and served from it,
    instead of as it is (its quantized weights through tserve's kernels; CPU
    fp32 only). ``gguf_activations`` (a GGUF file served as it is): "int8",
    activations quantized to 8 bits per block of 32 against the packed
    weights, integer products (llama.cpp's scheme); "fp32", fp32 against the
    weights dequantized in registers (the fp32 conversion's results up to
    summation order). ``gguf_runner`` (a GGUF file served as it is, on CPU):
    "native", the engine imports no torch (numpy buffers and the C kernels,
    every layer in one C call, any mix of formats); "torch", torch's forward
    pass; "auto", native on CPU in float32 (where no CUDA device may be
    present and ``model_impl`` is "auto"). ``heartbeat_interval``: every peer hears from
    the engine at least this often; on a network bind it is also the period
    of the ZMTP heartbeats (``tserve.gpu.engine._bind``).

    ``generation_config``: where a request that leaves temperature, top_p or
    top_k unset gets them (vLLM's ``--generation-config``): "auto" = what the
    model recommends (its generation_config.json, a GGUF file's
    ``general.sampling.*`` metadata, the default model's card), "none" =
    OpenAI's defaults always, else a directory whose generation_config.json
    alone gives them (``tserve.gpu.models._sampling_defaults``).

    ``grammar_compile_timeout``: a constrained request whose grammar is not
    compiled this many seconds after it arrived ends with an error (it waits
    unscheduled until then; others step on). ``grammar_cache_size``: compiled
    grammars kept, by text (least recently used dropped beyond it).
    ``grammar_mask_budget``: seconds one token's grammar mask may take; a
    constrained request whose masks take longer for ``MASK_MISSES`` (8) tokens
    in a row (``tserve.gpu.sampling._constraints``) ends with an error. A late mask
    never holds back other rows.

    ``task`` "embed" makes an embedding engine (``tserve.gpu.engine._embed_core``):
    ``model`` is a local encoder directory or "default" (all-MiniLM-L6-v2);
    ``max_model_len`` None = the encoder's maximum (256 for MiniLM);
    ``max_num_seqs`` and ``max_num_batched_tokens`` bound one forward pass
    (inputs, padded tokens); the KV fields are unused; ``dtype`` "auto" is fp32.

    ``engine_kind`` "echo" runs no model (``tserve.gpu.engine._echo_core``), to
    measure the frontend alone: ``model`` only gives the API its tokenizer;
    each step of ``echo_step_time`` s gives each of up to ``max_num_seqs``
    requests one token echoing its prompt. ``max_tokens``, stop token ids,
    deadlines and aborts work as in the real engine; EOS is never echoed.
    """

    model: str = "default"
    max_num_seqs: int = 64
    kv_cache_tokens: int = 16384
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: KvCacheDtype = "auto"
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int = 16
    threads: int = msgspec.field(default_factory=default_threads)
    device: str = "auto"
    dtype: str = "auto"
    heartbeat_interval: float = 0.5
    cache_dir: str | None = None
    task: Literal["generate", "embed"] = "generate"
    cpu_gemm: CpuGemm = "auto"
    engine_kind: Literal["model", "echo"] = "model"
    echo_step_time: float = 0.01
    enable_prefix_caching: bool = True
    max_decode_slowdown: float = 2.5
    model_impl: ModelImpl = "auto"
    grammar_compile_timeout: float = 10.0
    grammar_cache_size: int = 64
    grammar_mask_budget: float = 0.05
    dequantize: bool = False
    generation_config: str = "auto"
    gguf_activations: GgufActivations = "int8"
    gguf_runner: GgufRunner = "auto"
