"""The rejection sampler: greedy prefix rule, and the target distribution preserved exactly."""

import torch

from kvmulti.spec_decode.rejection_sampler import greedy_verify, random_verify


def one_hot_logits(tokens, vocab):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_greedy_accepts_matching_prefix_and_adds_target_token():
    target = torch.stack([one_hot_logits([3, 1, 4, 1], 8),        # drafts 3,1,4 all match -> bonus 1
                          one_hot_logits([3, 2, 4, 1], 8),        # mismatch at 1 -> emits 3, 2
                          one_hot_logits([5, 2, 4, 1], 8)])       # mismatch at 0 -> emits 5
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4], [3, 1, 4]])
    v = greedy_verify(drafts, target)
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert [v.emitted(i) for i in range(3)] == [[3, 1, 4, 1], [3, 2], [5]]
    assert v.tokens[2].tolist() == [5, -1, -1, -1]


def test_random_sampler_preserves_target_distribution():
    """k = 2 over a 4-token vocabulary with fixed p (target) and q (draft): the first emitted token
    and the second (given all paths) follow p; chi-square against thousands of draws."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.1, 0.1, 0.4, 0.4])
    n = 40000
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q.expand(n, 4), 2, replacement=True, generator=gen)
    v = random_verify(drafts, q.expand(n, 2, 4), p.expand(n, 3, 4), generator=gen)
    first = v.tokens[:, 0]
    counts = torch.bincount(first, minlength=4).float()
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts / n, chi2)        # 3 dof, p = 0.001
    # The second token, where one was emitted at position 1, also follows p (independent positions).
    second = v.tokens[:, 1][v.tokens[:, 1] >= 0]
    counts2 = torch.bincount(second, minlength=4).float()
    chi2b = float(((counts2 - p * len(second)) ** 2 / (p * len(second))).sum())
    assert chi2b < 16.3, (counts2 / len(second), chi2b)
    # Acceptance rate matches theory: sum_x min(p, q).
    acc = float((v.num_accepted >= 1).float().mean())
    assert abs(acc - float(torch.minimum(p, q).sum())) < 0.01


def test_random_sampler_identical_distributions_accepts_all():
    p = torch.tensor([0.25, 0.25, 0.5])
    drafts = torch.tensor([[2, 0, 1]])
    v = random_verify(drafts, p.expand(1, 3, 3), p.expand(1, 4, 3), generator=torch.Generator().manual_seed(0))
    assert v.num_accepted.tolist() == [3]
