"""Exactness of speculative verification, checked by chi-square against the target distribution.

Model of one decoding run (context-independent rows, enough for the math):
position t has target row P[t] and draft row Q[t]. A round starting at position s
drafts d_j ~ Q[s + j] (or takes D[s + j] for a deterministic drafter), verifies
against P[s .. s + k], and emits [accepted drafts..., next_token]. Exactness means
the emitted stream x1, x2, ... is distributed as P[0] x P[1] x ..., whatever Q is.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from quickdraft.sampling import LogitsProcessor, SamplingParams, make_generator
from quickdraft.sampling.sampler import draw
from quickdraft.speculative.verify import (draw_uniforms, verify_greedy, verify_sampled,
                                           verify_sampled_batch, verify_with_uniforms)

V = 6
N = 20_000
ALPHA = 1e-3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------- chi-square
def chisq_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value that integer ``samples`` are draws from ``probs`` (outcomes 0..len-1).

    An outcome of probability 0 that is observed gives 0. Cells expected < 5 are merged.
    """
    probs = probs.double().reshape(-1).numpy()
    probs = probs / probs.sum()
    obs = np.bincount(samples.reshape(-1).numpy(), minlength=len(probs)).astype(float)
    if len(obs) > len(probs):
        return 0.0
    zero = probs <= 0
    if obs[zero].sum() > 0:
        return 0.0
    obs, probs = obs[~zero], probs[~zero]
    exp = probs * obs.sum()
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


# -------------------------------------------------------------------- cases
def normalise(x):
    return x / x.sum(-1, keepdim=True)


def make_case(p_kind: str, q_kind: str, k: int, seed: int, vp: int = V, vq: int = V):
    """P: [k+2, vp] target rows; Q: [k+2, vq] draft rows or None with D: [k+2] fixed drafts."""
    g = torch.Generator().manual_seed(seed)
    rows = k + 2
    if p_kind == "dense":
        P = normalise(torch.rand(rows, vp, generator=g) + 0.05)
    elif p_kind == "topk_temp":  # zeros from truncation, as the engine would produce them
        logits = torch.randn(rows, vp, generator=g) * 1.5
        P = LogitsProcessor(SamplingParams(top_k=3, temperature=0.7), [], vp).probs(logits)
    elif p_kind == "topp_minp":
        logits = torch.randn(rows, vp, generator=g) * 2.0
        P = LogitsProcessor(SamplingParams(top_p=0.8, min_p=0.05, temperature=1.3), [], vp).probs(logits)
    else:
        raise AssertionError(p_kind)
    D = None
    if q_kind == "close":
        Q = normalise(0.8 * P[:, :vq] + 0.2 * normalise(torch.rand(rows, vq, generator=g)))
    elif q_kind == "poor":
        Q = normalise(torch.rand(rows, vq, generator=g) ** 3 + 1e-3)
    elif q_kind == "mismatch":  # q = 0 on p's two best tokens, q > 0 where p = 0
        mask = torch.ones(rows, vq)
        top2 = P[:, :vq].topk(2, dim=-1).indices
        mask.scatter_(1, top2, 0.0)
        Q = normalise(torch.rand(rows, vq, generator=g) * mask + 1e-9 * mask)
    elif q_kind == "onehot":  # deterministic drafter: best token, then the worst one (p = 0 if any)
        Q = None
        D = torch.where(torch.arange(rows) % 2 == 0, P.argmax(-1), P.argmin(-1))
    else:
        raise AssertionError(q_kind)
    return P, Q, D


def simulate(P, Q, D, k, starts, verifier, g_draft, g_verify):
    """One round per entry of ``starts``; returns emitted [B, k+1] (-1 padded) and num_accepted [B]."""
    B = starts.numel()
    pos = starts[:, None] + torch.arange(k + 1)
    p = P[pos]
    if Q is None:
        drafts, q = D[pos[:, :k]], None
    else:
        q = Q[pos]  # k+1 rows: verify_sampled_batch ignores the last, the bonus-from-q mutant uses it
        drafts = torch.multinomial(q[:, :k].reshape(-1, q.shape[-1]), 1, generator=g_draft).view(B, k)
    n, nxt = verifier(p, q, drafts, g_verify)
    j = torch.arange(k + 1)
    padded = torch.cat([drafts, torch.full((B, 1), -1)], dim=1)
    emitted = torch.where(j < n[:, None], padded, torch.full_like(padded, -1))
    emitted[torch.arange(B), n] = nxt
    return emitted, n


