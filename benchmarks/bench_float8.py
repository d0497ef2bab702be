"""Float8 training vs a high-precision baseline: the loss gap over the same steps and data.

For each recipe, ``compare_float8_to_baseline`` trains the model twice from the same seed on
the same batches (AdamW, linear warm-up then a constant learning rate, gradients clipped at
1.0): once as is, once with its eligible Linears swapped for torchao's ``Float8Linear``
(Float8Training's default filter: every block Linear; not the embedding, norms or head). Reported: the mean training loss of the last 5 steps of
each run and their relative gap (positive: float8 worse), the largest gap at any single step,
and seconds per step.

On CPU the baseline is fp32 (no autocast) and float8 is emulated (torchao ``emulate=True``: the
same float8 casts and scales, the matmul on the dequantised values in fp32), so the gap is the
quantisation error alone and the timings say nothing about float8 speed (see gpu.sh for that).
On CUDA the baseline is bf16 autocast, and float8 runs real ``_scaled_mm`` kernels.

Data: the embedded corpus (the Python standard library's sources, byte tokenizer), windows at
seeded random offsets, a fresh batch every step.

    python benchmarks/bench_float8.py                        # small, 40 steps, tensorwise
    python benchmarks/bench_float8.py --recipes tensorwise rowwise rowwise_with_gw_hp
    python benchmarks/bench_float8.py --model tiny --steps 10 --batch-size 4 --seq-len 64
"""

from __future__ import annotations

import os
import sys

import torch

from lightning_disttrain.data.embedded import embedded_documents
from lightning_disttrain.data.tokenizer import get_tokenizer
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.parallel.float8 import RECIPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported, not run
from bench_common import header, parser, report, table  # noqa: E402
from float8_compare import compare_float8_to_baseline  # noqa: E402


def corpus_batches(n: int, batch_size: int, seq_len: int, seed: int = 0, max_docs: int = 200):
    """``n`` (x, y) batches of byte tokens from the embedded corpus, windows at random offsets."""
    tok = get_tokenizer("bytes")
    ids = []
    for text in embedded_documents("train", max_docs=max_docs):
        ids.extend(tok.encode(text))
        ids.append(tok.eot_token)
    data = torch.tensor(ids, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
        batches.append((rows[:, :-1], rows[:, 1:]))
    return batches, tok.n_vocab, len(data)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, steps=40, warmup=(10, "linear warm-up steps (then constant lr)"))
    p.add_argument("--model", default="small")
    p.add_argument("--recipes", nargs="+", default=["tensorwise"], choices=RECIPES)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="where the results go as JSON (default: benchmarks/out/float8.json)")
    args = p.parse_args(argv)

    batches, vocab, corpus_tokens = corpus_batches(args.steps, args.batch_size, args.seq_len)
    cfg = GPTConfig.from_name(args.model, vocab_size=vocab, block_size=max(args.seq_len, 64))
    header("bench_float8", f"torchao {_torchao_version()}", f"device {args.device}",
           f"{torch.get_num_threads()} torch threads")
    print(f"# model {args.model} (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab={vocab} bytes)  "
          f"batch {args.batch_size} x seq {args.seq_len}  steps {args.steps}  AdamW lr {args.lr} "
          f"(warm-up {args.warmup}, clip 1.0)  corpus {corpus_tokens:,} tokens", flush=True)
    results, rows, every = [], [], max(1, args.steps // 8)
    for recipe in args.recipes:
        r = compare_float8_to_baseline(lambda: GPT(cfg), batches, steps=args.steps, recipe=recipe, lr=args.lr,
                                       warmup_steps=args.warmup, device=args.device)
        rows.append((recipe, r.baseline, "emulated" if r.notes["emulated"] else "_scaled_mm", len(r.converted),
                     sum(r.baseline_losses[-r.tail:]) / r.tail, sum(r.float8_losses[-r.tail:]) / r.tail, r.gap_pct,
                     r.max_step_gap_pct, r.baseline_s_per_step, r.float8_s_per_step))
        results.append({"recipe": recipe, "baseline": r.baseline, "emulated": r.notes["emulated"],
                         "converted": r.converted, "baseline_losses": r.baseline_losses,
                         "float8_losses": r.float8_losses, "gap_pct": r.gap_pct,
                         "max_step_gap_pct": r.max_step_gap_pct, "baseline_s_per_step": r.baseline_s_per_step,
                         "float8_s_per_step": r.float8_s_per_step})
    text = [table(["recipe", "baseline", "float8 matmul", "float8 Linears", ("base loss", ".4f"), ("fp8 loss", ".4f"),
                   ("gap %", "+.3f"), ("max step gap %", ".3f"), ("base s/step", ".3f"), ("fp8 s/step", ".3f")],
                  rows, rule=True)]
    for res in results:
        text.append(f"#   {res['recipe']}: losses every {every} steps: baseline "
                    + " ".join(f"{v:.3f}" for v in res["baseline_losses"][::every]) + " | float8 "
                    + " ".join(f"{v:.3f}" for v in res["float8_losses"][::every]))
    text.append(f"# loss: mean of the last {min(5, args.steps)} steps; gap = (float8 - baseline) / baseline. "
                f"First-step losses: baseline {results[0]['baseline_losses'][0]:.4f}, "
                f"float8 {results[0]['float8_losses'][0]:.4f}")
    out = {"args": vars(args), "results": results}
    report("float8", out, "\n".join(text), out=args.json, indent=1)
    return out


def _torchao_version() -> str:
    try:
        import torchao

        return torchao.__version__
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
