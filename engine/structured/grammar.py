"""Grammar specs and their compilation into xgrammar token-level grammars.

A `GrammarSpec` is plain data: a kind and its source text. `GrammarCompiler` turns it into an
`xgrammar.CompiledGrammar` for one tokenizer (the model's vocabulary, EOS as the stop token),
caches the result by (kind, source) in an LRU, and offers `compile_async` for the request path:
compilation runs in a worker thread, bounded by a timeout, and every failure is a `GrammarError`
whose message names the problem (the server answers 400 with it).

Kinds and sources:

    json            a JSON Schema document; "" = any JSON object (`json_object`)
    regex           a regular expression the whole output must match
    ebnf            an xgrammar EBNF grammar with a `root` rule
    structural_tag  a `xgrammar.StructuralTag` as JSON (tool calls, thinking-aware constraints)

`spec_for_constraint` maps the recipe's `OutputConstraint` kinds (`json`, `regex`, `tool_call`,
`tool_call_required`, `recipe.md` §5.4) onto specs; tool calls use xgrammar's builtin
`deepseek_v4_1` structural tag (DSML `<｜DSML｜ calls>` blocks).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pydantic
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from xgrammar import structural_tag as st

from engine.structured.formats import strict_formats, unenforced_keyword

if TYPE_CHECKING:
    from engine.structured.matcher import RequestMatcher

GRAMMAR_KINDS = ("json", "regex", "ebnf", "structural_tag")

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Compilations running at once, abandoned (timed-out) ones included: xgrammar cannot cancel a
# compilation, so this bounds the CPU a stream of pathological schemas can take from the engine.
DEFAULT_MAX_COMPILATIONS = 2
DEFAULT_COMPILE_THREADS = 2
# At interpreter exit, abandoned compilations get this long to finish (see `_join_compilations`).
EXIT_COMPILE_WAIT_S = 120.0

DSML_MARKER = "｜DSML｜"
CALLS_OPENING = "<｜DSML｜ calls>\n"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
_TOOL_STRUCTURAL_TAG_MODEL = "deepseek_v4_1"
_ANY_JSON_OBJECT = '{"type": "object"}'
# Longest whitespace run allowed between JSON tokens. Compact (the default): one character, so
# `{"a": 1}` and `{"a":1}` but no runs of newlines a random or degenerate model loops on. Free
# (`json_whitespace: "any"`): room for pretty-printing, still bounded.
JSON_COMPACT_WHITESPACE = 1
JSON_MAX_WHITESPACE = 16
# xgrammar prefixes C++ errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_NATIVE_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")

logger = logging.getLogger(__name__)

# Compilation threads still running. A daemon thread that returns from xgrammar while the
# interpreter finalises is unwound by pthread_exit through C++ frames, and the process aborts
# ("terminate called without an active exception"), so exit waits for them.
_compile_threads: set[threading.Thread] = set()
_compile_threads_lock = threading.Lock()


def _start_compile_thread(thread: threading.Thread) -> None:
    with _compile_threads_lock:
        if not _compile_threads:
            atexit.unregister(_join_compile_threads)
            atexit.register(_join_compile_threads)
        _compile_threads.add(thread)
    thread.start()


def _compile_thread_done() -> None:
    with _compile_threads_lock:
        _compile_threads.discard(threading.current_thread())


def _join_compile_threads() -> None:
    deadline = time.monotonic() + EXIT_COMPILE_WAIT_S
    with _compile_threads_lock:
        running = list(_compile_threads)
    if running:
        logger.warning("waiting for %d grammar compilation(s) to finish before exit", len(running))
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid source, unsupported feature, or compile timeout."""