def run(P, Q, D, k, verifier=verify_sampled_batch, seed=0):
    """x1, x2 of the emitted stream (second round where the first emitted only one token) and n1."""
    g_draft = torch.Generator().manual_seed(1000 + seed)
    g_verify = make_generator(2000 + seed)
    em1, n1 = simulate(P, Q, D, k, torch.zeros(N, dtype=torch.long), verifier, g_draft, g_verify)
    x1, x2 = em1[:, 0], em1[:, 1].clone()
    need = n1 == 0
    em2, _ = simulate(P, Q, D, k, torch.ones(int(need.sum()), dtype=torch.long), verifier, g_draft, g_verify)
    x2[need] = em2[:, 0]
    return x1, x2, n1


def pvalues(P, Q, D, k, verifier=verify_sampled_batch, seed=0):
    x1, x2, n1 = run(P, Q, D, k, verifier, seed)
    width = P.shape[-1]
    pv = {
        "first": chisq_pvalue(x1, P[0]),
        "joint": chisq_pvalue(x1 * width + x2, torch.outer(P[0].double(), P[1].double())),
    }
    # Given the first emitted token was an accepted draft: x1 ~ norm(min(p0, q0)) and x2 ~ p1.
    acc = n1 >= 1
    q0 = F.one_hot(D[0], width).float() if Q is None else F.pad(Q[0], (0, width - Q.shape[-1]))
    accepted_law = torch.minimum(P[0].double(), q0.double())
    # P(first draft accepted) = sum(min(p0, q0))
    pv["accept_rate"] = chisq_pvalue(acc.long(), torch.stack([1 - accepted_law.sum(), accepted_law.sum()]))
    if accepted_law.sum() * N >= 1000:  # enough accepted first drafts for a 36-cell test
        accepted_law = normalise(accepted_law)
        pv["cond"] = chisq_pvalue(x1[acc] * width + x2[acc], torch.outer(accepted_law, P[1].double()))
    return pv


CASES = [(pk, qk, k) for pk in ("dense", "topk_temp", "topp_minp") for qk in ("close", "poor", "mismatch", "onehot")
         for k in (1, 2, 3)]


@pytest.mark.parametrize("p_kind,q_kind,k", CASES, ids=[f"{a}-{b}-k{c}" for a, b, c in CASES])
def test_emitted_tokens_follow_p(p_kind, q_kind, k):
    seed = CASES.index((p_kind, q_kind, k))
    P, Q, D = make_case(p_kind, q_kind, k, seed)
    pv = pvalues(P, Q, D, k, seed=seed)
    if q_kind in ("close", "onehot"):  # poor / mismatched q may accept too rarely for the 36-cell check
        assert "cond" in pv
    assert all(v > ALPHA for v in pv.values()), pv


@pytest.mark.parametrize("vp,vq", [(8, 6), (6, 8)])
def test_different_widths(vp, vq):
    """p wider than q (padding ids with target mass) and q wider than p (draft mass beyond p)."""
    P, Q, _ = make_case("dense", "poor", 2, 77, vp=vp, vq=vq)
    if vq > vp:
        Q = normalise(torch.rand(4, vq, generator=torch.Generator().manual_seed(5)) + 0.5)
        P_eff = F.pad(P, (0, vq - vp))
    else:
        P_eff = P
    pv = pvalues(P, Q, None, 2, seed=3)
    x1, _, _ = run(P, Q, None, 2, seed=3)
    assert chisq_pvalue(x1, P_eff[0]) > ALPHA
    assert all(v > ALPHA for v in pv.values()), pv


# ------------------------------------------------------- the test can fail
def broken_residual_is_p(p, q, drafts, g):
    """Correct acceptance, but a rejection resamples from p instead of the residual."""
    B, k1, width = p.shape
    k = k1 - 1
    u = torch.rand((B, k), generator=g)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    n = (u * q_d < p_d).long().cumprod(-1).sum(-1)
    draws = torch.multinomial(p.reshape(-1, width), 1, generator=g).view(B, k1)
    return n, draws.gather(1, n[:, None]).squeeze(1)


def broken_accept_always(p, q, drafts, g):
    B, k1, width = p.shape
    return torch.full((B,), k1 - 1), torch.multinomial(p[:, -1], 1, generator=g).squeeze(1)


