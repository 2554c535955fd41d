"""Train a vision-language model with pipeline x data (x tensor) parallelism and ppmedia's staged media.

A thin caller of :func:`ppmedia.train.main` (the options, the loop and what a run does are documented
there and in docs/training.md)::

    torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl \\
        --pp 2 --batch-size 4 --epochs 2 --lr 1e-3 --export trained
"""

from ppmedia.train import *  # noqa: F401,F403  (parse_args, build_parser, run, ... for callers that load this file)
from ppmedia.train import main

if __name__ == "__main__":
    main()
