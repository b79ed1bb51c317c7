"""What a compressed KV cache costs in quality, token by token: teacher forcing on a held-out text.

The text is Python's Language Reference as every CPython install ships it (the topics of
`pydoc_data.topics`, in name order), a text no KV setting was chosen on. It is cut into
`--windows` windows of `--window` tokens. Each window's first `--prefix` tokens are prefilled;
every later token is then fed as a decode step (all windows in one batch, as the engine runs
them), so every scored position but each window's first (scored by the prefill kernel) reads its
whole context back from the cache through the decode kernel, the path generation takes. The same
steps run over an fp32 cache (or `--reference-kv bfloat16`) and a compressed one (`--kv-dtype`:
int8, jetserve_kernels/kv_int8.py, or bf16), both in each step's one forward (a KV segment
each, as the engine runs two KV pools), and each position's logits are compared. The model
is fp32, or `--model-dtype bfloat16` (batch-invariant: its attention over a bf16 or int8 cache
in bf16 products where the CPU has AVX512-BF16, an int8 cache's keys in integer products, as the
engine runs a bf16 model):

- **top-1 agreement**: the share of positions where both caches' most likely next token is the
  same (the text's own next token is fed either way: one difference does not derail the rest,
  as it does when whole greedy continuations are compared);
- **perplexity** of the text under each, and the compressed one's relative difference;
- **KL divergence** from the reference cache's next-token distribution, the mean over positions.

It needs the CPU kernels (they read an int8 or bf16 cache in place); without them it stops.

    python -m loadtest.kv_teacher_forced --result-json results/kv_teacher_forced.json
    python -m loadtest.kv_teacher_forced --model-dtype bfloat16 --reference-kv bfloat16
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from loadtest.metrics import write_result
from services.executor.engine.attention import SeqSlice, TorchBackend
from services.executor.engine.model import KvSegment, LlamaModel
from services.executor.engine.model_runner import calibrate_key_basis, kv_cache_row
from services.executor.engine.weights import load_model_files

BLOCK = 16


def held_out_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


class Forced:
    """One model, stepping every window through a cache of the given dtype."""

    def __init__(self, model_name: str, dtype: torch.dtype = torch.float32,
                 key_basis: bool = True):
        from shared.model_files import tokenizer_dir
        from shared.tokenizer import Tokenizer

        device = torch.device("cpu")
        self.config, weights, directory = load_model_files(model_name, device, dtype)
        self.tokenizer = Tokenizer(tokenizer_dir(directory))
        self.backend = TorchBackend(BLOCK, device, dtype)
        if not self.backend.prefill_kernel:
            raise SystemExit("the CPU attention kernels did not build (or lack AVX-512): this "
                             "benchmark measures them")
        self.model = LlamaModel(self.config, weights, self.backend,
                                max_position=self.config.max_position)
        if key_basis:  # what an engine with an int8 pool measures at start (kv_int8.py)
            calibrate_key_basis(self.model, BLOCK, device)

    def steps(self, windows: list[list[int]], prefix: int, cache_dtypes: list[torch.dtype]):
        """Yields, step by step, for each cache dtype the log-probabilities [windows, vocab] of
        each window's next token: first of token `prefix` (after the prefill), then of each
        later one. Every cache steps in the same forward (a segment each, as the engine runs
        two KV pools): the weights are read once a step for all of them."""
        cfg, n, length = self.config, len(windows), len(windows[0])
        per_seq = -(-length // BLOCK)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        pools = []
        for dtype in cache_dtypes:
            shape = (n * per_seq, BLOCK, cfg.num_kv_heads, kv_cache_row(cfg, dtype))
            pools.append([(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_layers)])

        def step(start: int, count: int) -> list[torch.Tensor]:
            seqs, slots, ids, positions = [], [], [], []
            for i, window in enumerate(windows):
                seqs.append(SeqSlice(i * count, count, start + count, tables[i]))
                for pos in range(start, start + count):
                    slots.append(tables[i][pos // BLOCK] * BLOCK + pos % BLOCK)
                    ids.append(window[pos])
                    positions.append(pos)
            rows = n * count
            segments = [KvSegment(self.backend.prepare(seqs, slots), caches, j * rows,
                                  (j + 1) * rows) for j, caches in enumerate(pools)]
            last = torch.arange(n * len(pools)) * count + count - 1
            with torch.inference_mode():
                logits = self.model.forward(torch.tensor(ids * len(pools)),
                                            torch.tensor(positions * len(pools)), segments, last)
                return list(torch.log_softmax(logits, -1).split(n))

        yield step(0, prefix)
        for pos in range(prefix, length - 1):
            yield step(pos, 1)


def compare(forced: Forced, windows: list[list[int]], prefix: int,
            kv_dtype: torch.dtype = torch.int8,
            reference_kv: torch.dtype = torch.float32) -> dict:
    """Both caches stepped together; top-1 agreement, perplexities and mean KL over every
    scored position, computed in fp32 as each step comes."""
    agree = total_kl = nll_ref = nll = 0.0
    count = 0
    steps = forced.steps(windows, prefix, [reference_kv, kv_dtype])
    for offset, (ref, other) in enumerate(steps):
        target = torch.tensor([w[prefix + offset] for w in windows])[:, None]
        agree += (ref.argmax(-1) == other.argmax(-1)).sum().item()
        total_kl += (ref.exp() * (ref - other)).sum().item()
        nll_ref -= ref.gather(1, target).sum().item()
        nll -= other.gather(1, target).sum().item()
        count += target.shape[0]
    return {"tokens": count, "top1_agreement": agree / count,
            "perplexity_reference_kv": math.exp(nll_ref / count),
            "perplexity": math.exp(nll / count),
            "perplexity_relative": math.exp((nll - nll_ref) / count) - 1,
            "mean_kl": total_kl / count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--window", type=int, default=1024, help="tokens a window")
    parser.add_argument("--prefix", type=int, default=16, help="tokens prefilled, not scored")
    parser.add_argument("--kv-dtype", choices=["int8", "bfloat16"], default="int8",
                        help="the cache compared with the reference's")
    parser.add_argument("--reference-kv", choices=["float32", "bfloat16"], default="float32",
                        help="the reference cache (bfloat16: a bf16 model's own, by default)")
    parser.add_argument("--model-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="model.dtype (bfloat16: batch-invariant, its attention in bf16 "
                        "products over a bf16 or int8 cache where the CPU has AVX512-BF16)")
    parser.add_argument("--no-key-basis", action="store_true",
                        help="int8 keys quantized as they are, without the key basis (the "
                        "baseline: kv_int8.py)")
    parser.add_argument("--result-json", default="results/kv_teacher_forced.json")
    args = parser.parse_args(argv)

    forced = Forced(args.model, getattr(torch, args.model_dtype), not args.no_key_basis)
    ids = forced.tokenizer.encode(held_out_text())
    if len(ids) < args.windows * args.window:
        parser.error(f"the text has {len(ids)} tokens, fewer than {args.windows} x {args.window}")
    windows = [ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    started = time.perf_counter()
    result = compare(forced, windows, args.prefix, getattr(torch, args.kv_dtype),
                     getattr(torch, args.reference_kv))
    result["seconds"] = time.perf_counter() - started
    print(f"{result['tokens']} tokens scored, {args.windows} windows of {args.window} "
          f"({args.prefix} prefilled, the rest decoded one by one)")
    kv, ref = args.kv_dtype, {"float32": "fp32", "bfloat16": "bf16"}[args.reference_kv]
    basis = ", keys as they are" if args.no_key_basis else ""
    print(f"model {args.model_dtype}{basis}; top-1 agreement, {kv} KV against {ref} KV: "
          f"{100 * result['top1_agreement']:.2f} %")
    print(f"perplexity: {ref} KV {result['perplexity_reference_kv']:.4f}, {kv} KV "
          f"{result['perplexity']:.4f} ({100 * result['perplexity_relative']:+.3f} %)")
    print(f"mean KL({ref} KV || {kv} KV): {result['mean_kl']:.2e} nats")
    write_result(args.result_json, "kv_teacher_forced", params=vars(args), results=result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
