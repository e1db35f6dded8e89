"""The rollout stage: chat format, tool-call parsing, generation engines and the multi-turn agent loop."""
from factory.rollout.agent import rollout, run_trajectory, sampling_from_spec
from factory.rollout.chat import ChatFormat
from factory.rollout.engine import Engine, Generation, Sampling, make_engine
from factory.rollout.parse import parse_tool_calls

__all__ = ["ChatFormat", "Engine", "Generation", "Sampling", "make_engine", "parse_tool_calls", "rollout",
           "run_trajectory", "sampling_from_spec"]
