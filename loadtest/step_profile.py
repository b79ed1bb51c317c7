"""Where a model step's time goes: the real engine's forward pass on synthetic batches, timed part
by part with the torch profiler on the calling thread.

Each case is one step shape: `B` decodes at a given context (batch 1, 8, 64, and the tail of a
run, a few long sequences), a short chat prompt's prefill, a full 512-token chunk, and a long
prompt's last 512-token chunk (after 1,536 cached tokens: the chunk that attends the most). Every
matmul, attention and element-wise op of the model is wrapped in a `record_function` label for
the run (here, not in the engine), so the parts are the model's own calls; what the labels do not
cover is Python and dispatch between ops.

    python -m loadtest.step_profile --quantization none int4 --result-json results/step_profile.json
    python -m loadtest.step_profile --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from loadtest.linear_bench import times_ms
from loadtest.metrics import write_result
from services.executor.engine.attention import SeqSlice
from services.executor.engine.llm_engine import Engine
from services.executor.engine.model import KvSegment
from services.executor.engine.sampler import SamplingBatch, sample
from services.executor.engine.sequence import SamplingParams
from shared.config import engine_config
from shared.model_files import default_gguf_path

# (name, decodes, decode context, prefill tokens)
CASES = [
    ("decode batch 1", 1, 256, 0),
    ("decode batch 8", 8, 256, 0),
    ("decode batch 64", 64, 256, 0),
    ("tail: 2 long decodes", 2, 700, 0),
    ("prefill 40 tokens (chat)", 0, 0, 40),
    ("prefill chunk 512 + 16 decodes", 16, 256, 496),
    ("full: 384-token chunk + 128 decodes", 128, 300, 384),  # a many-request run's steady state
    ("long prompt: chunk 512 after 1,536", 0, 0, 512, 1536),  # a 2,048-token prompt's last
]
PARTS = {
    "qkv_proj": "matmuls", "o_proj": "matmuls", "gate_up_proj": "matmuls", "down_proj": "matmuls",
    "lm_head": "output projection",
    "attention": "attention", "rotary_and_cache": "rotary + KV cache write",
    "rms_norm": "norms, silu_and_mul", "silu_and_mul": "norms, silu_and_mul",
    "sample": "sampling",
}


@contextlib.contextmanager
def labelled(model):
    """Wrap the model's linears and backend ops in profiler labels; undo on exit."""
    undo = []

    def wrap(owner, attr, label):
        original = getattr(owner, attr)

        def call(*args, **kwargs):
            with record_function(label):
                return original(*args, **kwargs)
        undo.append((owner, attr, vars(owner).get(attr)))  # None: a method of the class
        setattr(owner, attr, call)

    # Linear objects are called as layer.qkv_proj(x): wrap each instance in a labelled lambda.
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            wrap(layer, name, name)
    wrap(model, "lm_head", "lm_head")
    for name in ("attention", "rotary_and_cache", "rms_norm", "silu_and_mul"):
        wrap(model.backend, name, name)
    try:
        yield
    finally:
        for owner, attr, own in reversed(undo):
            if own is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


def step_inputs(engine: Engine, decodes: int, context: int, prefill: int, cached: int = 0):
    """Tensors of one step: `decodes` sequences at `context`, then one prefill of `prefill`
    tokens after `cached` ones (whose cache holds whatever the pool holds: the time is the
    same)."""
    runner, bs = engine.runner, engine.config.kv_cache.block_size
    vocab = engine.model_config.vocab_size
    next_block = 0
    slices, slots, ids, positions, logits_rows = [], [], [], [], []
    shapes = [(context - 1, 1)] * decodes + ([(cached, prefill)] if prefill else [])
    for start, n in shapes:
        blocks = -(-(start + n) // bs)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        q_start = len(ids)
        ids.extend((7 * (q_start + i) + 11) % vocab for i in range(n))
        positions.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        slices.append(SeqSlice(q_start, n, start + n, table))
        logits_rows.append(len(ids) - 1)
    assert next_block <= runner.kv_caches[0][0].shape[0], "KV pool too small for the case"
    return (torch.tensor(ids), torch.tensor(positions), runner.backend.prepare(slices, slots),
            torch.tensor(logits_rows), SamplingBatch([SamplingParams(max_tokens=1, temperature=0.0)] * len(logits_rows),
                                                      [None] * len(logits_rows)))


def run_case(engine: Engine, decodes: int, context: int, prefill: int, repeats: int,
             cached: int = 0) -> dict:
    model, runner = engine.runner.model, engine.runner
    ids, positions, meta, rows, sampling = step_inputs(engine, decodes, context, prefill, cached)

    def step():
        logits = model.forward(ids, positions, [KvSegment(meta, runner.kv_caches)], rows)
        with record_function("sample"):
            return sample(logits, sampling).tolist()

    for _ in range(2):  # and times_ms's own warm-up: 3
        step()
    walls = times_ms(step, repeats)  # unlabelled: the step as the engine runs it
    with labelled(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            with record_function("step"):
                step()
    parts: dict[str, float] = {}
    profiled_ms = 0.0
    for event in prof.key_averages():
        ms = event.cpu_time_total / 1e3 / repeats
        if event.key == "step":
            profiled_ms = ms
        elif event.key in PARTS:
            parts[PARTS[event.key]] = parts.get(PARTS[event.key], 0.0) + ms
    # The labels' own cost (~10 us each, ~300 a step) lands in this remainder.
    parts["python and dispatch between ops"] = profiled_ms - sum(parts.values())
    step_ms = statistics.median(walls)
    tokens = decodes + prefill
    return {"decodes": decodes, "context": context, "prefill_tokens": prefill, "cached": cached,
            "step_ms": round(step_ms, 2), "profiled_step_ms": round(profiled_ms, 2),
            "tokens_per_s": round(tokens / step_ms * 1e3, 1),
            "parts_ms": {k: round(v, 2) for k, v in parts.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "int8", "int4", "auto"])
    parser.add_argument("--dtype", nargs="+", default=["auto"],
                        choices=["auto", "float32", "bfloat16"], help="model.dtype, one run each")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or str(default_gguf_path())
    results = {}
    for dtype, quantization in [(d, q) for d in args.dtype for q in args.quantization]:
        engine = Engine(engine_config({"model.name": model, "model.quantization": quantization,
                                       "model.dtype": dtype,
                                       "scheduler.batch_level.max_num_seqs": 128,
                                       "kv_cache.enable_prefix_caching": False}))
        rows = []
        variant = quantization if dtype == "auto" else f"{dtype} {quantization}"
        print(f"\n{variant} (threads: {torch.get_num_threads()})")
        for name, decodes, context, prefill, *cached in CASES:
            # On the engine's model thread, as the engine runs steps: one OpenMP team.
            row = engine.on_model_thread(run_case, engine, decodes, context, prefill, args.repeats,
                                         *cached)
            row["case"] = name
            rows.append(row)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["parts_ms"].items())
            print(f"  {name:32s} {row['step_ms']:7.1f} ms (profiled {row['profiled_step_ms']:.1f}: "
                  f"{parts})", flush=True)
        results[variant] = rows
        del engine
    if args.result_json:
        write_result(args.result_json, "step_profile",
                     machine=platform.processor() or platform.machine(),
                     threads=torch.get_num_threads(), results=results)


if __name__ == "__main__":
    main()
