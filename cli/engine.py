"""The in-process engine: the scheduler's policy driving a ModelRunner directly, no bus.

The same two cores as the services (``services/scheduler/scheduler.py`` plans, ``ModelRunner``
computes), stepped in one loop. Offline batch jobs and the GPU benchmarks use it, and comparing
it with the full stack measures what the service split costs (issue 4, benchmark f).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from services.scheduler.config import SchedulerConfig
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from services.worker.tp_group import start_group
from services.worker.tp_ranks import SingleRank
from shared.messages import GenerateRequest, ImageInput, SamplingParams, StepPlan, StepResult
from shared.models import ModelFiles


@dataclass
class Completion:
    request_id: str
    num_prompt_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each token's, where asked
    finish_reason: str | None = None
    first_token_time: float = 0.0  # perf_counter seconds
    finish_time: float = 0.0


@dataclass
class EngineStats:
    num_preemptions: int
    elapsed_s: float
    # (tokens computed, sequences, seconds from queueing to reading back) of every step
    steps: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def step_time_s(self) -> float:
        return sum(seconds for _, _, seconds in self.steps)

    @property
    def decode_steps(self) -> list[float]:
        """Seconds of each step of one token per sequence (CUDA graphs on GPU)."""
        return [seconds for num_tokens, num_seqs, seconds in self.steps if num_tokens == num_seqs]


class Engine:
    def __init__(self, scheduler_config: SchedulerConfig, worker_config: WorkerConfig,
                 model_files: ModelFiles) -> None:
        speculation = scheduler_config.speculative_config
        if speculation is not None and worker_config.speculative_config is None:  # as serve
            worker_config = msgspec.structs.replace(worker_config, speculative_config=speculation)
        ranks = SingleRank()
        if worker_config.tensor_parallel_size > 1:  # ranks 1.. as processes (tp_group.py)
            ranks, worker_config = start_group(worker_config, model_files)
        self.runner = build_runner(worker_config, model_files, ranks)
        self.scheduler = Scheduler(
            scheduler_config, num_blocks=self.runner.num_blocks, block_size=self.runner.block_size,
            max_model_len=self.runner.max_model_len, eos_token_ids=self.runner.eos_token_ids,
            model_name=self.runner.model_name,
            loras=LoraRegistry(worker_config.enable_lora, worker_config.max_loras,
                               worker_config.lora_module_list))

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any."""
        self.runner.ranks.close()

    def generate(self, prompts: list[list[int]], sampling: list[SamplingParams],
                 lora_names: list[str] | None = None,
                 images: list[list[ImageInput]] | None = None
                 ) -> tuple[list[Completion], EngineStats]:
        """Run every prompt to completion; completions come back in prompt order.
        ``lora_names``: per prompt, the LoRA adapter it runs with ("": the base model;
        the worker config's --lora-modules, docs/lora.md). ``images``: per prompt, its
        preprocessed images (docs/vision.md)."""
        lora_names = lora_names or [""] * len(prompts)
        if len(lora_names) != len(prompts):
            raise ValueError(f"{len(lora_names)} lora_names for {len(prompts)} prompts")
        completions: dict[str, Completion] = {}
        for index, (prompt, params, lora_name) in enumerate(
                zip(prompts, sampling, lora_names, strict=True)):
            request_id = f"offline-{index}"
            self.scheduler.add_request(GenerateRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=params,
                output_subject="", arrival_time=time.time(), lora_name=lora_name,
                images=images[index] if images else []))
            completions[request_id] = Completion(request_id, len(prompt))
        start = time.perf_counter()
        steps: list[tuple[int, int, float]] = []
        preemptions_before = self.scheduler.num_preemptions
        plans: dict[int, StepPlan] = {}
        # Step N+1 is planned and queued before step N's tokens are read back (the runner
        # feeds them in on the device); the scheduler counts them as pending meanwhile.
        while self.scheduler.has_work or self.runner.has_in_flight:
            plan = self.scheduler.schedule() if self.scheduler.has_work else None
            if plan is not None:
                plans[plan.step_id] = plan
                results = self.runner.submit(plan)
            elif self.runner.has_in_flight:  # every request waits for a token in flight
                results = self.runner.flush()
            else:
                raise RuntimeError("the scheduler has work but planned no step")
            for result in results:
                self._apply(plans.pop(result.step_id), result, completions, steps)
        stats = EngineStats(self.scheduler.num_preemptions - preemptions_before,
                            time.perf_counter() - start, steps)
        return list(completions.values()), stats

    def _apply(self, plan: StepPlan, result: StepResult, completions: dict[str, Completion],
               steps: list[tuple[int, int, float]]) -> None:
        steps.append((sum(s.num_new_tokens for s in plan.scheduled), len(plan.scheduled),
                      result.step_time_s))
        now = time.perf_counter()
        for emitted in self.scheduler.update(plan, result):
            output = emitted.output
            completion = completions[output.request_id]
            if output.error is not None:
                raise RuntimeError(f"{output.request_id}: {output.error.message}")
            if not completion.output_token_ids:
                completion.first_token_time = now
            completion.output_token_ids.extend(output.new_token_ids)
            completion.logprobs.extend(entry.logprob for entry in output.logprobs)
            if output.finish_reason is not None:
                completion.finish_reason, completion.finish_time = output.finish_reason, now

