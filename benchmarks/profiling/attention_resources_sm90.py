"""Registers, spills and software pipelining of the attention kernels for sm_90, without a GPU.

Compiles each shipped forward launch of the attention kernels (``rl_engine.backends.triton.attention``:
``portable_forward``, ``split_kv_combine``; with ``--split-wg`` / ``--split-wgt`` / ``--fwd-wg``
the Hopper ``hopper_warpgroup`` / ``hopper_transposed_decode`` kernels) ahead of time for an
H100/H200 (``GPUTarget("cuda", 90, 128)``) with the Triton installed here, assembles the PTX with
the ``ptxas`` that Triton bundles (``-v``), and reports per kernel
variant: registers per thread, spill stores, whether the key/value loads are software-pipelined
(``cp.async`` copies in the PTX) and the PTX size. A proxy, not a measurement: the Triton here
may differ from the device's (the H200 image has Triton 3.6), and only a timed run on the device
says what is fast.

Arguments are specialised as a real launch specialises them: pointers and the strides of the
K/V storage rows divisible by 16 (``tt.divisibility``), which decides load vectorisation and
pipelining. Without it (``--no-divisibility``, the negative control) the loads stay scalar and
unpipelined and the decode kernel spills (255 registers): a finding of the compile setup
rather than of the kernel.

Usage::

    python benchmarks/profiling/attention_resources_sm90.py --out /tmp/attention_resources.json
    python benchmarks/profiling/attention_resources_sm90.py --out /tmp/a.json --kernels decode --no-divisibility
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: Kernel arguments that a launch on real tensors specialises as divisible by 16 (pointers, the
#: row / head strides of storage rows laid out ``[N, Hkv, D]`` with ``D`` a multiple of 16, the head counts).
DIVISIBLE = frozenset({"q_ptr", "k_ptr", "v_ptr", "out_ptr", "out32_ptr", "lse_ptr", "scr_ptr", "ws_m_ptr", "ws_l_ptr",
                       "ws_a_ptr", "tab_ptr", "pr_ptr", "sk_row", "sk_head", "sv_row", "sv_head"})
_FP32 = frozenset({"out32_ptr", "lse_ptr", "scr_ptr", "ws_m_ptr", "ws_l_ptr", "ws_a_ptr"})
_I64 = frozenset({"tab_ptr", "pr_ptr"})
_SCALARS = {"pr_stride": "i64", "sk_row": "i64", "sk_head": "i64", "sv_row": "i64", "sv_head": "i64", "W": "i32",
            "qk_scale": "fp32", "NS": "i32", "HQ": "i32", "HKV": "i32"}


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: its name, the compile-time constants and launch options."""

    label: str
    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int


@dataclass
class Resources:
    label: str
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    cp_async: int
    ptx_lines: int
    seconds: float
    #: TMA copies (``cp.async.bulk.tensor``) in the PTX: the train path's key / value blocks with
    #: ``TMA=True`` (``Variant.PACKED_TMA``)
    tma_copies: int = 0
    #: shared memory per program (bytes, Triton's compiled metadata: pipeline buffers and layout
    #: conversions); an H200 SM has 228 KiB, of which each resident program takes this plus 1 KiB
    #: the system reserves, so this decides how many programs share an SM
    shared_bytes: int = 0
    #: the Gluon decode kernels: CTA barriers in the unmasked run's loop (one trip: one or four
    #: blocks; ``_loop_barriers``), -1 where not counted
    barriers_per_step: int = -1
    #: sha256 of the PTX instruction sequence with register numbers, debug lines and comments
    #: removed (``ptx_digest``): equal digests at two commits mean a source change (a device function
    #: factored out, a rename) compiled to the same instructions in the same order;
    #: ``ptx_multiset_digest``: the same instructions in the same numbers, in any order
    ptx_digest: str = ""
    ptx_multiset_digest: str = ""
    #: tensor-core products in the PTX: Hopper's asynchronous warpgroup MMAs (``wgmma.mma_async``,
    #: which Triton emits for tiles of at least 64 rows a warpgroup) and Ampere-style ``mma.sync``
    wgmma: int = 0
    mma_sync: int = 0

    @property
    def pipelined(self) -> bool:
        return self.cp_async > 0 or self.tma_copies > 0


