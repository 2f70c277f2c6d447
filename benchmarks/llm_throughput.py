"""Generation and training tokens/s of ppo_llm.py, and its generation side by side with Hugging Face `generate`.

    python benchmarks/llm_throughput.py --preset tiny --device cpu --paths eager --iterations 3
    python benchmarks/llm_throughput.py --preset qwen2.5-0.5b --device cuda --estimators gae grpo --paths eager compile
    python benchmarks/llm_throughput.py --preset tiny --save-model /tmp/m --save-dataset /tmp/d.jsonl  # files only

A preset is a random-weight Qwen2 written from a config (nothing is downloaded) with the script's character
tokenizer: `tiny` (hidden 64, 2 layers, Qwen2.5's 151,936 output rows: 9.8M parameters, under a minute on a CPU)
or `qwen2.5-0.5b` (Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, 151,936 rows, tied
embeddings). It is saved to a temporary directory with a JSONL of prompts with answers (about 75 characters for
tiny, 140 for 0.5b) and run through `ppo_llm.py --model-name-or-path DIR --dataset FILE`, once per estimator and
path. Figures: the median of perf/gen_tokens_per_s and perf/train_tokens_per_s over the iterations after the first
(which holds start-up and compilation), perf/peak_gpu_mem_gib (CUDA). Beside them, on the same model and one
rollout's batch of prompts (in the run's precision): response tokens/s of ppo_llm's `generate` and of Hugging Face's
`model.generate` (sampling, temperature 1, the same stop tokens and length limit), interleaved, best of 3 after a
warm-up (`--no-side-by-side` skips it). Response tokens are counted up to each row's EOS. Writes PREFIX.json
and PREFIX.md after every run, so that one stopped at a time limit keeps the rows it measured (default
benchmarks/results/llm_throughput.*).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PATHS = {"eager": [], "compile": ["--compile"], "gradient-checkpointing": ["--gradient-checkpointing"]}
ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus")
PRESETS = {  # model shape, then the run's sizes
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=151_936, rollout_batch_size=16,
                 n=2, response_length=16, prompt_words=8, micro_batch_size=8),
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936,
                         rollout_batch_size=32, n=4, response_length=256, prompt_words=40, micro_batch_size=16),
}


def build_model_dir(path: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                    vocab: int, max_positions: int = 4096) -> int:
    """Writes a randomly initialised Qwen2 + the script's character tokenizer to `path`; returns the parameter count.
    A vocabulary larger than the tokenizer's has output rows no text maps to (as a real model's logits)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import ppo_llm

    tok = ppo_llm.build_char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=max(vocab, len(tok)), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_dataset(path: str, rows: int, words: int) -> int:
    """A JSONL of `rows` prompts "Sort these digits in ascending order and write them: 3 1 4 ... ->" (words digits)
    with answers;
    returns the longest prompt in characters."""
    rng = random.Random(0)
    longest = 0
    with open(path, "w") as f:
        for _ in range(rows):
            d = [rng.randrange(10) for _ in range(words)]
            prompt = "Sort these digits in ascending order and write them: " + " ".join(map(str, d)) + " ->"
            longest = max(longest, len(prompt))
            f.write(json.dumps({"prompt": prompt, "answer": "".join(map(str, sorted(d)))}) + "\n")
    return longest


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


