"""OpenAI Triton kernel for ``ssd::tree_attention`` and its torch launcher.

One kernel serves prefill, decode, chain verification and tree decoding (see ``reference.py`` for the
contract). It is written once and used three ways:

* on a GPU through torch (:func:`tree_attention`),
* on CPU in the Triton interpreter (:func:`tree_attention` with CPU tensors) to test it against the
  reference math everywhere,
* compiled ahead of time to PTX (``ptx.py``) and baked into a TensorRT engine (``trt_plugin.py``).

Work split. One program handles one (sequence b, kv head h, block of BLOCK_T new tokens) and all
GROUP = Hq / Hkv query heads that read kv head h (grouped-query attention): its tile has
BLOCK_M = GROUP_PAD * BLOCK_T rows, row r being query head h * GROUP + r // BLOCK_T at new token
t0 + r % BLOCK_T. Each K/V tile is therefore loaded once per kv head, and a decode step (T = 1)
still fills the 16-row minimum of a tensor-core dot with the group's heads.

Math. Flash-attention style online softmax in base 2 with fp32 statistics and an fp32 accumulator:
for each key tile, m' = max(m, rowmax(s)), acc = acc * 2^(m - m') + 2^(s - m') @ V,
l = l * 2^(m - m') + rowsum(2^(s - m')); the output is acc / l. ``scale * log2(e)`` is folded into
the scores so that ``exp2`` can be used. The running max starts at a large finite negative number,
not -inf, so a tile whose keys are all masked contributes exactly zero instead of NaN.

Two key ranges are visited: the cached prefix (slots s < L_b of the *input* cache) and the T new
keys (read from ``key_new``, not from the cache, so no program reads a slot another program writes).
New token i may read new token j when bit j of mask row i is set (packed int32 words, bit j % 32 of
word j // 32, like TensorRT-LLM's packed spec-decoding mask). Finally each program writes its block
of new keys/values into the *output* cache at slots L_b + t. The output cache is meant to alias the
input cache (in-place, O(T) per step); the launcher below copies first when asked for a functional
result.

Only Triton builtins are used (``tl.full`` rather than ``tl.zeros``, ``tl.reduce`` with the standard
combine functions rather than ``tl.max`` / ``tl.sum``): the standard-library helpers are themselves
jit functions, which the interpreter can only call when ``TRITON_INTERPRET=1`` was set before triton
was imported. With builtins only, one process can run the kernel in the interpreter *and* compile
it to PTX, whatever that environment variable says.

Kernel argument order is the TensorRT AOT-plugin calling convention: input pointers (in plugin
input order), then the extra int32 scalars, then output pointers. Tensors are contiguous.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass

import torch
import triton.language as tl

from ssd_trt_plugins.tree_attention.masks import MASK_WORD_BITS

LOG2E = 1.4426950408889634
# The Triton interpreter patches triton.language's module globals while a kernel runs, so two threads
# interpreting at once break each other (SSD runs the draft in a worker thread): CPU launches take turns.
_INTERPRETER_LOCK = threading.Lock()
# Large finite "minus infinity" for the running max (see module docstring).
_NEG_BIG = tl.constexpr(-1.0e30)

# Kernel parameters in calling-convention order (inputs, extra int32 scalars, outputs).
KERNEL_INPUTS = ("query", "key_new", "value_new", "key_cache", "value_cache", "cache_lengths", "tree_mask")
KERNEL_SCALARS = ("num_new", "capacity")
KERNEL_OUTPUTS = ("output", "key_cache_out", "value_cache_out")

TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _tree_attention_fwd(
    q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, lengths_ptr, mask_ptr,
    num_new, capacity,
    out_ptr, k_cache_out_ptr, v_cache_out_ptr,
    QK_SCALE_LOG2: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NUM_KV_HEADS
    kv_head = pid_bh % NUM_KV_HEADS
    words = (num_new + 31) // 32

    # Tile rows: (query head of the group, new token) pairs.
    rows = tl.arange(0, GROUP_PAD * BLOCK_T)
    group_idx = rows // BLOCK_T
    tok = pid_t * BLOCK_T + rows % BLOCK_T
    row_ok = (group_idx < GROUP) & (tok < num_new)
    dim = tl.arange(0, BLOCK_D)
    dim_ok = dim < HEAD_DIM

    # int64 offsets: a cache can hold more than 2^31 elements.
    b64 = b.to(tl.int64)
    q_row = ((b64 * (NUM_KV_HEADS * GROUP) + kv_head * GROUP + group_idx) * num_new + tok) * HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_row[:, None] + dim[None, :], mask=q_mask, other=0.0)

    length = tl.load(lengths_ptr + b)
    cache_base = (b64 * NUM_KV_HEADS + kv_head) * capacity * HEAD_DIM
    new_base = (b64 * NUM_KV_HEADS + kv_head) * num_new * HEAD_DIM

    m_i = tl.full([GROUP_PAD * BLOCK_T], _NEG_BIG, dtype=tl.float32)
    l_i = tl.full([GROUP_PAD * BLOCK_T], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD * BLOCK_T, BLOCK_D], 0.0, dtype=tl.float32)

    # 1. The cached prefix: slots 0 .. L_b - 1, visible to every new token.
    for s0 in range(0, length, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        slot_ok = slot < length
        kv_off = cache_base + slot[:, None] * HEAD_DIM + dim[None, :]
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(slot_ok[None, :], s * QK_SCALE_LOG2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        p_low = p.to(v.dtype)  # round P like a tensor-core kernel does
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p_low, v)
        m_i = m_new

    # 2. The new tokens, filtered by the packed tree mask.
    for j0 in range(0, num_new, BLOCK_N):
        col = j0 + tl.arange(0, BLOCK_N)
        col_ok = col < num_new
        kv_off = new_base + col[:, None] * HEAD_DIM + dim[None, :]
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_new_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # Word (row tok, column col // 32), then bit col % 32 (arithmetic shift is fine: we keep bit 0).
        word = tl.load(mask_ptr + (b64 * num_new + tok[:, None]) * words + col[None, :] // 32,
                       mask=row_ok[:, None] & col_ok[None, :], other=0)
        allowed = ((word >> (col[None, :] % 32)) & 1) != 0
        s = tl.where(allowed & col_ok[None, :], s * QK_SCALE_LOG2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_new_ptr + kv_off, mask=kv_mask, other=0.0)
        p_low = p.to(v.dtype)  # round P like a tensor-core kernel does
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p_low.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p_low, v)
        m_i = m_new

    # Rows outside the problem have l = 0: divide by 1 there (they are not stored).
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] + dim[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)

    # 3. Write this block's new keys/values at slots L_b + t (never past the capacity).
    wt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    dst_slot = length + wt
    w_mask = ((wt < num_new) & (dst_slot < capacity))[:, None] & dim_ok[None, :]
    src = new_base + wt[:, None] * HEAD_DIM + dim[None, :]
    dst = cache_base + dst_slot[:, None] * HEAD_DIM + dim[None, :]
    tl.store(k_cache_out_ptr + dst, tl.load(k_new_ptr + src, mask=w_mask, other=0.0), mask=w_mask)
    tl.store(v_cache_out_ptr + dst, tl.load(v_new_ptr + src, mask=w_mask, other=0.0), mask=w_mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """Everything that is baked into one compiled instance of the kernel.

    ``block_m`` is the number of tile rows to aim for (tensor-core dots need at least 16); the
    token block is derived from it so that GROUP_PAD * BLOCK_T >= block_m.
    """
    dtype: str  # "fp32" | "fp16" | "bf16" (queries, keys, values, caches and output alike)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    block_m: int = 16
    block_s: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    interpreter: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"dtype must be fp32, fp16 or bf16, got {self.dtype!r}")
        if self.num_q_heads < 1 or self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"query heads ({self.num_q_heads}) must be a positive multiple of kv heads "
                             f"({self.num_kv_heads})")
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        for name in ("block_m", "block_s", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tensor-core tile), got {value}")
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def group_pad(self) -> int:
        return _next_pow2(self.group)

    @property
    def block_t(self) -> int:
        return max(1, self.block_m // self.group_pad)

    @property
    def dot_fp32(self) -> bool:
        """Whether dots run on fp32-upcast operands with IEEE precision.

        fp32: always (tensor cores would otherwise multiply in TF32, ~1e-3 relative error).
        bf16 in the interpreter: the interpreter's dot multiplies the raw bf16 bit patterns (it
        stores bf16 as uint16), so operands are upcast first. Products of bf16 numbers are exact in
        fp32, so this is the same math as a tensor-core bf16 dot with fp32 accumulation.
        """
        return self.dtype == "fp32" or (self.interpreter and self.dtype == "bf16")

    @property
    def block_d(self) -> int:
        return max(16, _next_pow2(self.head_dim))

    def constexprs(self) -> dict[str, object]:
        """The kernel's compile-time arguments."""
        return {
            "QK_SCALE_LOG2": float(self.scale) * LOG2E,
            "NUM_KV_HEADS": self.num_kv_heads,
            "GROUP": self.group,
            "GROUP_PAD": self.group_pad,
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": self.block_d,
            "BLOCK_T": self.block_t,
            "BLOCK_S": self.block_s,
            "BLOCK_N": self.block_n,
            "DOT_FP32": self.dot_fp32,
        }

    def signature(self) -> dict[str, str]:
        """Triton type of every runtime argument, in calling-convention order."""
        pointer = f"*{self.dtype}"
        return {
            "q_ptr": pointer, "k_new_ptr": pointer, "v_new_ptr": pointer,
            "k_cache_ptr": pointer, "v_cache_ptr": pointer,
            "lengths_ptr": "*i32", "mask_ptr": "*i32",
            "num_new": "i32", "capacity": "i32",
            "out_ptr": pointer, "k_cache_out_ptr": pointer, "v_cache_out_ptr": pointer,
        }

    def grid(self, batch, num_new):
        """Launch grid (x, y, z) for ``batch`` sequences of ``num_new`` new tokens.

        Written with ``+ - * //`` only, so it works on ints and on TensorRT symbolic shape
        expressions alike (the AOT plugin calls it with ``ShapeExpr`` s).
        """
        return ((num_new + (self.block_t - 1)) // self.block_t, batch * self.num_kv_heads, 1)


@functools.cache
def kernel_function(interpret: bool):
    """The kernel as a Triton ``JITFunction`` (GPU / AOT) or ``InterpretedFunction`` (CPU).

    Chosen explicitly rather than through ``TRITON_INTERPRET`` so that one process can both run the
    kernel on CPU tensors and compile it to PTX.
    """
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(_tree_attention_fwd)
    from triton.runtime.jit import JITFunction
    return JITFunction(_tree_attention_fwd)


def _check_inputs(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, cache_lengths: torch.Tensor,
                  tree_mask: torch.Tensor) -> None:
    if query.dim() != 4:
        raise ValueError(f"query must be [B, Hq, T, D], got shape {tuple(query.shape)}")
    batch, q_heads, num_new, dim = query.shape
    kv_heads, capacity = key_cache.shape[1], key_cache.shape[2]
    expected = {
        "key_new": (key_new, (batch, kv_heads, num_new, dim)),
        "value_new": (value_new, (batch, kv_heads, num_new, dim)),
        "key_cache": (key_cache, (batch, kv_heads, capacity, dim)),
        "value_cache": (value_cache, (batch, kv_heads, capacity, dim)),
        "cache_lengths": (cache_lengths, (batch,)),
        "tree_mask": (tree_mask, (batch, num_new, (num_new + MASK_WORD_BITS - 1) // MASK_WORD_BITS)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for query {tuple(query.shape)} and cache "
                             f"capacity {capacity}, got {tuple(tensor.shape)}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}: move them together")
    if query.dtype not in TORCH_TO_TRITON:
        raise ValueError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    for name in ("key_new", "value_new", "key_cache", "value_cache"):
        if expected[name][0].dtype != query.dtype:
            raise ValueError(f"{name} dtype {expected[name][0].dtype} differs from query dtype {query.dtype}")
    for name in ("cache_lengths", "tree_mask"):
        if expected[name][0].dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {expected[name][0].dtype}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")


def tree_attention(query: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, cache_lengths: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float, *, inplace: bool = False,
                   check_lengths: bool = True, block_m: int = 16, block_s: int = 64, block_n: int = 32,
                   num_warps: int = 4, num_stages: int = 2,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the Triton kernel: same arguments and results as ``tree_attention_reference``.

    CUDA tensors run the compiled kernel, CPU tensors run it in the Triton interpreter. With
    ``inplace=True`` the caches are updated in place (the TensorRT / runtime mode: O(T) work);
    otherwise they are copied first. ``check_lengths`` verifies L_b + T <= S on the host (a device
    sync; turn it off inside CUDA-graph capture or timing loops: out-of-range writes are dropped).
    """
    _check_inputs(query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask)
    batch, q_heads, num_new, dim = query.shape
    kv_heads, capacity = key_cache.shape[1], key_cache.shape[2]
    if check_lengths:
        lengths = cache_lengths.detach().cpu()
        if int(lengths.min()) < 0 or int(lengths.max()) + num_new > capacity:
            raise ValueError(f"cache_lengths + T must lie in [0, {capacity}] (T = {num_new}); got lengths "
                             f"{lengths.tolist()}: grow the cache or roll back")
    if inplace:
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("in-place caches must be contiguous tensors")
    else:
        key_cache, value_cache = key_cache.clone(memory_format=torch.contiguous_format), \
            value_cache.clone(memory_format=torch.contiguous_format)
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    spec = KernelSpec(TORCH_TO_TRITON[query.dtype], q_heads, kv_heads, dim, float(scale), block_m=block_m,
                      block_s=block_s, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                      interpreter=query.device.type == "cpu")
    kernel = kernel_function(interpret=spec.interpreter)
    with _INTERPRETER_LOCK if spec.interpreter else contextlib.nullcontext():
        kernel[spec.grid(batch, num_new)](
            query.contiguous(), key_new.contiguous(), value_new.contiguous(), key_cache, value_cache,
            cache_lengths.contiguous(), tree_mask.contiguous(), num_new, capacity,
            output, key_cache, value_cache,
            num_warps=num_warps, num_stages=num_stages, **spec.constexprs())
    return output, key_cache, value_cache
