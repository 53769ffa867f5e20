"""Run by test_moe.py in a process without TRITON_INTERPRET: compiles the fused-MoE and skinny-linear kernels
for sm_90 (no GPU needed; with programmatic dependent launch where they use it) and prints, per kernel
variant, whether it reached a cubin and what its PTX uses, as one JSON line."""

from __future__ import annotations

import json
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from hybridserve.kernels.moe_router_triton import _route_kernel, _router_logits_kernel
from hybridserve.kernels.moe_small_triton import _small_down_kernel, _small_up_kernel
from hybridserve.kernels.moe_triton import _moe_align_kernel, _moe_combine_kernel, _moe_gemm_kernel
from hybridserve.kernels.paged_attention_triton import _combine_splits_kernel, _paged_decode_kernel, _write_kv_kernel
from hybridserve.kernels.skinny_linear_triton import _skinny_linear_kernel


def compile_for_hopper(kernel: Any, signature: dict, constexprs: dict, aligned: tuple[str, ...] = (),
                       num_warps: int = 4) -> dict:
    """`aligned` args get 16-divisibility, as real launches specialize them."""
    while not isinstance(kernel, JITFunction):  # unwrap the autotuner
        kernel = kernel.fn
    names = list(kernel.arg_names)  # attrs go by the argument's position in the kernel
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=kernel, signature={**signature, **{n: "constexpr" for n in constexprs}},
                       constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 3})
    ptx = compiled.asm["ptx"]
    return {"cubin": bool(compiled.asm.get("cubin")), "cp.async": "cp.async" in ptx, "wgmma": "wgmma" in ptx,
            "ld.global.v4": "ld.global.v4" in ptx, "cp.async 16B": "cp.async.cg.shared.global" in ptx,
            "prefetch.L2": "prefetch.global.L2" in ptx, "pdl wait": "griddepcontrol.wait" in ptx,
            "pdl trigger": "griddepcontrol.launch_dependents" in ptx,
            "wgmma e4m3": "e4m3.e4m3" in ptx}


