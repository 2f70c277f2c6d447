"""Tests of ppo_llm.py: every estimator / KL type / loss / aggregation mode against plain references, micro-batch
accumulation, left padding, ratio 1 on the first minibatch, bad input, smoke runs, local model loading, resume."""
import copy
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_llm as P  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared 2-core machine

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ppo_llm.py")
SMALL = (128, 2)  # hidden size, layers: a 0.34M model for the tests (the default is 2M)
TINY = ["--sft-steps", "5", "--eval-prompts", "8", "--rollout-batch-size", "4", "--n", "2",
        "--ppo-mini-batch-size", "2", "--micro-batch-size", "2", "--num-iterations", "2", "--no-save-model",
        "--tiny-hidden-size", "128", "--tiny-num-layers", "2", "--torch-threads", "1", "--no-cuda"]  # (GPU hosts too)


def hand_batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 1, 4, 2, 5][:B]
    mask = torch.tensor([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths])
    return g, mask, lengths


# ----- KL estimators -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_penalty_elementwise(kind):
    g = torch.Generator().manual_seed(1)
    lp, ref = -torch.rand(4, 3, generator=g) * 3, -torch.rand(4, 3, generator=g) * 3
    out = P.kl_penalty(lp, ref, kind)
    for i in range(4):
        for j in range(3):
            a, b = lp[i, j].item(), ref[i, j].item()
            want = {"kl": a - b, "abs": abs(a - b), "mse": 0.5 * (a - b) ** 2,
                    "low_var_kl": min(10.0, max(-10.0, math.exp(b - a) - (b - a) - 1))}[kind]
            assert out[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_kl_low_var_clamped_and_full():
    assert P.kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(2, 3, 5, generator=g).log_softmax(-1)
    ref = torch.randn(2, 3, 5, generator=g).log_softmax(-1)
    out = P.kl_penalty(lp, ref, "full")
    for i in range(2):
        for t in range(3):
            want = sum(math.exp(lp[i, t, v]) * (lp[i, t, v] - ref[i, t, v]) for v in range(5))
            assert out[i, t].item() == pytest.approx(float(want), rel=1e-5)
    assert (out >= 0).all()
    with pytest.raises(ValueError, match="low_var_kl"):
        P.kl_penalty(lp, ref, "k9")


def test_adaptive_kl_controller():
    c = P.AdaptiveKLController(0.2, target_kl=1.0, horizon=100)
    c.update(current_kl=3.0, n_steps=10)  # error clipped to +0.2
    assert c.value == pytest.approx(0.2 * (1 + 0.2 * 10 / 100))
    c.update(current_kl=0.9, n_steps=10)
    assert c.value == pytest.approx(0.2 * 1.02 * (1 - 0.1 * 10 / 100))


# ----- aggregation, policy loss, value loss ------------------------------------------------------------------
def ref_agg(loss, mask, mode, norm_len):
    B, T = loss.shape
    rows = [[loss[i, t].item() for t in range(T) if mask[i, t] > 0] for i in range(B)]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / B
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / B
    return sum(sum(r) for r in rows) / (B * norm_len)


@pytest.mark.parametrize("mode", P.LOSS_AGG_MODES)
def test_agg_loss(mode):
    g, mask, _ = hand_batch()
    loss = torch.randn(mask.shape, generator=g)
    assert P.agg_loss(loss, mask, mode).item() == pytest.approx(ref_agg(loss, mask, mode, 5), rel=1e-5)
    assert P.agg_loss(loss, mask, mode, norm_len=8).item() == pytest.approx(ref_agg(loss, mask, mode, 8), rel=1e-5)


def test_agg_loss_unknown_mode_lists_choices():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        P.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum")


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("mode", P.LOSS_AGG_MODES)
def test_policy_loss(dual, mode):
    g, mask, _ = hand_batch(3)
    old = -torch.rand(mask.shape, generator=g) * 2
    lp = old + torch.randn(mask.shape, generator=g) * 0.8  # large ratios: both clips and the dual clip are hit
    adv = torch.randn(mask.shape, generator=g) * 2
    lo, hi, c = 0.2, 0.28, 3.0
    loss, stats = P.policy_loss(lp, old, adv, mask, lo, hi, dual, c, mode)
    ref = torch.zeros(mask.shape)
    n_clip = n = 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            r, a = math.exp(lp[i, t] - old[i, t]), adv[i, t].item()
            l1, l2 = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            val = max(l1, l2)
            if dual and a < 0:
                val = min(val, -a * c)
            ref[i, t] = val
            if mask[i, t] > 0:
                n += 1
                n_clip += l2 > l1
    assert loss.item() == pytest.approx(ref_agg(ref, mask, mode, 5), rel=1e-5)
    assert stats["clipfrac"].item() == pytest.approx(n_clip / n)
    assert 0 < stats["clipfrac"].item() < 1


@pytest.mark.parametrize("clip,delta", [(None, None), (0.2, None), (None, 0.5), (0.2, 0.5)])
def test_value_loss(clip, delta):
    g, mask, _ = hand_batch(4)
    vp, old, ret = (torch.randn(mask.shape, generator=g) for _ in range(3))

    def err(x):
        if delta is None:
            return 0.5 * x * x
        return 0.5 * x * x if abs(x) <= delta else delta * (abs(x) - 0.5 * delta)

    ref = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            v, o, r = vp[i, t].item(), old[i, t].item(), ret[i, t].item()
            val = err(r - v)
            if clip is not None:
                val = max(val, err(r - min(max(v, o - clip), o + clip)))
            ref[i, t] = val
    loss, _ = P.value_loss(vp, old, ret, mask, clip, delta, "token-mean")
    assert loss.item() == pytest.approx(ref_agg(ref, mask, "token-mean", 5), rel=1e-5)


# ----- advantages -------------------------------------------------------------------------------------------
def test_gae_against_loop():
    g, mask, lengths = hand_batch(5)
    rewards = torch.randn(mask.shape, generator=g) * mask
    values = torch.randn(mask.shape, generator=g)  # garbage past EOS must not leak in
    gamma, lam = 0.9, 0.8
    adv, ret = P.compute_gae(rewards, values, mask, gamma, lam)
    for i, L in enumerate(lengths):
        last = 0.0
        for t in reversed(range(L)):
            nv = values[i, t + 1].item() if t + 1 < L else 0.0
            last = rewards[i, t].item() + gamma * nv - values[i, t].item() + gamma * lam * last
            assert adv[i, t].item() == pytest.approx(last, rel=1e-5, abs=1e-6)
            assert ret[i, t].item() == pytest.approx(last + values[i, t].item(), rel=1e-5, abs=1e-6)
        assert (adv[i, L:] == 0).all()


def group_fixture():
    _, mask, _ = hand_batch(6)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    return P.token_level_scores(scores, mask), mask, groups, scores


def test_token_level_scores_on_last_token():
    tr, mask, _, scores = group_fixture()
    for i, L in enumerate(mask.sum(-1).long().tolist()):
        assert tr[i, L - 1] == scores[i] and tr[i].abs().sum() == abs(scores[i])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(norm_by_std):
    tr, mask, groups, scores = group_fixture()
    adv = P.compute_grpo(tr, mask, groups, norm_by_std)
    for i in range(6):
        grp = [scores[j].item() for j in range(6) if groups[j] == groups[i]]
        mean = sum(grp) / 3
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / 2)
        want = (scores[i].item() - mean) / ((std + 1e-6) if norm_by_std else 1)
        assert torch.allclose(adv[i], want * mask[i], atol=1e-5)


def test_rloo():
    tr, mask, groups, scores = group_fixture()
    adv = P.compute_rloo(tr, mask, groups)
    for i in range(6):
        others = [scores[j].item() for j in range(6) if groups[j] == groups[i] and j != i]
        assert torch.allclose(adv[i], (scores[i].item() - sum(others) / len(others)) * mask[i], atol=1e-5)


def ref_whiten(vals):  # vals: list of floats (the masked entries)
    m = sum(vals) / len(vals)
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return [(v - m) / math.sqrt(var + 1e-8) for v in vals]


def test_reinforce_plus_plus():
    g, mask, lengths = hand_batch(7)
    tr = torch.randn(mask.shape, generator=g) * mask
    gamma = 0.9
    adv, _ = P.compute_reinforce_plus_plus(tr, mask, gamma)
    rets, where = [], []
    for i, L in enumerate(lengths):
        run = 0.0
        for t in reversed(range(L)):
            run = tr[i, t].item() + gamma * run
            rets.append(run), where.append((i, t))
    for (i, t), w in zip(where, ref_whiten(rets)):
        assert adv[i, t].item() == pytest.approx(w, rel=1e-4, abs=1e-5)
    assert (adv * (1 - mask) == 0).all()


def test_reinforce_return_to_go_and_estimator_choice():
    g, mask, lengths = hand_batch(8)
    tr = torch.randn(mask.shape, generator=g) * mask
    adv = P.compute_reinforce(tr, mask, 0.8)
    for i, L in enumerate(lengths):
        for t in range(mask.shape[1]):
            expected = sum(0.8 ** (k - t) * tr[i, k].item() for k in range(t, L)) if t < L else 0.0
            assert adv[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    raw, _ = P.compute_advantages("reinforce", tr, mask, None, gamma=0.8, whiten=False)
    assert torch.allclose(raw, adv)
    white, _ = P.compute_advantages("reinforce", tr, mask, None, gamma=0.8, whiten=True)
    vals = [adv[i, t].item() for i, L in enumerate(lengths) for t in range(L)]
    got = [white[i, t].item() for i, L in enumerate(lengths) for t in range(L)]
    assert got == pytest.approx(ref_whiten(vals), rel=1e-4, abs=1e-5)


def test_reinforce_plus_plus_baseline():
    tr, mask, groups, scores = group_fixture()
    adv = P.compute_reinforce_plus_plus_baseline(tr, mask, groups)
    vals, where = [], []
    for i in range(6):
        grp = [scores[j].item() for j in range(6) if groups[j] == groups[i]]
        for t in range(int(mask[i].sum())):
            vals.append(scores[i].item() - sum(grp) / 3), where.append((i, t))
    for (i, t), w in zip(where, ref_whiten(vals)):
        assert adv[i, t].item() == pytest.approx(w, rel=1e-4, abs=1e-5)


def test_advantage_whiten_and_clip():
    tr, mask, groups, _ = group_fixture()
    adv, _ = P.compute_advantages("rloo", tr, mask, groups, whiten=True, advantage_clip=0.5)
    assert adv.abs().max() <= 0.5 and (adv * (1 - mask) == 0).all()
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        P.compute_advantages("vtrace", tr, mask, groups)


def test_reward_normalisation():
    s = torch.tensor([1.0, 3.0, 0.0, 4.0, 2.0, 2.0])
    grp = torch.tensor([0, 0, 1, 1, 2, 2])
    out = P.normalize_scores(s, grp, "group", False, False, None)
    # ROLL: (s - mean_g) / (std_g + 1e-6) with the sample std (torch.std): a pair -> -+1/sqrt(2); equal scores -> 0
    r = 2 ** -0.5
    assert torch.allclose(out, torch.tensor([-r, r, -r, r, 0.0, 0.0]), atol=1e-5)
    out = P.normalize_scores(s, grp, "batch", False, False, None)
    mean = sum(s.tolist()) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in s.tolist()) / 5)  # n - 1
    assert torch.allclose(out, (s - mean) / (std + 1e-6), atol=1e-5)
    out = P.normalize_scores(s, grp, "batch", True, False, None)
    assert torch.allclose(out, s - 2.0)
    out = P.normalize_scores(s, grp, "batch", False, True, 1.0)
    assert torch.allclose(out, (s / std).clamp(-1, 1), atol=1e-5)
    rm = P.RunningMoments()
    out = P.normalize_scores(s, grp, "running", False, False, None, rm)
    assert rm.mean == pytest.approx(2.0, rel=1e-6) and rm.std == pytest.approx(math.sqrt(10 / 5), rel=1e-6)
    assert torch.allclose(out, (s - 2.0) / math.sqrt(2.0), atol=1e-6)
    t = torch.tensor([5.0, -1.0, 0.5, 0.5])  # a second batch: the statistics of the whole stream (ROLL's std, n - 1)
    out = P.normalize_scores(t, torch.tensor([0, 0, 1, 1]), "running", False, False, None, rm)
    stream = s.tolist() + t.tolist()
    m = sum(stream) / 10
    sd = math.sqrt(sum((x - m) ** 2 for x in stream) / 9)
    assert rm.mean == pytest.approx(m, rel=1e-6) and rm.std == pytest.approx(sd, rel=1e-6)
    assert torch.allclose(out, (t - m) / sd, atol=1e-6)


def test_reward_clip_also_clips_token_rewards_after_the_kl_penalty():
    """ROLL: scores clipped after normalisation, then the token rewards (score - beta * kl) clipped again."""
    raw = torch.tensor([5.0, -5.0])
    maskf = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kld = torch.tensor([[20.0, 0.5, -30.0], [1.0, -1.0, 7.0]]) * maskf
    args = P.parse_args(["--adv-estimator", "reinforce_plus_plus", "--critic", "none", "--reward-clip", "2",
                         "--init-kl-coef", "0.1", "--gamma", "1", "--no-cuda"])
    ctrl = P.FixedKLController(args.init_kl_coef)
    _, ret, scores, _ = P.rewards_and_advantages(raw, maskf, torch.zeros_like(maskf), kld, args, ctrl,
                                                   P.RunningMoments())
    assert scores.tolist() == [2.0, -2.0]
    token = [[-2.0, -0.05, min(2.0 + 3.0, 2.0)], [-0.1, max(-2.0 + 0.1, -2.0), 0.0]]  # clip(s - 0.1 kl) per token
    expected = torch.tensor(token).flip(-1).cumsum(-1).flip(-1) * maskf  # reinforce++: the return to go (gamma 1)
    assert torch.allclose(ret, expected, atol=1e-6), ret


def test_response_mask_and_sampling_filters():
    resp = torch.tensor([[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 1, 0]])
    assert P.response_mask_from(resp, 1).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(P.sample_token(logits, 1.0, 1.0, 2, g).tolist()) == {2, 3}  # both kept, nothing else
    p = torch.tensor([0.0, 1.0, 2.0, 3.0]).softmax(-1)  # top-p 0.7 keeps {3, 2} (0.64 + 0.24 >= 0.7)
    assert set(P.sample_token(logits, 1.0, 0.7, 0, g).tolist()) == {2, 3} and p[3] < 0.7


# ----- model-level: padding, accumulation, ratio 1 -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    tok = P.build_char_tokenizer()
    return tok, P.disable_dropout(P.build_tiny_model(tok, 0, *SMALL))


@pytest.fixture
def tiny_copy(tiny):
    """The tiny model's tokenizer and a copy of it that a test may train."""
    return tiny[0], copy.deepcopy(tiny[1])


CHAT = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_prompt_token_ids_special_tokens_and_chat_template():
    from tokenizers import processors

    tok = P.build_char_tokenizer()
    plain = tok.encode("31=", add_special_tokens=False)
    assert P.prompt_token_ids(tok, "31=") == plain  # the built-in tokenizer adds nothing: the default task as before
    # a tokenizer that adds BOS keeps it; one that also appends EOS loses the EOS (the response follows the prompt)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    assert P.prompt_token_ids(tok, "31=") == [tok.bos_token_id, *plain]
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    assert P.prompt_token_ids(tok, "31=") == [tok.bos_token_id, *plain]
    # chat template: the rendered user turn + generation prompt, special-token text mapped to its id
    tok.chat_template = CHAT
    want = [tok.bos_token_id, *tok.encode("<user>31=<assistant>", add_special_tokens=False)]
    assert P.prompt_token_ids(tok, "31=", chat=True) == want
    ids, mask = P.encode_batch(tok, [{"prompt": "31="}, {"prompt": "7="}], 24, chat=True)
    assert ids[0, -len(want):].tolist() == want and mask.sum(1).tolist() == [len(want), len(want) - 1]
    # the reward model sees the exchange in its template (with the chat flag), else the plain text
    enc = P.reward_model_inputs(tok, ["31="], ["13"], chat=True)
    assert tok.decode(enc["input_ids"][0]) == "<bos><user>31=<assistant>13"
    enc = P.reward_model_inputs(P.build_char_tokenizer(), ["31=", "7="], ["13", "7"])
    assert enc["input_ids"][1].tolist()[-1] == tok.pad_token_id and enc["attention_mask"].sum(1).tolist() == [5, 3]


def test_apply_chat_template_run_and_missing_template(tmp_path, capsys, monkeypatch):
    tok = P.build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}"  # the prompt behind a marker
    P.build_tiny_model(tok, 3, *SMALL).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    prompts, encode = [], P.encode_batch  # what the policy is given: the prompts in the template

    def spy(tok, rows, length, chat=False):
        ids, mask = encode(tok, rows, length, chat)
        prompts.extend(tok.decode(i[m.bool()]) for i, m in zip(ids, mask))
        return ids, mask

    monkeypatch.setattr(P, "encode_batch", spy)
    res = P.main(P.parse_args([*TINY, "--num-iterations", "1", "--runs-dir", str(tmp_path / "r"),
                               "--model-name-or-path", str(tmp_path / "lm"), "--apply-chat-template"]))
    assert all(math.isfinite(v) for v in res["stats"].values())
    assert prompts and all(p.startswith("Q:") and p.endswith("=") for p in prompts), prompts[:3]
    assert "no chat template" in one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "r"),
                                                                                 "--apply-chat-template"]))


def test_left_padding_matches_unpadded(tiny):
    tok, m = tiny
    a, b = tok.encode("98765=", add_special_tokens=False), tok.encode("12=", add_special_tokens=False)
    ids, mask = P.left_pad([a, b], tok.pad_token_id, 10)
    resp = torch.tensor([[20, 21, 1, 0], [22, 1, 0, 0]])
    rm = P.response_mask_from(resp, 1)
    batched = P.model_forward(m, torch.cat([ids, resp], 1), torch.cat([mask, rm], 1), 4, 0.7)["logp"]
    for i, (p, r) in enumerate([(a, resp[0]), (b, resp[1])]):
        single = P.model_forward(m, torch.cat([torch.tensor([p]), r[None]], 1),
                                 torch.cat([torch.ones(1, len(p), dtype=torch.long), rm[i:i + 1]], 1), 4, 0.7)["logp"]
        k = int(rm[i].sum())
        assert torch.allclose(batched[i, :k], single[0, :k], atol=1e-5)
    # generation with KV cache and left padding equals generation of each prompt alone (greedy)
    g = P.generate(m, ids, mask, 5, 1, 0, greedy=True)
    for i, p in enumerate([a, b]):
        alone = P.generate(m, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), 5, 1, 0, greedy=True)
        assert g[i].tolist() == alone[0].tolist()


def scoring_batch(tok, rows: int):
    """The first `rows` of two left-padded prompts and their responses of 4 tokens (EOS 1, then padding): prompt ids and
    mask, and the prompt + response ids and attention mask that scoring and the update read."""
    ids, mask = P.left_pad([tok.encode(p, add_special_tokens=False) for p in ("98765=", "12=")[:rows]],
                           tok.pad_token_id, 10)
    resp = torch.tensor([[20, 21, 1, 0], [22, 1, 0, 0]])[:rows]
    return ids, mask, torch.cat([ids, resp], 1), torch.cat([mask, P.response_mask_from(resp, 1)], 1)


def test_compiled_forward_gives_the_eager_log_probs_gradients_and_tokens():
    """--compile: scoring and the update's gradients through the compiled forward (dynamic shapes), and KV-cache
    generation (whose blocks run eager), equal the eager model's. Traced by dynamo and AOT autograd as under
    --compile; the kernels are run eagerly ("aot_eager") because inductor's C++ compilation of them takes minutes on
    two cores."""
    tok = P.build_char_tokenizer()
    # one layer (less to trace), the same weights twice
    eager, compiled = (P.disable_dropout(P.build_tiny_model(tok, 0, 64, 1)) for _ in range(2))
    P.compile_forward(compiled, backend="aot_eager")
    ids, mask, full, attn = scoring_batch(tok, 2)
    out = [P.model_forward(m, full, attn, 4, 0.7, entropy=True) for m in (eager, compiled)]
    for key in ("logp", "entropy"):
        assert torch.allclose(out[0][key], out[1][key], atol=1e-5), key
    eager.zero_grad(), compiled.zero_grad()
    for o in out:
        (o["logp"] * attn[:, -4:]).sum().backward()
    grads = [(p.grad, q.grad) for p, q in zip(eager.parameters(), compiled.parameters())]
    assert all(g is not None and torch.allclose(g, h, atol=1e-5) for g, h in grads)
    assert any(g.abs().sum() > 0 for g, _ in grads)
    assert torch.equal(P.generate(eager, ids, mask, 4, 1, 0, greedy=True),
                       P.generate(compiled, ids, mask, 4, 1, 0, greedy=True))


