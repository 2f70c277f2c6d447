"""One PPO iteration of ppo_llm.py at ROLL's lengths: 2,048-token prompts, 4,096-token responses, a 0.5B model.

    python benchmarks/llm_roll_lengths.py --out benchmarks/results/llm_roll_lengths     # on a GPU
    python benchmarks/llm_roll_lengths.py --dry-run --out /tmp/roll                     # tiny sizes on the CPU

ROLL documents 2,048-token prompts and 4,096-token responses as its defaults. Here a random-weight Qwen2 of
Qwen2.5-0.5B's shape (llm_throughput.py's qwen2.5-0.5b preset, 151,936 output rows; random weights do not say EOS, so
every response runs to 4,096 tokens) gets 32 prompts x 4 responses of llm_throughput.py's sorting task, each prompt
just under 2,048 tokens of the script's character tokenizer, through `ppo_llm.py --model-name-or-path DIR --dataset
FILE` for one iteration: GAE with a separate critic and the in-reward KL to a reference (three models of 0.5B), two
minibatches in micro-batches of 4 with gradient checkpointing, bf16 autocast on CUDA. Figures: the iteration's
seconds and their split (generation, scoring: the old and reference log-probs and the values, update), the peak GPU
memory, the process's peak memory, the run's wall time. Writes PREFIX.json and PREFIX.md (default
benchmarks/results/llm_roll_lengths). `--dry-run`: the same on the CPU at tiny sizes (a check of the tool).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import llm_throughput  # noqa: E402

SIZES = {  # model preset (and its vocabulary), then the run
    "full": dict(preset="qwen2.5-0.5b", vocab=151_936, prompt_length=2048, response_length=4096,
                 rollout_batch_size=32, n=4, micro_batch_size=4),
    "dry": dict(preset="tiny", vocab=99, prompt_length=64, response_length=24, rollout_batch_size=4, n=2,
                micro_batch_size=2),
}
FIGURES = {"seconds": "perf/iteration_s", "generation_s": "perf/generation_s", "scoring_s": "perf/scoring_s",
           "update_s": "perf/update_s", "peak_gib": "perf/peak_gpu_mem_gib", "response_length_mean":
           "response/length_mean", "gen_tokens_per_s": "perf/gen_tokens_per_s"}


def command(size: dict, model_dir: str, data: str, runs: str, cuda: bool) -> list:
    return [sys.executable, os.path.join(llm_throughput.ROOT, "ppo_llm.py"), "--model-name-or-path", model_dir,
            "--dataset", data, "--reward-fn", "exact", "--adv-estimator", "gae", "--num-iterations", "1",
            "--eval-prompts", "0", "--prompt-length", str(size["prompt_length"]), "--response-length",
            str(size["response_length"]), "--rollout-batch-size", str(size["rollout_batch_size"]), "--n",
            str(size["n"]), "--ppo-mini-batch-size", str(size["rollout_batch_size"] // 2), "--micro-batch-size",
            str(size["micro_batch_size"]), "--gradient-checkpointing", "--no-save-model", "--runs-dir", runs,
            "--cuda" if cuda else "--no-cuda"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(common.RESULTS, "llm_roll_lengths"), help="output path prefix")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    a = p.parse_args(argv)
    size, cuda = SIZES["dry" if a.dry_run else "full"], not a.dry_run
    shape = {k: v for k, v in llm_throughput.PRESETS[size["preset"]].items()
             if k in ("hidden", "layers", "heads", "kv_heads", "intermediate")}
    for stale in (a.out + ".json", a.out + ".md"):  # an earlier run's report never passes for this one's
        if os.path.exists(stale):
            os.remove(stale)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data, runs = (os.path.join(tmp, x) for x in ("model", "data.jsonl", "runs"))
        n_params = llm_throughput.build_model_dir(model_dir, **shape, vocab=size["vocab"],
                                                  max_positions=size["prompt_length"] + size["response_length"])
        # prompts of up to prompt_length - 1 characters (+ BOS): "Sort ... them: " + 2 characters a digit + " ->"
        longest = llm_throughput.write_dataset(data, 64, (size["prompt_length"] - 60) // 2)
        cmd = command(size, model_dir, data, runs, cuda)
        print(f"model: {n_params / 1e6:.1f}M parameters; prompts of {longest} characters\n$ {' '.join(cmd)}",
              flush=True)
        t0 = time.time()
        code, _, stderr, peak_rss = llm_throughput.run_child(cmd)
        if code:  # (its stdout: echoed as it ran)
            print(stderr[-3000:], flush=True)
        result = {"wall_s": round(time.time() - t0, 1), "peak_rss_gib": round(peak_rss / 2**30, 2), "error": None}
        if code != 0:
            result["error"] = (stderr.strip().splitlines() or ["?"])[-1]
        else:
            s = llm_throughput.read_scalars(os.path.join(runs, os.listdir(runs)[0]), list(FIGURES.values()))
            result.update({k: s[tag][0] if tag in s else None for k, tag in FIGURES.items()})
    write_reports(a.out, size, n_params, cuda, " ".join(["python benchmarks/llm_roll_lengths.py", *argv]), result)
    return 0 if result["error"] is None else 1


def write_reports(out: str, size: dict, n_params: int, cuda: bool, cmd: str, result: dict) -> None:
    def num(x, fmt=".1f"):
        return common.cell(x, fmt)

    info = common.machine_info()
    lines = [common.machine_markdown(info, cmd), "",
             f"Model: random-weight Qwen2 ({size['preset']}, {size['vocab']:,} output rows, {n_params / 1e6:.1f}M "
             f"parameters); {size['rollout_batch_size']} prompts of {size['prompt_length']} tokens x {size['n']} "
             f"responses of up to {size['response_length']} tokens; GAE with a separate critic and a reference; "
             f"micro-batch {size['micro_batch_size']}, gradient checkpointing; "
             f"{'CUDA, bf16 autocast' if cuda else 'CPU, fp32'}; the whole run took {result['wall_s']} s.",
             "", "| iteration (s) | generation (s) | scoring (s) | update (s) | peak GPU memory (GiB) | "
             "peak process memory (GiB) | response length (mean) |", "|---|---|---|---|---|---|---|"]
    if result["error"]:
        lines.append(f"| failed: {result['error']} | | | | | {num(result['peak_rss_gib'], '.2f')} | |")
    else:
        lines.append(" | ".join(["", num(result["seconds"]), num(result["generation_s"]), num(result["scoring_s"]),
                                 num(result["update_s"]), num(result["peak_gib"]), num(result["peak_rss_gib"], ".2f"),
                                 num(result["response_length_mean"], ".0f"), ""]).strip())
    common.write_report(out, lines, {"sizes": size, "params": n_params, "command": cmd, "machine": info,
                                     "result": result}, cuda)


if __name__ == "__main__":
    sys.exit(main())
