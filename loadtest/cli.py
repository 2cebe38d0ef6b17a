"""`python -m loadtest` / `deepinfer-loadtest`: sweep rates or concurrencies, print a table,
write JSON (and a PNG); or replay a seeded agent / chatbot trace (`--workload agent-trace`,
`chat-trace`) against one or several servers and print the cached share and TTFT by turn.

    python -m loadtest --base-url http://127.0.0.1:8000 --workload chat \\
        --mode open --rates 0.5 1 2 --num-requests 50 --duration 120 --out run.json --plot run.png
    python -m loadtest --base-url http://127.0.0.1:8000 --workload agent-trace --sessions 4 \\
        --turns 4 --system-tokens 1536 --tool-result-tokens 96 --output-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path

from loadtest.metrics import summarize, table
from loadtest.replay import ReplayConfig, by_turn, format_report, replay, sharing_breaks, summary
from loadtest.runner import RunConfig, run_load
from loadtest.traces import (
    AgentTraceConfig,
    ChatTraceConfig,
    TraceSession,
    agent_trace,
    chat_trace,
)
from loadtest.workloads import WORKLOADS, WorkloadConfig

TRACES = ("agent-trace", "chat-trace")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loadtest", description=__doc__.splitlines()[0])
    target = p.add_argument_group("target")
    target.add_argument(
        "--base-url",
        nargs="+",
        default=["http://127.0.0.1:8000"],
        help="traces: several servers, requests routed by --route",
    )
    target.add_argument("--model", default="DeepSeek-V4.1-Flash")
    target.add_argument("--api-key", default=None)
    target.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help='JSON merged into every request, e.g. \'{"thinking": {"type": "disabled"}}\'',
    )
    shape = p.add_argument_group("workload")
    shape.add_argument("--workload", choices=sorted([*WORKLOADS, *TRACES]), default="fixed")
    shape.add_argument("--input-tokens", type=int, default=256)
    shape.add_argument("--output-tokens", type=int, default=64)
    shape.add_argument("--system-tokens", type=int, default=1024)
    shape.add_argument("--turns", type=int, default=4)
    shape.add_argument("--tool-result-tokens", type=int, default=128)
    shape.add_argument("--tool-share", type=float, default=0.0)
    shape.add_argument("--json-share", type=float, default=0.0)
    shape.add_argument(
        "--no-ignore-eos", action="store_true", help="fixed: let EOS end answers early"
    )
    trace = p.add_argument_group(
        "traces (agent-trace, chat-trace; --turns is the mean, --tool-result-tokens and "
        "--input-tokens medians, --output-tokens each turn's max_tokens)"
    )
    trace.add_argument("--sessions", type=int, default=4)
    trace.add_argument("--session-rate", type=float, default=0.05, help="sessions per second")
    trace.add_argument("--time-scale", type=float, default=1.0, help="trace s per real s")
    trace.add_argument("--max-think", type=float, default=2.0, help="longest pause, seconds")
    trace.add_argument("--route", choices=("session", "turn"), default="session")
    trace.add_argument("--revisit-probability", type=float, default=0.3, help="chat-trace")
    load = p.add_argument_group("load")
    load.add_argument("--mode", choices=("open", "closed"), default="closed")
    load.add_argument("--rates", type=float, nargs="+", default=[1.0], help="open: per second")
    load.add_argument("--concurrency", type=int, nargs="+", default=[4], help="closed")
    load.add_argument("--num-requests", type=int, default=100, help="per run")
    load.add_argument("--duration", type=float, default=60.0, help="seconds per run")
    load.add_argument("--grace", type=float, default=30.0, help="seconds for stragglers")
    load.add_argument("--timeout", type=float, default=300.0, help="per request")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes sharing the load (one streams ~5,000 tok/s at most)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="JSON result file")
    out.add_argument("--plot", type=Path, default=None, help="PNG: latency vs throughput")
    out.add_argument("--no-progress", action="store_true")
    return p


def configs(args: argparse.Namespace) -> tuple[WorkloadConfig, list[RunConfig]]:
    if len(args.base_url) != 1:
        raise ValueError("several --base-url only with a trace workload")
    workload = WorkloadConfig(
        kind=args.workload,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        system_tokens=args.system_tokens,
        turns=args.turns,
        tool_result_tokens=args.tool_result_tokens,
        tool_share=args.tool_share,
        json_share=args.json_share,
        ignore_eos=not args.no_ignore_eos,
        model=args.model,
        extra_body=args.extra_body,
        seed=args.seed,
    )
    common = {
        "base_url": args.base_url[0],
        "mode": args.mode,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "grace_s": args.grace,
        "request_timeout_s": args.timeout,
        "api_key": args.api_key,
        "progress": not args.no_progress,
        "seed": args.seed,
        "processes": args.processes,
    }
    if args.mode == "open":
        runs = [RunConfig(rate=rate, **common) for rate in args.rates]
    else:
        runs = [RunConfig(concurrency=n, **common) for n in args.concurrency]
    return workload, runs


def sweep(workload: WorkloadConfig, runs: list[RunConfig]) -> list[dict]:
    """Each run in turn; returns [{"config", "summary", "requests"}] per run."""
    report = []
    for run in runs:
        result = asyncio.run(run_load(run, workload))
        report.append(
            {
                "config": result.config_dict(),
                "summary": summarize(result),
                "requests": [
                    {**asdict(r), "ttft": r.ttft, "e2e": r.e2e, "tpot": r.tpot}
                    for r in result.records
                ],
            }
        )
    return report


def trace_sessions(args: argparse.Namespace) -> list[TraceSession]:
    """The sessions of `--workload agent-trace|chat-trace` (live-sized: fixed system prompt
    and output lengths; `cache.md` §5.1's shapes otherwise)."""
    common = {
        "seed": args.seed,
        "num_sessions": args.sessions,
        "session_rate": args.session_rate,
        "system_tokens_min": args.system_tokens,
        "system_tokens_max": args.system_tokens,
        "turns_mean": args.turns,
        "output_median": args.output_tokens,
        "output_min": args.output_tokens,
        "output_max": args.output_tokens,
    }
    if args.workload == "agent-trace":
        return agent_trace(
            AgentTraceConfig(
                **common,
                num_types=2,
                task_tokens=args.input_tokens,
                tool_result_median=args.tool_result_tokens,
                tool_result_max=4 * args.tool_result_tokens,
            )
        )
    return chat_trace(
        ChatTraceConfig(
            **common,
            num_variants=2,
            question_median=args.input_tokens,
            question_max=4 * args.input_tokens,
            revisit_probability=args.revisit_probability,
        )
    )


def run_trace(args: argparse.Namespace) -> int:
    config = ReplayConfig(
        base_urls=tuple(args.base_url),
        route=args.route,
        model=args.model,
        time_scale=args.time_scale,
        max_think_s=args.max_think,
        max_output_tokens=args.output_tokens,
        num_requests=args.num_requests,
        duration_s=args.duration,
        request_timeout_s=args.timeout,
        api_key=args.api_key,
        extra_body=tuple(args.extra_body.items()),
    )
    records, tiers = asyncio.run(replay(trace_sessions(args), config))
    print(format_report(records, tiers, f"{args.workload}, seed {args.seed}, route {args.route}"))
    if args.out is not None:
        report = {
            "config": {**vars(args), "out": str(args.out), "plot": None, "base_url": args.base_url},
            "summary": summary(records),
            "by_turn": by_turn(records),
            "sharing": sharing_breaks(records),
            "hit_tokens_by_tier": tiers,
            "requests": [asdict(r) for r in records],
        }
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 1 if any(r.status != "ok" for r in records) else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workload in TRACES:
        try:
            return run_trace(args)
        except ValueError as exc:
            parser().error(str(exc))
    try:
        workload, runs = configs(args)
    except ValueError as exc:
        parser().error(str(exc))
    report = sweep(workload, runs)
    summaries = [entry["summary"] for entry in report]
    print(table(summaries))
    if args.out is not None:
        args.out.write_text(json.dumps({"runs": report}, indent=2))
    if args.plot is not None:
        from loadtest.plot import plot_sweep

        plot_sweep(summaries, args.plot, f"{workload.kind} workload, {args.base_url[0]}")
    return 1 if any(s["errors"] for s in summaries) else 0