def side_by_side(model_dir: str, data: str, count: int, response_length: int, cuda: bool, bf16: bool,
                 repeats: int = 3, compiled: bool = False) -> dict:
    """Response tokens/s of ppo_llm's rollout generation and of Hugging Face's model.generate on the same weights and
    batch (the first `count` prompts), sampling at temperature 1 with the same stop tokens; best of `repeats` after a
    warm-up. On CUDA ppo_llm's is its StaticDecoder (make_decoder: a bf16 copy of the model in a bf16 run, a static KV
    cache, each step a CUDA graph), and Hugging Face's runs on the same copy; `compiled`: also the decoder with its
    step compiled (--compile)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ppo_llm

    device = torch.device("cuda" if cuda else "cpu")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = ppo_llm.disable_dropout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)).to(device)
    model.eval()
    torch.use_deterministic_algorithms(True, warn_only=True)  # (as ppo_llm's default --torch-deterministic)
    run_args = ppo_llm.Args(cuda=cuda, precision="bf16" if bf16 else "fp32")
    decoder = ppo_llm.make_decoder(run_args, model, device, 1)  # (None on the CPU: generate itself)
    # Hugging Face's on the weights ours decodes from (on CUDA in a bf16 run: bf16, no autocast), its own attention
    hf_model = copy.deepcopy(model).to(torch.bfloat16) if decoder is not None and bf16 else model
    autocast = bf16 and hf_model is model
    contenders = {"ours": decoder or model, "hf": hf_model}
    if compiled and decoder is not None:
        contenders["ours_compiled"] = ppo_llm.StaticDecoder(decoder.model, compile=True)
    with open(data) as f:
        rows = [json.loads(line) for line in f][:count]
    ids, mask = ppo_llm.encode_batch(tok, rows, 4096)
    ids, mask = ids.to(device), mask.to(device)
    stops = ppo_llm.stop_token_ids(tok, model)

    def generate(name, model, gen):
        if name != "hf":  # (model: ppo_llm's StaticDecoder on CUDA, else the model itself)
            return ppo_llm.generate(model, ids, mask, response_length, stops, tok.pad_token_id, gen=gen,
                                    bf16=autocast)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=response_length, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, eos_token_id=stops,
                                 pad_token_id=tok.pad_token_id)
        return out[:, ids.shape[1]:]

    result = {name: 0.0 for name in contenders}
    gens = {name: torch.Generator(device) for name in contenders}  # (one each: a decoder's graph keeps its own)
    for i in range(repeats + 1):  # (interleaved, so that a change of load hits all)
        for name, model in contenders.items():
            gens[name].manual_seed(i)
            torch.manual_seed(i)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            resp = generate(name, model, gens[name])
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            tokens = int(ppo_llm.response_mask_from(resp.cpu(), stops).sum())
            if i:  # (the first: warm-up)
                result[name] = max(result[name], tokens / seconds)
    return result


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model shape and run sizes")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="where to run (default: cpu)")
    p.add_argument("--cuda", action="store_true", help="the same as --device cuda")
    p.add_argument("--estimators", nargs="+", default=["gae"], choices=ESTIMATORS, help="--adv-estimator values")
    p.add_argument("--paths", nargs="+", default=["eager"], choices=list(PATHS), help="paths to time")
    p.add_argument("--iterations", type=int, default=3, help="PPO iterations per run (the first is not counted)")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "llm_throughput"), help="output path prefix")
    p.add_argument("--no-side-by-side", dest="side_by_side", action="store_false",
                   help="skip the generation side by side with Hugging Face (another run measured it)")
    p.add_argument("--decode-only", action="store_true", help="only the generation side by side, no PPO runs")
    p.add_argument("--decode-compiled", action="store_true",
                   help="CUDA: also time the rollout's decoder with its step compiled (ppo_llm --compile)")
    p.add_argument("--minibatches", type=int, default=2, help="minibatches per iteration (--ppo-mini-batch-size)")
    p.add_argument("--save-model", metavar="DIR", help="only write the preset's model to DIR (and --save-dataset)")
    p.add_argument("--save-dataset", metavar="FILE", help="only write the preset's JSONL of 64 prompts to FILE")
    for name in ("hidden", "layers", "intermediate", "vocab-size", "rollout-batch-size", "n", "response-length",
                 "micro-batch-size"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the preset's {name.replace('-', ' ')}")
    a = p.parse_args(argv)
    a.device = "cuda" if a.cuda else (a.device or "cpu")
    cfg = dict(PRESETS[a.preset])
    for key, name in (("hidden", "hidden"), ("layers", "layers"), ("intermediate", "intermediate"),
                      ("vocab", "vocab_size"), ("rollout_batch_size", "rollout_batch_size"), ("n", "n"),
                      ("response_length", "response_length"), ("micro_batch_size", "micro_batch_size")):
        value = getattr(a, name)
        if value is not None:
            if value <= 0:
                common.die(f"--{name.replace('_', '-')} must be positive, got {value}")
            cfg[key] = value
    if a.hidden is not None:  # (a shape of one's own: heads of 64)
        if a.hidden % 64:
            common.die("--hidden must be a multiple of 64 (head size 64)")
        cfg["heads"] = cfg["kv_heads"] = a.hidden // 64
    if a.iterations < 2:
        common.die("--iterations must be >= 2 (the first is warm-up)")
    if a.decode_only and not a.side_by_side:
        common.die("--decode-only measures the side-by-side generation that --no-side-by-side skips")
    k = a.minibatches
    minibatch = cfg["rollout_batch_size"] // max(k, 1) * cfg["n"]
    if k < 1 or cfg["rollout_batch_size"] % k or minibatch % cfg["micro_batch_size"]:
        common.die(f"--micro-batch-size {cfg['micro_batch_size']} must divide a minibatch's {minibatch} responses "
                   f"(--rollout-batch-size / --minibatches {k} x --n; --rollout-batch-size a multiple of it)")
    return a, cfg


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # passed on to ppo_llm.py
    argv = argv[:argv.index("--")] if "--" in argv else argv
    a, cfg = parse(argv)
    cuda = a.device == "cuda"
    if a.save_model or a.save_dataset:
        if a.save_model:
            n_params = build_model_dir(a.save_model, cfg["hidden"], cfg["layers"], cfg["heads"], cfg["kv_heads"],
                                       cfg["intermediate"], cfg["vocab"])
            print(f"model: {n_params / 1e6:.1f}M parameters in {a.save_model}")
        if a.save_dataset:
            print(f"dataset: 64 prompts of up to {write_dataset(a.save_dataset, 64, cfg['prompt_words'])} characters "
                  f"in {a.save_dataset}")
        return 0

    rows, label = [], precision_label(cuda, extra)
    for stale in (a.out + ".json", a.out + ".md"):  # an earlier run's report never passes for this one's
        if os.path.exists(stale):
            os.remove(stale)
    command = "python benchmarks/llm_throughput.py " + " ".join(argv + (["--", *extra] if extra else []))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = os.path.join(tmp, "model"), os.path.join(tmp, "data.jsonl")
        n_params = build_model_dir(model_dir, cfg["hidden"], cfg["layers"], cfg["heads"], cfg["kv_heads"],
                                   cfg["intermediate"], cfg["vocab"])
        longest = write_dataset(data, 256, cfg["prompt_words"])
        print(f"model: {n_params / 1e6:.1f}M parameters; prompts up to {longest} characters", flush=True)
        batch = cfg["rollout_batch_size"] * cfg["n"]
        gen_side = {"ours": None, "hf": None}
        if a.side_by_side:
            gen_side = side_by_side(model_dir, data, batch, cfg["response_length"], cuda,
                                    label.endswith("bf16 autocast"), compiled=a.decode_compiled)
            print(f"generate, {batch} prompts x {cfg['response_length']} tokens: " + ", ".join(
                f"{name} {v:,.0f} tok/s" for name, v in gen_side.items()), flush=True)
            lines = write_reports(a.out, a.preset, cfg, n_params, label, command, cuda, rows, gen_side)
        for estimator in [] if a.decode_only else a.estimators:
            for name in a.paths:
                runs = os.path.join(tmp, f"runs_{estimator}_{name}")
                cmd = [sys.executable, os.path.join(ROOT, "ppo_llm.py"), "--model-name-or-path", model_dir,
                       "--dataset", data, "--reward-fn", "exact", "--adv-estimator", estimator,
                       "--num-iterations", str(a.iterations), "--eval-prompts", "0", "--prompt-length", "1024",
                       "--rollout-batch-size", str(cfg["rollout_batch_size"]), "--ppo-mini-batch-size",
                       str(cfg["rollout_batch_size"] // a.minibatches), "--n", str(cfg["n"]), "--response-length",
                       str(cfg["response_length"]), "--micro-batch-size", str(cfg["micro_batch_size"]),
                       "--no-save-model", "--no-torch-deterministic", "--runs-dir", runs,
                       "--cuda" if cuda else "--no-cuda", *PATHS[name], *extra]
                print("$ " + " ".join(cmd), flush=True)
                t0 = time.time()
                code, _, stderr, peak_rss = run_child(cmd)
                wall = time.time() - t0
                row = {"estimator": estimator, "path": name, "wall_s": round(wall, 1),
                       "ours_generate_tokens_per_s": gen_side["ours"], "hf_generate_tokens_per_s": gen_side["hf"],
                       "peak_rss_gib": round(peak_rss / 2**30, 2)}
                if code != 0:  # (its stdout: echoed as it ran)
                    print(stderr[-3000:])
                    rows.append({**row, "error": (stderr.strip().splitlines() or ["?"])[-1]})
                else:
                    run_dir = os.path.join(runs, os.listdir(runs)[0])
                    s = read_scalars(run_dir, ["perf/gen_tokens_per_s", "perf/train_tokens_per_s",
                                               "response/length_mean", "perf/peak_gpu_mem_gib"])
                    row.update(gen_tokens_per_s=float(np.median(s["perf/gen_tokens_per_s"][1:])),
                               train_tokens_per_s=float(np.median(s["perf/train_tokens_per_s"][1:])),
                               response_length_mean=float(np.mean(s["response/length_mean"])),
                               peak_gpu_mem_gib=max(s["perf/peak_gpu_mem_gib"]) if "perf/peak_gpu_mem_gib" in s
                               else None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                # after every run: a benchmark stopped at a time limit leaves the rows it measured
                lines = write_reports(a.out, a.preset, cfg, n_params, label, command, cuda, rows, gen_side)
    print("\n".join(lines[2:]))
    return 0 if all("error" not in r for r in rows) else 1


def run_child(cmd: list) -> tuple:
    """(exit code, stdout, stderr, peak resident memory in bytes) of a child process: its VmHWM (Linux), read every
    0.1 s while it runs (its rusage's maxrss would include this process's own peak, which an exec inherits). Its
    stdout lines are echoed as they come, indented: a run stopped at a time limit shows how far it got."""
    with tempfile.TemporaryFile("w+") as err:
        proc, peak, lines = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True), 0, []

        def echo():
            for line in proc.stdout:
                lines.append(line)
                print("    " + line, end="", flush=True)
        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    peak = max([peak] + [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")])
            except OSError:  # (it has just ended)
                pass
            time.sleep(0.1)
        reader.join(timeout=10)  # (a grandchild that kept the pipe open would hold it past the child's end)
        err.seek(0)
        return proc.returncode, "".join(lines), err.read(), peak


def write_reports(out: str, preset: str, cfg: dict, n_params: int, label: str, command: str, cuda: bool,
                  rows: list, decode: dict) -> list:
    """OUT.md (the tables) and OUT.json (the generation side by side, per estimator and path, and the rows in order);
    returns the markdown lines."""
    num = common.cell
    info = common.machine_info()
    lines = [common.machine_markdown(info, command), "",
             f"Model: random-weight Qwen2 ({preset}), hidden {cfg['hidden']}, {cfg['layers']} layers, MLP "
             f"{cfg['intermediate']}, {cfg['vocab']:,} output rows, {n_params / 1e6:.1f}M parameters; "
             f"{cfg['rollout_batch_size']} prompts x {cfg['n']} responses, up to {cfg['response_length']} response "
             f"tokens, micro-batch {cfg['micro_batch_size']}, {label}. Tokens/s count response tokens up to EOS.", ""]
    if decode.get("ours") is not None:
        names = {"ours": "ppo_llm's rollout", "ours_compiled": "ppo_llm's rollout, step compiled",
                 "hf": "Hugging Face `generate`"}
        ratio = {k: "" if k == "hf" else f" ({v / decode['hf']:.2f}x)" for k, v in decode.items()}
        lines += ["Generation of one rollout's batch, side by side (tokens/s, best of 3 after a warm-up; the ratio to "
                  "Hugging Face's): " + "; ".join(f"{names[k]} {num(v)}{ratio[k]}" for k, v in decode.items()) + ".", ""]
    lines += ["| estimator | path | generation tokens/s (PPO run) | training tokens/s | peak GPU memory (GiB) | "
              "peak process memory (GiB) | wall (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['estimator']} | {r['path']} | failed: {r['error']} | | | | {r['wall_s']:.0f} |")
        else:
            lines.append(f"| {r['estimator']} | {r['path']} | {num(r['gen_tokens_per_s'])} | "
                         f"{num(r['train_tokens_per_s'])} | {num(r['peak_gpu_mem_gib'], '.1f')} | "
                         f"{num(r['peak_rss_gib'], '.2f')} | {r['wall_s']:.0f} |")
    results = {}
    for r in rows:
        results.setdefault(r["estimator"], {})[r["path"]] = {k: r.get(k) for k in (
            "gen_tokens_per_s", "hf_generate_tokens_per_s", "ours_generate_tokens_per_s", "train_tokens_per_s",
            "peak_gpu_mem_gib", "peak_rss_gib", "response_length_mean", "wall_s", "error")}
    common.write_report(out, lines, {"preset": preset, "config": cfg, "params": n_params, "precision": label,
                                     "command": command, "machine": info, "decode": decode, "results": results,
                                     "rows": rows}, cuda)
    return lines


if __name__ == "__main__":
    sys.exit(main())
