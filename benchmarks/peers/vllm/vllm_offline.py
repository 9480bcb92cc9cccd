"""Peer on the GPU: vLLM's offline engine on the same dummy architectures and the same token-id
workloads as the project's benchmarks (`bash benchmarks/gpu/device_run.sh dump-workloads`), EOS
ignored.

  python3 benchmarks/peers/vllm/vllm_offline.py --model DIR --workloads c_fixed.json,e_sharegpt.json [--latency]

Prints one JSON line per workload and writes $OUT/vllm_<name>.json. Each result also holds
``period_by_seqs``: the engine's steps grouped by the sequences that got a token, each group's
[count, total s, mean ms, mean sequences], timed by the period between the steps' outputs (the
figure flotilla's offline_throughput reports under the same name). ``--runs 2`` times the
workload again in the same process (vLLM's steady state: its first timed run after the short
warm-up was 6% slower on the 70B TP2 ShareGPT workload, session 22). ``--profile-at N``
traces engine iterations N.. N + --profile-steps - 1 of the last run with vLLM's torch profiler
into $OUT/vllm_trace (summarize with benchmarks/gpu/kernel_summary.py). ``--lora-modules
name=path,...`` turns on vLLM's LoRA and spreads each workload's prompts round-robin over the
adapters, as flotilla's offline_throughput does (``--latency-lora NAME``: batch-1 with one).
"""
import argparse
import importlib.util
import json
import os
import time
from pathlib import Path


def record_steps(llm) -> list:
    """(when, sequences given a token) of each engine step's outputs as the front end reads
    them, appended while the engine runs (the engine core sends one batch of outputs a step)."""
    steps, client = [], llm.llm_engine.engine_core
    get_output = client.get_output

    def timed_get_output(*args, **kwargs):
        outputs = get_output(*args, **kwargs)
        if outputs.outputs:
            steps.append((time.perf_counter(), len(outputs.outputs)))
        return outputs

    client.get_output = timed_get_output
    return steps


def load_step_periods():
    """benchmarks/step_periods.py, loaded from its file: this script runs in vLLM's
    environment, apart from the repository's packages (its top-level ``kernels`` would
    shadow a library of that name), and that module is plain Python."""
    path = Path(__file__).resolve().parents[2] / "step_periods.py"
    spec = importlib.util.spec_from_file_location("flotilla_step_periods", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", default="")
    ap.add_argument("--latency", action="store_true", help="batch-1 decode, 1024-token context")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--quantization", default=None, help="e.g. fp8")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8")
    ap.add_argument("--speculative-config", default=None, help="JSON, vLLM's SpeculativeConfig fields")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="token-id prompts only")
    ap.add_argument("--tag", default="", help="suffix for the output names")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="timed runs of each workload")
    ap.add_argument("--profile-at", type=int, default=-1, help="engine iteration (-1: none)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--lora-modules", default="", help="name=path,...: prompts round-robin")
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--latency-lora", default="", help="a --lora-modules name for --latency")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    if a.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = a.max_num_batched_tokens
    if a.quantization:
        kw["quantization"] = a.quantization
    if a.kv_cache_dtype:
        kw["kv_cache_dtype"] = a.kv_cache_dtype
    if a.speculative_config:
        kw["speculative_config"] = json.loads(a.speculative_config)
    if a.skip_tokenizer_init:
        kw["skip_tokenizer_init"] = True
    if a.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = a.tensor_parallel_size
    loras = []
    if a.lora_modules:
        from vllm.lora.request import LoRARequest
        entries = [e.split("=", 1) for e in a.lora_modules.split(",") if e.strip()]
        loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(entries)]
        kw.update(enable_lora=True, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank)

    def spread(num: int):
        """Each prompt's adapter, round-robin (None: LoRA off)."""
        return [loras[i % len(loras)] for i in range(num)] if loras else None
    out = os.environ.get("OUT")
    if a.profile_at >= 0:
        kw["profiler_config"] = {
            "profiler": "torch", "torch_profiler_dir": str(Path(out or "/tmp", "vllm_trace")),
            "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False,
            "delay_iterations": a.profile_at, "max_iterations": a.profile_steps,
            "ignore_frontend": True}
    t0 = time.perf_counter()
    llm = LLM(model=a.model, load_format="dummy", dtype="bfloat16", max_model_len=a.max_model_len,
              gpu_memory_utilization=a.gpu_memory_utilization, seed=0, **kw)
    start_s = time.perf_counter() - t0
    import vllm
    cfg = llm.llm_engine.vllm_config.scheduler_config
    common = {"engine": f"vllm {vllm.__version__}", "model": a.model, "startup_s": start_s,
              "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    steps, step_periods = record_steps(llm), load_step_periods()

    def emit(name: str, res: dict) -> None:
        res = {**common, **res, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
               "speculative_config": a.speculative_config, "lora_adapters": len(loras)}
        print(json.dumps(res), flush=True)
        if out:
            Path(out, f"vllm_{name}{a.tag}.json").write_text(json.dumps(res, indent=1))

    # warm-up over varied shapes
    warm = [TokensPrompt(prompt_token_ids=[100 + (i * 37 + j) % 30000 for j in range(64 + 97 * i)])
            for i in range(24)]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, detokenize=not a.skip_tokenizer_init), use_tqdm=False,
                 lora_request=spread(len(warm)))  # (every adapter loaded before the clock)

    for path in [p for p in a.workloads.split(",") if p]:
        w = json.loads(Path(path).read_text())
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=not a.skip_tokenizer_init) for n in w["output_lens"]]
        for run in range(1, a.runs + 1):
            profiled = a.profile_at >= 0 and run == a.runs
            if profiled:
                llm.start_profile()
            steps.clear()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=spread(len(prompts)))
            el = time.perf_counter() - t
            if profiled:
                llm.stop_profile()
            got = [len(o.outputs[0].token_ids) for o in outs]
            assert got == w["output_lens"], "output lengths differ"
            n_in, n_out = sum(map(len, w["prompts"])), sum(w["output_lens"])
            name = Path(path).stem + (f"_run{run}" if a.runs > 1 else "")
            emit(name, {"workload": Path(path).stem, "run": run, "profiled": profiled,
                        "num_prompts": len(prompts), "input_tokens": n_in, "output_tokens": n_out,
                        "elapsed_s": el, "request_s": len(prompts) / el,
                        "output_tok_s": n_out / el, "total_tok_s": (n_in + n_out) / el,
                        "num_steps": len(steps), "period_by_seqs": step_periods.period_by_seqs(steps)})

    if a.latency:
        prompt = TokensPrompt(prompt_token_ids=[100 + (j * 7919) % 30000 for j in range(1024)])
        lora = [next(r for r in loras if r.lora_name == a.latency_lora)] if a.latency_lora else None
        def run(n):
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=not a.skip_tokenizer_init), use_tqdm=False,
                         lora_request=lora)
            return time.perf_counter() - t
        run(4)
        t1 = min(run(1) for _ in range(3))
        t129 = min(run(129) for _ in range(3))
        emit("b_latency", {"workload": "b_latency", "context": 1024, "latency_lora": a.latency_lora,
                           "ms_per_token": 1e3 * (t129 - t1) / 128})


if __name__ == "__main__":
    main()
