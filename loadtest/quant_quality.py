"""What weight quantization (or a bf16 model) costs in quality: greedy agreement with fp32,
teacher-forced agreement with fp32, and perplexity.

For each `--quantization`: the engine's greedy tokens on a fixed prompt set (16 chat questions and
16 text openings, `--max-tokens` each) against the fp32 engine's, as the mean share of each
output that matches before the first differing token and the number of identical outputs; and
perplexity on a short text the project ships (loadtest/data/perplexity.txt), every position
scored in one prefill; and token by token on held-out text (`--windows` windows of `--window`
tokens, by default six of 512, of Python's Language Reference, as `loadtest.kv_teacher_forced`
uses it), each window one prefill
through both models: the share of positions where both predict the same next token (the text's
own tokens are fed either way, so one difference does not derail the rest) and the mean KL
divergence from fp32's next-token distribution. Also the weight memory of the matmuls.

    python -m loadtest.quant_quality --quantization none int8 int4 auto
    python -m loadtest.quant_quality --quantization none --dtype bfloat16

`--dtype bfloat16` adds a run of `model.dtype: bfloat16` (bf16 weights and KV cache; on a CPU
fp32 activations between the kernels), compared with the same fp32 reference.

`--quantized-activations float32 int8` runs each quantized mode with each
`model.quantized_activations` (rows named e.g. int8/a32 and int8/a8); by default the shipped
setting (float32: weight-only) alone.

    python -m loadtest.quant_quality --quantization none int8 int4 --quantized-activations float32 int8
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import msgspec
import torch

from loadtest.metrics import write_result
from services.executor.engine.attention import SeqSlice, TorchBackend
from services.executor.engine.llm_engine import Engine
from services.executor.engine.model import KvSegment, LlamaModel
from services.executor.run_local import run_requests
from services.executor.engine.weights import load_model_files
from shared.config import EngineConfig, engine_config
from shared.protocol import ChatMessage, Completion, GenerateRequest

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle stays upright.",
    "List three fruits that are high in vitamin C.",
    "What is 17 times 23?",
    "Give me a tip for learning a new language.",
    "Why do cats purr?",
    "Describe the water cycle in two sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How do vaccines work?",
    "Translate 'good morning' into Spanish and German.",
    "What causes the seasons on Earth?",
    "Write a haiku about the sea.",
    "What is a prime number?",
    "How can I make my code easier to read?",
]
OPENINGS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village by the mountains,",
    "Water boils at a temperature of",
    "The history of the printing press begins",
    "To install the package, run",
    "In mathematics, a group is",
    "The best way to cook rice is",
    "Dear Sir or Madam,\n\nI am writing to",
    "The mitochondria is",
    "Photosynthesis converts",
    "SELECT name, email FROM users WHERE",
    "The first rule of the club is",
    "Paris is known for",
    "A healthy breakfast includes",
    "The stock market fell sharply today as",
]


def prompts() -> list[GenerateRequest]:
    return ([GenerateRequest(messages=[ChatMessage("user", q)]) for q in QUESTIONS]
            + [GenerateRequest(prompt=p) for p in OPENINGS])


async def completions(engine: Engine, requests: list[GenerateRequest]) -> list[Completion]:
    """The requests through a running engine (as `jetserve run-local` does), every one completed."""
    results = await run_requests(engine, [msgspec.json.encode(r).decode() for r in requests])
    assert all(isinstance(r, Completion) for r in results), results
    return results


def greedy_outputs(config: EngineConfig, max_tokens: int) -> list[list[int]]:
    async def go():
        async with Engine(config) as engine:
            return await completions(engine, [msgspec.structs.replace(
                p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts()])

    return [r.token_ids for r in asyncio.run(go())]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Mean share of each output equal to the reference before the first difference."""
    shares = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        shares.append(same / len(ref))
    return {"mean_prefix_share": sum(shares) / len(shares),
            "identical": sum(out == ref for out, ref in zip(outputs, reference)),
            "prompts": len(reference)}


def agreement_cells(a: dict) -> str:
    """An agreement as the two table columns both quality benchmarks print."""
    return f"{100 * a['mean_prefix_share']:>10.1f}%{a['identical']:>6}/{a['prompts']}"


def load_model(model_name: str, quantization: str, dtype: torch.dtype = torch.float32,
               quantized_activations: str = "float32"):
    """A LlamaModel to run forward passes on directly, its backend and its tokenizer."""
    from shared.model_files import tokenizer_dir
    from shared.tokenizer import Tokenizer

    device = torch.device("cpu")
    config, weights, directory = load_model_files(model_name, device, dtype,
                                                  quantization=quantization)
    backend = TorchBackend(BLOCK, device, dtype)
    model = LlamaModel(config, weights, backend, max_position=config.max_position,
                       quantized_activations=quantized_activations)
    return model, Tokenizer(tokenizer_dir(directory))


BLOCK = 16


@torch.inference_mode()
def prefill_logits(model: LlamaModel, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits [len(ids) - 1, vocab] of each next token, one prefill over a fresh cache in
    `dtype`, as the engine's is."""
    config = model.config
    num_blocks = -(-len(ids) // BLOCK)
    shape = (num_blocks, BLOCK, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(config.num_layers)]
    table = list(range(num_blocks))
    meta = model.backend.prepare([SeqSlice(0, len(ids), len(ids), table)], list(range(len(ids))))
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), [KvSegment(meta, caches)],
                         torch.arange(len(ids) - 1)).float()


