"""The reward stage: the spec's reward graph evaluated for every trajectory."""
from factory.reward.graph import MissingReward, node_inputs, reward_metrics
from factory.reward.stage import RewardStage

__all__ = ["MissingReward", "RewardStage", "node_inputs", "reward_metrics"]