def stages_of(cfg, head_dim: int) -> int:
    """The pipeline depth ``launch.attend`` launches ``cfg`` with (16-bit): four-block steps keep
    three stages only with at most 64 value columns."""
    if cfg.unroll == 4 and head_dim // cfg.v_slices > 64:
        return min(cfg.num_stages, 2)
    return cfg.num_stages


def signature(fn, dtype: str, constexprs: dict) -> dict:
    """The argument types of a kernel call with ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``) q/k/v."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("k_desc", "v_desc"):  # TMA descriptors of 64-row blocks, else unused pointers
            cols = constexprs["HEAD_D"] if name == "k_desc" else constexprs.get("DV", constexprs["HEAD_D"])
            rows = 256 if name == "k_desc" and constexprs.get("U") == 4 else 64  # rlk_attn_quad: four key blocks
            sig[name] = f"tensordesc<{dtype}[{rows},{cols}]>" if constexprs.get("TMA") else f"*{dtype}"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in _FP32 else ("*i64" if name in _I64 else f"*{dtype}")
        else:
            sig[name] = _SCALARS[name]
    return sig


def kernel(name: str):
    """The ``@triton.jit`` / ``@gluon.jit`` kernel ``name`` from the attention module that defines it."""
    import importlib

    for module in ("portable_forward", "split_kv_combine", "hopper_warpgroup", "hopper_transposed_decode"):
        mod = importlib.import_module(f"rl_engine.backends.triton.attention.{module}")
        if name in mod.KERNEL_NAMES:
            return getattr(mod, name)
    raise KeyError(f"no attention kernel named {name!r}")


def compile_sm90(variant: Variant, dtype: str = "bf16", divisibility: bool = True) -> Resources:
    """Compile ``variant`` for sm_90 and read its resources from ``ptxas -v``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel(variant.kernel)
    sig = signature(fn, dtype, variant.constexprs)
    attrs = ({(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
              if n in DIVISIBLE and t != "constexpr"} if divisibility else {})
    t0 = time.perf_counter()
    src = ASTSource(fn=fn, signature=sig, constexprs=variant.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages,
                                       "enable_fp_fusion": False, "launch_pdl": bool(variant.constexprs.get("PDL"))})
    return _assembled(compiled, variant.label, variant.kernel, t0)


def _assembled(compiled, label: str, kernel: str, t0: float, no_frame_is_zero: bool = False) -> Resources:
    """``compiled``'s PTX assembled by Triton's bundled ``ptxas -v`` for sm_90a: its resources
    (``t0``: when the compile started). ``no_frame_is_zero``: a kernel without a stack frame gets
    no spill line from ptxas (the Gluon kernel), read as 0 bytes."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    log = run.stderr

    def num(pattern: str, spill: bool = False) -> int:
        m = re.search(pattern, log)
        if m is None:
            if spill and no_frame_is_zero:
                return 0
            raise RuntimeError(f"ptxas -v: no match for {pattern!r} in:\n{log}")
        return int(m.group(1))

    return Resources(label=label, kernel=kernel, registers=num(r"Used (\d+) registers"), ptx_digest=ptx_digest(ptx),
                     ptx_multiset_digest=ptx_digest(ptx, ordered=False),
                     spill_store_bytes=num(r"(\d+) bytes spill stores", True),
                     spill_load_bytes=num(r"(\d+) bytes spill loads", True),
                     cp_async=len(re.findall(r"cp\.async\.c[ag]\.", ptx)), ptx_lines=ptx.count("\n"),
                     seconds=round(time.perf_counter() - t0, 2), tma_copies=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                     shared_bytes=int(compiled.metadata.shared), wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                     mma_sync=len(re.findall(r"\bmma\.sync", ptx)))


def ptx_digest(ptx: str, ordered: bool = True) -> str:
    """sha256 of ``ptx``'s instructions in order (``ordered``; else sorted: the multiset): register
    numbers (``%r12`` -> ``%r``), source locations, labels of the debug info, comments and the
    debug sections' data removed."""
    keep = []
    for line in ptx.split("\n"):
        t = line.split("//")[0].strip()
        if not t or t.startswith((".loc", ".file", ".b8", ".b16", ".b32", ".b64", "$L__tmp", ".section", "{", "}")):
            continue
        keep.append(re.sub(r"%(r|rd|p|f|fd|rs|h|hh)\d+", r"%\1", t))
    return hashlib.sha256("\n".join(keep if ordered else sorted(keep)).encode()).hexdigest()


