"""`deepinfer-server --kv-cache-report DIR`: a directory's blocks by traffic class and age,
bytes against the budget, expired blocks; read-only."""

from __future__ import annotations

import os
import secrets
import time

import pytest

from engine.kv_cache.hashing import namespace_fingerprint
from engine.kv_cache.store.dirstore import DirBlockStore, DirStoreConfig
from engine.kv_cache.store.format import BlockIdentity, file_size
from engine.kv_cache.store.ttl import TTLPolicy
from server.cli import main

DAY = 86400.0
PAYLOAD = 16
FIELDS = {"model": {"architecture": "deepseek_v41"}, "numerics": {"replay": "exact"}}


def _store(root: str, clock: float) -> DirBlockStore:
    config = DirStoreConfig(root=root, tier="shared", max_bytes=1 << 30, min_free_bytes=0)
    return DirBlockStore(
        config,
        fingerprint=namespace_fingerprint(FIELDS),
        namespace_fields=FIELDS,
        payload_len=PAYLOAD,
        policy=TTLPolicy(),
        clock=lambda: clock,
    )


def _write(store: DirBlockStore, traffic_class: str) -> None:
    block = BlockIdentity(store.namespace, secrets.token_bytes(32), bytes(32), 0, (1, 2, 3))
    assert store.write(block, bytes(PAYLOAD), traffic_class)


def _snapshot(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            info = os.stat(os.path.join(folder, name))
            out[os.path.join(folder, name)] = (info.st_size, info.st_mtime_ns)
    return out


def _row(lines: list[str], name: str) -> list[str]:
    return next(line.split() for line in lines if line.split()[:1] == [name])


def test_the_report_counts_blocks_by_class_and_age_and_changes_nothing(tmp_path, capsys) -> None:
    root = str(tmp_path / "kv")
    now = time.time()
    fresh, two_days_ago, four_days_ago = (_store(root, t) for t in (now, now - 2 * DAY,
                                                                     now - 4 * DAY))  # fmt: skip
    for _ in range(3):
        _write(fresh, "chat")
    for _ in range(2):
        _write(fresh, "agent")
    _write(two_days_ago, "chat")  # 2 days old, 5 days left
    _write(two_days_ago, "agent")  # 2 days old, 1 day left
    _write(four_days_ago, "agent")  # expired a day ago, not yet collected
    before = _snapshot(root)

    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-cache-report", root, "--kv-cache-dir-bytes", "1M"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert _snapshot(root) == before  # read-only

    size = file_size(PAYLOAD)
    text = "\n".join(lines)
    assert f"namespace {fresh.namespace.hex()} (architecture deepseek_v41, replay exact)" in text
    used = 8 * size
    assert f"8 blocks, {used / 1024:.1f} KiB of 1.0 MiB ({used / (1 << 20):.1%}" in text
    assert "expired, not yet collected: 1 blocks" in text
    # class, blocks, bytes (2 fields), then <1h, 1h-1d, 1d-3d, 3d-7d, >=7d
    assert _row(lines, "chat")[1:2] + _row(lines, "chat")[4:] == ["4", "3", "0", "1", "0", "0"]
    assert _row(lines, "agent")[1:2] + _row(lines, "agent")[4:] == ["3", "2", "0", "1", "0", "0"]


def test_the_report_refuses_a_directory_without_a_cache(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--kv-cache-report", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "holds no KV cache" in capsys.readouterr().err
