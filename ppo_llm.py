r"""PPO for causal language models (RLHF / RL with verifiable rewards), every algorithm option of verl, ROLL, RLinf.

    python ppo_llm.py                                   # offline, minutes on a CPU: tiny Llama learns to sort digits
    python ppo_llm.py --adv-estimator grpo --critic none --use-kl-loss --kl-loss-type low_var_kl
    python ppo_llm.py --adv-type gae --gae-lambda 0.95 --pg-clip 0.2    # verl / ROLL / RLinf option names work too
    python ppo_llm.py --model-name-or-path DIR --dataset prompts.jsonl --reward-model-path RM_DIR  # GPU if any
    python ppo_llm.py --model-name-or-path DIR --dataset gsm8k.parquet --answer-key reward_model.ground_truth \
        --reward-fn math --prompt-length 512 --response-length 512 --sft-steps 0 --lora-rank 32 --eval-n 8
    python ppo_llm.py --resume runs/<run>/checkpoint.pt
    torchrun --nproc-per-node 2 ppo_llm.py              # FSDP2 (--strategy ddp: DDP); batch sizes are global

Default run: a character tokenizer and a tiny Llama (2.0M parameters) built here, warm-started on "31415=" -> "11345"
until a third to a half of its answers are right, then PPO on the rule "response == sorted digits". A response is the
episode, a token an action. Outline: Args -> task and tokenizer -> models -> generation and scoring -> reward ->
advantages -> losses -> update -> main(), whose loop is the PPO note's steps (docs/reading_guide.md; formulas as verl's
core_algos.py); below main()'s banner, the plumbing.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import fractions
import inspect
import itertools
import json
import math
import numbers
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import types
import typing
import warnings
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.checkpoint import checkpoint

SCRIPT = "ppo_llm.py"
AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KLType = Literal["kl", "abs", "mse", "low_var_kl", "full", "k1", "k2", "k3", "k1+", "k2+", "k3+"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ADV_ESTIMATORS, KL_TYPES, LOSS_AGG_MODES = (typing.get_args(t) for t in (AdvEstimator, KLType, LossAggMode))


@dataclass
class Args:
    # Rollout: prompts, responses per prompt, sampling (verl actor_rollout_ref.rollout, ROLL, RLinf rollout)
    num_iterations: Count = 150  # PPO iterations (rollout + update)
    rollout_batch_size: Annotated[Count, alias("--train-batch-size", "--data.train-batch-size")] = 32
    """prompts per iteration (verl data.train_batch_size, ROLL rollout_batch_size)"""
    n: Annotated[Count, alias("--group-size", "--num-return-sequences-in-group", "--num-generations")] = 4
    """responses per prompt (verl rollout.n); under torchrun write --group-size (torchrun takes --n as its --nnodes)"""
    prompt_length: Annotated[Count, alias("--max-prompt-length")] = 16
    """maximum prompt tokens (longer dataset prompts are dropped and counted); a batch is padded to its longest"""
    response_length: Annotated[Count, alias("--max-response-length", "--max-completion-length")] = 8
    """maximum response tokens (8: the built-in task's five digits + EOS; a real task needs its own, e.g. 512)"""
    temperature: float = 1.0  # sampling temperature; log-probs for training are computed with the same temperature
    top_p: float = 1.0  # nucleus sampling threshold (1: off)
    top_k: Count = 0  # sample among the k most likely tokens (0: off)
    rollout_micro_batch_size: Optional[Count] = None  # generate this many responses at a time (RLinf; None: all)
    logprob_forward_micro_batch_size: Annotated[Optional[Count], alias("--log-prob-micro-batch-size-per-gpu")] = None
    """responses per no-grad scoring forward (RLinf; None: --micro-batch-size, so the first ratio is exactly 1)"""

    # Reward: the rule (verl custom_reward_function, TRL reward_funcs), normalisation, clipping (ROLL), no-EOS penalty
    reward_fn: Annotated[Optional[str], alias("--reward-funcs")] = None
    """exact, math or FILE.py:NAME(prompt, response, answer, **columns); a,b: weighted sum; None: exact or RM alone"""
    reward_weights: Optional[list[float]] = None  # weights of the --reward-fn functions in their sum (None: 1 each)
    reward_norm: Literal["none", "batch", "group", "running", "null"] = "none"  # score normalisation (ROLL; null: none)
    reward_shift: bool = False  # reward_norm subtracts the mean (given alone: without dividing by the std)
    reward_scale: bool = False  # reward_norm divides by the std (given alone: without subtracting the mean)
    reward_clip: Optional[float] = None  # clip normalised scores and KL-penalised token rewards to [-c, c] (ROLL)
    missing_eos_penalty: float = 0.0  # subtracted from the score of a response that hits response_length without EOS

    # Advantages (verl algorithm.adv_estimator, ROLL adv_estimator, RLinf adv_type)
    adv_estimator: Annotated[AdvEstimator, alias("--adv-type")] = "gae"  # advantage estimator
    gamma: float = 1.0  # discount factor over response tokens
    lam: Annotated[float, alias("--lambd", "--gae-lambda")] = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # grpo: divide by the group's std (off: Dr. GRPO)
    whiten_advantages: Annotated[bool, alias("--normalize-advantages")] = True
    """whiten (A - mean)/std over the batch's response tokens (gae, reinforce; grpo/rloo only when given, as ROLL)"""
    advantage_clip: Optional[float] = None  # clip advantages to [-c, c]

    # KL to the reference policy: a penalty in the reward (fixed or adaptive coefficient) and / or a loss
    use_kl_in_reward: Annotated[bool, alias("--add-token-level-kl")] = True
    """token reward -= kl_coef * kl(logp, ref_logp); off when --use-kl-loss is given alone (verl: one or the other)"""
    kl_penalty: KLType = "kl"  # KL estimator in the reward (k1 = kl, k2 = mse, k3 = low_var_kl; +: k2's gradient)
    kl_ctrl_type: Annotated[Literal["fixed", "adaptive"], alias("--kl-ctrl.type")] = "fixed"  # in-reward KL coefficient
    init_kl_coef: Annotated[float, alias("--kl-ctrl.kl-coef", "--kl-coef")] = 0.001  # (initial) in-reward KL coef
    target_kl: Annotated[Optional[float], alias("--kl-ctrl.target-kl")] = 0.1
    """adaptive controller's target sequence KL; a number given alone selects adaptive, None (ROLL's ~) fixed"""
    kl_horizon: Annotated[Count, alias("--kl-ctrl.horizon")] = 10000  # adaptive controller: horizon in samples
    use_kl_loss: bool = False  # add kl_loss_coef * kl(logp, ref_logp) to the actor loss (GRPO style)
    kl_loss_coef: float = 0.001  # coefficient of the KL loss
    kl_loss_type: KLType = "low_var_kl"  # KL estimator of the KL loss (k3+: k3's value, k2's unbiased gradient)

    # Policy loss (verl compute_policy_loss, agg_loss)
    clip_ratio: Annotated[Optional[float], alias("--pg-clip", "--epsilon", "--cliprange")] = None
    """sets clip_ratio_low and clip_ratio_high where those are not given (verl clip_ratio, ROLL pg_clip)"""
    clip_ratio_low: float = 0.2  # ratio lower clip: 1 - clip_ratio_low
    clip_ratio_high: Annotated[float, alias("--epsilon-high")] = 0.2  # ratio upper clip: 1 + clip_ratio_high
    dual_clip_loss: bool = True  # dual-clip PPO: for A < 0 the loss is at most -A * clip_ratio_c
    clip_ratio_c: float = 3.0  # dual-clip bound (> 1)
    loss_agg_mode: Annotated[LossAggMode, alias("--loss-agg-func")] = "token-mean"  # how token losses become one number
    entropy_coeff: Annotated[float, alias("--entropy-bonus")] = 0.0  # entropy bonus coefficient

    # Value model and value loss (verl critic, verl compute_value_loss, RLinf critic.use_critic_model / loss_type)
    critic: Literal["separate", "shared", "none"] = "separate"  # value model: own trunk, a head on the policy's, none
    use_critic_model: Annotated[Optional[bool], alias("--critic.use-critic-model")] = None
    """RLinf critic.use_critic_model: True = --critic separate, False = --critic shared (None: --critic decides)"""
    loss_type: Optional[Literal["actor_critic", "actor"]] = None  # RLinf: actor_critic=--critic shared, actor=separate
    value_clip: Annotated[Optional[float], alias("--cliprange-value")] = 0.5  # clip value to old value +- c (None: off)
    huber_delta: Optional[float] = None  # Huber loss with this delta instead of 0.5 * squared error (RLinf)
    vf_coef: float = 0.5  # value loss coefficient of --critic shared; a separate critic's loss is its own, unscaled
    critic_loss_agg_mode: Annotated[Optional[LossAggMode], alias("--critic.loss-agg-mode")] = None
    """how the value loss's token losses become one number (verl critic.loss_agg_mode; None: --loss-agg-mode)"""
    critic_warmup: Count = 0  # first N iterations update only the critic

    # Optimisation: epochs, minibatches of prompt groups, micro-batch accumulation, AdamW
    ppo_epochs: Annotated[Count, alias("--num-ppo-epochs")] = 1  # epochs over each rollout
    ppo_mini_batch_size: Count = 8  # prompts per minibatch (each brings its n responses), as in verl
    micro_batch_size: Annotated[Count, alias("--ppo-micro-batch-size-per-gpu")] = 16
    """responses per forward/backward, accumulated; unless given, the largest size <= 16 that divides a minibatch"""
    lr: Annotated[float, alias("--learning-rate")] = 5e-5  # actor AdamW lr: the built-in 2M model's; verl's is 1e-6
    critic_lr: float = 2.5e-4  # critic (or shared value head) AdamW lr: the built-in 2M model's; verl's is 1e-5
    lr_warmup_steps: Annotated[Count, alias("--warmup-steps")] = 5  # linear lr warm-up over N optimizer steps
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: Annotated[float, alias("--grad-clip")] = 1.0  # gradient norm clip of actor and critic

    # Task and models: policy, reward model, data, supervised warm start
    model_name_or_path: Optional[str] = None  # local Hugging Face causal LM + tokenizer dir (None: a tiny Llama)
    tiny_hidden_size: Count = 256  # hidden size of the built-in tiny Llama (4 attention heads, MLP 2x wider)
    tiny_num_layers: Count = 3  # decoder layers of the tiny Llama built without --model-name-or-path
    trust_remote_code: bool = False  # allow custom model code from --model-name-or-path / --reward-model-path
    reward_model_path: Optional[str] = None  # local sequence-classifier, 1 label; with --reward-fn: their sum (TRL)
    dataset: Annotated[Optional[str], alias("--train-files", "--data.train-files")] = None
    """.jsonl, .json or .parquet file of prompts (+ answers), read by Hugging Face datasets (None: digit sorting)"""
    eval_dataset: Annotated[Optional[str], alias("--val-files", "--data.val-files")] = None
    """held-out rows with answers to evaluate on, same formats (verl data.val_files; None: first --dataset rows)"""
    prompt_key: Annotated[str, alias("--data.prompt-key")] = "prompt"  # column of the prompt: text or chat messages
    answer_key: str = "answer"  # column of the answer; a.b reaches into nested columns (reward_model.ground_truth)
    apply_chat_template: bool = False  # each prompt as a user turn of the chat template; off: plain text (+ BOS)
    lora_rank: Annotated[Count, alias("--lora-r")] = 0
    """LoRA adapters of this rank on the policy (peft; 0: none). A warm start (--sft-steps) trains every parameter"""
    lora_alpha: float = 16.0  # LoRA scaling alpha (the update is alpha / rank * B A)
    lora_target_modules: Annotated[str, alias("--target-modules")] = "all-linear"
    """modules that get adapters: all-linear (every linear layer but the output) or names, comma-separated"""
    critic_lora: bool = False  # --critic separate: LoRA (and the value head in full) on the critic too (off: full)
    sft_steps: Optional[Count] = None  # warm-start steps (None: 60 on the built-in task, 0 on a user's model/data)
    sft_lr: float = 2.5e-4  # warm-start learning rate (the default 2M model learns worse, not faster, from 1e-3 and up)
    sft_batch_size: Count = 64  # warm-start batch size

    # Evaluation
    eval_prompts: Count = 256  # held-out prompts scored greedily and sampled (0: off)
    eval_every: Count = 15  # evaluate every N iterations, after the last, before the first unless the run is resumed
    eval_n: Count = 0  # also sample n per held-out prompt at --eval-temperature: eval/pass@1, pass@k (0: off)
    eval_temperature: float = 1.0  # sampling temperature of the --eval-n samples (top-p / top-k as the rollout's)

    # Run: seed, device and precision, speed paths, logging, checkpoints
    exp_name: str = "ppo_llm"  # name of this experiment (part of the run name)
    seed: Count = 1  # seed of the experiment (python and torch: tasks, sampling, shuffling, initialisation)
    torch_deterministic: bool = True  # deterministic torch algorithms (torch.use_deterministic_algorithms, warn-only)
    cuda: bool = dataclasses.field(default_factory=lambda: gpu_for_each_process())
    """run on CUDA (bf16 autocast unless --precision fp32): the default where torch sees a GPU for each local process"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # bf16 autocast (fp32 weights) or fp32; auto: bf16 on CUDA
    compile: bool = False  # torch.compile the blocks' parts of policy and critic (and the rollout's CUDA decode step)
    cudagraphs: bool = True
    """CUDA: the rollout decodes from a (bf16) copy of the policy with a static KV cache, each step one CUDA graph"""
    strategy: Literal["fsdp2", "ddp"] = "fsdp2"  # under torchrun: FSDP2 shards the models, DDP replicates them
    gradient_checkpointing: Annotated[bool, alias("--enable-gradient-checkpointing")] = False  # recompute activations
    torch_threads: Count = 2  # torch CPU threads (2 suits the default 2M model; 1 models of a few 100k parameters)
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works without network)
    wandb_project_name: str = "ppo-reference"  # wandb project name
    wandb_entity: Optional[str] = None  # wandb entity (team)
    save_model: bool = True  # at the end write checkpoint.pt and save_pretrained dirs checkpoint-<iteration>/
    checkpoint_every: Count = 0  # also write the checkpoint every N iterations (0: only at the end with --save-model)
    resume: Optional[str] = None  # continue from this checkpoint.pt; flags not given take the checkpoint's values
    stop_after: Count = 0  # stop after N iterations with a checkpoint (0: run to the end); --resume continues
    runs_dir: str = "runs"  # directory that holds the runs


# --- Task and tokenizer: synthetic digit sorting or a JSONL dataset, prompts as token ids ----------------------------
def build_char_tokenizer():
    """A real Hugging Face tokenizer (save_pretrained / AutoTokenizer work): one token per printable ASCII char."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def make_problems(count: int, gen: torch.Generator, exclude=frozenset(), distinct: bool = False,
                  fits=None) -> list[dict]:
    """Sort five digits: "31415=" -> "11345"; one in `exclude`, drawn before (`distinct`) or not `fits`: redrawn."""
    def prompt(digits):
        return "".join(map(str, digits)) + "="
    taken, rows = set(exclude), []
    for d in torch.randint(0, 10, (count, 5), generator=gen).tolist():
        while prompt(d) in taken or (fits is not None and not fits(prompt(d))):
            d = torch.randint(0, 10, (5,), generator=gen).tolist()
        rows.append({"prompt": prompt(d), "answer": "".join(map(str, sorted(d)))})
        if distinct:
            taken.add(rows[-1]["prompt"])
    return rows


def prompt_token_ids(tok, prompt, chat: bool = False) -> list[int]:
    """A prompt's ids with the tokenizer's special tokens (no trailing EOS); chat messages via the chat template."""
    if chat or not isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)  # (the template writes BOS itself where it wants one)
    ids = tok.encode(prompt)
    return ids[:-1] if len(ids) > 1 and ids[-1] == tok.eos_token_id else ids


def encode_batch(tok, rows: list[dict], prompt_length: int, chat: bool = False):
    """Prompts left-padded to the longest of these rows (a prompt over prompt_length: its last tokens)."""
    return left_pad([prompt_token_ids(tok, r["prompt"], chat)[-prompt_length:] for r in rows], tok.pad_token_id)


