"""Where nodes come from: local processes, SSH hosts (paramiko), AWS (boto3)."""