def compile_fwd_wg_sm90(multi: bool, window: bool, store: bool) -> Resources:
    """Compile the train path's Gluon forward (``hopper_warpgroup.rlk_attn_fwd_wg``, bf16, D = 128, G = 4,
    ``AttentionTuning.wg_forward_block_m``-row tiles) for sm_90a with ``AttentionTuning.wg_forward_rings[multi]``: KV splits merged (``multi``), a window, the
    backward's fp32 output and lse stored (``store``). Needs Triton 3.6's Gluon Hopper API."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from rl_engine.backends.triton.attention.hopper_common import BLOCK_N
    from rl_engine.backends.triton.attention.tuning import current_tuning

    fn = kernel("rlk_attn_fwd_wg")
    tuning = current_tuning()
    d = 128
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.bfloat16)
    desc = f"tensordesc<bf16[{BLOCK_N},{d}],{layout!r}>"
    sig = {"q_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "out_ptr": "*bf16", "out32_ptr": "*fp32",
           "lse_ptr": "*fp32", "scr_ptr": "*fp32", "tab_ptr": "*i64", "pr_ptr": "*i64", "pr_stride": "i64",
           "W": "i32", "qk_scale": "fp32", "HQ": "i32", "HKV": "i32"}
    k_st, v_st, regs = tuning.wg_forward_rings[multi]
    const = {"G": 4, "HEAD_D": d, "HAS_WINDOW": window, "STORE_F32": store, "STORE_LSE": store, "MULTI": multi,
             "SB": tuning.split_blocks, "K_ST": k_st, "V_ST": v_st, "BLOCK_ROWS": tuning.wg_forward_block_m, "PDL": True}
    sig.update({n: "constexpr" for n in const})
    label = f"fwd_wg multi={multi} window={window} store={store}"
    t0 = time.perf_counter()
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": tuning.wg_forward_block_m // 16, "enable_fp_fusion": False, "launch_pdl": True,
                                       **({} if regs is None else {"maxnreg": int(regs)})})
    return _assembled(compiled, label, "rlk_attn_fwd_wg", t0, no_frame_is_zero=True)


def compile_split_wg_sm90(page_size: int, dv: int, slots: int, one: bool, finish: bool = False,
                          group: int = 4) -> Resources:
    """Compile the Gluon paged decode split kernel (``hopper_warpgroup.rlk_attn_split_wg``, bf16,
    D = 128) for sm_90a and read its resources from ``ptxas -v``. Needs Triton 3.6's Gluon Hopper API
    (``eligibility.has_gluon_hopper``)."""
    label = f"split_wg pages{page_size} dv{dv} slots{slots} one={one}{' finish' if finish else ''}"
    return _compile_decode_gluon("rlk_attn_split_wg", label, page_size, dv, {"PS": page_size, "G": group, "ONE": one,
                                                                             "ST": slots, "FINISH": finish})


def compile_split_wgt_sm90(page_size: int | None, dv: int, slots: int, one: bool, finish: bool = False,
                           quad: bool = False, rows: int = 8, group: int = 4) -> Resources:
    """Compile the transposed decode split kernel (``hopper_transposed_decode.rlk_attn_split_wgt``, bf16, D = 128)
    for sm_90a: a contiguous cache (``page_size=None``: 64-row block copies) or ``page_size``-key
    pages, ``rows`` query rows (``NQ``), one or four blocks a step (``quad``, ``slots`` four-block
    slots). ``barriers_per_step`` counts the CTA barriers (``bar.sync``) in the unmasked run's loop
    of one (four) blocks. Needs Triton 3.6's Gluon Hopper API."""
    from rl_engine.backends.triton.attention.hopper_transposed_decode import exchange_layouts

    x_layout, f_layout = exchange_layouts(rows)
    ps = 64 if page_size is None else page_size
    label = (f"split_wgt {'contiguous' if page_size is None else f'pages{page_size}'} dv{dv} nq{rows} "
             f"{'quad ' if quad else ''}slots{slots} one={one}{' finish' if finish else ''}")
    return _compile_decode_gluon("rlk_attn_split_wgt", label, 256 if quad and page_size is None else ps, dv, {
        "PS": ps, "PAGED": page_size is not None, "G": group, "NQ": rows, "ONE": one, "ST": slots, "FINISH": finish,
        "X_LAYOUT": x_layout, "F_LAYOUT": f_layout, "QUAD": quad})


