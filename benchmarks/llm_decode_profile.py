"""Where a decoding step of ppo_llm.py's rollout spends its time on a GPU, kernel by kernel.

Per step: the wall time of the captured step and of the same step uncaptured, and the kernels that the step
launches, with their GPU time.

    python benchmarks/llm_decode_profile.py --out benchmarks/results/llm_decode_profile       # on a GPU, 0.5B
    python benchmarks/llm_decode_profile.py --preset tiny --device cpu --out /tmp/prof          # a check of the tool

The model is llm_throughput.py's preset (default qwen2.5-0.5b: random weights, 151,936 output rows) and the batch
one rollout's (128 prompts of its sorting task). On CUDA the decoder is the rollout's (make_decoder: a bf16 copy, a
static KV cache, each step one CUDA graph), sampling at temperature 1. A step's wall time is the difference between
two generations of different lengths divided by the extra tokens (the prefill and the set-up cancel), the best of 3;
the uncaptured step runs with deterministic algorithms off (ppo_llm.plain_kernels), as the captured one's forward.
The kernels: torch.profiler over the uncaptured step (the kernels a graph replays are the ones it captured), again as
the difference between two lengths, with deterministic algorithms off and, for the count, on (--torch-deterministic,
ppo_llm's default; the rollout's prompt forward and sampling run so). If the captured step's wall
time is near its kernels' GPU time the step is bound by what the kernels do (the table says which); if far above it,
by the gaps between many small kernels. On the CPU: ops and CPU time instead of kernels, no graph. Writes PREFIX.json
and PREFIX.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import llm_throughput  # noqa: E402

SHORT, LONG = 8, 40  # response lengths whose difference is timed (both shapes stay in the decoder's cache of 3)
PROFILED = (4, 12)  # and profiled (fewer steps: a profile of ~1,000 kernels a step takes its time to read)


def step_ms(P, decoder, ids, mask, stops, pad, cuda: bool) -> float:
    """Wall milliseconds of one decoding step: (best generation of LONG tokens - best of SHORT) / (LONG - SHORT)."""
    import torch

    gens = {n: torch.Generator(ids.device) for n in (SHORT, LONG)}  # (one each: a decoder's shape keeps its generator)

    def best(n: int) -> float:
        times = []
        for i in range(4):  # (the first: allocation and capture)
            gens[n].manual_seed(i)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            P.generate(decoder, ids, mask, n, stops, pad, gen=gens[n], check_every=LONG)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times[1:])
    return (best(LONG) - best(SHORT)) / (LONG - SHORT) * 1e3


def kernels_per_step(P, decoder, ids, mask, stops, pad, cuda: bool) -> dict:
    """{name: [launches per step, microseconds per step]} of the uncaptured step: the profile of a generation of
    PROFILED[1] tokens less one of PROFILED[0], divided by the extra steps (CUDA kernels; on the CPU, ops and their
    own CPU time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    tally = {}
    for n in PROFILED:
        gen = torch.Generator(ids.device)
        P.generate(decoder, ids, mask, n, stops, pad, gen=gen.manual_seed(0), check_every=LONG)  # (allocates)
        with profile(activities=acts) as prof:
            P.generate(decoder, ids, mask, n, stops, pad, gen=gen.manual_seed(0), check_every=LONG)
            if cuda:
                torch.cuda.synchronize()
        tally[n] = {e.key: (e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
                    for e in prof.key_averages() if e.device_type == kind}
    steps, out = PROFILED[1] - PROFILED[0], {}
    for name, (count, us) in tally[PROFILED[1]].items():
        c0, t0 = tally[PROFILED[0]].get(name, (0, 0.0))
        if count > c0:
            out[name] = [(count - c0) / steps, max(us - t0, 0.0) / steps]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(llm_throughput.PRESETS), default="qwen2.5-0.5b", help="model shape")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help="where to decode")
    p.add_argument("--batch", type=int, default=128, help="prompts decoded at once")
    p.add_argument("--vocab-size", type=int, default=None, help="override the preset's output rows")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "llm_decode_profile"), help="output path prefix")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ppo_llm as P

    cuda = a.device == "cuda"
    if cuda and not common.torch_sees_cuda():
        common.die("torch finds no CUDA device here; --device cpu checks the tool")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (as ppo_llm's --torch-deterministic sets it)
    cfg = dict(llm_throughput.PRESETS[a.preset], **({"vocab": a.vocab_size} if a.vocab_size else {}))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = os.path.join(tmp, "model"), os.path.join(tmp, "data.jsonl")
        n_params = llm_throughput.build_model_dir(model_dir, cfg["hidden"], cfg["layers"], cfg["heads"],
                                                  cfg["kv_heads"], cfg["intermediate"], cfg["vocab"])
        llm_throughput.write_dataset(data, a.batch, cfg["prompt_words"])
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = P.disable_dropout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)).eval()
        with open(data) as f:
            rows = [json.loads(line) for line in f]
    device = torch.device(a.device)
    model = model.to(device)
    torch.use_deterministic_algorithms(True, warn_only=True)  # (ppo_llm's default --torch-deterministic)
    captured = P.make_decoder(P.Args(cuda=cuda), model, device, 1)  # (None on the CPU)
    plain = P.StaticDecoder(captured.model if captured else P.rollout_copy(model, torch.float32), capture=False)
    ids, mask = (x.to(device) for x in P.encode_batch(tok, rows, 4096))
    stops, pad = P.stop_token_ids(tok, model), tok.pad_token_id
    with torch.no_grad():  # (the uncaptured step as the captured one runs: its forward without deterministic kernels)
        ms = {"captured": step_ms(P, captured, ids, mask, stops, pad, cuda) if captured else None}
        with P.plain_kernels():
            ms["uncaptured"] = step_ms(P, plain, ids, mask, stops, pad, cuda)
            kernels = kernels_per_step(P, plain, ids, mask, stops, pad, cuda)
        deterministic = kernels_per_step(P, plain, ids, mask, stops, pad, cuda)
    result = {"ms_per_step": ms["captured"], "ms_per_step_uncaptured": ms["uncaptured"],
              "kernels_per_step": sum(c for c, _ in kernels.values()),
              "gpu_ms_per_step": sum(t for _, t in kernels.values()) / 1e3,
              "kernels_per_step_deterministic": sum(c for c, _ in deterministic.values()),
              "gpu_ms_per_step_deterministic": sum(t for _, t in deterministic.values()) / 1e3,
              "tokens_per_s": a.batch / ms["captured"] * 1e3 if ms["captured"] else None}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    write_reports(a, argv, cfg, n_params, cuda, result, top, deterministic)
    print(f"decoding step, {a.batch} rows: " + ", ".join(f"{k} {common.cell(v, '.3g')}" for k, v in result.items()))
    return 0


