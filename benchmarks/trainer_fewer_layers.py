"""The trainer (`python -m train.trainer`) on a built-in architecture cut to fewer decoder layers,
for benchmarks that launch it under torchrun (`loss_curves.py --layers N`):

    python -m torch.distributed.run ... benchmarks/trainer_fewer_layers.py --layers N TRAINER_ARGS

TRAINER_ARGS hold `--arch NAME`; this process registers NAME-Nl (`common.register_fewer_layers`,
as train_speed.py --layers does) and runs the trainer with `--arch NAME-Nl`.
"""

from __future__ import annotations

import sys

from common import register_fewer_layers


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--layers" or "--arch" not in argv:
        raise SystemExit("usage: trainer_fewer_layers.py --layers N TRAINER_ARGS (with --arch NAME)")
    layers, rest = int(argv[1]), list(argv[2:])
    at = rest.index("--arch") + 1
    rest[at] = register_fewer_layers(rest[at], layers)
    from train.trainer import main as trainer_main

    return trainer_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