def _compile_decode_gluon(name: str, label: str, box_rows: int, dv: int, const: dict) -> Resources:
    """One of the Gluon decode split kernels compiled for sm_90a (``box_rows``-row TMA boxes of the
    keys and ``dv`` value columns; ``const``: its compile-time constants besides the shared ones),
    with the CTA barriers of its first loop that issues ``wgmma`` (the unmasked run's walk)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from rl_engine.backends.triton.attention.tuning import current_tuning

    fn = kernel(name)
    d = 128

    def desc(cols: int) -> str:
        return f"tensordesc<bf16[{box_rows},{cols}],{gl.NVMMASharedLayout.get_default_for([64, cols], gl.bfloat16)!r}>"

    sig = {"q_ptr": "*bf16", "k_desc": desc(d), "v_desc": desc(dv), "k_ptr": "*bf16", "v_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_a_ptr": "*fp32", "tab_ptr": "*i64", "pr_ptr": "*i64",
           **{n: _SCALARS[n] for n in ("pr_stride", "qk_scale", "sk_row", "sk_head", "sv_row", "sv_head", "NS", "HQ",
                                       "HKV")}}
    const = {"HEAD_D": d, "DV": dv, "WS_M": 16, "PDL": True, "SB": current_tuning().split_blocks, "ORDER": 2, **const}
    sig.update({n: "constexpr" for n in const})
    t0 = time.perf_counter()
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": 4, "enable_fp_fusion": False, "launch_pdl": True})
    r = _assembled(compiled, label, name, t0, no_frame_is_zero=True)
    r.barriers_per_step = _loop_barriers(compiled.asm["ptx"])
    return r


def _loop_barriers(ptx: str) -> int:
    """``bar.sync`` instructions in the first PTX loop (a backward branch's body) that issues a
    ``wgmma``; -1 if none."""
    lines = ptx.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = "\n".join(lines[labels[m.group(1)]:i])
            if "wgmma.mma_async" in body:
                return body.count("bar.sync")
    return -1


def variants(kinds: Sequence[str] = ("decode", "prefill", "combine"), head_dim: int = 128, group: int = 4) -> Iterator[Variant]:
    """The shipped forward launches for 16-bit inputs (default Qwen3-8B: D = 128, G = 4, no window)."""
    import torch
    from dataclasses import replace

    from rl_engine.backends.triton.attention import configs as C
    from rl_engine.backends.triton.attention.tuning import current_tuning

    common = {"G": group, "HEAD_D": head_dim, "HAS_WINDOW": False, "PDL": True, "SB": current_tuning().split_blocks}
    if "decode" in kinds:
        for paged, page in ((False, None), (True, 16)):
            # the split tile, the many-pairs tile, the few-programs tile (sliced, one or two blocks
            # per step: configs.pair_blocks); a tile two selections share is compiled once
            tiles = {C.select_decode(torch.bfloat16, head_dim, page): (1,),
                     C.select_decode(torch.bfloat16, head_dim, page, many=True): (1,)}
            few = C.select_decode(torch.bfloat16, head_dim, page, few=True)
            multi = C.multi_block_steps(head_dim)  # D = 256: one block a step
            for u in (1, 2) if multi else (1,):
                tiles[replace(few, unroll=u)] = (1, *(v for v in (2, 4, 8) if head_dim // v >= 16))
            if multi:  # four blocks a step where the step is sliced (configs.quad_blocks), at value_slices' slicings
                tiles[C.quad_tile(few)] = tuple(v for v in (2, 4) if v <= C.MAX_V_SLICES
                                                and head_dim // v >= C.MIN_V_COLUMNS)
            few_tiles = {replace(few, unroll=u) for u in (1, 2)} | {C.quad_tile(few)}
            for base, slicings in tiles.items():
                # the grid order configs.split_grid_order's rule gives: splits first for the
                # few-programs tiles, kv heads first otherwise (program-id arithmetic only)
                order = 2 if base in few_tiles else 1
                for vs in slicings:
                    cfg = replace(base, v_slices=vs)
                    for one in (False, True):
                        # contiguous caches: the unmasked run by TMA copies (eligibility.decode_tma_eligible)
                        yield Variant(f"split {'paged16' if paged else 'contiguous'} {cfg.key} one={one}",
                                      "rlk_attn_fwd_split",
                                      {**common, "page_size": page or 1, "DV": head_dim // vs, "BLOCK_M": cfg.block_m,
                                       "PAGED": paged, "IEEE": False, "SPLIT": True, "ONE": one, "U": cfg.unroll,
                                       "TMA": not paged, "ORDER": order},
                                      cfg.num_warps, stages_of(cfg, head_dim))
        # a decode step of one KV split runs the prefill kernel with the few-programs tile; over a
        # contiguous cache its unmasked run by TMA copies (eligibility.decode_tma_eligible); unsliced,
        # one or two blocks a step (configs.pair_blocks), sliced, four (configs.quad_blocks)
        few = C.select_decode(torch.bfloat16, head_dim, None, few=True)
        multi = C.multi_block_steps(head_dim)
        one_split = [replace(C.quad_tile(few) if multi and C.quad_blocks(vs) else few, v_slices=vs)
                     for vs in (1, 2, 4) if vs <= C.MAX_V_SLICES and head_dim // vs >= C.MIN_V_COLUMNS]
        for cfg in one_split + ([replace(few, unroll=2)] if multi else []):
            vs = cfg.v_slices
            yield Variant(f"fwd contiguous {cfg.key} one=True tma", "rlk_attn_fwd",
                          {**common, "page_size": 1, "DV": head_dim // vs, "BLOCK_M": cfg.block_m, "PAGED": False,
                           "IEEE": False, "STORE_F32": False, "STORE_LSE": False, "SPLIT": True, "MULTI": False,
                           "ONE": True, "TMA": True, "U": cfg.unroll, "TMA_EDGE": False}, cfg.num_warps,
                          stages_of(cfg, head_dim))
    if "prefill" in kinds:
        for paged, page in ((False, None), (True, 16)):
            cfg = C.select_prefill(torch.bfloat16, head_dim, page)
            for multi in (False, True):
                yield Variant(f"prefill {'paged16' if paged else 'contiguous'} {cfg.key} multi={multi}", "rlk_attn_fwd",
                              {**common, "page_size": page or 1, "DV": head_dim, "BLOCK_M": cfg.block_m, "PAGED": paged,
                               "IEEE": False, "STORE_F32": False, "STORE_LSE": False, "SPLIT": True, "MULTI": multi,
                               "ONE": False, "TMA": False, "U": cfg.unroll, "TMA_EDGE": False}, cfg.num_warps,
                              cfg.num_stages)
        # the train path (varlen_forward, packed rows): TMA copies, fp32 output and lse stored
        cfg = C.select_prefill(torch.bfloat16, head_dim)
        for multi in (False, True):
            yield Variant(f"train tma {cfg.key} multi={multi}", "rlk_attn_fwd",
                          {**common, "page_size": 1, "DV": head_dim, "BLOCK_M": cfg.block_m, "PAGED": False,
                           "IEEE": False, "STORE_F32": True, "STORE_LSE": True, "SPLIT": True, "MULTI": multi,
                           "ONE": False, "TMA": True, "U": cfg.unroll, "TMA_EDGE": True}, cfg.num_warps, cfg.num_stages)
    if "combine" in kinds:
        cfg = C.select_decode(torch.bfloat16, head_dim)
        for grp in (1, 2, 4, 8, 16):  # configs.combine_group: the launch's splits, a power of two up to 16
            yield Variant(f"combine {cfg.key} group={grp}", "rlk_attn_combine",
                          {**common, "BLOCK_M": cfg.block_m, "DC": min(head_dim, C.COMBINE_COLUMNS),
                           "STORE_F32": False, "STORE_LSE": False, "ONE": True, "GROUP": grp}, cfg.num_warps, 1)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    ap.add_argument("--kernels", default="decode,prefill,combine", help="comma-separated subset of decode,prefill,combine")
    ap.add_argument("--split-wg", action="store_true",
                    help="also the Gluon paged decode split kernel (hopper_warpgroup.rlk_attn_split_wg; needs Triton 3.6)")
    ap.add_argument("--split-wgt", action="store_true",
                    help="also the transposed decode split kernel (hopper_transposed_decode.rlk_attn_split_wgt; "
                         "needs Triton 3.6)")
    ap.add_argument("--fwd-wg", action="store_true",
                    help="also the train path's Gluon forward (hopper_warpgroup.rlk_attn_fwd_wg; needs Triton 3.6)")
    ap.add_argument("--no-divisibility", action="store_true",
                    help="compile without the divisibility a real launch specialises (negative control)")
    ap.add_argument("--head-dim", type=int, default=128,
                    help="the head dim of the portable kernels' launches (configs.HEAD_DIMS; default 128)")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kernels.split(",") if k)
    if not kinds or any(k not in ("decode", "prefill", "combine") for k in kinds):
        ap.error(f"--kernels: expected a subset of decode,prefill,combine, got {args.kernels!r}")
    try:
        import triton
    except ImportError:
        print("attention_resources_sm90: needs triton (with its NVIDIA backend and bundled ptxas)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("attention_resources_sm90: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    rows = []
    if args.split_wg or args.split_wgt or args.fwd_wg:
        from rl_engine.backends.triton.attention.eligibility import WG_DECODE_PAGE_SIZES, has_gluon_hopper
        from rl_engine.backends.triton.attention.tuning import current_tuning

        tuning = current_tuning()
        if not has_gluon_hopper():
            print(f"attention_resources_sm90: --split-wg / --split-wgt / --fwd-wg need Triton 3.6's Gluon Hopper API, "
                  f"found triton {triton.__version__}", file=sys.stderr)
            return 2
        gluon_rows = []
        if args.fwd_wg:
            gluon_rows += [(compile_fwd_wg_sm90, (multi, window, store)) for multi in (False, True)
                           for window in (False, True) for store in (False, True)]
        if args.split_wg:
            gluon_rows += [(compile_split_wg_sm90, (ps, dv, tuning.wg_decode_slots, one, finish))
                           for ps in WG_DECODE_PAGE_SIZES for dv in (128, 64)
                           for one, finish in ((True, False), (False, False), (True, True))]
        if args.split_wgt:
            # one block a step at the shipped value slices (64 columns) and one slice; four blocks a
            # step (64 columns, two four-block slots), contiguous caches and pages
            for ps in (None, *WG_DECODE_PAGE_SIZES):
                for nq in (8, 16):
                    for one, finish in ((True, False), (False, False), (True, True)):
                        gluon_rows += [(compile_split_wgt_sm90, (ps, dv, tuning.wgt_decode_slots, one, finish, False, nq))
                                       for dv in (64, 128)]
                        gluon_rows.append((compile_split_wgt_sm90,
                                           (ps, 64, tuning.wgt_quad_slots, one, finish, True, nq)))
        for compile_fn, fn_args in gluon_rows:
            r = compile_fn(*fn_args)
            rows.append(asdict(r))
            print(f"{r.label:60s} regs {r.registers:3d}  spill {r.spill_store_bytes:4d} B  "
                  f"smem {r.shared_bytes // 1024:3d} KiB  TMA copies {r.tma_copies:3d}  "
                  f"barriers/step {r.barriers_per_step:3d}  {r.seconds:5.1f} s", flush=True)
    from rl_engine.backends.triton.attention.configs import HEAD_DIMS

    if args.head_dim not in HEAD_DIMS:
        ap.error(f"--head-dim: expected one of {list(HEAD_DIMS)}, got {args.head_dim}")
    todo = list(variants(kinds, head_dim=args.head_dim))
    for i, v in enumerate(todo, 1):
        r = compile_sm90(v, divisibility=not args.no_divisibility)
        rows.append({**asdict(r), "pipelined": r.pipelined, "num_warps": v.num_warps, "num_stages": v.num_stages})
        print(f"[{i:2d}/{len(todo)}] {r.label:52s} regs {r.registers:3d}  spill {r.spill_store_bytes:4d} B  "
              f"smem {r.shared_bytes // 1024:3d} KiB  wgmma {r.wgmma:3d}  mma.sync {r.mma_sync:3d}  "
              f"{'pipelined' if r.pipelined else 'NOT pipelined':13s} ptx {r.ptx_lines:5d} lines  {r.seconds:5.1f} s",
              flush=True)
    report = {"schema_version": 1, "tool": "attention_resources_sm90", "target": "cuda sm_90 (offline)",
              "triton": triton.__version__, "divisibility": not args.no_divisibility,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
