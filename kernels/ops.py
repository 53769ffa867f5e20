"""The ops the model calls. Each picks the implementation for the tensors' device: the Triton kernel on
CUDA where one exists, the pure-torch reference otherwise (CPU, and the oracle in tests).

Model code imports from here only, so a new kernel is wired in by changing one function in this file.
"""

from __future__ import annotations

from hybridserve.kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from hybridserve.kernels.gated_rmsnorm import gated_rmsnorm_ref, rmsnorm_ref
from hybridserve.kernels.paged_attention import paged_attention_ref, write_kv_pages
from hybridserve.kernels.ssd_scan import ssd_scan_varlen_ref
from hybridserve.kernels.state_update import multi_token_state_update_ref, selective_state_update_ref

ssd_scan_varlen = ssd_scan_varlen_ref
causal_conv1d_varlen = causal_conv1d_varlen_ref
causal_conv1d_update = causal_conv1d_update_ref
selective_state_update = selective_state_update_ref
multi_token_state_update = multi_token_state_update_ref
paged_attention = paged_attention_ref
write_kv = write_kv_pages
gated_rmsnorm = gated_rmsnorm_ref
rmsnorm = rmsnorm_ref

__all__ = [
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "gated_rmsnorm",
    "multi_token_state_update",
    "paged_attention",
    "rmsnorm",
    "selective_state_update",
    "ssd_scan_varlen",
    "write_kv",
]
