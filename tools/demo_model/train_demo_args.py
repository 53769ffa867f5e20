"""Command-line options of tools/demo_model/train_demo.py (defaults: the shipped demo model's run)."""

from __future__ import annotations

import argparse
from pathlib import Path

SCAN_CONFIGS = Path(__file__).resolve().parent / "demo_scan_configs_h200.json"


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=None, help="archive of tools/demo_model/train_demo_fetch.py (default: stdlib)")
    p.add_argument("--tar", type=Path, default=None, help="also pack --out-dir into this tar (after saving)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer-mb", type=float, default=24.0, help="train the tokenizer on this much text")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--pattern", default="M-*M-M*-")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--mlp-intermediate", type=int, default=2048)
    p.add_argument("--mamba-head-dim", type=int, default=64)
    p.add_argument("--ssm-state", type=int, default=32)
    p.add_argument("--n-groups", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-depths", type=int, default=3, help="recurrent MTP depths trained (drafts K)")
    p.add_argument("--mtp-weight", type=float, default=0.3, help="loss weight of each MTP depth")
    p.add_argument("--max-steps", type=int, default=None, help="fixed step count (default: fit the budget)")
    p.add_argument("--total-budget-s", type=float, default=450.0, help="wall time of the whole script")
    p.add_argument("--eval-reserve-s", type=float, default=110.0, help="kept for saving and evaluation")
    p.add_argument("--calib-steps", type=int, default=30, help="steps timed to size the run to the budget")
    p.add_argument("--heldout-percent", type=int, default=4)
    p.add_argument("--validation-percent", type=int, default=3, help="files that pick the best step")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows evaluated at the end")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-prompts", type=int, default=64,
                   help="held-out function prompts of transformers' parse test and of the MTP acceptance runs")
    p.add_argument("--engine-eval-prompts", type=int, default=256,
                   help="held-out function prompts of the engine's parse test (default: all, ~160)")
    p.add_argument("--gen-tokens", type=int, default=256, help="long enough for every held-out body (longest 184)")
    p.add_argument("--repetition-penalty", type=float, default=1.1,
                   help="shipped in generation_config.json as the model's sampling default (1: none); a small "
                   "model loops under plain greedy decoding (bench/results/h200/demo_model/)")
    p.add_argument("--max-dup-line-fraction", type=float, default=1.0,
                   help="drop training files whose lines are mostly copies of each other, e.g. 0.5 (default 1: keep "
                   "all, as the shipped model; 0.5 did not help: bench/results/h200/demo_model/)")
    p.add_argument("--no-engine-eval", action="store_true", help="skip the hybridserve engine evaluation")
    p.add_argument("--max-files", type=int, default=None, help="debug: only the first N files")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="reuse a trained tokenizer")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the loss function (default: on CUDA; 1.8-2x faster steps on an H200: "
                   "bench/results/h200/demo_model/)")
    p.add_argument("--scan-configs", type=Path, default=None,
                   help="pin mamba_ssm's autotuned kernels to the configs of this file (what --scan-configs-out "
                   f"wrote) instead of benchmarking them all at start-up (default on CUDA: {SCAN_CONFIGS.name}, "
                   "tuned on an H200, unless --scan-configs-out is given; `none`: benchmark them all)")
    p.add_argument("--scan-configs-out", type=Path, default=None,
                   help="write the configs mamba_ssm's autotuner picked to this file (for --scan-configs)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps, profile this many steps (torch.profiler: the kernels' GPU time into "
                   "<out-dir>/profile.txt), then stop without saving a model")
    p.add_argument("--torch-scan", action="store_true", help="train with transformers' torch scan, not mamba_ssm's")
    p.add_argument("--line-break-rate", type=float, default=0.15,
                   help="share of training line ends encoded as a piece boundary (prompts ending in a newline)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this demo checkpoint (its shapes and MTP module; e.g. models/demo_model) instead "
                   "of random weights: a fine-tuning run, e.g. with --ditto-batch")
    p.add_argument("--ditto-batch", type=int, default=0,
                   help="pseudo-repetitive windows per step trained with DITTO's anti-loop loss (0: off; "
                   "tools/demo_model/train_demo_ditto.py)")
    p.add_argument("--ditto-lambda", type=float, default=0.5, help="DITTO's decay of a repeated token's probability")
    p.add_argument("--ditto-weight", type=float, default=1.0, help="weight of the DITTO loss")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.compile is None:
        args.compile = cuda
    if args.scan_configs is not None and str(args.scan_configs) == "none":
        args.scan_configs = None  # benchmark every config, as mamba_ssm does
    elif args.scan_configs is not None and not args.scan_configs.is_file():
        p.error(f"--scan-configs {args.scan_configs}: no such file (give one that --scan-configs-out wrote, or none)")
    elif args.scan_configs is None and cuda and args.scan_configs_out is None and SCAN_CONFIGS.is_file():
        args.scan_configs = SCAN_CONFIGS  # the default; not when recording picks (pinned kernels pick nothing)
    if args.ditto_batch < 0 or not 0.0 < args.ditto_lambda < 1.0:
        p.error(f"--ditto-batch must be >= 0 and --ditto-lambda in (0, 1), got {args.ditto_batch}, {args.ditto_lambda}")
    if args.init_from is not None and not (args.init_from / "config.json").is_file():
        p.error(f"--init-from {args.init_from}: no config.json there (give a directory train_demo.py wrote)")
    if args.calib_steps <= 10:
        p.error("--calib-steps must exceed 10 (steps 10..calib-steps are timed)")
    if args.profile_steps < 0:
        p.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.profile_steps and args.max_steps is not None and args.max_steps < args.calib_steps + args.profile_steps:
        p.error(f"--max-steps {args.max_steps} ends before the profiled steps (--calib-steps {args.calib_steps} + "
                f"--profile-steps {args.profile_steps}); raise it or leave it unset")
    return args