def test_compile_traces_the_block_once_for_all_blocks_and_generation_runs_eager():
    """--compile compiles the parts of the transformer blocks, once for all blocks: a 3-block policy and critic trace
    as many operations as 1-block ones, in scoring and in the update (the whole forward compiled traced each block).
    The critic builds no KV cache (each block would write its own slot: one compile per block), KV-cache generation
    runs the blocks eager, a deep copy's compiled parts are bound to the copy, and the rollout's copy has none (its
    decoding step is compiled whole, or not at all)."""
    from torch._dynamo.utils import counters
    tok = P.build_char_tokenizer()
    ids, mask, full, attn = scoring_batch(tok, 1)
    traced = []
    for layers in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        policy = P.disable_dropout(P.build_tiny_model(tok, 0, 64, layers))
        critic = P.make_critic(policy)
        for m in (policy, critic):
            P.compile_forward(m, backend="aot_eager")
        twin = copy.deepcopy(policy)  # (rollout_copy's deep copy: its compiled parts run the copy's weights)
        assert all(p.forward.__self__ is p for p in twin.modules() if "forward" in p.__dict__)
        assert not any("forward" in p.__dict__ for p in P.rollout_copy(policy, torch.float32).modules())
        P.generate(policy, ids, mask, 4, 1, 0, greedy=True)
        assert not counters["stats"], "generation compiled"
        with torch.no_grad():
            P.model_forward(policy, full, attn, 4, 1.0), P.critic_values(critic, full, attn, 4)
        (P.model_forward(policy, full, attn, 4, 1.0)["logp"].sum() + P.critic_values(critic, full, attn, 4).sum()
         ).backward()
        traced.append(counters["stats"]["calls_captured"])
    assert traced[0] == traced[1] > 0
    assert torch._dynamo.config.recompile_limit >= 64  # (policy and critic variants of one code: more than 8)


def test_compiled_blocks_keep_gradient_checkpointing_under_fsdp2(tmp_path):
    """--compile --gradient-checkpointing under FSDP2 (a gloo group of one process): each block still recomputes its
    forward in the backward (FSDP2 subclasses the block, whose forward transformers wraps with the checkpoint: a
    compiled block forward would bypass it), its parts are compiled inside the checkpoint, and the gradients are the
    eager model's."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    tok = P.build_char_tokenizer()
    ids, mask, full, attn = scoring_batch(tok, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        calls, grads, traced = [], [], []
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            m = P.disable_dropout(P.build_tiny_model(tok, 0, 64, 2))
            m.activation_checkpointing_enable()
            if compiled:  # (prepare_models' order: compile, then distribute)
                P.compile_forward(m, backend="aot_eager")
            m = P.distribute(m, "fsdp2", torch.device("cpu"))
            n = [0]
            for layer in m.model.layers:
                layer.self_attn.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
            m.train()
            P.model_forward(m, full, attn, 4, 1.0)["logp"].sum().backward()
            calls.append(n[0])
            grads.append([p.grad.full_tensor() for p in m.parameters()])
            traced.append(counters["stats"]["calls_captured"])
    finally:
        dist.destroy_process_group()
    assert calls == [4, 4]  # (2 blocks, each run in the forward and again in the backward)
    assert traced[0] == 0 < traced[1]
    assert all(torch.allclose(g, h, atol=1e-5) for g, h in zip(*grads))


def full_log_softmax(model, ids, attn, R: int, temperature: float):
    """The plain reference of model_forward: the model's own (B, R, V) logits of the response positions."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=P.position_ids_from(attn)).logits
    return (logits[:, -R - 1:-1].float() / temperature).log_softmax(-1)


def make_update_batch(tok, m, args, critic=None, seed=0, forward_chunk=None):
    """A rollout batch whose old log-probs come from forwards of forward_chunk rows (default: the micro-batch)."""
    chunk = forward_chunk or args.micro_batch_size
    gen = torch.Generator().manual_seed(seed)
    rows = P.make_problems(args.rollout_batch_size * args.n, gen)
    ids, mask = P.encode_batch(tok, rows, args.prompt_length)
    resp = P.generate(m, ids, mask, args.response_length, tok.eos_token_id, tok.pad_token_id, gen=gen)
    rm = P.response_mask_from(resp, tok.eos_token_id)
    ids, attn = torch.cat([ids, resp], 1), torch.cat([mask, rm], 1)
    with torch.no_grad():
        old = torch.cat([P.model_forward(m, ids[s:s + chunk], attn[s:s + chunk], args.response_length,
                                         args.temperature)["logp"] for s in range(0, len(ids), chunk)])
        values = P.critic_values(critic, ids, attn, args.response_length) if critic is not None else torch.zeros_like(old)
    maskf = rm.float()
    adv = torch.randn(maskf.shape, generator=gen) * maskf
    return {"input_ids": ids, "attention_mask": attn, "response_mask": maskf, "old_logp": old,
            "ref_logp": old - 0.1 * torch.rand(old.shape, generator=gen), "advantages": adv,
            "returns": torch.randn(maskf.shape, generator=gen) * maskf, "values": values * maskf}


@pytest.fixture(scope="module")
def acc_setup(tiny):
    tok, m = tiny
    critic = P.make_critic(m)
    torch.nn.init.normal_([x for x in critic.modules() if isinstance(x, torch.nn.Linear)][-1].weight, std=0.1)
    base = P.Args(rollout_batch_size=4, n=2, ppo_mini_batch_size=4, use_kl_loss=True, entropy_coeff=0.01,
                  micro_batch_size=8, cuda=False)
    return m, critic, base, make_update_batch(tok, m, base, critic)


@pytest.mark.parametrize("mode", P.LOSS_AGG_MODES)
def test_micro_batch_accumulation_same_gradients(acc_setup, mode):
    m, critic, base, batch = acc_setup
    base = P.Args(**{**vars(base), "loss_agg_mode": mode})
    grads = []
    for micro in (8, 2):
        args = P.Args(**{**vars(base), "micro_batch_size": micro})
        m.zero_grad(), critic.zero_grad()
        P.minibatch_backward(m, critic, None, batch, args)
        grads.append([p.grad.clone() for p in list(m.parameters()) + list(critic.parameters())])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    m.zero_grad()


def test_full_kl_loss_recomputes_the_reference_per_micro_batch(acc_setup):
    import copy

    m, critic, base, batch = acc_setup
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    R = batch["response_mask"].shape[1]
    with torch.no_grad():  # the exact KL over the vocabulary from the full logits, token-mean over response tokens
        logp_all, ref_all = (full_log_softmax(x, batch["input_ids"], batch["attention_mask"], R, base.temperature)
                             for x in (m, ref))
        per_token = (logp_all.exp() * (logp_all - ref_all)).sum(-1)
        want = (per_token * batch["response_mask"]).sum() / batch["response_mask"].sum()
    grads = []
    for micro in (8, 2):
        args = P.Args(**{**vars(base), "micro_batch_size": micro, "kl_loss_type": "full"})
        m.zero_grad(), critic.zero_grad()
        stats = P.minibatch_backward(m, critic, None, batch, args, ref=ref)
        assert float(stats["kl_loss"]) == pytest.approx(float(want), rel=1e-5) and float(want) > 1e-4
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    m.zero_grad(), critic.zero_grad()
    with pytest.raises(ValueError, match="reference"):
        P.minibatch_backward(m, critic, None, batch, P.Args(**{**vars(base), "kl_loss_type": "full"}))


def test_first_minibatch_ratio_is_exactly_one(tiny_copy):
    tok, m = tiny_copy
    args = P.Args(rollout_batch_size=8, n=2, ppo_mini_batch_size=2, micro_batch_size=2, critic="none",
                  adv_estimator="grpo", ppo_epochs=2, cuda=False)
    batch = make_update_batch(tok, m, args)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mean, first = P.ppo_update(m, None, None, [opt], [sch], batch, args, torch.Generator().manual_seed(0))
    assert first["approx_kl"] == 0.0 and first["old_approx_kl"] == 0.0 and first["clipfrac"] == 0.0
    assert mean["approx_kl"] > 0  # later minibatches see an updated policy


def test_first_minibatch_ratio_with_another_logprob_forward_size_is_one_up_to_rounding(tiny_copy):
    """--logprob-forward-micro-batch-size other than --micro-batch-size: other matmul shapes, so the old log-probs
    may differ from the update's in the last bits; the first ratio is then 1 to within float rounding."""
    tok, m = tiny_copy
    args = P.Args(rollout_batch_size=8, n=2, ppo_mini_batch_size=2, micro_batch_size=2, critic="none",
                  adv_estimator="grpo", ppo_epochs=1, cuda=False)
    batch = make_update_batch(tok, m, args, forward_chunk=16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    _, first = P.ppo_update(m, None, None, [opt], [sch], batch, args, torch.Generator().manual_seed(0))
    assert abs(first["approx_kl"]) < 1e-10 and first["clipfrac"] == 0.0


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_critic_warmup_leaves_the_actor_and_its_lr_warmup_alone(tiny_copy, critic):
    tok, m = tiny_copy
    args = P.Args(rollout_batch_size=4, n=2, ppo_mini_batch_size=2, micro_batch_size=4, critic=critic,
                  cuda=False)
    model = P.make_critic(m) if critic == "separate" else torch.nn.Linear(m.config.hidden_size, 1)
    batch = make_update_batch(tok, m, args)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)]
    schs = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 10)) for o in opts]
    before = [p.clone() for p in m.parameters()]
    critic_before = [p.clone() for p in model.parameters()]
    mean, _ = P.ppo_update(m, model if critic == "separate" else None, model if critic == "shared" else None,
                           opts, schs, batch, args, torch.Generator().manual_seed(0), update_actor=False)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # the policy (a shared trunk too)
    assert schs[0].last_epoch == 0 and schs[1].last_epoch == 2  # two minibatches
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, model.parameters()))
    assert "critic_grad_norm" in mean and "grad_norm" not in mean and "policy_loss" not in mean


def test_decode_stops_at_eos_with_a_printable_id_0():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"!": 0, "1": 1, "2": 2, "<eos>": 3, "<pad>": 4}  # id 0 is an ordinary character, as in GPT-2 or Qwen
    tk = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    resp = torch.tensor([[1, 2, 3, 4, 4], [2, 3, 1, 1, 1], [1, 1, 1, 1, 1], [1, 4, 2, 3, 4]])
    texts = [t.replace(" ", "") for t in P.decode_responses(tok, resp)]
    assert texts == ["12", "2", "11111", "1<pad>2"]  # a special token inside a response is no empty string
    assert [P.rule_reward(t, "12") for t in texts] == [1.0, 0.0, 0.0, 0.0]


def test_responses_also_end_at_the_end_of_turn_of_the_generation_config(tiny_copy, tmp_path, capsys):
    """A chat model's turn ends with a token of its generation config that is not the tokenizer's EOS (Qwen2.5's
    <|im_end|> beside <|endoftext|>): generation, the response mask, the text scored and the EOS flag stop there."""
    tok, m = tiny_copy
    ids, mask = P.left_pad([tok.encode("321=", add_special_tokens=False)], tok.pad_token_id, 6)
    first = int(P.generate(m, ids, mask, 3, tok.eos_token_id, tok.pad_token_id, greedy=True)[0, 0])
    assert first != tok.eos_token_id
    assert P.stop_token_ids(tok, m) == [tok.eos_token_id]
    m.generation_config.eos_token_id = [tok.eos_token_id, first]
    stops = P.stop_token_ids(tok, m)
    assert stops == [tok.eos_token_id, first]
    resp = P.generate(m, ids, mask, 3, stops, tok.pad_token_id, greedy=True)
    assert resp.tolist() == [[first]]  # stopped after the end-of-turn token (cut to the longest response)
    assert P.response_mask_from(resp, stops).tolist() == [[1]]
    assert P.decode_responses(tok, resp, stops) == [""] and P.is_stop(resp, stops).any(-1).tolist() == [True]
    assert P.response_mask_from(torch.tensor([[5, 7, 1, 1]]), [1, 7]).tolist() == [[1, 1, 0, 0]]
    # through main: the model's generation config is read and the extra stop token named
    m.save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    P.main(P.parse_args([*TINY, "--num-iterations", "1", "--sft-steps", "0", "--model-name-or-path",
                         str(tmp_path / "lm"), "--runs-dir", str(tmp_path / "r")]))
    assert f"and at {tok.convert_ids_to_tokens([first])}" in capsys.readouterr().out


def test_learned_positions_shorter_than_prompt_plus_response_is_one_line_error(capsys):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=40))
    P.check_positions(gpt2, 16, "gpt2")  # fits
    assert "more than the 16 learned positions of gpt2" in one_line_exit(capsys, 2, P.check_positions, gpt2, 24, "gpt2")
    with pytest.raises(IndexError):  # what the check saves the user from
        gpt2(torch.zeros(1, 24, dtype=torch.long))
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
    P.check_positions(llama, 24, "llama")  # rotary: runs on, with a note
    assert "more than llama's max_position_embeddings (16)" in capsys.readouterr().out


def test_disable_dropout_also_zeroes_attention_dropout():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, attention_dropout=0.5))
    x = torch.randint(0, 16, (2, 6))
    with torch.no_grad():
        ref = m.eval()(x).logits
        P.disable_dropout(m).train()
        assert torch.equal(m(x).logits, ref) and m.config.attention_dropout == 0.0


def test_kl_loss_turns_in_reward_kl_off_unless_asked():
    assert P.parse_args([]).use_kl_in_reward
    assert not P.parse_args(["--use-kl-loss"]).use_kl_in_reward
    assert P.parse_args(["--use-kl-loss", "--use-kl-in-reward"]).use_kl_in_reward
    assert not P.parse_args(["--no-use-kl-in-reward"]).use_kl_in_reward


# Every option name of the three framework docs (shared/seeds/) is a flag here, for the field it names
DOC_OPTION_NAMES = {
    # verl (the key's last part; kl_ctrl.* as written)
    "train_batch_size": "rollout_batch_size", "data.train_batch_size": "rollout_batch_size",
    "ppo_mini_batch_size": "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu": "micro_batch_size",
    "use_kl_loss": "use_kl_loss", "clip_ratio": "clip_ratio", "ppo_epochs": "ppo_epochs",
    "kl_loss_coef": "kl_loss_coef", "kl_loss_type": "kl_loss_type", "lam": "lam", "gamma": "gamma",
    "adv_estimator": "adv_estimator", "use_kl_in_reward": "use_kl_in_reward", "kl_penalty": "kl_penalty",
    "kl_ctrl.kl_coef": "init_kl_coef", "kl_ctrl.type": "kl_ctrl_type", "kl_ctrl.horizon": "kl_horizon",
    "kl_ctrl.target_kl": "target_kl", "cliprange_value": "value_clip", "grad_clip": "max_grad_norm",
    "enable_gradient_checkpointing": "gradient_checkpointing", "max_prompt_length": "prompt_length",
    "max_response_length": "response_length", "log_prob_micro_batch_size_per_gpu": "logprob_forward_micro_batch_size",
    "val_files": "eval_dataset", "data.val_files": "eval_dataset", "train_files": "dataset",
    # ROLL
    "rollout_batch_size": "rollout_batch_size", "prompt_length": "prompt_length",
    "response_length": "response_length", "num_return_sequences_in_group": "n", "loss_agg_mode": "loss_agg_mode",
    "whiten_advantages": "whiten_advantages", "advantage_clip": "advantage_clip", "reward_clip": "reward_clip",
    "dual_clip_loss": "dual_clip_loss", "lambd": "lam", "pg_clip": "clip_ratio", "value_clip": "value_clip",
    "target_kl": "target_kl", "init_kl_coef": "init_kl_coef", "kl_horizon": "kl_horizon",
    "add_token_level_kl": "use_kl_in_reward", "reward_norm": "reward_norm", "reward_shift": "reward_shift",
    "reward_scale": "reward_scale",
    # RLinf
    "normalize_advantages": "whiten_advantages", "group_size": "n", "adv_type": "adv_estimator",
    "loss_type": "loss_type", "loss_agg_func": "loss_agg_mode", "rollout_micro_batch_size": "rollout_micro_batch_size",
    "logprob_forward_micro_batch_size": "logprob_forward_micro_batch_size", "entropy_bonus": "entropy_coeff",
    "clip_ratio_high": "clip_ratio_high", "clip_ratio_low": "clip_ratio_low", "clip_ratio_c": "clip_ratio_c",
    "gae_lambda": "lam", "huber_delta": "huber_delta", "use_critic_model": "use_critic_model",
    "critic.use_critic_model": "use_critic_model",
}


@pytest.mark.parametrize("name,field", sorted(DOC_OPTION_NAMES.items()))
def test_framework_option_names_are_flags(name, field):
    assert P.given_fields(["--" + name.replace("_", "-")]) == {field}


def readme_option_rows():
    """(framework names, flag fields) of each row of docs/ppo_llm.md option mapping table."""
    text = open(os.path.join(os.path.dirname(SCRIPT), "docs", "ppo_llm.md")).read()
    table = text.split("### Option mapping")[1].split("\n\n| verl |")[1].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        names = []
        for cell in cells[:3]:
            for name in re.findall(r"`([a-z_.]+)`", cell):
                if name in ("critic.optim.lr", "model.path", "reward_model.model.path", "custom_reward_function.path",
                            "custom_reward_function.name", "rollout.val_kwargs.n",
                            "rollout.val_kwargs.temperature", "critic.loss_agg_mode"):  # the documented exceptions
                    continue
                keep_prefix = name.startswith(("kl_ctrl.", "algorithm.kl_ctrl.", "data.train_batch_size"))
                names.append(name.removeprefix("algorithm.") if keep_prefix else name.split(".")[-1])
        fields = set().union(*(P.given_fields([f]) for f in re.findall(r"--[a-z][a-z.-]*", cells[3])))
        rows.append((line[:40], names, fields))
    return rows


def test_readme_option_table_names_are_flags_of_their_row():
    rows = readme_option_rows()
    assert len(rows) > 40
    for row, names, fields in rows:
        assert fields, row
        for name in names:
            spelled = P.given_fields(["--" + name.replace("_", "-")])
            assert spelled and spelled <= fields, (row, name, spelled, fields)


