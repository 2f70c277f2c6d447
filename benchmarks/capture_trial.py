"""ppo_atari_envpool.py with its CUDA graphs captured by hand: a candidate path, timed against the script's own.

    python benchmarks/capture_trial.py --cuda --compile --cudagraphs [the script's other flags]

The script's `--cudagraphs` is torch.compile's reduce-overhead mode. Its update breaks into several graphs (dynamo
stops at `zero_grad` and `backward`), each a CUDA graph of its own with eager launches between them; on an H100 it ran
at 0.75x LeanRL's `--compile --cudagraphs`, which captures each whole function in one graph (tensordict's
CudaGraphModule). Here the script runs unchanged except for `compile_hot_functions`: the action sampling and the
update are compiled in torch.compile's default mode (with `--compile`) and each captured whole in one
`torch.cuda.CUDAGraph` by `cuda_graphed`. benchmarks/gpu_check.py times it in stage 2 (`ours_hand_captured`), and
tests/test_gpu.py checks that it ends with the eager path's parameters; where it pays, `cuda_graphed` belongs in the
scripts' compile helpers.
"""

import dataclasses
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the script sets it when run itself (before torch loads)
import torch  # noqa: E402
from torch.utils import _pytree  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_atari_envpool as script  # noqa: E402

script_compile = script.compile_hot_functions


def cuda_graphed(fn, name: str, warmup: int = 2):
    """fn, run as it is for its first `warmup` calls (on a side stream: they create the optimizer's state and
    compile), then captured whole in one CUDA graph at the next call and replayed from then on. fn always gets the
    same input tensors, made at the first call (so that torch.compile sees the same kind of tensor at every call):
    each call copies its tensor arguments into them, and a replay returns the captured outputs, which the next call
    overwrites. Every call runs fn's work once."""
    stream, state = torch.cuda.Stream(), {"calls": 0}

    def run(*args):
        flat, spec = _pytree.tree_flatten(args)
        if "inputs" not in state:  # (flat, and as fn takes them)
            state["inputs"], state["spec"] = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat], spec
            state["args"] = _pytree.tree_unflatten(state["inputs"], spec)
        plain = [(x, c) for x, c in zip(flat, state["inputs"]) if not isinstance(c, torch.Tensor)]
        if spec != state["spec"] or any(x != c for x, c in plain):
            raise ValueError(f"{name}: called with other arguments than at its first call")
        for captured, x in zip(state["inputs"], flat):
            if isinstance(captured, torch.Tensor):
                if (x.shape, x.dtype) != (captured.shape, captured.dtype):
                    raise ValueError(f"{name}: a {x.dtype} {tuple(x.shape)} input, captured {tuple(captured.shape)}")
                captured.copy_(x)
        if state["calls"] < warmup:
            state["calls"] += 1
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = fn(*state["args"])
            torch.cuda.current_stream().wait_stream(stream)
            return out
        if "graph" not in state:
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):  # records fn's kernels without running them
                state["outputs"] = fn(*state["args"])
            print(f"capture_trial: {name} captured in one CUDA graph", flush=True)
        state["graph"].replay()
        return state["outputs"]
    return run


def compile_hot_functions(policy, update, agent, args):
    """The script's helper without reduce-overhead (compiled in the default mode with --compile, else eager), then,
    with --cudagraphs, each function captured by hand."""
    policy, update = script_compile(policy, update, agent, dataclasses.replace(args, cudagraphs=False))
    return (cuda_graphed(policy, "policy"), cuda_graphed(update, "update")) if args.cudagraphs else (policy, update)


if __name__ == "__main__":
    script.compile_hot_functions = compile_hot_functions  # main() looks the helper up when it runs
    try:
        script.main(script.parse_args())
    except script.Failure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