def build_task(args: Args, tok, gen: torch.Generator, world: int = 1):
    """(sample_rows(k), held-out rows with answers, whether all rows have answers): --dataset or the synthetic task."""
    def n_tokens(prompt):
        return len(prompt_token_ids(tok, prompt, args.apply_chat_template))
    keys = {"prompt_key": args.prompt_key, "answer_key": args.answer_key}
    if args.dataset is not None:
        data = load_dataset(args.dataset, tok, args.prompt_length, args.apply_chat_template, **keys)

        def sample_rows(k):
            return [data[i] for i in torch.randint(0, len(data), (k,), generator=gen).tolist()]
        eval_rows = [r for r in data if r["answer"] is not None][:args.eval_prompts]
        has_answers = all(r["answer"] is not None for r in data)
        if args.reward_fn in REWARD_RULES and not any(r["answer"] is not None for r in data):  # (given by name)
            raise Failure(f"--reward-fn {args.reward_fn} scores responses against answers: no row of --dataset "
                          f"{args.dataset} has {args.answer_key!r} (--answer-key)")
        if args.reward_model_path is None and not has_answers and (args.reward_fn or "exact") in REWARD_RULES:
            raise Failure(f"--dataset {args.dataset}: rows without {args.answer_key!r} need --reward-model-path (or a "
                          "--reward-fn FILE.py:NAME that needs no answer)")
    else:
        eval_rows = make_problems(args.eval_prompts, torch.Generator().manual_seed(10_000 + args.seed), distinct=True)
        held_out = frozenset(r["prompt"] for r in eval_rows)
        # A tokenizer that merges digits gives some prompts more tokens: checked are every held-out prompt, 256 others
        # and all 2,002 answers (+ EOS); a training prompt still cut is redrawn (never with the built-in tokenizer)
        probe = make_problems(256, torch.Generator().manual_seed(20_000 + args.seed), distinct=True)
        prompt = max((r["prompt"] for r in probe + eval_rows), key=n_tokens)
        answers = ["".join(c) for c in itertools.combinations_with_replacement("0123456789", 5)]
        answer = max(answers, key=lambda a: len(tok.encode(a, add_special_tokens=False)))
        need = (n_tokens(prompt), len(tok.encode(answer, add_special_tokens=False)))
        if need[0] > args.prompt_length or need[1] + 1 > args.response_length:
            raise Failure(f"the synthetic task's prompts take up to {need[0]} tokens ({prompt!r}) and its answers "
                          f"up to {need[1]} ({answer!r}) plus EOS: --prompt-length {args.prompt_length} / "
                          f"--response-length {args.response_length} cut them")

        def sample_rows(k):
            return make_problems(k, gen, exclude=held_out, fits=lambda p: n_tokens(p) <= args.prompt_length)
        has_answers = True
    if args.eval_dataset is not None:
        eval_rows = load_dataset(args.eval_dataset, tok, args.prompt_length, args.apply_chat_template,
                                 "--eval-dataset", **keys)
        if any(r["answer"] is None for r in eval_rows):
            raise Failure(f"--eval-dataset {args.eval_dataset}: every row needs {args.answer_key!r} (accuracy is the "
                          "--reward-fn rule's)")
        eval_rows = eval_rows[:args.eval_prompts]
    elif args.dataset is not None and args.eval_prompts:
        print("note: evaluating on the first --eval-prompts rows of --dataset, which training also samples; "
              "--eval-dataset FILE holds prompts out" if eval_rows else "note: no evaluation: no row of --dataset "
              f"has an {args.answer_key!r} (accuracy is the --reward-fn rule's); --eval-dataset FILE with answers "
              "adds one")
    return sample_rows, eval_rows[:len(eval_rows) - len(eval_rows) % world], has_answers


DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension -> datasets' builder


def read_rows(path: str, flag: str) -> list[dict]:
    """Every row of a local data file via Hugging Face datasets, offline, its cache removed; a UTF-8 BOM is allowed."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(var, "1")
    import datasets

    kind, verbosity = DATA_FORMATS[os.path.splitext(path)[1].lower()], datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # (its log of a failed read: the one line below)
    try:
        with tempfile.TemporaryDirectory(prefix="ppo_llm_data_") as cache:
            data = datasets.load_dataset(kind, data_files=path, split="train", cache_dir=cache, keep_in_memory=True,
                                         **({"encoding": "utf-8-sig"} if kind == "json" else {}))
            return data.to_list()
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the file is bad input
        with open(path, "rb") as f:
            if kind == "json" and not f.read().removeprefix(b"\xef\xbb\xbf").strip():
                raise Failure(f"{flag} {path}: empty (no rows)")
        raise Failure(f"{flag} {path}: cannot read it as {kind} ({reason(exception_chain(e)[-1])})")
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_dataset(path: str, tok, prompt_length: int, chat: bool = False, flag: str = "--dataset",
                 prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict]:
    """Rows {"prompt" (text or chat messages), "answer" (text or None), "columns" (the others)}; a key may be a dotted
    path into nested columns (reward_model.ground_truth). Prompts longer than prompt_length are dropped with a note."""
    def column(row, key):
        if key in row:
            return row[key]
        for part in key.split("."):
            row = row.get(part) if isinstance(row, dict) else None
        return row

    def where(i):  # a .jsonl row by its line (the reader skips blank lines), others by their number
        if not path.lower().endswith(".jsonl"):
            return f"row {i + 1}"
        with open(path, encoding="utf-8-sig") as f:
            return f"line {[n for n, line in enumerate(f, 1) if line.strip()][i]}"
    table, rows = read_rows(path, flag), []
    for key, name, default in ((prompt_key, "--prompt-key", None), (answer_key, "--answer-key", Args.answer_key)):
        if table and key != default and all(column(r, key) is None for r in table):  # (a mistyped key, say)
            raise Failure(f"{flag} {path}: no column {key!r} ({name}); its columns: "
                          f"{', '.join(column_names(table[0]))}")
    for i, row in enumerate(table):
        prompt, answer = column(row, prompt_key), column(row, answer_key)
        if isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            if not tok.chat_template:
                raise Failure(f"{flag} {path}: its prompts are chat messages, but the policy's tokenizer has no chat "
                              "template")
        elif not isinstance(prompt, str):
            raise Failure(f"{flag} {path} {where(i)}: {prompt_key!r} is {prompt!r:.40}, neither text nor a list of "
                          "chat messages {'role', 'content'}")
        elif not prompt:
            raise Failure(f"{flag} {path} {where(i)}: empty prompt")
        columns = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, "prompt", "response", "answer")}
        rows.append({"prompt": prompt, "answer": answer_text(answer), "columns": columns})
    if not rows:
        raise Failure(f"{flag} {path}: empty (no rows)")
    kept = [r for r in rows if len(prompt_token_ids(tok, r["prompt"], chat)) <= prompt_length]
    if len(kept) < len(rows):
        print(f"note: dropped {len(rows) - len(kept)} of {len(rows)} prompts longer than --prompt-length {prompt_length}")
    if not kept:
        raise Failure(f"{flag} {path}: no prompt fits --prompt-length {prompt_length}")
    return kept


def column_names(row: dict, prefix: str = "") -> list[str]:  # nested ones by their dotted path, as keys reach them
    return [name for key, value in row.items() for name in (column_names(value, f"{prefix}{key}.")
                                                            if isinstance(value, dict) and value else [prefix + key])]


def answer_text(value) -> Optional[str]:
    """Text as it is; a number as text, whole floats as integers (datasets reads 72 in a column with 2.5 as 72.0)."""
    if value is None or isinstance(value, str):
        return value
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# --- Models: policy, frozen reference (a copy, or the policy with its LoRA adapters off), critic ---------------------
def build_tiny_model(tok, seed: int, hidden_size: int, num_layers: int, max_positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))


def stop_token_ids(tok, model) -> list[int]:
    """The ids that end a response, as HF generate: the tokenizer's EOS, then the generation config's (<|im_end|>)."""
    ids = [tok.eos_token_id]
    extra = getattr(getattr(getattr(model, "module", model), "generation_config", None), "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if isinstance(i, int) and 0 <= i < len(tok) and i not in ids:
            ids.append(i)
    return ids


def disable_dropout(model: nn.Module) -> nn.Module:
    """RLHF detail: dropout off, so that the log-probs of rollout and update agree (ratio exactly 1 at first)."""
    # nn.Dropout modules, float attributes such as HF attention's `attention_dropout`, and the config (later copies)
    for holder in [*model.modules(), *([model.config] if hasattr(model, "config") else [])]:
        if isinstance(holder, nn.Dropout):
            holder.p = 0.0
        for name, value in list(vars(holder).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(holder, name, 0.0)
    return model


def build_policy(args: Args, ckpt: Optional[dict], device):
    """Tokenizer, policy, stop tokens and (on resume) the reference; with --lora-rank the policy is the base model."""
    from transformers import AutoModelForCausalLM

    def causal_lm(path):
        return load_pretrained("a causal LM", path, AutoModelForCausalLM.from_pretrained, args.trust_remote_code,
                               dtype=torch.float32)
    ref = None
    if ckpt is not None:
        tok = load_tokenizer(saved_model_dir(args, ckpt, "policy"), args.trust_remote_code)
        if kl_reads_reference(args) and not args.lora_rank and not ckpt["model"]["ref"]:
            raise Failure(f"--resume {args.resume}: the run had no KL term, so its checkpoint holds no reference model")
        policy = causal_lm(saved_model_dir(args, ckpt, "ref" if args.lora_rank else "policy"))
        if kl_reads_reference(args) and not args.lora_rank:
            ref = causal_lm(saved_model_dir(args, ckpt, "ref"))
    elif args.model_name_or_path:
        tok = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
        policy = causal_lm(args.model_name_or_path)
    else:
        tok = build_char_tokenizer()
        policy = build_tiny_model(tok, args.seed, args.tiny_hidden_size, args.tiny_num_layers,
                                  max(64, args.prompt_length + args.response_length))
    check_positions(policy, args.prompt_length + args.response_length, args.model_name_or_path or "the model")
    stops = stop_token_ids(tok, policy)
    if len(stops) > 1:
        print(f"note: responses end at the tokenizer's EOS {tok.eos_token!r} and at "
              f"{tok.convert_ids_to_tokens(stops[1:])} (the model's generation config)")
    if args.apply_chat_template and not tok.chat_template:
        raise Failure(f"--apply-chat-template: the tokenizer of {args.model_name_or_path or 'the built-in model'} has "
                      "no chat template")
    check_models(args, policy, ckpt)  # (what build_critic and reference_policy will make of it: before anything)
    policy = disable_dropout(policy).to(device)
    print(f"policy: {type(policy).__name__}, {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters")
    return tok, policy, ref, stops


def value_model(config):
    """A token-classification model of the policy's class with one label, the value: a separate critic's, untrained."""
    from transformers import AutoModelForTokenClassification
    cfg = copy.deepcopy(config)
    cfg.num_labels = 1
    try:
        return AutoModelForTokenClassification.from_config(cfg)
    except ValueError as e:
        raise Failure(f"--critic separate: no token-classification class for {cfg.model_type} ({reason(e)}); use "
                      "--critic shared")


def make_critic(policy):
    """Separate critic (verl/RLinf): its own copy of the policy trunk with a token-classification value head."""
    critic = value_model(policy.config)
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    head = [m for m in critic.modules() if isinstance(m, nn.Linear)][-1]
    nn.init.zeros_(head.weight)  # V = 0 at the start; the critic learns the task's reward scale from scratch
    if head.bias is not None:
        nn.init.zeros_(head.bias)
    return disable_dropout(critic)


def build_critic(args: Args, policy, ckpt: Optional[dict], device):
    """(critic, value_head): a separate critic (its own trunk) or a value head on the policy's trunk."""
    from transformers import AutoModelForTokenClassification
    critic, value_head, saved = None, None, saved_model_dir(args, ckpt, "critic")
    if args.critic == "separate":
        if args.critic_lora:  # the policy's trunk as PPO starts (on resume: ref/) + new or saved LoRA adapters
            critic = frozen_in_bf16(with_lora(make_critic(policy), args, "TOKEN_CLS", saved), args)
        else:
            critic = make_critic(policy) if ckpt is None else load_pretrained(
                "a critic", saved, AutoModelForTokenClassification.from_pretrained, args.trust_remote_code)
        critic = disable_dropout(critic).to(device)
    elif args.critic == "shared":
        value_head = nn.Linear(policy.config.hidden_size, 1).to(device)
        nn.init.zeros_(value_head.weight), nn.init.zeros_(value_head.bias)
        if ckpt is not None:
            with checkpoint_fits(args.resume):
                value_head.load_state_dict(ckpt["model"]["value_head"])
    return critic, value_head


def kl_reads_reference(args: Args) -> bool:  # whether a KL term reads the reference (else it is not built)
    return args.use_kl_in_reward or args.use_kl_loss


def reference_policy(args: Args, policy, ref, ckpt: Optional[dict], device):
    """(policy, frozen reference or None): a copy of the policy as PPO starts, or with LoRA it with adapters off."""
    if not args.lora_rank:
        if not kl_reads_reference(args):
            return policy, None
        ref = disable_dropout(copy.deepcopy(policy) if ref is None else ref).eval().requires_grad_(False)
        return policy, frozen_in_bf16(ref, args).to(device)
    policy = disable_dropout(with_lora(policy, args, "CAUSAL_LM", saved_model_dir(args, ckpt, "policy"))).to(device)
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    print(f"LoRA: rank {args.lora_rank}, alpha {args.lora_alpha:g} on {args.lora_target_modules}: "
          f"{trained / 1e6:.3f}M trained parameters")
    return frozen_in_bf16(policy, args), AdaptersOff(policy) if kl_reads_reference(args) else None


def frozen_in_bf16(model, args: Args):
    """A bf16 run: the parameters not trained stored in bf16, as autocast would cast them at every forward."""
    for p in model.parameters() if use_bf16(args) else ():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    return model


class AdaptersOff(nn.Module):
    """--lora-rank's reference: the policy's forward with its adapters off; no parameters of its own, no second copy."""
    def __init__(self, policy):
        super().__init__()
        self.__dict__["policy"] = policy

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def with_lora(model, args: Args, task_type: str, saved: Optional[str] = None):
    """LoRA adapters (dropout 0), new (B = 0: the same function) or `saved`; a critic's value head trains in full."""
    from peft import LoraConfig, PeftModel, get_peft_model
    head = ["classifier", "score"] if task_type == "TOKEN_CLS" else None
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                        target_modules=lora_targets(args), exclude_modules=head, task_type=task_type)
    with warnings.catch_warnings():  # (peft asks transformers' deprecated is_gradient_checkpointing)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if saved is not None:
            return load_pretrained("LoRA adapters", saved, lambda path, trust_remote_code: PeftModel.from_pretrained(
                model, path, is_trainable=True), args.trust_remote_code)
        try:
            return get_peft_model(model, config)
        except Exception as e:  # noqa: BLE001 - modules peft cannot adapt, say: bad input
            raise Failure(f"--lora-target-modules {args.lora_target_modules}: no LoRA adapters on the "
                          f"{'critic' if head else 'policy'} ({reason(e)})")


def lora_targets(args: Args):
    return "all-linear" if args.lora_target_modules == "all-linear" else [
        t.strip() for t in args.lora_target_modules.split(",") if t.strip()]


# --- Generation and scoring: left-padded prompts, KV-cache sampling, log-probs recomputed with the same temperature ---
@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, max_new_tokens: int, eos_id, pad_id: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, gen=None, greedy: bool = False, all_done=None, bf16: bool = False,
             check_every: Optional[int] = None):
    """KV-cache sampling until every row stops (all_done: every rank, FSDP2): (B, L) tokens, pad after the stop."""
    if isinstance(model, StaticDecoder):  # CUDA: the same sampling from a static KV cache, each step a CUDA graph
        return model.generate(prompt_ids, prompt_mask, max_new_tokens, eos_id, pad_id, temperature, top_p, top_k, gen,
                              greedy, check_every or 8)
    B, device = prompt_ids.shape[0], prompt_ids.device
    check_every = check_every or (1 if device.type == "cpu" else 8)  # (asking "all done?" is a host sync on a GPU)
    stop_ids = torch.as_tensor(eos_id, device=device)  # (on the device once, not once a token)
    was_training = model.training
    model.eval()  # KV cache on (HF turns it off in training mode under gradient checkpointing)
    mask = F.pad(prompt_mask, (0, max_new_tokens), value=1)  # (the response columns, as the steps reach them)
    P, pos = prompt_ids.shape[1], position_ids_from(prompt_mask)
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    # bf16 autocast as in scoring and training (the log-probs used in the loss are recomputed there); --compile's
    # parts eager (each block's attention writes its own slot of the cache: one compiled code would not serve all)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), torch.compiler.set_stance("force_eager"):
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos, use_cache=True,
                    logits_to_keep=1)
        next_pos = pos[:, -1:] + 1
        for t in range(max_new_tokens):
            tok = sample_token(out.logits[:, -1], temperature, top_p, top_k, gen, greedy)
            tokens[:, t] = tok.masked_fill(done, pad_id)
            done |= is_stop(tokens[:, t], stop_ids)
            if t + 1 == max_new_tokens or (t + 1) % check_every == 0 and (
                    bool(done.all()) if all_done is None else all_done(done)):
                break
            out = model(input_ids=tokens[:, t:t + 1], attention_mask=mask[:, :P + t + 1], position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
            next_pos = next_pos + 1
    model.train(was_training)
    tokens = tokens[:, :t + 1]  # then cut after the column where the longest response ends
    length = response_mask_from(tokens, eos_id).sum(-1).max() if tokens.numel() else 0
    return tokens[:, :max(int(length), 1)]


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen, greedy: bool = False):
    if greedy:
        return logits.argmax(-1)
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature  # (x / 1 is x: one kernel less)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return sample_categorical(logits.softmax(-1), gen)


