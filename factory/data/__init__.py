"""Data-prep: sources (files, generators, prompt templates), built-in generators and the data stage."""
from factory.data.generators import arithmetic
from factory.data.sources import DataError, PromptRenderer, from_table, load_rows, to_table
from factory.data.stage import DataStage

__all__ = ["DataError", "DataStage", "PromptRenderer", "arithmetic", "from_table", "load_rows", "to_table"]
