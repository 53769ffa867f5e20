"""Train the embedded demo model: a small NemotronH (Mamba2 + attention + MLP) with one MTP step, on the
Python source of the running interpreter's standard library.

Writes a transformers checkpoint (config.json, model.safetensors in bf16 with the `mtp.*` tensors added,
tokenizer files), a model card (README.md) and training_report.json into --out-dir.

    python tools/demo_model/train_demo.py --out-dir models/demo_model               # GPU, ~9 minutes
    # with mamba_ssm 2.3.2's sdist unpacked under .peer/ (bench/kernels/peer.py) the scan trains 4.4x faster
    python tools/demo_model/train_demo.py --out-dir /tmp/demo --device cpu --max-steps 5 --max-files 40   # smoke test

MTP semantics (vLLM's nemotron_h_mtp layout): with the trunk's final-normed hidden states h_0..h_{L-1},
slot q = 1..L-1 computes u_q = eh_proj([enorm(embed(x_q)), hnorm(h_{q-1})]), then for each MTP layer
u = u + mixer(norm(u)) (causal attention over the slots, no positional embedding), g_q = final_layernorm(u),
and lm_head(g_q) predicts x_{q+1}. Embedding and lm_head are the trunk's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path
from types import ModuleType

# keep this folder off sys.path: its siblings are loaded by path below, under their own names
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import torch  # noqa: E402
from torch import nn  # noqa: E402

logger = logging.getLogger("train_demo")



def _sibling(name: str) -> ModuleType:
    """Import tools/demo_model/<name>.py by path (the folder itself stays off sys.path, see above)."""
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None  # the file ships next to this one
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_data = _sibling("train_demo_data")
_mtp = _sibling("train_demo_mtp")
_card = _sibling("train_demo_card")
_eval = _sibling("train_demo_eval")
_scan = _sibling("train_demo_scan")
_ditto = _sibling("train_demo_ditto")
parse_args = _sibling("train_demo_args").parse_args
EOS, load_corpus, train_tokenizer = _data.EOS, _data.load_corpus, _data.train_tokenizer
encode_stream, windows_of = _data.encode_stream, _data.windows_of
MTP, init_mtp, forward_losses, model_card = _mtp.MTP, _mtp.init_mtp, _mtp.forward_losses, _card.model_card


# ------------------------------------------------------------------------------------------- training


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def model_config(args: argparse.Namespace, vocab: int, eos: int) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "hybrid_override_pattern": args.pattern,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "intermediate_size": args.mlp_intermediate,
        "mamba_num_heads": 2 * args.hidden // args.mamba_head_dim,
        "mamba_head_dim": args.mamba_head_dim,
        "ssm_state_size": args.ssm_state,
        "n_groups": args.n_groups,
        "conv_kernel": 4,
        "chunk_size": args.chunk_size,
        "max_position_embeddings": 4096,
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "tie_word_embeddings": False,
    }


def save_checkpoint(trunk, mtp: MTP, cfg: dict, mtp_kinds: list[str], out_dir: Path,  # noqa: ANN001
                    repetition_penalty: float = 1.0) -> dict:
    """save_pretrained (bf16), then add `mtp.*` to model.safetensors, the MTP fields to config.json and the
    sampling default to generation_config.json (servers apply it to requests that leave it unset)."""
    from safetensors.torch import load_file, save_file

    trunk.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in mtp.state_dict().items():
        tensors[f"mtp.{name}"] = value.detach().to(torch.bfloat16).cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config["mtp_layers_block_type"] = mtp_kinds
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if repetition_penalty != 1.0:
        gen_path = out_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        gen["repetition_penalty"] = repetition_penalty
        gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return {name: list(t.shape) for name, t in tensors.items() if name.startswith("mtp.")}


def snapshot(trunk: nn.Module, mtp: nn.Module) -> tuple[dict, dict]:
    """CPU copies of both state dicts."""
    return (
        {k: v.detach().cpu().clone() for k, v in trunk.state_dict().items()},
        {k: v.detach().cpu().clone() for k, v in mtp.state_dict().items()},
    )


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def write_profile(profiler: torch.profiler.profile, steps: int, path: Path) -> None:
    """Stop `profiler` and write its per-kernel table (sorted by GPU time) with the kernels' GPU time per step on
    top (device-side events only: the operator rows repeat their kernels' time)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.stop()
    events = profiler.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    table = events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70)
    path.write_text(f"{steps} steps profiled; GPU time {gpu_us / steps / 1e3:.1f} ms/step\n\n{table}\n")
    logger.info("profile of %d steps (GPU time %.1f ms/step) -> %s", steps, gpu_us / steps / 1e3, path)