def main() -> None:
    found = {}
    pointers = {"a_ptr": "*bf16", "a_scale_ptr": "*fp32", "w_ptr": "*bf16", "ws_ptr": "*bf16", "scale_ptr": "*fp32",
                "out_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "used_rows_ptr": "*i32"}
    strides = ("N_OUT", "K", "a_m", "w_e", "w_n", "ws_e", "ws_n", "out_m")
    ints = {n: "i32" for n in ("num_pairs", "num_routed", "num_blocks", *strides)}
    for weights, block_m, a8 in (("*bf16", 16, False), ("*bf16", 128, False), ("*fp8e4nv", 16, False),
                                 ("*fp8e4nv", 128, False), ("*fp8e4nv", 128, True)):
        for up in (True, False):
            constexprs = {"SHARED": weights == "*bf16", "A_ROW_DIV": 6 if up else 1, "BLOCK_M": block_m,
                          "BLOCK_N": 64 if block_m == 16 else 128, "BLOCK_K": 128 if block_m == 16 or a8 else 64,
                          "GROUP_M": 1 if block_m == 16 else 8, "RELU2": up,
                          "HAS_SCALE": weights != "*bf16", "A_FP8": a8, "DOT_PRECISION": "tf32", "DOT_UPCAST": False}
            signature = {**pointers, "a_ptr": "*fp8e4nv" if a8 else "*bf16", "w_ptr": weights, "ws_ptr": weights,
                         "out_ptr": "*bf16", **ints}
            found[f"gemm {weights}{' a8' if a8 else ''} {'up' if up else 'down'} {block_m}"] = compile_for_hopper(
                _moe_gemm_kernel, signature, constexprs, aligned=(*pointers, *strides),
                num_warps=4 if block_m == 16 else 8)
    align = {"E": 128, "E_BINS": 128, "BLOCK_M": 16, "CHUNK": 1024, "BLOCK_CHUNK": 64}
    found["align"] = compile_for_hopper(_moe_align_kernel, {
        "ids_ptr": "*i64", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "used_rows_ptr": "*i32",
        "cursor_ptr": "*i32", "num_pairs": "i32", "num_rows": "i32", "num_blocks": "i32"}, align)
    for groups, per_group, top_groups in ((1, 128, 1), (8, 16, 4)):
        route = {"K": 6, "K_BLOCK": 8, "N_GROUP": groups, "PER_GROUP": per_group, "TOPK_GROUP": top_groups,
                 "NORM": True, "SHARED": 2}
        found[f"route {groups} groups"] = compile_for_hopper(_route_kernel, {
            "logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32",
            "scaling": "fp32"}, route)
    for shared in (False, True):
        found[f"combine shared={shared}"] = compile_for_hopper(
            _moe_combine_kernel, {"pair_ptr": "*bf16", "route_w_ptr": "*fp32", "shared_ptr": "*bf16", "out_ptr": "*bf16",
                                  "D": "i32"},
            {"K": 6, "BLOCK_D": 1024, "HAS_SHARED": shared}, aligned=("pair_ptr", "shared_ptr", "out_ptr", "D"))
    for block_k in (4096, 32):  # Nano's rows, and a tiny test model's (fewer than 64 elements)
        found[f"router logits {block_k}"] = compile_for_hopper(_router_logits_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*bf16", "logits_ptr": "*fp32", "E": "i32", "D": "i32", "x_m": "i32"},
            {"BLOCK_E": 2, "BLOCK_K": block_k, "USE_PDL": True}, aligned=("x_ptr", "w_ptr", "logits_ptr", "D", "x_m"))
    small_ints = {n: "i32" for n in ("E", "N_OUT", "K", "w_e", "w_n", "ws_e", "ws_n")}
    for weights, early in (("*bf16", False), ("*fp8e4nv", False), ("*bf16", True)):
        fp8 = weights != "*bf16"
        variant = f"{weights}{' early' if early else ''}"
        found[f"small up {variant}"] = compile_for_hopper(_small_up_kernel, {
            "x_ptr": "*bf16", "logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": weights, "ws_ptr": weights,
            "scale_ptr": "*fp32", "h_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", "arrive_ptr": "*i32",
            **small_ints, "scaling": "fp32", "x_m": "i32", "n_arrive": "i32"}, {
            "TOP_K": 6, "WIDTH": 6 if fp8 else 8, "K_BLOCK": 8, "N_GROUP": 1, "PER_GROUP": 128, "TOPK_GROUP": 1,
            "NORM": True, "SHARED": 0 if fp8 else 2, "HAS_SCALE": fp8, "BLOCK_N": 32, "BLOCK_K": 256,
            "EARLY_SHARED": early, "USE_PDL": True},
            aligned=("x_ptr", "w_ptr", "ws_ptr", "h_ptr", "K", "w_e", "w_n", "ws_e", "ws_n", "x_m"))
        if early:
            continue
        found[f"small down {variant}"] = compile_for_hopper(_small_down_kernel, {
            "h_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", "w_ptr": weights, "ws_ptr": weights,
            "scale_ptr": "*fp32", "shared_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "arrive_ptr": "*i32",
            **small_ints, "out_m": "i32", "n_arrive": "i32"}, {
            "WIDTH": 6 if fp8 else 8, "SHARED": not fp8, "HAS_SCALE": fp8, "HAS_SHARED_OUT": fp8, "BLOCK_N": 32,
            "BLOCK_K": 128, "DOT_PRECISION": "tf32", "DOT_UPCAST": False, "USE_PDL": fp8},
            aligned=("h_ptr", "w_ptr", "ws_ptr", "out_ptr", "K", "w_e", "w_n", "ws_e", "ws_n", "out_m"))
    skinny = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
              "arrive_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "x_m": "i32", "w_n": "i32", "y_m": "i32"}
    for split in (1, 4):  # the decode projections, with programmatic dependent launch and L2 prefetch
        found[f"skinny split={split}"] = compile_for_hopper(_skinny_linear_kernel, skinny, {
            "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split, "HAS_BIAS": split == 1, "DOT_PRECISION": "tf32",
            "USE_PDL": True}, aligned=("x_ptr", "w_ptr", "y_ptr", "K", "w_n", "x_m", "y_m"))
    decode_ints = {n: "i32" for n in ("page_size", "heads_per_kv", "num_q_heads", "Dh", "kv_start", "num_splits",
                               "row_blocks", "q_n", "q_h", "q_d", "k_p", "k_o", "k_h", "k_d", "v_p", "v_o", "v_h", "v_d",
                               "o_n", "o_h", "o_d", "t_s", "t_p")}
    found["attention decode"] = compile_for_hopper(_paged_decode_kernel, {  # the decode attention chain, under PDL
        "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32",
        "acc_ptr": "*fp32", "cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "tables_ptr": "*i32", "scale": "fp32",
        "v_scale": "fp32", **decode_ints},
        {"T": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": True, "USE_PDL": True})
    found["attention combine"] = compile_for_hopper(_combine_splits_kernel, {
        "out_ptr": "*bf16", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "cu_q_ptr": "*i32",
        **{n: "i32" for n in ("num_q_heads", "Dh", "num_splits", "o_n", "o_h", "o_d")}},
        {"T": 1, "BLOCK_S": 16, "BLOCK_D": 128, "USE_PDL": True})
    found["attention write_kv"] = compile_for_hopper(_write_kv_kernel, {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "kp_ptr": "*bf16", "vp_ptr": "*bf16", "slot_ptr": "*i64",
        "inv_k_scale": "fp32", "inv_v_scale": "fp32",
        **{n: "i32" for n in ("page_size", "Hkv", "Dh", "k_n", "k_h", "k_d", "v_n", "v_h", "v_d", "kp_p", "kp_o", "kp_h",
                              "kp_d", "vp_p", "vp_o", "vp_h", "vp_d")}},
        {"BLOCK_H": 2, "BLOCK_D": 128, "FP8": False, "USE_PDL": True})
    print(json.dumps(found))


if __name__ == "__main__":
    main()