def sample_categorical(probs: torch.Tensor, gen=None) -> torch.Tensor:
    """One index per row drawn from probs (B, V) by inverse CDF in float64: multinomial's law, cheaper over 10^5
    tokens. A row of more than 4,096 tokens is drawn in two levels, the block of about sqrt(V) tokens where the
    cumulated sum passes u, then the token inside it: the draw of one cumulated sum of the row, which a GPU scans
    slowly in float64 (8% of a 0.5B decoding step's kernel time at 151,936 tokens)."""
    V = probs.shape[-1]
    if V <= 4096:
        cdf = probs.double().cumsum(-1)
        u = torch.rand(cdf.shape[:-1] + (1,), generator=gen, device=probs.device, dtype=torch.float64) * cdf[..., -1:]
        return first_above(cdf, u).squeeze(-1)
    size = 1 << math.ceil(math.log2(V) / 2)
    blocks = F.pad(probs, (0, -V % size)).unflatten(-1, (-1, size))  # (B, V / size, size), zeros after V
    sums = blocks.sum(-1, dtype=torch.float64)
    cdf = sums.cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=gen, device=probs.device, dtype=torch.float64) * cdf[..., -1:]
    j = first_above(cdf, u)  # the block, then u's place inside it (never below 0: rounding)
    inner = blocks.gather(-2, j[..., None].expand(*j.shape, size)).squeeze(-2).double().cumsum(-1)
    i = first_above(inner, (u - cdf.gather(-1, j) + sums.gather(-1, j)).clamp(min=0))
    return (j * size + i).squeeze(-1)


def first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cdf exceeds u, at most the last of probability > 0 (rounding can leave u past the end)."""
    last = torch.searchsorted(cdf, cdf[..., -1:].contiguous())
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last)


def is_stop(tokens: torch.Tensor, stops) -> torch.Tensor:
    return (tokens[..., None] == torch.as_tensor(stops, device=tokens.device).reshape(-1)).any(-1)


def response_mask_from(responses: torch.Tensor, stops) -> torch.Tensor:
    """1 for response tokens up to and including the first stop token (EOS; one id or a list), 0 after it."""
    is_eos = is_stop(responses, stops).long()
    return ((is_eos.cumsum(-1) - is_eos) == 0).long()


def decode_responses(tok, responses: torch.Tensor, stops=None) -> list[str]:
    """Text before the first stop token; special tokens inside stay ("1<pad>2" is not scored as "12")."""
    stops = tok.eos_token_id if stops is None else stops
    keep = response_mask_from(responses, stops).bool() & ~is_stop(responses, stops)
    return [tok.decode(r[k].tolist(), skip_special_tokens=False) for r, k in zip(responses, keep)]


def left_pad(seqs: list[list[int]], pad_id: int, length: Optional[int] = None):
    length = length or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s):], mask[i, length - len(s):] = torch.tensor(s), 1
    return ids, mask


def position_ids_from(mask: torch.Tensor) -> torch.Tensor:
    """RLHF detail: with left padding the first real token is position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def sample_responses(policy, tok, rows: list[dict], args: Args, stops, gen, device, all_done=None, world: int = 1,
                     decoder=None):
    """The rollout, in chunks of --rollout-micro-batch-size: responses (B, R), [prompt | response] ids and mask; a
    StaticDecoder (CUDA) generates them if given."""
    policy.eval()
    p_ids, p_mask = encode_batch(tok, rows, args.prompt_length, args.apply_chat_template)
    size = args.rollout_micro_batch_size or p_ids.shape[0]
    chunks = [generate(decoder or policy, p_ids[s:s + size].to(device), p_mask[s:s + size].to(device),
                       args.response_length, stops, tok.pad_token_id, args.temperature, args.top_p, args.top_k, gen,
                       all_done=all_done, bf16=use_bf16(args)).cpu() for s in range(0, p_ids.shape[0], size)]
    R = max(c.shape[1] for c in chunks)
    R = max(gather_objects(R, world)) if world > 1 else R  # (the ranks gather (B, R) tensors)
    resp = torch.cat([F.pad(c, (0, R - c.shape[1]), value=tok.pad_token_id) for c in chunks])
    attn = torch.cat([p_mask, response_mask_from(resp, stops)], 1)
    return resp, torch.cat([p_ids, resp], 1).to(device), attn.to(device)


def model_forward(model, input_ids, attention_mask, resp_len: int, temperature: float, shared_value_head=None,
                  entropy: bool = False, entropy_grad: bool = False, ref=None):
    """Per response token: log-prob, optionally entropy and shared-trunk value; with `ref` (the frozen reference) also
    its log-prob and the full KL over the vocabulary. The logits come from the last hidden states, in chunks."""
    hidden = last_hidden(model, input_ids, attention_mask, resp_len)
    ref_hidden = None
    if ref is not None:
        with torch.no_grad():
            ref_hidden = last_hidden(ref, input_ids, attention_mask, resp_len)
    res = token_stats(output_layer(model), hidden, input_ids[:, -resp_len:], temperature, entropy, entropy_grad,
                      output_layer(ref) if ref is not None else None, ref_hidden)
    if shared_value_head is not None:  # the head in fp32 (outside bf16 autocast) on the trunk's last hidden state
        with torch.autocast(input_ids.device.type, enabled=False):
            res["values"] = shared_value_head(hidden.float()).squeeze(-1)
    return res


def last_hidden(model, input_ids, attention_mask, resp_len: int) -> torch.Tensor:
    """The trunk's last (normed) hidden states before each response token (B, R, H): hidden t predicts token t + 1."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                use_cache=False, output_hidden_states=-1, logits_to_keep=1)  # (transformers 5.23 keeps only -1)
    return out.hidden_states[-1][:, -resp_len - 1:-1]


def output_layer(model) -> tuple:
    """(the logits as a function of the last hidden states, the vocabulary's size): the output layer, then the model
    class's soft cap (Gemma 2); check_output_layer refuses a class that computes its logits otherwise."""
    if isinstance(model, AdaptersOff):  # (an adapter on lm_head is off too)
        head, rows = output_layer(model.policy)

        def adapters_off(h):
            with model.policy.disable_adapter():
                return head(h)
        return adapters_off, rows
    inner = getattr(model, "module", model)  # (DDP)
    lm, cap = inner.get_output_embeddings(), getattr(inner.config, "final_logit_softcapping", None)
    return (lm if cap is None else lambda h: torch.tanh(lm(h) / cap) * cap), lm.weight.shape[0]


LOGIT_ELEMENTS = 1 << 24  # float32 logits of one chunk: 64 MB, about 110 tokens of a 151,936-row vocabulary


def token_stats(head: tuple, hidden, tokens, temperature: float, entropy: bool = False, entropy_grad: bool = False,
                ref_head: Optional[tuple] = None, ref_hidden=None, elements: int = LOGIT_ELEMENTS) -> dict:
    """log-prob of each token (B, R) from the hidden states before it (B, R, H), optionally the entropy, and the
    reference's log-prob and the full KL, in float32. The (B, R, V) logits are never whole: the output layer runs on
    chunks of tokens and, with gradients, each chunk is recomputed in the backward (verl's fused kernels' way)."""
    B, R = tokens.shape
    fn, rows = head
    ref_fn = ref_head[0] if ref_head is not None else None

    def logits(head, h):
        x = head(h).float()
        return x / temperature if temperature != 1.0 else x

    def chunk(h, t, rh=None):
        logp_all = logits(fn, h).log_softmax(-1)
        out = [logp_all.gather(-1, t[:, None]).squeeze(-1)]
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                out.append(-(logp_all.exp() * logp_all).sum(-1))
        if rh is not None:
            with torch.no_grad():
                ref_all = logits(ref_fn, rh).log_softmax(-1)
            out += [ref_all.gather(-1, t[:, None]).squeeze(-1), kl_penalty(logp_all, ref_all, "full")]
        return tuple(out)
    inputs = [x.reshape(B * R, *x.shape[2:]) for x in (hidden, tokens, ref_hidden) if x is not None]
    size, grad = max(1, elements // rows), torch.is_grad_enabled() and hidden.requires_grad
    parts = [checkpoint(chunk, *x, use_reentrant=False) if grad else chunk(*x)
             for x in zip(*(torch.split(x, size) for x in inputs))]
    names = ["logp", *(["entropy"] if entropy else []), *(["ref_logp", "kl_full"] if ref_hidden is not None else [])]
    return {name: torch.cat(column).reshape(B, R) for name, column in zip(names, zip(*parts))}


def critic_values(critic, input_ids, attention_mask, resp_len: int):
    """V(s_t) for the state before each response token (same alignment as the logits)."""
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                 use_cache=False)
    return out.logits[:, -resp_len - 1:-1, 0].float()  # ((B, T, 1): one value per position, no vocabulary)


@torch.no_grad()
def score_responses(policy, ref, critic, value_head, ids, attn, R: int, args: Args, autocast=contextlib.nullcontext):
    """Per response token, on the CPU: old and reference log-probs, values, full KL (None where not computed)."""
    full = args.kl_penalty == "full" and ref is not None
    size = args.logprob_forward_micro_batch_size or args.micro_batch_size
    old_logp, ref_logp, values, kl_full = [], [], [], []
    with autocast():
        for s in range(0, ids.shape[0], size):
            sl = slice(s, s + size)
            o = model_forward(policy, ids[sl], attn[sl], R, args.temperature, value_head, ref=ref if full else None)
            old_logp.append(o["logp"])  # (to the host once, after the loop)
            if ref is not None:
                ref_logp.append(o["ref_logp"] if full else model_forward(ref, ids[sl], attn[sl], R,
                                                                         args.temperature)["logp"])
            if full:  # (over the vocabulary, chunk by chunk)
                kl_full.append(o["kl_full"])
            if args.critic != "none":
                values.append(o["values"] if args.critic == "shared" else critic_values(critic, ids[sl], attn[sl], R))
    return tuple(torch.cat(x).cpu() if x else None for x in (old_logp, ref_logp, values, kl_full))


# --- Reward: the score (rule or reward model), normalisation, the KL penalty and its coefficient ---------------------
def rule_reward(response: str, answer: Optional[str]) -> float:
    return float(answer is not None and response.strip() == answer.strip())


def boxed_content(text: str) -> Optional[str]:
    """The content of the last \boxed{...}, braces balanced; None without one or when it is not closed."""
    start = text.rfind("\\boxed{")
    end = None if start < 0 else closing_brace(text, start + len("\\boxed{"))
    return None if end is None else text[start + len("\\boxed{"):end]


def closing_brace(text: str, begin: int) -> Optional[int]:
    """Where the brace opened just before text[begin] closes (braces balanced); None if it does not."""
    depth = 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def unbraced(text: str) -> str:
    """text stripped, without braces around all of it ("{5}" -> "5"; "{1}{2}" stays)."""
    s = text.strip()
    while s.startswith("{") and closing_brace(s, 1) == len(s) - 1:
        s = s[1:-1].strip()
    return s


# A number in a response: a minus only after no digit or letter (3-2, 2023-11-25: no negative number), commas only in
# thousands, a decimal part, a fraction, an exponent kept with its number (1e5, never a 5): 1,234.5  -3  .5  7/8  1e5
NUMBER = re.compile(r"(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?(?:[eE][-+]?\d+)?"
                    r"|(?:(?<!\w)-)?\.\d+")
THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:,|\{,\}|\\,)\d{3})+(?!\d)")  # 1,234  1{,}234  1\,234 (LaTeX)


def math_number(text: str) -> Optional[fractions.Fraction]:
    """A final answer as an exact number ("1,234" "$5" "7/8" "\frac{1}{2}" "50%"); None for anything else."""
    s = THOUSANDS.sub(lambda m: re.sub(r"\D", "", m[0]), unbraced(text.replace("\u2212", "-")))
    for junk in ("\\$", "$", "\\%", "%"):  # currency, percent
        s = s.replace(junk, "")
    s = re.sub(r"\\[,!;: ]|~", " ", s)  # LaTeX's spaces
    if re.search(r"\d\s+\d", s):  # "2 3": two numbers, not 23
        return None
    s = re.sub(r"\s+", "", s).rstrip(".")  # "- 3"; "42." at the end of a sentence
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if frac:
        s = f"{frac[1]}{frac[2]}/{frac[3]}"
    if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/-?\d+(?:\.\d+)?)?", s):
        return None
    num, _, den = s.partition("/")
    if den and fractions.Fraction(den) == 0:
        return None
    return fractions.Fraction(num) / (fractions.Fraction(den) if den else 1)


def math_reward(response: str, answer: Optional[str]) -> float:
    """GSM8K / MATH: 1 if the final answers ("####", \boxed{}, last number) are equal as numbers or strings."""
    if answer is None:
        return 0.0
    response, answer = response.replace("\u2212", "-"), answer.replace("\u2212", "-")  # (a Unicode minus: "−3")
    ref = answer.rpartition("####")[2] if "####" in answer else boxed_content(answer) or answer
    got = boxed_content(response)
    got = (NUMBER.findall(response) or [None])[-1] if got is None else got
    if got is None:
        return 0.0
    got, ref = unbraced(got), unbraced(ref)
    a, b = math_number(got), math_number(ref)
    return float(a == b if a is not None and b is not None else got == ref)


REWARD_RULES = {"exact": lambda prompt, response, answer, **columns: rule_reward(response, answer),
                "math": lambda prompt, response, answer, **columns: math_reward(response, answer)}


def weighted_sum(fns: list, weights: list[float]):
    """The weighted sum of fns' scores (TRL's reward_funcs / reward_weights), each given the columns it takes."""
    def takes(fn):  # the names of the columns fn takes (None: all)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return None
        named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        return None if any(p.kind is p.VAR_KEYWORD for p in params) else named
    accepted = [takes(fn) for fn in fns]

    def total(prompt, response, answer, **columns):
        score = 0.0
        for fn, w, names in zip(fns, weights, accepted):
            kw = columns if names is None else {k: v for k, v in columns.items() if k in names}
            value = fn(prompt, response, answer, **kw)
            if finite_number(value) is None:
                return value  # (rule_scores says which)
            score += w * float(value)
        return score
    return total


def load_reward_fn(spec: Optional[str], weights: Optional[list[float]] = None):  # several: their weighted sum
    specs = (spec or "exact").split(",")  # (as many weights: validate)
    return weighted_sum([load_one_reward_fn(s.strip()) for s in specs], weights or [1.0] * len(specs))


