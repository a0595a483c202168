"""Job specs the end-to-end tests and the drills submit (plain Python: no Django)."""


def tiny_trainer_spec(team, *, nodes: int, gpus_per_node: int, **trainer) -> dict:
    """A `tiny` trainer job on synthetic data, in fp32 so that CPUs compute it exactly alike
    on every layout; `trainer` overrides its fields (steps, global_batch, seq_len...)."""
    return {
        "name": f"tiny-{nodes}x{gpus_per_node}",
        "team": getattr(team, "pk", team),
        "time_limit_s": 900,
        "trainer": {
            "preset": "tiny",
            "dataset": "synthetic",
            "steps": 10,
            "global_batch": 8,
            "seq_len": 32,
            "precision": "fp32",
            "checkpoint_every_steps": 5,
            "seed": 7,
            **trainer,
        },
        "resources": {"gpu_type": "H100", "nodes": nodes, "gpus_per_node": gpus_per_node},
        "placement": {"where": "owned"},
    }


def command_spec(team, argv: list[str], *, gpus: int = 1, name: str = "e2e", **extra) -> dict:
    """A command job of `gpus` GPUs on one owned node, its code in /tmp (on local and SSH
    nodes, this machine's disk)."""
    return {
        "name": name,
        "team": getattr(team, "pk", team),
        "time_limit_s": 600,
        "command": {"argv": argv, "path": "/tmp"},
        "resources": {"gpu_type": "H100", "gpus": gpus},
        "placement": {"where": "owned"},
        **extra,
    }