def tokenizer_texts(train: list[tuple[str, str]], megabytes: float) -> list[str]:
    """A deterministic sample of the training files (by split hash) of about `megabytes` for BPE training."""
    ranked = sorted(train, key=lambda item: _data.hashlib.sha256(item[0].encode()).hexdigest())
    out, size = [], 0
    for _, text in ranked:
        if size > megabytes * 1e6:
            break
        out.append(text)
        size += len(text)
    return out


def write_outputs(report: dict, cfg: dict, mtp_kinds: list[str], out_dir: Path, tar: Path | None) -> None:
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(report, cfg, mtp_kinds))
    if tar is not None:
        import tarfile

        tar.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar, "w") as archive:
            archive.add(str(out_dir), arcname=out_dir.name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    t_start = time.perf_counter()
    deadline = t_start + args.total_budget_s
    torch.manual_seed(args.seed)
    device = args.device
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corpus = load_corpus(args.heldout_percent, args.validation_percent, args.max_files, args.corpus)
    corpus.train, dropped = _data.drop_repetitive(corpus.train, args.max_dup_line_fraction)  # training files only
    logger.info("dropped %d repetitive training files (duplicate-line fraction > %.2f)", dropped,
                args.max_dup_line_fraction)
    train_bytes = sum(len(t) for _, t in corpus.train)
    logger.info(
        "corpus %s: %d train files (%.1f MB), %d held-out, %d validation files, %d skipped (not UTF-8) (%.1fs)",
        corpus.root, len(corpus.train), train_bytes / 1e6, len(corpus.heldout), len(corpus.validation),
        corpus.skipped, time.perf_counter() - t_start,
    )
    t0 = time.perf_counter()
    if args.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = _data.save_with_bos(AutoTokenizer.from_pretrained(str(args.tokenizer_dir), local_files_only=True),
                                        out_dir)
    else:
        tokenizer = train_tokenizer(tokenizer_texts(corpus.train, args.tokenizer_mb), args.vocab_size, out_dir)
    train_stream = encode_stream(tokenizer, [t for _, t in corpus.train], args.line_break_rate, args.seed)
    heldout_stream = encode_stream(tokenizer, [t for _, t in corpus.heldout])
    validation_stream = encode_stream(tokenizer, [t for _, t in corpus.validation])
    tok_time = time.perf_counter() - t0
    logger.info(
        "tokenizer: %d tokens, %.2f bytes/token on train; %d train tokens, %d held-out tokens (%.1fs)",
        len(tokenizer), train_bytes / train_stream.numel(), train_stream.numel(), heldout_stream.numel(), tok_time,
    )

    from transformers import NemotronHConfig, NemotronHForCausalLM

    eos = tokenizer.convert_tokens_to_ids(EOS)
    cfg = model_config(args, len(tokenizer), eos)
    mtp_kinds = ["full_attention", "mlp"]
    torch.manual_seed(args.seed)
    if args.init_from is not None:  # fine-tuning: the checkpoint's shapes and weights
        trunk, mtp_state, mtp_kinds = _ditto.load_initial(args.init_from, device)
        cfg = {key: getattr(trunk.config, key) for key in cfg}
        mtp = MTP(cfg, mtp_kinds).to(device)
        mtp.load_state_dict(mtp_state)
        logger.info("starting from %s", args.init_from)
    else:
        trunk = NemotronHForCausalLM(NemotronHConfig(**cfg)).to(device)
        mtp = MTP(cfg, mtp_kinds).to(device)
        init_mtp(mtp, std=0.02)
    trunk.train()
    mtp.train()
    n_trunk, n_mtp = count_params(trunk), count_params(mtp)
    logger.info("trunk %.2fM params (%s), MTP %.2fM params", n_trunk / 1e6, args.pattern, n_mtp / 1e6)

    params = [p for p in [*trunk.parameters(), *mtp.parameters()] if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    fused = device.startswith("cuda")
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused,
    )
    loss_fn = torch.compile(forward_losses) if args.compile else forward_losses

    gen = torch.Generator().manual_seed(args.seed)
    stream_dev = train_stream.to(device)
    if args.ditto_batch:
        newline = _ditto.newline_token_mask(tokenizer, cfg["vocab_size"])
        stream_np, ditto_rng = train_stream.numpy(), _ditto.np.random.default_rng(args.seed)
    span = torch.arange(args.seq_len + 1, device=device)
    heldout_windows = windows_of(heldout_stream, args.seq_len, args.eval_windows)
    validation_windows = windows_of(validation_stream, args.seq_len, 64)
    best: dict = {"loss": math.inf, "step": 0, "state": None}
    total = args.max_steps
    step = 0
    t_loop = time.perf_counter()
    budget = deadline - args.eval_reserve_s - t_loop  # the training loop's wall time
    logger.info("training loop budget %.0fs", budget)
    t_calib = None
    autocast = device != "cpu"
    history: list[dict] = []
    scan_patch = contextlib.ExitStack()
    triton_scan = False if args.torch_scan else scan_patch.enter_context(_scan.fast_scan(device, cfg, args.scan_configs))
    profiler = None
    while total is None or step < total:
        offsets = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = stream_dev[offsets.to(device)[:, None] + span[None, :]].long()
        lr = lr_at(step, total or 10**9, args.warmup, args.lr, args.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            loss, mtp_losses, _, _ = loss_fn(trunk, mtp, batch, args.mtp_depths)
        (loss + args.mtp_weight * sum(mtp_losses)).backward()
        if args.ditto_batch:  # a second backward into the same gradients: the peak memory of one batch at a time
            tokens, prev = _ditto.pseudo_batch(stream_np, newline, args.ditto_batch, args.seq_len, ditto_rng)
            with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
                ditto = _ditto.ditto_loss(trunk, tokens.to(device), prev.to(device), args.ditto_lambda)
            (args.ditto_weight * ditto).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 10:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if step == args.calib_steps:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_calib) / (args.calib_steps - 10)
            logger.info("%.1f ms/step (steps 10-%d)", per_step * 1e3, step)
            if total is None:
                n_evals = max(1, int(budget / per_step) // max(1, args.eval_every))
                remaining = budget - (time.perf_counter() - t_loop) - n_evals * 2 * per_step
                total = step + max(0, int(remaining / per_step))
                logger.info("%d steps fit the %.0fs budget", total, budget)
            if args.profile_steps:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                              torch.profiler.ProfilerActivity.CUDA])
                profiler.start()
        if profiler is not None and step == args.calib_steps + args.profile_steps:
            write_profile(profiler, step - args.calib_steps, out_dir / "profile.txt")
            profiler = None
            break
        if step % 50 == 0 or step == 1 or step == total:
            elapsed = time.perf_counter() - t_loop
            logger.info(
                "step %d/%s loss %.3f mtp %s ditto %.3f gnorm %.2f lr %.2e  %.0fs  %.0f tok/s",
                step, total, loss.item(), " ".join(f"{m.item():.3f}" for m in mtp_losses),
                ditto.item() if args.ditto_batch else 0.0, grad_norm.item(), lr,
                elapsed, step * args.batch_size * args.seq_len / elapsed,
            )
            history.append({"step": step, "loss": loss.item(), "mtp_losses": [m.item() for m in mtp_losses],
                            "ditto_loss": ditto.item() if args.ditto_batch else None, "elapsed_s": elapsed})
        if validation_windows.shape[0] and ((args.eval_every and step % args.eval_every == 0) or step == total):
            val = _eval.heldout_metrics(trunk, mtp, validation_windows, args.batch_size, device, args.mtp_depths)
            val_loss = val["trunk_loss_nats_per_token"] + args.mtp_weight * sum(
                d["loss_nats_per_token"] for d in val["mtp_depths"])
            logger.info("validation @%d: trunk %.4f mtp %s", step, val["trunk_loss_nats_per_token"],
                        [round(d["loss_nats_per_token"], 4) for d in val["mtp_depths"]])
            history.append({"step": step, "validation": val})
            if val_loss < best["loss"]:
                best = {"loss": val_loss, "step": step, "state": snapshot(trunk, mtp)}
        if time.perf_counter() - t_loop > 1.1 * budget:
            logger.warning("time budget exceeded at step %d: stopping early", step)
            break
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if triton_scan and args.scan_configs_out is not None:
        args.scan_configs_out.parent.mkdir(parents=True, exist_ok=True)
        args.scan_configs_out.write_text(json.dumps(_scan.tuned_configs(), indent=1) + "\n")
    scan_patch.close()
    if profiler is not None:  # the time budget ended the loop inside the profiled steps
        write_profile(profiler, step - args.calib_steps, out_dir / "profile.txt")
    if args.profile_steps:
        return 0
    train_time = time.perf_counter() - t_loop
    tokens_seen = step * args.batch_size * args.seq_len
    logger.info("trained %d steps, %.1fM tokens in %.1fs", step, tokens_seen / 1e6, train_time)

    if best["state"] is not None and best["step"] != step:
        logger.warning("validation loss was lowest at step %d: shipping that step's weights", best["step"])
        trunk.load_state_dict(best["state"][0])
        mtp.load_state_dict(best["state"][1])
    # the shipped weights are bf16: round them, save them first (a timeout later still leaves a model), then
    # evaluate exactly what is saved
    with torch.no_grad():
        for p_ in [*trunk.parameters(), *mtp.parameters()]:
            p_.copy_(p_.to(torch.bfloat16).float())
    trunk.eval()
    mtp.eval()
    mtp_shapes = save_checkpoint(trunk, mtp, cfg, mtp_kinds, out_dir, args.repetition_penalty)
    trunk.float()
    size_mb = (out_dir / "model.safetensors").stat().st_size / 1e6
    nan = float("nan")
    report = {
        "heldout": {"trunk_loss_nats_per_token": nan, "trunk_top1_accuracy": nan, "mtp_loss_nats_per_token": nan,
                    "mtp_top1_accuracy": nan, "mtp_depths": [], "tokens": 0},
        "train": {
            "steps": step, "tokens_seen": tokens_seen, "train_time_s": round(train_time, 1),
            "total_time_s": nan, "tokenizer_and_encoding_s": round(tok_time, 1),
            "shipped_step": best["step"] or step, "triton_scan": triton_scan,
        },
        "data": {
            "corpus": str(corpus.root), "python": (corpus.manifest or {}).get("python", platform.python_version()),
            "manifest": corpus.manifest, "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout), "skipped_files": corpus.skipped,
            "validation_files": len(corpus.validation), "validation_percent": args.validation_percent,
            "train_tokens": train_stream.numel(), "heldout_tokens": heldout_stream.numel(),
            "train_bytes": train_bytes, "heldout_percent": args.heldout_percent,
            "repetitive_train_files_dropped": dropped, "max_dup_line_fraction": args.max_dup_line_fraction,
        },
        "model": {"trunk_params": n_trunk, "mtp_params": n_mtp, "safetensors_mb": round(size_mb, 2),
                  "mtp_tensors": mtp_shapes, "reload_max_logit_diff": nan},
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": "python tools/demo_model/train_demo.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "samples": {}, "parse": {}, "acceptance": {}, "engine": None, "history": history,
    }
    write_outputs(report, cfg, mtp_kinds, out_dir, args.tar)
    logger.info("saved %s (model.safetensors %.2f MB) at %.0fs", out_dir, size_mb, time.perf_counter() - t_start)
    _eval.evaluate_trained(report, trunk, mtp, tokenizer, corpus, heldout_windows, train_stream, args, deadline, out_dir,
                  lambda: write_outputs(report, cfg, mtp_kinds, out_dir, args.tar))
    report["train"]["total_time_s"] = round(time.perf_counter() - t_start, 1)
    write_outputs(report, cfg, mtp_kinds, out_dir, args.tar)
    logger.info("wrote %s in %.1fs total", out_dir, report["train"]["total_time_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
