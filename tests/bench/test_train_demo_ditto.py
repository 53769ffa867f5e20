"""DITTO anti-loop training of the demo model (tools/demo_model/train_demo_ditto.py): the pseudo-repetitive windows, the
loss's fixed point, and a fine-tuning run of train_demo.py from a checkpoint."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import torch
import train_demo_ditto as ditto  # tools/demo_model/ is on pytest's pythonpath

ROOT = Path(__file__).resolve().parents[2]


def _stream(rng: np.random.Generator, size: int = 5000) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens over a 50-token vocabulary where id 0 ends a line, about every 8 tokens."""
    stream = rng.integers(1, 50, size=size)
    stream[rng.random(size) < 0.12] = 0
    newline = np.zeros(50, dtype=bool)
    newline[0] = True
    return stream, newline


def test_pseudo_windows_repeat_whole_lines_and_point_one_copy_back() -> None:
    rng = np.random.default_rng(0)
    stream, newline = _stream(rng)
    tokens, prev = ditto.pseudo_batch(stream, newline, batch=16, seq_len=128, rng=rng)
    assert tokens.shape == (16, 129) and prev.shape == (16, 128)
    for row, back in zip(tokens.numpy(), prev.numpy()):
        targets = np.flatnonzero(back >= 0)  # target i predicts token i + 1
        assert targets.size > 0 and np.all(np.diff(targets) == 1) and targets[-1] == 127  # copies 2.. to the end
        m = targets[0] - back[targets[0]]
        assert np.all(targets - back[targets] == m) and 4 <= m <= 48
        span_start = targets[0] + 1 - m
        assert newline[row[span_start - 1]] and newline[row[span_start + m - 1]]  # whole lines
        assert np.array_equal(row[targets + 1], row[back[targets] + 1])  # the same token one copy earlier


def test_loss_is_zero_at_the_decayed_probability_and_grows_away_from_it() -> None:
    vocab, lam = 8, 0.5

    class Fixed(torch.nn.Module):
        """p(token 1) = the given value at every position."""

        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, input_ids: torch.Tensor, use_cache: bool = False):  # noqa: ANN201
            probs = torch.full((*input_ids.shape, vocab), (1 - self.p) / (vocab - 1))
            probs[..., 1] = self.p
            return type("Out", (), {"logits": probs.log()})()

    tokens = torch.ones(1, 9, dtype=torch.long)
    prev = torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 3]])
    assert float(ditto.ditto_loss(Fixed(0.5), tokens, prev, lam)) > 0.2  # p stays 0.5: |0.5 - 0.25| away
    assert float(ditto.ditto_loss(Fixed(0.9), tokens, prev, lam)) > float(ditto.ditto_loss(Fixed(0.5), tokens, prev, lam))


def test_the_loss_pushes_a_repeated_token_below_its_previous_copy() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(1, 8, 8, requires_grad=True)

    class Free(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, use_cache: bool = False):  # noqa: ANN201
            return type("Out", (), {"logits": logits})()

    tokens = torch.ones(1, 9, dtype=torch.long)
    prev = torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 3]])
    with torch.no_grad():
        logits[0, :, 1] = 4.0  # a confident loop: p(token 1) ~ 0.9 everywhere
    ditto.ditto_loss(Free(), tokens, prev, 0.5).backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[0, 4:, 1] > 0)  # gradient descent lowers the repeated copies' probability
    assert torch.all(logits.grad[0, :4, 1] == 0)  # the first copy and the prefix are left to the LM loss


def test_newline_mask_marks_line_ending_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "models" / "demo_model"), local_files_only=True)
    mask = ditto.newline_token_mask(tokenizer, len(tokenizer))
    newline_id = tokenizer.encode("\n", add_special_tokens=False)[0]
    x_id = tokenizer.encode("x", add_special_tokens=False)[0]
    assert mask[newline_id] and not mask[x_id] and 0 < mask.sum() < len(tokenizer) // 4


def test_finetuning_from_the_demo_checkpoint_with_ditto_runs_and_saves(tmp_path: Path,
                                                                       train_demo: types.ModuleType) -> None:

    demo = ROOT / "models" / "demo_model"
    out = tmp_path / "tuned"
    argv = ["--out-dir", str(out), "--device", "cpu", "--max-steps", "2", "--max-files", "30", "--seq-len", "128",
            "--batch-size", "2", "--calib-steps", "11", "--eval-windows", "2", "--eval-every", "0", "--eval-prompts", "1",
            "--gen-tokens", "4", "--init-from", str(demo), "--tokenizer-dir", str(demo), "--ditto-batch", "2",
            "--no-engine-eval", "--no-compile"]
    assert train_demo.main(argv) == 0
    report = json.loads((out / "training_report.json").read_text())
    logged = [h["ditto_loss"] for h in report["history"] if "loss" in h]
    assert logged and all(value is not None and value > 0 for value in logged)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == json.loads(
        (demo / "config.json").read_text())["hidden_size"]
    assert "Fine-tuned from" in (out / "README.md").read_text() and "DITTO" in (out / "README.md").read_text()