def load_one_reward_fn(spec: str):
    """exact, math, or NAME(prompt, response, answer, **columns) -> float of FILE.py (verl, TRL); else one line."""
    if spec in REWARD_RULES:
        return REWARD_RULES[spec]
    import importlib.util

    path, _, name = spec.rpartition(":")
    if not (path.endswith(".py") and name.isidentifier()):
        raise Failure(f"--reward-fn {spec!r}: choose exact, math or FILE.py:NAME (the function NAME(prompt, response, "
                      "answer) -> float in FILE.py)")
    if not os.path.isfile(path):
        raise Failure(f"--reward-fn {spec}: no such file {path}")
    try:
        module_spec = importlib.util.spec_from_file_location("reward_fn", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: whatever stops it from importing is bad input
        raise Failure(f"--reward-fn {spec}: cannot import {path}: {reason(e)}")
    if not callable(getattr(module, name, None)):
        raise Failure(f"--reward-fn {spec}: {path} has no function {name!r}")
    return getattr(module, name)


def rule_scores(fn, rows: list[dict], texts: list[str], name: str) -> tuple[torch.Tensor, Optional[str]]:
    """fn(prompt, response, answer) of each response; a raise or a non-finite score: (zeros, why), the run stops."""
    scores = []
    for row, text in zip(rows, texts):
        try:
            value = fn(row["prompt"], text, row["answer"], **row.get("columns", {}))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's function: what it raises stops the run
            return torch.zeros(len(rows)), f"--reward-fn {name} raised {reason(e)} on the prompt {row['prompt']!r:.80}"
        score = finite_number(value)
        if score is None:
            return torch.zeros(len(rows)), (f"--reward-fn {name} returned {value!r:.40}, not a finite number, on the "
                                            f"prompt {row['prompt']!r:.80}")
        scores.append(score)
    return torch.tensor(scores), None


def finite_number(value) -> Optional[float]:
    """value as a float if it is a finite real number (a one-element tensor too), else None (10**400 included)."""
    if not (isinstance(value, numbers.Real) or torch.is_tensor(value) and value.numel() == 1):
        return None
    try:
        value = float(value)
    except (OverflowError, ValueError, TypeError):  # (an int too large for a float)
        return None
    return value if math.isfinite(value) else None


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k (Chen et al. 2021) of n samples, c correct: 1 - C(n-c, k) / C(n, k), as a product."""
    return 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def reward_model_inputs(rm_tok, prompts: list, responses: list[str], chat: bool = False) -> dict:
    """Prompt + response for the reward model, right-padded: its chat template where it applies, else plain text."""
    def messages(p):
        return [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
    templated = bool((chat or any(not isinstance(p, str) for p in prompts)) and rm_tok.chat_template)
    if templated:  # (the template writes its special tokens itself)
        texts = [rm_tok.apply_chat_template([*messages(p), {"role": "assistant", "content": r}], tokenize=False)
                 for p, r in zip(prompts, responses)]
    else:
        texts = ["\n".join(m["content"] for m in messages(p)) + r for p, r in zip(prompts, responses)]
    return rm_tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=not templated)


@torch.no_grad()
def reward_model_scores(rm, rm_tok, prompts: list[str], responses: list[str], chat: bool = False, device="cpu",
                        autocast=contextlib.nullcontext) -> torch.Tensor:
    """Each prompt + response's score, read at its last real token as the mask says (not config.pad_token_id)."""
    enc = reward_model_inputs(rm_tok, prompts, responses, chat)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    head, per_position = getattr(rm, "score", None), []
    hook = (head.register_forward_hook(lambda module, inputs, out: per_position.append(out))
            if isinstance(head, nn.Module) else None)
    try:
        with autocast():
            logits = rm(input_ids=ids, attention_mask=mask).logits
    finally:
        if hook is not None:
            hook.remove()
    if per_position and per_position[-1].dim() == 3 and per_position[-1].shape[:2] == ids.shape:  # (B, T, 1)
        last = (mask * torch.arange(mask.shape[1], device=device)).argmax(-1)
        logits = per_position[-1][torch.arange(len(ids), device=device), last]  # the last real token's
    return logits[:, 0].float().cpu()


def sequence_scores(rule: torch.Tensor, rm, rm_tok, rows: list[dict], texts: list[str], args: Args, device="cpu",
                    autocast=contextlib.nullcontext) -> tuple[torch.Tensor, dict]:
    """(scores, their parts by name): the rule's, the reward model's, or both summed (TRL's convention)."""
    if rm is None:
        return rule, {}
    rm_scores = reward_model_scores(rm, rm_tok, [r["prompt"] for r in rows], texts, args.apply_chat_template, device,
                                    autocast)
    if args.reward_fn is None:
        return rm_scores, {}
    return rule + rm_scores, {"rule_reward": rule, "rm_score": rm_scores}


class RunningMoments:
    """Running mean / std over all scores seen (--reward-norm running), as ROLL's: std with Bessel's correction."""
    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24  # (a prior of no weight)

    def update(self, x: torch.Tensor):
        b_mean, b_var, b_count = x.mean().item(), x.var(unbiased=False).item(), x.numel()
        delta, total = b_mean - self.mean, self.count + b_count
        self.mean += delta * b_count / total
        self.var = (self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total) / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else math.sqrt(self.var)


def group_stats(scores, group_ids):
    """Per response: the mean, the std (unbiased, as torch.std) and the size of its prompt's group of responses."""
    G = int(group_ids.max()) + 1
    cnt = torch.zeros(G).index_add_(0, group_ids, torch.ones_like(scores))
    mean = torch.zeros(G).index_add_(0, group_ids, scores) / cnt
    var = torch.zeros(G).index_add_(0, group_ids, (scores - mean[group_ids]) ** 2) / (cnt - 1).clamp(min=1)
    return mean[group_ids], var.sqrt()[group_ids], cnt[group_ids]


def normalize_scores(scores, group_ids, norm: str, shift: bool, scale: bool, clip: Optional[float],
                     running: Optional[RunningMoments] = None, eps: float = 1e-6):
    """ROLL reward_norm: (s - mean) / (std + eps) over batch, group or running stats (shift / scale alone), clip."""
    if norm != "none":
        if norm == "batch":
            mean, std = scores.mean(), scores.std()
        elif norm == "group":
            mean, std, _ = group_stats(scores, group_ids)
        elif norm == "running":
            running.update(scores)
            mean, std = torch.tensor(running.mean), torch.tensor(running.std)
            eps = torch.finfo(scores.dtype).eps
        else:
            raise ValueError(f"unknown reward_norm {norm!r}: choose one of none, batch, group, running")
        if shift or not scale:
            scores = scores - mean
        if scale or not shift:
            scores = scores / (std + eps)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The sequence score sits on the last response token (the EOS, or the last token of a truncated response)."""
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype)
    out[torch.arange(len(scores)), last] = scores
    return out


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """verl core_algos.kl_penalty per token ('full': over the vocabulary); k1/k2/k3 and straight-through + forms."""
    if kind.endswith("+"):
        k2 = 0.5 * (logp - ref_logp).square()
        return k2 - k2.detach() + kl_penalty(logp, ref_logp, kind[:-1]).detach()
    kind = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}.get(kind, kind)
    if kind == "kl":  # k1
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "mse":  # k2
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":  # k3 (Schulman), clamped as verl
        kl = (ref_logp - logp).clamp(-20, 20)
        return (kl.exp() - kl - 1).clamp(-10, 10)
    if kind == "full":
        return (logp.exp() * (logp - ref_logp)).sum(-1)
    raise ValueError(f"unknown KL type {kind!r}: choose one of {', '.join(KL_TYPES)}")


class FixedKLController:
    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int):
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019 (verl/TRL): coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int):
        err = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon


# --- Advantages and returns: GAE, or critic-free group / REINFORCE++ estimators; whitening ---------------------------
def group_all_equal(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Per group of n consecutive responses: all scores equal (a group-relative advantage of 0 for all)."""
    groups = scores.view(-1, n)
    return groups.max(-1).values == groups.min(-1).values


def masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum().clamp(min=1) if dim is None else (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    var = var * mask.sum() / (mask.sum() - 1).clamp(min=1)  # unbiased, as verl
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def compute_gae(token_rewards, values, mask, gamma: float, lam: float):
    """Token-level GAE over the response mask: tokens past EOS neither contribute nor carry values (verl)."""
    values = values * mask
    adv = torch.zeros_like(token_rewards)
    lastgaelam = nextvalues = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * nextvalues - values[:, t]
        new = delta + gamma * lam * lastgaelam
        m = mask[:, t].float()
        nextvalues = values[:, t] * m + (1 - m) * nextvalues
        lastgaelam = new * m + (1 - m) * lastgaelam
        adv[:, t] = lastgaelam
    return adv * mask, (adv + values) * mask  # (advantages, returns)


def compute_grpo(token_rewards, mask, group_ids, norm_by_std: bool = True, eps: float = 1e-6):
    """GRPO: (score - group mean) / (group std + eps), std unbiased as torch.std (verl)."""
    scores = token_rewards.sum(-1)
    mean, std, _ = group_stats(scores, group_ids)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv[:, None] * mask


def compute_rloo(token_rewards, mask, group_ids):
    """RLOO: score minus the mean score of the other responses to the same prompt."""
    scores = token_rewards.sum(-1)
    mean, _, n = group_stats(scores, group_ids)
    return ((scores * n - mean * n) / (n - 1).clamp(min=1))[:, None] * mask


def compute_reinforce(token_rewards, mask, gamma: float):
    """REINFORCE (ROLL's "reinforce"): the advantage is the discounted return-to-go of the token rewards."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns * mask


def compute_reinforce_plus_plus(token_rewards, mask, gamma: float):
    """REINFORCE++: discounted return-to-go of the token rewards (KL included), whitened over the batch."""
    returns = compute_reinforce(token_rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


def compute_reinforce_plus_plus_baseline(token_rewards, mask, group_ids):
    """REINFORCE++ with baseline: score minus group mean, broadcast to the tokens, whitened over the batch."""
    scores = token_rewards.sum(-1)
    mean, _, _ = group_stats(scores, group_ids)
    adv = (scores - mean)[:, None] * mask
    return masked_whiten(adv, mask) * mask


def compute_advantages(estimator: str, token_rewards, mask, group_ids, values=None, gamma=1.0, lam=1.0,
                       norm_adv_by_std_in_grpo=True, whiten=True, advantage_clip=None):
    """Returns (advantages, returns); returns are used by the value loss (gae) and logged otherwise."""
    if estimator == "gae":
        adv, returns = compute_gae(token_rewards, values, mask, gamma, lam)
    elif estimator == "grpo":
        adv = compute_grpo(token_rewards, mask, group_ids, norm_adv_by_std_in_grpo)
    elif estimator == "rloo":
        adv = compute_rloo(token_rewards, mask, group_ids)
    elif estimator == "reinforce":
        adv = compute_reinforce(token_rewards, mask, gamma)
    elif estimator == "reinforce_plus_plus":
        adv, returns = compute_reinforce_plus_plus(token_rewards, mask, gamma)
    elif estimator == "reinforce_plus_plus_baseline":
        adv = compute_reinforce_plus_plus_baseline(token_rewards, mask, group_ids)
    else:
        raise ValueError(f"unknown adv_estimator {estimator!r}: choose one of {', '.join(ADV_ESTIMATORS)}")
    if estimator not in ("gae", "reinforce_plus_plus"):
        returns = adv.clone()
    if whiten and estimator in ("gae", "grpo", "rloo", "reinforce"):
        adv = masked_whiten(adv, mask) * mask
    if advantage_clip is not None:
        adv = adv.clamp(-advantage_clip, advantage_clip)
    return adv, returns


def rewards_and_advantages(raw, maskf, values, kld, args: Args, kl_ctrl, running: RunningMoments,
                           rank: int = 0, world: int = 1):
    """Token rewards and advantages of one rollout, over the global batch under torchrun (each rank: its rows)."""
    B = raw.shape[0]
    raw, maskf, values, kld = (all_gather_cat(x, world) for x in (raw, maskf, values, kld))
    group_ids = torch.arange(raw.shape[0] // args.n).repeat_interleave(args.n)  # response i answers prompt i // n
    scores = normalize_scores(raw, group_ids, args.reward_norm, args.reward_shift, args.reward_scale,
                              args.reward_clip, running)
    token_rewards = token_level_scores(scores, maskf)
    seq_kl = masked_mean(kld, maskf, dim=-1).mean().item()
    if args.use_kl_in_reward:
        token_rewards = token_rewards - kl_ctrl.value * kld
        kl_ctrl.update(seq_kl, raw.shape[0])
    if args.reward_clip is not None:  # ROLL clips the token rewards too, after the KL penalty
        token_rewards = token_rewards.clamp(-args.reward_clip, args.reward_clip)
    adv, returns = compute_advantages(args.adv_estimator, token_rewards, maskf, group_ids, values, args.gamma,
                                      args.lam, args.norm_adv_by_std_in_grpo, args.whiten_advantages,
                                      args.advantage_clip)
    mine = slice(rank * B, (rank + 1) * B)
    return adv[mine], returns[mine], scores, seq_kl


# --- Losses: verl agg_loss, clipped / dual-clip policy loss, clipped / Huber value loss ------------------------------
def agg_loss(loss_mat, mask, mode: str, n_tokens=None, n_seqs=None, norm_len=None):
    """Token losses -> one number; the minibatch's n_tokens / n_seqs make micro-batch losses sum to its loss."""
    mask = mask.float()
    n_tokens = mask.sum().clamp(min=1) if n_tokens is None else n_tokens
    n_seqs = mask.shape[0] if n_seqs is None else n_seqs
    norm_len = mask.shape[-1] if norm_len is None else norm_len
    if mode == "token-mean":
        return (loss_mat * mask).sum() / n_tokens
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum(-1).sum() / n_seqs
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: divide by a constant length, not by the tokens present
        return (loss_mat * mask).sum() / (n_seqs * norm_len)
    raise ValueError(f"unknown loss_agg_mode {mode!r}: choose one of {', '.join(LOSS_AGG_MODES)}")


def policy_loss(logp, old_logp, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip=True,
                clip_ratio_c=3.0, loss_agg_mode="token-mean", **agg):
    """verl compute_policy_loss: clipped surrogate with asymmetric clip range, dual clip for A < 0."""
    neg_kl = (logp - old_logp).clamp(-20, 20)
    ratio = neg_kl.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    losses, clipfrac_lower = clipped, torch.zeros((), device=logp.device)
    if dual_clip:
        loss3 = -advantages * clip_ratio_c
        losses = torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)
        clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).float(), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((loss2 > loss1).float(), mask),  # 0-dim tensors: no host sync here
                 "clipfrac_lower": clipfrac_lower.detach(),
                 "old_approx_kl": masked_mean(-neg_kl, mask),  # verl ppo_kl (k1)
                 "approx_kl": masked_mean(ratio - 1 - neg_kl, mask)}  # k3, CleanRL's approx_kl
    return agg_loss(losses, mask, loss_agg_mode, **agg), stats


def value_loss(vpreds, old_values, returns, mask, value_clip=None, huber_delta=None, loss_agg_mode="token-mean",
               **agg):
    """verl compute_value_loss (0.5 * max(unclipped, clipped) squared error) or RLinf's Huber version."""
    err = (lambda x: 0.5 * x**2) if huber_delta is None else (  # squared error, or Huber's
        lambda x: torch.where(x.abs() <= huber_delta, 0.5 * x**2, huber_delta * (x.abs() - 0.5 * huber_delta)))
    losses = err(returns - vpreds)
    clipfrac = torch.zeros((), device=vpreds.device)
    if value_clip is not None:
        vclipped = old_values + (vpreds - old_values).clamp(-value_clip, value_clip)
        losses2 = err(returns - vclipped)
        clipfrac = masked_mean((losses2 > losses).float(), mask)
        losses = torch.maximum(losses, losses2)
    return agg_loss(losses, mask, loss_agg_mode, **agg), {"vf_clipfrac": clipfrac.detach()}


def explained_variance(values, returns, mask) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens; NaN where returns do not vary."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    err = returns - values
    var_e = masked_mean((err - masked_mean(err, mask)) ** 2, mask)
    tol = 1e-10 * (1 + masked_mean(values**2, mask))  # (float32 rounding is ~1e-7 of the values)
    return float("nan") if var_r <= tol else (1 - var_e / var_r).item()


# --- Update: E epochs of shuffled minibatches, each accumulated over micro-batches; the optimisers -------------------
def minibatch_backward(policy, critic, value_head, mb: dict, args: Args, update_actor: bool = True,
                       autocast=contextlib.nullcontext, world: int = 1, ref=None):
    """Forward/backward in micro-batches, each normalised by the minibatch's totals: one big batch's gradients."""
    def critic_loss(v, m):  # verl compute_value_loss, the critic's aggregation over the minibatch's totals (agg)
        return value_loss(v, m["values"], m["returns"], m["response_mask"], args.value_clip, args.huber_delta,
                          args.critic_loss_agg_mode or args.loss_agg_mode, **agg)
    R = mb["response_mask"].shape[1]
    n_tokens = all_ranks_sum(mb["response_mask"].sum(), world).clamp(min=1).float() / world
    agg = {"n_tokens": n_tokens, "n_seqs": mb["response_mask"].shape[0], "norm_len": args.response_length}
    need_full = args.use_kl_loss and args.kl_loss_type == "full"
    if need_full and ref is None:
        raise ValueError("--kl-loss-type full needs the reference policy (ref=...)")
    sums: dict[str, torch.Tensor] = {}  # 0-dim tensors, read once per update (no host sync per micro-batch)
    n_micro = math.ceil(mb["input_ids"].shape[0] / args.micro_batch_size)
    for s in range(0, mb["input_ids"].shape[0], args.micro_batch_size):
        m = {k: v[s:s + args.micro_batch_size] for k, v in mb.items()}
        mask = m["response_mask"]
        loss, stats = torch.zeros(()), {}
        with autocast():
            if update_actor or args.critic == "shared":  # (a separate critic's warm-up needs no policy forward)
                out = model_forward(policy, m["input_ids"], m["attention_mask"], R, args.temperature,
                                    value_head if args.critic == "shared" else None, entropy=True,
                                    entropy_grad=args.entropy_coeff != 0,
                                    ref=ref if need_full and update_actor else None)
            if update_actor:
                pg, stats = policy_loss(out["logp"], m["old_logp"], m["advantages"], mask, args.clip_ratio_low,
                                        args.clip_ratio_high, args.dual_clip_loss, args.clip_ratio_c,
                                        args.loss_agg_mode, **agg)
                ent = agg_loss(out["entropy"], mask, args.loss_agg_mode, **agg)
                loss = pg - args.entropy_coeff * ent
                stats.update(policy_loss=pg.detach(), entropy=ent.detach())
                if args.use_kl_loss:
                    if need_full:  # the reference's distributions: recomputed here, chunk by chunk, never stored
                        kl = out["kl_full"]
                    else:
                        kl = kl_penalty(out["logp"], m["ref_logp"], args.kl_loss_type)
                    kl_loss = agg_loss(kl, mask, args.loss_agg_mode, **agg)
                    loss = loss + args.kl_loss_coef * kl_loss
                    stats["kl_loss"] = kl_loss.detach()
            if args.critic == "shared":  # one loss on one trunk: one backward
                vl, vstats = critic_loss(out["values"], m)
                loss = loss + args.vf_coef * vl
                stats.update(value_loss=vl.detach(), **vstats)
        if loss.requires_grad:
            loss.backward()
        if args.critic == "separate":  # its own loss (no vf_coef, as verl's critic), forward and backward
            with autocast():
                vl, vstats = critic_loss(critic_values(critic, m["input_ids"], m["attention_mask"], R), m)
            vl.backward()
            stats.update(value_loss=vl.detach(), **vstats)
        for k, val in stats.items():  # losses add up over micro-batches; ratios/fractions are averaged
            val = val.float() if k in ("policy_loss", "entropy", "kl_loss", "value_loss") else val.float() / n_micro
            sums[k] = sums[k] + val if k in sums else val
    return sums


