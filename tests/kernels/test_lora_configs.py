"""kernels/lora_configs.py: a swept table's plan at the step's row bucket, the default plan
for a shape or bucket it lacks."""

from __future__ import annotations

import json

import torch

from kernels.lora_configs import (
    BUCKETS, ExpandConfig, LoraPlan, ShrinkConfig, bucket, default_plan, plan_for, shape_key)

SWEPT = LoraPlan(ShrinkConfig(block_m=16, block_k=128, target_programs=256, max_splits=64),
                 ExpandConfig(block_m=16, block_n=128))


def test_buckets_round_up_and_stop_at_the_largest():
    assert [bucket(n) for n in (1, 2, 4, 5, 16, 17, 300)] == [1, 4, 4, 16, 16, 64, 1024]
    assert bucket(10**6) == BUCKETS[-1]


def test_a_swept_bucket_gives_its_plan_and_others_the_default(tmp_path):
    path = tmp_path / "lora_configs.json"
    key = shape_key(4096, 48, 6144, torch.bfloat16)
    path.write_text(json.dumps({"plans": {key: {"4": SWEPT.to_json()}}}))
    assert plan_for(4096, 48, 6144, 3, torch.bfloat16, path) == SWEPT
    assert plan_for(4096, 48, 6144, 1, torch.bfloat16, path) == default_plan(1, 48)
    assert plan_for(4096, 48, 6144, 3, torch.float32, path) == default_plan(3, 48)
    assert plan_for(4096, 16, 4096, 3, torch.bfloat16, path) == default_plan(3, 16)
    assert LoraPlan.from_json(json.loads(json.dumps(SWEPT.to_json()))) == SWEPT


def test_no_table_runs_the_default(tmp_path):
    assert plan_for(4096, 48, 6144, 3, torch.bfloat16, tmp_path / "none.json") == \
        default_plan(3, 48)
