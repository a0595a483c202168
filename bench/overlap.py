"""Could the optimizer's update hide under the next step's forward? A probe on one GPU.

The trainer's step on the `1b` shape spends about 15 ms of 238 (H100) in fused AdamW,
a memory-bound pass over every parameter's weight, gradient and two moments. The
update of block i is needed only when block i's forward starts, so it could run on a
second stream beside the forward's matrix products. That gains only if the GPU runs
the two at once. This probe measures that before any trainer code is written for it:

- `forward`: the forward matrix products of the `1b` preset's 22 blocks at batch 8 ×
  2048 tokens (q, k, v, o, gate, up, down), bf16, on the default stream;
- `update`: fused AdamW over fp32 parameters of the preset's size (1.1 billion, 24
  tensors a block's worth each), gradients present, on a second stream;
- `both`: the two launched together, each on its own stream; `both_prioritised` the
  same with the forward on a stream of the greatest priority.

Each is the median of --repeats timed runs after a warm-up. The last line:

    overlap: forward_ms=<x> update_ms=<x> both_ms=<x> hidden_ms=<x> hidden_fraction=<x>
             both_prioritised_ms=<x>                                  (on one line)

hidden_ms = forward + update − both: how much of the update the forward hid. Needs
python3 and torch with a CUDA GPU; without one it says so and exits.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.trainer.presets import PRESETS  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bench.overlap: needs a CUDA GPU")
        return 1
    shape = PRESETS[args.preset]
    device = torch.device("cuda")
    d, kv, ffn = shape.dim, shape.kv_heads * shape.head_dim, shape.ffn_dim
    x = torch.randn(args.tokens, d, device=device, dtype=torch.bfloat16)
    h = torch.randn(args.tokens, ffn, device=device, dtype=torch.bfloat16)
    weights = [
        torch.randn(out, inp, device=device, dtype=torch.bfloat16) * 0.02
        for out, inp in ((d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn))
    ]

    def forward() -> None:
        for _ in range(shape.layers):
            for weight in weights[:6]:
                torch.nn.functional.linear(x, weight)
            torch.nn.functional.linear(h, weights[6])

    per_block = 2 * d * d + 2 * kv * d + 3 * ffn * d
    params = [
        torch.nn.Parameter(torch.randn(per_block, device=device) * 0.02)
        for _ in range(shape.layers + 2)
    ]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()  # the moments exist from here on, as after a trainer's first step
    # (least, greatest) priority: the default stream has the least; a forward on a stream
    # of the greatest runs its blocks first wherever both wait for the same multiprocessors.
    low, high = torch.cuda.Stream.priority_range()
    side = torch.cuda.Stream(priority=low)
    main_stream = torch.cuda.Stream(priority=high)

    def update() -> None:
        with torch.cuda.stream(side):
            optimizer.step()

    def prioritised_forward() -> None:
        with torch.cuda.stream(main_stream):
            forward()

    def timed(*work) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for run in work:
            run()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1000

    figures = {}
    runs = {
        "forward": (forward,),
        "update": (update,),
        "both": (update, forward),
        "both_prioritised": (update, prioritised_forward),
    }
    for name, work in runs.items():
        for _ in range(3):
            timed(*work)
        figures[name] = statistics.median(timed(*work) for _ in range(args.repeats))
    hidden = figures["forward"] + figures["update"] - figures["both"]
    name = torch.cuda.get_device_name()
    print(
        f"bench.overlap: torch {torch.__version__}, {name}; {args.preset}, {args.tokens} tokens, "
        f"{sum(p.numel() for p in params) / 1e9:.2f} B parameters; stream priorities {low}..{high}"
    )
    print(
        f"overlap: forward_ms={figures['forward']:.2f} update_ms={figures['update']:.2f} "
        f"both_ms={figures['both']:.2f} hidden_ms={hidden:.2f} "
        f"hidden_fraction={hidden / figures['update']:.2f} "
        f"both_prioritised_ms={figures['both_prioritised']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
