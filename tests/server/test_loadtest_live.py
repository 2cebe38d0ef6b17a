"""loadtest/ against a live `default` server: bounded runs whose numbers agree with each other
and with the server's own counters."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from loadtest.cli import main as loadtest_main
from loadtest.metrics import summarize
from loadtest.runner import RunConfig, run_load
from loadtest.workloads import WorkloadConfig, session

MODEL = "DeepSeek-V4.1-Flash"
NO_THINKING = {"thinking": {"type": "disabled"}}


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    values = re.findall(rf"^deepinfer:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def _run(url: str, workload: WorkloadConfig, **run: object):
    config = RunConfig(base_url=url, progress=False, **run)
    return asyncio.run(run_load(config, workload))


def _ordered(percentiles: dict[str, float | None]) -> bool:
    return percentiles["p50"] <= percentiles["p90"] <= percentiles["p99"]


def test_closed_loop_numbers_are_consistent_with_usage_and_server(default_server) -> None:
    url = default_server[0]
    workload = WorkloadConfig(
        kind="fixed", input_tokens=48, output_tokens=6, model=MODEL, extra_body=NO_THINKING
    )
    prompt_before = _counter(url, "prompt_tokens_total")
    generated_before = _counter(url, "generation_tokens_total")
    result = _run(url, workload, mode="closed", concurrency=3, num_requests=9, duration_s=120)
    records = result.records
    assert len(records) == 9 and result.cancelled == 0
    for record in records:
        assert record.ok, record.error
        assert record.completion_tokens == 6 and record.finish_reason == "length"  # ignore_eos
        assert record.prompt_tokens >= 48
        assert 0 < record.ttft <= record.e2e
        assert 1 <= len(record.token_times) <= record.completion_tokens
        assert all(gap >= 0 for gap in record.inter_token)
    summary = summarize(result)
    assert summary["succeeded"] == 9 and summary["errors"] == {}
    assert summary["output_tokens"] == 54
    # The load generator's token counts are the server's.
    assert summary["output_tokens"] == _counter(url, "generation_tokens_total") - generated_before
    assert summary["prompt_tokens"] == _counter(url, "prompt_tokens_total") - prompt_before
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert _ordered(summary[key]), key
    assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]
    assert summary["requests_per_s"] > 0 and 0 <= summary["cached_share"] <= 1
    assert summary["output_tokens_per_s"] == pytest.approx(54 / result.wall_s)
    # The server publishes its process CPU time: the run's share of it, per streamed token.
    assert summary["server_cpu_s"] > 0
    assert summary["server_cpu_ms_per_output_token"] == pytest.approx(
        summary["server_cpu_s"] * 1e3 / 54
    )


@pytest.mark.slow  # ~7 s
def test_agent_sessions_resend_a_growing_history_turn_by_turn(default_server) -> None:
    url = default_server[0]
    workload = WorkloadConfig(
        kind="agent",
        turns=3,
        input_tokens=16,
        system_tokens=64,
        tool_result_tokens=16,
        output_tokens=24,
        model=MODEL,
        extra_body=NO_THINKING,
    )
    result = _run(url, workload, mode="closed", concurrency=2, num_requests=6, duration_s=120)
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    by_session: dict[int, list] = {}
    for record in result.records:
        by_session.setdefault(record.session, []).append(record)
    assert sorted(by_session) == [0, 1]
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.start >= earlier.end  # a turn waits for the previous answer
            assert later.prompt_tokens > earlier.prompt_tokens + 16  # history + tool result


def test_client_processes_share_the_sessions_and_add_up(default_server) -> None:
    url = default_server[0]
    workload = WorkloadConfig(
        kind="agent",
        turns=2,
        input_tokens=16,
        system_tokens=32,
        tool_result_tokens=8,
        output_tokens=6,
        model=MODEL,
        extra_body=NO_THINKING,
    )
    generated_before = _counter(url, "generation_tokens_total")
    result = _run(
        url, workload, mode="closed", concurrency=2, num_requests=4, duration_s=120, processes=2
    )
    records = result.records
    assert len(records) == 4 and result.cancelled == 0 and all(r.ok for r in records)
    # one session each (sessions 0, 2, 4... in one process, 1, 3, 5... in the other), its
    # turns in order
    sessions = sorted({r.session for r in records})
    assert sessions == [0, 1]
    for index in sessions:
        assert [r.turn for r in records if r.session == index] == [0, 1]
    summary = summarize(result)
    assert summary["output_tokens"] == _counter(url, "generation_tokens_total") - generated_before
    first, last = min(r.start for r in records), max(r.end for r in records)
    assert result.started_at <= first and last - result.started_at <= result.wall_s + 1e-6
    assert summary["server_cpu_s"] > 0


def test_open_loop_stops_by_itself_and_cancelled_requests_free_the_server(default_server) -> None:
    url = default_server[0]
    workload = WorkloadConfig(
        kind="fixed", input_tokens=32, output_tokens=64, model=MODEL, extra_body=NO_THINKING
    )
    started = time.monotonic()
    result = _run(
        url, workload, mode="open", rate=8.0, num_requests=10_000, duration_s=1.5, grace_s=1.0
    )
    assert time.monotonic() - started < 1.5 + 1.0 + 10
    issued = len(result.records) + result.cancelled
    assert 1 <= issued < 100  # bounded by time, not by the huge count
    assert result.cancelled >= 1  # 64 tokens each cannot all finish in the grace time here
    deadline = time.monotonic() + 30
    while _counter(url, "num_requests_running") + _counter(url, "num_requests_waiting"):
        assert time.monotonic() < deadline, "cancelled requests still hold the engine"
        time.sleep(0.1)


def test_errors_are_counted_by_status(default_server) -> None:
    url = default_server[0]
    workload = WorkloadConfig(
        kind="fixed", output_tokens=4, model=MODEL, extra_body={"temperature": -1.0}
    )
    result = _run(url, workload, mode="closed", concurrency=2, num_requests=4, duration_s=60)
    summary = summarize(result)
    assert summary["succeeded"] == 0 and summary["errors"] == {"400": 4}
    assert "temperature" in result.records[0].error


def test_workloads_are_deterministic_by_seed() -> None:
    def bodies(seed: int, kind: str, **shape: object) -> list[dict]:
        config = WorkloadConfig(kind=kind, seed=seed, **shape)
        return [next(session(config, index)) for index in range(5)]

    assert bodies(1, "chat") == bodies(1, "chat") != bodies(2, "chat")
    chat = bodies(1, "chat")
    assert len({body["messages"][0]["content"] for body in chat}) == 1  # one shared system prompt
    assert len({body["messages"][1]["content"] for body in chat}) == 5
    fixed = bodies(0, "fixed", input_tokens=20)
    assert all(len(body["messages"][0]["content"].split()) == 20 for body in fixed)
    assert all(body["ignore_eos"] and body["stream_options"]["include_usage"] for body in fixed)
    assert all(body["tool_choice"] == "required" for body in bodies(0, "fixed", tool_share=1.0))
    json_bodies = bodies(0, "chat", json_share=1.0)
    assert all(body["response_format"]["type"] == "json_schema" for body in json_bodies)
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadConfig(kind="nope")


def test_cli_writes_json_table_and_plot(default_server, tmp_path: Path, capsys) -> None:
    url = default_server[0]
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    code = loadtest_main(
        [
            "--base-url", url, "--model", MODEL, "--workload", "chat", "--system-tokens", "64",
            "--input-tokens", "8", "--output-tokens", "4", "--mode", "open", "--rates", "2", "4",
            "--num-requests", "3", "--duration", "60", "--extra-body", json.dumps(NO_THINKING),
            "--out", str(out), "--plot", str(plot), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert [run["summary"]["label"] for run in report["runs"]] == ["rate 2/s", "rate 4/s"]
    assert all(run["summary"]["succeeded"] == 3 for run in report["runs"])
    assert len(report["runs"][0]["requests"]) == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "TTFT p50/p90/p99 ms" in table and "rate 4/s" in table


@pytest.mark.slow  # ~6 s
def test_agent_trace_replay_prints_cached_share_by_turn_and_where_sharing_breaks(
    default_server, tmp_path: Path, capsys
) -> None:
    url = default_server[0]
    out = tmp_path / "trace.json"
    code = loadtest_main(
        [
            "--base-url", url, "--model", MODEL, "--workload", "agent-trace", "--seed", "4",
            "--sessions", "2", "--turns", "3", "--system-tokens", "200", "--input-tokens", "16",
            "--tool-result-tokens", "24", "--output-tokens", "8", "--session-rate", "0.5",
            "--max-think", "0.2", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    records = report["requests"]
    assert sorted((r["session"], r["turn"]) for r in records) == [
        (0, 0), (0, 1), (1, 0), (1, 1), (1, 2)
    ]  # fmt: skip
    by_key = {(r["session"], r["turn"]): r for r in records}
    for (index, turn), record in by_key.items():
        assert record["status"] == "ok" and record["ttft"] > 0
        if turn:
            previous = by_key[(index, turn - 1)]
            assert (
                record["prompt_tokens"] > previous["prompt_tokens"] + previous["completion_tokens"]
            )
            # At least every full block of the previous prompt is served from the cache.
            assert record["cached_tokens"] >= previous["prompt_tokens"] // 128 * 128
    sharing = report["sharing"]
    assert sharing["before previous answer"] == 0
    assert sharing["full"] + sharing["in previous answer"] == 3
    assert (
        sharing["cached"] + sharing["not_cached"] + sharing["lost_to_rounding"]
        == (sharing["reusable"])
    )
    assert report["hit_tokens_by_tier"]["gpu"] > 0  # the server's own counter moved
    rows = {row["turn"]: row for row in report["by_turn"]}
    assert rows[1]["requests"] == 2 and rows[2]["cached_share"] > 0.5
    printed = capsys.readouterr().out
    assert "TTFT p50 ms" in printed and "sharing with the previous turn" in printed
