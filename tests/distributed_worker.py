"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2` (gloo, CPU), never collected by pytest.

    python -m torch.distributed.run --nproc-per-node 2 --standalone tests/distributed_worker.py SCRIPT OUT [STRATEGY]

RL scripts: one update step of SCRIPT's loss, the way its main() takes it under torchrun: the agent wrapped in
DistributedDataParallel and called through forward(); rank r scores its half of a fixed batch. Rank 0 writes the
gradients (after DDP's all-reduce) to OUT, for the test to compare with one process on the whole batch.
ppo_llm: each rank passes its half of a rollout to rewards_and_advantages and of a minibatch to minibatch_backward
(policy under FSDP2 or DDP, every loss_agg_mode); rank r writes its advantages and the full gradients to OUT.r.
"""
import importlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

B = 8  # transitions per rank


def make_case(script: str, n: int):
    """(agent, loss_fn) for SCRIPT with an agent initialised from seed 0, and a batch of n transitions (seed 1)."""
    mod = importlib.import_module(script)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if script == "ppo":
        agent, obs = mod.Agent(4, 3), torch.randn(n, 4, generator=g)
        actions = torch.randint(0, 3, (n,), generator=g)
    elif script == "ppo_continuous":
        agent, obs = mod.Agent(5, 2), torch.randn(n, 5, generator=g)
        actions = torch.randn(n, 2, generator=g)
    else:
        agent, obs = mod.Agent(4), torch.randint(0, 256, (n, 4, 84, 84), generator=g).to(torch.uint8)
        actions = torch.randint(0, 4, (n,), generator=g)
    old_logp, adv = -torch.rand(n, generator=g) - 0.5, torch.randn(n, generator=g)
    old_v, ret = torch.randn(n, generator=g), torch.randn(n, generator=g)
    extra = [torch.ones(n)] if script == "ppo_atari_envpool" else []  # the reset-step mask: all steps valid
    # pi_old(.|s) for the KL-penalty variant: log-probs of every action, or a Gaussian's mean and (shared) log std
    if script == "ppo_continuous":
        old_mean, old_logstd = torch.randn(n, 2, generator=g), torch.full((1, 2), -0.3)
    else:
        old_logp_all = torch.log_softmax(torch.randn(n, 3 if script == "ppo" else 4, generator=g), -1)

    def loss_fn(model, idx):
        """The clipped loss plus the KL-penalty variant's (its exact KL comes from forward()'s fifth output)."""
        _, logp, ent, v, dist = model(obs[idx], actions[idx])
        common = (logp, old_logp[idx], adv[idx], v, old_v[idx], ret[idx], ent, *[e[idx] for e in extra])
        kw = dict(clip_coef=0.2, clip_vloss=True, ent_coef=0.01, vf_coef=0.5,
                  norm_adv=False)  # advantages are standardised per rank's minibatch: off here
        clipped, _ = mod.ppo_loss(*common, **kw)
        if script == "ppo_continuous":
            kl = mod.gaussian_kl(old_mean[idx], old_logstd, *dist)
        else:
            kl = mod.categorical_kl(old_logp_all[idx], dist)
        penalised, _ = mod.ppo_loss(*common, **kw, kl_coef=0.5, kl=kl)
        return clipped + penalised

    return agent, loss_fn


# ----- ppo_llm.py ---------------------------------------------------------------------------------------------
LLM_N, LLM_R = 8, 5  # responses (4 prompts x 2) and response length of the global batch
ADV_CASES = {  # name: Args overrides of the reward / advantage step
    "gae_whiten_batchnorm": dict(adv_estimator="gae", whiten_advantages=True, reward_norm="batch"),
    "grpo_groupnorm": dict(adv_estimator="grpo", reward_norm="group"),
    "rloo_running_adaptive_kl": dict(adv_estimator="rloo", reward_norm="running", kl_ctrl_type="adaptive"),
    "reinforce_pp": dict(adv_estimator="reinforce_plus_plus", reward_norm="batch", reward_clip=0.5),  # token clip
    "reinforce_pp_baseline": dict(adv_estimator="reinforce_plus_plus_baseline"),
}
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def llm_args(**kw):
    import ppo_llm

    base = dict(n=2, rollout_batch_size=4, ppo_mini_batch_size=4, micro_batch_size=2, response_length=LLM_R,
                critic="none", adv_estimator="grpo", use_kl_in_reward=True, cuda=False)
    return ppo_llm.Args(**{**base, **kw})


def llm_case():
    """A tiny policy (seed 0) and a global batch of 8 responses with masks of different lengths (seed 1)."""
    import ppo_llm

    tok = ppo_llm.build_char_tokenizer()
    model = ppo_llm.disable_dropout(ppo_llm.build_tiny_model(tok, 0, 128, 2))
    g = torch.Generator().manual_seed(1)
    N, R = LLM_N, LLM_R
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 2, 3])
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    ids = torch.randint(5, 60, (N, 6 + R), generator=g)
    attn = torch.cat([torch.ones(N, 6, dtype=torch.long), mask.long()], 1)
    batch = dict(input_ids=ids, attention_mask=attn, response_mask=mask, old_logp=-torch.rand(N, R, generator=g) - 1,
                 ref_logp=-torch.rand(N, R, generator=g) - 1, advantages=torch.randn(N, R, generator=g) * mask,
                 returns=torch.randn(N, R, generator=g), values=torch.randn(N, R, generator=g))
    rollout = dict(raw=torch.randint(0, 2, (N,), generator=g).float() - 0.3 * torch.rand(N, generator=g),
                   maskf=mask, values=torch.randn(N, R, generator=g) * mask,
                   kld=torch.rand(N, R, generator=g) * 0.1 * mask)
    return model, batch, rollout


def llm_rewards(rollout, rank: int, world: int) -> dict:
    """rewards_and_advantages on this rank's rows for every ADV_CASES entry, with fresh KL controller / moments."""
    import ppo_llm

    B = LLM_N // world
    mine = {k: v[rank * B:(rank + 1) * B] for k, v in rollout.items()}
    out = {}
    for name, kw in ADV_CASES.items():
        args = llm_args(**kw)
        kl = (ppo_llm.AdaptiveKLController(0.1, 0.01, 100) if args.kl_ctrl_type == "adaptive"
              else ppo_llm.FixedKLController(0.1))
        running = ppo_llm.RunningMoments()
        running.update(torch.tensor([0.5, -1.0, 2.0]))  # earlier batches
        adv, ret, scores, seq_kl = ppo_llm.rewards_and_advantages(mine["raw"], mine["maskf"], mine["values"],
                                                                  mine["kld"], args, kl, running, rank, world)
        out[name] = dict(adv=adv, ret=ret, scores=scores, seq_kl=seq_kl, kl_coef=kl.value, running=running.mean)
    return out


