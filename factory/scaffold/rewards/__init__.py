"""This project's reward functions (Factory's own built-ins live under `factory.rewards`, so this package
never hides them). The spec names a function by import path: `rewards.task:correct`."""