def ppo_update(policy, critic, value_head, optimizers, schedulers, batch: dict, args: Args, gen,
               update_actor: bool = True, autocast=contextlib.nullcontext, world: int = 1, ref=None):
    """ppo_epochs x shuffled minibatches: this rank's mean stats and the first minibatch's (ratio exactly 1)."""
    N = batch["input_ids"].shape[0]
    mb_size = args.ppo_mini_batch_size // world * args.n
    all_stats = []
    for _ in range(args.ppo_epochs):
        perm = torch.randperm(N, generator=gen)
        for s in range(0, N, mb_size):
            idx = perm[s:s + mb_size]
            for o in optimizers:
                o.zero_grad(set_to_none=True)
            stats = minibatch_backward(policy, critic, value_head, {k: v[idx] for k, v in batch.items()}, args,
                                       update_actor, autocast, world, ref)
            # optimizers[0] is the actor's: during critic warm-up it neither steps nor advances its lr warm-up (a
            # shared trunk's value gradients are dropped); the critic's (separate model or shared head) steps
            for i, (o, sch) in enumerate(zip(optimizers, schedulers)):
                if i == 0 and not update_actor:
                    continue
                norm = nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], args.max_grad_norm)
                stats["grad_norm" if i == 0 else "critic_grad_norm"] = (  # actor and critic clipped separately
                    norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
                o.step()
                sch.step()
            all_stats.append(stats)
    keys = list(all_stats[0])
    if not keys:  # nothing trained (critic warm-up without a critic)
        return {}, {}
    table = torch.stack([torch.stack([s[k].float() for k in keys]) for s in all_stats]).tolist()  # the one sync
    mean = {k: sum(row[j] for row in table) / len(table) for j, k in enumerate(keys)}
    return mean, dict(zip(keys, table[0]))


def build_optimizers(args: Args, policy, critic, value_head):
    def trained(m):  # (with LoRA the adapters, and a LoRA critic's value head)
        return [p for p in m.parameters() if p.requires_grad]
    optimizers = [torch.optim.AdamW(trained(policy), lr=args.lr, weight_decay=args.weight_decay)]
    optimizers += [torch.optim.AdamW(trained(m), lr=args.critic_lr, weight_decay=args.weight_decay)
                   for m in (critic, value_head) if m is not None]  # (a separate critic or the shared value head)
    warm = max(args.lr_warmup_steps, 1)
    return optimizers, [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / warm)) for o in optimizers]


# --- Warm start (supervised, before PPO) and the training loop -------------------------------------------------------
def sft_steps(args: Args) -> int:
    if args.sft_steps is not None:
        return args.sft_steps
    return 0 if args.model_name_or_path or args.dataset else 60


def warm_start(policy, tok, sample_rows, args: Args, device, autocast=contextlib.nullcontext, stop=None) -> None:
    """Supervised fine-tuning on answers + EOS, a progress line every ~5 s; stop() (every 10 steps) ends it."""
    opt = torch.optim.AdamW(policy.parameters(), lr=args.sft_lr)
    policy.train()
    steps, t0, last = sft_steps(args), time.time(), time.time()
    print(f"warm start: {steps} supervised steps on the answers (--sft-steps)", flush=True)
    for step in range(steps):
        if stop is not None and step % 10 == 0 and stop():
            return
        rows = sample_rows(args.sft_batch_size)
        targets = [tok.encode(r["answer"], add_special_tokens=False)[:args.response_length - 1] + [tok.eos_token_id]
                   for r in rows]
        p_ids, p_mask = encode_batch(tok, rows, args.prompt_length, args.apply_chat_template)
        r_ids, r_mask = (x.flip(-1) for x in left_pad([t[::-1] for t in targets], tok.pad_token_id))  # right-padded
        R = r_ids.shape[1]
        ids, mask = torch.cat([p_ids, r_ids], 1).to(device), torch.cat([p_mask, r_mask], 1).to(device)
        with autocast():
            logp = model_forward(policy, ids, mask, R, 1.0)["logp"]
        loss = -masked_mean(logp, r_mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        now = time.time()
        if now - last >= 5.0 or step + 1 == steps:
            last, eta = now, (now - t0) / (step + 1) * (steps - step - 1)
            print(f"warm-start step {step + 1}/{steps}  loss={loss.item():.3f}  eta={eta_text(eta)}", flush=True)
    print(f"warm start done in {time.time() - t0:.1f}s")


# --- torchrun (statistics over the global batch, FSDP2 / DDP), bf16 autocast, torch.compile ---------------------
def use_bf16(args: Args) -> bool:
    return args.precision == "bf16" or (args.precision == "auto" and args.cuda)


def collective_device() -> torch.device:
    """Where tensors must be for a collective: the rank's GPU under nccl, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_ranks_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        y = x.to(collective_device(), copy=True)
        dist.all_reduce(y)
        x = y.to(x.device)
    return x


def all_gather_cat(x: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return x
    y = x.to(collective_device()).contiguous()
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y)
    return torch.cat(parts).to(x.device)


def transformer_blocks(model: nn.Module) -> list:
    """The model's transformer blocks: its modules of the classes it names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def distribute(model: Optional[nn.Module], strategy: str, device: torch.device, trainable: bool = True):
    """FSDP2: every transformer block, then the model, a fully_shard unit; DDP: a replica for the update."""
    if model is None:
        return None
    for p in model.parameters():  # the same start on every rank, whatever each rank's warm-start did
        dist.broadcast(p.data, 0)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        # HF heads return views; this script never modifies a model output in place, which is what FSDP2 warns about
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        for block in transformer_blocks(model):
            fully_shard(block)
        return fully_shard(model)
    if not trainable:
        return model
    from torch.nn.parallel import DistributedDataParallel
    # find_unused_parameters: the critic warm-up trains the shared trunk through the value loss, not lm_head
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=True)


def prepare_models(args: Args, policy, critic, value_head, ref, device, world: int):
    """Gradient checkpointing, torch.compile, FSDP2 / DDP (none changes what is computed) and all_done."""
    for m in (m for m in (policy, critic) if m is not None):
        if args.gradient_checkpointing:
            getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
        if args.compile:
            compile_forward(m)
    if world == 1:
        return policy, critic, value_head, None
    train = [distribute(m, args.strategy, device) for m in (policy, critic, value_head)]
    distribute(ref, args.strategy, device, trainable=False)

    def all_done(done):  # FSDP2: each forward is a collective, so the ranks stop generating together
        return bool(all_ranks_sum(done.all().float()[None], world) == world)
    return (*train, all_done if args.strategy == "fsdp2" else None)


def compile_forward(model, backend: str = "inductor"):
    """--compile: the forward of each part of each transformer block (attention, MLP, norms) torch.compiled with
    dynamic shapes; dynamo keeps what it compiles with the code, so the parts of a class compile once for all blocks.
    The blocks' own forward stays eager, and with it what wraps it (gradient checkpointing, FSDP2's hooks). A model
    that names no blocks: its whole forward. (The tests use backend aot_eager on the CPU.)"""
    # (a part's code serves policy and critic, with and without gradients, padding or LoRA: more variants than the 8
    # that dynamo compiles by default before it runs a code eager)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for m in [part for block in transformer_blocks(model) for part in block.children()] or [model]:
        # (bound to the part: a deep copy rebinds it to the copy)
        m.forward = types.MethodType(torch.compile(type(m).forward, dynamic=True, backend=backend), m)
    return model


def main(args: Args) -> dict:
    with StopSignals() as signals:  # SIGTERM / SIGINT are noted, then honoured where nothing is half-written
        rank, world, device = setup_distributed(args)  # torchrun: one process per rank (gloo, or NCCL per GPU)
        ckpt = load_checkpoint(args.resume) if args.resume else None

        def stop() -> bool:  # a signal came to any rank (a collective: all ranks ask alike)
            return all_ranks_sum(torch.tensor([float(len(signals.received))]), world).item() > 0
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
        torch.set_num_threads(args.torch_threads)
        gen = torch.Generator().manual_seed(args.seed)  # tasks and shuffles (the same on every rank), CPU sampling
        # token sampling: gen itself in one CPU process; on CUDA or under torchrun a generator of its own (per rank)
        gen_dev = (gen if device.type == "cpu" and world == 1
                   else torch.Generator(device).manual_seed(args.seed + 1_000_003 * rank))
        eval_gen = torch.Generator(device)  # evaluations draw from it, reseeded alike at each (a CUDA graph keeps it)
        autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16(args)
                    else contextlib.nullcontext)

        # The reward rule, the models and the task, all checked before anything is written (bad input: no run dir)
        reward_fn = load_reward_fn(args.reward_fn, args.reward_weights)  # exact, math or FILE.py:NAME, imported once
        tok, policy, ref, stops = build_policy(args, ckpt, device)
        sample_rows, eval_rows, has_answers = build_task(args, tok, gen, world)
        rm, rm_tok = load_reward_model(args, tok, device)
        # The built-in task's supervised warm start (a user's model gets one only with --sft-steps)
        if ckpt is None and sft_steps(args) > 0 and has_answers:
            warm_start(policy, tok, sample_rows, args, device, autocast, stop)
        critic, value_head = build_critic(args, policy, ckpt, device)
        # the frozen KL reference: a copy of the policy, or (--lora-rank) its base model, the adapters put on here
        policy, ref = reference_policy(args, policy, ref, ckpt, device)
        train_policy, train_critic, train_value_head, all_done = prepare_models(args, policy, critic, value_head, ref,
                                                                                device, world)
        # the rollout on CUDA (--cudagraphs): a bf16 copy of the policy, refreshed after each update (step 5)
        decoder = make_decoder(args, policy, device, world)

        # The optimisers and the state that exact resume carries between iterations
        optimizers, schedulers = build_optimizers(args, policy, critic, value_head)
        kl_ctrl = (AdaptiveKLController(args.init_kl_coef, args.target_kl, args.kl_horizon)
                   if args.kl_ctrl_type == "adaptive" else FixedKLController(args.init_kl_coef))
        running = RunningMoments()
        start_iteration, global_step, tracker = restore_trainer_state(ckpt, args, optimizers, schedulers, gen, gen_dev,
                                                                      kl_ctrl, running, rank, world)
        finished = ckpt is not None and start_iteration > args.num_iterations
        if finished:  # nothing left to train: evaluate the checkpoint (a larger --num-iterations trains on)
            print(f"the checkpoint is at iteration {ckpt['iteration']} of --num-iterations {args.num_iterations}: "
                  "evaluating it")
        if stop():  # (nothing written yet)
            return stopped_before_training(args, signals, world)
        run_dir = make_run_dir(args, rank, world)
        writer = open_logs(args, run_dir, rank, resumed=ckpt is not None)  # TensorBoard; wandb with --track
        stats, metrics, eval_stopped, written = {}, {}, False, None  # written: the last checkpoint this process wrote

        def evaluation(iteration: int) -> bool:  # held-out accuracy, logged and printed; True: a signal stopped it
            return evaluate_and_log(decoder or policy, tok, eval_rows, args, reward_fn, stops, eval_gen, device, rank,
                                    world, all_done, stop, writer, iteration, global_step, tracker,
                                    written or args.resume)

        def save(iteration: int) -> str:  # every rank calls it at the same iteration; rank 0 writes
            return save_checkpoint(run_dir, policy, ref, critic, value_head, tok, optimizers, schedulers, args,
                                   global_step, iteration, gen, kl_ctrl, running, tracker, gen_dev, rank, world)

        # the model as training starts (or the finished checkpoint) evaluated, then a signal so far stops the run
        if (ckpt is None or finished) and evaluation(start_iteration - 1) or stop():
            return stopped_before_training(args, signals, world, run_dir, writer)
        clock = {"start": time.time(), "steps": global_step, "first": start_iteration, "printed": 0.0, "warned": 0}
        for iteration in range(start_iteration, args.num_iterations + 1):
            # 1. Collect rollout: rollout_batch_size prompts x n responses (response i answers prompt i // n), sampled
            #    and scored by policy (old log-probs), reference and critic; torchrun: each rank, its share of groups
            t0 = time.time()
            rows = [r for r in sample_rows(args.rollout_batch_size) for _ in range(args.n)]
            rows = rows[rank * len(rows) // world:(rank + 1) * len(rows) // world]
            resp, ids, attn = sample_responses(policy, tok, rows, args, stops, gen_dev, device, all_done, world,
                                               decoder)
            t_gen = time.time() - t0
            old_logp, ref_logp, values, kl_full = score_responses(policy, ref, critic, value_head, ids, attn,
                                                                  resp.shape[1], args, autocast)
            t_score = time.time() - t0 - t_gen
            maskf = response_mask_from(resp, stops).float()
            ref_logp = old_logp if ref_logp is None else ref_logp  # (no reference: no KL term reads it)
            values = values * maskf if values is not None else torch.zeros_like(old_logp)

            # Reward: each response's score (the rule, the reward model or their sum; the missing-EOS penalty), the
            # KL to the reference. A response is correct when the rule gives it 1 or more (exact, math: 1 or 0)
            texts = decode_responses(tok, resp, stops)
            eos = is_stop(resp, stops).any(-1)
            rule, problem = rule_scores(reward_fn, rows, texts, args.reward_fn or "exact")
            if problem:  # (the user's function raised or gave no number: one line naming the prompt)
                raise stopping(problem, written or args.resume)
            raw, parts = sequence_scores(rule, rm, rm_tok, rows, texts, args, device, autocast)
            raw, correct = raw - args.missing_eos_penalty * (~eos).float(), (rule >= 1).float()
            kld = (kl_full if kl_full is not None else kl_penalty(old_logp, ref_logp, args.kl_penalty)) * maskf

            # Scores normalised and put on the last token, minus the KL penalty, then
            # 2. Compute advantages and returns (GAE, or a critic-free estimator) and
            # 3. Advantage normalisation (whitening, then --advantage-clip): over the global batch under torchrun
            adv, returns, scores, seq_kl = rewards_and_advantages(raw, maskf, values, kld, args, kl_ctrl, running,
                                                                  rank, world)

            # 4. Optimise policy & value for E epochs (the actor after --critic-warmup iterations)
            t1 = time.time()
            batch = {"input_ids": ids, "attention_mask": attn, "response_mask": maskf, "old_logp": old_logp,
                     "ref_logp": ref_logp, "advantages": adv, "returns": returns, "values": values}
            batch = {k: v.to(device) for k, v in batch.items()}
            for m in (train_policy, train_critic, train_value_head):
                if m is not None:
                    m.train()
            stats, first = ppo_update(train_policy, train_critic, train_value_head, optimizers, schedulers, batch,
                                      args, gen, iteration > args.critic_warmup, autocast, world, ref)
            t_train = time.time() - t1

            # 5. Update reference policy: theta_old <- theta: the next rollout is sampled and scored by the updated
            #    policy (on CUDA sampled from its bf16 copy, refreshed here); the KL reference stays the initial model
            if decoder is not None:
                decoder.refresh(policy)
            # Statistics averaged over ranks; in the same all-reduce, whether any rank got a stop signal
            *means, signalled = all_ranks_sum(torch.tensor([*stats.values(), len(signals.received)],
                                                           dtype=torch.float64), world).tolist()
            stats = {k: v / world for k, v in zip(stats, means)}
            raw, correct, eos, maskf = (all_gather_cat(x, world) for x in (raw, correct, eos.float(), maskf))
            bad = [k for k, v in stats.items() if not math.isfinite(v)]
            if bad:  # stop before logging or saving: the last checkpoint written stays the last good one
                raise stopping(f"non-finite {', '.join(bad)} at iteration {iteration}", written or args.resume)
            global_step += ids.shape[0] * world
            n_tok, lengths = maskf.sum().item(), maskf.sum(-1)  # all ranks' response tokens
            metrics = {
                "rollout/reward_mean": raw.mean().item(), "rollout/reward_std": raw.std().item(),
                "rollout/score_mean": scores.mean().item(), "charts/episodic_return": raw.mean().item(),
                "charts/episodic_length": lengths.mean().item(), "response/length_mean": lengths.mean().item(),
                "response/eos_frac": eos.mean().item(), "response/clip_ratio": 1 - eos.mean().item(),
                "rollout/groups_all_equal_frac": group_all_equal(raw, args.n).float().mean().item(),
                **({"kl/kl_mean": seq_kl, "kl/kl_coef": kl_ctrl.value} if ref is not None else {}),
                "losses/explained_variance": explained_variance(values, returns, batch["response_mask"].cpu())
                if args.critic != "none" else float("nan"),  # (this rank's rows)
                "losses/first_minibatch_approx_kl": first.get("approx_kl", 0.0),
                "charts/learning_rate": schedulers[0].get_last_lr()[0],
                "perf/gen_tokens_per_s": n_tok / max(t_gen, 1e-9),
                "perf/train_tokens_per_s": n_tok * args.ppo_epochs / max(t_train, 1e-9),
                "perf/generation_s": t_gen, "perf/scoring_s": t_score, "perf/update_s": t_train,
                "perf/iteration_s": time.time() - t0,
                **({"perf/peak_gpu_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
                   if device.type == "cuda" else {}),
                **{f"rollout/{k}_mean": all_gather_cat(v, world).mean().item() for k, v in parts.items()},
                **{f"losses/{k}": v for k, v in stats.items()}}
            if has_answers:  # (accuracy is the rule's: none for a reward model's prompts without answers)
                metrics["rollout/accuracy"] = correct.mean().item()
                tracker.setdefault("rollout", []).append([iteration, metrics["rollout/accuracy"]])
            samples = [{"iteration": iteration, "prompt": r["prompt"], "response": t, "reward": float(x)}
                       for r, t, x in zip(rows[::args.n][:4], texts[::args.n][:4], raw[::args.n][:4])]
            log_iteration(writer, args, iteration, global_step, metrics, samples, clock)  # + the progress line
            if iteration % args.eval_every == 0 or iteration == args.num_iterations:
                eval_stopped = evaluation(iteration)
            stop_now = args.stop_after and iteration - start_iteration + 1 >= args.stop_after
            if (stop_now or signalled or eval_stopped) and iteration < args.num_iterations:  # (all ranks alike)
                written = save(iteration)
                print_stopped(args, iteration, signals if signalled or eval_stopped else None, written, world)
                break
            if args.checkpoint_every and iteration % args.checkpoint_every == 0:
                written = save(iteration)
        else:
            saved_now = args.checkpoint_every and args.num_iterations % args.checkpoint_every == 0  # just above
            checkpointed = ckpt is not None or args.checkpoint_every or args.stop_after  # a checkpoint along the way
            if not finished and not saved_now and (args.save_model or checkpointed or eval_stopped):
                written = save(args.num_iterations)
                print(f"checkpoint written to {written}")
            if eval_stopped:  # (a signal in the last evaluation: the trained model is saved above)
                print(f"evaluation stopped ({signal_name(signals)}); evaluate the trained model with: "
                      f"{launcher(world)} --resume {written or args.resume}")
    close_run(writer, args, world)
    print(f"done in {time.time() - clock['start']:.1f}s; run directory {run_dir}")
    return {"run_dir": run_dir, "curve": tracker["curve"], "stats": stats, "checkpoint": written, "metrics": metrics}


# =========================================================================================================
# Plumbing: nothing below this line changes what PPO computes. torchrun, signals, the run directory and logging,
# checkpoints and exact resume, evaluation, local models and their checks, the command line and its one error boundary.
# =========================================================================================================
class Failure(Exception):  # [SHARED] one line from __main__: exit 2 bad input / a checkpoint that does not fit, else 1
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def reason(e: BaseException) -> str:  # an exception in a one-line error: its type and its message's first line
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__


def exception_chain(error: Optional[BaseException]) -> list[BaseException]:  # error, then its causes / contexts
    chain = []
    while error is not None and len(chain) < 20:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def write_failure(error: BaseException) -> str:  # the OSError's reason (torch.save raises RuntimeError from it)
    return next((e.strerror or str(e) for e in exception_chain(error) if isinstance(e, OSError)), reason(error))


def stopping(message: str, last_checkpoint: Optional[str]) -> Failure:  # the run cannot go on: exit 1
    kept = f"last checkpoint kept: {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
    return Failure(f"{message}; stopping ({kept})", code=1)


# --- torchrun, signals, the run directory, TensorBoard and the progress line -------------------------------------
def gpu_for_each_process() -> bool:  # --cuda's default
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def setup_distributed(args: Args) -> tuple[int, int, torch.device]:  # a process group under torchrun (gloo / NCCL)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (a bar per from_pretrained / save_pretrained buries the progress line)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.cuda and args.torch_deterministic:  # (deterministic cuBLAS: set before its first call)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if world == 1:
        return 0, 1, torch.device("cuda" if args.cuda else "cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    return dist.get_rank(), world, device


def gather_objects(obj, world: int) -> list:  # [obj of rank 0, obj of rank 1, ...] on every rank
    out = [obj] * world
    if world > 1:
        torch.distributed.all_gather_object(out, obj)
    return out


class StopSignals:  # [SHARED] while active, SIGTERM / SIGINT are noted (main stops at the end of the iteration)
    def __enter__(self):
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, lambda signum, _: self.received.append(signum))
                         for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def signal_name(signals: StopSignals) -> str:
    return signal.Signals(signals.received[0]).name if signals.received else "a signal to another rank"


def launcher(world: int) -> str:
    return f"{f'torchrun --nproc-per-node {world}' if world > 1 else 'python'} {SCRIPT}"


def stopped_before_training(args: Args, signals: StopSignals, world: int, run_dir=None, writer=None) -> dict:
    if writer is not None:
        writer.close()
        if args.track:  # (wandb writes into the run directory)
            import wandb
            wandb.finish()
    if run_dir is not None and not args.resume:  # a new run directory holds nothing of value
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"stopped before training ({signal_name(signals)}); nothing written" + (
        f"; continue with: {launcher(world)} --resume {args.resume}" if args.resume else ""), flush=True)
    return {"run_dir": None, "curve": [], "stats": {}, "checkpoint": None, "metrics": {}}


def print_stopped(args: Args, iteration: int, signals: Optional[StopSignals], path: str, world: int) -> None:
    why = signal_name(signals) if signals is not None else f"--stop-after {args.stop_after}"
    print(f"stopped at iteration {iteration} ({why}); continue with: {launcher(world)} --resume {path}" + (
        f" (which stops again after {args.stop_after} iterations, the checkpoint's --stop-after; add --stop-after 0 "
        "to run to the end)" if args.stop_after else ""), flush=True)


def make_run_dir(args: Args, rank: int, world: int) -> str:  # the resumed run's, or a new one that rank 0 makes
    if args.resume:
        return os.path.dirname(os.path.abspath(args.resume))
    task = "sort" if args.dataset is None else os.path.splitext(os.path.basename(args.dataset))[0]
    base = os.path.join(args.runs_dir, f"{task}__{args.exp_name}__{args.seed}__{int(time.time())}")
    run_dir, n = base, 1
    while rank == 0:
        try:
            os.makedirs(run_dir)
            break
        except FileExistsError:  # another run started in the same second
            n, run_dir = n + 1, f"{base}-{n + 1}"
        except OSError as e:
            raise Failure(f"cannot create the run directory {run_dir}: {e.strerror or e}", code=1) from None
    return gather_objects(run_dir, world)[0]


def open_logs(args: Args, run_dir: str, rank: int, resumed: bool):  # TensorBoard (wandb with --track), rank 0
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    if args.track:
        import wandb
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=vars(args),
                   name=os.path.basename(run_dir), id=os.path.basename(run_dir), resume="allow", dir=run_dir)
    writer = SummaryWriter(run_dir)
    atexit.register(writer.close)  # a run that ends on a Failure still writes its last scalars
    if not resumed:
        table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


