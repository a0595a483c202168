"""Where nodes come from: local processes, SSH hosts (paramiko), AWS (boto3).

`interface` holds the one interface and its dataclasses, `errors` the exceptions;
`local`, `ssh` and `aws` implement it. None of them imports Django.
"""
