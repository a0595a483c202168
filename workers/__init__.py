"""Everything that runs away from the web process: tasks, providers, the agent, the trainer."""
