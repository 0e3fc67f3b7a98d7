"""Reward functions in verl's ``custom_reward_function`` format (``reward.custom_reward_function.{path,name}``)."""