def log_scalars(writer, scalars: dict, step: int) -> None:
    for k, v in scalars.items() if writer is not None else ():
        writer.add_scalar(k, v, step)


def log_iteration(writer, args: Args, iteration: int, global_step: int, m: dict, samples: list, clock: dict) -> None:
    """Scalars, charts/SPS, sample completions (TensorBoard text, samples.jsonl); every ~5 s the progress line + ETA."""
    now, nan = time.time(), float("nan")
    m["charts/SPS"] = (global_step - clock["steps"]) / max(now - clock["start"], 1e-9)  # this process's steps/s
    log_scalars(writer, m, global_step)
    if writer is not None and samples:
        with open(os.path.join(writer.log_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in samples))
        cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        writer.add_text("samples/completions", "|prompt|response|reward|\n|-|-|-|\n" + "\n".join(
            f"|{cell(x['prompt'])}|{cell(x['response'])}|{x['reward']:g}|" for x in samples), global_step)
    if m["response/clip_ratio"] > 0.5 and not clock["warned"]:
        clock["warned"] = 1
        print(f"warning: {m['response/clip_ratio']:.0%} of the responses hit --response-length "
              f"{args.response_length} without EOS (cut off, scored as they are): a longer limit may suit this task",
              flush=True)
    if now - clock["printed"] >= 5.0 or iteration in (clock["first"], args.num_iterations):
        clock["printed"] = now
        per_iteration = (now - clock["start"]) / (iteration - clock["first"] + 1)  # (evaluations included)
        accuracy = f"acc={m['rollout/accuracy']:.3f}  " if "rollout/accuracy" in m else ""
        print(f"iter {iteration}/{args.num_iterations}  reward={m['rollout/reward_mean']:.3f}  {accuracy}"
              f"kl={m.get('kl/kl_mean', nan):.4f}  entropy={m.get('losses/entropy', nan):.3f}  "
              f"len={m['response/length_mean']:.2f}  clipfrac={m.get('losses/clipfrac', 0.0):.3f}  "
              f"vloss={m.get('losses/value_loss', nan):.4f}  gen_tok/s={m['perf/gen_tokens_per_s']:.0f}  "
              f"train_tok/s={m['perf/train_tokens_per_s']:.0f}  "
              f"eta={eta_text(per_iteration * (args.num_iterations - iteration))}", flush=True)


def eta_text(seconds: float) -> str:  # [SHARED] 2h05m, 13m20s or 45s ("?" before the speed is known)
    s = int(seconds) if 0 <= seconds < math.inf else -1
    h, m = s // 3600, s // 60 % 60
    return "?" if s < 0 else f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def close_run(writer, args: Args, world: int) -> None:  # the events flushed; no rank leaves while another works
    if writer is not None:
        writer.close()
        if args.track:
            import wandb
            wandb.finish()
    if world > 1:
        torch.distributed.barrier()  # (rank 0 may still be writing)
        torch.distributed.destroy_process_group()


# --- Checkpoints: save_pretrained for policy, reference and critic + trainer state in checkpoint.pt; exact resume ---
def full_state(state):  # FSDP2's sharded DTensors gathered into full CPU tensors (a collective: every rank calls it)
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: full_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full_state(v) for v in state]
    return state.full_tensor().cpu() if isinstance(state, DTensor) else state


def shard_optimizer_state(opt) -> None:  # after load_state_dict of a full state: moments sharded as their parameters
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, st in opt.state.items():
        if isinstance(p, DTensor):
            for k, v in st.items():
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.shape == p.shape:
                    st[k] = distribute_tensor(v.to(p.device_mesh.device_type), p.device_mesh, p.placements)


def save_checkpoint(run_dir: str, policy, ref, critic, value_head, tok, optimizers, schedulers, args: Args,
                    global_step: int, iteration: int, gen, kl_ctrl, running: RunningMoments, tracker: dict,
                    gen_dev=None, rank: int = 0, world: int = 1) -> str:
    """Atomic: models to a new checkpoint-<iteration>/, then checkpoint.pt naming it replaced in one rename (a kill
    leaves complete models; older checkpoint-* go after; a failed write removes this save's, exit 1). Every rank calls
    it (FSDP2 shards gathered), rank 0 writes; with LoRA policy/ (and critic/) hold the adapters, ref/ their base."""
    sub, path = f"checkpoint-{iteration}", os.path.join(run_dir, "checkpoint.pt")
    lora, has_ref = bool(args.lora_rank), bool(args.lora_rank) or ref is not None  # (no KL term: no reference)
    write_ref = has_ref and gather_objects(not os.path.isdir(os.path.join(run_dir, "ref")), world)[0]  # written once
    sd = {name: full_state(m.state_dict()) for name, m in (("policy", policy), ("critic", critic)) if m is not None}
    if write_ref:
        sd["ref"] = base_weights(policy) if lora else full_state(ref.state_dict())
    optim_states = [full_state(o.state_dict()) for o in optimizers]
    value_head_state = full_state(value_head.state_dict()) if value_head is not None else {}
    dev_states = gather_objects(gen_dev.get_state() if gen_dev is not None and gen_dev is not gen else None, world)
    failed, tmp_dir, made = None, os.path.join(run_dir, sub + ".tmp"), []  # made: what this save put in place
    if rank == 0:
        try:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            target = os.path.join(run_dir, sub, "policy")  # (what is being written, named by a failed write)
            policy.save_pretrained(os.path.join(tmp_dir, "policy"), state_dict=sd["policy"])
            tok.save_pretrained(os.path.join(tmp_dir, "policy"))
            if critic is not None:
                target = os.path.join(run_dir, sub, "critic")
                critic.save_pretrained(os.path.join(tmp_dir, "critic"), state_dict=sd["critic"])
            shutil.rmtree(os.path.join(run_dir, sub), ignore_errors=True)  # a leftover of a save killed after this
            os.rename(tmp_dir, os.path.join(run_dir, sub))
            made.append(os.path.join(run_dir, sub))
            if write_ref:
                target = os.path.join(run_dir, "ref")
                (policy.get_base_model() if lora else ref).save_pretrained(os.path.join(run_dir, "ref.tmp"),
                                                                           state_dict=sd["ref"])
                os.rename(os.path.join(run_dir, "ref.tmp"), target)
                made.append(target)
            state = {
                "script": SCRIPT, "env_id": "sort" if args.dataset is None else os.path.basename(args.dataset),
                "model": {"policy": f"{sub}/policy", "ref": "ref" if has_ref else "",
                          "critic": f"{sub}/critic" if critic is not None else "", "value_head": value_head_state},
                "optimizer": optim_states, "scheduler": [s.state_dict() for s in schedulers],
                "global_step": global_step, "iteration": iteration,
                # gen: tasks and shuffles (the same on every rank); gen_dev: token sampling on CUDA / torchrun, per rank
                "rng": {"torch": torch.get_rng_state(), "gen": gen.get_state(), "gen_dev": dev_states},
                "args": dataclasses.asdict(args), "kl_coef": kl_ctrl.value, "reward_running": dict(vars(running)),
                "tracker": tracker}
            target = path
            with open(path + ".tmp", "wb") as f:  # (into a file object: a refused write raises from its OSError)
                torch.save(state, f)
            os.replace(path + ".tmp", path)
        except Exception as e:
            failed = (target, write_failure(e))
            for leftover in (tmp_dir, os.path.join(run_dir, "ref.tmp"), *made):  # the checkpoint before stays whole
                shutil.rmtree(leftover, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + ".tmp")
        else:
            for d in os.listdir(run_dir):  # earlier checkpoints (and .tmp leftovers of killed saves)
                if d.startswith("checkpoint-") and d != sub:
                    shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
    if failed is not None:  # (under torchrun rank 0's exit ends the job)
        kept = "the previous checkpoint is kept" if os.path.exists(path) else "no checkpoint was written"
        raise Failure(f"cannot write {failed[0]}: {failed[1]} ({kept})", code=1)
    return path


def base_weights(policy) -> dict:  # a LoRA policy's base model as it was before peft (ref/, loadable without peft)
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in policy.state_dict().items() if "lora_" not in k}


def saved_model_dir(args: Args, ckpt: Optional[dict], name: str) -> Optional[str]:  # policy, ref or critic
    if ckpt is None:
        return None
    with checkpoint_fits(args.resume):
        return os.path.join(os.path.dirname(os.path.abspath(args.resume)), ckpt["model"][name])


_READ: dict = {}  # parse_args' read of --resume, which main() takes: a checkpoint is read once per process


