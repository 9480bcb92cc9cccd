"""Load or recompute (services/scheduler/tiering.py): the measured speeds and the choice."""

from __future__ import annotations

import pytest

from services.scheduler.tiering import MIN_PREFILL_SAMPLE_TOKENS, TierSpeeds

BLOCK_BYTES = 1_000_000  # 1 MB per block
BLOCK_SIZE = 16


def measured(prefill_tokens_per_s=None, host=None, disk=None) -> TierSpeeds:
    return TierSpeeds(host_load_bytes_per_s=host, disk_read_bytes_per_s=disk,
                      prefill_tokens_per_s=prefill_tokens_per_s)


def test_nothing_measured_loads_every_hit():
    assert TierSpeeds().num_blocks_worth_loading(["host", "disk", "host"], BLOCK_BYTES,
                                                 BLOCK_SIZE) == 3


def test_unmeasured_load_speeds_count_as_free():
    # prefill measured, the tiers not yet: host and disk hits are loaded, to learn their speed
    speeds = measured(prefill_tokens_per_s=1_000)
    assert speeds.num_blocks_worth_loading(["host", "disk"], BLOCK_BYTES, BLOCK_SIZE) == 2


def test_host_hit_used_when_loading_is_faster():
    # recompute 16 tokens at 1,000 tok/s = 16 ms; load 1 MB at 1 GB/s = 1 ms
    speeds = measured(prefill_tokens_per_s=1_000, host=1e9)
    assert speeds.num_blocks_worth_loading(["host"] * 4, BLOCK_BYTES, BLOCK_SIZE) == 4


def test_hit_never_used_when_recompute_is_measured_faster():
    # recompute 16 tokens at 100,000 tok/s = 0.16 ms; load 1 MB at 1 GB/s = 1 ms
    speeds = measured(prefill_tokens_per_s=100_000, host=1e9)
    assert speeds.num_blocks_worth_loading(["host"] * 4, BLOCK_BYTES, BLOCK_SIZE) == 0


def test_slow_disk_blocks_are_left_to_recompute():
    # host block: saves 16 - 1 = 15 ms; disk block (read 50 ms + load 1 ms) loses 35 ms
    speeds = measured(prefill_tokens_per_s=1_000, host=1e9, disk=20e6)
    assert speeds.num_blocks_worth_loading(["host", "host", "disk", "disk"], BLOCK_BYTES,
                                           BLOCK_SIZE) == 2


def test_run_that_saves_most_may_cross_a_dearer_block():
    # +15, +15, -35 (disk), +15 x 4: the whole run saves 55 ms, more than the first two
    speeds = measured(prefill_tokens_per_s=1_000, host=1e9, disk=20e6)
    tiers = ["host", "host", "disk"] + ["host"] * 4
    assert speeds.num_blocks_worth_loading(tiers, BLOCK_BYTES, BLOCK_SIZE) == 7
    assert speeds.num_blocks_worth_loading(tiers[:4], BLOCK_BYTES, BLOCK_SIZE) == 2


def test_unknown_disk_speed_loads_disk_hits_when_host_is_worth_it():
    speeds = measured(prefill_tokens_per_s=1_000, host=1e9)
    assert speeds.num_blocks_worth_loading(["disk", "disk"], BLOCK_BYTES, BLOCK_SIZE) == 2


def test_no_hits_nothing_to_load():
    assert measured(prefill_tokens_per_s=1_000, host=1e9).num_blocks_worth_loading(
        [], BLOCK_BYTES, BLOCK_SIZE) == 0


def test_speeds_are_running_means():
    speeds = TierSpeeds()
    speeds.observe_load(1e9)
    assert speeds.host_load_bytes_per_s == 1e9
    speeds.observe_load(2e9)
    assert 1e9 < speeds.host_load_bytes_per_s < 2e9
    speeds.observe_load(0.0)  # a step without loads says nothing
    speeds.observe_disk_read(0.0)  # the kvstore has not measured its disk yet
    assert speeds.disk_read_bytes_per_s is None
    speeds.observe_disk_read(5e8)
    assert speeds.disk_read_bytes_per_s == 5e8


def test_prefill_speed_from_prompt_steps_only():
    speeds = TierSpeeds()
    speeds.observe_step(num_tokens=64, num_prompt_tokens=1, step_time_s=0.1)  # decodes
    speeds.observe_step(num_tokens=8, num_prompt_tokens=8, step_time_s=0.1)  # too small
    assert speeds.prefill_tokens_per_s is None
    speeds.observe_step(num_tokens=512, num_prompt_tokens=500, step_time_s=0.5)
    assert speeds.prefill_tokens_per_s == pytest.approx(1024)


def test_prefill_speed_excludes_the_steps_load_time():
    speeds = TierSpeeds()
    # 0.1 s of the step was loading 100 MB at 1 GB/s: 512 tokens in 0.4 s of compute
    speeds.observe_step(num_tokens=512, num_prompt_tokens=512, step_time_s=0.5,
                        load_bytes=100_000_000, load_bytes_per_s=1e9)
    assert speeds.prefill_tokens_per_s == pytest.approx(1280)
    assert speeds.host_load_bytes_per_s == 1e9


def test_learning_turns_loading_off_once_recompute_is_faster():
    speeds = TierSpeeds()
    tiers = ["host"] * 2
    assert speeds.num_blocks_worth_loading(tiers, BLOCK_BYTES, BLOCK_SIZE) == 2
    speeds.observe_step(num_tokens=MIN_PREFILL_SAMPLE_TOKENS * 100,
                        num_prompt_tokens=MIN_PREFILL_SAMPLE_TOKENS * 100, step_time_s=0.01)
    speeds.observe_load(1e8)  # 10 ms per block vs 0.05 ms to recompute it
    assert speeds.num_blocks_worth_loading(tiers, BLOCK_BYTES, BLOCK_SIZE) == 0


def test_the_decode_cost_is_the_slope_of_decode_steps_over_batch_size():
    speeds = TierSpeeds()
    assert speeds.decode_seq_s is None and speeds.decode_seq_cost_tokens is None
    for _ in range(50):  # one size only: no slope to read
        speeds.observe_step(4, 0, 0.060)
    assert speeds.decode_seq_s is None
    for _ in range(40):  # 50 ms + 10 ms a sequence
        for num_seqs in (1, 2, 3, 4, 5):
            speeds.observe_step(num_seqs, 0, 0.050 + 0.010 * num_seqs)
    assert speeds.decode_seq_s == pytest.approx(0.010, rel=0.05)
    assert speeds.decode_seq_cost_tokens is None  # no prefill speed yet
    speeds.observe_step(200, 200, 0.5)  # 400 prompt tokens/s
    assert speeds.decode_seq_cost_tokens == pytest.approx(4.0, rel=0.05)
    # steps with prompt tokens or loads are no decode samples
    moments = speeds.decode_moments
    speeds.observe_step(8, 0, 5.0, load_bytes=1000, load_bytes_per_s=1e3)
    speeds.observe_step(300, 290, 1.0)
    assert speeds.decode_moments == moments