@pytest.mark.parametrize("argv,expected", [
    (["--data.train-batch-size", "16"], {"rollout_batch_size": 16}),
    (["--num-return-sequences-in-group", "2"], {"n": 2}),
    (["--adv-type", "rloo", "--critic", "none"], {"adv_estimator": "rloo"}),
    (["--lambd", "0.9"], {"lam": 0.9}), (["--gae-lambda", "0.8"], {"lam": 0.8}),
    (["--no-normalize-advantages"], {"whiten_advantages": False}),
    (["--loss-agg-func", "seq-mean-token-sum"], {"loss_agg_mode": "seq-mean-token-sum"}),
    (["--entropy-bonus", "0.01"], {"entropy_coeff": 0.01}),
    (["--kl-ctrl.kl-coef", "0.2"], {"init_kl_coef": 0.2}),
    (["--kl-ctrl.type", "adaptive", "--kl-ctrl.horizon", "500"], {"kl_ctrl_type": "adaptive", "kl_horizon": 500}),
    (["--cliprange-value", "0.2"], {"value_clip": 0.2}),
    (["--ppo-micro-batch-size-per-gpu", "8"], {"micro_batch_size": 8}),
    (["--grad-clip", "0.5"], {"max_grad_norm": 0.5}),
    (["--enable-gradient-checkpointing"], {"gradient_checkpointing": True}),
    (["--rollout-micro-batch-size", "1e1"], {"rollout_micro_batch_size": 10}),
    # flags that set others unless those are given too
    (["--pg-clip", "0.3"], {"clip_ratio_low": 0.3, "clip_ratio_high": 0.3}),
    (["--clip-ratio", "0.3", "--clip-ratio-high", "0.28"], {"clip_ratio_low": 0.3, "clip_ratio_high": 0.28}),
    (["--kl-ctrl.target-kl", "0.05"], {"kl_ctrl_type": "adaptive", "target_kl": 0.05}),
    (["--target-kl", "None"], {"kl_ctrl_type": "fixed", "target_kl": 0.1}),  # ROLL's ~: not set
    (["--kl-ctrl-type", "adaptive"], {"kl_ctrl_type": "adaptive", "target_kl": 0.1}),
    (["--target-kl", "0.05", "--kl-ctrl-type", "fixed"], {"kl_ctrl_type": "fixed"}),
    (["--use-kl-loss", "--add-token-level-kl"], {"use_kl_in_reward": True}),
    (["--use-kl-loss"], {"use_kl_in_reward": False}),
    (["--use_kl_loss"], {"use_kl_in_reward": False}),  # tyro also takes underscores
    (["--use_kl_loss", "--add_token_level_kl"], {"use_kl_in_reward": True}),
    (["--use-critic-model", "False"], {"critic": "shared"}), (["--use-critic-model", "True"], {"critic": "separate"}),
    (["--loss-type", "actor_critic"], {"critic": "shared"}),
    (["--loss-type", "actor", "--use-critic-model", "True", "--critic", "separate"], {"critic": "separate"}),
    (["--critic.use-critic-model", "False"], {"critic": "shared"}),
    (["--reward-norm", "null"], {"reward_norm": "none"}),  # ROLL's spelling
    # RLinf's / ROLL's PPO setting of one response per prompt: micro-batches no larger than a minibatch (8)
    (["--group-size", "1"], {"n": 1, "micro_batch_size": 8}),
    (["--n", "3"], {"micro_batch_size": 12}),  # 24 responses a minibatch: the largest divisor up to 16
    (["--target-kl", "None", "--kl-ctrl-type", "adaptive"], {"kl_ctrl_type": "adaptive", "target_kl": 0.1}),
    (["--num-return-sequences-in-group", "1", "--micro-batch-size", "4"], {"micro_batch_size": 4}),
    # grpo / rloo advantages are verl's unless whitening is asked for (ROLL)
    (["--adv-estimator", "grpo", "--critic", "none"], {"whiten_advantages": False}),
    (["--adv-estimator", "rloo", "--critic", "none", "--normalize-advantages"], {"whiten_advantages": True}),
    (["--adv-estimator", "reinforce_plus_plus_baseline", "--critic", "none"], {"whiten_advantages": True}),
    ([], {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "kl_ctrl_type": "fixed", "critic": "separate",
          "whiten_advantages": True}),
])
def test_framework_spellings_set_the_fields(argv, expected):
    args = P.parse_args(argv)
    assert {k: getattr(args, k) for k in expected} == expected


def test_a_note_says_what_an_implied_option_changed(capsys):  # (rank 0 alone: test_bad_input_under_torchrun_...)
    assert P.parse_args(["--group-size", "1"]).micro_batch_size == 8
    assert "note: --micro-batch-size 8" in capsys.readouterr().out


def test_a_resumed_grpo_run_keeps_its_whitening():
    # saved with --whiten-advantages
    args = P.Args(adv_estimator="grpo", critic="none", resume="run/checkpoint.pt", cuda=False)
    P.resolve_implied(args, set())
    assert args.whiten_advantages


def test_whitening_would_make_rloo_the_same_as_reinforce_plus_plus_baseline():
    """Why grpo/rloo are not whitened by default: rloo's advantage is n/(n-1) (s - mean_g), a scaled
    reinforce_plus_plus_baseline, and whitening removes the scale."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    lengths = torch.tensor([3, 2, 1, 3, 2, 1, 3, 3])
    mask = (torch.arange(3) < lengths[:, None]).float()
    tr = torch.zeros_like(mask)
    tr[torch.arange(8), lengths - 1] = scores  # the score on the last response token
    groups = torch.arange(8) // 4
    rloo, _ = P.compute_advantages("rloo", tr, mask, groups, whiten=False)
    white, _ = P.compute_advantages("rloo", tr, mask, groups, whiten=True)
    base, _ = P.compute_advantages("reinforce_plus_plus_baseline", tr, mask, groups)
    assert torch.allclose(white, base, atol=1e-5) and not torch.allclose(rloo, base, atol=1e-2)


def test_what_ppo_computes_lies_above_the_banner():
    """The banner says that nothing below it changes what PPO computes: the KL reference (with LoRA, the policy with
    its adapters off), the task's data and the --reward-fn functions are above it, main() stays short, and generation
    comes early in the file."""
    import ast

    source = open(SCRIPT).read()
    banner = next(i for i, line in enumerate(source.splitlines(), 1)
                  if line.startswith("# Plumbing: nothing below this line changes what PPO computes"))
    defs = {n.name: n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in ("reference_policy", "AdaptersOff", "with_lora", "lora_targets", "build_critic", "load_dataset",
                 "load_reward_fn", "main"):
        assert defs[name].lineno < banner, name
    for name in ("save_checkpoint", "parse_args", "check_models"):
        assert defs[name].lineno > banner, name
    assert defs["main"].end_lineno - defs["main"].lineno + 1 <= 170 and defs["generate"].lineno < 600


# ----- bad input: one line, exit 2 ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--adv-estimator", "grpo", "--n", "1"], "n >= 2"),
    (["--adv-estimator", "rloo", "--n", "1", "--critic", "none"], "n >= 2"),
    (["--critic", "none"], "needs a critic"),
    (["--rollout-batch-size", "10", "--ppo-mini-batch-size", "4"], "not divisible"),
    (["--micro-batch-size", "5"], "not divisible"),
    (["--model-name-or-path", "/nonexistent/model"], "no config.json"),
    (["--reward-model-path", "/nonexistent/rm"], "no config.json"),
    (["--dataset", "/nonexistent.jsonl"], "no such file"),
    (["--eval-dataset", "/nonexistent.jsonl"], "--eval-dataset /nonexistent.jsonl: no such file"),
    (["--resume", "/nonexistent/checkpoint.pt"], "no such file"),
    (["--tiny-hidden-size", "12"], "multiple of 8"),
    (["--adv-estimator", "reinforce_plus_plus_baseline", "--critic", "none", "--n", "1"], "n >= 2"),
    (["--reward-norm", "group", "--n", "1"], "n >= 2"),
    (["--reward-norm", "batch", "--rollout-batch-size", "1", "--ppo-mini-batch-size", "1", "--n", "1"],
     "at least 2 responses"),
    (["--reward-norm", "running", "--rollout-batch-size", "1", "--ppo-mini-batch-size", "1", "--n", "1"],
     "at least 2 responses"),  # (a std with n - 1 of a first batch of one score)
    (["--kl-ctrl-type", "adaptive", "--target-kl", "0"], "target-kl > 0"),
    (["--tiny-num-layers", "0"], "must be positive"),
    (["--loss-type", "actor_critic", "--critic", "separate"], "contradictory critic choice"),
    (["--use-critic-model", "True", "--loss-type", "actor_critic"], "contradictory critic choice"),
    (["--logprob-forward-micro-batch-size", "0"], "must be positive"),
    (["--pg-clip", "-0.1"], "must be >= 0"),
    (["--eval-prompts", "-1"], "must be >= 0"),
    (["--eval-prompts", "20000"], "at most 10000"),
    (["--seed", "-1"], "[0, 2**31)"),
    (["--lr", "nan"], "finite"),
    (["--sft-lr", "-1"], "--sft-lr must be positive, got -1.0"),
    (["--critic-lr", "0"], "--critic-lr must be positive, got 0.0"),
    (["--weight-decay", "-0.1"], "must be >= 0"),
    (["--reward-clip", "-1"], "must be positive"),
    (["--advantage-clip", "-2"], "must be positive"),
    (["--value-clip", "-0.5"], "must be positive"),
    (["--huber-delta", "-1"], "must be positive"),
    (["--top-k", "-3"], "must be >= 0"),
    (["--stop-after", "-1"], "must be >= 0"),
    (["--critic-warmup", "2", "--adv-estimator", "grpo", "--critic", "none"], "needs --adv-estimator gae"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    err = one_line_exit(capsys, 2, P.parse_args, argv)
    assert needle in err, err


def test_unwritable_runs_dir_is_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = one_line_exit(capsys, 1, P.main, P.parse_args([*TINY, "--runs-dir", str(blocker / "runs")]))
    assert err.startswith("error: cannot create the run directory"), err


def test_tiny_model_size_flags(tmp_path):
    tok = P.build_char_tokenizer()
    small = P.build_tiny_model(tok, 0, 32, 1)
    assert (small.config.hidden_size, small.config.intermediate_size, small.config.num_hidden_layers) == (32, 64, 1)
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--tiny-hidden-size", "32", "--tiny-num-layers",
                               "1", "--save-model"]))
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(os.path.join(res["run_dir"], "checkpoint-2", "policy"))
    assert sum(p.numel() for p in saved.parameters()) == sum(p.numel() for p in small.parameters())


def test_default_model_has_the_2_0m_parameters_the_docs_say():
    a, tok = P.Args(), P.build_char_tokenizer()
    count = sum(p.numel() for p in P.build_tiny_model(tok, 0, a.tiny_hidden_size, a.tiny_num_layers).parameters())
    h, layers = 256, 3  # the docs' model: a Llama of 3 layers, hidden 256, MLP 2 * 256, tied embeddings
    per_layer = 4 * h * h + 3 * h * (2 * h) + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    assert count == len(tok) * h + layers * per_layer + h == 1_993_216  # embeddings (= the output layer), final norm
    for text in (P.__doc__, open(os.path.join(os.path.dirname(SCRIPT), "docs", "ppo_llm.md")).read()):
        assert f"{count / 1e6:.1f}M parameters" in re.sub(r"\s+", " ", text)


def field_help(name: str) -> str:
    """The help text of an Args field, as --help shows it: the comment after the field or the docstring under it."""
    source = open(SCRIPT).read()
    found = re.search(rf"^    {name}: [^\n]*?  # ([^\n]*)$|^    {name}: [^\n]*\n    \"\"\"(.*?)\"\"\"", source, re.M | re.S)
    return " ".join((found.group(1) or found.group(2)).split())


def test_help_texts_say_what_the_options_do():
    assert "response == answer" not in field_help("reward_model_path") and "--reward-fn" in field_help(
        "reward_model_path")  # (the rule reward is --reward-fn's: exact, math or a function)
    assert "unless the run is resumed" in field_help("eval_every")  # (a resumed run is not evaluated before)
    assert "A warm start (--sft-steps) trains every parameter" in field_help("lora_rank")


def test_the_gsm8k_commands_of_the_docs_would_run(tmp_path, monkeypatch):
    """The GSM8K + LoRA commands of ppo_llm.py's docstring and docs/ppo_llm.md, through parse_args (its implied
    options and validation, which stop before anything is loaded): prompts that fit GSM8K in a chat template (the
    default 16 tokens drops every one: exit 2), room for a worked answer, verl's answer column, and no warm start (on
    verl's ground truths it would teach bare numbers, and with LoRA it trains every parameter)."""
    import shlex

    docs = open(os.path.join(os.path.dirname(SCRIPT), "docs", "ppo_llm.md")).read()
    commands = [line.split("python ppo_llm.py", 1)[1] for text in (P.__doc__, docs)
                for line in re.sub(r"\\\n\s*", " ", text).splitlines()
                if "python ppo_llm.py" in line and "--reward-fn math" in line]
    assert len(commands) == 3, commands  # the docstring's, the doc's first block and its real-task command
    monkeypatch.setenv("HOME", str(tmp_path))  # (the shell's ~)
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = [os.path.expanduser(a) for a in shlex.split(command.split(" #")[0])]
        for flag, path in zip(argv, argv[1:]):  # the model directory and the data files the command names, empty
            if flag == "--model-name-or-path":
                os.makedirs(path, exist_ok=True)
                open(os.path.join(path, "config.json"), "w").write("{}")
            elif flag in ("--dataset", "--train-files", "--val-files", "--eval-dataset"):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                open(path, "w").close()
        args = P.parse_args(argv)
        assert args.answer_key == "reward_model.ground_truth" and args.prompt_length >= 256, command
        assert args.response_length >= 256 and args.sft_steps == 0 and args.lora_rank > 0, command


def test_counts_parse():
    assert P.parse_args(["--num-iterations", "1e2", "--rollout-batch-size", "1_6"]).num_iterations == 100


@pytest.mark.parametrize("argv,needle", [(["--n", "1.5"], "--n"), (["--no-such-flag"], "--no-such-flag"),
                                         (["--use-kl-loss", "True"], "True"), (["--kl-loss-type", "k5"], "low_var_kl"),
                                         (["--kl-penalty", "k5"], "k3+"), (["--loss-agg-mode", "sum"], "seq-mean"),
                                         (["--adv-estimator", "vtrace"], "reinforce_plus_plus_baseline")])
def test_flags_tyro_cannot_parse_are_its_message_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:  # (tyro's own message, as the RL scripts leave it)
        P.parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


# ----- runs ---------------------------------------------------------------------------------------------------
def test_smoke_two_iterations_subprocess(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, *TINY, "--runs-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "iter 2/2" in out.stdout and "eval iter 2" in out.stdout
    assert re.search(r"iter 1/2 .*  eta=(\d+h\d\dm|\d+m\d\ds|\d+s)\n", out.stdout)  # the time left
    assert re.search(r"iter 2/2 .*  eta=0s\n", out.stdout)
    assert any(f.startswith("events.out.tfevents") for d in os.listdir(tmp_path)
               for f in os.listdir(tmp_path / d))


def kl_coef_adapted(m, updates):  # adaptive controller: the coefficient has left its initial value
    return m["kl/kl_coef"] != P.Args().init_kl_coef


def warmup_then_actor(m, updates):  # --critic-warmup 1: the actor is updated from iteration 2 on
    return [u["update_actor"] for u in updates] == [False, True]


def advantages_clipped(m, updates):  # --advantage-clip 0.5: whitened advantages reach it; no critic: no EV
    reached = max(u["max_abs_adv"] for u in updates) == pytest.approx(0.5)
    return reached and math.isnan(m["losses/explained_variance"])


def shared_value_head(m, updates):  # --use-critic-model False = --critic shared: a value head is trained, no critic
    return all(u["value_head"] and not u["critic"] for u in updates) and math.isfinite(m["losses/value_loss"])


@pytest.mark.parametrize("extra,effect", [
    (["--critic", "shared", "--use-kl-loss", "--use-kl-in-reward", "--kl-loss-type", "full", "--kl-penalty", "full",
      "--kl-ctrl-type", "adaptive", "--reward-norm", "group", "--gradient-checkpointing", "--critic-warmup", "1",
      "--huber-delta", "1.0", "--top-k", "5", "--top-p", "0.9", "--temperature", "0.8"],
     [kl_coef_adapted, warmup_then_actor]),
    (["--adv-estimator", "reinforce_plus_plus", "--critic", "none", "--loss-agg-mode", "seq-mean-token-sum-norm",
      "--reward-norm", "running", "--reward-clip", "1.0", "--missing-eos-penalty", "1.0", "--advantage-clip", "0.5"],
     [advantages_clipped]),
    (["--adv-type", "gae", "--use-critic-model", "False", "--loss-agg-func", "seq-mean-token-mean", "--gae-lambda",
      "0.95", "--pg-clip", "0.1", "--rollout-micro-batch-size", "2", "--logprob-forward-micro-batch-size", "4"],
     [shared_value_head]),
])
def test_option_combinations_run(tmp_path, monkeypatch, extra, effect):
    updates, update = [], P.ppo_update

    def spy(policy, critic, value_head, optimizers, schedulers, batch, args, gen, update_actor=True, *a, **k):
        updates.append({"update_actor": update_actor, "max_abs_adv": batch["advantages"].abs().max().item(),
                        "critic": critic is not None, "value_head": value_head is not None})
        return update(policy, critic, value_head, optimizers, schedulers, batch, args, gen, update_actor, *a, **k)

    monkeypatch.setattr(P, "ppo_update", spy)
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), *extra]))
    assert all(math.isfinite(v) for v in res["stats"].values())
    assert len(res["curve"]) == 2 and len(updates) == 2
    for check in effect:
        assert check(res["metrics"], updates), check.__name__


def test_a_resumed_run_goes_on_with_the_adapted_kl_coefficient(tmp_path):
    argv = [*TINY, "--use-kl-in-reward", "--kl-ctrl-type", "adaptive"]
    whole = P.main(P.parse_args([*argv, "--runs-dir", str(tmp_path / "whole")]))
    first = P.main(P.parse_args([*argv, "--runs-dir", str(tmp_path / "parts"), "--stop-after", "1"]))
    assert torch.load(first["checkpoint"], weights_only=False)["kl_coef"] != P.Args().init_kl_coef  # adapted once
    rest = P.main(P.parse_args(["--resume", first["checkpoint"], "--stop-after", "0"]))
    assert rest["metrics"]["kl/kl_coef"] == whole["metrics"]["kl/kl_coef"]


def test_bf16_precision_runs_under_autocast_on_the_cpu(tmp_path, monkeypatch):
    """--precision bf16 (the default with --cuda): generation, scoring and the update under bf16 autocast, fp32
    master weights; run here on the CPU, where the same code path can be tested without a GPU."""
    seen, original_forward, original_generate = [], P.model_forward, P.generate

    def forward(*a, **k):
        res = original_forward(*a, **k)
        seen.append((torch.is_autocast_enabled("cpu"), res["logp"].dtype))
        if "values" in res:  # the shared value head's output, computed in fp32 (a bf16 Linear would give bf16)
            seen.append((torch.is_autocast_enabled("cpu"), res["values"].dtype))
        return res

    generated = []  # whether autocast is on in each forward of the model during generation

    def generate(model, *a, **k):
        hook = model.register_forward_hook(lambda *_: generated.append(torch.is_autocast_enabled("cpu")))
        try:
            return original_generate(model, *a, **k)
        finally:
            hook.remove()

    monkeypatch.setattr(P, "model_forward", forward)
    monkeypatch.setattr(P, "generate", generate)
    args = [*TINY, "--sft-steps", "2", "--critic", "shared"]  # warm-start forwards too; the shared head in fp32
    res = P.main(P.parse_args([*args, "--runs-dir", str(tmp_path), "--precision", "bf16"]))
    assert all(math.isfinite(v) for v in res["stats"].values()) and len(res["curve"]) == 2
    assert seen and all(on and dtype == torch.float32 for on, dtype in seen)  # log-probs in fp32 all the same
    assert generated and all(generated)
    seen.clear(), generated.clear()
    P.main(P.parse_args([*args, "--runs-dir", str(tmp_path / "fp32")]))  # auto on the CPU: fp32
    assert seen and not any(on for on, _ in seen) and generated and not any(generated)


