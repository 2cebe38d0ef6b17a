"""Public surface of the model package: the DeepSeek-V4.1 network, its checkpoints and loading."""

from engine.models.deepseek_v41.checkpoint_loader import (
    CheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    resolve_model_path,
)
from engine.models.deepseek_v41.checkpoint_writer import write_random_checkpoint
from engine.models.deepseek_v41.config import DeepseekV41Config, preset_config
from engine.models.deepseek_v41.loading import load_model
from engine.models.deepseek_v41.model import DeepseekV41ForCausalLM, Numerics, StepOutput
from engine.models.deepseek_v41.state import ModelState, StepBatch, ints_to_device, sequential_batch

__all__ = [
    "CheckpointError",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "Numerics",
    "LoadedCheckpoint",
    "ModelState",
    "StepBatch",
    "ints_to_device",
    "StepOutput",
    "load_checkpoint",
    "load_model",
    "preset_config",
    "resolve_model_path",
    "sequential_batch",
    "write_random_checkpoint",
]
