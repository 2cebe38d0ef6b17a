"""The server under `loadtest` in several configurations, one table (issue 17's server must-show).

Each mode starts its own `python -m server` on a free port (a fresh process: no state carried
between modes), waits for `/health`, runs `python -m loadtest` (closed loop, `fixed` workload)
once per concurrency, and stops it. The table has one row per (mode, concurrency): output
tokens/s, TTFT / ITL / TPOT p50, the server's CPU time per output token (from its
`/metrics`, engine processes included) and the load generator's CPU seconds per second.

    python3 benchmarks/serve_compare.py --device cuda --concurrency 1 256 --requests 8 512 \
        --modes async sync

Modes: `default` (the server's defaults), `async` / `sync` (`--[no-]async-scheduling`),
`process` / `in-process` (async, `--[no-]engine-process`), `spec-off` (`--speculative off`),
`invariant` (`--batch-invariant`); `--server-arg` adds arguments to every mode. The JSON of
every run goes to `--out` (default `$OUT`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine import envs
from engine.distributed.groups import free_port

MODES = {
    "default": [],
    "async": ["--async-scheduling"],
    "sync": ["--no-async-scheduling"],
    "process": ["--async-scheduling", "--engine-process"],
    "in-process": ["--async-scheduling", "--no-engine-process"],
    "spec-off": ["--speculative", "off"],
    "invariant": ["--batch-invariant"],
}


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until `url` answers 200. Raises RuntimeError if the server exits or never does."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s")


def _loadtest(base_url: str, args: argparse.Namespace, concurrency: int, requests: int, out: Path):
    command = [
        sys.executable, "-m", "loadtest", "--base-url", base_url, "--workload", "fixed",
        "--input-tokens", str(args.input_tokens), "--output-tokens", str(args.output_tokens),
        "--mode", "closed", "--concurrency", str(concurrency), "--num-requests", str(requests),
        "--duration", str(args.duration), "--no-progress", "--out", str(out),
        "--processes", str(args.client_processes),
    ]  # fmt: skip
    # loadtest exits 1 when a request failed, or was cancelled at the end of the run: the
    # summary counts those (the table's ok/req column), and the other modes still run
    out.unlink(missing_ok=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    after, wall_s = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    if done.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"loadtest exited with {done.returncode} ({' '.join(command)})")
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    client_cpu_s = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    # the clients' CPU per second of their life (start-up included): near 1.0 per client
    # process the load generator, not the server, is the bound
    summary["client_cpu_per_s"] = client_cpu_s / wall_s
    return summary


def run_mode(mode: str, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    port = free_port()
    log_path = out_dir / f"server_{mode}.log"
    server = [
        sys.executable, "-m", "server", "--model", args.model, "--device", args.device,
        "--port", str(port), "--max-num-seqs", str(max(args.concurrency)),
        *MODES[mode], *args.server_arg,
    ]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            ready_s = _wait_ready(f"{base_url}/health", process, args.ready_timeout)
            print(f"{mode}: ready in {ready_s:.0f} s ({' '.join(server[3:])})", flush=True)
            rows = []
            for concurrency, requests in zip(args.concurrency, args.requests, strict=True):
                json_path = out_dir / f"loadtest_{mode}_{concurrency}.json"
                summary = _loadtest(base_url, args, concurrency, requests, json_path)
                row = {"mode": mode, "concurrency": concurrency, "ready_s": ready_s}
                rows.append({**row, **summary})
                print(_row(rows[-1]), flush=True)
            return rows
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _row(r: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.1f}"

    p50 = {key: (r.get(key) or {}).get("p50") for key in ("ttft_ms", "itl_ms", "tpot_ms")}
    return (
        f"{r['mode']:<10} {r['concurrency']:>5} {r['succeeded']:>4}/{r['requests']:<4} "
        f"{r['output_tokens_per_s']:>10.1f} {ms(p50['ttft_ms']):>10} {ms(p50['itl_ms']):>8} "
        f"{ms(p50['tpot_ms']):>8} {ms(r.get('server_cpu_ms_per_output_token')):>12} "
        f"{r.get('client_cpu_per_s', 0.0):>11.2f}"
    )


HEADER = (
    f"{'mode':<10} {'conc':>5} {'ok/req':>9} {'out tok/s':>10} {'TTFT p50':>10} {'ITL p50':>8} "
    f"{'TPOT p50':>8} {'CPU ms/tok':>12} {'client CPU':>11}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", default=["async", "sync"], choices=list(MODES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 512], help="per concurrency")
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--duration", type=float, default=120.0, help="loadtest seconds per run")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--server-arg", action="append", default=[], help="to every mode")
    parser.add_argument("--client-processes", type=int, default=1, help="loadtest --processes")
    parser.add_argument("--out", type=Path, default=envs.benchmark_out_dir())
    args = parser.parse_args()
    if len(args.requests) != len(args.concurrency):
        parser.error("give one --requests value per --concurrency value")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(HEADER, flush=True)
    for mode in args.modes:
        rows += run_mode(mode, args, args.out)
    print("\n" + HEADER)
    for row in rows:
        print(_row(row))
    (args.out / "serve_compare.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
