"""Grammar-constrained decoding with xgrammar: specs, compilation, per-request matchers and the
batch token bitmask (`issues` #5, engine side)."""

from engine.structured.grammar import (
    DSML_MARKER,
    GRAMMAR_KINDS,
    CompiledConstraint,
    GrammarCompiler,
    GrammarCompilerBusyError,
    GrammarError,
    GrammarSpec,
    MarkerGuard,
    TokenBlock,
    build_tokenizer_info,
    spec_for_constraint,
    tool_call_spec,
)
from engine.structured.matcher import (
    BatchBitmask,
    RequestMatcher,
    StepMask,
    apply_bitmask,
    apply_bitmask_reference,
    unpack_bitmask_row,
)

__all__ = [
    "DSML_MARKER",
    "GRAMMAR_KINDS",
    "BatchBitmask",
    "CompiledConstraint",
    "GrammarCompiler",
    "GrammarCompilerBusyError",
    "GrammarError",
    "GrammarSpec",
    "MarkerGuard",
    "TokenBlock",
    "RequestMatcher",
    "StepMask",
    "apply_bitmask",
    "apply_bitmask_reference",
    "build_tokenizer_info",
    "spec_for_constraint",
    "tool_call_spec",
    "unpack_bitmask_row",
]
