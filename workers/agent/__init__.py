"""The node agent: registers, heartbeats, runs the control plane's run plans, relays logs.

Copied to every node by bootstrap and run there as `python3 -m workers.agent`
from the node directory. Standard library only (README, "Design"): nodes have
no Django and may have no third-party packages at all.
"""

# The control plane upgrades agents that report an older version than its own.
VERSION = "1.2.2"  # 1.1: checkpoint reports and requests; 1.2: each job as its own user;
# 1.2.1: a run that ends spares the other runs of its job still going; 1.2.2: heartbeats
# from a thread of their own