def test_local_model_dataset_reward_model_and_resume(tmp_path):
    from transformers import LlamaForSequenceClassification

    tok = P.build_char_tokenizer()
    model = P.build_tiny_model(tok, 3, *SMALL)
    model.save_pretrained(tmp_path / "lm")
    tok.pad_token = None  # a tokenizer without pad token: the script uses EOS and says so
    tok.save_pretrained(tmp_path / "lm")
    cfg = model.config
    cfg.num_labels = 1
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    with open(tmp_path / "data.jsonl", "w") as f:
        for row in P.make_problems(16, torch.Generator().manual_seed(0)):
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"prompt": "x" * 40, "answer": "1"}) + "\n")  # longer than --prompt-length: dropped
    common = [*TINY, "--model-name-or-path", str(tmp_path / "lm"), "--dataset", str(tmp_path / "data.jsonl"),
              "--reward-model-path", str(tmp_path / "rm"), "--adv-estimator", "rloo", "--critic", "none",
              "--save-model"]
    out = subprocess.run([sys.executable, SCRIPT, *common, "--runs-dir", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no pad token; using EOS" in out.stdout and "dropped 1 of 17" in out.stdout
    # stopped after one iteration and resumed == uninterrupted (in-process: same machine, same threads)
    full = P.main(P.parse_args([*common, "--runs-dir", str(tmp_path / "b")]))
    part = P.main(P.parse_args([*common, "--runs-dir", str(tmp_path / "c"), "--stop-after", "1"]))
    resumed = P.main(P.parse_args(["--resume", part["checkpoint"]]))
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(os.path.join(full["run_dir"], "checkpoint-2", "policy"))
    b = AutoModelForCausalLM.from_pretrained(os.path.join(resumed["run_dir"], "checkpoint-2", "policy"))
    for (n1, p1), (_, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p1, p2), n1


def test_resume_takes_the_learning_rates_given_now(tmp_path):
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1", "--lr-warmup-steps", "10"]))
    done = P.main(P.parse_args(["--resume", part["checkpoint"], "--lr", "1e-3", "--critic-lr", "5e-3",
                                "--weight-decay", "0.1"]))  # (no --save-model: a resumed run saves its end)
    state = torch.load(done["checkpoint"], weights_only=True)
    assert [s["last_epoch"] for s in state["scheduler"]] == [4, 4]  # 2 iterations x 2 minibatches
    for opt, sch, lr in zip(state["optimizer"], state["scheduler"], (1e-3, 5e-3)):
        assert sch["base_lrs"] == [lr]
        assert opt["param_groups"][0]["lr"] == pytest.approx(lr * 5 / 10)  # at the warm-up position, new base
        assert opt["param_groups"][0]["weight_decay"] == 0.1
    # resuming the finished run evaluates it, with the same held-out accuracy as its end, and writes nothing
    before = os.stat(done["checkpoint"]).st_mtime_ns
    again = P.main(P.parse_args(["--resume", done["checkpoint"]]))
    assert again["checkpoint"] is None and os.stat(done["checkpoint"]).st_mtime_ns == before
    assert again["curve"][-1] == done["curve"][-1] and done["curve"][-1][0] == 2


def test_the_last_iteration_is_saved_once(tmp_path, monkeypatch):
    saved, real = [], P.save_checkpoint

    def spy(*a, **k):
        saved.append(inspect.signature(real).bind(*a, **k).arguments["iteration"])
        return real(*a, **k)
    monkeypatch.setattr(P, "save_checkpoint", spy)
    P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--checkpoint-every", "2", "--save-model"]))
    assert saved == [2]


def test_rollout_micro_batches_generate_the_same_rollout(tmp_path, monkeypatch):
    # greedy generation (no random draws whose order chunking would change): generating the rollout and the
    # evaluation in chunks of 2 gives the same responses, hence the same run, as generating each batch at once
    sizes, real = [], P.generate

    def greedy(*a, **k):
        call = inspect.signature(real).bind(*a, **k)
        call.arguments["greedy"] = True
        sizes.append(call.arguments["prompt_ids"].shape[0])
        return real(*call.args, **call.kwargs)
    monkeypatch.setattr(P, "generate", greedy)
    runs = []
    for extra in ([], ["--rollout-micro-batch-size", "2"]):
        sizes.clear()
        runs.append(P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / str(len(runs))), *extra])))
        assert set(sizes) == ({8} if not extra else {2})  # 4 prompts x 2 responses; 8 evaluation prompts
    assert runs[0]["curve"] == runs[1]["curve"] and runs[0]["stats"] == runs[1]["stats"]


def test_eval_dataset_holds_prompts_out(tmp_path, monkeypatch, capsys):
    train = P.make_problems(16, torch.Generator().manual_seed(0))
    held = P.make_problems(12, torch.Generator().manual_seed(1))
    for name, rows in (("train.jsonl", train), ("held.jsonl", held)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen, real = [], P.evaluate

    def spy(policy, tok, rows, *a, **k):  # the rows main() evaluates on
        seen.append(rows)
        return real(policy, tok, rows, *a, **k)
    monkeypatch.setattr(P, "evaluate", spy)
    argv = [*TINY, "--num-iterations", "1", "--runs-dir", str(tmp_path), "--dataset", str(tmp_path / "train.jsonl")]
    P.main(P.parse_args([*argv, "--val-files", str(tmp_path / "held.jsonl")]))
    assert [r["prompt"] for r in seen[0]] == [r["prompt"] for r in held[:8]]  # --eval-prompts 8 of the file
    assert "training also samples" not in capsys.readouterr().out
    seen.clear()
    P.main(P.parse_args(argv))  # without it: the dataset's first rows, with a note saying they are not held out
    assert [r["prompt"] for r in seen[0]] == [r["prompt"] for r in train[:8]]
    assert "training also samples" in capsys.readouterr().out
    (tmp_path / "noanswer.jsonl").write_text(json.dumps({"prompt": "12="}) + "\n")
    assert "--eval-dataset" in one_line_exit(capsys, 2, P.main, P.parse_args([*argv, "--eval-dataset",
                                                                              str(tmp_path / "noanswer.jsonl")]))


def test_synthetic_held_out_prompts_are_distinct_and_never_trained_on(tmp_path, monkeypatch):
    rows = P.make_problems(2000, torch.Generator().manual_seed(0), distinct=True)
    assert len({r["prompt"] for r in rows}) == 2000  # 2000 plain draws of 100000 prompts repeat ~20 of them
    assert all(r["answer"] == "".join(sorted(r["prompt"][:5])) for r in rows)
    not_nine = {f"{i:05d}=" for i in range(90_000)}  # every prompt but those starting with 9
    assert {r["prompt"][0] for r in P.make_problems(300, torch.Generator().manual_seed(0), not_nine)} == {"9"}
    fits = P.make_problems(300, torch.Generator().manual_seed(0), fits=lambda p: p[0] != "9")  # (prompt length)
    assert len(fits) == 300 and "9" not in {r["prompt"][0] for r in fits}
    calls, real = [], P.make_problems

    def spy(count, gen, exclude=frozenset(), distinct=False, fits=None):
        calls.append((exclude, distinct, real(count, gen, exclude, distinct, fits)))
        return calls[-1][2]
    monkeypatch.setattr(P, "make_problems", spy)
    P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path)]))
    (_, distinct, held), (_, _, probe), *training = calls  # probe: 256 prompts for the length check
    assert distinct and len(held) == 8 and len(probe) == 256 and len(training) == 5 + 2  # warm-start, then PPO
    assert all(exclude == {r["prompt"] for r in held} for exclude, _, _ in training)


@pytest.mark.parametrize("argv,needle", [
    (["--prompt-length", "5"], "prompts take up to 6 tokens"),  # a synthetic prompt would be cut to "1415="
    (["--response-length", "5"], "answers up to 5"),  # 5 digits and EOS: 6 tokens
    (["--dataset", "{latin1}"], "cannot read it as json (UnicodeDecodeError"),
])
def test_bad_input_found_in_main_is_one_line_and_leaves_no_run_dir(tmp_path, capsys, argv, needle):
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    argv = [a.format(latin1=tmp_path / "latin1.jsonl") for a in argv]
    err = one_line_exit(capsys, 2, lambda a: P.main(P.parse_args(a)), [*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                                       *argv])
    assert needle in err and not (tmp_path / "runs").exists(), err


@pytest.mark.parametrize("argv,needle", [(["--prompt-length", "5"], "prompts take up to 6 tokens"),
                                         (["--response-length", "4"], "answers up to 5")])
def test_synthetic_length_check_sees_a_tokenizer_that_merges_some_digits(tmp_path, monkeypatch, capsys, argv, needle):
    """"01" and "23" are single tokens: "01234=" takes 4 tokens and "01234" 3, most prompts 6 and answers 5."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def merging_tokenizer():
        vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "01", "23"]
                                            + [chr(c) for c in range(32, 127)])}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("01|23|."), behavior="isolated")
        tk.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                       unk_token="<unk>")
    tok = merging_tokenizer()
    assert len(tok.encode("01234=")) == 4 and len(tok.encode("01234")) == 3 and len(tok.encode("98765=")) == 6
    monkeypatch.setattr(P, "build_char_tokenizer", merging_tokenizer)
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"), *argv]))
    assert needle in err, err


def test_empty_dataset_prompt_is_one_line_error(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "", "answer": "1"}) + "\n")
    assert "line 1: empty prompt" in one_line_exit(capsys, 2, P.main, P.parse_args(
        [*TINY, "--runs-dir", str(tmp_path), "--dataset", str(tmp_path / "d.jsonl")]))


# ----- reliability: same seed, SIGTERM, non-finite updates, atomic checkpoints ----------------------------------
def test_same_seed_same_run(tmp_path):
    a = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "a")]))
    b = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "b")]))
    c = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "c"), "--seed", "2"]))
    assert a["stats"] == b["stats"] and a["curve"] == b["curve"]
    assert a["stats"] != c["stats"]


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    import signal
    import time

    p = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--num-iterations", "1000", "--runs-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:  # the first progress line: the PPO loop is under way
        if line.startswith("iter 1/"):
            break
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert "(SIGTERM); continue with: python ppo_llm.py --resume" in out
    (run,) = os.listdir(tmp_path)
    state = torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)
    assert 1 <= state["iteration"] < 1000
    assert os.path.isfile(tmp_path / run / state["model"]["policy"] / "model.safetensors")


def test_non_finite_update_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    calls = []
    real = P.compute_advantages

    def poisoned(*a, **kw):  # the second iteration's advantages are NaN: its update makes NaN losses
        calls.append(1)
        adv, ret = real(*a, **kw)
        return (adv * float("nan"), ret) if len(calls) == 2 else (adv, ret)

    monkeypatch.setattr(P, "compute_advantages", poisoned)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    err = one_line_exit(capsys, 1, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--checkpoint-every", "1",
                                                         "--num-iterations", "3"]))
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored
    assert "non-finite" in err and "at iteration 2" in err and "policy_loss" in err
    (run,) = os.listdir(tmp_path)
    state = torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)
    assert state["iteration"] == 1
    assert f"stopping (last checkpoint kept: {tmp_path / run / 'checkpoint.pt'})" in err


def tiny_saver(tmp_path, *size):
    """A tiny policy (also the reference), its critic and their optimisers; save(it) writes their checkpoint."""
    tok = P.build_char_tokenizer()
    m = P.build_tiny_model(tok, 0, *size)
    critic = P.make_critic(m)
    opt = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in (m, critic)]  # (one per trained model)
    sch = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in opt]
    args = P.parse_args(TINY)

    def save(it):
        return P.save_checkpoint(str(tmp_path), m, m, critic, None, tok, opt, sch, args, it * 8, it,
                                 torch.Generator(), P.FixedKLController(0.1), P.RunningMoments(), {})
    return m, critic, save


def test_checkpoint_killed_during_save_keeps_the_previous_one(tmp_path, monkeypatch):
    """A save that dies halfway (here: while writing the critic) leaves the previous checkpoint whole."""
    m, critic, save = tiny_saver(tmp_path, *SMALL)
    path = save(1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for prm in m.parameters():
            prm.add_(1.0)

    def killed(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(critic, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        save(2)
    monkeypatch.undo()
    state = P.load_checkpoint(path)
    assert state["iteration"] == 1
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / state["model"]["policy"])
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, before[k]), k
    save(3)  # the next save cleans up the leftovers of the killed one
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == ["checkpoint-3"]


def test_foreign_corrupt_and_incomplete_checkpoints_are_rejected(tmp_path, capsys):
    torch.save({"script": "ppo.py"}, tmp_path / "foreign.pt")
    (tmp_path / "corrupt.pt").write_bytes(b"not a checkpoint")
    d = tmp_path / "run"
    d.mkdir()  # a ppo_llm.py checkpoint whose model directories are gone
    keys = ("optimizer", "scheduler", "global_step", "iteration", "rng", "args", "kl_coef", "reward_running", "tracker")
    torch.save({"script": "ppo_llm.py", "model": {"policy": "checkpoint-9/policy", "ref": "ref", "critic": ""},
                **dict.fromkeys(keys, {})}, d / "checkpoint.pt")
    (d / "checkpoint-3" / "policy").mkdir(parents=True)
    torch.save({"script": "ppo_llm.py", "model": {"policy": "checkpoint-3/policy", "ref": "", "critic": ""}},
               d / "partial.pt")  # (an entry main() reads is missing)
    for path, needle in [(tmp_path / "foreign.pt", "not a ppo_llm.py checkpoint"),
                         (d / "partial.pt", "does not fit this run: KeyError: 'args'"),
                         (tmp_path / "corrupt.pt", "cannot read checkpoint"),
                         (d / "checkpoint.pt", f"cannot load a tokenizer from {d / 'checkpoint-9' / 'policy'}")]:
        err = one_line_exit(capsys, 2, lambda a: P.main(P.parse_args(a)), ["--resume", str(path), "--no-cuda"])
        assert sorted(os.listdir(d)) == ["checkpoint-3", "checkpoint.pt", "partial.pt"] and needle in err, err


def test_eta_text():
    assert [P.eta_text(x) for x in (45.9, 200, 7500, 0, math.inf, -1)] == ["45s", "3m20s", "2h05m", "0s", "?", "?"]


# ----- faults found with foreign models (issue #25) ----------------------------------------------------------------
def one_line_exit(capsys, code, call, *a):
    """call(*a) raises Failure(message, code) of one line, which __main__ prints as "error: <message>" before it
    exits with code; returns that line."""
    with pytest.raises(P.Failure) as e:
        call(*a)
    err = f"error: {e.value}"
    assert e.value.code == code and "\n" not in err, err
    return err


def gpt2_reward_model(path, positions=64, vocab=200, num_labels=1):
    """A 1-layer GPT-2 sequence classifier (learned positions), saved without a tokenizer of its own."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=positions, vocab_size=vocab, num_labels=num_labels,
                     pad_token_id=0, bos_token_id=1, eos_token_id=1)
    GPT2ForSequenceClassification(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("positions,vocab,needle", [(16, 200, "more than the 16 learned positions of the reward model"),
                                                    (64, 40, "40 token embeddings, fewer than the 99 tokens of the "
                                                             "policy's tokenizer")])
def test_a_reward_model_too_short_or_with_a_smaller_vocabulary_is_one_line_error(tmp_path, capsys, positions, vocab,
                                                                                 needle):
    rm = gpt2_reward_model(tmp_path / "rm", positions, vocab)  # prompt + response: 16 + 8 = 24 tokens
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                         "--reward-model-path", str(rm)]))
    assert needle in err and not (tmp_path / "runs").exists()


def test_a_reward_model_that_does_not_load_says_why_and_writes_nothing(tmp_path, capsys):
    rm = gpt2_reward_model(tmp_path / "rm")
    (rm / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                         "--reward-model-path", str(rm)]))
    assert err.startswith(f"error: cannot load a reward model from {rm}: ") and not (tmp_path / "runs").exists()
    assert len(err.split(": ", 3)[-1]) > 8, err  # the reason, not only the exception's name


def test_a_causal_lm_or_a_two_label_model_is_refused_as_reward_model(tmp_path, capsys):
    P.build_tiny_model(P.build_char_tokenizer(), 0, 32, 1).save_pretrained(tmp_path / "lm")
    gpt2_reward_model(tmp_path / "two", num_labels=2)
    for path, needle in ((tmp_path / "lm", "score head (score.weight) is not in its weights: a causal LM"),
                         (tmp_path / "two", "2 labels; a reward model gives one score")):
        err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                             "--reward-model-path", str(path)]))
        assert needle in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("head", ["linear", "mlp"])
def test_a_reward_model_scores_the_last_real_token_whatever_its_config_calls_padding(tmp_path, head):
    """The reward model's config names "1" its pad token, its tokenizer pads with <pad>: Hugging Face's own pooling
    reads padding, so that a row's score depends on the rows beside it. Scored here batched == each row alone == the
    score head on the last real token's hidden state (the plain reference), whether the head is a Linear or not."""
    from transformers import LlamaForSequenceClassification

    tok = P.build_char_tokenizer()
    cfg = P.build_tiny_model(tok, 0, 32, 1).config
    cfg.num_labels, cfg.pad_token_id = 1, tok.convert_tokens_to_ids("1")
    torch.manual_seed(1)
    rm = LlamaForSequenceClassification(cfg).eval()
    if head == "mlp":  # (a head of another shape, as a custom reward model may have)
        rm.score = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    prompts, responses = ["31415=", "7=", "20="], ["11345", "7", "02<eos>"]
    batched = P.reward_model_scores(rm, tok, prompts, responses)
    alone = torch.cat([P.reward_model_scores(rm, tok, [p], [r]) for p, r in zip(prompts, responses)])
    with torch.no_grad():
        ref = [rm.score(rm.model(torch.tensor([tok.encode(p + r)])).last_hidden_state[0, -1]).item()
               for p, r in zip(prompts, responses)]
    assert torch.allclose(batched, alone, atol=1e-5) and torch.allclose(batched, torch.tensor(ref), atol=1e-5)
    enc = P.reward_model_inputs(tok, prompts, responses)
    with torch.no_grad():  # what the check guards against: Hugging Face's pooling of the same batch
        hf = rm(**enc).logits[:, 0]
    assert (hf - batched).abs().max() > 1e-3


def test_a_reward_model_with_weights_missing_from_its_files_says_which(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    rm = gpt2_reward_model(tmp_path / "rm")
    weights = load_file(rm / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]  # (a trunk weight, not the score head)
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                         "--reward-model-path", str(rm)]))
    assert "weights not in its files: transformer.h.0.mlp.c_fc.weight (1 in all; Hugging Face would make them up at " \
           "random)" in err and "score head" not in err, err


def test_explained_variance_against_a_plain_reference_and_with_returns_that_do_not_vary():
    g, mask, lengths = hand_batch(7)
    values, returns = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    r = [returns[i, t].item() for i, L in enumerate(lengths) for t in range(L)]
    e = [returns[i, t].item() - values[i, t].item() for i, L in enumerate(lengths) for t in range(L)]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert P.explained_variance(values, returns, mask) == pytest.approx(1 - var(e) / var(r), rel=1e-5)
    # every reward 0: the returns of GAE (gamma = lam = 1) are the values' float rounding, ~1e-8, not a signal
    _, noise = P.compute_gae(torch.zeros_like(mask), values * 1000, mask, 1.0, 1.0)
    assert 0 < var([noise[i, t].item() for i, L in enumerate(lengths) for t in range(L)]) < 1e-6
    assert math.isnan(P.explained_variance(values * 1000, noise, mask))
    assert math.isnan(P.explained_variance(values, torch.zeros_like(values), mask))  # exactly 0: the same answer


def write_rows(path, rows, encoding="utf-8"):
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode(encoding))
    return path


def test_a_reward_model_with_prompts_without_answers_logs_no_accuracy(tmp_path, monkeypatch, capsys):
    rm = gpt2_reward_model(tmp_path / "rm")
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": r["prompt"]} for r in P.make_problems(8, torch.Generator())])
    logged = {}
    monkeypatch.setattr(P, "log_scalars", lambda writer, scalars, step: logged.update(scalars))
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--dataset", str(data), "--reward-model-path",
                               str(rm)]))
    out = capsys.readouterr().out
    assert "rollout/reward_mean" in logged and "rollout/accuracy" not in logged and "rollout/accuracy" not in res[
        "metrics"]
    assert "iter 2/2" in out and " acc=" not in out and res["curve"] == [] and "eval iter" not in out
    assert "note: no evaluation: no row of --dataset has an 'answer'" in out and "training also samples" not in out


def test_an_answer_key_that_reaches_no_row_is_one_line_error_with_a_reward_model(tmp_path, capsys):
    """With a reward model nothing else would say it: the rule part of the score is 0 for every row."""
    rm = gpt2_reward_model(tmp_path / "rm")
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": r["prompt"], "reward_model": {"ground_truth": r["answer"]}}
                                             for r in P.make_problems(8, torch.Generator())])
    argv = [*TINY, "--runs-dir", str(tmp_path / "runs"), "--dataset", str(data), "--reward-model-path", str(rm)]
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*argv, "--reward-fn", "math", "--answer-key",
                                                         "reward_model.ground_truht"]))
    assert "d.jsonl: no column 'reward_model.ground_truht' (--answer-key); its columns: prompt, " \
           "reward_model.ground_truth" in err, err
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*argv, "--reward-fn", "math"]))  # (the default key)
    assert "--reward-fn math scores responses against answers: no row of --dataset" in err and "has 'answer'" in err
    assert not (tmp_path / "runs").exists()
    res = P.main(P.parse_args([*argv, "--answer-key", "reward_model.ground_truth", "--reward-fn", "math"]))
    assert "rollout/rule_reward_mean" in res["metrics"] and "rollout/accuracy" in res["metrics"]


