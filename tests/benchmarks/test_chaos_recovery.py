"""The chaos benchmark reads where a restarted process spent its start from its log."""

from benchmarks.chaos_recovery import startup_phases

LOG = """\
2026-12-02T14:03:11Z [info     ] startup_phase                  instance=a phase=imported service=tokenizer since_start_s=9.5
2026-12-02T14:03:12Z [info     ] startup_phase                  instance=a phase=serving service=tokenizer since_start_s=12.0
2026-12-02T14:05:00Z [info     ] tokenizer_started              instance=b model=SmolLM2 service=tokenizer
2026-12-02T14:05:01Z [info     ] startup_phase                  instance=b phase=imported service=tokenizer since_start_s=2.15
2026-12-02T14:05:04Z [info     ] startup_phase                  instance=b phase=tokenizer_loaded service=tokenizer since_start_s=5.21
2026-12-02T14:05:04Z [info     ] startup_phase                  instance=b phase=serving service=tokenizer since_start_s=5.5
2026-12-02T14:05:09Z [info     ] startup_phase                  phase=scheduler_attached since_start_s=9.9
"""


def test_only_the_last_start_counts_and_a_phase_keeps_its_first_time(tmp_path):
    log = tmp_path / "tokenizer.log"
    log.write_text(LOG)
    assert startup_phases(log) == {"imported": 2.15, "tokenizer_loaded": 5.21, "serving": 5.5,
                                   "scheduler_attached": 9.9}
    assert startup_phases(tmp_path / "missing.log") == {}