class GrammarCompilerBusyError(GrammarError):
    """Every compilation slot stayed taken for the whole timeout (retry later; not the
    request's fault)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` (one of `GRAMMAR_KINDS`) and its `source` text.

    `token_marker`: a marker string (a single added token) that this grammar matches as text but
    that must only ever be emitted as its dedicated token; matchers enforce it with a
    `MarkerGuard` (see `GrammarCompiler.guard_for`).
    json_whitespace: longest whitespace run between JSON tokens (kind `json`; structural tags
    carry theirs in the source). The spec is the cache key, so equal specs share one compiled
    grammar.
    """

    kind: str
    source: str
    token_marker: str | None = None
    json_whitespace: int = JSON_COMPACT_WHITESPACE

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(
                f"unknown grammar kind {self.kind!r}; expected one of {GRAMMAR_KINDS}"
            )
        if self.json_whitespace < 1:
            raise GrammarError(f"json_whitespace must be >= 1, got {self.json_whitespace}")


# ----------------------------------------------------------------------------------------------
# Specs from request constraints
# ----------------------------------------------------------------------------------------------


def spec_for_constraint(
    kind: str,
    schema: str,
    *,
    thinking: bool = False,
    parallel_tool_calls: bool = True,
    starts_in_tool_calls: bool = False,
    json_whitespace: int = JSON_COMPACT_WHITESPACE,
) -> GrammarSpec:
    """The spec enforcing a recipe `OutputConstraint(kind, schema)` (`recipe.md` §5.4).

    kind: `json` (schema or "" for json_object), `regex`, `ebnf`, `tool_call` (tools offered,
    tool_choice auto) or `tool_call_required` (schema: compact JSON array of Chat-style tools).
    thinking: the prompt ends in `<think>`; free reasoning is allowed up to the `</think>` token
    and the constraint applies after it.
    parallel_tool_calls, starts_in_tool_calls: see `tool_call_spec` (tool-call kinds only).
    json_whitespace: longest whitespace run between JSON tokens (JSON answers and tool
    arguments).

    Raises:
        GrammarError: unknown kind, a tool list that is not valid JSON / not accepted, or a
            JSON Schema keyword that is not enforced (`check_schema_keywords`).
    """
    if kind in ("tool_call", "tool_call_required"):
        return tool_call_spec(
            schema,
            is_required=kind == "tool_call_required",
            thinking=thinking,
            parallel_tool_calls=parallel_tool_calls,
            starts_in_tool_calls=starts_in_tool_calls,
            json_whitespace=json_whitespace,
        )
    if kind not in ("json", "regex", "ebnf"):
        raise GrammarError(f"unknown output constraint kind {kind!r}")
    if kind == "json" and schema:
        schema = _strict_schema_text(schema)
    if not thinking:
        return GrammarSpec(kind, schema, json_whitespace=json_whitespace)
    content = _content_format(kind, schema, json_whitespace)
    return GrammarSpec("structural_tag", _after_reasoning(content))


def tool_call_spec(
    tools_json: str,
    *,
    is_required: bool,
    thinking: bool,
    parallel_tool_calls: bool = True,
    starts_in_tool_calls: bool = False,
    json_whitespace: int = JSON_COMPACT_WHITESPACE,
) -> GrammarSpec:
    """The DSML tool-call structural tag for a compact JSON array of Chat-style tools.

    is_required: at least one call must be made (tool_choice required or a named tool; the
    recipe passes only that tool then); otherwise free text is allowed but any `<｜DSML｜ calls>`
    block that starts must complete validly against the tools' parameter schemas.
    thinking: the structural tag starts inside reasoning (the prompt ends in `<think>`); the
    tool-call format applies after the `</think>` token (required: right after it, the answer
    is the calls block).
    parallel_tool_calls: False allows one call at most (exactly one when required).
    starts_in_tool_calls: the prompt already ends with the opening of the calls block (the
    recipe prefills `\n\n<｜DSML｜ calls>\n` for a required or named tool_choice), so the
    output starts with the first invoke.
    json_whitespace: longest whitespace run inside JSON (non-string) argument values.

    NOTE: xgrammar's builtin tag matches the DSML markers (`<｜DSML｜ calls>`, `invoke`,
    `parameter`) as text, so a marker could also be spelled from ordinary byte-level tokens
    ("ï", "ï½", "｜"...), which the stream processor (it recognises `｜DSML｜` only as token
    128825) would read as plain text. The spec therefore names `｜DSML｜` as its `token_marker`.

    Raises:
        GrammarError: the tool list is not JSON, xgrammar rejects it, or a parameter schema
            uses a keyword that is not enforced.
    """
    if starts_in_tool_calls and not is_required:
        raise GrammarError("a prefilled tool-call block requires a required tool choice")
    try:
        tools = _with_strict_formats(json.loads(tools_json))
        tag = xgr.get_model_structural_tag(
            _TOOL_STRUCTURAL_TAG_MODEL,
            tools=tools,
            tool_choice="required" if is_required else "auto",
            reasoning="disabled",
            parallel_tool_calls=parallel_tool_calls,
            max_whitespace_cnt=json_whitespace,
        )
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid tool list for tool-call grammar: {exc}") from exc
    if starts_in_tool_calls:
        tag = st.StructuralTag(format=_without_calls_opening(tag.format))
    # In thinking mode, our own reasoning prefix: the builtin one ends reasoning at the *text*
    # "</think>", not at its token.
    source = _after_reasoning(tag.format) if thinking else tag.model_dump_json()
    return GrammarSpec("structural_tag", source, token_marker=DSML_MARKER)