def test_an_empty_dataset_says_so_and_a_byte_order_mark_is_allowed(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    err = one_line_exit(capsys, 2, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path / "r"), "--dataset",
                                                         str(tmp_path / "empty.jsonl")]))
    assert "empty.jsonl: empty" in err and not (tmp_path / "r").exists()
    bom = write_rows(tmp_path / "bom.jsonl", P.make_problems(8, torch.Generator()), "utf-8-sig")
    assert bom.read_bytes()[:3] == b"\xef\xbb\xbf"
    rows = P.load_dataset(str(bom), P.build_char_tokenizer(), 16)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in P.make_problems(8, torch.Generator())]


def test_reward_shift_and_scale_given_together_do_both():
    s, grp = torch.tensor([1.0, 3.0, 0.0, 4.0]), torch.tensor([0, 0, 1, 1])
    mean = sum(s.tolist()) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in s.tolist()) / 3)
    both = P.normalize_scores(s, grp, "batch", True, True, None)
    assert torch.allclose(both, (s - mean) / (std + 1e-6), atol=1e-6)
    assert torch.allclose(P.normalize_scores(s, grp, "batch", True, False, None), s - mean)
    assert torch.allclose(P.normalize_scores(s, grp, "batch", False, True, None), s / (std + 1e-6), atol=1e-6)


def test_group_statistics_against_a_plain_reference():
    scores, groups = torch.tensor([1.0, 3.0, 0.5, -2.0, 4.0, 4.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    mean, std, size = P.group_stats(scores, groups)
    for i, g in enumerate(groups.tolist()):
        xs = [s for s, h in zip(scores.tolist(), groups.tolist()) if h == g]
        m = sum(xs) / len(xs)
        assert mean[i].item() == pytest.approx(m) and size[i].item() == len(xs)
        assert std[i].item() == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)), abs=1e-6)


def test_a_resumed_critic_that_does_not_load_is_one_line_error(tmp_path, capsys):
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1"]))
    state = torch.load(part["checkpoint"], weights_only=True)
    with open(os.path.join(part["run_dir"], state["model"]["critic"], "model.safetensors"), "wb") as f:
        f.write(b"\x08" + b"\x00" * 7)
    err = one_line_exit(capsys, 2, P.main, P.parse_args(["--resume", part["checkpoint"]]))
    assert f"cannot load a critic from {os.path.join(part['run_dir'], state['model']['critic'])}: " in err


def test_ctrl_c_before_training_stops_cleanly_and_leaves_no_run_directory(tmp_path):
    p = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--sft-steps", "100000", "--runs-dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = p.stdout.readline()
    assert first.startswith("policy: "), first + p.stderr.read()
    time.sleep(1.0)  # (in the warm-start)
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    out, err = p.communicate(timeout=120)
    lines = out.splitlines()  # (the warm start's first line, then the stop; nothing else)
    assert p.returncode == 0 and err == "" and lines[-1] == "stopped before training (SIGINT); nothing written", (out, err)
    assert all(line.startswith("warm") for line in lines[:-1]), out
    assert os.listdir(tmp_path) == []


def test_a_stop_before_training_finishes_wandb_before_it_removes_the_run_directory(tmp_path, monkeypatch, capsys):
    import types

    run_dir, seen = tmp_path / "run", []
    run_dir.mkdir()
    wandb = types.SimpleNamespace(finish=lambda: seen.append(run_dir.exists()))  # (wandb writes into run_dir)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    writer = types.SimpleNamespace(close=lambda: None)
    with P.StopSignals() as signals:
        signals.received.append(signal.SIGINT)
        P.stopped_before_training(P.parse_args(["--track"]), signals, 1, str(run_dir), writer)
    assert seen == [True] and not run_dir.exists()
    assert "stopped before training" in capsys.readouterr().out


def test_sigterm_before_training_of_a_resumed_run_leaves_its_checkpoint_alone(tmp_path, monkeypatch, capsys):
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1"]))
    before = sorted(os.listdir(part["run_dir"])), os.stat(part["checkpoint"]).st_mtime_ns
    build = P.build_critic

    def signalled(*a, **k):  # a SIGTERM while the models load
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*a, **k)
    monkeypatch.setattr(P, "build_critic", signalled)
    capsys.readouterr()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    res = P.main(P.parse_args(["--resume", part["checkpoint"]]))
    out = capsys.readouterr().out
    assert res["run_dir"] is None and out.endswith(f"stopped before training (SIGTERM); nothing written; continue "
                                                   f"with: python ppo_llm.py --resume {part['checkpoint']}\n"), out
    assert (sorted(os.listdir(part["run_dir"])), os.stat(part["checkpoint"]).st_mtime_ns) == before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_a_signal_in_the_last_evaluation_saves_the_trained_model(tmp_path, monkeypatch, capsys):
    evaluate = P.evaluate

    def signalled(*a, stop=None):
        if stop is not None and len(calls) == 2:  # the evaluation after the last iteration
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return evaluate(*a, stop=stop)
    calls = []
    monkeypatch.setattr(P, "evaluate", signalled)
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--eval-every", "1"]))  # (--no-save-model)
    out = capsys.readouterr().out
    assert res["checkpoint"] and torch.load(res["checkpoint"], weights_only=True)["iteration"] == 2
    assert f"evaluation stopped (SIGTERM); evaluate the trained model with: python ppo_llm.py --resume " \
           f"{res['checkpoint']}" in out and [c[0] for c in res["curve"]] == [0, 1]


# ----- what a cluster does to a job (issue #26) ----------------------------------------------------------------
def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(P.time, "time", lambda: 1_700_000_000.0)
    dirs = [P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--save-model"]))["run_dir"] for _ in range(3)]
    name = "sort__ppo_llm__1__1700000000"
    assert dirs == [str(tmp_path / name), str(tmp_path / f"{name}-2"), str(tmp_path / f"{name}-3")]
    assert all(os.path.isfile(os.path.join(d, "checkpoint.pt")) for d in dirs)


def disk_full(after_bytes: int):
    """torch.save that writes after_bytes into its file, then fails as torch does on a full disk: RuntimeError
    "unexpected pos" raised while handling the file's OSError(ENOSPC)."""
    import errno

    def save(obj, f, *a, **k):
        f.write(b"\0" * after_bytes)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    return save


@pytest.mark.parametrize("fail_at,kept", [(1, "(no checkpoint was written)"), (2, "(the previous checkpoint is kept)")])
def test_a_full_disk_while_writing_checkpoint_pt_is_one_line_and_keeps_the_previous_one(tmp_path, monkeypatch, capsys,
                                                                                       fail_at, kept):
    saves, real = [], torch.save

    def save(obj, f, *a, **k):
        saves.append(1)
        return (disk_full(100) if len(saves) == fail_at else real)(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    err = one_line_exit(capsys, 1, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--checkpoint-every",
                                                         "1"]))
    monkeypatch.undo()
    (run,) = os.listdir(tmp_path)
    path = tmp_path / run / "checkpoint.pt"
    assert err == f"error: cannot write {path}: No space left on device {kept}"
    left = sorted(os.listdir(tmp_path / run))
    if fail_at == 1:  # nothing of the failed save stays (not its models, not the reference)
        assert not [f for f in left if f.startswith(("checkpoint", "ref"))], left
    else:
        assert [f for f in left if f.startswith(("checkpoint", "ref"))] == ["checkpoint-1", "checkpoint.pt", "ref"]
        assert P.load_checkpoint(str(path))["iteration"] == 1


def test_a_full_disk_while_writing_the_models_removes_what_the_save_wrote(tmp_path, monkeypatch):
    import errno

    m, critic, save = tiny_saver(tmp_path, 32, 1)
    save(1)

    def full(path, *a, **k):  # half a file, then the disk is full (safetensors says so in its own words)
        os.makedirs(path, exist_ok=True)
        (tmp_path / "partial").write_bytes(b"\0" * 10)
        os.replace(tmp_path / "partial", os.path.join(path, "model.safetensors"))
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(critic, "save_pretrained", full)
    with pytest.raises(P.Failure) as e:
        save(2)
    assert e.value.code == 1 and str(e.value).startswith(f"cannot write {tmp_path / 'checkpoint-2' / 'critic'}: "), e.value
    assert "No space left on device" in str(e.value) and str(e.value).endswith("(the previous checkpoint is kept)")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint.pt", "ref"]
    assert P.load_checkpoint(str(tmp_path / "checkpoint.pt"))["iteration"] == 1
    assert P.write_failure(OSError(errno.EDQUOT, "Disk quota exceeded")) == "Disk quota exceeded"
    try:  # the chain that write_failure and read_rows walk: raised from, or while handling
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as first:
            raise ValueError("second") from first
    except ValueError as second:
        try:
            raise RuntimeError("third")
        except RuntimeError as third:
            assert [type(x) for x in P.exception_chain(third)] == [RuntimeError, ValueError, OSError]
            assert P.write_failure(third) == "No space left on device"


def test_a_checkpoint_is_read_once_per_process(tmp_path, monkeypatch):
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1"]))
    loads, real = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    P.main(P.parse_args(["--resume", part["checkpoint"]]))
    assert loads == [part["checkpoint"]]


def test_the_non_finite_stop_says_when_no_checkpoint_was_written(tmp_path, monkeypatch, capsys):
    real = P.compute_advantages
    monkeypatch.setattr(P, "compute_advantages", lambda *a, **k: tuple(x * float("nan") for x in real(*a, **k)))
    err = one_line_exit(capsys, 1, P.main, P.parse_args([*TINY, "--runs-dir", str(tmp_path)]))
    assert err.endswith("at iteration 1; stopping (no checkpoint was written)"), err


def test_bad_input_and_notes_under_torchrun_are_printed_by_rank_0_alone():
    """Every rank finds them; rank 0 says them (the error in one line), the others say nothing."""
    def run(rank):  # (--group-size 1: a note on --micro-batch-size, then the error)
        return subprocess.run([sys.executable, SCRIPT, "--group-size", "1", "--tiny-hidden-size", "12"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "RANK": rank})
    zero, one = run("0"), run("1")
    assert zero.returncode == one.returncode == 2 and (one.stdout, one.stderr) == ("", ""), (one.stdout, one.stderr)
    assert zero.stderr.startswith("error: --tiny-hidden-size must be a multiple of 8") and zero.stderr.count("\n") == 1
    assert "note: --micro-batch-size 8" in zero.stdout


# ----- real verifiable-reward tasks (issue #27): reward functions, data files, pass@k, LoRA, GPU by default ---------
MATH_CASES = [  # (response, reference answer, reward): the GSM8K / MATH rule
    ("so the total is 1234", "Natalia sold 48 + 24 = 72 clips.\n#### 1,234", 1.0),  # GSM8K: after ####, commas
    ("The answer is 1,234.", "#### 1234", 1.0),  # the response's last number, its comma and the period
    ("#### 1,234", "1234", 1.0),
    ("-5 degrees, so -5", "-5", 1.0), ("it drops by 5", "-5", 0.0),  # negative numbers
    ("I cannot tell", "7", 0.0), ("", "7", 0.0),  # no number at all
    ("3.50 each", "3.5", 1.0), ("7.0", "7", 1.0), ("about 0.333", "1/3", 0.0),  # decimals
    ("costs $18", "$18.00", 1.0), ("\\boxed{\\$18}", "18", 1.0),  # dollars
    ("x = 42.", "42", 1.0), ("\\boxed{42.}", "42", 1.0),  # a trailing period
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0), ("1/2", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{0}}", "0", 0.0),  # fractions of plain numbers are numbers; /0 is none
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0), ("\\boxed{3} and 4 later", "3", 1.0),  # the last \boxed{} wins
    ("\\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}", 1.0), ("\\boxed{2^{10}}", "1024", 0.0),  # nested braces
    ("\\boxed{x+1", "1", 1.0),  # an unclosed \boxed{: its last number
    ("\\boxed{ x+1 }", "x+1", 1.0), ("\\boxed{x + 1}", "x+1", 0.0),  # strings: stripped, not normalised
    ("The solution gives 5", "so it is \\boxed{5}", 1.0),  # a MATH solution as the reference: its \boxed{}
    ("12", None, 0.0),  # no reference answer
    ("The answer is 1e5", "5", 0.0), ("The answer is 1e5", "1e5", 1.0), ("so 1.5e3", "3", 0.0),  # one token, as text
    ("the score was 3-2", "-2", 0.0), ("the score was 3-2", "2", 1.0),  # a minus after a digit is no sign
    ("on 2023-11-25", "-25", 0.0), ("on 2023-11-25", "25", 1.0), ("x-3", "-3", 0.0), ("so (-3)", "-3", 1.0),
    ("\\boxed{1,2}", "12", 0.0), ("It is 1,0000", "10000", 0.0), ("\\boxed{1{,}000}", "1000", 1.0),  # thousands
    ("\\boxed{2 3}", "23", 0.0), ("\\boxed{- 3}", "-3", 1.0),  # spaces between digits are not removed
    ("50%", "50%", 1.0), ("\\boxed{10}", "10\\%", 1.0), ("\\boxed{50\\%}", "50", 1.0),  # percent signs stripped
    ("\\boxed{{5}}", "5", 1.0), ("\\boxed{{x}}", "x", 1.0), ("\\boxed{{1}{2}}", "12", 0.0),  # braces around it all
    ("\u22123 degrees", "-3", 1.0), ("\\boxed{\u22121/2}", "-0.5", 1.0),  # a Unicode minus
]


@pytest.mark.parametrize("response,answer,want", MATH_CASES)
def test_math_reward_table(response, answer, want):
    assert P.math_reward(response, answer) == want


def test_math_number_and_boxed_content():
    from fractions import Fraction

    assert [P.math_number(s) for s in ("1,234", " $5 ", "-3.50", "42.", "7/8", "\\frac{1}{2}", "-\\tfrac{3}{4}",
                                       ".5", "x+1", "1e5", "nan", "\\sqrt{2}")] == [
        1234, 5, Fraction(-7, 2), 42, Fraction(7, 8), Fraction(1, 2), Fraction(-3, 4), Fraction(1, 2), None, None,
        None, None]
    assert P.boxed_content("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}" and P.boxed_content("\\boxed{{x}") is None
    assert [P.math_number(s) for s in ("1,2", "2 3", "1 000", "1\\,000", "{7}", "\u22127", "12%", "1,234,567.5")] == [
        None, None, None, 1000, 7, -7, 12, Fraction(2469135, 2)]
    assert P.NUMBER.findall("3-2 on 2023-11-25, -4 and 1e-5; x1,234,5678") == ["3", "2", "2023", "11", "25", "-4", "1e-5",
                                                                                 "1,234", "5678"]


def test_pass_at_k_against_a_count_over_all_k_subsets():
    import itertools

    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert P.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert P.pass_at_k(200, 3, 1) == pytest.approx(3 / 200)  # pass@1: the fraction correct
    assert 0 < P.pass_at_k(2000, 1, 10) < 1  # large n: no binomial overflows


def write_reward_fn(path, body):
    path.write_text("import math\nCALLS = []\n\n\ndef score(prompt, response, answer):\n    CALLS.append(1)\n"
                    + "".join(f"    {line}\n" for line in body.splitlines()))
    return f"{path}:score"


def test_a_user_reward_function_is_used_and_summed_with_a_reward_model(tmp_path, monkeypatch):
    fn = write_reward_fn(tmp_path / "r.py", "return 1.0 if prompt.endswith('=') and answer else 0.0")
    logged = {}
    monkeypatch.setattr(P, "log_scalars", lambda writer, scalars, step: logged.update(scalars))
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "a"), "--reward-fn", fn]))
    assert res["metrics"]["rollout/reward_mean"] == 1.0 and res["metrics"]["rollout/accuracy"] == 1.0
    assert logged["eval/accuracy_greedy"] == 1.0 and "rollout/rule_reward_mean" not in logged
    rm = gpt2_reward_model(tmp_path / "rm")
    one = [*TINY, "--num-iterations", "1", "--reward-model-path", str(rm)]  # (the same responses in both runs)
    res = P.main(P.parse_args([*one, "--runs-dir", str(tmp_path / "b"), "--reward-funcs", fn]))
    m = res["metrics"]
    assert m["rollout/rule_reward_mean"] == 1.0 and m["rollout/rm_score_mean"] != 0.0
    assert m["rollout/reward_mean"] == pytest.approx(1.0 + m["rollout/rm_score_mean"], abs=1e-6)
    alone = P.main(P.parse_args([*one, "--runs-dir", str(tmp_path / "c")]))
    assert "rollout/rule_reward_mean" not in alone["metrics"]  # without --reward-fn: the reward model's score alone
    assert alone["metrics"]["rollout/reward_mean"] == pytest.approx(m["rollout/rm_score_mean"], abs=1e-6)


def test_a_reward_function_that_cannot_be_imported_is_exit_2_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    fn = write_reward_fn(tmp_path / "r.py", "return 1.0")
    runs = tmp_path / "runs"
    for spec, needle in [(str(tmp_path / "none.py:score"), "no such file"),
                         ("exactly", "choose exact, math or FILE.py:NAME"),
                         (fn.replace(":score", ":scor"), "has no function 'scor'"),
                         (f"{tmp_path / 'broken.py'}:score", "cannot import")]:
        argv = [*TINY, "--runs-dir", str(runs), "--reward-fn", spec]
        err = one_line_exit(capsys, 2, lambda a: P.main(P.parse_args(a)), argv)
        assert needle in err and not runs.exists(), err


@pytest.mark.parametrize("body,needle", [("raise ValueError('no verdict')", "raised ValueError: no verdict"),
                                         ("return float('nan')", "returned nan, not a finite number"),
                                         ("return 'yes'", "returned 'yes', not a finite number"),
                                         ("return 10**400", f"returned {'1' + '0' * 39}, not a finite number"),
                                         ("raise SystemExit(3)", "raised SystemExit: 3 on the prompt"),
                                         ("import sys; sys.exit()", "raised SystemExit on the prompt")])
def test_a_reward_function_that_fails_stops_the_run_naming_the_prompt(tmp_path, capsys, body, needle):
    fn = write_reward_fn(tmp_path / "r.py", f"if len(CALLS) > 24:\n    {body}\nreturn 0.0")  # 16 evaluated, 8 in iteration 1
    err = one_line_exit(capsys, 1, lambda a: P.main(P.parse_args(a)), [
        *TINY, "--runs-dir", str(tmp_path / "runs"), "--reward-fn", fn, "--checkpoint-every", "1"])
    (run,) = os.listdir(tmp_path / "runs")
    assert needle in err and re.search(r"on the prompt '\d{5}='", err), err
    assert err.endswith(f"stopping (last checkpoint kept: {tmp_path / 'runs' / run / 'checkpoint.pt'})"), err
    assert P.load_checkpoint(str(tmp_path / "runs" / run / "checkpoint.pt"))["iteration"] == 1


def test_a_reward_function_that_fails_in_the_first_evaluation_stops_before_training(tmp_path, capsys):
    fn = write_reward_fn(tmp_path / "r.py", "return {'score': 1}")  # (a dict, as some frameworks' functions return)
    err = one_line_exit(capsys, 1, lambda a: P.main(P.parse_args(a)), [*TINY, "--runs-dir", str(tmp_path / "runs"),
                                                                       "--reward-fn", fn])
    assert "returned {'score': 1}, not a finite number, on the prompt" in err, err
    (run,) = os.listdir(tmp_path / "runs")  # (its TensorBoard events alone)
    assert err.endswith("stopping (no checkpoint was written)"), err
    assert all(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "runs" / run))


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_rows(problems):
    """Rows in verl's parquet layout (its GSM8K preprocessing): chat-message prompts, reward_model.ground_truth."""
    return [{"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"index": i},
             "prompt": [{"role": "user", "content": r["prompt"]}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}} for i, r in enumerate(problems)]


