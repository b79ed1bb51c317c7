import math

import torch

from services.executor.engine.sampler import SamplingBatch, sample, token_seed
from services.executor.engine.sequence import SamplingParams


def batch_of(*params, seed=0):
    return SamplingBatch(list(params), [None if p.greedy else token_seed(seed, i)
                                        for i, p in enumerate(params)])


def test_greedy_is_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    out = sample(logits, batch_of(*[SamplingParams(max_tokens=1, temperature=0.0)] * 4))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_filters_that_keep_one_token_equal_greedy():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(max_tokens=1, top_k=1), SamplingParams(max_tokens=1, top_p=1e-6),
              SamplingParams(max_tokens=1, min_p=1.0)]
    for _ in range(5):
        assert sample(logits, batch_of(*params)).tolist() == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(2))
    top5 = set(logits[0].topk(5).indices.tolist())
    params = SamplingParams(max_tokens=1, temperature=2.0, top_k=5)
    for i in range(200):
        token = sample(logits, SamplingBatch([params], [token_seed(3, i)])).item()
        assert token in top5


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # p = [0.25, 0.75]
    params = SamplingParams(max_tokens=1, temperature=1.0)
    draws = [sample(logits, SamplingBatch([params], [token_seed(4, i)])).item()
             for i in range(4000)]
    share = sum(draws) / len(draws)
    assert 0.72 < share < 0.78


def test_same_seed_same_tokens_regardless_of_neighbours():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9)
    alone = [sample(logits[1:2], SamplingBatch([p], [token_seed(42, 3)])).item()]
    mixed = sample(logits, SamplingBatch([SamplingParams(max_tokens=1, temperature=0.0), p,
                                          SamplingParams(max_tokens=1, temperature=0.5)],
                                         [None, token_seed(42, 3), token_seed(7, 3)]))
    assert mixed[1].item() == alone[0]


def test_token_seeds_differ_by_request_and_by_index():
    seeds = {token_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)


def test_the_inverse_cdf_draw_follows_the_distribution_across_blocks():
    """Blocks of 4 tokens over a vocabulary of 10 (the last block padded): each token's share of
    20,000 draws at evenly spread u is its probability, and tokens of zero probability (one
    inside a block, a whole block, the padding's neighbours) are never drawn, even at u -> 1."""
    from services.executor.engine.sampler import inverse_cdf

    probs = torch.tensor([0.1, 0.0, 0.2, 0.05, 0.0, 0.0, 0.0, 0.0, 0.65, 0.0])
    n = 20_000
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n)[:, None]
    drawn = inverse_cdf(probs.expand(n, -1).contiguous(), u, block=4)
    counts = torch.bincount(drawn, minlength=10).double() / n
    assert torch.allclose(counts, probs.double(), atol=1e-3), counts
    edge = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)
    assert inverse_cdf(probs.expand(2, -1).contiguous(), edge, block=4).tolist() == [0, 8]


def test_rows_that_are_not_numbers_take_their_greedy_token_and_fault_nothing():
    """A temperature so small the logits overflow (any client may send 1e-40), an infinite
    logit, a row all -inf: each row gets a token in range (its argmax), the others sample as
    ever, and nothing indexes outside a tensor (on a GPU, a device-side assert)."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(6))
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    logits[3, 5] = float("nan")
    hot = SamplingParams(max_tokens=1, temperature=1.0)
    tiny = SamplingParams(max_tokens=1, temperature=1e-40)
    assert tiny.greedy
    params = [tiny, hot, hot, hot]
    out = sample(logits, batch_of(*params, seed=9))
    assert out[0].item() == logits[0].argmax().item() and out[1].item() == 7
    assert all(0 <= t < 3000 for t in out.tolist())
