"""The reward stage: the spec's reward graph evaluated for every trajectory."""
from factory.reward.graph import node_inputs, topological_order, training_node
from factory.reward.stage import RewardStage

__all__ = ["RewardStage", "node_inputs", "topological_order", "training_node"]