def test_data_files_through_datasets_keys_and_formats(tmp_path, capsys):
    tok = P.build_char_tokenizer()
    problems = P.make_problems(6, torch.Generator().manual_seed(0))
    want = [(r["prompt"], r["answer"]) for r in problems]
    (tmp_path / "d.json").write_text(json.dumps([{"q": r["prompt"], "a": int(r["answer"])} for r in problems]))
    rows = P.load_dataset(str(tmp_path / "d.json"), tok, 16, prompt_key="q", answer_key="a")
    assert [(r["prompt"], r["answer"]) for r in rows] == [(p, str(int(a))) for p, a in want]
    write_parquet(tmp_path / "v.parquet", verl_rows(problems))
    tok.chat_template = CHAT
    rows = P.load_dataset(str(tmp_path / "v.parquet"), tok, 24, answer_key="reward_model.ground_truth")
    assert [r["answer"] for r in rows] == [a for _, a in want]
    assert rows[0]["prompt"] == [{"role": "user", "content": want[0][0]}]
    assert P.prompt_token_ids(tok, rows[0]["prompt"]) == P.prompt_token_ids(tok, want[0][0], chat=True)
    enc = P.reward_model_inputs(tok, [rows[0]["prompt"]], ["13"])  # a reward model reads the exchange in its template
    assert tok.decode(enc["input_ids"][0]) == f"<bos><user>{want[0][0]}<assistant>13"
    # the same file, but the tokenizer has no chat template; a missing prompt column; a JSONL row by its line
    (tmp_path / "b.jsonl").write_text('{"prompt": "1="}\n\n\n{"question": "3="}\n')  # (blank lines are skipped)
    (tmp_path / "x.jsonl").write_text('{"prompt": "1="}\nnot json\n')
    for path, needle in [
            (tmp_path / "v.parquet", "its prompts are chat messages, but the policy's tokenizer has no chat template"),
            (tmp_path / "d.json", "no column 'prompt' (--prompt-key); its columns: q, a"),
            (write_rows(tmp_path / "g.jsonl", [{"prompt": "1="}, {"prompt": ""}]), "g.jsonl line 2: empty prompt"),
            (tmp_path / "b.jsonl", "b.jsonl line 4: 'prompt' is None, neither text nor a list of chat messages"),
            (tmp_path / "x.jsonl", "x.jsonl: cannot read it as json (")]:
        err = one_line_exit(capsys, 2, P.load_dataset, str(path), P.build_char_tokenizer(), 24, False, "--dataset")
        assert needle in err, err
    (tmp_path / "d.csv").write_text("prompt,answer\n1=,1\n")
    err = one_line_exit(capsys, 2, P.parse_args, ["--dataset", str(tmp_path / "d.csv")])
    assert "d.csv: not a .jsonl, .json or .parquet file" in err


def test_answers_read_by_datasets_keep_their_text_and_their_integers(tmp_path, capsys):
    """datasets reads a JSON column of 72 and 2.5 as floats (72.0): answers are text as the file has it, integers as
    integers."""
    tok = P.build_char_tokenizer()

    def answers(name, lines):
        (tmp_path / name).write_text("".join(f'{{"prompt": "{i}=", "answer": {a}}}\n' for i, a in enumerate(lines)))
        capsys.readouterr()
        rows = P.load_dataset(str(tmp_path / name), tok, 16)
        return [r["answer"] for r in rows], capsys.readouterr().out
    got, out = answers("mixed.jsonl", ["72", "2.5", "null", "-3", "1e5"])
    assert got == ["72", "2.5", None, "-3", "100000"] and out == ""  # (the old reader: "72", not "72.0")
    assert P.rule_reward(got[0], "72") == 1.0  # the exact rule scores the right response right again
    got, out = answers("text.jsonl", ['"01"', '"72.0"', '" 7 "', '"1e5"'])
    assert got == ["01", "72.0", " 7 ", "1e5"] and out == ""  # text: as written
    write_parquet(tmp_path / "f.parquet", [{"prompt": "1=", "answer": 72.0, "n": 3}, {"prompt": "2=", "answer": 2.5,
                                                                                     "n": 4}])
    assert [r["answer"] for r in P.load_dataset(str(tmp_path / "f.parquet"), tok, 16)] == ["72", "2.5"]
    assert [r["answer"] for r in P.load_dataset(str(tmp_path / "f.parquet"), tok, 16, answer_key="n")] == ["3", "4"]


def test_data_files_leave_no_cache_behind(tmp_path, monkeypatch):
    import tempfile

    import datasets

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    cache = datasets.config.HF_DATASETS_CACHE
    before = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
    rows = P.load_dataset(str(write_rows(tmp_path / "d.jsonl", P.make_problems(4, torch.Generator()))),
                          P.build_char_tokenizer(), 16)
    assert len(rows) == 4 and os.listdir(tmp_path / "tmp") == []
    assert (sorted(os.listdir(cache)) if os.path.isdir(cache) else []) == before


def test_verl_parquet_with_chat_prompts_math_reward_and_pass_at_k(tmp_path, monkeypatch):
    tok = P.build_char_tokenizer()
    tok.chat_template = CHAT
    P.build_tiny_model(tok, 3, *SMALL).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")

    def smallest_digit(problems):  # a one-digit ground truth (a number, as GSM8K's): one a tiny model gets right
        return [{**r, "answer": r["answer"][0]} for r in problems]
    train = write_parquet(tmp_path / "train.parquet", verl_rows(smallest_digit(P.make_problems(
        16, torch.Generator().manual_seed(0)))))
    held = P.make_problems(4, torch.Generator().manual_seed(1))
    test = write_parquet(tmp_path / "test.parquet", verl_rows(smallest_digit(held)))
    scored, math_rule = [], P.REWARD_RULES["math"]  # every math score of the run: rollouts and evaluations
    monkeypatch.setitem(P.REWARD_RULES, "math", lambda *a: scored.append(math_rule(*a)) or scored[-1])
    logged, prompts, encode = {}, [], P.encode_batch

    def spy(tok, rows, length, chat=False):
        ids, mask = encode(tok, rows, length, chat)
        prompts.extend(tok.decode(i[m.bool()]) for i, m in zip(ids, mask))
        return ids, mask
    monkeypatch.setattr(P, "encode_batch", spy)
    monkeypatch.setattr(P, "log_scalars", lambda writer, scalars, step: logged.update(scalars))
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "runs"), "--model-name-or-path",
                               str(tmp_path / "lm"), "--train-files", str(train), "--val-files", str(test),
                               "--answer-key", "reward_model.ground_truth", "--reward-fn", "math",
                               "--prompt-length", "24", "--eval-n", "4", "--eval-temperature", "1.5",
                               "--sft-steps", "30"]))
    assert len(res["curve"]) == 2 and all(math.isfinite(v) for v in res["stats"].values())
    assert prompts and all(p.startswith("<bos><user>") and p.endswith("=<assistant>") for p in prompts), prompts[:3]
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/accuracy_greedy"} <= set(logged)
    assert 0 <= logged["eval/pass@1"] <= logged["eval/pass@2"] <= logged["eval/pass@4"] <= 1
    assert res["run_dir"].startswith(str(tmp_path / "runs" / "train__"))
    assert 1.0 in scored and 0.0 in scored and len(scored) == 2 * 8 + 2 * (4 + 4 + 16)  # right and wrong answers


def test_eval_n_samples_each_prompt_n_times_at_the_eval_temperature(tmp_path, monkeypatch):
    calls, real = [], P.generate

    def spy(model, prompt_ids, *a, **k):
        call = inspect.signature(real).bind(model, prompt_ids, *a, **k)
        calls.append((prompt_ids.shape[0], call.arguments.get("temperature"), call.arguments.get("greedy", False)))
        return real(model, prompt_ids, *a, **k)
    monkeypatch.setattr(P, "generate", spy)
    fn = write_reward_fn(tmp_path / "r.py", "return float(len(CALLS) % 3 == 0)")  # a third of the samples right
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--num-iterations", "1", "--eval-n", "3",
                               "--eval-temperature", "0.7", "--reward-fn", fn]))
    evals = [c for c in calls if c[1] == 0.7]
    # 8 prompts x 3 samples, before and after training, in micro-batches of a rollout's 4 x 2 responses
    assert evals and all(size == 8 and not greedy for size, _, greedy in evals)
    assert res["curve"] and len(evals) == 2 * 3


# ----- LoRA --------------------------------------------------------------------------------------------------------
def test_lora_reference_is_the_base_model_without_a_copy():
    tok = P.build_char_tokenizer()
    base = P.build_tiny_model(tok, 0, 64, 1)
    policy = P.with_lora(P.build_tiny_model(tok, 0, 64, 1), P.Args(lora_rank=4, cuda=False), "CAUSAL_LM")
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=torch.Generator().manual_seed(0))
    ref = P.AdaptersOff(policy)
    ids, mask = P.left_pad([tok.encode("98765="), tok.encode("12=")], tok.pad_token_id, 8)
    resp = torch.tensor([[20, 21, 1, 0], [22, 1, 0, 0]])
    ids, attn = torch.cat([ids, resp], 1), torch.cat([mask, P.response_mask_from(resp, 1)], 1)
    with torch.no_grad():
        logp = {name: P.model_forward(m, ids, attn, 4, 0.7)["logp"] for name, m in
                (("base", base), ("ref", ref), ("policy", policy))}
    assert torch.equal(logp["ref"], logp["base"]) and not torch.allclose(logp["policy"], logp["base"], atol=1e-3)
    assert list(ref.parameters()) == [] and ref.state_dict() == {}  # no second copy
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    base_sd = P.base_weights(policy)
    assert base_sd.keys() == base.state_dict().keys()
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in base_sd.items())


LORA_CASES = [("gae", ["--critic-lora"]), ("gae", ["--critic", "shared"]), ("grpo", []), ("rloo", []),
              ("reinforce", []), ("reinforce_plus_plus", []), ("reinforce_plus_plus_baseline", [])]


@pytest.mark.parametrize("estimator,extra", LORA_CASES)
def test_lora_ratio_one_reference_equals_base_and_exact_resume(tmp_path, monkeypatch, estimator, extra):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    firsts, scored, update, score = [], [], P.ppo_update, P.score_responses

    def spy_update(*a, **k):
        mean, first = update(*a, **k)
        firsts.append((first.get("approx_kl"), first.get("clipfrac"), mean.get("approx_kl")))
        return mean, first

    def spy_score(policy, ref, critic, value_head, ids, attn, args, *a, **k):
        out = score(policy, ref, critic, value_head, ids, attn, args, *a, **k)
        scored.append((ref, ids, attn, out[0], out[1]))
        return out
    monkeypatch.setattr(P, "ppo_update", spy_update)
    monkeypatch.setattr(P, "score_responses", spy_score)
    fn = write_reward_fn(tmp_path / "r.py", "return len(response) / 8")  # (scores that differ: advantages that do)
    argv = [*TINY, "--lora-rank", "4", "--adv-estimator", estimator, "--lr", "2e-3", "--save-model", "--reward-fn",
            fn, *extra]
    if estimator != "gae":
        argv += ["--critic", "none"]
    full = P.main(P.parse_args([*argv, "--runs-dir", str(tmp_path / "a")]))
    part = P.main(P.parse_args([*argv, "--runs-dir", str(tmp_path / "b"), "--stop-after", "1"]))
    resumed = P.main(P.parse_args(["--resume", part["checkpoint"]]))
    # ratio exactly 1 on the first minibatch of every iteration; later minibatches see the adapters move
    assert len(firsts) == 4 and all(kl == 0.0 and clip == 0.0 for kl, clip, _ in firsts), firsts
    assert all(mean > 0 for _, _, mean in firsts), firsts
    # the reference's log-probs are the base model's (ref/ of the run, loaded without peft); the policy's are not
    base = AutoModelForCausalLM.from_pretrained(os.path.join(full["run_dir"], "ref"))
    for ref, ids, attn, old_logp, ref_logp in scored:
        assert isinstance(ref, P.AdaptersOff)
        with torch.no_grad():
            want = torch.cat([P.model_forward(base, ids[s:s + 2], attn[s:s + 2], 8, 1.0)["logp"]
                              for s in range(0, len(ids), 2)])
        assert torch.equal(ref_logp, want)
    assert not torch.allclose(scored[1][3], scored[1][4], atol=1e-4)  # iteration 2: the adapters have moved
    # stopped after one iteration and resumed == uninterrupted: adapters (and a LoRA critic's) bit for bit
    for sub in ("policy", "critic") if "--critic-lora" in extra else ("policy",):
        a, b = (load_file(os.path.join(r["run_dir"], "checkpoint-2", sub, "adapter_model.safetensors"))
                for r in (full, resumed))
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), sub
    a, b = (load_file(os.path.join(r["run_dir"], "ref", "model.safetensors")) for r in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the base, the same


def test_lora_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    for argv, needle in [(["--critic-lora"], "needs --critic separate and --lora-rank"),
                         (["--lora-rank", "4", "--critic", "shared", "--critic-lora"], "needs --critic separate"),
                         (["--lora-alpha", "0"], "--lora-alpha must be positive, got 0.0"),
                         (["--eval-temperature", "-1"], "--eval-temperature must be positive, got -1.0"),
                         (["--lora-rank", "-1"], "--lora-rank must be >= 0")]:
        assert needle in one_line_exit(capsys, 2, P.parse_args, argv)
    err = one_line_exit(capsys, 2, lambda a: P.main(P.parse_args(a)), [
        *TINY, "--runs-dir", str(tmp_path / "r"), "--lora-rank", "4", "--lora-target-modules", "q_proj,qkv"])
    assert "no module qkv in the policy (its linear layers: down_proj, gate_proj, k_proj, " in err
    assert not (tmp_path / "r").exists()
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1", "--lora-rank", "4"]))
    err = one_line_exit(capsys, 2, P.parse_args, ["--resume", part["checkpoint"], "--lora-rank", "8"])
    assert "--lora-rank 8: the checkpoint's is 4; it cannot change on resume" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "not supported under torchrun" in one_line_exit(capsys, 2, P.parse_args, ["--lora-rank", "4"])


def test_what_the_models_become_is_checked_before_the_run_directory_and_the_warm_start(tmp_path, capsys,
                                                                                      monkeypatch):
    """A separate critic of a class transformers lacks, LoRA on modules peft cannot adapt, saved adapters that do not
    load: one line, exit 2, before a run directory is made (or taken, on resume) and before the warm start."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    tok = P.build_char_tokenizer()
    CodeGenForCausalLM(CodeGenConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), n_positions=64,
                                     rotary_dim=8)).save_pretrained(tmp_path / "codegen")  # (no ...ForTokenClassification)
    tok.save_pretrained(tmp_path / "codegen")
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path / "lora"), "--stop-after", "1", "--lora-rank", "4"]))
    state = torch.load(part["checkpoint"], weights_only=True)
    (tmp_path / "lora" / os.path.basename(part["run_dir"]) / state["model"]["policy"] / "adapter_config.json"
     ).write_text("{not json")
    calls = []
    monkeypatch.setattr(P, "warm_start", lambda *a, **k: calls.append("warm start"))
    monkeypatch.setattr(P, "make_run_dir", lambda *a: calls.append("run directory"))
    for argv, needle in [
            (["--model-name-or-path", str(tmp_path / "codegen")], "--critic separate: no token-classification class "
                                                                  "for codegen"),
            (["--lora-rank", "4", "--lora-target-modules", "input_layernorm"], "--lora-target-modules input_layernorm: "
                                                                               "no LoRA adapters on the policy ("),
            (["--resume", part["checkpoint"]], "cannot load LoRA adapters from ")]:
        argv = argv if argv[0] == "--resume" else [*TINY, "--runs-dir", str(tmp_path / "runs"), *argv]
        err = one_line_exit(capsys, 2, P.main, P.parse_args(argv))
        assert needle in err and calls == [], (err, calls)
    assert not (tmp_path / "runs").exists()


# ----- GPU by default --------------------------------------------------------------------------------------------
def test_cuda_is_the_default_where_torch_sees_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as here, on a GPU host too)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not P.parse_args([]).cuda  # (no GPU here)
    assert "--cuda given but torch finds no CUDA device" in one_line_exit(capsys, 2, P.parse_args, ["--cuda"])
    part = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--stop-after", "1"]))
    state = torch.load(part["checkpoint"], weights_only=True)
    state["args"]["cuda"] = True  # as written on a GPU
    torch.save(state, part["checkpoint"])
    capsys.readouterr()
    args = P.parse_args(["--resume", part["checkpoint"]])
    assert not args.cuda and f"note: {part['checkpoint']} was written on a GPU and torch finds none here: the run " \
                             "resumes on the CPU" in capsys.readouterr().out
    assert "--cuda given" in one_line_exit(capsys, 2, P.parse_args, ["--resume", part["checkpoint"], "--cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert P.parse_args([]).cuda and P.parse_args([]).precision == "auto" and P.use_bf16(P.parse_args([]))
    assert not P.parse_args(["--no-cuda"]).cuda and not P.Args(cuda=False).cuda
    args = P.parse_args(["--resume", part["checkpoint"]])
    assert args.cuda and "written on a GPU" not in capsys.readouterr().out  # a GPU here: it resumes on it


def test_under_torchrun_the_gpu_is_the_default_only_with_a_gpu_for_each_process(monkeypatch, capsys):
    """torchrun --nproc-per-node 2 on a machine with one GPU: the default is the CPU; --cuda is one line (rank 0's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for var, value in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    assert not P.parse_args([]).cuda and not P.Args().cuda
    assert "--cuda: 2 processes on this machine, 1 GPU(s): one GPU each" in one_line_exit(capsys, 2, P.parse_args,
                                                                                          ["--cuda"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert P.parse_args([]).cuda
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1"), monkeypatch.setenv("WORLD_SIZE", "1")  # (no torchrun: 1 GPU will do)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert P.parse_args([]).cuda


# ----- real scale: no warm start on a user's model, logits only where used, padding to the batch ----------------
def save_qwen2(path, tok, vocab=None, hidden=64, layers=2):
    """A random-weight Qwen2 (a real architecture) with `vocab` output rows (default: the tokenizer's) and the
    character tokenizer, saved as a user's model directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def sort_rows(count, words=8, seed=0):
    """Rows of a task a user might bring: a sentence of about 20 + 8 * words characters, the sorted digits."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        d = [rng.randrange(10) for _ in range(words)]
        rows.append({"prompt": "Sort these digits in ascending order: " + " ".join(map(str, d)) + " ->",
                     "answer": "".join(map(str, sorted(d)))})
    return rows


def test_a_user_model_or_dataset_gets_no_warm_start_unless_asked(tmp_path, capsys):
    tok = P.build_char_tokenizer()
    lm, data = save_qwen2(tmp_path / "lm", tok), write_rows(tmp_path / "d.jsonl", sort_rows(16, words=3))
    assert P.sft_steps(P.parse_args([])) == 60  # the built-in task's warm start
    assert P.sft_steps(P.parse_args(["--model-name-or-path", lm])) == 0
    assert P.sft_steps(P.parse_args(["--dataset", str(data)])) == 0
    assert P.sft_steps(P.parse_args(["--dataset", str(data), "--sft-steps", "3"])) == 3
    base = [*TINY[2:], "--model-name-or-path", lm, "--dataset", str(data), "--reward-fn", "exact", "--prompt-length",
            "64"]
    capsys.readouterr()
    res = P.main(P.parse_args([*base, "--runs-dir", str(tmp_path / "a")]))
    out = capsys.readouterr().out
    assert "warm start" not in out and "warm-start" not in out
    # a random model of 99 tokens rarely says EOS within 8 tokens: the clip ratio is logged, the warning said once
    assert res["metrics"]["response/clip_ratio"] > 0.5
    assert out.count("of the responses hit --response-length 8 without EOS") == 1
    assert 0 <= res["metrics"]["rollout/groups_all_equal_frac"] <= 1
    # sample completions of every iteration (one response to each of the first 4 prompts): samples.jsonl in the
    # run directory and TensorBoard text
    with open(os.path.join(res["run_dir"], "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["iteration"] for s in samples] == [1] * 4 + [2] * 4 and all(set(s) == {"iteration", "prompt", "response",
                                                                                "reward"} for s in samples)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(res["run_dir"])
    events.Reload()
    assert "samples/completions/text_summary" in events.Tags()["tensors"]
    P.main(P.parse_args([*base, "--sft-steps", "2", "--num-iterations", "1", "--runs-dir", str(tmp_path / "b")]))
    out = capsys.readouterr().out
    assert "warm start: 2 supervised steps" in out and re.search(r"warm-start step 2/2  loss=\S+  eta=0s", out)
    assert "built-in task" in field_help("sft_steps")
    assert "built-in task" in field_help("response_length") and "built-in 2M model" in field_help("lr")


@pytest.mark.parametrize("V", [50, 151_936])
def test_token_stats_in_chunks_against_the_full_log_softmax(V):
    """token_stats on chunks of tokens (several here) against the plain computation through the whole (B, R, V)
    logits: log-probs, entropy, the reference's log-probs and the full KL, their values and their gradients (hidden
    states, output layer), at a temperature; a small vocabulary and Qwen2.5's 151,936 rows."""
    g = torch.Generator().manual_seed(0)
    B, R, H, T = 3, 5, 8, 0.7
    head, ref_head = torch.nn.Linear(H, V, bias=False), torch.nn.Linear(H, V, bias=False)
    for lin in (head, ref_head):
        torch.nn.init.normal_(lin.weight, std=2.0, generator=g)
    hidden, ref_hidden = torch.randn(B, R, H, generator=g), torch.randn(B, R, H, generator=g)
    tokens = torch.randint(0, V, (B, R), generator=g)
    w = torch.randn(3, B, R, generator=g)

    def reference(h):
        logp_all = (head(h) / T).log_softmax(-1)
        ref_all = (ref_head(ref_hidden) / T).log_softmax(-1)
        pick = lambda x: x.gather(-1, tokens[..., None]).squeeze(-1)  # noqa: E731
        return {"logp": pick(logp_all), "entropy": -(logp_all.exp() * logp_all).sum(-1),
                "ref_logp": pick(ref_all), "kl_full": (logp_all.exp() * (logp_all - ref_all)).sum(-1)}
    results = []
    for fn in (reference, lambda h: P.token_stats((head, V), h, tokens, T, True, True, (ref_head, V), ref_hidden,
                                                  elements=4 * V)):  # (chunks of 4 of the 15 tokens)
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        out = fn(h)
        (sum((out[k] * wk).sum() for k, wk in zip(("logp", "entropy", "kl_full"), w))).backward()
        results.append((out, h.grad, head.weight.grad.clone()))
    (want, *want_grads), (got, *got_grads) = results
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-5, rtol=1e-4), k
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert not got["ref_logp"].requires_grad
    # without entropy_grad the entropy carries no graph; without gradients no chunk is kept for a backward
    out = P.token_stats((head, V), hidden.requires_grad_(), tokens, T, entropy=True, elements=4 * V)
    assert out["logp"].requires_grad and not out["entropy"].requires_grad
    with torch.no_grad():
        assert torch.allclose(P.token_stats((head, V), hidden, tokens, T, elements=V)["logp"], want["logp"],
                              atol=1e-5, rtol=1e-4)


def test_logits_are_computed_only_where_they_are_used(tiny):
    """The prefill of generation keeps the last position's logits; scoring and training apply the output layer to
    chunks of response positions of at most LOGIT_ELEMENTS logits; the log-probs and entropy are those of the full
    forward. Entropy carries gradients only when asked."""
    tok, m = tiny
    shapes = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(out.shape)))
    try:
        ids, mask = P.left_pad([tok.encode("98765=", add_special_tokens=False), [5, 6]], tok.pad_token_id)
        resp = P.generate(m, ids, mask, 3, tok.eos_token_id, tok.pad_token_id, greedy=True)
        assert shapes and all(s[1] == 1 for s in shapes)  # the prefill too
        shapes.clear()
        full = torch.cat([ids, resp], 1)
        attn = torch.cat([mask, P.response_mask_from(resp, tok.eos_token_id)], 1)
        R = resp.shape[1]
        out = P.model_forward(m, full, attn, R, 0.7, entropy=True)
        # the forward's own (its last position), then the response's 2 x R tokens in one chunk of this small vocabulary
        assert shapes == [(2, 1, len(tok)), (2 * R, len(tok))]
    finally:
        hook.remove()
    with torch.no_grad():
        ref = full_log_softmax(m, full, attn, R, 0.7)
    assert torch.allclose(out["logp"], ref.gather(-1, full[:, -R:, None]).squeeze(-1), atol=1e-5)
    assert torch.allclose(out["entropy"], -(ref.exp() * ref).sum(-1), atol=1e-5)
    assert out["logp"].requires_grad and not out["entropy"].requires_grad  # (--entropy-coeff 0: no graph)
    assert P.model_forward(m, full, attn, R, 0.7, entropy=True, entropy_grad=True)["entropy"].requires_grad


def test_a_model_whose_logits_are_not_its_output_layers_is_refused_and_a_soft_cap_is_applied():
    """Granite divides its logits by logits_scaling, which output_layer does not know: one line, not wrong log-probs.
    Gemma 2 caps them (final_logit_softcapping), which output_layer applies: the log-probs of its full logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    shape = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    with pytest.raises(P.Failure, match="GraniteForCausalLM computes its logits otherwise than its output layer"):
        P.check_output_layer(GraniteForCausalLM(GraniteConfig(**shape, logits_scaling=4.0)))
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=16, final_logit_softcapping=2.0)).eval()
    P.check_output_layer(gemma)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        want = full_log_softmax(gemma, ids, attn, 4, 0.7).gather(-1, ids[:, -4:, None]).squeeze(-1)
        assert torch.allclose(P.model_forward(gemma, ids, attn, 4, 0.7)["logp"], want, atol=1e-5)


def test_no_logits_of_the_whole_response_with_a_151936_row_vocabulary(tmp_path):
    """A random Qwen2 with Qwen2.5's output rows, 8 responses of 256 tokens: no output of the output layer holds more
    than LOGIT_ELEMENTS logits in scoring (no gradients) or in training (forward and the backward's recomputation), and
    the log-probs and gradients equal those through the model's own full logits."""
    from transformers import AutoModelForCausalLM

    tok = P.build_char_tokenizer()
    m = P.disable_dropout(AutoModelForCausalLM.from_pretrained(save_qwen2(tmp_path / "lm", tok, vocab=151_936,
                                                                          hidden=32, layers=1)))
    B, R = 4, 256
    ids = torch.randint(3, len(tok), (B, 8 + R), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    sizes = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: sizes.append(out.numel()))
    try:
        with torch.no_grad():
            scored = P.model_forward(m, ids, attn, R, 1.0)["logp"]
        out = P.model_forward(m, ids, attn, R, 1.0)["logp"]
        out.sum().backward()
    finally:
        hook.remove()
    assert len(sizes) > 3 * B * R * 151_936 // P.LOGIT_ELEMENTS and max(sizes) <= P.LOGIT_ELEMENTS, max(sizes)
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    logp = full_log_softmax(m, ids, attn, R, 1.0).gather(-1, ids[:, -R:, None]).squeeze(-1)
    logp.sum().backward()
    assert torch.equal(scored, out.detach()) and torch.allclose(out, logp, atol=1e-5, rtol=1e-4)
    assert all(torch.allclose(a, p.grad, atol=1e-5, rtol=1e-4) for a, p in zip(got, m.parameters()))


def pad_batch(batch, left: int, right: int, pad_id: int):
    """The batch padded to larger limits: `left` more prompt columns, `right` more response columns (masked)."""
    out = {}
    for k, v in batch.items():
        if k in ("input_ids", "attention_mask"):
            fill = pad_id if k == "input_ids" else 0
            v = torch.nn.functional.pad(v, (left, 0), value=fill)
            v = torch.nn.functional.pad(v, (0, right), value=fill)
        else:
            v = torch.nn.functional.pad(v, (0, right), value=0)
        out[k] = v
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_padding_to_the_batch_or_to_the_limits_gives_the_same_losses_and_gradients(acc_setup, tiny, mode):
    m, critic, base, batch = acc_setup
    tok = tiny[0]
    args = P.Args(**{**vars(base), "loss_agg_mode": mode, "micro_batch_size": 4})
    results = []
    for b in (batch, pad_batch(batch, 7, 5, tok.pad_token_id)):
        m.zero_grad(), critic.zero_grad()
        stats = P.minibatch_backward(m, critic, None, b, args)
        results.append(({k: float(v) for k, v in stats.items()},
                        [p.grad.clone() for p in list(m.parameters()) + list(critic.parameters())]))
    (s0, g0), (s1, g1) = results
    assert s0.keys() == s1.keys() and all(abs(s0[k] - s1[k]) < 1e-5 for k in s0), (s0, s1)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g0, g1))
    m.zero_grad(), critic.zero_grad()