def load_checkpoint(path: str, keep: bool = False) -> dict:
    if not os.path.isfile(path):
        raise Failure(f"--resume: no such file {path}")
    key = (os.path.abspath(path), os.stat(path).st_mtime_ns)
    try:
        ckpt = _READ.pop(key, None) or torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise Failure(f"cannot read checkpoint {path}: {reason(e)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("script") != SCRIPT:
        raise Failure(f"{path} is not a {SCRIPT} checkpoint")
    if keep:
        _READ[key] = ckpt
    return ckpt


@contextlib.contextmanager
def checkpoint_fits(path: str):  # [SHARED] what torch or the envs raise on a checkpoint that does not fit: one line
    try:
        yield
    except Failure:
        raise
    except Exception as e:
        raise Failure(f"checkpoint {path} does not fit this run: {type(e).__name__}: {first_line(e)}") from None


def first_line(e: BaseException) -> str:  # [SHARED]
    return (str(e).splitlines() or [""])[0]


def restore_trainer_state(ckpt: dict, args: Args, optimizers, schedulers, gen, gen_dev, kl_ctrl, running, rank: int,
                          world: int):
    """(next iteration, global step, tracker), and optimizers, schedulers (--lr, --critic-lr, --weight-decay as given
    now, at the saved warm-up position), generators, KL coefficient, running reward statistics as saved."""
    if ckpt is None:
        return 1, 0, {"curve": []}
    with checkpoint_fits(args.resume):
        if len(ckpt["optimizer"]) != len(optimizers):
            raise ValueError(f"{len(ckpt['optimizer'])} optimizers saved, {len(optimizers)} here")
        for o, s, so, ss, base in zip(optimizers, schedulers, ckpt["optimizer"], ckpt["scheduler"],
                                      [args.lr, args.critic_lr]):
            o.load_state_dict(so)
            s.load_state_dict(ss)
            # the saved state holds the old learning rate and weight decay: --lr, --critic-lr, --weight-decay
            # (the checkpoint's values unless given now) apply from here, at the saved warm-up position
            s.base_lrs = [base] * len(o.param_groups)
            for g, f in zip(o.param_groups, s.lr_lambdas):
                g.update(lr=base * f(s.last_epoch), initial_lr=base, weight_decay=args.weight_decay)
            s._last_lr = [g["lr"] for g in o.param_groups]
            if world > 1 and args.strategy == "fsdp2":
                shard_optimizer_state(o)
        torch.set_rng_state(ckpt["rng"]["torch"])
        gen.set_state(ckpt["rng"]["gen"])
        dev_states = ckpt["rng"].get("gen_dev") or [None]  # one per rank
        if gen_dev is not gen and len(dev_states) == world and dev_states[rank] is not None:
            if dev_states[rank].numel() == gen_dev.get_state().numel():
                gen_dev.set_state(dev_states[rank])
            else:  # (a CUDA generator's state in a CPU run, or the reverse: they do not convert)
                gen_dev.manual_seed(args.seed + 1_000_003 * rank + ckpt["iteration"])
                print(f"note: rank {rank}'s sampling generator was saved on another device type; it continues from a "
                      "new seed (the run is not the one an uninterrupted run would have been)")
        kl_ctrl.value = float(ckpt["kl_coef"])
        running.__dict__.update({k: float(ckpt["reward_running"][k]) for k in ("mean", "var", "count")})
        print(f"resumed {args.resume} at iteration {ckpt['iteration']}")
        return ckpt["iteration"] + 1, ckpt["global_step"], {"curve": [], **ckpt["tracker"]}


# --- Evaluation: held-out accuracy, greedy and sampled; pass@k of --eval-n samples ---------------------------------
@torch.no_grad()
def evaluate(policy, tok, rows: list[dict], args: Args, rule, stops, gen, device, rank: int = 0, world: int = 1,
             all_done=None, stop=None) -> Optional[dict]:
    """Held-out accuracy (the rule scores >= 1) of policy (on CUDA its StaticDecoder), greedy and sampled once;
    --eval-n: pass@1, pass@k (k = 2, 4, .., n) at --eval-temperature. torchrun: each rank an equal share, sums added.
    None when stop() (asked each micro-batch) says a signal came; "problem": why the user's rule failed, else None."""
    per_rank = len(rows) // world
    mine = rows[rank * per_rank:(rank + 1) * per_rank]
    # micro-batches of the rollout's size (--rollout-micro-batch-size, else a rank's share of a rollout)
    chunk_size = args.rollout_micro_batch_size or max(1, args.rollout_batch_size * args.n // world)
    problems = []

    def correct(rows, greedy: bool, temperature: float) -> Optional[list[bool]]:  # None: a signal came
        right = []
        for s in range(0, len(rows), chunk_size):
            if stop is not None and stop():
                return None
            chunk = rows[s:s + chunk_size]
            ids, mask = encode_batch(tok, chunk, args.prompt_length, args.apply_chat_template)
            resp = generate(policy, ids.to(device), mask.to(device), args.response_length, stops, tok.pad_token_id,
                            temperature, args.top_p, args.top_k, gen, greedy, all_done, use_bf16(args)).cpu()
            scores, problem = rule_scores(rule, chunk, decode_responses(tok, resp, stops), args.reward_fn or "exact")
            problems.append(problem)
            right += (scores >= 1).tolist()
        return right

    sums, n = {}, args.eval_n
    for name, greedy in (("greedy", True), ("sampled", False)):
        right = correct(mine, greedy, args.temperature)
        if right is None:
            return None
        sums[f"accuracy_{name}"] = sum(right)
    if n:
        right = correct([r for r in mine for _ in range(n)], False, args.eval_temperature)
        if right is None:
            return None
        counts = [sum(right[i * n:(i + 1) * n]) for i in range(len(mine))]  # correct samples of each prompt
        for k in sorted({n, *(2**i for i in range(n.bit_length()))}):
            sums[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts)
    totals = all_ranks_sum(torch.tensor(list(sums.values()), dtype=torch.float64), world).tolist()
    return {**{k: v / (per_rank * world) for k, v in zip(sums, totals)},
            "problem": next((p for p in problems if p is not None), None)}


def evaluate_and_log(policy, tok, rows, args: Args, rule, stops, gen, device, rank: int, world: int, all_done, stop,
                     writer, iteration: int, step: int, tracker: dict, last_checkpoint) -> bool:  # True: stopped
    if not rows:
        return False
    gen.manual_seed(args.seed + 1 + rank)  # (every evaluation draws alike)
    ev = evaluate(policy, tok, rows, args, rule, stops, gen, device, rank, world, all_done, stop=stop)
    if ev is None:
        return True
    if ev["problem"]:
        raise stopping(ev["problem"], last_checkpoint)
    del ev["problem"]
    log_scalars(writer, {f"eval/{k}": v for k, v in ev.items()}, step)
    tracker["curve"].append([iteration, ev["accuracy_greedy"], ev["accuracy_sampled"]])
    print(f"eval iter {iteration}: accuracy greedy {ev['accuracy_greedy']:.3f}  sampled {ev['accuracy_sampled']:.3f}"
          + "".join(f"  {k} {v:.3f}" for k, v in ev.items() if k.startswith("pass@")))
    return False


# --- The rollout on CUDA: a bf16 copy of the policy, a static KV cache, each one-token step a CUDA graph ------------
class StaticDecoder:
    """generate()'s sampling, token for token, with a static KV cache (transformers' StaticCache, allocated once per
    batch shape: prompts left-padded to a multiple of 64 columns) and the one-token step (forward, sampling, the
    bookkeeping) replayed as one CUDA graph from its third call (capture=True). A 0.5B step reads about 1 GB of
    weights, a fraction of a millisecond on a GPU, where eager launches took ~16 ms. The model is rollout_copy's copy
    of the policy, which refresh() updates after each update, as verl refreshes its rollout engine."""

    def __init__(self, model, capture: bool = True, compile: bool = False, keep: int = 3):
        self.model, self.capture, self.keep = model, capture, keep
        # --compile: the step only; its forward, as the uncompiled one, captured without deterministic kernels
        # (plain_kernels), so in a deterministic run compiled in inductor's deterministic mode (no benchmarking on the
        # device that could change the numerics: another run may choose otherwise)
        options = {"deterministic": True} if torch.are_deterministic_algorithms_enabled() else None
        self.step_forward = torch.compile(model, dynamic=False, options=options) if compile else model
        self.shapes: dict = {}  # the `keep` most recent (batch shape, sampling) -> their buffers, cache and graph
        #                        (3: the rollout's and an evaluation's greedy and sampled decoding)

    @torch.no_grad()
    def refresh(self, policy) -> None:  # the policy's weights, cast in place (the graphs read these addresses)
        for mine, theirs in zip(self.model.parameters(), policy.parameters(), strict=True):
            if mine.data_ptr() != theirs.data_ptr():  # (a weight of the policy's dtype is shared, not copied)
                mine.copy_(theirs)

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, max_new_tokens: int, stops, pad_id: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, gen=None, greedy: bool = False, check_every: int = 8):
        (B, P), R, stops = prompt_ids.shape, max_new_tokens, [stops] if isinstance(stops, int) else list(stops)
        width = -(-P // 64) * 64
        key = (B, width, R, temperature, top_p, top_k, None if greedy else gen, greedy, tuple(stops), pad_id)
        s = self.shapes.pop(key, None) or self.buffers(B, width, R, prompt_ids.device, stops)
        self.shapes[key] = s  # (the most recent last; the oldest shapes go, with their memory)
        while len(self.shapes) > self.keep:
            del self.shapes[next(iter(self.shapes))]
        if any(layer.max_cache_len < width + R for layer in s["cache"].layers):  # (a sliding window: unsupported)
            return generate(self.model, prompt_ids, prompt_mask, R, stops, pad_id, temperature, top_p, top_k, gen,
                            greedy, check_every=check_every)
        s["sampling"] = (temperature, top_p, top_k, gen, greedy, pad_id)
        # the prefill, outside the graph: the prompts, then R response columns hidden until a step writes them
        ids, mask = F.pad(prompt_ids, (width - P, 0), value=pad_id), F.pad(prompt_mask, (width - P, R))
        s["cache"].reset()
        pos = position_ids_from(mask[:, :width])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=s["cache"],
                         use_cache=True, logits_to_keep=1)
        first = sample_token(out.logits[:, -1], temperature, top_p, top_k, gen, greedy)
        s["tokens"].fill_(pad_id)
        s["tokens"][:, 0] = first
        s["done"].copy_(is_stop(first, s["stops"]))
        s["cur"].copy_(first[:, None])
        s["pos"].copy_(pos[:, -1:] + 1)
        s["bias"].copy_(torch.zeros_like(mask, dtype=s["bias"].dtype).masked_fill(mask == 0, s["low"])[:, None, None])
        s["col"].fill_(width)
        s["t"].fill_(1)
        n = 1  # tokens written; "all done?" every check_every tokens, as generate() asks it
        while n < R and not (n % check_every == 0 and bool(s["done"].all())):
            self.step(s)
            n += 1
        length = response_mask_from(s["tokens"][:, :n], s["stops"]).sum(-1).max()
        return s["tokens"][:, :max(int(length), 1)].clone()

    def buffers(self, B: int, width: int, R: int, device, stops) -> dict:
        """A batch shape's cache and the step's inputs and outputs, allocated once (a graph reads their addresses)."""
        from transformers import StaticCache
        dtype = next(self.model.parameters()).dtype

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        return {"cache": StaticCache(config=self.model.config, max_cache_len=width + R),
                "tokens": zeros(B, R), "done": zeros(B, dtype=torch.bool), "cur": zeros(B, 1), "pos": zeros(B, 1),
                "bias": zeros(B, 1, 1, width + R, dtype=dtype), "low": torch.finfo(dtype).min,  # (additive mask)
                "col": zeros(), "t": zeros(), "arange": torch.arange(R, device=device),
                "columns": torch.arange(width + R, device=device), "stops": torch.as_tensor(stops, device=device),
                "calls": 0, "graph": None}

    def decode_step(self, s: dict) -> None:
        """One token for every row, all on the device (no host sync, the same addresses at every call)."""
        temperature, top_p, top_k, gen, greedy, pad_id = s["sampling"]
        s["bias"].masked_fill_(s["columns"] == s["col"], 0.0)  # the column of the token this step reads
        with plain_kernels(self.capture):  # (the captured forward without deterministic kernels)
            logits = self.step_forward(input_ids=s["cur"], attention_mask=s["bias"], position_ids=s["pos"],
                                       past_key_values=s["cache"], use_cache=True).logits[:, -1]
        tok = sample_token(logits, temperature, top_p, top_k, gen, greedy).masked_fill(s["done"], pad_id)
        s["tokens"].copy_(torch.where(s["arange"] == s["t"], tok[:, None], s["tokens"]))
        s["done"] |= is_stop(tok, s["stops"])
        s["cur"].copy_(tok[:, None])
        for k in ("pos", "col", "t"):
            s[k] += 1

    def step(self, s: dict) -> None:
        """decode_step: run as it is for its first two calls of a shape (on a side stream, as CUDA graphs ask: the
        warm-up), captured at the third (capturing runs nothing) and replayed from then on."""
        if not self.capture:
            return self.decode_step(s)
        if s["calls"] < 2:
            s["calls"] += 1
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.decode_step(s)
            torch.cuda.current_stream().wait_stream(stream)
            return None
        if s["graph"] is None:
            s["graph"] = torch.cuda.CUDAGraph()
            gen = s["sampling"][3]
            if gen is not None and not s["sampling"][4]:  # a generator of the run's own: its draws advance in the graph
                s["graph"].register_generator_state(gen)
            try:
                with torch.cuda.graph(s["graph"]):
                    self.decode_step(s)
            except RuntimeError as e:  # (the capture's own error hides the step's: that one is its context)
                cause = reason(e.__context__ or e)
                raise Failure(f"capturing the rollout's decoding step in a CUDA graph failed: {cause} (--no-cudagraphs "
                              "decodes step by step)", code=1) from e
        s["graph"].replay()
        return None


@contextlib.contextmanager
def plain_kernels(enabled: bool = True):
    """torch.use_deterministic_algorithms off inside, restored after. The captured step's forward computes the same
    either way (the one position each cache write indexes never repeats; every buffer is written before it is read),
    but the deterministic kernels sort that position at each layer's two writes (index_copy_ as index_put_) and fill
    fresh memory first: kernels that a graph replays at every token (compiled too: under the mode inductor hands
    such writes to those kernels). Not the sampling (a one-row cumsum is another kernel without the mode)."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(mode and not enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def make_decoder(args: Args, policy, device, world: int) -> Optional[StaticDecoder]:
    """--cudagraphs on CUDA: a StaticDecoder of rollout_copy(policy) (with --compile, its step compiled). Under FSDP2
    (each forward a collective) the rollout decodes step by step, as on the CPU."""
    if device.type != "cuda" or not args.cudagraphs:
        return None
    if world > 1 and args.strategy == "fsdp2":
        print("note: under FSDP2 the rollout decodes step by step, without CUDA graphs (--strategy ddp has them)")
        return None
    print(f"rollout: a {'bf16 ' if use_bf16(args) else ''}copy of the policy decodes with a static KV cache, each step "
          "replayed as a CUDA graph (--no-cudagraphs: step by step)")
    return StaticDecoder(rollout_copy(policy, torch.bfloat16 if use_bf16(args) else torch.float32),
                         compile=args.compile)


def rollout_copy(policy, dtype: torch.dtype):
    """The policy for decoding: its parameters in `dtype` (those already in it shared, not copied: a LoRA run's frozen
    bf16 base), its buffers as they are (rotary frequencies stay float32), eval mode, and for one query token over
    a static cache the attention of packed_gqa_sdpa."""
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in policy.parameters()}
    model = copy.deepcopy(policy, memo)
    for m in model.modules():  # (--compile's compiled parts, which the copy rebinds: it decodes with its own step)
        m.__dict__.pop("forward", None)
    if model.config._attn_implementation == "sdpa":
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionInterface.register("ppo_llm_decode", packed_gqa_sdpa)
        AttentionMaskInterface.register("ppo_llm_decode", sdpa_mask)  # (the prompt's forward: sdpa's mask)
        model.config._attn_implementation = "ppo_llm_decode"
    return model.eval()


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Hugging Face's sdpa attention, but for one query token with fewer key/value heads than query heads: the query
    heads of each key/value head are its queries, (B, H_kv, H / H_kv, D), where sdpa repeats the static cache for
    every query head (transformers 5.17: about 7x the cache's bytes a step at Qwen2.5-0.5B's 14 / 2 heads)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    (B, H, q, D), kv_heads = query.shape, key.shape[1]
    if q != 1 or H == kv_heads:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query.reshape(B, kv_heads, H // kv_heads, D), key, value,
                                         attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2), None


# --- Local models: loaded, with the checks that turn a model that cannot work here into one line (exit 2) ----------
def load_pretrained(what: str, path: str, from_pretrained, trust_remote_code: bool, **kwargs):  # or one line
    try:
        return from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 - any loader failure is bad input here
        raise Failure(f"cannot load {what} from {path}: {reason(e)}")


def load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    tok = load_pretrained("a tokenizer", path, AutoTokenizer.from_pretrained, trust_remote_code)
    if tok.eos_token_id is None:
        raise Failure(f"tokenizer in {path} has no EOS token: responses could not end")
    if tok.pad_token_id is None:
        print(f"note: tokenizer in {path} has no pad token; using EOS ({tok.eos_token!r}) as pad token")
        tok.pad_token = tok.eos_token
    return tok


def check_positions(model, length: int, source: str) -> None:
    """Learned absolute positions (GPT-2, OPT) end at their table: past it, exit 2; rotary / ALiBi models: a note."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or length <= limit:
        return
    words = model.get_input_embeddings()
    if any(isinstance(m, nn.Embedding) and m is not words and limit <= m.num_embeddings <= limit + 2
           for m in model.modules()):
        raise Failure(f"--prompt-length + --response-length = {length} tokens, more than the {limit} learned "
                      f"positions of {source}")
    print(f"note: --prompt-length + --response-length = {length} tokens, more than {source}'s "
          f"max_position_embeddings ({limit})")


def check_models(args: Args, policy, ckpt: Optional[dict]) -> None:
    """What build_critic and reference_policy will make of the policy, built now on the meta device (no memory), so
    that what fails does so before anything is written: a separate critic of its class, LoRA adapters (new or saved);
    then whether its logits are its output layer's (check_output_layer)."""
    check_lora_targets(args, policy)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-meta parameter")  # (saved adapter weights go nowhere here)
        critic = value_model(policy.config) if args.critic == "separate" else None
        if args.lora_rank:
            with_lora(type(policy)(policy.config), args, "CAUSAL_LM", saved_model_dir(args, ckpt, "policy"))
        if args.critic_lora:
            with_lora(critic, args, "TOKEN_CLS", saved_model_dir(args, ckpt, "critic"))
    check_output_layer(policy)


def check_output_layer(model) -> None:
    """The logits of a few tokens as model_forward computes them (output_layer on the last hidden states) and as the
    model's forward does: a class that computes them otherwise is refused, not trained on wrong log-probs."""
    ids = torch.arange(min(4, model.get_input_embeddings().num_embeddings))[None]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=-1)
        ours = output_layer(model)[0](out.hidden_states[-1])
    if not torch.allclose(ours, out.logits, rtol=1e-4, atol=1e-4):
        raise Failure(f"{type(model).__name__} computes its logits otherwise than its output layer on its last hidden "
                      "states, as ppo_llm.py computes them (chunk by chunk)")


