"""Compute ops for the hybrid models.

`<op>.py` holds the pure-torch reference (the CPU path and the oracle for every Triton kernel);
`<op>_triton.py` beside it holds the Triton kernel(s) and launcher with the same signature, imported only
on the GPU path (and by the interpreter tests) so a CPU install needs no triton. `ops` picks between them.
`skinny_linear_triton` (decode projections, split-K for few output columns) holds its kernel and its oracle,
torch's linear, in one file; the other modules (`launch`, `host_index`, `ssd_scan_meta`, `triton_utils`) are
launch and metadata helpers.
`triton_utils.pdl_gate` is how a decode kernel takes part in programmatic dependent launch (Hopper+).
"""

from hybridserve.kernels.causal_conv1d import ConvVarlenOutput, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from hybridserve.kernels.gated_rmsnorm import gated_rmsnorm_ref, rmsnorm_ref
from hybridserve.kernels.paged_attention import paged_attention_ref, write_kv_pages
from hybridserve.kernels.ssd_scan import SSDScanOutput, process_dt, ssd_scan_varlen_ref
from hybridserve.kernels.state_update import multi_token_state_update_ref

__all__ = [
    "ConvVarlenOutput",
    "SSDScanOutput",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen_ref",
    "gated_rmsnorm_ref",
    "multi_token_state_update_ref",
    "paged_attention_ref",
    "process_dt",
    "rmsnorm_ref",
    "ssd_scan_varlen_ref",
    "write_kv_pages",
]
