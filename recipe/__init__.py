"""DeepSeek prompt/stream recipe over the `deepseek-recipe` package: request conversion for the
three protocols, injection-safe prompt encoding, and the engine-to-protocol stream bridge."""

from recipe.bridge import DONE, BridgeStep, ResponseBridge, StreamEvent
from recipe.constraints import OutputConstraint
from recipe.convert import PreparedRequest, Recipe, RecipeConfig
from recipe.errors import Protocol, RecipeError
from recipe.tokenizer import ModelTokenizer, load_tokenizer

__all__ = [
    "DONE",
    "BridgeStep",
    "ModelTokenizer",
    "OutputConstraint",
    "PreparedRequest",
    "Protocol",
    "Recipe",
    "RecipeConfig",
    "RecipeError",
    "ResponseBridge",
    "StreamEvent",
    "load_tokenizer",
]