def broken_bonus_from_q(p, q, drafts, g):
    """Correct except that the bonus token is drawn from the draft's next row."""
    n, nxt = verify_sampled_batch(p, q, drafts, g)
    k = drafts.shape[1]
    bonus = torch.multinomial(q[:, k], 1, generator=g).squeeze(1)
    return n, torch.where(n == k, bonus, nxt)


@pytest.mark.parametrize("p_kind,q_kind,k", [("dense", "poor", 2), ("topk_temp", "mismatch", 1),
                                             ("topp_minp", "poor", 3)])
def test_broken_verifiers_fail(p_kind, q_kind, k):
    P, Q, D = make_case(p_kind, q_kind, k, 11)
    assert pvalues(P, Q, D, k, seed=1)["first"] > ALPHA  # the real one passes on this case
    for broken in (broken_residual_is_p, broken_accept_always):
        pv = pvalues(P, Q, D, k, verifier=broken, seed=1)
        assert pv["first"] < ALPHA, (broken.__name__, pv)


def test_broken_bonus_fails_conditional_check():
    # x1 stays exact (the bonus is never the first token for k=1), so only the two-token checks see it.
    P, Q, D = make_case("dense", "close", 1, 5)
    Q = Q.clone()
    Q[1] = normalise(torch.tensor([5.0, 1, 1, 1, 1, 0.01]))
    pv = pvalues(P, Q, D, 1, verifier=broken_bonus_from_q, seed=2)
    assert pv["first"] > ALPHA
    assert pv["cond"] < ALPHA and pv["joint"] < ALPHA, pv
    assert all(v > ALPHA for v in pvalues(P, Q, D, 1, seed=2).values())


# ------------------------------------------------------ single-call API
def test_verify_sampled_single_calls_follow_p():
    P, Q, _ = make_case("topk_temp", "poor", 2, 21)
    g_draft, g = torch.Generator().manual_seed(0), make_generator(9)
    firsts = []
    for _ in range(3000):
        d = torch.multinomial(Q[:2], 1, generator=g_draft).squeeze(1)
        n, nxt = verify_sampled(P[:3], Q[:2], d.tolist(), g)
        assert 0 <= n <= 2
        firsts.append(d[0].item() if n else nxt)
    assert chisq_pvalue(torch.tensor(firsts), P[0]) > ALPHA


def test_seeded_generator_reproducible():
    P, Q, _ = make_case("dense", "poor", 3, 4)
    drafts = torch.multinomial(Q[:3], 1, generator=torch.Generator().manual_seed(0)).squeeze(1).tolist()

    def outcomes(seed):
        g = make_generator(seed)
        return [verify_sampled(P[:4], Q[:3], drafts, g) for _ in range(50)]

    assert outcomes(123) == outcomes(123)
    assert outcomes(123) != outcomes(124)
    assert outcomes(None) != outcomes(None)
    a = verify_sampled_batch(P[None, :4].expand(500, -1, -1), None, torch.tensor([drafts] * 500), make_generator(5))
    b = verify_sampled_batch(P[None, :4].expand(500, -1, -1), None, torch.tensor([drafts] * 500), make_generator(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------ edge cases
def test_edge_cases():
    g = make_generator(0)
    p = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    # q == p accepts always (u < 1); p(d) = 0 never accepts
    for _ in range(50):
        assert verify_sampled(p, p[:1], [1], g)[0] == 1
        n, nxt = verify_sampled(torch.tensor([[0.0, 0.5, 0.5], [1.0, 0, 0]]), p[:1], [0], g)
        assert n == 0 and nxt in (1, 2)
        # one-hot draft with p(d) = 1: accepted; then bonus from p_1
        n, nxt = verify_sampled(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), None, [1], g)
        assert (n, nxt) == (1, 2)
        # one-hot draft rejected: the residual excludes the draft
        n, nxt = verify_sampled(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]), None, [1], g)
        assert (n, nxt) == (0, 2)
        # q(d) = 0 < p(d) (draft outside q's support): accepted
        assert verify_sampled(p, torch.tensor([[1.0, 0.0, 0.0]]), [2], g)[0] == 1
    # zero residual mass (p <= q everywhere: unnormalised p) falls back to p, no crash
    for _ in range(50):
        n, nxt = verify_sampled(torch.tensor([[0.0, 0.25, 0.25], [0, 1.0, 0]]), torch.tensor([[0.0, 0.5, 0.5]]), [1], g)
        assert (n, nxt) in ((0, 1), (0, 2), (1, 1))
    # k = 0: plain sampling from p_0
    assert verify_sampled(torch.tensor([[0.0, 1.0]]), None, [], g) == (0, 1)
    assert verify_sampled(torch.tensor([[0.0, 1.0]]), torch.zeros(0, 2), [], g) == (0, 1)
    # half precision inputs
    assert verify_sampled(p.half(), p[:1].bfloat16(), torch.tensor([2]), g)[0] == 1
    with pytest.raises(ValueError):
        verify_sampled(p, p[:1], [1, 2], g)
    with pytest.raises(ValueError):
        verify_sampled(p, p, [1, 2, 0], g)
    with pytest.raises(ValueError):
        verify_sampled(p, p[:1], [3], g)
    with pytest.raises(ValueError):
        verify_sampled(p, p[:1], [-1], g)


