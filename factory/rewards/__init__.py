"""Factory's built-in reward functions, named in specs as `factory.rewards.<module>:<function>`.

They live in Factory's own namespace so that a user project's `rewards/` package (with a `math.py` of its
own, say) can never shadow them, nor they it. The stage that evaluates reward graphs is `factory.reward`.
"""