def check_schema_keywords(schema: object, where: str = "schema") -> None:
    """Refuse a JSON schema that uses a keyword or format xgrammar would not enforce.

    Raises:
        GrammarError: naming the keyword, e.g. "schema: JSON Schema keyword 'uniqueItems'
            (at /properties/tags) is not supported".
    """
    message = unenforced_keyword(schema)
    if message is not None:
        raise GrammarError(f"{where}: {message}")


def _strict_schema_text(schema: str) -> str:
    """`schema` with `strict_formats` applied (unchanged if it is not valid JSON: the compiler
    reports that).

    Raises:
        GrammarError: a keyword that is not enforced (`check_schema_keywords`).
    """
    try:
        parsed = json.loads(schema)
    except ValueError:
        return schema
    check_schema_keywords(parsed)
    return json.dumps(strict_formats(parsed), ensure_ascii=False, separators=(",", ":"))


def _with_strict_formats(tools: object) -> object:
    """Chat-style tools with `strict_formats` applied to each function's parameters and, for
    tools not marked `strict: true`, the length bounds of their raw-string parameters dropped
    (`_without_raw_string_bounds`).

    Raises:
        GrammarError: `check_schema_keywords` on the parameters of a tool not marked
            `strict: false` (xgrammar enforces no schema for those: any JSON object).
    """
    if not isinstance(tools, list):
        return tools
    fixed = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
            parameters = function["parameters"]
            if function.get("strict") is not True:
                parameters = _without_raw_string_bounds(parameters)
            if function.get("strict") is not False:
                check_schema_keywords(parameters, f"tool {function.get('name')!r} parameters")
            parameters = strict_formats(parameters)
            function = {**function, "parameters": parameters}
            tool = {**tool, "function": function}
        fixed.append(tool)
    return fixed


def _without_raw_string_bounds(parameters: dict) -> dict:
    """`parameters` without `minLength` / `maxLength` on its top-level string properties.

    NOTE: DSML writes a string parameter raw (`string="true"`), and xgrammar 0.2 expands a
    length bound there into one grammar rule per allowed character, each with its own token
    mask: `maxLength: 256` alone took ~13 s to compile on 2 cores, and coding agents send such
    bounds on every turn. For a tool that is not strict (OpenAI: adherence not guaranteed) the
    bound is left to the client's validation; a `strict: true` tool keeps it and pays the
    compilation (about 0.4 s for `maxLength: 10`, 2.4 s for 40 on 2 cores).
    Strings nested in object / array parameters are JSON inside the parameter and keep theirs.
    """
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return parameters
    unbounded = {
        name: (
            {k: v for k, v in prop.items() if k not in ("minLength", "maxLength")}
            if isinstance(prop, dict) and prop.get("type") == "string"
            else prop
        )
        for name, prop in properties.items()
    }
    return {**parameters, "properties": unbounded}