def write_reports(a, argv: list, cfg: dict, n_params: int, cuda: bool, result: dict, top: list,
                  deterministic: dict) -> None:
    cmd = " ".join(["python benchmarks/llm_decode_profile.py", *argv])
    info = common.machine_info()
    what = "kernel" if cuda else "op"
    lines = [common.machine_markdown(info, cmd), "",
             f"Model: random-weight Qwen2 ({a.preset}, {cfg['vocab']:,} output rows, {n_params / 1e6:.1f}M "
             f"parameters); {a.batch} rows decoded at once, sampling; {'CUDA, bf16 copy' if cuda else 'CPU, fp32'}. "
             f"A step: captured {common.cell(result['ms_per_step'], '.3f')} ms, uncaptured "
             f"{common.cell(result['ms_per_step_uncaptured'], '.3f')} ms; its {result['kernels_per_step']:.0f} "
             f"{what}s take {result['gpu_ms_per_step']:.3f} ms of {'GPU' if cuda else 'CPU'} time "
             f"(deterministic algorithms on: {result['kernels_per_step_deterministic']:.0f} {what}s, "
             f"{result['gpu_ms_per_step_deterministic']:.3f} ms).", "",
             f"| {what} | per step | µs per step | share |", "|---|---|---|---|"]
    total = sum(t for _, (_, t) in top) or 1.0
    for name, (count, us) in top[:30]:
        lines.append(f"| `{name[:90]}` | {count:g} | {us:.1f} | {us / total:.1%} |")
    common.write_report(a.out, lines, {"command": cmd, "machine": info, "preset": a.preset, "batch": a.batch,
                                       "params": n_params, "result": result,
                                       "kernels": {k: {"per_step": c, "us_per_step": t} for k, (c, t) in top},
                                       "deterministic_kernels": {k: c for k, (c, _) in deterministic.items()}}, cuda)


if __name__ == "__main__":
    sys.exit(main())
