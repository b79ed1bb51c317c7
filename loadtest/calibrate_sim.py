"""Refit a sim profile from the real engine on this machine: run a mixed workload through an
in-process engine, time every model step with its shape, and fit the step cost model of
services/executor/engine/sim.py by least squares on relative error.

    python -m loadtest.calibrate_sim --profile smollm2-cpu --result-json results/calibrate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path

import numpy as np

from loadtest.metrics import write_result
from services.executor.engine.llm_engine import Engine
from services.executor.engine.sim import step_features
from shared.sim_profiles import PROFILES_DIR
from shared.config import DEFAULT_MODEL, engine_config
from shared.protocol import Delta, GenerateRequest

FEATURES = ("base", "per_new_token", "per_kv_token", "per_attn_pair", "per_seq")


def workload(rng: random.Random, vocab: int) -> list[list[GenerateRequest]]:
    """Phases run one after another: a mixed burst (chunked prefill beside decodes, then decode
    batches shrinking from 48 to 1) and a few long contexts decoding together."""
    def request(prompt_len: int, max_tokens: int) -> GenerateRequest:
        return GenerateRequest(prompt_token_ids=[rng.randrange(17, vocab)
                                                 for _ in range(prompt_len)],
                               max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    burst = [request(rng.randint(16, 512), rng.randint(16, 200)) for _ in range(48)]
    long_context = [request(rng.randint(1024, 1800), 48) for _ in range(8)]
    return [burst, long_context]


async def measure(engine: Engine, phases: list[list[GenerateRequest]]) -> list[tuple]:
    """(new, kv, pairs, seqs, ms) of every step."""
    samples: list[tuple] = []
    runner = engine.runner
    prepare, execute = runner.prepare, runner.execute

    def timed_prepare(batch):  # remember each step's shape beside its inputs
        inputs = prepare(batch)
        inputs.features = step_features(batch)
        return inputs

    def timed_execute(inputs):
        start = time.perf_counter()
        sampled = execute(inputs)
        samples.append((*inputs.features, 1e3 * (time.perf_counter() - start)))
        return sampled

    runner.prepare, runner.execute = timed_prepare, timed_execute
    engine.start()

    async def run(request):
        async for output in engine.generate(request):
            if not isinstance(output, Delta):
                return output

    for phase in phases:
        await asyncio.gather(*(run(r) for r in phase))
    await engine.stop()
    return samples


def fit(samples: list[tuple]) -> tuple[dict[str, float], dict]:
    """Non-negative least squares on relative error (drop a feature whose weight comes out
    negative and refit)."""
    data = np.array(samples, dtype=float)
    columns = np.column_stack([np.ones(len(data)), data[:, :4]])
    ms = data[:, 4]
    keep = list(range(len(FEATURES)))
    while True:
        weight = 1.0 / ms
        coef, *_ = np.linalg.lstsq(columns[:, keep] * weight[:, None], ms * weight, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    cost = dict.fromkeys(FEATURES, 0.0)
    cost.update({FEATURES[k]: float(c) for k, c in zip(keep, coef)})
    predicted = columns[:, keep] @ coef
    error = np.abs(predicted - ms) / ms
    quality = {"steps": len(ms), "step_ms_range": [float(ms.min()), float(ms.max())],
               "relative_error_mean": float(error.mean()),
               "relative_error_p90": float(np.percentile(error, 90)),
               "total_ms_measured": float(ms.sum()), "total_ms_predicted": float(predicted.sum())}
    return cost, quality


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.calibrate_sim", description=__doc__)
    parser.add_argument("--profile", default="smollm2-cpu")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)

    config = engine_config({"model.name": args.model, "scheduler.batch_level.max_num_seqs": 128,
                            "scheduler.batch_level.max_num_batched_tokens": 512})
    engine = Engine(config)
    phases = workload(random.Random(args.seed), engine.model_config.vocab_size)
    samples = asyncio.run(measure(engine, phases))
    cost, quality = fit(samples)
    print(json.dumps({"step_ms": cost, "fit": quality}, indent=1))

    path = PROFILES_DIR / f"{args.profile}.json"
    profile = json.loads(path.read_text()) if path.exists() else {
        "model_shape": "smollm2-135m", "max_position": 8192, "kv_blocks": None,
        "eos_fraction": None}
    profile.update({
        "description": f"{args.model} on this machine's CPU (fp32, the engine's defaults), "
                       f"fitted by loadtest.calibrate_sim",
        "step_ms": {k: round(v, 9) for k, v in cost.items()} | {"weights": 0.0},
        "calibration": {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                        "date": time.strftime("%Y-%m-%d"), **quality}})
    path.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {path}")
    if args.result_json:
        write_result(args.result_json, "calibrate_sim", step_ms=cost, fit=quality, samples=samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