def test_rollout_prompts_and_responses_are_padded_to_the_batch(tiny):
    tok, m = tiny
    rows = [{"prompt": "12=", "answer": "12"}, {"prompt": "98765=", "answer": "56789"}]
    ids, mask = P.encode_batch(tok, rows, 2048)
    assert ids.shape == (2, len(P.prompt_token_ids(tok, "98765=")))  # the longest prompt, not --prompt-length
    args = P.Args(prompt_length=2048, response_length=50, rollout_micro_batch_size=1, cuda=False)
    resp, full, attn = P.sample_responses(m, tok, rows, args, [tok.eos_token_id], torch.Generator().manual_seed(0),
                                          torch.device("cpu"))
    lengths = P.response_mask_from(resp, tok.eos_token_id).sum(-1)
    assert resp.shape[1] == int(lengths.max()) and full.shape[1] == ids.shape[1] + resp.shape[1]


def test_evaluation_generates_in_micro_batches(tiny, monkeypatch):
    tok, m = tiny
    sizes, original = [], P.generate
    monkeypatch.setattr(P, "generate", lambda model, ids, *a, **k: sizes.append(len(ids)) or original(model, ids, *a,
                                                                                                        **k))
    rows = P.make_problems(10, torch.Generator().manual_seed(0))
    args = P.Args(rollout_batch_size=2, n=2, cuda=False)
    P.evaluate(m, tok, rows, args, P.REWARD_RULES["exact"], [tok.eos_token_id], torch.Generator(), "cpu")
    assert sizes == [4, 4, 2] * 2  # greedy, then sampled: chunks of a rollout's 2 x 2 responses


def test_without_a_kl_term_no_reference_is_built_saved_or_run(tmp_path, capsys):
    argv = [*TINY, "--adv-estimator", "grpo", "--no-use-kl-in-reward", "--runs-dir", str(tmp_path)]
    part = P.main(P.parse_args([*argv, "--stop-after", "1"]))
    ckpt = torch.load(part["checkpoint"], weights_only=True)
    assert ckpt["model"]["ref"] == "" and not os.path.exists(os.path.join(part["run_dir"], "ref"))
    assert "kl/kl_mean" not in part["metrics"]
    rest = P.main(P.parse_args(["--resume", part["checkpoint"]]))
    assert len(rest["curve"]) >= 1 and math.isfinite(rest["stats"]["policy_loss"])
    assert "holds no reference model" in one_line_exit(capsys, 2, P.main, P.parse_args(["--resume", part["checkpoint"],
                                                                                        "--use-kl-loss"]))


def test_frozen_weights_are_stored_in_bf16_in_a_bf16_run(tiny):
    import copy

    tok, m = tiny
    bf16 = P.Args(precision="bf16", cuda=False)
    policy, ref = P.reference_policy(bf16, copy.deepcopy(m), None, None, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())
    _, ref32 = P.reference_policy(P.Args(cuda=False), copy.deepcopy(m), None, None, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in ref32.parameters())
    lora = P.Args(precision="bf16", cuda=False, lora_rank=4)
    policy, ref = P.reference_policy(lora, copy.deepcopy(m), None, None, torch.device("cpu"))
    kinds = {(p.requires_grad, p.dtype) for p in policy.parameters()}
    assert kinds == {(True, torch.float32), (False, torch.bfloat16)}  # adapters fp32, their base bf16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = P.model_forward(policy, ids, torch.ones_like(ids), 2, 1.0)["logp"]
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_peak_memory_with_a_151936_row_vocabulary_is_far_below_full_vocabulary_logits(tmp_path):
    """The issue's case: a random Qwen2 with Qwen2.5's 151,936 output rows, long prompts. Logits over the vocabulary
    for every position of the batch would take B x (P + R) x V x 4 bytes; the whole iteration (models, optimizer,
    rollout, update) grows the process by far less."""
    tok = P.build_char_tokenizer()
    V = 151_936
    lm = save_qwen2(tmp_path / "lm", tok, vocab=V)
    data = write_rows(tmp_path / "d.jsonl", sort_rows(32, words=100))  # prompts of ~240 characters
    B, R = 16, 8
    P_len = max(len(P.prompt_token_ids(tok, r["prompt"])) for r in sort_rows(32, words=100))
    code = f"""
import json, os, sys
sys.path.insert(0, {os.path.dirname(SCRIPT)!r})
import datasets, torch, transformers, ppo_llm as P
from torch.utils.tensorboard import SummaryWriter
rss = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
P.main(P.parse_args(['--model-name-or-path', {lm!r}, '--dataset', {str(data)!r}, '--prompt-length', '256',
    '--response-length', '{R}', '--rollout-batch-size', '8', '--n', '2', '--ppo-mini-batch-size', '8',
    '--micro-batch-size', '4', '--num-iterations', '1', '--eval-prompts', '0', '--no-save-model', '--no-cuda',
    '--adv-estimator', 'grpo',
    '--torch-threads', '1', '--runs-dir', {str(tmp_path / 'runs')!r}]))
peak = [int(ln.split()[1]) * 1024 for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]
print(json.dumps({{"start": rss, "peak": peak}}))  # (VmHWM: ru_maxrss would count the pytest process's own peak)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    mem = json.loads(res.stdout.strip().splitlines()[-1])
    full_logits = B * (P_len + R) * V * 4  # ~2.4 GB
    # the growth is 0.45-0.5 GB alone on 2 cores and was 0.8 GB once inside the whole suite; full-vocabulary logits
    # would add at least full_logits to it
    assert mem["peak"] - mem["start"] < full_logits / 2, (mem, full_logits)


def test_prompt_length_2048_or_256_on_short_prompts_take_about_the_same_time(tmp_path):
    tok = P.build_char_tokenizer()
    lm, data = save_qwen2(tmp_path / "lm", tok), write_rows(tmp_path / "d.jsonl", sort_rows(32))

    def seconds(prompt_length):  # this process's CPU time (one torch thread): the other test worker's load aside
        t0 = time.process_time()
        P.main(P.parse_args(["--model-name-or-path", lm, "--dataset", str(data), "--prompt-length", str(prompt_length),
                             "--response-length", "16", "--rollout-batch-size", "8", "--n", "2",
                             "--ppo-mini-batch-size", "8", "--micro-batch-size", "8", "--num-iterations", "2",
                             "--eval-prompts", "8", "--no-save-model", "--no-cuda", "--torch-threads", "1",
                             "--runs-dir", str(tmp_path / f"r{prompt_length}")]))
        return time.process_time() - t0
    seconds(256)  # (warm: imports, first forwards)
    short, long = seconds(256), seconds(2048)
    assert long < 1.6 * short + 1.0, (short, long)  # padded to the limit, 2048 took ~4.5x as long


def static_decoder_cases(m, tok, rows, R: int):
    """(today's generate, StaticDecoder) tokens for greedy and sampled decoding with and without top-p / top-k, twice
    per setting (the second call reuses the shape's buffers and cache), each pair from equally seeded generators."""
    ids, mask = P.encode_batch(tok, rows, 512)
    dec = P.StaticDecoder(P.rollout_copy(m, torch.float32), capture=False)  # (its attention: packed_gqa_sdpa)
    for greedy, extra in [(True, {}), (False, {}), (False, dict(temperature=0.7, top_p=0.9, top_k=20))]:
        gens = [torch.Generator().manual_seed(3) for _ in range(2)]
        for _ in range(2):
            yield [P.generate(model, ids, mask, R, [tok.eos_token_id], tok.pad_token_id, gen=g, greedy=greedy,
                              check_every=8, **extra) for model, g in zip((m, dec), gens)]


def test_the_static_decoder_gives_the_tokens_of_generate_and_of_hugging_face(tmp_path):
    """The static KV cache path (the CUDA rollout's, here without the graph, on rollout_copy's float32 copy: its packed
    grouped-query attention) token for token: against generate with the same generator on the model itself (Hugging
    Face's sdpa), greedy and sampled, on the built-in tiny Llama and on a random Qwen2 of Qwen2.5's 151,936 rows
    (2 key/value heads for 4 query heads); greedy against Hugging Face's generate. Prompts of several lengths."""
    from transformers import AutoModelForCausalLM

    tok = P.build_char_tokenizer()
    llama = P.disable_dropout(P.build_tiny_model(tok, 0, 64, 2, max_positions=512)).eval()
    qwen = P.disable_dropout(AutoModelForCausalLM.from_pretrained(save_qwen2(tmp_path / "q", tok, vocab=151_936,
                                                                             hidden=32, layers=1))).eval()
    rows = P.make_problems(6, torch.Generator().manual_seed(0)) + sort_rows(2, words=30)  # (up to ~260 characters)
    for m, R in ((llama, 40), (qwen, 12)):
        for want, got in static_decoder_cases(m, tok, rows, R):
            assert torch.equal(want, got), (want, got)
        ids, mask = P.encode_batch(tok, rows, 512)
        hf = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=R, do_sample=False,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
        ours = P.generate(P.StaticDecoder(P.rollout_copy(m, torch.float32), capture=False), ids, mask, R,
                          tok.eos_token_id, tok.pad_token_id, greedy=True)
        hf = hf.masked_fill(~P.response_mask_from(hf, tok.eos_token_id).bool(), tok.pad_token_id)
        assert torch.equal(ours, hf[:, :ours.shape[1]]) and (hf[:, ours.shape[1]:] == tok.pad_token_id).all()
    # a sliding window shorter than prompt + response (the full 4D mask would be wrong there): step by step instead
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=16, max_window_layers=0)).eval()
    dec = P.StaticDecoder(P.rollout_copy(sliding, torch.float32), capture=False)
    ids, mask = P.encode_batch(tok, rows[:4], 512)
    want, got = (P.generate(m, ids, mask, 20, [tok.eos_token_id], tok.pad_token_id, check_every=8,
                            gen=torch.Generator().manual_seed(1)) for m in (sliding, dec))
    assert torch.equal(want, got) and all("sampling" not in s for s in dec.shapes.values())  # (it fell back)
    # the packed attention against Hugging Face's sdpa: one query token, 6 query heads on 2 key/value heads, a mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 6, 1, 8, generator=g), torch.randn(3, 2, 10, 8, generator=g), torch.randn(3, 2, 10, 8,
                                                                                                      generator=g)
    bias = torch.zeros(3, 1, 1, 10).masked_fill(torch.rand(3, 1, 1, 10, generator=g) < 0.3, torch.finfo().min)
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 3, True
    want = sdpa_attention_forward(layer, q, k, v, bias, scaling=0.3)[0]
    assert torch.allclose(P.packed_gqa_sdpa(layer, q, k, v, bias, scaling=0.3)[0], want, atol=1e-6)