def _without_calls_opening(required: st.Format) -> st.Format:
    """The required-call format minus its leading `...<｜DSML｜ calls>\n` constant."""
    elements = getattr(required, "elements", None)
    opening = elements[0] if elements else None
    if not isinstance(opening, st.ConstStringFormat) or not opening.value.endswith(CALLS_OPENING):
        raise GrammarError(
            "unexpected deepseek_v4_1 structural tag layout: a required tool call does not "
            f"start with {CALLS_OPENING!r}"
        )
    return st.SequenceFormat(elements=elements[1:])


def _content_format(kind: str, source: str, json_whitespace: int) -> st.Format:
    if kind == "json":
        try:
            schema = json.loads(source or _ANY_JSON_OBJECT)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: not valid JSON ({exc})") from exc
        check_schema_keywords(schema)
        return st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=json_whitespace)
    if kind == "regex":
        return st.RegexFormat(pattern=source)
    return st.GrammarFormat(grammar=source)


def _after_reasoning(content: st.Format) -> str:
    """Structural tag: any tokens but `<think>`, then the `</think>` token, then `content`.

    NOTE: `</think>` is matched as its dedicated token (128822), which is how the stream
    processor recognises the end of reasoning; a textual spelling from sub-tokens stays reasoning.
    """
    tag = st.StructuralTag(
        format=st.SequenceFormat(
            elements=[
                st.AnyTokensFormat(exclude_tokens=[THINK_BEGIN, THINK_END]),
                st.TokenFormat(token=THINK_END),
                content,
            ]
        )
    )
    return tag.model_dump_json()


# ----------------------------------------------------------------------------------------------
# Compiler
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MarkerGuard:
    """Makes a marker's dedicated token the only way to spell the marker.

    Wherever a row's bitmask allows `marker_id`, the tokens in `blocked_ids` (ordinary tokens
    whose bytes end with a proper prefix of the marker's bytes: the only ways to start spelling
    it from sub-tokens) are disallowed. Where the grammar requires the marker, only its token is
    left; in free text the cost is that such tokens (e.g. a lone "｜") cannot follow.

    keep_words: (word index, int32 mask of the bits to keep) for the words holding blocked ids.
    """

    marker_id: int
    blocked_ids: tuple[int, ...]
    keep_words: tuple[tuple[int, int], ...]

    @classmethod
    def for_marker(cls, tokenizer_info: xgr.TokenizerInfo, marker: str) -> MarkerGuard:
        """The guard for `marker` in this vocabulary.

        Raises:
            GrammarError: `marker` is not exactly one token of the vocabulary.
        """
        vocab = tokenizer_info.decoded_vocab  # NOTE: ~0.4 s per read for 129K tokens
        spelling = marker.encode()
        if vocab.count(spelling) != 1:
            raise GrammarError(f"marker {marker!r} is not a single token of this vocabulary")
        marker_id = vocab.index(spelling)
        prefixes = tuple(spelling[:k] for k in range(1, len(spelling)))
        blocked = tuple(
            i for i, token in enumerate(vocab) if i != marker_id and token.endswith(prefixes)
        )
        return cls(marker_id=marker_id, blocked_ids=blocked, keep_words=_keep_words(blocked))