def perplexity(model_name: str, quantization: str, text: str,
               dtype: torch.dtype = torch.float32,
               quantized_activations: str = "float32") -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the text's tokens after the first, one prefill;
    also the bytes of the matmul weights."""
    model, tokenizer = load_model(model_name, quantization, dtype, quantized_activations)
    ids = tokenizer.encode(text)
    nll = torch.nn.functional.cross_entropy(prefill_logits(model, ids, dtype),
                                            torch.tensor(ids[1:]))
    matmuls = [model.lm_head] + [getattr(layer, name) for layer in model.layers
                                 for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    size = sum(m.weight.nbytes for m in matmuls)  # a tensor's, or QuantizedPanels'
    return math.exp(nll.item()), size


def teacher_forced(reference: LlamaModel, model: LlamaModel, windows: list[list[int]],
                   dtype: torch.dtype = torch.float32) -> dict:
    """Token by token against the reference (fp32) model on held-out text, each window one
    prefill: the share of positions where both predict the same next token, and the mean KL
    divergence of the model's next-token distribution from the reference's."""
    same = positions = 0
    kl = 0.0
    for window in windows:
        ref = prefill_logits(reference, window, torch.float32).log_softmax(-1)
        out = prefill_logits(model, window, dtype).log_softmax(-1)
        same += (ref.argmax(-1) == out.argmax(-1)).sum().item()
        kl += (ref.exp() * (ref - out)).sum().item()
        positions += len(window) - 1
    return {"top1_agreement": same / positions, "mean_kl": kl / positions,
            "positions": positions}


def held_out_windows(tokenizer, count: int = 6, length: int = 512) -> list[list[int]]:
    """`count` windows of `length` tokens of Python's Language Reference (pydoc_data, as
    loadtest.kv_teacher_forced uses it): text no quantization setting was chosen on."""
    from loadtest.kv_teacher_forced import held_out_text

    ids = tokenizer.encode(held_out_text())
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4", "auto"],
                        choices=["none", "int8", "int4", "auto"])
    parser.add_argument("--dtype", choices=["bfloat16"], help="also this model.dtype (quantization "
                        "none), against the same fp32 reference")
    parser.add_argument("--quantized-activations", nargs="+",
                        default=[EngineConfig().model.quantized_activations],
                        choices=["auto", "float32", "int8"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=6, help="held-out windows, teacher-forced")
    parser.add_argument("--window", type=int, default=512, help="tokens a held-out window")
    parser.add_argument("--result-json", default="results/quant_quality.json")
    args = parser.parse_args(argv)

    text = TEXT.read_text()
    base = {"model.name": args.model, "scheduler.batch_level.max_num_seqs": 32,
            "kv_cache.enable_prefix_caching": False}
    # The fp32 model (model.dtype auto is bf16 on a CPU with native bf16).
    reference = greedy_outputs(engine_config({**base, "model.dtype": "float32"}), args.max_tokens)
    fp32_model, tokenizer = load_model(args.model, "none")
    windows = held_out_windows(tokenizer, args.windows, args.window)
    if len(windows[-1]) < args.window:
        parser.error(f"the held-out text has fewer than {args.windows} x {args.window} tokens")
    results = {}
    several = len(args.quantized_activations) > 1  # then each row says which
    suffix = {"auto": "/aauto", "float32": "/a32", "int8": "/a8"}
    for quantization in args.quantization:
        for acts in args.quantized_activations if quantization != "none" else ["float32"]:
            overrides = {**base, "model.quantization": quantization,
                         "model.quantized_activations": acts}
            outputs = (reference if quantization == "none" else
                       greedy_outputs(engine_config(overrides), args.max_tokens))
            ppl, size = perplexity(args.model, quantization, text, quantized_activations=acts)
            name = quantization + (suffix[acts] if several and quantization != "none" else "")
            forced = teacher_forced(fp32_model, load_model(args.model, quantization,
                                                           quantized_activations=acts)[0],
                                    windows)
            results[name] = {"perplexity": ppl, "matmul_weight_bytes": size,
                             "agreement_with_fp32": agreement(outputs, reference),
                             "teacher_forced": forced}
    if args.dtype:
        dtype = getattr(torch, args.dtype)
        outputs = greedy_outputs(engine_config({**base, "model.dtype": args.dtype}), args.max_tokens)
        ppl, size = perplexity(args.model, "none", text, dtype)
        forced = teacher_forced(fp32_model, load_model(args.model, "none", dtype)[0], windows, dtype)
        results[args.dtype] = {"perplexity": ppl, "matmul_weight_bytes": size,
                               "agreement_with_fp32": agreement(outputs, reference),
                               "teacher_forced": forced}
    positions = next(iter(results.values()))["teacher_forced"]["positions"]
    print(f"{'quantization':<14}{'matmul MB':>10}{'perplexity':>12}{'agreement':>11}{'identical':>11}"
          f"{'top-1':>9}{'KL':>10}   (top-1 and KL: teacher-forced, {positions} held-out tokens)")
    for name, r in results.items():
        a, f = r["agreement_with_fp32"], r["teacher_forced"]
        print(f"{name:<14}{r['matmul_weight_bytes'] / 1e6:>10.1f}{r['perplexity']:>12.3f}"
              + agreement_cells(a) + f"{100 * f['top1_agreement']:>8.2f}%{f['mean_kl']:>10.2e}")
    write_result(args.result_json, "quant_quality", params=vars(args), results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