def test_the_decoder_refreshes_its_bf16_copy_and_is_only_made_on_cuda(tiny_copy, capsys):
    """rollout_copy: the parameters in bf16 (ties kept), the buffers as they are (the rotary frequencies stay float32:
    in bf16 their angles would be wrong at long positions), the policy untouched; refresh() copies the updated policy
    into the same tensors (the graphs read those); a weight already in the copy's dtype is shared. make_decoder gives
    none on the CPU, with --no-cudagraphs, or under FSDP2 (a note)."""
    tok, m = tiny_copy
    copy = P.rollout_copy(m, torch.bfloat16)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16} and not copy.training
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # (the tiny Llama ties them)
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32 and m.config._attn_implementation == "sdpa"
    dec = P.StaticDecoder(copy, capture=False)
    before = [p.data_ptr() for p in dec.model.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1)
    dec.refresh(m)
    assert [p.data_ptr() for p in dec.model.parameters()] == before
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(dec.model.parameters(), m.parameters()))
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(P.rollout_copy(m, torch.float32).parameters(),
                                                             m.parameters()))
    assert P.make_decoder(P.Args(cuda=False), m, torch.device("cpu"), 1) is None
    assert P.make_decoder(P.Args(cuda=False, cudagraphs=False), m, torch.device("cuda"), 1) is None
    assert P.make_decoder(P.Args(cuda=False), m, torch.device("cuda"), 2) is None
    assert "under FSDP2 the rollout decodes step by step" in capsys.readouterr().out
    assert not P.parse_args(["--no-cudagraphs"]).cudagraphs and P.parse_args([]).cudagraphs


def test_the_decoder_warms_up_twice_then_captures_once_and_replays(tiny, monkeypatch):
    """StaticDecoder's dispatch on the CPU, torch.cuda's streams and graphs stood in for (a "capture" runs the step
    once, a replay nothing; the real ones: tests/test_gpu.py): two warm-up steps, one capture registering the run's
    sampling generator (not for greedy decoding), replays after; a shape seen again replays at once; a capture that
    fails is one line naming --no-cudagraphs."""
    from shared import stand_in_for_cuda_graphs  # (tests/shared.py)

    tok, m = tiny
    events = []
    stand_in_for_cuda_graphs(monkeypatch, events)
    dec = P.StaticDecoder(m)
    monkeypatch.setattr(dec, "decode_step", lambda s: events.append("run"))
    ids, mask = P.encode_batch(tok, P.make_problems(2, torch.Generator().manual_seed(0)), 16)
    gen = torch.Generator().manual_seed(0)
    P.generate(dec, ids, mask, 7, [tok.eos_token_id], tok.pad_token_id, gen=gen)  # (6 steps after the prefill)
    assert events == ["run", "run", ("register", gen), "capture", "run", "captured", *["replay"] * 4]  # (3rd on)
    events.clear()
    P.generate(dec, ids, mask, 7, [tok.eos_token_id], tok.pad_token_id, gen=gen)
    assert events == ["replay"] * 6
    events.clear()
    P.generate(dec, ids, mask, 5, [tok.eos_token_id], tok.pad_token_id, greedy=True)  # (another shape, no draws)
    assert events == ["run", "run", "capture", "run", "captured", "replay", "replay"]

    def fails(s):
        if events and events[-1] == "capture":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(dec, "decode_step", fails)
    with pytest.raises(P.Failure) as e:
        P.generate(dec, ids, mask, 9, [tok.eos_token_id], tok.pad_token_id, greedy=True)
    assert e.value.code == 1 and str(e.value) == (
        "capturing the rollout's decoding step in a CUDA graph failed: RuntimeError: CUDA error: operation not "
        "permitted when stream is capturing (--no-cudagraphs decodes step by step)")


def test_the_captured_decoding_forward_runs_plain_kernels(tiny, monkeypatch):
    """--torch-deterministic (warn-only) is off for the forward of the decoding step while it warms up and is captured,
    compiled or not, restored after; the sampling keeps it (a one-row cumsum runs another kernel without it), as does
    the uncaptured step. The forward computes the same with the plain kernels (tests/test_gpu.py compares the captured
    tokens with those of the uncaptured step) without the deterministic index_copy_'s sort at every layer."""
    from shared import stand_in_for_cuda_graphs  # (tests/shared.py)

    tok, m = tiny
    stand_in_for_cuda_graphs(monkeypatch, [])
    seen, sample = [], P.sample_token

    def mode(what):
        seen.append((what, torch.are_deterministic_algorithms_enabled()))
    monkeypatch.setattr(P, "sample_token", lambda *a, **k: mode("sample") or sample(*a, **k))
    ids, mask = P.encode_batch(tok, P.make_problems(2, torch.Generator().manual_seed(0)), 16)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for flags, plain in ((dict(), True), (dict(capture=False), False), (dict(compile=True), True)):
            dec = P.StaticDecoder(m, **flags)
            dec.step_forward = lambda **kw: mode("forward") or m(**kw)  # (the compiled one: never compiled here)
            for on in (True, False):
                torch.use_deterministic_algorithms(on, warn_only=True)
                seen.clear()
                P.generate(dec, ids, mask, 7, [tok.eos_token_id], tok.pad_token_id, greedy=on)  # (a new shape each)
                steps = 3 if dec.capture else 6  # (captured: two warm-up steps and the capture; replays run nothing)
                want = [("sample", on)] + [("forward", on and not plain), ("sample", on)] * steps  # (prefill first)
                assert seen == want, (flags, on, seen)
                assert torch.are_deterministic_algorithms_enabled() is on
                assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_a_deterministic_run_compiles_the_decoding_step_in_inductors_deterministic_mode(tiny, monkeypatch):
    """--compile: the decoding step's forward runs without deterministic algorithms (plain_kernels), and in a
    deterministic run it is compiled in inductor's own deterministic mode (no benchmarking on the device that could
    change the numerics)."""
    tok, m = tiny
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for on in (True, False):
            torch.use_deterministic_algorithms(on, warn_only=True)
            P.StaticDecoder(m, compile=True)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert calls == [dict(dynamic=False, options={"deterministic": True}), dict(dynamic=False, options=None)]


def test_evaluations_find_their_decoding_shapes_again(tmp_path, monkeypatch):
    """main's evaluations draw from one generator, reseeded alike at each: a StaticDecoder (the CUDA rollout's, here
    without graphs) allocates the rollout's and the evaluation's shapes once (their caches and, on CUDA, graphs) and
    finds them again at every later rollout and evaluation; each evaluation seeds it alike."""
    made, decoders = [], []

    def make_decoder(args, policy, device, world):
        dec = P.StaticDecoder(P.rollout_copy(policy, torch.float32), capture=False)
        buffers = dec.buffers
        monkeypatch.setattr(dec, "buffers", lambda *a: made.append(a) or buffers(*a))
        decoders.append(dec)
        return dec
    monkeypatch.setattr(P, "make_decoder", make_decoder)
    seeds, evaluate = [], P.evaluate
    monkeypatch.setattr(P, "evaluate", lambda *a, **k: seeds.append(a[6].initial_seed()) or evaluate(*a, **k))
    res = P.main(P.parse_args([*TINY, "--runs-dir", str(tmp_path), "--eval-every", "1", "--sft-steps", "0",
                               "--num-iterations", "1"]))
    assert [c[0] for c in res["curve"]] == [0, 1] and len(set(seeds)) == 1  # (2 evaluations around a rollout)
    assert len(made) == len(decoders[0].shapes) == 3  # the rollout's, the greedy and the sampled evaluation's


def test_sampling_draws_from_the_softmax():
    """sample_categorical against counts: 40,000 draws of a 6-token distribution (one token of probability 0, as
    top-k / top-p leave them) fall within 4 standard errors of each probability, and the 0 is never drawn."""
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.07, 0.03])
    draws = P.sample_categorical(probs.expand(40_000, 6), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    se = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert freq[2] == 0 and ((freq - probs.double()).abs() <= 4 * se + 1e-12).all(), freq
    last_zero = torch.tensor([[0.0, 1.0, 0.0]])  # u * total can round to the total: never the zero after it
    assert set(P.sample_categorical(last_zero.expand(1000, 3), torch.Generator().manual_seed(1)).tolist()) == {1}
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert P.sample_token(logits, 1.0, 1.0, 0, torch.Generator().manual_seed(0)).shape == (1,)


def test_a_long_row_is_drawn_in_two_levels_as_one_cumulated_sum_draws_it():
    """Over 151,936 tokens (two levels: blocks, then a token) the draw is the one-level inverse CDF's with the same
    uniform, token for token; zeros (top-k's) are never drawn, in a block of their own or beside a drawn token, nor
    the zeros that pad the last block."""
    def one_level(probs, gen):  # (plainly: the whole row's float64 cumulated sum)
        cdf = probs.double().cumsum(-1)
        u = torch.rand(cdf.shape[:-1] + (1,), generator=gen, dtype=torch.float64) * cdf[..., -1:]
        return torch.minimum(torch.searchsorted(cdf, u, right=True),
                             torch.searchsorted(cdf, cdf[..., -1:].contiguous())).squeeze(-1)
    g = torch.Generator().manual_seed(0)
    V = 151_936
    probs = (torch.randn(64, V, generator=g) * 3).softmax(-1)
    probs[:8, 1:] = 0.0  # all the mass on the first token
    probs[8:16, :-1] = 0.0  # on the last (in the padded block)
    probs[16:32] = torch.zeros(V).index_fill(0, torch.tensor([5, 700, 701, 90_000, V - 2]), 0.2)  # top-5's zeros
    drawn = P.sample_categorical(probs, torch.Generator().manual_seed(1))
    assert torch.equal(drawn, one_level(probs, torch.Generator().manual_seed(1)))
    assert (drawn[:8] == 0).all() and (drawn[8:16] == V - 1).all()
    assert set(P.sample_categorical(probs[16:17].expand(200, V), torch.Generator().manual_seed(2)).tolist()) == {
        5, 700, 701, 90_000, V - 2}
    assert (probs.gather(-1, drawn[:, None]) > 0).all()
    cdf = torch.tensor([[0.2, 0.2, 0.5, 0.5]], dtype=torch.float64)  # (tokens 1 and 3 of probability 0)
    assert [int(P.first_above(cdf, torch.tensor([[u]], dtype=torch.float64))) for u in (0.0, 0.2, 0.3, 0.5, 0.6)] == [
        0, 2, 2, 2, 2]  # (u past the total, as rounding can leave it inside a block: the last token of mass > 0)


def test_a_draw_on_a_block_edge_never_takes_a_token_of_probability_0(monkeypatch):
    """u put (through torch.rand) on each block's lower edge and just under its upper edge, where float64 rounding
    leaves u's place in the block below its first token of mass (these 6 masses, one a block, round so) or past its
    last (a block of 128 masses whose sum exceeds their cumulated sum): always a token of probability > 0, in u's
    block."""
    size, V = 128, 128 * 40  # (5,120 tokens: 40 blocks of 128)

    def edges(probs):  # (the blocks' cumulated sums, as sample_categorical adds them)
        return probs.reshape(-1, size).sum(-1, dtype=torch.float64).cumsum(0)
    g = torch.Generator().manual_seed(0)
    rows = (torch.cat([torch.rand(size, generator=g) * 2.0 ** -torch.randint(0, 40, (size,), generator=g),
                       torch.zeros(V - size)])[None] for _ in range(100))
    sum_past_cumsum = next(r for r in rows if edges(r)[0] > r[0, :size].double().cumsum(0)[-1])

    def draw(probs, u):
        total = float(edges(probs)[-1])
        r = u / total
        while r * total != u:  # (the uniform that makes u exactly)
            r = math.nextafter(r, 1.0 if r * total < u else 0.0)
        monkeypatch.setattr(P.torch, "rand", lambda *a, **k: torch.full((1, 1), r, dtype=torch.float64))
        return int(P.sample_categorical(probs))
    masses = torch.tensor([0.02568100020289421, 4.463063760340447e-06, 5.817729834234342e-05, 0.00800468772649765,
                           2.217356723122066e-06, 3.332536677169706e-11])
    probs = torch.zeros(1, V).index_put_((torch.zeros(6, dtype=torch.long), torch.arange(6) * size + 5), masses)
    cum = edges(probs)[:6].tolist()
    for u in cum[:-1] + [math.nextafter(c, 0.0) for c in cum]:
        token = draw(probs, u)
        assert token % size == 5 and token // size == sum(c <= u for c in cum), (u, token)
    token = draw(sum_past_cumsum, math.nextafter(float(edges(sum_past_cumsum)[0]), 0.0))
    assert token < size and sum_past_cumsum[0, token] > 0, token


# ----- what a user pointing it at a real task needs -------------------------------------------------------------
@pytest.mark.parametrize("kind,base", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl"), ("k1+", "kl"),
                                       ("k2+", "mse"), ("k3+", "low_var_kl")])
def test_verl_kl_names_and_straight_through_forms(kind, base):
    """k1 / k2 / k3 are kl / mse / low_var_kl; a + form has the value of its estimator and the gradient of k2."""
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(4, 5, generator=g) * 3, -torch.rand(4, 5, generator=g) * 3
    x = logp.clone().requires_grad_()
    value = P.kl_penalty(x, ref, kind)
    assert torch.allclose(value, P.kl_penalty(logp, ref, base), atol=1e-6)
    value.sum().backward()
    want = (logp - ref) if kind.endswith("+") or base == "mse" else None  # d/dlogp of 0.5 (logp - ref)^2
    if want is not None:
        assert torch.allclose(x.grad, want, atol=1e-6)
    else:
        y = logp.clone().requires_grad_()
        P.kl_penalty(y, ref, base).sum().backward()
        assert torch.allclose(x.grad, y.grad)
    assert P.parse_args(["--kl-loss-type", kind, "--use-kl-loss"]).kl_loss_type == kind


def test_a_separate_critic_has_its_own_loss_aggregation_and_no_vf_coef(acc_setup):
    m, critic, base, batch = acc_setup
    grads = []
    for vf_coef, mode in ((0.5, "seq-mean-token-sum"), (2.0, "seq-mean-token-sum"), (0.5, None)):
        args = P.Args(**{**vars(base), "vf_coef": vf_coef, "critic_loss_agg_mode": mode})
        m.zero_grad(), critic.zero_grad()
        P.minibatch_backward(m, critic, None, batch, args)
        grads.append([p.grad.clone() for p in critic.parameters() if p.grad is not None])
    # the value loss alone, aggregated as verl's critic.loss_agg_mode, its gradient unscaled
    critic.zero_grad()
    mask = batch["response_mask"]
    v = P.critic_values(critic, batch["input_ids"], batch["attention_mask"], mask.shape[1])
    vl, _ = P.value_loss(v, batch["values"], batch["returns"], mask, base.value_clip, None, "seq-mean-token-sum",
                         n_tokens=mask.sum(), n_seqs=mask.shape[0], norm_len=base.response_length)
    vl.backward()
    want = [p.grad.clone() for p in critic.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(grads[0], want))
    assert all(torch.allclose(a, b) for a, b in zip(grads[0], grads[1]))  # vf_coef: not a separate critic's
    assert any(not torch.allclose(a, b) for a, b in zip(grads[0], grads[2]))  # None: --loss-agg-mode (token-mean)
    m.zero_grad(), critic.zero_grad()


def test_reward_functions_get_the_row_columns_and_several_are_summed_with_weights(tmp_path, capsys):
    (tmp_path / "r.py").write_text(
        "def level(prompt, response, answer, difficulty):\n    return float(difficulty)\n"
        "def anything(prompt, response, answer, **columns):\n    return float(len(columns))\n"
        "def plain(prompt, response, answer):\n    return 1.0 if response == answer else 0.0\n")
    path = str(tmp_path / "r.py")
    fn = P.load_reward_fn(f"{path}:level,{path}:anything, {path}:plain,exact", [2.0, 1.0, 0.5, 0.25])
    assert fn("p", "12", "12", difficulty=3, source="x") == 2.0 * 3 + 1.0 * 2 + 0.5 * 1 + 0.25 * 1
    rows = [{"prompt": "p", "answer": "1", "columns": {"difficulty": 1, "source": "x"}}]
    assert P.rule_scores(fn, rows, ["2"], "f")[0].tolist() == [2.0 + 2.0]
    assert "1 weights for the 2 functions" in one_line_exit(capsys, 2, P.parse_args, ["--reward-fn", f"{path}:plain,exact",
                                                                                      "--reward-weights", "1"])
    # the columns of a data file reach the function (all but the prompt and the answer)
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "12=", "answer": "12", "difficulty": 2, "source": "s"}])
    loaded = P.load_dataset(str(data), P.build_char_tokenizer(), 16)
    assert loaded == [{"prompt": "12=", "answer": "12", "columns": {"difficulty": 2, "source": "s"}}]


def test_trl_option_names_set_our_fields():
    args = P.parse_args(["--num-generations", "2", "--epsilon", "0.3", "--epsilon-high", "0.28", "--num-ppo-epochs",
                         "2", "--warmup-steps", "3", "--max-completion-length", "9", "--learning-rate", "1e-5",
                         "--cliprange-value", "0.3"])
    assert (args.n, args.clip_ratio_low, args.clip_ratio_high, args.ppo_epochs, args.lr_warmup_steps,
            args.response_length, args.lr, args.value_clip) == (2, 0.3, 0.28, 2, 3, 9, 1e-5, 0.3)
    assert P.parse_args(["--cliprange", "0.1"]).clip_ratio_high == 0.1


def test_cublas_workspace_is_set_for_deterministic_cuda(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    P.setup_distributed(P.Args(cuda=False))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert P.setup_distributed(P.Args(cuda=True))[2].type == "cuda"  # (no CUDA call: a device object)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_sampling_generator_saved_on_another_device_type_is_reseeded(tiny_copy, capsys):
    tok, m = tiny_copy
    args = P.Args(cuda=False, critic="none", adv_estimator="grpo", resume="ckpt.pt")
    optimizers, schedulers = P.build_optimizers(args, m, None, None)
    gen, gen_dev = torch.Generator(), torch.Generator()
    cuda_state = torch.zeros(16, dtype=torch.uint8)  # (a CUDA generator's state: seed and offset)
    ckpt = {"optimizer": [o.state_dict() for o in optimizers], "scheduler": [s.state_dict() for s in schedulers],
            "rng": {"torch": torch.get_rng_state(), "gen": gen.get_state(), "gen_dev": [cuda_state]},
            "kl_coef": 0.1, "reward_running": {"mean": 0.0, "var": 1.0, "count": 1.0}, "iteration": 3,
            "global_step": 24, "tracker": {}}
    assert P.restore_trainer_state(ckpt, args, optimizers, schedulers, gen, gen_dev, P.FixedKLController(0.1),
                                   P.RunningMoments(), 0, 1)[0] == 4
    assert "saved on another device type" in capsys.readouterr().out
    state = gen_dev.get_state()
    ckpt["rng"]["gen_dev"] = [state]  # the same device type: restored exactly
    P.restore_trainer_state(ckpt, args, optimizers, schedulers, gen, torch.Generator(), P.FixedKLController(0.1),
                            P.RunningMoments(), 0, 1)
    assert "another device type" not in capsys.readouterr().out


def test_the_throughput_benchmark_writes_its_contract(tmp_path):
    """benchmarks/llm_throughput.py --preset tiny --device cpu --estimators ... --paths ... --out PREFIX: PREFIX.json
    holds the generation side by side with Hugging Face's, per estimator and path the generation / training tokens/s,
    the peak GPU memory (null on the CPU) and the peak process memory, with device, torch and date; PREFIX.md the
    tables (small sizes here, one minibatch of the 8 responses)."""
    out = tmp_path / "llm"
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(SCRIPT), "benchmarks", "llm_throughput.py"),
                          "--preset", "tiny", "--device", "cpu", "--estimators", "grpo", "--paths", "eager",
                          "--iterations", "2", "--vocab-size", "99", "--rollout-batch-size", "4", "--n", "2",
                          "--response-length", "4", "--micro-batch-size", "8", "--minibatches", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "llm.json").read_text())
    row = data["results"]["grpo"]["eager"]
    assert all(row[k] > 0 for k in ("gen_tokens_per_s", "hf_generate_tokens_per_s", "train_tokens_per_s"))
    assert data["decode"]["ours"] > 0 and data["decode"]["hf"] > 0 and 0.1 < row["peak_rss_gib"] < 8
    assert row["peak_gpu_mem_gib"] is None and data["torch"] == torch.__version__ and data["device"] and data["date"]
    assert 1 <= row["response_length_mean"] <= 4
    assert [(r["estimator"], r["path"]) for r in data["rows"]] == [("grpo", "eager")]
    md = (tmp_path / "llm.md").read_text()
    assert "| grpo | eager |" in md and "CPU fp32" in md
