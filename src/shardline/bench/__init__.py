"""`shardline bench ...`: each benchmark runs its baseline side by side and reports ratios, machine named."""
