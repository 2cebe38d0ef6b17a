"""The Dockerfile, checked without a Docker engine (none runs in CI): what it copies exists and
is not excluded by `.dockerignore`, every installed package is copied, and the image serves as a
non-root user with a health check on `/health`, a CUDA torch unless asked for the CPU one, and
no pip cache."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

REPO = Path(__file__).parents[1]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments
    dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")
    ))  # fmt: skip
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


DOCKERFILE = instructions((REPO / "Dockerfile").read_text())
IGNORED = [
    line.strip()
    for line in (REPO / ".dockerignore").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def copied_sources() -> list[str]:
    sources = []
    for keyword, args in DOCKERFILE:
        if keyword == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources.extend(words[:-1])
    return sources


def is_ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in IGNORED)


def test_the_parser_reads_copy_lines() -> None:
    parsed = instructions("FROM x\n# COPY nope ./\nCOPY a b ./\nRUN one \\\n    two\n")
    assert parsed == [("FROM", "x"), ("COPY", "a b ./"), ("RUN", "one      two")]


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    sources = copied_sources()
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path"
        assert not is_ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_every_installed_package_and_the_readme_are_copied() -> None:
    """`pip install .` in the image needs every package pyproject includes (loadtest too:
    `deepinfer-loadtest` is one of the image's commands) and the readme it names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(copied_sources())
    assert packages <= copied, packages - copied
    assert project["project"]["readme"] in copied


def _last(keyword: str) -> str:
    found = [args for kw, args in DOCKERFILE if kw == keyword]
    assert found, f"no {keyword}"
    return found[-1]


def test_the_entrypoint_is_a_project_command_run_as_a_non_root_user() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = [kw for kw, _ in DOCKERFILE].index("ENTRYPOINT")
    users = [args for kw, args in DOCKERFILE[:entrypoint] if kw == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert shlex.split(_last("ENTRYPOINT").strip("[]").replace(",", " "))[0] in scripts


def test_health_check_asks_health_on_the_served_port() -> None:
    check = _last("HEALTHCHECK")
    assert "/health" in check and "8000" in check and "8000" in _last("ENTRYPOINT")
    assert "8000" in _last("EXPOSE")


def test_cuda_torch_by_default_cpu_only_by_build_argument_no_pip_cache() -> None:
    args = {a.split("=")[0]: a.partition("=")[2] for kw, a in DOCKERFILE if kw == "ARG"}
    assert args["TORCH"] == "cuda"
    install = next(a for kw, a in DOCKERFILE if kw == "RUN" and "scripts/install.sh" in a)
    assert "cpu)" in install and "cuda) index= ;;" in install  # PyPI's torch is the CUDA build
    assert "PIP_NO_CACHE_DIR=1" in " ".join(a for kw, a in DOCKERFILE if kw == "ENV")


def test_the_checkpoint_cache_belongs_to_the_server_user() -> None:
    """The embedded checkpoint is generated into DEEPINFER_CACHE_DIR by the user that serves."""
    env = " ".join(a for kw, a in DOCKERFILE if kw == "ENV")
    cache = re.search(r"DEEPINFER_CACHE_DIR=(\S+)", env).group(1)
    user = _last("USER")
    keywords = [kw for kw, _ in DOCKERFILE]
    generate = next(
        i for i, (kw, a) in enumerate(DOCKERFILE) if kw == "RUN" and "ensure_embedded" in a
    )
    assert max(i for i, kw in enumerate(keywords) if kw == "USER") < generate
    assert any(
        f"chown {user}:{user} {cache}" in a for kw, a in DOCKERFILE[:generate] if kw == "RUN"
    )