def test_verify_greedy():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == (3, 8)
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == (1, 6)
    assert verify_greedy([5, 6, 7, 8], [1, 6, 7]) == (0, 5)
    assert verify_greedy([4], []) == (0, 4)
    assert verify_greedy(torch.tensor([1, 2]), torch.tensor([1])) == (1, 2)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])


def test_verification_from_uniforms_is_the_generators():
    """Uniforms drawn ahead (what a GPU step sends to the device) give what the generator gives when it draws them
    itself, draw for draw; a row that is no distribution is flagged, not raised, so nothing is read back."""
    P, Q, _ = make_case("dense", "poor", 3, 4)
    drafts = torch.tensor([[4, 2, 0]] * 300)  # accepted with probability 0.10, 0.53, 0.61: every count occurs
    a = verify_sampled_batch(P[None, :4].expand(300, -1, -1), Q[None, :3].expand(300, -1, -1), drafts, make_generator(9))
    u = draw_uniforms(make_generator(9), 300, 3)
    b = verify_with_uniforms(P[None, :4].expand(300, -1, -1), Q[None, :3].expand(300, -1, -1), drafts, u)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and bool(b[2].all())
    assert len(set(a[0].tolist())) == 4  # every acceptance count occurred: the residual and the bonus ran
    bad = torch.tensor([[[float("nan"), 0.5, 0.5]], [[0.0, 0.0, 0.0]], [[0.2, 0.3, 0.5]]])
    _, token, valid = verify_with_uniforms(bad, None, torch.zeros(3, 0, dtype=torch.long), draw_uniforms(None, 3, 0))
    assert valid.tolist() == [False, False, True] and 0 <= int(token[2]) < 3
    # u at the top of the mass takes the last token that has any
    assert draw(torch.tensor([[0.3, 0.7, 0.0]]), torch.tensor([1.0]))[0].tolist() == [1]


def test_a_draft_steps_tokens_decided_together_equal_one_at_a_time():
    """``draft_tokens`` decides a whole draft step at once (one copy back on a GPU): each row's token is the one its
    own greedy argmax or inverse-CDF draw gives, its q row its own softmax bit for bit; a row with no finite logit is
    None; a sampled row that is no distribution raises."""
    from quickdraft.sampling.sampler import NOT_A_DISTRIBUTION, greedy, sample_with_uniforms
    from quickdraft.speculative.drafters import draft_tokens

    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        n, width = 1 + trial % 7, 50 + 97 * trial
        logits = torch.randn(n, width, generator=g) * 3
        logits[0, :] = float("-inf") if trial % 5 == 0 else logits[0, :]
        uniforms = [None if (trial + j) % 3 == 0 else float(torch.rand(1, generator=g)) for j in range(n)]
        tokens, qs = draft_tokens(logits, uniforms)
        for j in range(n):
            row = logits[j:j + 1]
            if not torch.isfinite(row).any():
                assert tokens[j] is None
            elif uniforms[j] is None:
                assert tokens[j] == greedy(row)[0] and qs[j] is None
            else:
                q = torch.softmax(row, dim=-1)
                assert tokens[j] == int(sample_with_uniforms(q, [uniforms[j]])[0]) and torch.equal(qs[j], q[0])
    bad = torch.zeros(2, 8)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match=NOT_A_DISTRIBUTION[:20]):
        draft_tokens(bad, [None, 0.5])