def llm_grads(model, batch, mode: str, rank: int, world: int, train_model=None) -> dict:
    """One minibatch_backward (loss_agg_mode `mode`) on this rank's rows; full gradients of every parameter."""
    import ppo_llm

    B = LLM_N // world
    model.zero_grad(set_to_none=True)
    mine = {k: v[rank * B:(rank + 1) * B] for k, v in batch.items()}
    ppo_llm.minibatch_backward(train_model or model, None, None, mine, llm_args(loss_agg_mode=mode), world=world)
    return {k: ppo_llm.full_state(p.grad) for k, p in model.named_parameters()}


def run_llm(strategy: str, out: str):
    import torch.distributed as dist

    import ppo_llm

    rank, world = dist.get_rank(), dist.get_world_size()
    model, batch, rollout = llm_case()
    result = {"rewards": llm_rewards(rollout, rank, world), "grads": {}}
    train_model = ppo_llm.distribute(model, strategy, torch.device("cpu"))
    for mode in AGG_MODES:
        result["grads"][mode] = llm_grads(model, batch, mode, rank, world, train_model)
    torch.save(result, f"{out}.{rank}")


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    script, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if script == "ppo_llm":  # sys.argv[3]: fsdp2 or ddp
        run_llm(sys.argv[3], out)
    else:
        agent, loss_fn = make_case(script, B * world)
        ddp = DistributedDataParallel(agent)  # kept alive until backward: its hooks do the all-reduce
        loss_fn(ddp, torch.arange(rank * B, (rank + 1) * B)).backward()
        if rank == 0:
            torch.save({k: p.grad for k, p in agent.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as the scripts: gloo's threads can abort the interpreter's teardown