def check_lora_targets(args: Args, model) -> None:  # each name of --lora-target-modules ends a module's name
    targets = lora_targets(args)
    if not args.lora_rank or targets == "all-linear":
        return
    names = [n for n, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise Failure(f"--lora-target-modules: no module {', '.join(missing)} in the policy (its linear layers: "
                      f"{', '.join(linear)})")


def load_reward_model(args: Args, tok, device):
    """(model, tokenizer) of --reward-model-path, checked: a trained score head (Hugging Face gives a causal LM a random
    one), num_labels 1, embeddings for its tokenizer's tokens (its own, else the policy's), positions for the text."""
    if args.reward_model_path is None:
        return None, None
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path, verbosity = args.reward_model_path, hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (its load report of missing weights becomes the one line below)
    try:
        rm, info = load_pretrained("a reward model", path, AutoModelForSequenceClassification.from_pretrained,
                                   args.trust_remote_code, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing, heads = sorted(info["missing_keys"]), {n for n, _ in rm.named_children()} - {rm.base_model_prefix}
    if missing and all(k.split(".")[0] in heads for k in missing):
        raise Failure(f"--reward-model-path {path}: its score head ({', '.join(missing[:2])}) is not in its weights: "
                      "a causal LM or a base model, not a trained reward model")
    if missing:
        raise Failure(f"--reward-model-path {path}: weights not in its files: {', '.join(missing[:3])}"
                      f"{', ...' if len(missing) > 3 else ''} ({len(missing)} in all; Hugging Face would make them up "
                      "at random)")
    if rm.config.num_labels != 1:
        raise Failure(f"--reward-model-path {path}: {rm.config.num_labels} labels; a reward model gives one score "
                      "(num_labels=1)")
    own = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    rm_tok = load_tokenizer(path, args.trust_remote_code) if own else tok
    if len(rm_tok) > rm.get_input_embeddings().num_embeddings:
        whose = "its tokenizer" if own else "the policy's tokenizer (it has none)"
        raise Failure(f"--reward-model-path {path}: {rm.get_input_embeddings().num_embeddings} token embeddings, fewer "
                      f"than the {len(rm_tok)} tokens of {whose}")
    check_positions(rm, args.prompt_length + args.response_length, f"the reward model {path}")
    if rm.config.pad_token_id is None:  # (read by classifiers that pool the last token themselves)
        rm.config.pad_token_id = rm_tok.pad_token_id
    return frozen_in_bf16(disable_dropout(rm).eval().requires_grad_(False), args).to(device), rm_tok


# --- Command line: tyro, counts as 1e3, the frameworks' option names, one-line errors for bad values ----------
def parse_count(text: str) -> int:  # 64, 1e3 or 1_000; a number that is not whole is an error
    value = float(text.replace("_", ""))  # (ValueError: tyro says the flag wants an INT)
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


Count = Annotated[int, tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="INT", instance_from_str=lambda a: parse_count(a[0]),
    is_instance=lambda x: isinstance(x, int) and not isinstance(x, bool), str_from_instance=lambda x: [str(x)])]


def alias(*names: str):  # other spellings of a flag: the option names of the verl / ROLL / RLinf / TRL docs
    return tyro.conf.arg(aliases=names)


def given_fields(argv: list[str]) -> set[str]:  # the Args fields set on it, by any spelling (an alias, --no-x, --a_b)
    hints, spelling = typing.get_type_hints(Args, include_extras=True), {}
    for f in dataclasses.fields(Args):
        metadata = getattr(hints[f.name], "__metadata__", ())
        for name in ["--" + f.name.replace("_", "-"), *(a for m in metadata for a in getattr(m, "aliases", None) or ())]:
            spelling[name] = spelling["--no-" + name[2:]] = f.name
    return {spelling.get(a.split("=", 1)[0].replace("_", "-")) for a in argv if a.startswith("--")} - {None}


def parse_args(argv: Optional[list[str]] = None) -> Args:
    """tyro.cli (exit 2 on a bad flag; --resume: the checkpoint's arguments as defaults), implied options, validate."""
    argv = sys.argv[1:] if argv is None else argv
    resume = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                   if (a == "--resume" and i + 1 < len(argv)) or a.startswith("--resume=")), None)
    default, gpu_gone = None, False
    if resume is not None:
        ckpt = load_checkpoint(resume, keep=True)  # (kept for main)
        with checkpoint_fits(resume):
            saved = ckpt["args"]
            default = Args(**{f.name: saved[f.name] for f in dataclasses.fields(Args) if f.name in saved})
        default.resume = resume
        if default.cuda and not gpu_for_each_process():  # written on a GPU, resumed where there is none (enough)
            default.cuda, gpu_gone = False, True  # (--cuda by name is refused in validate)
    args = tyro.cli(Args, args=argv, default=default)
    resolve_implied(args, given_fields(argv))
    if gpu_gone and not args.cuda:
        found = (f"{torch.cuda.device_count()} for {os.environ.get('LOCAL_WORLD_SIZE')} processes"
                 if torch.cuda.is_available() else "none")
        print(f"note: {resume} was written on a GPU and torch finds {found} here: the run resumes on the CPU")
    for name in ("lora_rank", "lora_alpha", "lora_target_modules", "critic_lora") if resume is not None else ():
        was = saved.get(name, getattr(Args, name))  # (the saved adapters are of that shape)
        if getattr(args, name) != was:
            raise Failure(f"--{name.replace('_', '-')} {getattr(args, name)}: the checkpoint's is {was}; it cannot "
                          "change on resume")
    validate(args)
    return args


def resolve_implied(args: Args, given: set[str]) -> None:
    """Flags that set others, as the frameworks do, unless those others are given too (notes say what changed)."""
    if "use_kl_loss" in given and "use_kl_in_reward" not in given and args.use_kl_loss and args.use_kl_in_reward:
        # verl: "when use_kl_loss is used, we are not applying KL in the reward function"; --use-kl-in-reward adds it
        print("note: --use-kl-loss: no KL penalty in the reward (as verl); add --use-kl-in-reward for both")
        args.use_kl_in_reward = False
    if "target_kl" in given and "kl_ctrl_type" not in given:  # ROLL: a target means adaptive, ~ (None) fixed
        kind = "fixed" if args.target_kl is None else "adaptive"
        if args.kl_ctrl_type != kind:
            print(f"note: --target-kl {args.target_kl}: {kind} KL controller (as ROLL); --kl-ctrl-type chooses")
            args.kl_ctrl_type = kind
    if args.target_kl is None:
        args.target_kl = Args.target_kl  # (the adaptive controller's target, should --kl-ctrl-type ask for it)
    if args.adv_estimator in ("grpo", "rloo") and args.whiten_advantages and "whiten_advantages" not in given \
            and args.resume is None:  # (a resumed run keeps its checkpoint's choice)
        # verl's forms: whitening on top would shift every group by the batch's token-weighted mean, and would make
        # rloo (a scaled s - mean of the group) the same estimator as reinforce_plus_plus_baseline
        print(f"note: --adv-estimator {args.adv_estimator}: advantages not whitened again (as verl); "
              "--whiten-advantages whitens them (as ROLL)")
        args.whiten_advantages = False
    if args.reward_norm == "null":  # ROLL's spelling of none
        args.reward_norm = "none"
    minibatch = responses_per_minibatch(args)
    if "micro_batch_size" not in given and minibatch >= 1 and minibatch % args.micro_batch_size:
        # (--group-size 1, --n 3, another number of processes on resume): the largest size that divides, as
        # micro-batches change memory only; losses are normalised by the minibatch's totals
        size = max(d for d in range(1, args.micro_batch_size + 1) if minibatch % d == 0)
        print(f"note: --micro-batch-size {size}: {args.micro_batch_size} does not divide a minibatch's {minibatch} "
              "responses per process")
        args.micro_batch_size = size
    if args.kl_ctrl_type == "adaptive" and not args.use_kl_in_reward:
        print("note: the adaptive KL controller adapts the KL penalty in the reward, which is off: it stays inert")
    if "clip_ratio" in given and args.clip_ratio is not None:  # verl: clip_ratio_low/high default to clip_ratio
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if name not in given:
                setattr(args, name, args.clip_ratio)
    implied = {}  # RLinf's two ways of choosing the critic
    if "use_critic_model" in given and args.use_critic_model is not None:
        implied["--use-critic-model"] = "separate" if args.use_critic_model else "shared"
    if "loss_type" in given and args.loss_type is not None:
        implied["--loss-type"] = "shared" if args.loss_type == "actor_critic" else "separate"
    if "critic" in given:
        implied["--critic"] = args.critic
    if len(set(implied.values())) > 1:
        raise Failure("contradictory critic choice: " + ", ".join(f"{k} means --critic {v}"
                                                                  for k, v in implied.items()))
    if implied:
        args.critic = next(iter(implied.values()))
    if args.adv_estimator != "gae" and args.critic != "none":
        print(f"note: --adv-estimator {args.adv_estimator} uses no critic; --critic {args.critic} ignored")
        args.critic = "none"


def validate(args: Args) -> None:  # bad values: one line, exit 2, before anything is loaded or written
    values = {"--" + k.replace("_", "-"): v for k, v in vars(args).items()}
    checks = [(isinstance(v, float) and not math.isfinite(v), f"{k} must be a finite number, got {v}")
              for k, v in values.items()]  # (nan and inf pass the range checks unnoticed)
    checks += [(not values[k] > 0, f"{k} must be positive, got {values[k]}") for k in (
        "--num-iterations --rollout-batch-size --n --prompt-length --response-length --ppo-epochs "
        "--ppo-mini-batch-size --micro-batch-size --sft-batch-size --torch-threads --eval-every --tiny-hidden-size "
        "--tiny-num-layers --lr --critic-lr --sft-lr --max-grad-norm --eval-temperature --lora-alpha").split()]
    checks += [(values[k] < 0, f"{k} must be >= 0, got {values[k]}") for k in (
        "--checkpoint-every --stop-after --top-k --critic-warmup --lr-warmup-steps --eval-prompts --init-kl-coef "
        "--kl-loss-coef --vf-coef --weight-decay --eval-n --lora-rank").split()]
    checks += [(values[k] is not None and values[k] <= 0, f"{k} must be positive (or left unset), got {values[k]}")
               for k in ("--reward-clip --advantage-clip --value-clip --huber-delta --rollout-micro-batch-size "
                         "--logprob-forward-micro-batch-size").split()]  # (None: off, or the default)
    for bad, message in checks:
        if bad:
            raise Failure(message)
    world, local_world = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    files = [(k, values[k]) for k in ("--dataset", "--eval-dataset") if values[k] is not None]
    functions = (args.reward_fn or "exact").count(",") + 1
    checks = [
        ((args.sft_steps or 0) < 0, f"--sft-steps must be >= 0, got {args.sft_steps}"),
        (not 0 <= args.seed < 2**31, f"--seed must lie in [0, 2**31), got {args.seed}"),
        (args.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and args.n < 2,
         f"--adv-estimator {args.adv_estimator} compares responses within a group: needs --n >= 2, got {args.n}"),
        (args.reward_norm == "group" and args.n < 2,
         f"--reward-norm group normalises within a prompt's responses: needs --n >= 2, got {args.n}"),
        (args.reward_norm in ("batch", "running") and args.rollout_batch_size * args.n < 2,  # (a std of n - 1)
         f"--reward-norm {args.reward_norm} needs at least 2 responses per iteration (--rollout-batch-size x --n)"),
        (args.kl_ctrl_type == "adaptive" and (args.target_kl <= 0 or args.kl_horizon <= 0),
         "--kl-ctrl-type adaptive needs --target-kl > 0 and --kl-horizon > 0"),
        (args.critic_warmup and (args.adv_estimator != "gae" or args.critic == "none"),
         "--critic-warmup trains the critic alone first: it needs --adv-estimator gae and a critic"),
        (args.adv_estimator == "gae" and args.critic == "none",
         "--adv-estimator gae needs a critic: --critic separate or shared (or choose grpo/rloo/reinforce_plus_plus)"),
        (args.rollout_batch_size % args.ppo_mini_batch_size, f"--rollout-batch-size {args.rollout_batch_size} is not "
         f"divisible by --ppo-mini-batch-size {args.ppo_mini_batch_size}"),
        (world > 1 and (args.rollout_batch_size % world or args.ppo_mini_batch_size % world),  # (global sizes, verl)
         f"--rollout-batch-size {args.rollout_batch_size} and --ppo-mini-batch-size {args.ppo_mini_batch_size} must be "
         f"divisible by the number of processes {world}"),
        (responses_per_minibatch(args) % args.micro_batch_size,
         f"a minibatch's {responses_per_minibatch(args)} responses per process (ppo_mini_batch_size * n / processes) "
         f"are not divisible by --micro-batch-size {args.micro_batch_size}"),
        (args.clip_ratio_low < 0 or args.clip_ratio_high < 0, "--clip-ratio-low and --clip-ratio-high must be >= 0"),
        (args.tiny_hidden_size % 8,  # 4 heads of an even size (rotary embeddings)
         f"--tiny-hidden-size must be a multiple of 8, got {args.tiny_hidden_size}"),
        (args.temperature <= 0 or not 0 < args.top_p <= 1, "--temperature must be > 0 and --top-p in (0, 1]"),
        (args.dual_clip_loss and args.clip_ratio_c <= 1,
         f"--clip-ratio-c must be > 1 for dual clip, got {args.clip_ratio_c}"),
        (not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1), "--gamma and --lam must lie in [0, 1]"),
        *[(v is not None and not os.path.isfile(os.path.join(v, "config.json")),
           f"{k} {v}: not a local model directory (no config.json)")
          for k, v in [("--model-name-or-path", args.model_name_or_path),
                       ("--reward-model-path", args.reward_model_path)]],
        *[(not os.path.isfile(v), f"{k} {v}: no such file") for k, v in files],
        *[(os.path.splitext(v)[1].lower() not in DATA_FORMATS, f"{k} {v}: not a .jsonl, .json or .parquet file")
          for k, v in files],
        (args.dataset is None and args.eval_prompts > 10_000,
         f"--eval-prompts {args.eval_prompts}: the synthetic task holds out at most 10000 of its 100000 prompts"),
        (args.cuda and not torch.cuda.is_available(),
         "--cuda given but torch finds no CUDA device (without the flag the script uses the GPU if there is one)"),
        (args.cuda and world > 1 and torch.cuda.device_count() < local_world,
         f"--cuda: {local_world} processes on this machine, {torch.cuda.device_count()} GPU(s): one GPU each "
         "(--no-cuda runs them on the CPU)"),
        (args.reward_weights is not None and len(args.reward_weights) != functions,
         f"--reward-weights: {len(args.reward_weights or [])} weights for the {functions} functions of --reward-fn"),
        (args.critic_lora and (args.critic != "separate" or not args.lora_rank),
         "--critic-lora puts LoRA adapters on the separate critic: it needs --critic separate and --lora-rank"),
        (args.lora_rank and world > 1, "--lora-rank is not supported under torchrun yet (FSDP2 / DDP of a model whose "
         "adapters alone train is not tested here); run it in one process")]
    for bad, message in checks:
        if bad:
            raise Failure(message)


def responses_per_minibatch(args: Args) -> int:
    """Responses in a minibatch per process: ppo_mini_batch_size prompts (global) x n, shared by the processes."""
    return args.ppo_mini_batch_size // int(os.environ.get("WORLD_SIZE", "1")) * args.n


if __name__ == "__main__":  # the one error boundary
    rank = int(os.environ.get("RANK", "0"))
    if rank > 0:  # under torchrun rank 0 alone prints
        sys.stdout = open(os.devnull, "w")
    try:
        args = parse_args()
        for sig in (signal.SIGTERM, signal.SIGINT):  # main notes them from its first line and puts this back at its
            signal.signal(sig, signal.SIG_IGN)  # end: a signal while the interpreter exits is ignored
        main(args)
        code = 0
    except Failure as e:  # every rank finds bad input and rank 0 says it; a failed write is said where it happened
        if e.code == 1 or rank == 0:
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun ends the job when a rank exits: give rank 0 the time to say it
            time.sleep(5)
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C before main's handlers (in main, the run stops where nothing is half-written)
        code = 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # skip the interpreter's teardown, where gloo's threads now and
        if code:  # then abort a finished run ("terminate called without an active exception"); a failed run's
            atexit._run_exitfuncs()  # last TensorBoard scalars are written first
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
