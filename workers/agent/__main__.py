"""`python3 -m workers.agent [--dir NODE_DIR]`: run the node agent until SIGTERM."""

import argparse
import logging
from pathlib import Path

from workers.agent import agent, config


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m workers.agent")
    parser.add_argument("--dir", type=Path, default=None, help="the node directory (agent.env)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s agent: %(message)s"
    )
    agent.main(config.load(args.dir))


if __name__ == "__main__":
    main()
