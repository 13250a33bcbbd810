"""Reward functions the GRPO tests name (``grpo.reward_funcs=grpo_rewards.even_tokens``):
importable because pytest puts tests/ on the path."""


def even_tokens(completions, completion_ids, **kwargs):
    """A synthetic verifiable task: the share of a completion's tokens with an even id
    (about 0.5 for a random model, 1.0 at best)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