@dataclass(frozen=True, eq=False)
class TokenBlock:
    """Tokens a constrained request never samples, whatever its grammar allows: the special and
    added tokens (`<｜place▁holder▁no▁706｜>`, `<｜User｜>`...) that xgrammar would otherwise
    take for their literal spelling inside a JSON string, a tool argument or a regex.

    words / keep: `[n]` long word indices and `[n]` int32 masks of the bits to keep there
    (host tensors, for one vectorised AND per step).
    """

    blocked_ids: tuple[int, ...]
    words: torch.Tensor
    keep: torch.Tensor

    @classmethod
    def of(cls, token_ids: Iterable[int]) -> TokenBlock:
        blocked = tuple(sorted(set(token_ids)))
        keep_words = _keep_words(blocked)
        return cls(
            blocked_ids=blocked,
            words=torch.tensor([word for word, _ in keep_words], dtype=torch.long),
            keep=torch.tensor([keep for _, keep in keep_words], dtype=torch.int32),
        )

    def apply(self, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Clear the blocked tokens' bits in `bitmask[rows]` (rows: long tensor), in place."""
        index = rows.unsqueeze(1)
        bitmask[index, self.words] = bitmask[index, self.words] & self.keep


def _keep_words(token_ids: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """(word index, int32 mask of the bits to keep) for the bitmask words holding `token_ids`."""
    clear: dict[int, int] = {}
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        clear[word] = clear.get(word, 0) | (1 << bit)
    return tuple((word, _as_int32(~bits & 0xFFFFFFFF)) for word, bits in sorted(clear.items()))


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def build_tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`: the encoded vocabulary padded to the model's
    `vocab_size` (the logits width), the vocabulary type (byte-level BPE for DeepSeek, detected
    from the tokenizer JSON) and the stop tokens.

    NOTE: added tokens keep their literal spelling (`</think>`, `｜DSML｜`), so grammars may match
    them by text or, through `TokenFormat`, by id. Ids beyond the tokenizer's vocabulary are
    empty strings, which xgrammar never allows.
    """
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A compiled grammar ready for requests: what `AsyncEngine.generate` takes as `constraint`.

    Immutable and shared by every request of the same spec; each request gets its own
    `RequestMatcher` from `new_matcher`.
    """

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar
    guard: MarkerGuard | None
    block: TokenBlock | None = None

    @property
    def vocab_size(self) -> int:
        return self.grammar.tokenizer_info.vocab_size

    def new_matcher(self) -> RequestMatcher:
        from engine.structured.matcher import RequestMatcher

        return RequestMatcher(self.grammar, self.guard, self.block)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; an LRU of `cache_size` compiled grammars.

    `compile` blocks; `compile_async` runs the compilation in a daemon worker thread so the
    event loop keeps serving, and joins an identical compilation already in flight.
    Thread-safe.

    At most `max_compilations` compilations run at once (each on `compile_threads` xgrammar
    threads). A compilation that times out cannot be interrupted (xgrammar has no
    cancellation): it finishes in its thread, keeping its slot, and its result still enters the
    cache. Requests for the same spec meanwhile wait on that one compilation instead of
    starting another; a request that finds no free slot within its timeout gets
    `GrammarCompilerBusyError`.

    added_tokens: id -> spelling of the tokenizer's special and added tokens; a constraint
    blocks every one of them but the stop tokens and those its source names literally
    (`</think>`, `｜DSML｜` in the structural tags; a regex or EBNF may name others).
    """

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        added_tokens: Mapping[int, str] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_compilations: int = DEFAULT_MAX_COMPILATIONS,
        compile_threads: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        if cache_size < 1 or max_compilations < 1 or compile_threads < 1:
            raise ValueError(
                "cache_size, max_compilations and compile_threads must be >= 1, got "
                f"{cache_size}, {max_compilations}, {compile_threads}"
            )
        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=compile_threads, cache_enabled=False
        )
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._in_flight: dict[GrammarSpec, threading.Event] = {}
        self._errors: dict[GrammarSpec, GrammarError] = {}
        self._guards: dict[str, MarkerGuard] = {}
        stop_ids = set(tokenizer_info.stop_token_ids)
        self._added_tokens = {
            token_id: text
            for token_id, text in (added_tokens or {}).items()
            if token_id not in stop_ids and token_id < tokenizer_info.vocab_size
        }
        self._blocks: dict[tuple[int, ...], TokenBlock] = {}
        self._slots = threading.BoundedSemaphore(max_compilations)
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int, **kwargs: int
    ) -> GrammarCompiler:
        """A compiler for `tokenizer` with logits width `vocab_size` and EOS as the stop token;
        its added tokens are blocked in constrained output (see the class docstring)."""
        added = {i: token.content for i, token in tokenizer.get_added_tokens_decoder().items()}
        info = build_tokenizer_info(tokenizer, vocab_size, [eos_token_id])
        return cls(info, added_tokens=added, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def guard_for(self, spec: GrammarSpec) -> MarkerGuard | None:
        """The `MarkerGuard` a matcher of `spec` needs, or None (computed once per marker).

        Raises:
            GrammarError: the spec's marker is not a single token of this vocabulary.
        """
        if spec.token_marker is None:
            return None
        return self.marker_guard(spec.token_marker)

    def marker_guard(self, marker: str) -> MarkerGuard:
        """The `MarkerGuard` of `marker`, computed on first use (~0.5 s for the V4.1
        vocabulary, holding the interpreter lock: call it before serving for the markers the
        specs will name, as the server does for `DSML_MARKER`).

        Raises:
            GrammarError: `marker` is not a single token of this vocabulary.
        """
        with self._lock:
            guard = self._guards.get(marker)
        if guard is None:
            guard = MarkerGuard.for_marker(self.tokenizer_info, marker)
            with self._lock:
                self._guards[marker] = guard
        return guard

    @property
    def prepared_markers(self) -> frozenset[str]:
        """The markers whose guards are computed."""
        with self._lock:
            return frozenset(self._guards)

    def block_for(self, spec: GrammarSpec) -> TokenBlock | None:
        """The added tokens a matcher of `spec` must never allow (None: none to block): all but
        the stop tokens and those whose spelling `spec.source` contains."""
        blocked = tuple(i for i, text in self._added_tokens.items() if text not in spec.source)
        if not blocked:
            return None
        with self._lock:
            block = self._blocks.get(blocked)
            if block is None:
                block = self._blocks[blocked] = TokenBlock.of(blocked)
            return block

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The cached grammar for `spec` (marking it recently used), or None. Mutates LRU order."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
            return grammar

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled now (blocking; does not
        take a compilation slot).

        Raises:
            GrammarError: the source is invalid or uses an unsupported feature.
        """
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        grammar = self._compile_uncached(spec)
        with self._lock:
            self._cache[spec] = grammar
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, spec: GrammarSpec) -> CompiledConstraint:
        """`compile` plus the spec's guard, bundled for the engine (blocking).

        Raises:
            GrammarError: as `compile` and `guard_for`.
        """
        return CompiledConstraint(
            spec, self.compile(spec), self.guard_for(spec), self.block_for(spec)
        )

    async def constraint_async(
        self, spec: GrammarSpec, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> CompiledConstraint:
        """`compile_async` plus the spec's guard, bundled for the engine.

        Raises:
            GrammarError: as `compile_async` (GrammarCompilerBusyError included).
        """
        grammar = await self.compile_async(spec, timeout_s)
        return CompiledConstraint(spec, grammar, self.guard_for(spec), self.block_for(spec))

    async def compile_async(
        self, spec: GrammarSpec, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> xgr.CompiledGrammar:
        """`compile` in a worker thread, waiting at most `timeout_s` seconds in all.

        Raises:
            GrammarCompilerBusyError: no compilation slot came free within `timeout_s`.
            GrammarError: invalid source, or compilation took longer than `timeout_s`.
        """
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        with self._lock:
            error = self._errors.get(spec)
        if error is not None:
            raise error
        deadline = time.monotonic() + timeout_s
        done = await self._join_or_start(spec, timeout_s)
        waiter = asyncio.get_running_loop().run_in_executor(
            None, done.wait, max(0.0, deadline - time.monotonic())
        )
        if not await waiter:
            raise GrammarError(
                f"{_KIND_NAMES[spec.kind]} compilation exceeded the {timeout_s:g} s timeout; "
                "simplify it"
            )
        with self._lock:
            error = self._errors.get(spec)
        if error is not None:
            raise error
        return self.compile(spec)

    async def _join_or_start(self, spec: GrammarSpec, timeout_s: float) -> threading.Event:
        """The event of `spec`'s compilation in flight, or of one started now in a free slot."""
        with self._lock:
            done = self._in_flight.get(spec)
        if done is not None:
            return done
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._slots.acquire, True, timeout_s):
            raise GrammarCompilerBusyError(
                "the grammar compiler is busy with other compilations; retry later"
            )
        with self._lock:
            done = self._in_flight.get(spec)
            if done is not None:  # started by another request while this one waited
                self._slots.release()
                return done
            done = threading.Event()
            self._in_flight[spec] = done
        thread = threading.Thread(target=self._compile_in_thread, args=(spec, done), daemon=True)
        _start_compile_thread(thread)
        return done

    def _compile_in_thread(self, spec: GrammarSpec, done: threading.Event) -> None:
        try:
            self.compile(spec)
        except GrammarError as exc:
            with self._lock:
                self._errors[spec] = exc
                while len(self._errors) > self._cache_size:
                    del self._errors[next(iter(self._errors))]
        finally:
            with self._lock:
                del self._in_flight[spec]
            self._slots.release()
            done.set()
            _compile_thread_done()

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compile_fn = _COMPILE_BY_KIND[spec.kind]
        try:
            return compile_fn(self._compiler, spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors
            raise GrammarError(f"invalid {_KIND_NAMES[spec.kind]}: {_clean_message(exc)}") from exc


# xgrammar (0.2.9) spells a JSON string with minLength / maxLength as `"` c{m,n} `"` over the
# character class below: raw control characters (a tab, U+0000) allowed, invalid JSON that
# `json.loads` refuses, and no escapes. The replacement is the JSON string character of its own
# unbounded strings: any character but a control one, `"` or `\`, or an escape, each one
# character of the decoded string (what minLength / maxLength count).
_XGR_BOUNDED_STRING_CHARACTER = r"(([^\"\\\r\n]))"
_JSON_STRING_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" basic_escape))'


def _json_ebnf(json_format: st.JSONSchemaFormat) -> str:
    """The EBNF of one JSON-schema format (any style), its bounded strings valid JSON."""
    ebnf = str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=json_format)))
    return ebnf.replace(_XGR_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def _with_json_as_ebnf(node: object) -> object:
    """`node` (a structural-tag format tree) with every JSON-schema format as its `_json_ebnf`."""
    if isinstance(node, st.JSONSchemaFormat):
        return st.GrammarFormat(grammar=_json_ebnf(node))
    if isinstance(node, list):
        return [_with_json_as_ebnf(item) for item in node]
    if isinstance(node, pydantic.BaseModel):
        fields = type(node).model_fields
        return node.model_copy(update={k: _with_json_as_ebnf(getattr(node, k)) for k in fields})
    return node


def _compile_json(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    if not spec.source:
        # json_object: any object, extra properties allowed.
        return compiler.compile_json_schema(
            _ANY_JSON_OBJECT, strict_mode=False, max_whitespace_cnt=spec.json_whitespace
        )
    json_format = st.JSONSchemaFormat(
        json_schema=json.loads(spec.source), max_whitespace_cnt=spec.json_whitespace
    )
    return compiler.compile_grammar(_json_ebnf(json_format))


def _compile_structural_tag(
    compiler: xgr.GrammarCompiler, spec: GrammarSpec
) -> xgr.CompiledGrammar:
    tag = st.StructuralTag.model_validate_json(spec.source)
    return compiler.compile_structural_tag(_with_json_as_ebnf(tag))


_COMPILE_BY_KIND = {
    "json": _compile_json,
    "regex": lambda compiler, spec: compiler.compile_regex(spec.source),
    "ebnf": lambda compiler, spec: compiler.compile_grammar(spec.source),
    "structural_tag": _compile_structural_tag,
}
_KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regular expression",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}


def _clean_message(exc: Exception) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _NATIVE_ERROR_PREFIX.sub("", first_line)
