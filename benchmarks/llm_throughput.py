"""Generation and training tokens/s of ppo_llm.py on a ~100M-parameter Llama built from a config (random weights).

    python benchmarks/llm_throughput.py --cuda                       # eager, then --compile, on the GPU
    python benchmarks/llm_throughput.py --paths eager --iterations 3  # CPU (slow: for a check, not a figure)
    python benchmarks/llm_throughput.py --cuda -- --critic none --adv-estimator grpo

The model (hidden 768, 12 layers, 12 heads, MLP 3072, ~113M parameters with the script's character tokenizer) is
written with save_pretrained to a temporary directory and run through `ppo_llm.py --model-name-or-path` on the
synthetic task with no warm-start, so responses are random text up to --response-length tokens (a realistic length
mix, EOS comes at random). Each path runs --iterations PPO iterations; the figures are the median of
perf/gen_tokens_per_s and perf/train_tokens_per_s over the iterations after the first (the first holds CUDA
start-up and compilation). Response tokens are counted, as in the script's own metric: the tokens up to each
row's EOS, whereas the decoder steps every row until the batch's last one ends (with random weights about 40% of
the rows x steps decoded are counted), so generation tokens/s is useful tokens per second, below the raw decode
rate; compare paths by it only at similar mean response lengths. Training tokens count each of the --ppo-epochs
passes. Writes JSON and markdown (default benchmarks/results/llm_throughput.*).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PATHS = {"eager": [], "compile": ["--compile"], "gradient-checkpointing": ["--gradient-checkpointing"]}


def build_model_dir(path: str, hidden: int, layers: int, intermediate: int) -> int:
    """Writes a randomly initialised Llama + the script's tokenizer to `path`; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ppo_llm

    tok = ppo_llm.build_char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=1024, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def read_scalars(run_dir: str, tags: list) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in tags if t in acc.Tags()["scalars"]}


def precision_label(cuda: bool, extra: list) -> str:
    """What the runs computed in: ppo_llm's --precision among the passed-through flags (auto: bf16 with --cuda)."""
    precision = "auto"
    for i, x in enumerate(extra):
        if x == "--precision" and i + 1 < len(extra):
            precision = extra[i + 1]
        elif x.startswith("--precision="):
            precision = x.split("=", 1)[1]
    bf16 = precision == "bf16" or (precision == "auto" and cuda)
    return f"{'CUDA' if cuda else 'CPU'} {'bf16 autocast' if bf16 else 'fp32'}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", help="run on CUDA with bf16 autocast")
    p.add_argument("--paths", nargs="+", default=["eager", "compile"], choices=list(PATHS), help="paths to time")
    p.add_argument("--iterations", type=int, default=6, help="PPO iterations per path (the first is not counted)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size")
    p.add_argument("--layers", type=int, default=12, help="decoder layers")
    p.add_argument("--intermediate", type=int, default=3072, help="MLP size")
    p.add_argument("--rollout-batch-size", type=int, default=64, help="prompts per iteration")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--response-length", type=int, default=256, help="maximum response tokens")
    p.add_argument("--micro-batch-size", type=int, default=64, help="responses per forward/backward")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "llm_throughput"), help="output path prefix")
    a = p.parse_args(argv)
    if a.iterations < 2:
        common.die("--iterations must be >= 2 (the first is warm-up)")
    for name in ("hidden", "layers", "intermediate", "rollout_batch_size", "n", "response_length", "micro_batch_size"):
        if getattr(a, name) <= 0:
            common.die(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.hidden % 64:
        common.die("--hidden must be a multiple of 64 (head size 64)")
    minibatch = a.rollout_batch_size // 2 * a.n  # the runs use two minibatches per iteration
    if a.rollout_batch_size % 2 or minibatch % a.micro_batch_size:
        common.die(f"--micro-batch-size {a.micro_batch_size} must divide a minibatch's {minibatch} responses "
                   "(--rollout-batch-size / 2 x --n; --rollout-batch-size even)")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        n_params = build_model_dir(model_dir, a.hidden, a.layers, a.intermediate)
        print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
        for name in a.paths:
            runs = os.path.join(tmp, "runs_" + name)
            cmd = [sys.executable, os.path.join(ROOT, "ppo_llm.py"), "--model-name-or-path", model_dir,
                   "--sft-steps", "0", "--num-iterations", str(a.iterations), "--eval-prompts", "0",
                   "--rollout-batch-size", str(a.rollout_batch_size), "--ppo-mini-batch-size",
                   str(a.rollout_batch_size // 2), "--n", str(a.n), "--response-length", str(a.response_length),
                   "--micro-batch-size", str(a.micro_batch_size), "--no-save-model", "--no-torch-deterministic",
                   "--runs-dir", runs, *(["--cuda"] if a.cuda else []), *PATHS[name], *extra]
            print("$ " + " ".join(cmd), flush=True)
            t0 = time.time()
            res = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.time() - t0
            if res.returncode != 0:
                print(res.stdout[-3000:], res.stderr[-3000:], sep="\n")
                rows.append({"path": name, "error": (res.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall})
                continue
            run_dir = os.path.join(runs, os.listdir(runs)[0])
            s = read_scalars(run_dir, ["perf/gen_tokens_per_s", "perf/train_tokens_per_s", "response/length_mean"])
            row = {"path": name, "wall_s": round(wall, 1),
                   "gen_tokens_per_s": float(np.median(s["perf/gen_tokens_per_s"][1:])),
                   "train_tokens_per_s": float(np.median(s["perf/train_tokens_per_s"][1:])),
                   "response_length_mean": float(np.mean(s["response/length_mean"]))}
            rows.append(row)
            print(json.dumps(row), flush=True)

    info = common.machine_info()
    command = "python benchmarks/llm_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [common.machine_markdown(info, command), "",
             f"Model: Llama, hidden {a.hidden}, {a.layers} layers, MLP {a.intermediate}, {n_params / 1e6:.1f}M "
             f"parameters; {a.rollout_batch_size} prompts x {a.n} responses, up to {a.response_length} response "
             f"tokens, micro-batch {a.micro_batch_size}, {precision_label(a.cuda, extra)}. "
             "Generation tokens/s counts response tokens up to EOS (rows that end early still take decode steps).", "",
             "| path | generation tokens/s | training tokens/s | mean response length | wall (s) |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error']} | | | {r['wall_s']:.0f} |")
        else:
            lines.append(f"| {r['path']} | {r['gen_tokens_per_s']:,.0f} | {r['train_tokens_per_s']:,.0f} | "
                         f"{r['response_length_mean']:.1f} | {r['wall_s']:.0f} |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": info, "command": command, "params": n_params, "rows": rows}, f, indent=1)
    print("\n".join(lines[2:]))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
