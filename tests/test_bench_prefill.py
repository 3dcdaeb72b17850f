"""`jaxfill bench prefill` end to end on the tiny preset: table, JSON, PNGs, KV bytes
allocated vs the planner's formula, chunk sweep, decay, and bad input -> exit code 2.

Timings here are not asserted beyond sanity (speed is measured by benchmarks with
committed results, see benchmarks/results/prefill_bench_bench.json): the one timing
check is that no run beats the planner's floor by 2x, which would mean the FLOP count or
the measured CPU peak is wrong, not that the machine is noisy.
"""

from __future__ import annotations

import json

import pytest

from jaxfill.serving.cli import main


@pytest.mark.slow
def test_bench_prefill_tiny(tmp_path, capsys):
    rc = main(["bench", "prefill", "--config", "tiny_random", "--lengths", "64", "128", "--chunk-sizes", "0", "64",
               "--repeats", "2", "--out", str(tmp_path), "--hardware", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "[3/3] len=128 chunk=64" in out.err  # progress
    assert "skipped len=64 chunk=64: chunk >= prompt length" in out.err  # said, not silently dropped
    assert out.err.count("measuring this CPU") == 2 and "before the timed runs" in out.err
    assert "meas/floor" in out.out and "TTFT(128)/TTFT(64)" in out.out
    result = json.loads((tmp_path / "prefill_bench_tiny_random.json").read_text())
    points = {(p["prompt_len"], p["chunk"]): p for p in result["points"]}
    assert set(points) == {(64, 0), (128, 0), (128, 64)}  # chunk >= length: skipped
    for p in points.values():
        assert len(p["times_s"]) == 2 and p["ttft_s"] > 0
        assert len(p["probe_flops_per_s"]) == 2
        # tiny: 2 layers of K+V x 2 kv heads x 32 x 4 bytes... the engine's real allocation
        assert p["kv_bytes_per_token_allocated"] == p["kv_bytes_per_token_formula"] == 2 * 4 * 2 * 32 * 4
        assert p["kv_cache_slots"] >= p["prompt_len"]
        assert p["ttft_over_floor"] > 0.5, p
        assert p["tokens_per_s"] == pytest.approx(p["prompt_len"] / p["ttft_s"])
    assert result["decay"][0]["prompt_len"] == 64 and result["decay"][0]["measured"] > 0
    assert result["hardware"]["name"] == "cpu" and result["attention_impl"] in ("xla", "reference")
    for stem in ("ttft", "tokens_per_s", "chunks"):
        png = tmp_path / f"prefill_bench_tiny_random_{stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "4096"], "max_model_len=4096"),
    (["--set", "mesh.tensor=2"], "one device"),
    (["--hardware", "a100"], "unknown hardware"),
    (["--chunk-sizes", "-1"], "chunk sizes"),
])
def test_bench_prefill_bad_input(argv, message, tmp_path, capsys):
    rc = main(["bench", "prefill", "--config", "tiny_random", "--out", str(tmp_path), "--no-plots"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_default_output_is_a_fresh_directory(tmp_path, monkeypatch, capsys):
    """Without --out a run writes under ./jaxfill-bench/prefill-<time>/, never into
    benchmarks/results, and a second run gets its own directory."""
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "prefill", "--config", "tiny_random", "--lengths", "16", "--repeats", "1", "--no-plots"]
    assert main(argv) == 0 and main(argv) == 0
    runs = sorted((tmp_path / "jaxfill-bench").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("prefill-") for r in runs)
    for run in runs:
        assert [f.name for f in run.iterdir()] == ["prefill_bench_tiny_random.json"]
    assert not (tmp_path / "benchmarks").exists()
    assert str(runs[1].relative_to(tmp_path)) in capsys.readouterr().err


def test_hardware_help_lists_the_aliases(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "h100_sxm (also: h100)" in text and "tpu_v5e (also: v5e, v5litepod)" in text

